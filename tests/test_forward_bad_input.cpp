// SPEC §5: every argument is checked before anything is written. Each check below starts from
// a valid call, breaks one argument and asserts that recattn::Error names that argument, the
// expected and the actual value, and that the sentinel-filled output and state buffers are
// bit for bit untouched.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>

#include "support/forward.hpp"
#include "support/rejects.hpp"

using namespace recattn;
using namespace recattn::testing;
using Catch::Matchers::Contains;

namespace {

/// A valid forward call (all four gates, an initial state, the final state asked for) into
/// sentinel buffers, that a test breaks one argument of.
struct call : replacements {
  problem_data d;
  tensor_view q, k, v;
  forward_options o;
  buffer out, state;
  bool pass_state_buffer = true;

  explicit call(problem_spec s) : d(generate(s)) {
    q = d.q, k = d.k, v = d.v;
    o = d.options();
    o.return_state = true;
    out = d.make_output();
    state = d.make_state();
  }
  call(const call&) = delete;  // the views point into this object's buffers
  call& operator=(const call&) = delete;
  forward_outputs outputs() {
    forward_outputs r{out.mutable_view(), std::nullopt};
    if (pass_state_buffer) r.final_state = state.mutable_view();
    return r;
  }
};

/// B2 T5 H2 K4 V3: K != V, so that a [K, V] state is not a [V, K] one.
problem_spec dense_spec(dtype type = dtype::float32) {
  problem_spec s;
  s.type = type;
  s.B = 2, s.T = 5, s.Hq = 2, s.Hk = 2, s.Hv = 2, s.K = 4, s.V = 3;
  s.gates = 15;
  s.initial_state = true;
  return s;
}

/// Varlen: B1 T8, sequences {3, 0, 5}.
problem_spec varlen_spec() {
  problem_spec s = dense_spec();
  s.with_seqlens({3, 0, 5});
  s.g_gamma_per_sequence = true;
  return s;
}

/// The forms of the forward call a check applies to.
enum form : unsigned {
  caller_owned = 1u,  ///< recurrent_attention(q, k, v, options, outputs)
  allocating = 2u,    ///< recurrent_attention(q, k, v, options)
  reference = 4u,     ///< reference_recurrent_attention(q, k, v, options)
  every_form = 7u,
};

/// Expects each form in `forms` to reject the call, naming `argument`, with nothing written
/// to the caller's output and state buffers. Checks about output buffers apply to the
/// caller-owned form only; the reference takes no cfg or platform.
void require_rejected(call& c, const std::string& argument, unsigned forms = every_form) {
  INFO("expected a recattn::Error naming " << argument);
  if (forms & caller_owned) {
    INFO("caller-owned form");
    check_message(error_of([&] { recurrent_attention(c.q, c.k, c.v, c.o, c.outputs()); }), argument);
    CHECK(untouched(c.out));
    CHECK(untouched(c.state));
  }
  if (forms & allocating) {
    INFO("allocating form");
    check_message(error_of([&] { (void)recurrent_attention(c.q, c.k, c.v, c.o); }), argument);
  }
  if (forms & reference) {
    INFO("reference");
    check_message(error_of([&] { (void)reference_recurrent_attention(c.q, c.k, c.v, c.o); }), argument);
  }
}

}  // namespace

TEST_CASE("the valid calls the bad-input tests start from are accepted", "[forward][bad_input]") {
  for (const problem_spec& s : {dense_spec(), varlen_spec()}) {
    INFO(s.str());
    call c(s);
    REQUIRE_NOTHROW(recurrent_attention(c.q, c.k, c.v, c.o, c.outputs()));
    CHECK_FALSE(untouched(c.out));
    CHECK_FALSE(untouched(c.state));
    CHECK(rel_error(c.out, run_reference(c.d, c.o).output) < 1e-4);
  }
}

TEST_CASE("bad input: q, k or v of the wrong rank", "[forward][bad_input]") {
  const std::string which = GENERATE(as<std::string>{}, "query", "key", "value");
  call c(dense_spec());
  tensor_view& t = which == "query" ? c.q : which == "key" ? c.k : c.v;
  t = tensor_view(t.data(), t.type(), {t.size(0) * t.size(1), t.size(2), t.size(3)});  // [B * T, H, D]
  require_rejected(c, which);
}

TEST_CASE("bad input: key with another B, T or K than query", "[forward][bad_input]") {
  const int dim = GENERATE(0, 1, 3);
  call c(dense_spec());
  std::vector<std::int64_t> shape = c.k.shape_vec();
  shape[std::size_t(dim)] += 1;
  c.k = c.make(dtype::float32, shape);
  require_rejected(c, "key");
}

