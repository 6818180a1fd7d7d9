// SPEC §1-§3.2 invariants of the backward pass, kernel against kernel: a sequence split in
// two with the state (and its gradient) passed equals the whole; reverse equals forward on
// time-flipped inputs; varlen equals each sequence on its own (empty ones included); grouped
// heads get the sum over the heads that share them; the [V, K] state layout is the [K, V]
// one transposed; g_gamma [H] gets the sum over sequences; caller-owned strided buffers;
// SPEC §5: bad input is rejected before anything is written.
//
// Built with every gate present only (RECATTN_GATE_MASK_ONLY=15, tests/backward.cmake): each
// property is checked for all gradients at once.
#include <catch2/catch.hpp>

#include <functional>

#include "test_backward_common.hpp"

using namespace recattn;
using namespace recattn::testing;

namespace {

constexpr double same = 2e-5;  // two float kernel runs summing in a different order

problem_spec base_spec() {
  problem_spec s;
  s.B = 2;
  s.T = 37;
  s.Hq = 2;
  s.Hk = 2;
  s.Hv = 2;
  s.K = 13;
  s.V = 19;
  s.gates = 15;
  s.initial_state = true;
  s.g_gamma_per_sequence = true;
  s.seed = 3;
  return s;
}

/// backward on explicit tensors (for rearranged inputs).
struct inputs {
  buffer q, k, v, g, g_gamma, gk, gv, h0, dO, dht, cu;
  forward_options options(bool reverse) const {
    forward_options o;
    if (g.present()) o.g = g.view();
    if (g_gamma.present()) o.g_gamma = g_gamma.view();
    if (gk.present()) o.gk = gk.view();
    if (gv.present()) o.gv = gv.view();
    if (h0.present()) o.initial_state = h0.view();
    if (cu.present()) o.cu_seqlens = cu.view();
    o.reverse = reverse;
    return o;
  }
  output_grads grads() const {
    output_grads g{dO.view(), std::nullopt};
    if (dht.present()) g.d_final_state = dht.view();
    return g;
  }
  backward_result backward(bool reverse = false) const {
    return recurrent_attention_backward(q.view(), k.view(), v.view(), options(reverse), grads());
  }
};

inputs inputs_of(const problem_data& d, const incoming& in) {
  inputs x;
  x.q = buffer::copy_of(d.q);
  x.k = buffer::copy_of(d.k);
  x.v = buffer::copy_of(d.v);
  if (d.g.present()) x.g = buffer::copy_of(d.g);
  if (d.g_gamma.present()) x.g_gamma = buffer::copy_of(d.g_gamma);
  if (d.gk.present()) x.gk = buffer::copy_of(d.gk);
  if (d.gv.present()) x.gv = buffer::copy_of(d.gv);
  if (d.initial_state.present()) x.h0 = buffer::copy_of(d.initial_state);
  if (d.cu_seqlens.present()) x.cu = buffer::copy_of(d.cu_seqlens);
  x.dO = buffer::copy_of(in.dO);
  if (in.dht.present()) x.dht = buffer::copy_of(in.dht);
  return x;
}

/// Applies f to every time-indexed tensor (q, k, v, g, gk, gv, dO).
void each_timed(inputs& x, const std::function<buffer(const buffer&)>& f) {
  for (buffer* b : {&x.q, &x.k, &x.v, &x.g, &x.gk, &x.gv, &x.dO})
    if (b->present()) *b = f(*b);
}

}  // namespace

