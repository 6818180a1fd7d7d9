// The chunked CUDA forward (issue 8) on dense inputs: all 16 gate combinations (none, g,
// g_gamma, gk, gv and their unions) x both directions x bfloat16 and half; K and V of odd
// sizes up to 256; T shorter than a chunk, not a multiple of it, T = 1; strong, underflowing
// (-inf) and positive decays, scalar, per key channel and per value column; T = 65536;
// sequence splits (without gv); every chunked candidate cfg; the dispatcher's choice; and the
// rejection of what the chunked kernel does not take (float, double, splits with gv). Each
// case is compared with the CPU double reference and with the recurrent CUDA kernel.
// Varlen, grouped heads and the [V,K] state are in test_cuda_chunked_layouts.cu.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <utility>
#include <vector>

#include "chunked_check.hpp"

using recattn::algorithm;
using recattn::dtype;
using recattn_test::algo_cfg;
using recattn_test::expect_chunked_rejected;
using recattn_test::instance;
using recattn_test::require_agreement;
using recattn_test::spec;

namespace {

const dtype mma_types[] = {dtype::bfloat16, dtype::float16};
constexpr unsigned g_ = recattn::gate_g, gg_ = recattn::gate_g_gamma, gk_ = recattn::gate_gk, gv_ = recattn::gate_gv;
/// The gate combinations without gv (the split pass takes these).
const unsigned key_gates[] = {0u, g_, gg_, g_ | gg_, gk_, g_ | gk_, gg_ | gk_, g_ | gg_ | gk_};
/// All 16.
const unsigned all_gates[] = {0u,  g_,       gg_,       g_ | gg_,       gk_,       g_ | gk_,       gg_ | gk_,       g_ | gg_ | gk_,
                              gv_, g_ | gv_, gg_ | gv_, g_ | gg_ | gv_, gk_ | gv_, g_ | gk_ | gv_, gg_ | gk_ | gv_, g_ | gg_ | gk_ | gv_};

/// A case of the per-channel and per-column decay loops: B2 T200 H2 K40 V24 with an initial
/// state; the gate dtype, direction and gamma layout drawn from the seed; g (when present) in
/// [-1, 0].
spec decay_case(dtype t, unsigned gates, std::uint64_t seed) {
  spec s;
  s.type = t;
  s.gate_type = (seed & 8) ? t : dtype::float32;
  s.gates = gates;
  if (gates & g_) s.scalar_range = std::make_pair(-1.0, 0.0);
  s.B = 2;
  s.T = 200;
  s.Hq = s.Hk = s.Hv = 2;
  s.K = 40;
  s.V = 24;
  s.reverse = (seed & 1) != 0;
  s.initial_state = true;
  s.gamma_per_seq = (seed & 2) != 0;
  s.seed = seed;
  return s;
}

/// A case of the exact-zero (-inf) decay loops: T300, V40, K = 144 for every = 7 (two state row
/// tiles a warp) else 40, an initial state, reverse for every = 37.
spec neg_inf_case(dtype t, unsigned gates, int every, std::uint64_t seed) {
  spec s;
  s.type = t;
  s.gate_type = t;
  s.gates = gates;
  s.T = 300;
  s.K = every == 7 ? 144 : 40;
  s.V = 40;
  s.initial_state = true;
  s.reverse = every == 37;
  s.seed = seed;
  return s;
}

recattn::problem problem_of(instance& in) {
  recattn::forward_outputs outs{in.out.dev_mview(), std::nullopt};
  if (in.s.return_state) outs.final_state = in.ht.dev_mview();
  return recattn::make_problem(in.q.dev_view(), in.k.dev_view(), in.v.dev_view(), in.options(true), &outs);
}

}  // namespace

