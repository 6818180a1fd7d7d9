// Caller-owned buffers, the in-place state, and SPEC §5's last rule: NaN or infinity in the
// inputs flows to the affected (sequence, head) only and never crashes.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "support/forward.hpp"

using namespace recattn;
using namespace recattn::testing;

namespace {

constexpr double nan_value = std::numeric_limits<double>::quiet_NaN();
constexpr double inf_value = std::numeric_limits<double>::infinity();

problem_spec buffers_spec(unsigned gates, bool varlen) {
  problem_spec s;
  s.B = 3, s.T = 12, s.Hq = 3, s.Hk = 3, s.Hv = 3, s.K = 8, s.V = 21;
  if (varlen) s.with_seqlens({5, 0, 13, 6});
  s.gates = gates;
  s.g_gamma_per_sequence = true;  // so that a poisoned g_gamma belongs to one sequence
  s.initial_state = true;
  s.seed = 60 + gates;
  return s;
}

/// The (batch row, first token, length) of sequence n.
struct token_range { std::int64_t b, t0, len; };
token_range tokens_of(const problem_spec& s, std::int64_t n) {
  if (!s.varlen()) return {n, 0, s.T};
  const auto cu = s.cu_seqlens();
  return {0, cu[std::size_t(n)], cu[std::size_t(n) + 1] - cu[std::size_t(n)]};
}

/// Every (n, h) output row and state slice of `got` other than (n0, h0) equals `clean` bit for
/// bit; the tokens of (n0, h0) processed before `first_hit` (in time order, forward) too.
void check_only(const problem_spec& s, const forward_result& got, const forward_result& clean, std::int64_t n0,
                std::int64_t h0) {
  for (std::int64_t n = 0; n < s.N(); ++n) {
    const token_range r = tokens_of(s, n);
    for (std::int64_t h = 0; h < s.H(); ++h) {
      if (n == n0 && h == h0) continue;
      INFO("sequence " << n << " head " << h);
      const buffer o_got = slice(slice(slice(got.output.view(), 0, r.b, 1).view(), 1, r.t0, r.len).view(), 2, h, 1);
      const buffer o_clean = slice(slice(slice(clean.output.view(), 0, r.b, 1).view(), 1, r.t0, r.len).view(), 2, h, 1);
      CHECK(bitwise_equal(o_got.view(), o_clean.view()));
      const buffer st_got = slice(slice(got.final_state->view(), 0, n, 1).view(), 1, h, 1);
      const buffer st_clean = slice(slice(clean.final_state->view(), 0, n, 1).view(), 1, h, 1);
      CHECK(bitwise_equal(st_got.view(), st_clean.view()));
    }
  }
}

bool any_nan(const tensor_view& v) {
  bool found = false;
  for_each_index(v.shape_vec(), [&](const idx& i) { found = found || std::isnan(element(v, i)); });
  return found;
}

}  // namespace

TEST_CASE("the caller-owned form writes what the allocating form returns", "[forward][buffers]") {
  const unsigned gates = GENERATE(0u, 3u, 12u, 15u);
  const bool varlen = GENERATE(false, true);
  const problem_data d = generate(buffers_spec(gates, varlen));
  INFO(d.spec.str());
  forward_options o = d.options();
  o.return_state = true;
  const forward_result allocated = run_forward(d, o);
  buffer out = d.make_output();
  buffer state = d.make_state();
  recurrent_attention(d.q, d.k, d.v, o, forward_outputs{out.mutable_view(), state.mutable_view()});
  CHECK(bitwise_equal(out.view(), allocated.output.view()));
  CHECK(bitwise_equal(state.view(), allocated.final_state->view()));

  // Without return_state and without a state buffer, only the output is written.
  forward_options no_state = d.options();
  buffer out2 = d.make_output();
  recurrent_attention(d.q, d.k, d.v, no_state, forward_outputs{out2.mutable_view(), std::nullopt});
  CHECK(bitwise_equal(out2.view(), allocated.output.view()));
}

TEST_CASE("the state may be updated in place (final_state aliasing initial_state)", "[forward][buffers][state]") {
  const unsigned gates = GENERATE(range(0u, 16u));
  const bool varlen = GENERATE(false, true);
  const bool reverse = GENERATE(false, true);
  const problem_data d = generate(buffers_spec(gates, varlen));
  INFO(d.spec.str() << (reverse ? " reverse" : ""));
  forward_options o = d.options();
  o.reverse = reverse;
  o.return_state = true;
  const forward_result out_of_place = run_forward(d, o);

  buffer state = buffer::copy_of(d.initial_state);
  forward_options in_place = o;
  in_place.initial_state = state.view();
  buffer out = d.make_output();
  recurrent_attention(d.q, d.k, d.v, in_place, forward_outputs{out.mutable_view(), state.mutable_view()});
  CHECK(bitwise_equal(out.view(), out_of_place.output.view()));
  CHECK(bitwise_equal(state.view(), out_of_place.final_state->view()));
}