TEST_CASE("backward: a sequence split in two with the state passed equals the whole", "[backward][invariants]") {
  const problem_spec s = base_spec();
  const problem_data d = generate(s);
  const incoming in = make_incoming(s, true, 5);
  const inputs whole = inputs_of(d, in);
  const backward_result w = whole.backward();
  const std::int64_t T1 = 15, T2 = s.T - T1;

  inputs a = whole, b = whole;
  each_timed(a, [&](const buffer& x) { return slice(x.view(), 1, 0, T1); });
  each_timed(b, [&](const buffer& x) { return slice(x.view(), 1, T1, T2); });
  // The state after the first part, from the forward; then part two, then part one with the
  // gradient of that state.
  forward_options fa = a.options(false);
  fa.return_state = true;
  const forward_result fwd_a = recurrent_attention(a.q.view(), a.k.view(), a.v.view(), fa);
  b.h0 = buffer::copy_of(*fwd_a.final_state);
  const backward_result gb = b.backward();
  a.dht = buffer::copy_of(*gb.d_initial_state);
  const backward_result ga = a.backward();

  auto part = [&](const tensor& t, std::int64_t begin, std::int64_t len) { return slice(t.view(), 1, begin, len); };
  CHECK(rel_error(part(w.dq, 0, T1), ga.dq) < same);
  CHECK(rel_error(part(w.dq, T1, T2), gb.dq) < same);
  CHECK(rel_error(part(w.dk, 0, T1), ga.dk) < same);
  CHECK(rel_error(part(w.dk, T1, T2), gb.dk) < same);
  CHECK(rel_error(part(w.dv, 0, T1), ga.dv) < same);
  CHECK(rel_error(part(w.dv, T1, T2), gb.dv) < same);
  CHECK(rel_error(part(*w.dg, 0, T1), *ga.dg) < same);
  CHECK(rel_error(part(*w.dg, T1, T2), *gb.dg) < same);
  CHECK(rel_error(part(*w.dgk, 0, T1), *ga.dgk) < same);
  CHECK(rel_error(part(*w.dgk, T1, T2), *gb.dgk) < same);
  CHECK(rel_error(part(*w.dgv, 0, T1), *ga.dgv) < same);
  CHECK(rel_error(part(*w.dgv, T1, T2), *gb.dgv) < same);
  CHECK(rel_error(*w.d_initial_state, *ga.d_initial_state) < same);
  buffer gamma_sum = buffer::copy_of(*ga.dg_gamma);
  for_each_index(gamma_sum.shape(), [&](const idx& i) { gamma_sum.set(i, gamma_sum.get(i) + element(*gb.dg_gamma, i)); });
  CHECK(rel_error(*w.dg_gamma, gamma_sum) < same);
}

TEST_CASE("backward: reverse equals forward on time-flipped inputs, dense and varlen", "[backward][invariants]") {
  for (bool varlen : {false, true}) {
    problem_spec s = base_spec();
    if (varlen) s.with_seqlens({9, 0, 14, 1});
    const problem_data d = generate(s);
    const incoming in = make_incoming(s, true, 6);
    INFO(s.str());
    const inputs x = inputs_of(d, in);
    const std::vector<std::int64_t> cu = varlen ? s.cu_seqlens() : std::vector<std::int64_t>{};
    inputs flipped = x;
    each_timed(flipped, [&](const buffer& b) { return flip_time(b.view(), cu); });
    const backward_result rev = x.backward(true);
    const backward_result fwd = flipped.backward(false);
    CHECK(rel_error(rev.dq, flip_time(fwd.dq.view(), cu)) < same);
    CHECK(rel_error(rev.dk, flip_time(fwd.dk.view(), cu)) < same);
    CHECK(rel_error(rev.dv, flip_time(fwd.dv.view(), cu)) < same);
    CHECK(rel_error(*rev.dg, flip_time(fwd.dg->view(), cu)) < same);
    CHECK(rel_error(*rev.dgk, flip_time(fwd.dgk->view(), cu)) < same);
    CHECK(rel_error(*rev.dgv, flip_time(fwd.dgv->view(), cu)) < same);
    CHECK(rel_error(*rev.dg_gamma, *fwd.dg_gamma) < same);
    CHECK(rel_error(*rev.d_initial_state, *fwd.d_initial_state) < same);
  }
}

TEST_CASE("backward: varlen equals each sequence on its own, empty sequences included", "[backward][invariants]") {
  problem_spec s = base_spec();
  s.with_seqlens({6, 0, 17, 1, 0, 9});
  const problem_data d = generate(s);
  const incoming in = make_incoming(s, true, 8);
  const inputs x = inputs_of(d, in);
  const backward_result all = x.backward();
  const std::vector<std::int64_t> cu = s.cu_seqlens();
  for (std::size_t n = 0; n + 1 < cu.size(); ++n) {
    const std::int64_t t0 = cu[n], L = cu[n + 1] - cu[n];
    INFO("sequence " << n << " length " << L);
    const buffer dh0_n = slice(all.d_initial_state->view(), 0, std::int64_t(n), 1);
    const buffer dgam_n = slice(all.dg_gamma->view(), 0, std::int64_t(n), 1);
    if (L == 0) {  // its final state is its initial state: the gradient passes through
      CHECK(rel_error(dh0_n, slice(x.dht.view(), 0, std::int64_t(n), 1)) == 0);
      CHECK(rel_error(dgam_n, buffer(dtype::float32, dgam_n.shape()).fill([](const idx&) { return 0.0; })) == 0);
      continue;
    }
    inputs one = x;
    one.cu = buffer();
    each_timed(one, [&](const buffer& b) { return slice(b.view(), 1, t0, L); });
    one.h0 = slice(x.h0.view(), 0, std::int64_t(n), 1);
    one.dht = slice(x.dht.view(), 0, std::int64_t(n), 1);
    one.g_gamma = slice(x.g_gamma.view(), 0, std::int64_t(n), 1);
    const backward_result r = one.backward();
    auto seq = [&](const tensor& t) { return slice(t.view(), 1, t0, L); };
    CHECK(rel_error(seq(all.dq), r.dq) < same);
    CHECK(rel_error(seq(all.dk), r.dk) < same);
    CHECK(rel_error(seq(all.dv), r.dv) < same);
    CHECK(rel_error(seq(*all.dg), *r.dg) < same);
    CHECK(rel_error(seq(*all.dgk), *r.dgk) < same);
    CHECK(rel_error(seq(*all.dgv), *r.dgv) < same);
    CHECK(rel_error(dh0_n, *r.d_initial_state) < same);
    CHECK(rel_error(dgam_n, *r.dg_gamma) < same);
  }
}