TEST_CASE("cuda chunked: all 16 gate combinations, both directions, bf16 and half", "[cuda][chunked]") {
  std::uint64_t seed = 10;
  for (dtype t : mma_types)
    for (unsigned gates : all_gates)
      for (bool reverse : {false, true})
        for (int chunk : {32, 64}) {
          spec s;
          s.type = t;
          s.gate_type = (seed & 1) ? t : dtype::float32;
          s.gates = gates;
          s.reverse = reverse;
          s.B = 2;
          s.T = 150;  // 2 full chunks of 64 and a partial one; 4 of 32 and a partial one
          s.Hq = s.Hk = s.Hv = 2;
          s.K = 24;
          s.V = 20;
          s.initial_state = (seed & 2) != 0;
          s.gamma_per_seq = (seed & 4) != 0;
          s.seed = seed++;
          require_agreement(s, chunk);
        }
}

TEST_CASE("cuda chunked: K and V of odd sizes up to 256, short sequences", "[cuda][chunked]") {
  const std::int64_t sizes[][2] = {{16, 16}, {24, 100}, {64, 64}, {100, 24}, {128, 128}, {256, 256}, {256, 16}, {16, 256}, {100, 256}};
  std::uint64_t seed = 200;
  for (dtype t : mma_types)
    for (const auto& kv : sizes)
      for (std::int64_t T : {1, 37, 130}) {
        spec s;
        s.type = t;
        s.gate_type = t;
        const unsigned by_seed[] = {0u, g_ | gg_, gk_, g_ | gk_, gv_, gk_ | gv_};
        s.gates = by_seed[seed % 6];
        s.reverse = (seed & 1) != 0;
        s.B = 1;
        s.T = T;
        s.Hq = s.Hk = s.Hv = 2;
        s.K = kv[0];
        s.V = kv[1];
        s.initial_state = true;
        s.pad = (seed % 3 == 0) ? 3 : 0;  // strided rows (odd pitch: plain loads)
        s.seed = seed++;
        const bool gk_wide = (s.gates & gk_) && s.K > 128;  // gk with K > 128: chunks of 32
        require_agreement(s, seed % 2 && !gk_wide ? 64 : 32, 0);
      }
  // Rows 8-byte aligned (padded to 40 and 48 elements) whose sizes are not multiples of 4:
  // the staging's 4-element loads end in a partial group.
  for (dtype t : mma_types)
    for (int bv : {16, 32, 64}) {
      spec s;
      s.type = t;
      s.gate_type = t;
      s.gates = recattn::gate_g;
      s.B = 2;
      s.T = 70;
      s.Hq = s.Hk = s.Hv = 1;
      s.K = 37;
      s.V = 45;
      s.pad = 3;
      s.initial_state = true;
      s.seed = seed++;
      require_agreement(s, 32, bv);
    }
}

