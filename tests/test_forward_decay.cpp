// SPEC §1 and §6 under decays that stress the CPU kernel's rescaled recurrence (the state is
// kept divided by the decay product of the current segment, and a segment ends before that
// product would leave [e^-20, e^20]): strong decays down to -20 per token, strong and weak
// channels mixed, positive gates (growth), decays that underflow to exactly 0, segments
// longer than a chunk, and T = 16384; all against the double-precision reference.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "support/decay_laws.hpp"
#include "support/forward.hpp"

using namespace recattn;
using namespace recattn::testing;

namespace {

const unsigned decaying_gate_sets[] = {gate_g, gate_gk, gate_gv, gate_g | gate_gk, gate_gk | gate_gv, 15u};

void check_against_reference(const problem_data& d, const forward_options& o, double tol) {
  const forward_errors e = errors_against_reference(d, o);
  CHECK(e.output < tol);
  CHECK(e.state < tol);
}

/// s with gates drawn from decay_laws[law], cfg.chunk = chunk (0: the heuristic), forward and
/// reverse, within 1e-4 of the reference.
void check_law(const problem_spec& s, int law, int chunk) {
  problem_data d = generate(s);
  set_gates(d, decay_laws[law], s.seed);
  forward_options o = d.options();
  if (chunk) {
    cfg c;
    c.chunk = chunk;
    o.cfg = c;
  }
  INFO(s.str() << " gates " << decay_law_names[law] << " chunk " << chunk);
  check_against_reference(d, o, 1e-4);
  o.reverse = true;
  check_against_reference(d, o, 1e-4);
}

}  // namespace

TEST_CASE("strong, mixed, moderate and growing decays match the reference", "[forward][decay][float]") {
  const unsigned gates = GENERATE(from_range(std::begin(decaying_gate_sets), std::end(decaying_gate_sets)));
  const int law_index = GENERATE(0, 1, 2, 3);
  const int chunk = GENERATE(0, 1, 5);  // 0: the heuristic (32)
  problem_spec s;
  s.B = 2, s.T = 300, s.Hq = s.Hk = s.Hv = 3, s.K = 9, s.V = 17;
  s.gates = gates;
  s.initial_state = true;
  s.seed = 900 + gates + 16 * unsigned(law_index);
  check_law(s, law_index, chunk);
}

TEST_CASE("decays with K and V whole SIMD registers (the float one-pass staging) match the reference",
          "[forward][decay][float]") {
  // K and V multiples of 16 floats take stage_group_float (cpu/recurrence.hpp), which
  // assumes a token starts no segment and redoes the one that does (gv: the general staging).
  const unsigned gates = GENERATE(gate_g, gate_g_gamma, gate_gk, gate_g | gate_gk, gate_g_gamma | gate_gk,
                                  gate_g | gate_g_gamma | gate_gk, gate_gk | gate_gv);
  const int law_index = GENERATE(0, 1, 2, 3);
  const int chunk = GENERATE(0, 5);
  problem_spec s;
  s.B = 2, s.T = 150, s.Hq = s.Hk = s.Hv = 2, s.K = 32, s.V = 16;
  s.gates = gates;
  s.initial_state = true;
  s.seed = 950 + gates + 16 * unsigned(law_index);
  check_law(s, law_index, chunk);
}

TEST_CASE("double inputs under strong and growing decays match the reference", "[forward][decay][double]") {
  const unsigned gates = GENERATE(from_range(std::begin(decaying_gate_sets), std::end(decaying_gate_sets)));
  const bool grow = GENERATE(false, true);
  problem_spec s;
  s.type = dtype::float64;
  s.B = 1, s.T = 200, s.K = 8, s.V = 11;
  s.gates = gates;
  s.initial_state = true;
  s.seed = 950 + gates;
  problem_data d = generate(s);
  set_gates(d, grow ? growing : mixed, s.seed);
  INFO(s.str() << (grow ? " growing" : " mixed"));
  check_against_reference(d, d.options(), tolerance(dtype::float64));
}

TEST_CASE("float forward stays within 1e-4 of the reference for T = 16384 under strong decays",
          "[forward][decay][float][long]") {
  const unsigned gates = GENERATE(from_range(std::begin(decaying_gate_sets), std::end(decaying_gate_sets)));
  const int law_index = GENERATE(0, 1, 2);  // strong, mixed, moderate
  problem_spec s;
  s.Hq = s.Hk = s.Hv = 2, s.K = 8, s.V = 8, s.T = 16384;
  s.gates = gates;
  s.initial_state = true;
  s.seed = 16384 + gates + 16 * unsigned(law_index);
  problem_data d = generate(s);
  set_gates(d, decay_laws[law_index], s.seed);
  INFO(s.str() << " law " << decay_law_names[law_index]);
  check_against_reference(d, d.options(), 1e-4);
}

