// SPEC §3.2 and §6: every gradient of the CPU backward against the double reference
// gradient (per-token states kept, differentiated by hand), over generated shapes, for all 16
// gate combinations, both directions, dense and varlen (with empty sequences), grouped heads,
// strided inputs, with and without d_final_state.
#include <catch2/catch.hpp>

#include "test_backward_common.hpp"

using namespace recattn;
using namespace recattn::testing;

TEST_CASE("backward: every gradient matches the double reference for all gate combinations", "[backward][reference]") {
  rng r(20261202);
  for (unsigned gates = 0; gates < 16; ++gates) {
    for (int rep = 0; rep < 8; ++rep) {
      const problem_spec s = random_spec(r, gates, dtype::float32);
      const problem_data d = generate(s);
      forward_options o = d.options();
      o.reverse = rep % 2 == 1;
      if (rep == 3) o.softmax_scale = 0.7;
      const incoming in = make_incoming(s, rep % 4 >= 2, s.seed + 1);
      INFO(s.str() << (o.reverse ? " reverse" : "") << (in.dht.present() ? " d_final_state" : ""));
      const grad_errors e = compare(run_backward(d, o, in), run_reference_backward(d, o, in));
      INFO(e.str());
      CHECK(e.max() < grad_tolerance(s.type));
    }
  }
}

TEST_CASE("backward: long sequences with decaying gates stay within SPEC tolerance", "[backward][reference]") {
  // The gate gradients come from prefix and suffix sums over the whole sequence of per-token
  // terms computed from float states: their error grows like eps * sqrt(T) (dgk, dgv, dg) and,
  // for dg_gamma (a sum of T such prefix sums), like eps * T. At 3000 tokens of strong decay
  // the first stay within 1e-4; dg_gamma is held to 1e-2 (a known limit, see cpu/backward.hpp).
  for (unsigned gates : {unsigned(gate_gk), unsigned(gate_g | gate_gv), 15u}) {
    problem_spec s;
    s.B = 1;
    s.T = 3000;
    s.Hq = s.Hk = s.Hv = 1;
    s.K = 9;
    s.V = 7;
    s.gates = gates;
    s.initial_state = true;
    s.gate_bias = 0.0;  // strong decay: log(sigmoid(N(0, 1)))
    s.seed = 7 + gates;
    const problem_data d = generate(s);
    const incoming in = make_incoming(s, true, 99);
    INFO(s.str());
    grad_errors e = compare(run_backward(d, d.options(), in), run_reference_backward(d, d.options(), in));
    INFO(e.str());
    CHECK(e.dg_gamma < 1e-2);
    e.dg_gamma = 0;
    CHECK(e.max() < 1e-4);
  }
}

TEST_CASE("backward: K and V of any size, including sizes past one SIMD register", "[backward][reference]") {
  rng r(5);
  for (std::int64_t K : {1, 3, 16, 17, 40}) {
    for (std::int64_t V : {1, 15, 33}) {
      problem_spec s;
      s.B = 2;
      s.T = 11;
      s.Hq = 2;
      s.Hk = s.Hv = 1;
      s.K = K;
      s.V = V;
      s.gates = unsigned(r.integer(0, 15));
      s.initial_state = true;
      s.seed = std::uint64_t(K * 100 + V);
      const problem_data d = generate(s);
      const incoming in = make_incoming(s, true, 3);
      INFO(s.str());
      const grad_errors e = compare(run_backward(d, d.options(), in), run_reference_backward(d, d.options(), in));
      INFO(e.str());
      CHECK(e.max() < 1e-4);
    }
  }
}

TEST_CASE("backward: threads and chunk sizes do not change the result", "[backward][reference]") {
  problem_spec s;
  s.B = 3;
  s.T = 70;
  s.Hq = 4;
  s.Hk = 2;
  s.Hv = 4;
  s.K = 20;
  s.V = 18;
  s.gates = 15;
  s.initial_state = true;
  const problem_data d = generate(s);
  const incoming in = make_incoming(s, true, 4);
  const backward_result ref = run_reference_backward(d, d.options(), in);
  for (int threads : {1, 2, 3}) {
    for (int chunk : {1, 7, 64}) {
      forward_options o = d.options();
      cfg c;
      c.threads = threads;
      c.chunk = chunk;
      o.cfg = c;
      INFO("threads " << threads << " chunk " << chunk);
      const grad_errors e = compare(run_backward(d, o, in), ref);
      INFO(e.str());
      CHECK(e.max() < 1e-4);
    }
  }
}
