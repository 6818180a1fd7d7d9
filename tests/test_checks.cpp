// Issue 7, catalog (tests/CHECKS.md): the checks that no other test proved. Each breaks one
// argument of a valid call and asserts that recattn::Error names it, with the expected and
// the actual value, before anything is written.
//
// This translation unit is built with every variant cap (tests/reliability.cmake): float32,
// forward direction, dense, [K, V] state, all four gates. So it also proves the caps' own
// check: a call that needs a cut variant is a recattn::Error naming the macro.
#include <catch2/catch.hpp>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>

#include "support/forward.hpp"
#include "support/rejects.hpp"
#include "test_backward_common.hpp"
#include "test_step_common.hpp"

using namespace recattn;
using namespace recattn::testing;
using Catch::Matchers::Contains;

namespace {

problem_spec spec(dtype type = dtype::float32) {
  problem_spec s;
  s.type = type;
  s.B = 2, s.T = 5, s.Hq = 2, s.Hk = 2, s.Hv = 2, s.K = 4, s.V = 3;
  s.gates = 15;
  s.initial_state = true;
  s.g_gamma_per_sequence = true;
  return s;
}

/// A valid forward call into sentinel buffers.
struct forward_call : replacements {
  problem_data d;
  tensor_view q, k, v;
  forward_options o;
  buffer out, state;
  explicit forward_call(problem_spec s) : d(generate(s)) {
    q = d.q, k = d.k, v = d.v;
    o = d.options();
    o.return_state = true;
    out = d.make_output();
    state = d.make_state();
  }
  forward_call(const forward_call&) = delete;
  std::string run() {
    return error_of([&] { recurrent_attention(q, k, v, o, {out.mutable_view(), state.mutable_view()}); });
  }
};

/// A valid backward call (every gradient asked for) into sentinel buffers.
struct backward_call : replacements {
  problem_data d;
  incoming in;
  forward_options o;
  output_grads g;
  std::vector<buffer> grads;
  backward_outputs outs;
  explicit backward_call(problem_spec s) : d(generate(s)), in(make_incoming(s, true, 11)) {
    o = d.options();
    g = in.view();
    // A gradient buffer for every input given (an absent gate gets none: asking for its
    // gradient is an error of its own).
    for (const buffer* b : {&d.q, &d.k, &d.v, &d.g, &d.g_gamma, &d.gk, &d.gv, &d.initial_state})
      grads.push_back(b->present() ? sentinel_buffer(b->type(), b->shape()) : buffer());
    outs.dq = grads[0].mutable_view();
    outs.dk = grads[1].mutable_view();
    outs.dv = grads[2].mutable_view();
    std::optional<mutable_tensor_view>* opt[] = {&outs.dg, &outs.dg_gamma, &outs.dgk, &outs.dgv, &outs.d_initial_state};
    for (std::size_t i = 3; i < grads.size(); ++i)
      if (grads[i].present()) *opt[i - 3] = grads[i].mutable_view();
  }
  backward_call(const backward_call&) = delete;
  std::string run() {
    return error_of([&] { recurrent_attention_backward(d.q, d.k, d.v, o, g, outs); });
  }
  /// The gradient buffers of the valid call and every replacement `sentinel` made.
  bool untouched_all() const {
    for (const buffer& b : grads)
      if (b.present() && !untouched(b)) return false;
    return sentinels_untouched();
  }
};

}  // namespace

TEST_CASE("checks: the valid calls these tests break are accepted and computed", "[checks]") {
  forward_call f(spec());
  REQUIRE(f.run().empty());
  forward_options o = f.o;
  const forward_result ref = run_reference(f.d, o);
  CHECK(rel_error(f.out, ref.output) < 1e-4);
  backward_call b(spec());
  REQUIRE(b.run().empty());
  const backward_result gref = run_reference_backward(b.d, b.o, b.in);
  CHECK(rel_error(b.grads[0], gref.dq) < 1e-4);
  CHECK(rel_error(b.grads[6], *gref.dgv) < 1e-4);
}

TEST_CASE("checks: key or value with no heads", "[checks][forward]") {
  forward_call f(spec());
  SECTION("key") {
    f.k = f.make(dtype::float32, {2, 5, 0, 4});
    check_message(f.run(), "key", "at least one head", "[2, 5, 0, 4]");
  }
  SECTION("value") {
    f.v = f.make(dtype::float32, {2, 5, 0, 3});
    check_message(f.run(), "value", "at least one head", "[2, 5, 0, 3]");
  }
  CHECK(untouched(f.out));
  CHECK(untouched(f.state));
}