TEST_CASE("bad input: value with another B or T than query", "[forward][bad_input]") {
  const int dim = GENERATE(0, 1);
  call c(dense_spec());
  std::vector<std::int64_t> shape = c.v.shape_vec();
  shape[std::size_t(dim)] += 1;
  c.v = c.make(dtype::float32, shape);
  require_rejected(c, "value");
}

TEST_CASE("bad input: K or V of zero, or no heads", "[forward][bad_input]") {
  call c(dense_spec());
  SECTION("K = 0") {
    c.q = c.make(dtype::float32, {2, 5, 2, 0});
    c.k = c.make(dtype::float32, {2, 5, 2, 0});
    c.o.gk.reset();
    require_rejected(c, "query");
  }
  SECTION("V = 0") {
    c.v = c.make(dtype::float32, {2, 5, 2, 0});
    c.o.gv.reset();
    require_rejected(c, "value");
  }
  SECTION("no query heads") {
    c.q = c.make(dtype::float32, {2, 5, 0, 4});
    require_rejected(c, "query");
  }
}

TEST_CASE("bad input: g of the wrong shape", "[forward][bad_input]") {
  const std::vector<std::int64_t> shape = GENERATE(std::vector<std::int64_t>{2, 5, 3}, std::vector<std::int64_t>{2, 4, 2},
                                                   std::vector<std::int64_t>{1, 5, 2}, std::vector<std::int64_t>{2, 5, 2, 1});
  call c(dense_spec());
  c.o.g = c.make(dtype::float32, shape);
  require_rejected(c, "g");
}

TEST_CASE("bad input: g_gamma of the wrong shape", "[forward][bad_input]") {
  const std::vector<std::int64_t> shape = GENERATE(std::vector<std::int64_t>{3}, std::vector<std::int64_t>{1},
                                                   std::vector<std::int64_t>{3, 2}, std::vector<std::int64_t>{2, 3},
                                                   std::vector<std::int64_t>{2, 2, 1});
  const bool varlen = GENERATE(false, true);
  call c(varlen ? varlen_spec() : dense_spec());  // B = 2 dense, N = 3 varlen: [3, 2] is wrong dense, right varlen
  if (varlen && shape == std::vector<std::int64_t>{3, 2}) return;
  c.o.g_gamma = c.make(dtype::float32, shape);
  require_rejected(c, "g_gamma");
}

TEST_CASE("bad input: g_gamma as [B, H] in varlen (N sequences, B = 1)", "[forward][bad_input]") {
  call c(varlen_spec());
  c.o.g_gamma = c.make(dtype::float32, {1, 2});
  require_rejected(c, "g_gamma");
}

TEST_CASE("bad input: gk of the wrong shape", "[forward][bad_input]") {
  const int dim = GENERATE(0, 1, 2, 3);
  call c(dense_spec());
  std::vector<std::int64_t> shape{2, 5, 2, 4};
  shape[std::size_t(dim)] += 1;
  c.o.gk = c.make(dtype::float32, shape);
  require_rejected(c, "gk");
}

TEST_CASE("bad input: gv of the wrong shape (K instead of V)", "[forward][bad_input]") {
  call c(dense_spec());
  c.o.gv = c.make(dtype::float32, {2, 5, 2, 4});
  require_rejected(c, "gv");
}

TEST_CASE("bad input: initial_state of the wrong shape", "[forward][bad_input]") {
  call c(dense_spec());
  SECTION("V + 1") { c.o.initial_state = c.make(dtype::float32, {2, 2, 4, 4}); }
  SECTION("one head too many") { c.o.initial_state = c.make(dtype::float32, {2, 3, 4, 3}); }
  SECTION("[K, V] with state_layout vk") {
    c.o.state_layout = state_layout::vk;
    c.state = sentinel_buffer(dtype::float32, {2, 2, 3, 4});
  }
  require_rejected(c, "initial_state");
}

TEST_CASE("bad input: initial_state with B instead of N rows (varlen)", "[forward][bad_input][varlen]") {
  call c(varlen_spec());
  c.o.initial_state = c.make(dtype::float32, {1, 2, 4, 3});
  require_rejected(c, "initial_state");
}

TEST_CASE("bad input: output of the wrong shape", "[forward][bad_input]") {
  const int dim = GENERATE(0, 1, 2, 3);
  call c(dense_spec());
  std::vector<std::int64_t> shape{2, 5, 2, 3};
  shape[std::size_t(dim)] += 1;
  c.out = sentinel_buffer(dtype::float32, shape);
  require_rejected(c, "output", caller_owned);
}

