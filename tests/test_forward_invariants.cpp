// SPEC §1-§2 as invariants of the CPU forward, over every gate combination: reverse is the
// forward of the time-flipped tensors; varlen is each sequence alone; a split sequence with
// the state carried over is the whole; grouped heads are repeated heads; the [V, K] state
// layout is the transposed [K, V].
#include <catch2/catch.hpp>

#include <vector>

#include "support/forward.hpp"

using namespace recattn;
using namespace recattn::testing;

namespace {

/// The invariants hold up to float rounding (in practice bit for bit).
constexpr double same = 1e-6;

forward_result run_with_state(const problem_data& d, forward_options o) {
  o.return_state = true;
  return run_forward(d, o);
}

/// A problem made of tensors cut out of `d`: tokens [t0, t0 + L) of batch row b (dense form,
/// B = 1), with sequence n's g_gamma row and initial state.
problem_data cut_sequence(const problem_data& d, std::int64_t b, std::int64_t t0, std::int64_t L, std::int64_t n) {
  problem_data c;
  c.spec = d.spec;
  c.spec.seqlens.clear();
  c.spec.B = 1;
  c.spec.T = L;
  auto cut = [&](const buffer& x) { return slice(slice(x.view(), 0, b, 1).view(), 1, t0, L); };
  c.q = cut(d.q);
  c.k = cut(d.k);
  c.v = cut(d.v);
  if (d.g.present()) c.g = cut(d.g);
  if (d.gk.present()) c.gk = cut(d.gk);
  if (d.gv.present()) c.gv = cut(d.gv);
  if (d.g_gamma.present()) c.g_gamma = d.g_gamma.rank() == 1 ? d.g_gamma : slice(d.g_gamma.view(), 0, n, 1);
  if (d.initial_state.present()) c.initial_state = slice(d.initial_state.view(), 0, n, 1);
  return c;
}

}  // namespace

TEST_CASE("reverse equals forward on the time-flipped tensors", "[forward][invariant][reverse]") {
  const unsigned gates = GENERATE(range(0u, 16u));
  const bool varlen = GENERATE(false, true);
  problem_spec s;
  s.B = 2, s.T = 19, s.Hq = 2, s.Hk = 1, s.Hv = 2, s.K = 7, s.V = 20;
  if (varlen) s.with_seqlens({7, 0, 12, 1});
  s.gates = gates;
  s.g_gamma_per_sequence = varlen;
  s.initial_state = true;
  s.seed = 10 + gates;
  const problem_data d = generate(s);
  INFO(s.str());

  // Flip every time-indexed input (within each sequence for varlen); g_gamma and the initial
  // state are not indexed by time.
  const std::vector<std::int64_t> cu = s.varlen() ? s.cu_seqlens() : std::vector<std::int64_t>{};
  problem_data f = d;
  f.q = flip_time(d.q, cu);
  f.k = flip_time(d.k, cu);
  f.v = flip_time(d.v, cu);
  if (d.g.present()) f.g = flip_time(d.g, cu);
  if (d.gk.present()) f.gk = flip_time(d.gk, cu);
  if (d.gv.present()) f.gv = flip_time(d.gv, cu);

  forward_options rev = d.options();
  rev.reverse = true;
  const forward_result backwards = run_with_state(d, rev);
  const forward_result forwards = run_with_state(f, f.options());
  CHECK(rel_error(backwards.output, flip_time(forwards.output, cu)) < same);
  CHECK(rel_error(*backwards.final_state, *forwards.final_state) < same);
  // And reverse is not forward: the test would not notice an ignored flag otherwise.
  CHECK(rel_error(run_forward(d, d.options()).output, backwards.output) > 1e-3);
}

TEST_CASE("varlen equals each sequence run alone, int32 and int64 cu_seqlens, with empty sequences",
          "[forward][invariant][varlen]") {
  const unsigned gates = GENERATE(range(0u, 16u));
  const dtype cu_type = GENERATE(dtype::int32, dtype::int64);
  const bool reverse = GENERATE(false, true);
  problem_spec s;
  s.with_seqlens({0, 9, 1, 0, 0, 14, 5, 0});
  s.cu_type = cu_type;
  s.Hq = 3, s.Hk = 3, s.Hv = 3, s.K = 6, s.V = 17;
  s.gates = gates;
  s.g_gamma_per_sequence = gates % 4 == 2;
  s.initial_state = gates % 2 == 0 || reverse;
  s.seed = 20 + gates;
  const problem_data d = generate(s);
  INFO(s.str() << (reverse ? " reverse" : ""));
  forward_options o = d.options();
  o.reverse = reverse;
  const forward_result all = run_with_state(d, o);

  const std::vector<std::int64_t> cu = s.cu_seqlens();
  for (std::int64_t n = 0; n < s.N(); ++n) {
    const std::int64_t t0 = cu[std::size_t(n)], L = cu[std::size_t(n) + 1] - t0;
    INFO("sequence " << n << " tokens [" << t0 << ", " << t0 + L << ")");
    const buffer state_n = slice(all.final_state->view(), 0, n, 1);
    if (L == 0) {
      // An empty sequence's final state is its initial state (zeros without one).
      if (d.initial_state.present()) {
        CHECK(bitwise_equal(state_n.view(), slice(d.initial_state.view(), 0, n, 1).view()));
      } else {
        CHECK(rel_error(state_n, buffer(dtype::float32, state_n.shape()).fill([](const idx&) { return 0.0; })) == 0);
      }
      continue;
    }
    const problem_data alone = cut_sequence(d, 0, t0, L, n);
    forward_options oa = alone.options();
    oa.reverse = reverse;
    const forward_result one = run_with_state(alone, oa);
    CHECK(rel_error(slice(all.output.view(), 1, t0, L), one.output) < same);
    CHECK(rel_error(state_n, *one.final_state) < same);
  }
}