TEST_CASE("checks: negative sizes", "[checks][forward]") {
  forward_call f(spec());
  // B = -1 in q, k and v alike, so that only the size check itself can reject it.
  f.q = tensor_view(f.d.q.data(), dtype::float32, {-1, 5, 2, 4});
  f.k = tensor_view(f.d.k.data(), dtype::float32, {-1, 5, 2, 4});
  f.v = tensor_view(f.d.v.data(), dtype::float32, {-1, 5, 2, 3});
  check_message(f.run(), "query", "non-negative sizes", "[-1, 5, 2, 4]");
  CHECK(untouched(f.out));
  CHECK(untouched(f.state));
}

TEST_CASE("checks: tensor_view and tensor reject what they cannot describe", "[checks][tensor]") {
  float x[8] = {};
  check_message(error_of([&] { tensor_view(x, dtype::float32, {1, 1, 1, 1, 8}); }), "tensor_view", "rank <= 4", "5");
  check_message(error_of([&] { tensor_view(x, dtype::float32, {2, 4}, {4}); }), "tensor_view strides", "2 strides", "1");
  const tensor t(dtype::float32, {2, 3});
  check_message(error_of([&] { (void)t.data<double>(); }), "tensor::data<T>", "float32", "float64");
}

TEST_CASE("checks: get_impl for a platform this translation unit lacks", "[checks][platform]") {
  check_message(error_of([] { (void)RecurrentAttention().get_impl(platform::cuda); }), "platform",
                "cpu or cuda (compiled into this translation unit)", "cuda");
  CHECK(RecurrentAttention().get_impl(platform::automatic).platform == platform::cpu);
}

TEST_CASE("checks: a call that needs a variant this build cut names the macro (forward and backward)",
          "[checks][caps]") {
  struct cut {
    const char* macro;
    std::function<void(problem_spec&, forward_options&)> edit;
  };
  const std::vector<cut> cuts = {
      {"RECATTN_DISABLE_FLOAT64", [](problem_spec& s, forward_options&) { s.type = dtype::float64; }},
      {"RECATTN_DISABLE_BFLOAT16", [](problem_spec& s, forward_options&) { s.type = dtype::bfloat16; }},
      {"RECATTN_DISABLE_FLOAT16", [](problem_spec& s, forward_options&) { s.type = dtype::float16; }},
      {"RECATTN_DISABLE_REVERSE", [](problem_spec&, forward_options& o) { o.reverse = true; }},
      {"RECATTN_DISABLE_VARLEN", [](problem_spec& s, forward_options&) { s.with_seqlens({2, 3}); }},
      {"RECATTN_DISABLE_VK_STATE", [](problem_spec& s, forward_options&) { s.layout = state_layout::vk; }},
      {"RECATTN_GATE_MASK_ONLY", [](problem_spec& s, forward_options&) { s.gates = gate_g | gate_gk; }},
  };
  for (const cut& c : cuts) {
    INFO(c.macro);
    problem_spec s = spec();
    forward_options edits;
    c.edit(s, edits);
    {
      forward_call f(s);
      f.o.reverse = edits.reverse;
      const std::string m = f.run();
      CHECK_THAT(m, Contains(c.macro) && Contains("compiled"));
      CHECK(untouched(f.out));
      CHECK(untouched(f.state));
    }
    {
      backward_call b(s);
      b.o.reverse = edits.reverse;
      const std::string m = b.run();
      CHECK_THAT(m, Contains(c.macro) && Contains("compiled"));
      CHECK(b.untouched_all());
    }
  }
}