TEST_CASE("cuda chunked: strong, mixed, positive and zero (-inf) decays", "[cuda][chunked]") {
  // ({-3, -1}: the factored mask with column factors near 2^43 on the diagonal tiles; {-6, 0}:
  // chunks on both sides of its 2^64 bound.)
  const std::pair<double, double> ranges[] = {{-20.0, -5.0}, {-6.0, 0.0}, {-3.0, -1.0}, {-1.0, 0.8}, {-0.2, 0.0}, {-40.0, 0.5}};
  std::uint64_t seed = 400;
  for (dtype t : mma_types)
    for (unsigned gates : {unsigned(recattn::gate_g), unsigned(recattn::gate_g_gamma),
                           unsigned(recattn::gate_g | recattn::gate_g_gamma)})
      for (const auto& r : ranges) {
        if ((gates & recattn::gate_g_gamma) && r.second > 0.0) continue;  // a constant growth overflows
        // Growing stretches of [-1, 0.8] take outputs past half's largest finite value (65504;
        // the recurrent kernel writes inf there too): bfloat16 covers growth.
        if (t == dtype::float16 && r.second > 0.0) continue;
        spec s = decay_case(t, gates, seed++);  // (its shape; the gates in the input dtype, the range r)
        s.gate_type = t;
        s.scalar_range = r;
        require_agreement(s, (seed & 4) ? 32 : 64);
      }
  // Decays of exactly 0 (g = -inf) between ordinary ones: inside chunks, at their first and
  // last tokens (every 37th token over 300 meets every position class of chunks of 32, 64).
  for (dtype t : mma_types)
    for (int every : {1, 2, 37, 64}) {
      spec s;
      s.type = t;
      s.gate_type = t;
      s.gates = recattn::gate_g | (every == 2 ? recattn::gate_g_gamma : 0u);
      s.scalar_range = std::make_pair(-3.0, 0.0);
      s.neg_inf_every = every;
      s.T = 300;
      s.initial_state = true;
      s.reverse = every == 37;
      s.seed = seed++;
      require_agreement(s, every == 64 ? 64 : 32);
    }
  // Per-channel decays (gk, alone and with g): strong ones (every diagonal tile takes the
  // elementwise fallback), mixed, weak, growing (bfloat16), very strong with growth.
  const std::pair<double, double> gk_ranges[] = {{-20.0, -5.0}, {-6.0, 0.0}, {-3.0, -1.0},
                                                 {-0.2, 0.0},   {-1.0, 0.8}, {-40.0, 0.5}};
  for (dtype t : mma_types)
    for (unsigned gates : {gk_, g_ | gk_, g_ | gg_ | gk_})
      for (const auto& r : gk_ranges) {
        if (t == dtype::float16 && r.second > 0.0) continue;  // (growth past half's range, as above)
        spec s = decay_case(t, gates, seed++);
        s.gk_range = r;
        require_agreement(s, (seed & 4) ? 32 : 64);
      }
  // gk of exactly 0 decay (-inf) in scattered channels and tokens (every n-th element), and
  // everywhere (each token starts afresh); K > 128 (two state row tiles a warp, chunks of 32).
  for (dtype t : mma_types)
    for (int every : {1, 7, 37, 64}) {
      spec s = neg_inf_case(t, gk_, every, seed++);
      s.gk_range = std::make_pair(-2.0, 0.0);
      s.gk_neg_inf_every = every;
      require_agreement(s, every == 64 ? 64 : 32);
    }
  // Per-column decays (gv alone, with gk, with g): strong ones (every diagonal tile past
  // 2^64 takes the elementwise sum), mixed, weak, growing (bfloat16), very strong with growth;
  // every value block width (the output warps' split, the state warps' V~ rows), forced (the
  // heuristic takes 16 columns for shapes this small).
  for (dtype t : mma_types)
    for (unsigned gates : {gv_, gk_ | gv_, g_ | gv_, g_ | gg_ | gk_ | gv_})
      for (const auto& r : gk_ranges) {
        if (t == dtype::float16 && r.second > 0.0) continue;  // (growth past half's range, as above)
        spec s = decay_case(t, gates, seed++);
        s.gv_range = r;
        if (gates & gk_) s.gk_range = std::make_pair(r.first / 2, std::min(0.0, r.second));
        s.V = (s.seed & 2) ? 24 : 72;
        const int block_v[] = {0, 16, 32, 64};
        require_agreement(s, (seed & 4) ? 32 : 64, block_v[seed % 4]);
      }
  // gv of exactly 0 decay (-inf) in scattered columns and tokens, and everywhere; with gk.
  for (dtype t : mma_types)
    for (int every : {1, 7, 37, 64}) {
      spec s = neg_inf_case(t, gv_ | (every == 7 ? gk_ : 0u), every, seed++);
      s.gv_range = std::make_pair(-2.0, 0.0);
      s.gv_neg_inf_every = every;
      require_agreement(s, every == 64 ? 64 : 32);
    }
}