TEST_CASE("bad input: final_state of the wrong shape", "[forward][bad_input]") {
  call c(dense_spec());
  SECTION("[V, K] for the [K, V] layout") { c.state = sentinel_buffer(dtype::float32, {2, 2, 3, 4}); }
  SECTION("one sequence too many") { c.state = sentinel_buffer(dtype::float32, {3, 2, 4, 3}); }
  SECTION("rank 3") { c.state = sentinel_buffer(dtype::float32, {4, 4, 3}); }
  require_rejected(c, "final_state", caller_owned);
}

TEST_CASE("bad input: a head count that does not divide H", "[forward][bad_input]") {
  call c(dense_spec());
  c.o.g.reset(), c.o.gk.reset(), c.o.gv.reset(), c.o.g_gamma.reset(), c.o.initial_state.reset();
  c.pass_state_buffer = false;
  c.o.return_state = false;
  SECTION("query: 2 heads, H = 3") {
    c.k = c.make(dtype::float32, {2, 5, 3, 4});
    c.v = c.make(dtype::float32, {2, 5, 3, 3});
    c.out = sentinel_buffer(dtype::float32, {2, 5, 3, 3});
    require_rejected(c, "query");
  }
  SECTION("key: 2 heads, H = 3") {
    c.q = c.make(dtype::float32, {2, 5, 3, 4});
    c.out = sentinel_buffer(dtype::float32, {2, 5, 3, 3});
    require_rejected(c, "key");
  }
  SECTION("value: 3 heads, H = 4") {
    c.q = c.make(dtype::float32, {2, 5, 4, 4});
    c.k = c.make(dtype::float32, {2, 5, 4, 4});
    c.v = c.make(dtype::float32, {2, 5, 3, 3});
    c.out = sentinel_buffer(dtype::float32, {2, 5, 4, 3});
    require_rejected(c, "value");
  }
}

TEST_CASE("bad input: cu_seqlens not starting at 0", "[forward][bad_input][varlen]") {
  call c(varlen_spec());
  c.o.cu_seqlens = c.indices({1, 3, 3, 8});
  require_rejected(c, "cu_seqlens");
}

TEST_CASE("bad input: cu_seqlens decreasing", "[forward][bad_input][varlen]") {
  const dtype t = GENERATE(dtype::int32, dtype::int64);
  call c(varlen_spec());
  c.o.cu_seqlens = c.indices({0, 4, 2, 8}, t);
  require_rejected(c, "cu_seqlens");
}

TEST_CASE("bad input: cu_seqlens not ending at the token count", "[forward][bad_input][varlen]") {
  const std::int64_t last = GENERATE(7, 9);
  call c(varlen_spec());
  c.o.cu_seqlens = c.indices({0, 3, 3, last});
  require_rejected(c, "cu_seqlens");
}

TEST_CASE("bad input: cu_seqlens with B != 1", "[forward][bad_input][varlen]") {
  call c(dense_spec());  // B = 2, T = 5
  c.o.cu_seqlens = c.indices({0, 2, 5});
  require_rejected(c, "query");  // "query: expected batch size B = 1 with cu_seqlens ..."
  CHECK_THAT(error_of([&] { recurrent_attention(c.q, c.k, c.v, c.o, c.outputs()); }), Contains("cu_seqlens"));
}

TEST_CASE("bad input: cu_seqlens of the wrong dtype or rank", "[forward][bad_input][varlen]") {
  call c(varlen_spec());
  SECTION("float32") { c.o.cu_seqlens = c.make(dtype::float32, {4}); }
  SECTION("rank 2") {
    c.keep.push_back(buffer(dtype::int64, {2, 2}).fill([](const idx& i) { return double(i[0] * 2 + i[1]); }));
    c.o.cu_seqlens = c.keep.back().view();
  }
  SECTION("no entries") { c.o.cu_seqlens = c.indices({}); }
  require_rejected(c, "cu_seqlens");
}