TEST_CASE("checks: backward gradient buffers of the wrong shape, dtype or null", "[checks][backward]") {
  const int which = GENERATE(range(0, 8));
  const char* names[] = {"dq", "dk", "dv", "dg", "dg_gamma", "dgk", "dgv", "d_initial_state"};
  INFO(names[which]);
  auto slot = [](backward_outputs& o, int i) -> mutable_tensor_view& {
    switch (i) {
      case 0: return o.dq;
      case 1: return o.dk;
      case 2: return o.dv;
      case 3: return *o.dg;
      case 4: return *o.dg_gamma;
      case 5: return *o.dgk;
      case 6: return *o.dgv;
      default: return *o.d_initial_state;
    }
  };
  SECTION("shape") {
    backward_call b(spec());
    std::vector<std::int64_t> sh = b.grads[std::size_t(which)].shape();
    sh.back() += 1;
    slot(b.outs, which) = b.sentinel(dtype::float32, sh);
    check_message(b.run(), names[which], "shape", "");
    CHECK(b.untouched_all());
  }
  SECTION("dtype") {
    backward_call b(spec());
    slot(b.outs, which) = b.sentinel(dtype::float64, b.grads[std::size_t(which)].shape());
    check_message(b.run(), names[which], "dtype float32", "dtype float64");
    CHECK(b.untouched_all());
  }
  SECTION("null") {
    backward_call b(spec());
    slot(b.outs, which) = mutable_tensor_view(nullptr, dtype::float32, b.grads[std::size_t(which)].shape());
    check_message(b.run(), names[which], "non-null data", "null pointer");
    CHECK(b.untouched_all());
  }
}

TEST_CASE("checks: backward d_final_state with null data", "[checks][backward]") {
  backward_call b(spec());
  b.g.d_final_state = tensor_view(nullptr, dtype::float32, b.in.dht.shape());
  check_message(b.run(), "d_final_state", "non-null data", "null pointer");
  CHECK(b.untouched_all());
}

TEST_CASE("checks: a gate gradient for a gate the forward did not get (dg_gamma, dgv)", "[checks][backward]") {
  backward_call b(spec());
  SECTION("dg_gamma") {
    b.o.g_gamma.reset();
    check_message(b.run(), "dg_gamma", "no buffer (no g_gamma was given to the forward)", "[2, 2]");
  }
  SECTION("dgv") {
    b.o.gv.reset();
    check_message(b.run(), "dgv", "no buffer (no gv was given to the forward)", "[2, 5, 2, 3]");
  }
  CHECK(b.untouched_all());
}

TEST_CASE("checks: a gradient buffer overlapping an input", "[checks][backward]") {
  {
    backward_call b(spec());
    const std::vector<unsigned char> before = b.d.q.bytes();
    b.outs.dq = mutable_tensor_view(b.d.q.data(), dtype::float32, b.d.q.shape(), b.d.q.strides());
    check_message(b.run(), "dq", "memory disjoint from every input", "a buffer overlapping query");
    CHECK(b.untouched_all());
    CHECK(b.d.q.bytes() == before);
  }
  {
    backward_call b(spec());
    const std::vector<unsigned char> before = b.in.dO.bytes();
    b.outs.dgk = mutable_tensor_view(b.in.dO.data(), dtype::float32, {2, 5, 2, 4});
    check_message(b.run(), "dgk", "memory disjoint from every input", "a buffer overlapping d_output");
    CHECK(b.untouched_all());
    CHECK(b.in.dO.bytes() == before);
  }
}

// ---------------------------------------------------------------------------------------
// Step (step_problem.hpp): the checks tests/test_step_bad_input.cpp does not reach.

namespace {

/// A valid single-token step (B2 H2 K4 V3, or B1, every gate, state_indices with spare
/// slots, no snapshots) into sentinel buffers.
struct step_call : replacements {
  problem_data d;
  tensor_view q, k, v;
  step_options o;
  buffer pool, out, ix;
  mutable_tensor_view pool_view, out_view;
  explicit step_call(dtype type = dtype::float32, std::int64_t B = 2) : d(generate(spec(type, B))) {
    const token_args a = token_of(d, 0);
    q = a.q, k = a.k, v = a.v;
    o = a.opt;
    pool = sentinel_buffer(d.spec.state_type(), {4, 2, 4, 3});
    out = sentinel_buffer(type, {B, 2, 3});
    ix = index_buffer(B == 2 ? std::vector<std::int64_t>{3, 1} : std::vector<std::int64_t>{3});
    o.state_indices = ix.view();
    pool_view = pool.mutable_view();
    out_view = out.mutable_view();
  }
  step_call(const step_call&) = delete;
  static problem_spec spec(dtype type, std::int64_t B) {
    problem_spec s;
    s.type = type;
    s.B = B, s.T = 1, s.Hq = 2, s.Hk = 2, s.Hv = 2, s.K = 4, s.V = 3;
    s.gates = 15;
    return s;
  }
  std::string run() {
    return error_of([&] { step(q, k, v, pool_view, out_view, o); });
  }
  /// The pool, the output and every replacement `sentinel` made.
  bool untouched_all() const { return sentinels_untouched() && untouched(pool) && untouched(out); }
};

}  // namespace