TEST_CASE("backward: grouped heads get the sum over the heads that share them", "[backward][invariants]") {
  // Grouped-query (q has all heads), grouped-value (v has all heads) and a mixed grouping.
  for (auto heads : {std::array<std::int64_t, 3>{4, 2, 2}, std::array<std::int64_t, 3>{2, 2, 4},
                     std::array<std::int64_t, 3>{6, 2, 3}, std::array<std::int64_t, 3>{1, 1, 4}}) {
    problem_spec s = base_spec();
    s.Hq = heads[0];
    s.Hk = heads[1];
    s.Hv = heads[2];
    const std::int64_t H = s.H();
    const problem_data d = generate(s);
    const incoming in = make_incoming(s, true, 9);
    INFO(s.str());
    const inputs grouped = inputs_of(d, in);
    inputs full = grouped;
    full.q = repeat_interleave(grouped.q.view(), 2, H / s.Hq);
    full.k = repeat_interleave(grouped.k.view(), 2, H / s.Hk);
    full.v = repeat_interleave(grouped.v.view(), 2, H / s.Hv);
    const backward_result g = grouped.backward();
    const backward_result f = full.backward();
    auto summed = [&](const tensor& t, std::int64_t Hx) {
      std::vector<std::int64_t> shape = t.shape();
      shape[2] = Hx;
      buffer out(dtype::float64, shape);
      out.fill([](const idx&) { return 0.0; });
      for_each_index(t.shape(), [&](const idx& i) {
        idx j = i;
        j[2] = i[2] / (H / Hx);
        out.set(j, out.get(j) + element(t.view(), i));
      });
      return out;
    };
    CHECK(rel_error(g.dq, summed(f.dq, s.Hq)) < same);
    CHECK(rel_error(g.dk, summed(f.dk, s.Hk)) < same);
    CHECK(rel_error(g.dv, summed(f.dv, s.Hv)) < same);
    CHECK(rel_error(*g.dg, *f.dg) < same);
    CHECK(rel_error(*g.dgk, *f.dgk) < same);
    CHECK(rel_error(*g.dgv, *f.dgv) < same);
    CHECK(rel_error(*g.dg_gamma, *f.dg_gamma) < same);
    CHECK(rel_error(*g.d_initial_state, *f.d_initial_state) < same);
  }
}

TEST_CASE("backward: the [V, K] state layout is the [K, V] one transposed", "[backward][invariants]") {
  const problem_spec s = base_spec();
  const problem_data d = generate(s);
  const incoming in = make_incoming(s, true, 10);
  const inputs kv = inputs_of(d, in);
  inputs vk = kv;
  vk.h0 = transpose_last2(kv.h0.view());
  vk.dht = transpose_last2(kv.dht.view());
  forward_options o = vk.options(false);
  o.state_layout = state_layout::vk;
  const backward_result a = kv.backward();
  const backward_result b = recurrent_attention_backward(vk.q.view(), vk.k.view(), vk.v.view(), o, vk.grads());
  CHECK(rel_error(a.dq, b.dq) < same);
  CHECK(rel_error(a.dk, b.dk) < same);
  CHECK(rel_error(a.dv, b.dv) < same);
  CHECK(rel_error(*a.dgk, *b.dgk) < same);
  CHECK(rel_error(*a.dgv, *b.dgv) < same);
  CHECK(rel_error(*a.dg, *b.dg) < same);
  CHECK(rel_error(*a.dg_gamma, *b.dg_gamma) < same);
  CHECK(rel_error(transpose_last2(a.d_initial_state->view()), *b.d_initial_state) < same);
}