TEST_CASE("a decay of exactly zero (gate -inf, or one whose exp underflows) forgets the history exactly",
          "[forward][decay][float]") {
  // Two problems that differ only before token t0, where every channel's decay is 0: from t0
  // on, outputs and the final state must agree bit for bit (nothing of the history survives),
  // and both must match the reference.
  const unsigned gates = GENERATE(from_range(std::begin(decaying_gate_sets), std::end(decaying_gate_sets)));
  const double zero_gate = GENERATE(-std::numeric_limits<double>::infinity(), -200.0);
  const std::int64_t t0 = GENERATE(0, 1, 31, 32, 45);
  problem_spec s;
  s.B = 1, s.T = 100, s.Hq = s.Hk = s.Hv = 2, s.K = 12, s.V = 20;
  s.gates = gates;
  s.initial_state = true;
  s.seed = 77 + gates;
  problem_data a = generate(s);
  set_gates(a, moderate, 5);
  problem_spec other = s;
  other.seed += 1000;
  const problem_data c = generate(other);
  // b: a with another history (tokens before t0 and the initial state from c).
  problem_data b = a;
  auto splice = [&](buffer& dst, const buffer& late, const buffer& early) {
    dst.fill([&](const idx& i) { return i[1] < t0 ? element(early.view(), i) : element(late.view(), i); });
  };
  splice(b.q, a.q, c.q);
  splice(b.k, a.k, c.k);
  splice(b.v, a.v, c.v);
  b.initial_state = buffer::copy_of(c.initial_state.view());
  // The zero decay at t0: every channel of the row gate (gk, or g when gk is absent) and of gv.
  auto zero_at_t0 = [&](problem_data& d) {
    if (d.gk.present()) d.gk.fill([&](const idx& i) { return i[1] == t0 ? zero_gate : element(d.gk.view(), i); });
    else if (d.g.present()) d.g.fill([&](const idx& i) { return i[1] == t0 ? zero_gate : element(d.g.view(), i); });
    if (d.gv.present()) d.gv.fill([&](const idx& i) { return i[1] == t0 ? zero_gate : element(d.gv.view(), i); });
  };
  zero_at_t0(a);
  zero_at_t0(b);
  INFO(s.str() << " zero gate " << zero_gate << " at t0 = " << t0);
  forward_options oa = a.options(), ob = b.options();
  oa.return_state = ob.return_state = true;
  const forward_result ra = run_forward(a, oa);
  const forward_result rb = run_forward(b, ob);
  const std::int64_t tail = s.T - t0;
  CHECK(bitwise_equal(slice(ra.output.view(), 1, t0, tail).view(), slice(rb.output.view(), 1, t0, tail).view()));
  CHECK(bitwise_equal(ra.final_state->view(), rb.final_state->view()));
  // The history did matter before t0.
  if (t0 > 0) CHECK_FALSE(bitwise_equal(slice(ra.output.view(), 1, 0, t0).view(), slice(rb.output.view(), 1, 0, t0).view()));
  check_against_reference(a, a.options(), 1e-4);
}

TEST_CASE("a zero decay in some channels resets only their rows or columns", "[forward][decay][float]") {
  // gk = -inf in the even key channels at a few tokens, gv = -inf in one value column: the
  // reference zeroes exactly those rows or columns; the kernel must agree.
  const unsigned gates = GENERATE(unsigned(gate_gk), unsigned(gate_gk | gate_gv), unsigned(gate_g | gate_gk));
  problem_spec s;
  s.B = 2, s.T = 90, s.K = 10, s.V = 18;
  s.gates = gates;
  s.initial_state = true;
  s.seed = 4242 + gates;
  problem_data d = generate(s);
  const double ninf = -std::numeric_limits<double>::infinity();
  d.gk.fill([&](const idx& i) { return (i[1] % 29 == 3 && i[3] % 2 == 0) ? ninf : element(d.gk.view(), i); });
  if (d.gv.present()) d.gv.fill([&](const idx& i) { return (i[1] % 37 == 5 && i[3] == 7) ? ninf : element(d.gv.view(), i); });
  INFO(s.str());
  check_against_reference(d, d.options(), 1e-4);
}