TEST_CASE("checks: the valid step these tests break is accepted and computed", "[checks][step]") {
  step_call c;
  // Slots 3 and 1 start from zero states: the output is then the forward's from no state.
  for (std::int64_t slot : {1, 3})
    for_each_index({2, 4, 3}, [&](const idx& i) { c.pool.set({slot, i[0], i[1], i[2]}, 0.0); });
  REQUIRE(c.run().empty());
  forward_options fo = c.d.options();
  const forward_result ref = run_reference(c.d, fo);
  CHECK(rel_error(c.out.view(), drop_dim(ref.output.view(), 1, 0)) < 1e-4);
}

TEST_CASE("checks: step with V = 0, a value with no heads, or negative sizes", "[checks][step]") {
  step_call c;
  SECTION("V = 0") {
    c.v = c.make(dtype::float32, {2, 2, 0});
    check_message(c.run(), "value", "V >= 1 (last dimension)", "[2, 2, 0]");
  }
  SECTION("no value heads") {
    c.v = c.make(dtype::float32, {2, 0, 3});
    check_message(c.run(), "value", "at least one head", "[2, 0, 3]");
  }
  SECTION("negative B") {
    c.q = tensor_view(c.d.q.data(), dtype::float32, {-1, 2, 4});
    c.k = tensor_view(c.d.k.data(), dtype::float32, {-1, 2, 4});
    c.v = tensor_view(c.d.v.data(), dtype::float32, {-1, 2, 3});
    check_message(c.run(), "query", "non-negative sizes", "[-1, 2, 4]");
  }
  CHECK(c.untouched_all());
}

TEST_CASE("checks: step gates of rank 3 (g_gamma) or with null data", "[checks][step]") {
  step_call c;
  SECTION("g_gamma rank 3") {
    c.o.g_gamma = c.make(dtype::float32, {2, 2, 1});
    check_message(c.run(), "g_gamma", "rank 1 [H] or rank 2 [B, H]", "rank 3 [2, 2, 1]");
  }
  SECTION("g null") {
    c.o.g = tensor_view(nullptr, dtype::float32, {2, 2});
    check_message(c.run(), "g", "non-null data", "null pointer");
  }
  SECTION("gv null") {
    c.o.gv = tensor_view(nullptr, dtype::float32, {2, 2, 3});
    check_message(c.run(), "gv", "non-null data", "null pointer");
  }
  CHECK(c.untouched_all());
}

TEST_CASE("checks: step state_pool of float32 for float64 inputs, or with a negative stride", "[checks][step]") {
  SECTION("float64 inputs") {
    // Checked before the dispatch, so a build without float64 kernels rejects it the same way.
    step_call c(dtype::float64);
    c.pool_view = c.sentinel(dtype::float32, {4, 2, 4, 3});
    check_message(c.run(), "state_pool", "dtype float64 (the state of float64 inputs)", "dtype float32");
    CHECK(c.untouched_all());
  }
  SECTION("negative slot stride") {
    step_call c;
    float* last = static_cast<float*>(c.pool.data()) + 3 * 24;
    c.pool_view = mutable_tensor_view(last, dtype::float32, {4, 2, 4, 3}, {-24, 12, 3, 1});
    check_message(c.run(), "state_pool", "non-negative strides", "stride -24 in dimension 0");
    CHECK(c.untouched_all());
  }
}

TEST_CASE("checks: step state_indices with null data or a stride other than 1", "[checks][step]") {
  SECTION("null") {
    step_call c;
    c.o.state_indices = tensor_view(nullptr, dtype::int64, {2});
    check_message(c.run(), "state_indices", "non-null data", "null pointer");
    CHECK(c.untouched_all());
  }
  SECTION("stride -1, two rows: the last-dimension check") {
    step_call c;
    c.o.state_indices = tensor_view(static_cast<const std::int64_t*>(c.ix.data()) + 1, dtype::int64, {2}, {-1});
    check_message(c.run(), "state_indices", "stride 1 in the last dimension", "stride -1");
    CHECK(c.untouched_all());
  }
  SECTION("stride -1, one row: the only case that reaches the non-negative stride check") {
    step_call c(dtype::float32, 1);
    c.o.state_indices = tensor_view(c.ix.data(), dtype::int64, {1}, {-1});
    check_message(c.run(), "state_indices", "a non-negative stride", "stride -1");
    CHECK(c.untouched_all());
  }
}