TEST_CASE("cuda chunked: sequence splits (a state pass, the combine, the outputs in parallel)", "[cuda][chunked]") {
  // T = 1000: splits of a multiple of 64 tokens; 2, 3 and 7 splits (the last one short), and
  // more splits asked than there are 64-token units. Every gate set without gv (splits do not
  // take gv: below), both directions, both chunk lengths, with and without an initial state,
  // bf16 and half ([V,K]: in test_cuda_chunked_layouts.cu, this unit is compiled without it).
  std::uint64_t seed = 900;
  for (dtype t : mma_types)
    for (unsigned gates : key_gates)
      for (int splits : {2, 3, 7, 40}) {
        spec s;
        s.type = t;
        s.gate_type = (seed & 1) ? t : dtype::float32;
        s.gates = gates;
        s.reverse = (seed & 2) != 0;
        s.initial_state = (seed & 4) != 0;
        s.gamma_per_seq = (seed & 16) != 0;
        s.B = 2;
        s.T = 1000;
        s.Hq = s.Hk = s.Hv = 2;
        s.K = 72;
        s.V = 40;
        s.seed = seed++;
        require_agreement(s, (seed & 1) ? 32 : 64, 0, splits);
      }
  // Strong and zero decays across split boundaries, K > 128 (two state tiles a warp), and the
  // final state written over the initial one.
  const std::pair<double, double> ranges[] = {{-20.0, -5.0}, {-1.0, 0.5}, {-3.0, 0.0}};
  for (const auto& r : ranges)
    for (int every : {0, 64, 37}) {
      spec s;
      s.type = dtype::bfloat16;
      s.gate_type = dtype::float32;
      s.gates = recattn::gate_g;
      s.scalar_range = r;
      s.neg_inf_every = every;
      s.B = 1;
      s.T = 777;
      s.Hq = s.Hk = s.Hv = 2;
      s.K = 160;
      s.V = 64;
      s.initial_state = true;
      s.alias_state = every == 37;
      s.reverse = every == 64;
      s.seed = seed++;
      require_agreement(s, 64, 0, 4);
    }
  // gk across split boundaries (a decay factor per key channel), K = 72 and K = 160.
  for (const auto& r : {std::make_pair(-3.0, 0.0), std::make_pair(-20.0, -5.0)})
    for (std::int64_t K : {72, 160}) {
      spec s;
      s.type = dtype::bfloat16;
      s.gate_type = dtype::float32;
      s.gates = gk_ | (K == 72 ? g_ : 0u);
      s.gk_range = r;
      s.scalar_range = std::make_pair(-0.5, 0.0);
      s.B = 1;
      s.T = 777;
      s.Hq = s.Hk = s.Hv = 2;
      s.K = K;
      s.V = 48;
      s.initial_state = true;
      s.alias_state = K == 160;
      s.reverse = r.first < -10.0;
      s.seed = seed++;
      require_agreement(s, 0, 0, 4);
    }
  // The heuristic splits few long sequences (B1 H2: blocks fill a fraction of the SMs) and
  // not many short ones.
  spec s;
  s.type = dtype::bfloat16;
  s.gates = recattn::gate_g;
  s.B = 1;
  s.T = 8192;
  s.Hq = s.Hk = s.Hv = 2;
  s.K = s.V = 128;
  instance few(s);
  const recattn::cfg c = recattn::cuda::resolve_cfg(problem_of(few), std::nullopt);
  CHECK(c.algo == algorithm::chunked);
  CHECK(c.splits > 1);
  s.seed = seed++;
  require_agreement(s);  // the heuristic's cfg, splits included
  spec sv = s;
  sv.B = 1;
  sv.T = 3000;
  sv.cu = {0, 1000, 1000, 3000};
  instance varlen(sv);
  CHECK(recattn::cuda::resolve_cfg(problem_of(varlen), std::nullopt).splits == 1);
  expect_chunked_rejected([&] {
    spec x = sv;
    x.cfg = algo_cfg(algorithm::chunked, 0, 0, 2);
    return x;
  }(), "cfg.splits");
  expect_chunked_rejected([&] {
    spec x = s;
    x.cfg = algo_cfg(algorithm::recurrent, 0, 0, 3);
    return x;
  }(), "cfg.splits");
  // gv: the heuristic does not split (one block a sequence and head runs it), a forced split
  // is a recattn::Error.
  spec sg = s;
  sg.gates = gv_ | gk_;
  instance gv_few(sg);
  const recattn::cfg cg = recattn::cuda::resolve_cfg(problem_of(gv_few), std::nullopt);
  CHECK(cg.algo == algorithm::chunked);
  CHECK(cg.splits == 1);
  sg.seed = seed++;
  require_agreement(sg);
  expect_chunked_rejected([&] {
    spec x = sg;
    x.cfg = algo_cfg(algorithm::chunked, 0, 0, 2);
    return x;
  }(), "cfg.splits: expected 0 or 1 with gv");
}

