// SPEC §3.2 and §6 under decays that stress the CPU backward's rescaled sweeps (the state and
// the adjoint are kept divided by the decay product of their current segment, and a segment
// ends before that product would leave [e^-20, e^20]): strong decays down to -20 per token,
// strong and weak channels mixed, moderate decays (segments spanning chunks), positive gates
// (growth), and decays that are exactly zero; every gradient against the double reference.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "support/decay_laws.hpp"
#include "test_backward_common.hpp"

using namespace recattn;
using namespace recattn::testing;

namespace {

const unsigned decaying_gate_sets[] = {gate_g,           gate_gk, gate_gv, gate_g | gate_gk, gate_gk | gate_gv,
                                       gate_g_gamma | gate_gv, 15u};

}  // namespace

TEST_CASE("backward: strong, mixed, moderate and growing decays match the reference", "[backward][decay]") {
  const unsigned gates = GENERATE(from_range(std::begin(decaying_gate_sets), std::end(decaying_gate_sets)));
  const int law_index = GENERATE(0, 1, 2, 3);
  const int chunk = GENERATE(0, 1, 5);  // 0: the heuristic
  // K = 9, V = 17 take the general staging; whole registers the one-pass float staging.
  const bool whole = GENERATE(false, true);
  const std::int64_t W = recattn::cpu::simd_width<float>();
  problem_spec s;
  s.B = 2, s.T = 300, s.Hq = s.Hk = s.Hv = 2, s.K = whole ? 2 * W : 9, s.V = whole ? W : 17;
  s.gates = gates;
  s.initial_state = true;
  s.seed = 700 + gates + 16 * unsigned(law_index);
  problem_data d = generate(s);
  set_gates(d, decay_laws[law_index], s.seed);
  const incoming in = make_incoming(s, true, s.seed + 1);
  for (bool reverse : {false, true}) {
    forward_options o = d.options();
    o.reverse = reverse;
    if (chunk) {
      cfg c;
      c.chunk = chunk;
      o.cfg = c;
    }
    INFO(s.str() << " gates " << decay_law_names[law_index] << " chunk " << chunk << (reverse ? " reverse" : ""));
    const grad_errors e = compare(run_backward(d, o, in), run_reference_backward(d, o, in));
    INFO(e.str());
    CHECK(e.max() < 1e-4);
  }
}

TEST_CASE("backward: T = 16384 under strong and mixed decays stays within 1e-4", "[backward][decay][long]") {
  const unsigned gates = GENERATE(unsigned(gate_gk), unsigned(gate_g | gate_gv), 15u);
  const int law_index = GENERATE(0, 1, 2);
  problem_spec s;
  s.Hq = s.Hk = s.Hv = 1, s.K = 8, s.V = 8, s.T = 16384;
  s.gates = gates;
  s.initial_state = true;
  s.seed = 3000 + gates + 16 * unsigned(law_index);
  problem_data d = generate(s);
  set_gates(d, decay_laws[law_index], s.seed);
  const incoming in = make_incoming(s, true, 5);
  INFO(s.str() << " law " << decay_law_names[law_index]);
  const grad_errors e = compare(run_backward(d, d.options(), in), run_reference_backward(d, d.options(), in));
  INFO(e.str());
  CHECK(e.max() < 1e-4);
}

TEST_CASE("backward: zero decays (gate -inf, or one whose exp underflows) match the reference",
          "[backward][decay]") {
  // Every channel's decay 0 at token t0 (the history before it is forgotten: its gradients
  // through the state are exactly 0), and -inf in some channels at a few other tokens.
  const unsigned gates = GENERATE(from_range(std::begin(decaying_gate_sets), std::end(decaying_gate_sets)));
  const double zero_gate = GENERATE(-std::numeric_limits<double>::infinity(), -200.0);
  const std::int64_t t0 = GENERATE(0, 1, 31, 32, 45, 99);
  const bool whole = GENERATE(false, true);  // (as above)
  const std::int64_t W = recattn::cpu::simd_width<float>();
  problem_spec s;
  s.B = 1, s.T = 100, s.Hq = s.Hk = s.Hv = 2, s.K = whole ? W : 12, s.V = whole ? 2 * W : 20;
  s.gates = gates;
  s.initial_state = true;
  s.seed = 177 + gates;
  problem_data d = generate(s);
  set_gates(d, moderate, 5);
  const double ninf = -std::numeric_limits<double>::infinity();
  auto at = [&](buffer& b, const idx& i) { return element(b.view(), i); };
  if (d.gk.present())
    d.gk.fill([&](const idx& i) {
      return i[1] == t0 ? zero_gate : (i[1] % 29 == 3 && i[3] % 2 == 0) ? ninf : at(d.gk, i);
    });
  else if (d.g.present())
    d.g.fill([&](const idx& i) { return i[1] == t0 ? zero_gate : at(d.g, i); });
  if (d.gv.present())
    d.gv.fill([&](const idx& i) { return i[1] == t0 ? zero_gate : (i[1] % 37 == 5 && i[3] == 7) ? ninf : at(d.gv, i); });
  const incoming in = make_incoming(s, true, 8);
  for (bool reverse : {false, true}) {
    forward_options o = d.options();
    o.reverse = reverse;
    INFO(s.str() << " zero gate " << zero_gate << " at t0 = " << t0 << (reverse ? " reverse" : ""));
    const backward_result got = run_backward(d, o, in);
    const backward_result ref = run_reference_backward(d, o, in);
    grad_errors e = compare(got, ref);
    INFO(e.str());
    // exp(-200) is 0 in float but ~1e-87 in the double reference: where that decay is the
    // first one applied to the initial state, d initial_state must be exactly 0 here.
    const bool underflow_at_h0 = std::isfinite(zero_gate) && t0 == (reverse ? s.T - 1 : 0);
    if (underflow_at_h0) {
      REQUIRE(got.d_initial_state);
      double m = 0;
      for (std::int64_t i = 0; i < got.d_initial_state->numel(); ++i)
        m = std::max(m, std::abs(load_as<double>(got.d_initial_state->raw(), got.d_initial_state->type(), i)));
      CHECK(m == 0.0);
      e.dh0 = 0;
    }
    CHECK(e.max() < 1e-4);
  }
}
