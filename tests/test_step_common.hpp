// Shared by the step tests: the step arguments of one token or a window of tokens of a
// generated problem (zero-copy views, support/views.hpp), state pools, and comparisons of pool
// slots with forward states.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include <catch2/catch.hpp>
#include <recattn/recattn.hpp>

#include "support/forward.hpp"
#include "support/views.hpp"

namespace recattn::testing {

/// The step arguments of token t of a dense generated problem: q, k, v, gates of that token.
struct token_args {
  tensor_view q, k, v;
  step_options opt;
};

/// Token t (single-token form) of a dense problem, gates included; options from `base`.
inline token_args token_of(const problem_data& d, std::int64_t t, const step_options& base = {}) {
  token_args a;
  a.q = drop_dim(d.q.view(), 1, t);
  a.k = drop_dim(d.k.view(), 1, t);
  a.v = drop_dim(d.v.view(), 1, t);
  a.opt = base;
  if (d.g.present()) a.opt.g = drop_dim(d.g.view(), 1, t);
  if (d.g_gamma.present()) a.opt.g_gamma = d.g_gamma.view();
  if (d.gk.present()) a.opt.gk = drop_dim(d.gk.view(), 1, t);
  if (d.gv.present()) a.opt.gv = drop_dim(d.gv.view(), 1, t);
  a.opt.state_layout = d.spec.layout;
  return a;
}

/// Tokens [t0, t0 + n) (multi-token form) of a dense problem.
inline token_args window_of(const problem_data& d, std::int64_t t0, std::int64_t n, const step_options& base = {}) {
  token_args a;
  a.q = window(d.q.view(), 1, t0, n);
  a.k = window(d.k.view(), 1, t0, n);
  a.v = window(d.v.view(), 1, t0, n);
  a.opt = base;
  if (d.g.present()) a.opt.g = window(d.g.view(), 1, t0, n);
  if (d.g_gamma.present()) a.opt.g_gamma = d.g_gamma.view();
  if (d.gk.present()) a.opt.gk = window(d.gk.view(), 1, t0, n);
  if (d.gv.present()) a.opt.gv = window(d.gv.view(), 1, t0, n);
  a.opt.state_layout = d.spec.layout;
  return a;
}

/// A forward problem made of tokens [t0, t0 + n) of `d` (dense copies), for prefill.
inline problem_data prefix_of(const problem_data& d, std::int64_t n) {
  problem_data p = d;
  p.spec.T = n;
  p.q = slice(d.q.view(), 1, 0, n);
  p.k = slice(d.k.view(), 1, 0, n);
  p.v = slice(d.v.view(), 1, 0, n);
  if (d.g.present()) p.g = slice(d.g.view(), 1, 0, n);
  if (d.gk.present()) p.gk = slice(d.gk.view(), 1, 0, n);
  if (d.gv.present()) p.gv = slice(d.gv.view(), 1, 0, n);
  return p;
}

/// A state pool [P, H, r, c] of dtype `t`, every element `fill` (NaN by default: a slot the
/// step reads without a state put there poisons its output).
inline buffer make_pool(dtype t, std::int64_t P, const problem_spec& s) {
  std::vector<std::int64_t> shape = s.state_shape();
  shape[0] = P;
  return buffer(t, shape);
}

/// Copies state n of `states` ([N, H, r, c]) into slot `slot` of `pool` (rounded to its dtype).
inline void put_state(buffer& pool, std::int64_t slot, const tensor_view& states, std::int64_t n) {
  for_each_index({states.size(1), states.size(2), states.size(3)}, [&](const idx& i) {
    pool.set({slot, i[0], i[1], i[2]}, element(states, {n, i[0], i[1], i[2]}));
  });
}

/// Slot `slot` of a pool as a [H, r, c] view.
inline tensor_view slot_view(const buffer& pool, std::int64_t slot) { return drop_dim(pool.view(), 0, slot); }

/// Runs the prefill + token-by-token steps and checks them against forward and the reference.
/// `state_type`: the pool's storage (bfloat16: one rounding per step, looser bounds).
inline void check_prefill_then_steps(problem_spec s, std::int64_t prefill, dtype state_type) {
  INFO(s.str() << " prefill=" << prefill << " state=" << dtype_name(state_type));
  const problem_data d = generate(s);
  forward_options fo = d.options();
  fo.return_state = true;
  const forward_result full = recurrent_attention(d.q.view(), d.k.view(), d.v.view(), fo);
  const forward_result ref = reference_recurrent_attention(d.q.view(), d.k.view(), d.v.view(), fo);

  const problem_data pre = prefix_of(d, prefill);
  forward_options po = pre.options();
  po.return_state = true;
  const forward_result head = recurrent_attention(pre.q.view(), pre.k.view(), pre.v.view(), po);

  // Row b lives in slot P - 1 - b of a pool with two spare slots, which stay untouched.
  const std::int64_t P = s.B + 2;
  buffer pool = make_pool(state_type, P, s);
  pool.fill_bytes(sentinel_byte);
  std::vector<std::int64_t> slots;
  for (std::int64_t b = 0; b < s.B; ++b) {
    slots.push_back(P - 1 - b);
    put_state(pool, P - 1 - b, *head.final_state, b);
  }
  const buffer slot_idx = index_buffer(slots, dtype::int32);
  step_options base;
  base.state_indices = slot_idx.view();

  const bool exact = state_type == s.state_type();
  // Step against forward: float rounding of two summation orders (and of the output dtype).
  const double vs_forward = s.type == dtype::float64 ? 1e-12 : s.type == dtype::float32 ? 1e-5 : 1e-2;
  buffer out = sentinel_buffer(s.type, {s.B, s.H(), s.V});
  buffer got(s.type, s.output_shape());  // the steps' outputs, gathered
  double worst = 0;
  for (std::int64_t t = prefill; t < s.T; ++t) {
    const token_args a = token_of(d, t, base);
    step(a.q, a.k, a.v, pool.mutable_view(), out.mutable_view(), a.opt);
    worst = std::max(worst, rel_error(out.view(), drop_dim(full.output.view(), 1, t)));
    for_each_index({s.B, s.H(), s.V}, [&](const idx& i) { got.set({i[0], t, i[1], i[2]}, element(out.view(), i)); });
  }
  CHECK(worst < (exact ? vs_forward : 1e-2));
  for (std::int64_t b = 0; b < s.B; ++b)
    CHECK(rel_error(slot_view(pool, P - 1 - b), drop_dim(full.final_state->view(), 0, b)) < (exact ? vs_forward : 1e-2));
  for (std::int64_t spare = 0; spare < 2; ++spare) {
    buffer slot_bytes = buffer::copy_of(slot_view(pool, spare));
    CHECK(untouched(slot_bytes));
  }
  // Against the double reference: the stepped tokens and the final state.
  const buffer got_tail = slice(got.view(), 1, prefill, s.T - prefill);
  const buffer ref_tail = slice(ref.output.view(), 1, prefill, s.T - prefill);
  CHECK(rel_error(got_tail.view(), ref_tail.view()) < tolerance(s.type));
  buffer final_states(dtype::float64, s.state_shape());
  for (std::int64_t b = 0; b < s.B; ++b) {
    for_each_index({s.H(), s.state_shape()[2], s.state_shape()[3]}, [&](const idx& i) {
      final_states.set({b, i[0], i[1], i[2]}, pool.get({P - 1 - b, i[0], i[1], i[2]}));
    });
  }
  CHECK(rel_error(final_states.view(), ref.final_state->view()) < (exact ? tolerance(s.type) : 1e-2));
}


}  // namespace recattn::testing