TEST_CASE("bad input: null data", "[forward][bad_input]") {
  const std::string which = GENERATE(as<std::string>{}, "query", "key", "value", "g", "g_gamma", "gk", "gv",
                                     "initial_state", "cu_seqlens", "output", "final_state");
  call c(which == "cu_seqlens" ? varlen_spec() : dense_spec());
  if (which == "query") c.q = null_data(c.q);
  if (which == "key") c.k = null_data(c.k);
  if (which == "value") c.v = null_data(c.v);
  if (which == "g") c.o.g = null_data(*c.o.g);
  if (which == "g_gamma") c.o.g_gamma = null_data(*c.o.g_gamma);
  if (which == "gk") c.o.gk = null_data(*c.o.gk);
  if (which == "gv") c.o.gv = null_data(*c.o.gv);
  if (which == "initial_state") c.o.initial_state = null_data(*c.o.initial_state);
  if (which == "cu_seqlens") c.o.cu_seqlens = null_data(*c.o.cu_seqlens);
  if (which == "output" || which == "final_state") {
    forward_outputs outs = c.outputs();
    if (which == "output") outs.output = mutable_tensor_view(nullptr, outs.output.type(), outs.output.shape_vec());
    else outs.final_state = mutable_tensor_view(nullptr, outs.final_state->type(), outs.final_state->shape_vec());
    check_message(error_of([&] { recurrent_attention(c.q, c.k, c.v, c.o, outs); }), which);
    CHECK(untouched(c.out));
    CHECK(untouched(c.state));
    return;
  }
  require_rejected(c, which);
}

TEST_CASE("bad input: key or value of another dtype than query", "[forward][bad_input]") {
  const std::string which = GENERATE(as<std::string>{}, "key", "value");
  const dtype t = GENERATE(dtype::float64, dtype::bfloat16);
  call c(dense_spec());
  tensor_view& x = which == "key" ? c.k : c.v;
  x = c.make(t, x.shape_vec());
  require_rejected(c, which);
}

TEST_CASE("bad input: query of a dtype recattn does not compute in", "[forward][bad_input]") {
  call c(dense_spec());
  const dtype t = GENERATE(dtype::int32, dtype::int64);
  c.q = c.make(t, c.q.shape_vec());
  c.k = c.make(t, c.k.shape_vec());
  c.v = c.make(t, c.v.shape_vec());
  require_rejected(c, "query");
}

TEST_CASE("bad input: output not of the query's dtype", "[forward][bad_input]") {
  const dtype t = GENERATE(dtype::float64, dtype::bfloat16, dtype::float16);
  call c(dense_spec());
  c.out = sentinel_buffer(t, c.d.spec.output_shape());
  require_rejected(c, "output", caller_owned);
}

TEST_CASE("bad input: state not float32 for float inputs (initial or final)", "[forward][bad_input]") {
  const dtype t = GENERATE(dtype::float64, dtype::bfloat16);
  call c(dense_spec());
  SECTION("initial_state") {
    c.o.initial_state = c.make(t, c.d.spec.state_shape());
    // The reference also takes a float64 initial state (its own state dtype).
    require_rejected(c, "initial_state", t == dtype::float64 ? caller_owned | allocating : every_form);
  }
  SECTION("final_state") {
    c.state = sentinel_buffer(t, c.d.spec.state_shape());
    require_rejected(c, "final_state", caller_owned);
  }
}

TEST_CASE("bad input: state not float64 for double inputs", "[forward][bad_input]") {
  call c(dense_spec(dtype::float64));
  c.state = sentinel_buffer(dtype::float32, c.d.spec.state_shape());
  require_rejected(c, "final_state", caller_owned);
  c.state = c.d.make_state();
  c.o.initial_state = c.make(dtype::float32, c.d.spec.state_shape());
  require_rejected(c, "initial_state");
}

TEST_CASE("bad input: a gate neither float32 nor the query's dtype", "[forward][bad_input]") {
  const std::string which = GENERATE(as<std::string>{}, "g", "g_gamma", "gk", "gv");
  struct types { dtype query, gate; };
  const types t = GENERATE(types{dtype::float32, dtype::float64}, types{dtype::float32, dtype::bfloat16},
                           types{dtype::bfloat16, dtype::float16}, types{dtype::float16, dtype::float64},
                           types{dtype::float64, dtype::bfloat16}, types{dtype::float32, dtype::int32});
  call c(dense_spec(t.query));
  std::optional<tensor_view>& gate = which == "g" ? c.o.g : which == "g_gamma" ? c.o.g_gamma : which == "gk" ? c.o.gk : c.o.gv;
  gate = c.make(t.gate, gate->shape_vec());
  INFO("query " << dtype_name(t.query) << ", " << which << " " << dtype_name(t.gate));
  require_rejected(c, which);
}