TEST_CASE("backward: g_gamma of shape [H] gets the sum over sequences of the [N, H] gradient", "[backward][invariants]") {
  for (bool varlen : {false, true}) {
    problem_spec s = base_spec();
    s.g_gamma_per_sequence = false;
    if (varlen) s.with_seqlens({4, 11, 0, 8});
    const problem_data d = generate(s);
    const incoming in = make_incoming(s, true, 12);
    const inputs per_head = inputs_of(d, in);
    inputs per_seq = per_head;
    per_seq.g_gamma = repeat_interleave(buffer(dtype::float32, {1, s.H()}).fill([&](const idx& i) {
                                          return per_head.g_gamma.get({i[1]});
                                        }).view(),
                                        0, s.N());
    const backward_result a = per_head.backward();
    const backward_result b = per_seq.backward();
    REQUIRE(a.dg_gamma->shape() == std::vector<std::int64_t>{s.H()});
    buffer sum(dtype::float64, {s.H()});
    sum.fill([&](const idx& i) {
      double x = 0;
      for (std::int64_t n = 0; n < s.N(); ++n) x += element(b.dg_gamma->view(), {n, i[0]});
      return x;
    });
    CHECK(rel_error(*a.dg_gamma, sum) < same);
    CHECK(rel_error(a.dq, b.dq) < same);
  }
}

TEST_CASE("backward: caller-owned strided buffers get exactly the allocating result", "[backward][buffers]") {
  problem_spec s = base_spec();
  s.strided = true;
  const problem_data d = generate(s);
  const incoming in = make_incoming(s, true, 13);
  const forward_options o = d.options();
  const backward_result ref = run_backward(d, o, in);
  const std::vector<std::int64_t> gaps{3, 1, 2};
  buffer dq = sentinel_buffer(s.type, d.q.shape(), gaps), dk = sentinel_buffer(s.type, d.k.shape(), gaps),
         dv = sentinel_buffer(s.type, d.v.shape(), gaps), dg = sentinel_buffer(dtype::float32, d.g.shape(), gaps),
         dgam = sentinel_buffer(dtype::float32, d.g_gamma.shape(), gaps),
         dgk = sentinel_buffer(dtype::float32, d.gk.shape(), gaps), dgv = sentinel_buffer(dtype::float32, d.gv.shape(), gaps),
         dh0 = sentinel_buffer(s.state_type(), s.state_shape(), gaps);
  backward_outputs outs{dq.mutable_view(), dk.mutable_view(), dv.mutable_view(), dg.mutable_view(), dgam.mutable_view(),
                        dgk.mutable_view(),  dgv.mutable_view(), dh0.mutable_view()};
  CHECK(can_implement_backward(d.q.view(), d.k.view(), d.v.view(), o, in.view(), outs).empty());
  recurrent_attention_backward(d.q.view(), d.k.view(), d.v.view(), o, in.view(), outs);
  CHECK(bitwise_equal(dq.view(), ref.dq.view()));
  CHECK(bitwise_equal(dk.view(), ref.dk.view()));
  CHECK(bitwise_equal(dv.view(), ref.dv.view()));
  CHECK(bitwise_equal(dg.view(), ref.dg->view()));
  CHECK(bitwise_equal(dgam.view(), ref.dg_gamma->view()));
  CHECK(bitwise_equal(dgk.view(), ref.dgk->view()));
  CHECK(bitwise_equal(dgv.view(), ref.dgv->view()));
  CHECK(bitwise_equal(dh0.view(), ref.d_initial_state->view()));
  for (const buffer* b : {&dq, &dk, &dv, &dg, &dgam, &dgk, &dgv, &dh0}) CHECK(gaps_untouched(*b));

  // A gradient not asked for is not computed, and the others do not change.
  backward_outputs fewer{dq.mutable_view(), dk.mutable_view(), dv.mutable_view(), {}, {}, {}, {}, {}};
  buffer dq2 = sentinel_buffer(s.type, d.q.shape());
  fewer.dq = dq2.mutable_view();
  recurrent_attention_backward(d.q.view(), d.k.view(), d.v.view(), o, in.view(), fewer);
  CHECK(bitwise_equal(dq2.view(), ref.dq.view()));
  // The member function is the same operation.
  const backward_result m = RecurrentAttention(platform::cpu).backward(d.q.view(), d.k.view(), d.v.view(), o, in.view());
  CHECK(bitwise_equal(m.dgk->view(), ref.dgk->view()));
}