TEST_CASE("cuda chunked: a long sequence, T = 65536", "[cuda][chunked][long]") {
  std::uint64_t seed = 600;
  for (unsigned gates : {0u, g_, gk_, gk_ | gv_}) {
    spec s;
    s.type = dtype::bfloat16;
    s.gate_type = dtype::float32;
    s.gates = gates;
    s.scalar_range = std::make_pair(-0.05, 0.0);
    s.gk_range = std::make_pair(-0.05, 0.0);
    s.gv_range = std::make_pair(-0.05, 0.0);
    s.B = 1;
    s.T = 65536;
    s.Hq = s.Hk = s.Hv = 1;
    s.K = s.V = 64;
    s.initial_state = true;
    s.seed = seed++;
    require_agreement(s);  // the heuristic's chunk and columns
  }
}

TEST_CASE("cuda chunked: every candidate configuration; the dispatcher's choice", "[cuda][chunked]") {
  spec s;
  s.type = dtype::bfloat16;
  s.gate_type = dtype::bfloat16;
  s.gates = recattn::gate_g | recattn::gate_g_gamma;
  s.B = 1;
  s.T = 300;
  s.Hq = s.Hk = s.Hv = 2;
  s.K = 128;
  s.V = 100;
  s.initial_state = true;
  instance probe(s);
  const recattn::problem p = problem_of(probe);
  const auto cands = recattn::RecurrentAttention(recattn::platform::cuda).candidate_cfgs(p);
  int chunked = 0;
  std::uint64_t seed = 700;
  for (const recattn::cfg& c : cands) {
    if (c.algo != algorithm::chunked) continue;
    ++chunked;
    spec sc = s;
    sc.seed = seed++;
    require_agreement(sc, c.chunk, c.block_v);
  }
  CHECK(chunked >= 4);
  const algorithm automatic_choice =
      recattn::cuda::detail::chunked_min_tokens > 0 ? algorithm::chunked : algorithm::recurrent;
  CHECK(cands.front().algo == automatic_choice);  // T = 300, bf16, scalar gates

  // The heuristic: recurrent while the chunked kernel is the slower one
  // (chunked_min_tokens = 0), else chunked for long bf16/half sequences, gv included;
  // recurrent for short ones and for float. A cfg with recurrent fields and algo
  // automatic stays recurrent; algo forces either.
  CHECK(recattn::cuda::resolve_cfg(p, std::nullopt).algo == automatic_choice);
  CHECK(recattn::cuda::resolve_cfg(p, algo_cfg(algorithm::recurrent)).algo == algorithm::recurrent);
  recattn::cfg legacy;
  legacy.num_warps = 4;
  CHECK(recattn::cuda::resolve_cfg(p, legacy).algo == algorithm::recurrent);
  spec sh = s;
  sh.T = 100;
  instance short_seq(sh);
  const recattn::problem ps = problem_of(short_seq);
  CHECK(recattn::cuda::resolve_cfg(ps, std::nullopt).algo == algorithm::recurrent);
  CHECK(recattn::cuda::resolve_cfg(ps, algo_cfg(algorithm::chunked)).algo == algorithm::chunked);
  spec sk = s;
  sk.gates = recattn::gate_gk;
  instance with_gk(sk);
  CHECK(recattn::cuda::resolve_cfg(problem_of(with_gk), std::nullopt).algo == automatic_choice);
  // gk with small heads too (K = 64), split or not.
  spec sk64 = sk;
  sk64.K = 64;
  instance gk_small(sk64);
  CHECK(recattn::cuda::resolve_cfg(problem_of(gk_small), std::nullopt).algo == automatic_choice);
  sk64.T = 8192;
  instance gk_long(sk64);
  CHECK(recattn::cuda::resolve_cfg(problem_of(gk_long), std::nullopt).algo == automatic_choice);
  spec sgv = s;
  sgv.gates = recattn::gate_gv;
  instance with_gv(sgv);
  CHECK(recattn::cuda::resolve_cfg(problem_of(with_gv), std::nullopt).algo == automatic_choice);
  // gk + gv at K = 128 keeps 64 columns (one wave) and shortens the chunk to fit.
  spec skv = s;
  skv.gates = gk_ | gv_;
  skv.B = 8;  // 128 sequences x heads: 64-column blocks fill the GPU
  skv.Hq = skv.Hk = skv.Hv = 16;
  skv.V = 128;
  instance with_gkv(skv);
  const recattn::cfg ckv = recattn::cuda::chunked_heuristic_cfg(problem_of(with_gkv));
  CHECK(ckv.block_v == 64);
  CHECK(ckv.chunk == 32);
  spec sf = s;
  sf.type = dtype::float32;
  sf.gate_type = dtype::float32;
  instance with_float(sf);
  CHECK(recattn::cuda::resolve_cfg(problem_of(with_float), std::nullopt).algo == algorithm::recurrent);
  // The public call with algo chunked in its options (and nothing else of cfg) against the
  // reference.
  spec sd = s;
  sd.seed = seed++;
  sd.cfg = algo_cfg(algorithm::chunked);
  instance dflt(sd);
  const recattn_test::errors e = dflt.check();
  CHECK(e.output_written);
  CHECK(e.output < recattn_test::tolerance(s.type));
  CHECK(e.state < recattn_test::tolerance(s.type));
}