TEST_CASE("checks: step snapshots of the wrong rank, null, with a negative stride, or over the output",
          "[checks][step]") {
  step_call c;
  c.o.snapshot_indices = c.make(dtype::int64, {2}, 0.0);
  SECTION("rank") {
    c.o.snapshots = c.sentinel(dtype::float32, {2, 4, 3});
    check_message(c.run(), "snapshots", "rank 4 [P, H, K, V] (the state pool's layout)", "rank 3 [2, 4, 3]");
  }
  SECTION("null") {
    c.o.snapshots = mutable_tensor_view(nullptr, dtype::float32, {2, 2, 4, 3});
    check_message(c.run(), "snapshots", "non-null data", "null pointer");
  }
  SECTION("negative stride") {
    mutable_tensor_view s = c.sentinel(dtype::float32, {2, 2, 4, 3});
    c.o.snapshots = mutable_tensor_view(static_cast<float*>(s.data()) + 24, dtype::float32, {2, 2, 4, 3}, {-24, 12, 3, 1});
    check_message(c.run(), "snapshots", "non-negative strides", "stride -24 in dimension 0");
  }
  SECTION("output over the snapshots") {
    mutable_tensor_view s = c.sentinel(dtype::float32, {2, 2, 4, 3});
    c.o.snapshots = s;
    c.out_view = mutable_tensor_view(s.data(), dtype::float32, {2, 2, 3});
    check_message(c.run(), "output", "memory disjoint from state_pool and snapshots", "a buffer overlapping them");
  }
  CHECK(c.untouched_all());
}

TEST_CASE("checks: step snapshot_indices with null data or a negative stride", "[checks][step]") {
  SECTION("null") {
    step_call c;
    c.o.snapshots = c.sentinel(dtype::float32, {2, 2, 4, 3});
    c.o.snapshot_indices = tensor_view(nullptr, dtype::int64, {2});
    check_message(c.run(), "snapshot_indices", "non-null data", "null pointer");
    CHECK(c.untouched_all());
  }
  SECTION("negative stride (one row: with more, the last-dimension check fires first)") {
    step_call c(dtype::float32, 1);
    c.o.snapshots = c.sentinel(dtype::float32, {2, 2, 4, 3});
    const tensor_view si = c.make(dtype::int64, {1}, 0.0);
    c.o.snapshot_indices = tensor_view(si.data(), dtype::int64, {1}, {-1});
    check_message(c.run(), "snapshot_indices", "non-negative strides", "stride -1");
    CHECK(c.untouched_all());
  }
}

TEST_CASE("checks: step cu_seqlens of rank 2, empty, or not contiguous", "[checks][step]") {
  // A multi-token varlen call: q [1, 4, H, K], two sequences.
  step_call c;
  to_varlen_step(c, 4);
  c.o.g_gamma = c.make(dtype::float32, {2});
  SECTION("rank 2") {
    c.o.cu_seqlens = c.make(dtype::int64, {3, 1}, 0.0);
    check_message(c.run(), "cu_seqlens", "rank 1 [N + 1]", "rank 2 [3, 1]");
  }
  SECTION("empty") {
    c.o.cu_seqlens = c.make(dtype::int64, {0});
    check_message(c.run(), "cu_seqlens", "at least one entry [N + 1]", "[0]");
  }
  SECTION("stride 2, three entries: the last-dimension check") {
    // Values 0, 2, 4 at stride 2 (valid contents): only the stride is wrong.
    c.keep.push_back(buffer(dtype::int64, {6}).fill([](const idx& i) { return double(i[0]); }));
    c.o.cu_seqlens = tensor_view(c.keep.back().data(), dtype::int64, {3}, {2});
    check_message(c.run(), "cu_seqlens", "stride 1 in the last dimension", "stride 2");
  }
  SECTION("stride 2, one entry (no sequences, no tokens): the contiguity check") {
    to_varlen_step(c, 0);
    c.o.state_indices.reset();
    c.o.cu_seqlens = tensor_view(c.make(dtype::int64, {2}, 0.0).data(), dtype::int64, {1}, {2});
    check_message(c.run(), "cu_seqlens", "a contiguous tensor", "stride 2");
  }
  CHECK(c.untouched_all());
}

