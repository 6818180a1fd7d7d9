// The CUDA forward pass against the scalar double reference (SPEC §1, §6), the layouts:
// varlen with empty sequences, grouped heads, [V,K] and in-place state, double inputs.
// (Float and double only: tests/cuda/CMakeLists.txt cuts the other dtypes from this file.)
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "cuda_case.hpp"

using recattn::dtype;
using recattn_test::errors;
using recattn_test::instance;
using recattn_test::spec;
using recattn_test::tolerance;

namespace {

void check_case(const spec& s) {
  INFO(s.str());
  instance in(s);
  const errors e = in.check();
  INFO("output rel err " << e.output << ", state rel err " << e.state);
  CHECK(e.output_written);
  CHECK(e.output < tolerance(s.type));
  if (s.return_state) CHECK(e.state < tolerance(s.type));
}


}  // namespace

TEST_CASE("cuda forward: double inputs", "[cuda]") {
  for (unsigned gates : {0u, 5u, 15u}) {
    spec s;
    s.type = dtype::float64;
    s.gate_type = gates == 15u ? dtype::float32 : dtype::float64;
    s.gates = gates;
    s.T = 30;
    s.K = 40;
    s.V = 24;
    s.initial_state = true;
    s.reverse = gates == 5u;
    s.seed = 400 + gates;
    check_case(s);
  }
}

TEST_CASE("cuda forward: varlen with empty sequences", "[cuda]") {
  std::uint64_t seed = 500;
  for (bool int32 : {false, true})
    for (bool on_device : {true, false})
      for (bool reverse : {false, true})
        for (unsigned gates : {0u, 3u, 6u, 15u}) {
          spec s;
          s.type = dtype::float32;
          s.gates = gates;
          s.cu = {0, 0, 5, 5, 40, 41, 41, 100};
          s.cu_int32 = int32;
          s.cu_on_device = on_device;
          s.B = 1;
          s.T = 100;
          s.Hq = s.Hk = s.Hv = 3;
          s.K = 32;
          s.V = 40;
          s.initial_state = true;
          s.gamma_per_seq = gates == 15u;
          s.reverse = reverse;
          s.seed = seed++;
          check_case(s);
        }
}

TEST_CASE("cuda forward: grouped heads", "[cuda]") {
  const std::int64_t heads[][3] = {{4, 2, 2}, {4, 1, 1}, {1, 1, 4}, {2, 2, 4}, {4, 2, 1}};
  std::uint64_t seed = 600;
  for (auto& hh : heads)
    for (unsigned gates : {0u, 4u, 9u}) {
      spec s;
      s.type = dtype::float32;
      s.gates = gates;
      s.Hq = hh[0];
      s.Hk = hh[1];
      s.Hv = hh[2];
      s.K = 48;
      s.V = 32;
      s.initial_state = true;
      s.seed = seed++;
      check_case(s);
    }
}

TEST_CASE("cuda forward: [V, K] state layout and in-place state", "[cuda]") {
  std::uint64_t seed = 700;
  for (auto layout : {recattn::state_layout::kv, recattn::state_layout::vk})
    for (bool alias : {false, true})
      for (dtype t : {dtype::float32, dtype::float64}) {
        spec s;
        s.type = t;
        s.gates = recattn::gate_gk | recattn::gate_g_gamma;
        s.layout = layout;
        s.initial_state = true;
        s.alias_state = alias;
        s.K = 40;
        s.V = 72;
        s.seed = seed++;
        check_case(s);
      }
}