TEST_CASE("splitting a sequence and passing the final state on equals running it whole",
          "[forward][invariant][state]") {
  const unsigned gates = GENERATE(range(0u, 16u));
  const bool reverse = GENERATE(false, true);
  problem_spec s;
  s.B = 2, s.T = 37, s.Hq = 2, s.Hk = 2, s.Hv = 2, s.K = 9, s.V = 13;
  s.gates = gates;
  s.g_gamma_per_sequence = true;
  s.initial_state = true;
  s.seed = 30 + gates;
  const problem_data d = generate(s);
  INFO(s.str() << (reverse ? " reverse" : ""));
  forward_options o = d.options();
  o.reverse = reverse;
  const forward_result whole = run_with_state(d, o);

  for (const std::int64_t cut : {1, 5, 32, 36}) {
    INFO("split at t = " << cut);
    // Tokens [0, cut) and [cut, T), in processing order: the later part first when reversed.
    auto part = [&](std::int64_t t0, std::int64_t L) {
      problem_data p = d;
      auto time_cut = [&](const buffer& x) { return slice(x.view(), 1, t0, L); };
      p.spec.T = L;
      p.q = time_cut(d.q);
      p.k = time_cut(d.k);
      p.v = time_cut(d.v);
      if (d.g.present()) p.g = time_cut(d.g);
      if (d.gk.present()) p.gk = time_cut(d.gk);
      if (d.gv.present()) p.gv = time_cut(d.gv);
      return p;
    };
    problem_data first = reverse ? part(cut, s.T - cut) : part(0, cut);
    problem_data second = reverse ? part(0, cut) : part(cut, s.T - cut);
    forward_options o1 = first.options();
    o1.reverse = reverse;
    const forward_result r1 = run_with_state(first, o1);
    second.initial_state = buffer::copy_of(*r1.final_state);
    forward_options o2 = second.options();
    o2.reverse = reverse;
    const forward_result r2 = run_with_state(second, o2);

    const std::int64_t first_t0 = reverse ? cut : 0, second_t0 = reverse ? 0 : cut;
    CHECK(rel_error(slice(whole.output.view(), 1, first_t0, first.spec.T), r1.output) < same);
    CHECK(rel_error(slice(whole.output.view(), 1, second_t0, second.spec.T), r2.output) < same);
    CHECK(rel_error(*whole.final_state, *r2.final_state) < same);
  }
}

TEST_CASE("grouped heads equal explicitly repeated tensors (grouped-query and grouped-value)",
          "[forward][invariant][heads]") {
  const unsigned gates = GENERATE(range(0u, 16u));
  struct heads { std::int64_t q, k, v; };
  const heads h = GENERATE(heads{4, 2, 2},   // grouped-query: Hk = Hv < Hq
                           heads{6, 1, 1},   // multi-query
                           heads{2, 2, 4},   // grouped-value: Hq = Hk < Hv
                           heads{1, 1, 3},
                           heads{2, 4, 1});  // any divisors of H
  const bool varlen = GENERATE(false, true);
  problem_spec s;
  s.B = 2, s.T = 11, s.K = 5, s.V = 18;
  if (varlen) s.with_seqlens({4, 0, 9});
  s.Hq = h.q, s.Hk = h.k, s.Hv = h.v;
  s.gates = gates;
  s.initial_state = true;
  s.seed = 40 + gates;
  const problem_data d = generate(s);
  INFO(s.str());

  problem_data r = d;
  const std::int64_t H = s.H();
  r.spec.Hq = r.spec.Hk = r.spec.Hv = H;
  r.q = repeat_interleave(d.q, 2, H / s.Hq);
  r.k = repeat_interleave(d.k, 2, H / s.Hk);
  r.v = repeat_interleave(d.v, 2, H / s.Hv);
  forward_options o = d.options();
  o.reverse = gates % 2 == 1;
  forward_options orep = r.options();
  orep.reverse = o.reverse;
  const forward_result grouped = run_with_state(d, o);
  const forward_result repeated = run_with_state(r, orep);
  CHECK(rel_error(grouped.output, repeated.output) < same);
  CHECK(rel_error(*grouped.final_state, *repeated.final_state) < same);
}

TEST_CASE("the [V, K] state layout equals the transposed [K, V], initial and final",
          "[forward][invariant][state_layout]") {
  const unsigned gates = GENERATE(range(0u, 16u));
  const bool varlen = GENERATE(false, true);
  problem_spec s;
  s.B = 2, s.T = 15, s.Hq = 2, s.Hk = 2, s.Hv = 2, s.K = 11, s.V = 6;
  if (varlen) s.with_seqlens({3, 0, 12});
  s.gates = gates;
  s.initial_state = true;
  s.seed = 50 + gates;
  const problem_data kv = generate(s);
  INFO(s.str());

  problem_data vk = kv;
  vk.spec.layout = state_layout::vk;
  vk.initial_state = transpose_last2(kv.initial_state);
  forward_options okv = kv.options();
  forward_options ovk = vk.options();
  okv.reverse = ovk.reverse = gates % 2 == 1;
  const forward_result a = run_with_state(kv, okv);
  const forward_result b = run_with_state(vk, ovk);
  REQUIRE(b.final_state->shape() == vk.spec.state_shape());
  CHECK(rel_error(b.output, a.output) < same);
  CHECK(rel_error(*b.final_state, transpose_last2(*a.final_state)) < same);
  // Against the reference too, which reads and writes the [V, K] layout itself.
  const forward_result ref = run_reference(vk, [&] { auto o = ovk; o.return_state = true; return o; }());
  CHECK(rel_error(*b.final_state, *ref.final_state) < 1e-4);
}