TEST_CASE("bad input: a last dimension with a stride other than 1", "[forward][bad_input]") {
  const std::string which = GENERATE(as<std::string>{}, "query", "key", "value", "g", "gk", "gv", "initial_state",
                                     "output", "final_state");
  call c(dense_spec());
  // A view of every other element of a buffer twice as wide.
  auto spread = [&](const tensor_view& t) {
    std::vector<std::int64_t> wide = t.shape_vec();
    wide.back() *= 2;
    const tensor_view w = c.make(t.type(), wide);
    std::vector<std::int64_t> strides = strides_of(w);
    strides.back() = 2;
    return tensor_view(w.data(), t.type(), t.shape_vec(), strides);
  };
  if (which == "query") c.q = spread(c.q);
  if (which == "key") c.k = spread(c.k);
  if (which == "value") c.v = spread(c.v);
  if (which == "g") c.o.g = spread(*c.o.g);
  if (which == "gk") c.o.gk = spread(*c.o.gk);
  if (which == "gv") c.o.gv = spread(*c.o.gv);
  if (which == "initial_state") c.o.initial_state = spread(*c.o.initial_state);
  if (which == "output" || which == "final_state") {
    buffer& b = which == "output" ? c.out : c.state;
    std::vector<std::int64_t> wide = b.shape();
    wide.back() *= 2;
    buffer w = sentinel_buffer(b.type(), wide);
    forward_outputs outs = c.outputs();
    std::vector<std::int64_t> strides = w.strides();
    strides.back() = 2;
    const mutable_tensor_view spread_view(w.data(), w.type(), b.shape(), strides);
    if (which == "output") outs.output = spread_view;
    else outs.final_state = spread_view;
    check_message(error_of([&] { recurrent_attention(c.q, c.k, c.v, c.o, outs); }), which);
    CHECK(untouched(w));
    CHECK(untouched(c.out));
    CHECK(untouched(c.state));
    return;
  }
  require_rejected(c, which);
}

TEST_CASE("bad input: return_state without a final_state buffer", "[forward][bad_input]") {
  call c(dense_spec());
  c.pass_state_buffer = false;
  require_rejected(c, "final_state", caller_owned);
}

TEST_CASE("bad input: final_state sharing initial_state's memory with other strides", "[forward][bad_input]") {
  call c(dense_spec());
  // One [2, 2, 4, 3] state buffer, read densely as the initial state and written as the final
  // state with the batch and head strides swapped: an in-place update that cannot work.
  buffer h0 = buffer::copy_of(*c.o.initial_state);
  const std::vector<std::int64_t> st = h0.strides();
  c.o.initial_state = h0.view();
  forward_outputs outs = c.outputs();
  outs.final_state = mutable_tensor_view(h0.data(), h0.type(), {2, 2, 4, 3}, {st[1], st[0], st[2], 1});
  const std::vector<unsigned char> before = h0.bytes();
  check_message(error_of([&] { recurrent_attention(c.q, c.k, c.v, c.o, outs); }), "final_state");
  CHECK(h0.bytes() == before);
  CHECK(untouched(c.out));
}

TEST_CASE("bad input: a softmax_scale that is not finite", "[forward][bad_input]") {
  const double scale = GENERATE(std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                                -std::numeric_limits<double>::infinity());
  call c(dense_spec());
  c.o.softmax_scale = scale;
  require_rejected(c, "softmax_scale");
}

TEST_CASE("bad input: negative cfg fields", "[forward][bad_input]") {
  const std::string field = GENERATE(as<std::string>{}, "threads", "block_v", "chunk");
  call c(dense_spec());
  c.o.cfg = cfg{};
  if (field == "threads") c.o.cfg->threads = -1;
  if (field == "block_v") c.o.cfg->block_v = -8;
  if (field == "chunk") c.o.cfg->chunk = -2;
  require_rejected(c, "cfg." + field, caller_owned | allocating);  // the reference takes no cfg
  CHECK_FALSE(can_implement(c.q, c.k, c.v, c.o, c.outputs()).empty());
}

TEST_CASE("bad input: platform cuda in a translation unit not compiled by nvcc", "[forward][bad_input]") {
  call c(dense_spec());
  c.o.platform = platform::cuda;
  require_rejected(c, "platform", caller_owned | allocating);
}

TEST_CASE("can_implement gives the reason a call would be rejected, and nothing for a valid one", "[forward][bad_input]") {
  call c(dense_spec());
  CHECK(can_implement(c.q, c.k, c.v, c.o, c.outputs()).empty());
  c.o.gk = c.make(dtype::float32, {2, 5, 2, 5});
  CHECK_THAT(can_implement(c.q, c.k, c.v, c.o, c.outputs()), Contains("gk") && Contains("expected"));
  CHECK(untouched(c.out));
}
