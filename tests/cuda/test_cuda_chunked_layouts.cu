// The chunked CUDA forward (issue 8) on the layouts: varlen with empty sequences and
// lengths not a multiple of the chunk (int32 and int64 offsets, host or device), both
// directions, grouped heads (GQA, GVA), initial and final state (also in place), the [V,K]
// state layout; bfloat16 (half is in test_cuda_chunked.cu: the kernel is the same code for
// both, the dtype only changes the 16-bit operand format). Each case is compared with the
// CPU double reference and with the recurrent CUDA kernel.
#include <catch2/catch.hpp>

#include <vector>

#include "chunked_check.hpp"

using recattn::dtype;
using recattn_test::require_agreement;
using recattn_test::spec;

TEST_CASE("cuda chunked: varlen with empty sequences, both directions, [K,V] and [V,K]", "[cuda][chunked]") {
  const std::vector<std::int64_t> cus[] = {
      {0, 0, 70, 70, 200, 263, 263},  // empty first, middle and last; lengths 70, 130, 63
      {0, 1, 65, 129, 400},           // 1, a chunk + 1, exactly 64, 271
      {0, 300},                       // one sequence
      {0, 0, 0, 17},                  // two empty sequences (final state = initial state), then 17
  };
  std::uint64_t seed = 1000;
  for (const auto& cu : cus)
    for (unsigned gates : {0u, unsigned(recattn::gate_g), unsigned(recattn::gate_g | recattn::gate_g_gamma),
                           unsigned(recattn::gate_gk), unsigned(recattn::gate_g | recattn::gate_gk),
                           unsigned(recattn::gate_gv), unsigned(recattn::gate_gk | recattn::gate_gv)})
      for (bool reverse : {false, true})
        for (auto layout : {recattn::state_layout::kv, recattn::state_layout::vk}) {
          spec s;
          s.type = dtype::bfloat16;
          s.gate_type = (seed & 1) ? dtype::bfloat16 : dtype::float32;
          s.gates = gates;
          s.reverse = reverse;
          s.layout = layout;
          s.B = 1;
          s.cu = cu;
          s.T = cu.back();
          s.cu_int32 = (seed & 2) != 0;
          s.cu_on_device = (seed & 4) != 0;
          s.Hq = s.Hk = s.Hv = 2;
          s.K = 40;
          s.V = 72;  // two value blocks of 64, or more of 32 / 16
          s.initial_state = (seed % 3) != 0;
          s.gamma_per_seq = (seed & 8) != 0;
          s.seed = seed++;
          require_agreement(s, (seed & 16) ? 32 : 64, (seed % 5 == 0) ? 16 : 0);
        }
}

TEST_CASE("cuda chunked: grouped heads, in-place state, [V,K]", "[cuda][chunked]") {
  struct heads {
    std::int64_t q, k, v;
  };
  const heads hs[] = {{4, 2, 2}, {4, 1, 1}, {2, 2, 4}, {1, 1, 4}, {4, 4, 2}};
  std::uint64_t seed = 1200;
  for (const heads& hd : hs)
    for (bool vk : {false, true})
      for (bool alias : {false, true}) {
        spec s;
        s.type = dtype::bfloat16;
        s.gate_type = dtype::float32;
        s.gates = recattn::gate_g | ((seed & 1) ? recattn::gate_g_gamma : 0u) | ((seed & 4) ? recattn::gate_gk : 0u) |
                  ((seed % 5) < 2 ? recattn::gate_gv : 0u);
        s.reverse = (seed & 2) != 0;
        s.B = 2;
        s.T = 140;
        s.Hq = hd.q;
        s.Hk = hd.k;
        s.Hv = hd.v;
        s.K = 64;
        s.V = 48;
        s.layout = vk ? recattn::state_layout::vk : recattn::state_layout::kv;
        s.initial_state = true;
        s.alias_state = alias;
        if (seed % 3 == 0) {
          s.cu = {0, 0, 100, 280};
          s.B = 1;
          s.T = 280;
        }
        s.seed = seed++;
        require_agreement(s);
      }
}

TEST_CASE("cuda chunked: sequence splits with the [V,K] state", "[cuda][chunked]") {
  // Splits (the split-state pass writes its slots, the combine scans them, in the state
  // layout) with [V,K]: scalar decays, gk (a factor per key channel), both; with and without
  // an initial state, the final state over the initial one.
  std::uint64_t seed = 1400;
  for (unsigned gates : {unsigned(recattn::gate_g), unsigned(recattn::gate_gk),
                         unsigned(recattn::gate_g | recattn::gate_g_gamma | recattn::gate_gk)})
    for (int splits : {2, 5}) {
      spec s;
      s.type = dtype::bfloat16;
      s.gate_type = dtype::float32;
      s.gates = gates;
      s.layout = recattn::state_layout::vk;
      s.reverse = (seed & 1) != 0;
      s.initial_state = (seed & 2) != 0;
      s.alias_state = s.initial_state && splits == 5;
      s.B = 2;
      s.T = 1000;
      s.Hq = s.Hk = s.Hv = 2;
      s.K = 72;
      s.V = 40;
      s.seed = seed++;
      require_agreement(s, 0, 0, splits);
    }
}