TEST_CASE("backward: bad input is rejected before anything is written", "[backward][bad-input]") {
  problem_spec s = base_spec();
  s.K = 5;
  s.V = 3;
  const problem_data d = generate(s);
  const incoming in = make_incoming(s, true, 14);

  struct bufs {
    buffer dq, dk, dv, dg, dgam, dgk, dgv, dh0;
    backward_outputs outs;
  };
  auto fresh = [&] {
    bufs b;
    b.dq = sentinel_buffer(s.type, d.q.shape());
    b.dk = sentinel_buffer(s.type, d.k.shape());
    b.dv = sentinel_buffer(s.type, d.v.shape());
    b.dg = sentinel_buffer(dtype::float32, d.g.shape());
    b.dgam = sentinel_buffer(dtype::float32, d.g_gamma.shape());
    b.dgk = sentinel_buffer(dtype::float32, d.gk.shape());
    b.dgv = sentinel_buffer(dtype::float32, d.gv.shape());
    b.dh0 = sentinel_buffer(s.state_type(), s.state_shape());
    b.outs = backward_outputs{b.dq.mutable_view(),  b.dk.mutable_view(),  b.dv.mutable_view(),
                              b.dg.mutable_view(),  b.dgam.mutable_view(), b.dgk.mutable_view(),
                              b.dgv.mutable_view(), b.dh0.mutable_view()};
    return b;
  };
  buffer wrong_dO = buffer(s.type, {s.B, s.T, s.H(), s.V + 1});
  buffer dO_f64 = buffer(dtype::float64, s.output_shape());
  buffer dht_t = buffer(s.state_type(), {s.N(), s.H(), s.V, s.K});  // [V, K] with the [K, V] layout
  buffer dht_f64 = buffer(dtype::float64, s.state_shape());
  buffer bf16_dgk = sentinel_buffer(dtype::bfloat16, d.gk.shape());

  struct bad_case {
    const char* name;
    std::function<void(forward_options&, output_grads&, bufs&)> edit;
    const char* says;  ///< a word the message must contain
  };
  const std::vector<bad_case> cases = {
      {"dO shape", [&](forward_options&, output_grads& g, bufs&) { g.d_output = wrong_dO.view(); }, "d_output"},
      {"dO dtype", [&](forward_options&, output_grads& g, bufs&) { g.d_output = dO_f64.view(); }, "d_output"},
      {"dO null", [&](forward_options&, output_grads& g, bufs&) {
         g.d_output = tensor_view(nullptr, s.type, in.dO.shape());
       }, "d_output"},
      {"d_final_state shape", [&](forward_options&, output_grads& g, bufs&) { g.d_final_state = dht_t.view(); }, "d_final_state"},
      {"d_final_state dtype", [&](forward_options&, output_grads& g, bufs&) { g.d_final_state = dht_f64.view(); }, "d_final_state"},
      {"dgk without gk", [&](forward_options& o, output_grads&, bufs&) { o.gk.reset(); }, "dgk"},
      {"d_initial_state without initial_state",
       [&](forward_options& o, output_grads&, bufs&) { o.initial_state.reset(); }, "d_initial_state"},
      {"dg without g", [&](forward_options& o, output_grads&, bufs&) { o.g.reset(); }, "dg"},
      {"dq shape", [&](forward_options&, output_grads&, bufs& b) { b.outs.dq = b.dv.mutable_view(); }, "dq"},
      {"dgk dtype", [&](forward_options&, output_grads&, bufs& b) { b.outs.dgk = bf16_dgk.mutable_view(); }, "dgk"},
      {"dv overlapping dk", [&](forward_options&, output_grads&, bufs& b) {
         b.outs.dv = mutable_tensor_view(b.dk.data(), s.type, d.v.shape());
       }, "dv"},
      {"forward input: bad g_gamma", [&](forward_options& o, output_grads&, bufs&) { o.g_gamma = d.g.view(); }, "g_gamma"},
      {"platform cuda", [&](forward_options& o, output_grads&, bufs&) { o.platform = platform::cuda; }, "platform"},
  };
  for (const bad_case& c : cases) {
    INFO(c.name);
    forward_options o = d.options();
    output_grads g = in.view();
    bufs b = fresh();
    c.edit(o, g, b);
    CHECK_FALSE(can_implement_backward(d.q.view(), d.k.view(), d.v.view(), o, g, b.outs).empty());
    try {
      recurrent_attention_backward(d.q.view(), d.k.view(), d.v.view(), o, g, b.outs);
      FAIL("no recattn::Error");
    } catch (const Error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(c.says) != std::string::npos);
    }
    for (const buffer* x : {&b.dq, &b.dk, &b.dv, &b.dg, &b.dgam, &b.dgk, &b.dgv, &b.dh0}) CHECK(untouched(*x));
  }
}