TEST_CASE("checks: step cfg fields below zero", "[checks][step]") {
  step_call c;
  cfg bad;
  SECTION("threads") {
    bad.threads = -1;
    c.o.cfg = bad;
    check_message(c.run(), "cfg.threads", "a value >= 0", "-1");
  }
  SECTION("block_v") {
    bad.block_v = -2;
    c.o.cfg = bad;
    check_message(c.run(), "cfg.block_v", "a value >= 0", "-2");
  }
  SECTION("chunk") {
    bad.chunk = -3;
    c.o.cfg = bad;
    check_message(c.run(), "cfg.chunk", "a value >= 0", "-3");
  }
  CHECK(c.untouched_all());
}

TEST_CASE("checks: a step that needs a variant this build cut names the macro", "[checks][step][caps]") {
  SECTION("dtypes") {
    for (auto [type, macro] : {std::pair{dtype::float64, "RECATTN_DISABLE_FLOAT64"},
                               std::pair{dtype::bfloat16, "RECATTN_DISABLE_BFLOAT16"},
                               std::pair{dtype::float16, "RECATTN_DISABLE_FLOAT16"}}) {
      INFO(macro);
      step_call c(type);
      CHECK_THAT(c.run(), Contains(macro) && Contains("compiled"));
      CHECK(c.untouched_all());
    }
  }
  SECTION("bfloat16 state storage") {
    step_call c;
    c.pool_view = c.sentinel(dtype::bfloat16, {4, 2, 4, 3});
    CHECK_THAT(c.run(), Contains("RECATTN_DISABLE_BF16_STATE") && Contains("compiled"));
    CHECK(c.untouched_all());
  }
  SECTION("[V, K] pool") {
    step_call c;
    c.o.state_layout = state_layout::vk;
    c.pool_view = c.sentinel(dtype::float32, {4, 2, 3, 4});
    CHECK_THAT(c.run(), Contains("RECATTN_DISABLE_VK_STATE") && Contains("compiled"));
    CHECK(c.untouched_all());
  }
  SECTION("varlen") {
    step_call c;
    to_varlen_step(c, 2);
    c.o.cu_seqlens = c.indices({0, 1, 2});
    CHECK_THAT(c.run(), Contains("RECATTN_DISABLE_VARLEN") && Contains("compiled"));
    CHECK(c.untouched_all());
  }
  SECTION("gates") {
    step_call c;
    c.o.gv.reset();
    CHECK_THAT(c.run(), Contains("RECATTN_GATE_MASK_ONLY") && Contains("compiled"));
    CHECK(c.untouched_all());
  }
}

namespace {

/// A CPU cfg field with an upper bound. Without the bounds, a huge cfg.chunk was a
/// std::bad_alloc (the staging buffers) and a huge cfg.threads started that many threads (a
/// std::system_error or an OpenMP abort), neither a recattn::Error.
struct cfg_bound {
  const char* name;
  int cfg::*field;
  int bound;
  bool step;  ///< the step reads it too
};

}  // namespace

TEST_CASE("checks: CPU cfg.chunk and cfg.threads above their bounds (forward, backward, step)", "[checks][cfg]") {
  const cfg_bound bounds[] = {{"cfg.chunk", &cfg::chunk, cpu::cpu_max_chunk, false},
                              {"cfg.threads", &cfg::threads, cpu::cpu_max_threads, true}};
  for (const cfg_bound& b : bounds) {
    INFO(b.name);
    const std::string want = "a value <= " + std::to_string(b.bound);
    for (const int value : {b.bound + 1, std::numeric_limits<int>::max()}) {
      cfg big;
      big.*b.field = value;
      const std::string got = std::to_string(value);
      {
        forward_call f(spec());
        f.o.cfg = big;
        check_message(f.run(), b.name, want, got);
        CHECK(untouched(f.out));
        CHECK(untouched(f.state));
      }
      {
        backward_call bc(spec());
        bc.o.cfg = big;
        check_message(bc.run(), b.name, want, got);
        CHECK(bc.untouched_all());
      }
      if (b.step) {
        step_call c;
        c.o.cfg = big;
        check_message(c.run(), b.name, want, got);
        CHECK(c.untouched_all());
      }
    }
    // The bound itself is accepted and computed (threads: the workers are capped by the
    // work items).
    cfg at_bound;
    at_bound.*b.field = b.bound;
    forward_call f(spec());
    f.o.cfg = at_bound;
    REQUIRE(f.run().empty());
    CHECK(rel_error(f.out, run_reference(f.d, f.o).output) < 1e-4);
    if (b.step) {
      step_call c;
      c.o.cfg = at_bound;
      CHECK(c.run().empty());
    }
  }
}