TEST_CASE("cuda chunked: what it does not take is a recattn::Error, nothing written", "[cuda][chunked]") {
  spec s;
  s.type = dtype::bfloat16;
  s.gate_type = dtype::bfloat16;
  s.B = 1;
  s.T = 300;
  s.K = s.V = 32;
  s.initial_state = true;
  s.cfg = algo_cfg(algorithm::chunked);
  {
    spec sk = s;  // gk with K > 128 takes chunks of 32
    sk.gates = recattn::gate_gk;
    sk.K = 160;
    sk.cfg = algo_cfg(algorithm::chunked, 64, 0);
    expect_chunked_rejected(sk, "cfg.chunk");
  }
  for (dtype t : {dtype::float32, dtype::float64}) {
    spec st = s;
    st.type = t;
    st.gate_type = t;
    INFO(st.str());
    expect_chunked_rejected(st, "cfg.algorithm");
  }
  SECTION("fields the chunked kernel cannot take") {
    spec sb = s;
    sb.cfg = algo_cfg(algorithm::chunked, 48, 0);
    expect_chunked_rejected(sb, "cfg.chunk");
    sb.cfg = algo_cfg(algorithm::chunked, 0, 8);
    expect_chunked_rejected(sb, "cfg.block_v");
    recattn::cfg c = algo_cfg(algorithm::chunked);
    c.num_warps = 4;
    sb.cfg = c;
    expect_chunked_rejected(sb, "cfg.num_warps");
  }
}