TEST_CASE("NaN in one (sequence, head)'s inputs reaches only that (sequence, head)", "[forward][buffers][nonfinite]") {
  const std::string input = GENERATE(as<std::string>{}, "query", "key", "value", "g", "g_gamma", "gk", "gv",
                                     "initial_state");
  const bool varlen = GENERATE(false, true);
  const bool reverse = GENERATE(false, true);
  const problem_data clean = generate(buffers_spec(15, varlen));
  const problem_spec& s = clean.spec;
  const std::int64_t n0 = 2, h0 = 1;  // sequence 2 is not empty in either form
  const token_range r = tokens_of(s, n0);
  const std::int64_t t_hit = r.t0 + r.len / 2;
  INFO(s.str() << (reverse ? " reverse" : "") << ": NaN in " << input << " of sequence " << n0 << " head " << h0
               << " at t = " << t_hit);

  problem_data d = clean;
  if (input == "query") d.q.set({r.b, t_hit, h0, 3}, nan_value);
  if (input == "key") d.k.set({r.b, t_hit, h0, 3}, nan_value);
  if (input == "value") d.v.set({r.b, t_hit, h0, 3}, nan_value);
  if (input == "g") d.g.set({r.b, t_hit, h0}, nan_value);
  if (input == "g_gamma") d.g_gamma.set({n0, h0}, nan_value);
  if (input == "gk") d.gk.set({r.b, t_hit, h0, 3}, nan_value);
  if (input == "gv") d.gv.set({r.b, t_hit, h0, 3}, nan_value);
  if (input == "initial_state") d.initial_state.set({n0, h0, 3, 3}, nan_value);

  forward_options o = d.options();
  o.reverse = reverse;
  o.return_state = true;
  forward_options oc = clean.options();
  oc.reverse = reverse;
  oc.return_state = true;
  const forward_result got = run_forward(d, o);
  const forward_result ref = run_forward(clean, oc);
  check_only(s, got, ref, n0, h0);

  // The poisoned (sequence, head) shows it: its output from the poisoned token on (in
  // processing order) holds NaN, the tokens before it do not.
  const buffer o_hit = slice(slice(got.output.view(), 0, r.b, 1).view(), 2, h0, 1);
  const bool whole_sequence = input == "g_gamma" || input == "initial_state";
  const std::int64_t from = whole_sequence ? (reverse ? r.t0 + r.len - 1 : r.t0) : t_hit;
  CHECK(any_nan(slice(o_hit.view(), 1, from, 1).view()));
  if (!whole_sequence) {
    const buffer before = reverse ? slice(o_hit.view(), 1, t_hit + 1, r.t0 + r.len - t_hit - 1)
                                  : slice(o_hit.view(), 1, r.t0, t_hit - r.t0);
    const buffer before_clean = reverse ? slice(slice(slice(ref.output.view(), 0, r.b, 1).view(), 2, h0, 1).view(), 1,
                                                t_hit + 1, r.t0 + r.len - t_hit - 1)
                                        : slice(slice(slice(ref.output.view(), 0, r.b, 1).view(), 2, h0, 1).view(), 1,
                                                r.t0, t_hit - r.t0);
    CHECK(bitwise_equal(before.view(), before_clean.view()));
  }
  if (input != "query") CHECK(any_nan(slice(slice(got.final_state->view(), 0, n0, 1).view(), 1, h0, 1).view()));
}

TEST_CASE("infinity in the inputs does not crash and stays in its (sequence, head)", "[forward][buffers][nonfinite]") {
  const std::string input = GENERATE(as<std::string>{}, "query", "key", "value", "g", "gk", "gv", "initial_state");
  // as<double>: Catch2 2.13 returns a dangling reference for a GENERATE of a plain lvalue (ASan
  // detect_stack_use_after_return reports it).
  const double x = GENERATE(as<double>{}, inf_value, -inf_value);
  const bool varlen = GENERATE(false, true);
  const problem_data clean = generate(buffers_spec(15, varlen));
  const problem_spec& s = clean.spec;
  const std::int64_t n0 = 2, h0 = 0;
  const token_range r = tokens_of(s, n0);
  const std::int64_t t_hit = r.t0 + 1;
  INFO(s.str() << ": " << x << " in " << input << " of sequence " << n0 << " head " << h0 << " at t = " << t_hit);

  problem_data d = clean;
  if (input == "query") d.q.set({r.b, t_hit, h0, 0}, x);
  if (input == "key") d.k.set({r.b, t_hit, h0, 0}, x);
  if (input == "value") d.v.set({r.b, t_hit, h0, 0}, x);
  if (input == "g") d.g.set({r.b, t_hit, h0}, x);
  if (input == "gk") d.gk.set({r.b, t_hit, h0, 0}, x);
  if (input == "gv") d.gv.set({r.b, t_hit, h0, 0}, x);
  if (input == "initial_state") d.initial_state.set({n0, h0, 0, 0}, x);
  forward_options o = d.options();
  o.return_state = true;
  forward_options oc = clean.options();
  oc.return_state = true;
  const forward_result got = run_forward(d, o);
  const forward_result ref = run_forward(clean, oc);
  check_only(s, got, ref, n0, h0);
}

TEST_CASE("a gate of -infinity resets the state, as exp(-inf) = 0 in the recurrence", "[forward][buffers][nonfinite]") {
  // D = exp(-inf) = 0 wipes the state before the update: the kernel agrees with the reference.
  const unsigned gates = GENERATE(range(1u, 16u));
  problem_spec s = buffers_spec(gates, false);
  const problem_data clean = generate(s);
  problem_data d = clean;
  INFO(s.str());
  if (gates & gate_g) d.g.set({1, 4, 2}, -inf_value);
  if (gates & gate_gk) d.gk.set({0, 7, 1, 5}, -inf_value);
  if (gates & gate_gv) d.gv.set({2, 3, 0, 9}, -inf_value);
  if (gates & gate_g_gamma) d.g_gamma.set({1, 1}, -inf_value);
  forward_options o = d.options();
  const forward_errors e = errors_against_reference(d, o);
  CHECK(e.output < 1e-4);
  CHECK(e.state < 1e-4);
}
