// SPEC §5 and issue 6 item 4: every argument of a step is checked before anything is
// written. Each check starts from a valid call (all four gates, state indices with a padding
// row, snapshots), breaks one argument and asserts that recattn::Error names that argument,
// the expected and the given value, and that the sentinel-filled pool, snapshots and output
// are bit for bit untouched.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>

#include "support/rejects.hpp"
#include "test_step_common.hpp"

using namespace recattn;
using namespace recattn::testing;
using Catch::Matchers::Contains;

namespace {

/// A valid step (B3 H2 K4 V3: K != V, so that a [K, V] pool is not a [V, K] one) into
/// sentinel buffers; `single`: one token per row, else 2 tokens per row.
struct call : replacements {
  problem_data d;
  bool single;
  tensor_view q, k, v;
  step_options o;
  buffer pool, out, snaps, ix, snap_ix;
  mutable_tensor_view pool_view, out_view;

  explicit call(bool single_token = true) : d(generate(spec())), single(single_token) {
    const token_args a = single ? token_of(d, 0) : window_of(d, 0, 2);
    q = a.q, k = a.k, v = a.v;
    o = a.opt;
    pool = sentinel_buffer(dtype::float32, {5, 2, 4, 3});
    out = single ? sentinel_buffer(dtype::float32, {3, 2, 3}) : sentinel_buffer(dtype::float32, {3, 2, 2, 3});
    snaps = sentinel_buffer(dtype::float32, {6, 2, 4, 3});
    ix = index_buffer({4, 0, -1});
    snap_ix = single ? index_buffer({1, 5, 0}) : buffer(dtype::int64, {3, 2});
    if (!single) snap_ix.fill([](const idx& i) { return double(i[0] * 2 + i[1]); });
    o.state_indices = ix.view();
    o.snapshots = snaps.mutable_view();
    o.snapshot_indices = snap_ix.view();
    pool_view = pool.mutable_view();
    out_view = out.mutable_view();
  }
  call(const call&) = delete;
  call& operator=(const call&) = delete;
  static problem_spec spec() {
    problem_spec s;
    s.B = 3, s.T = 2, s.Hq = 2, s.Hk = 2, s.Hv = 2, s.K = 4, s.V = 3;
    s.gates = 15;
    return s;
  }
  void run() { step(q, k, v, pool_view, out_view, o); }
};

/// The call throws recattn::Error naming `arg`, containing `expected` and `got` (anywhere:
/// "float64" in "got dtype float64"), and writes nothing.
void expect_rejected(call& c, const std::string& arg, const std::string& expected, const std::string& got) {
  const std::string msg = error_of([&] { c.run(); });
  INFO("message: " << msg);
  REQUIRE(!msg.empty());
  check_message(msg, arg, expected);
  CHECK_THAT(msg, Contains(got));
  CHECK(untouched(c.pool));
  CHECK(untouched(c.out));
  CHECK(untouched(c.snaps));
  for (const buffer& b : c.sentinels) CHECK(untouched(b));
}

}  // namespace

TEST_CASE("the valid calls run and write the pool, the snapshots and the output", "[step][bad_input]") {
  for (bool single : {true, false}) {
    call c(single);
    c.run();
    CHECK_FALSE(untouched(c.pool));
    CHECK_FALSE(untouched(c.out));
    CHECK_FALSE(untouched(c.snaps));
  }
}

TEST_CASE("step rejects a query of rank other than 3 or 4", "[step][bad_input]") {
  call c;
  c.q = c.make(dtype::float32, {3, 8});
  expect_rejected(c, "query", "rank 3 [B, Hq, K]", "rank 2");
}
TEST_CASE("step rejects a key or value of another rank than the query", "[step][bad_input]") {
  call c;
  c.k = c.make(dtype::float32, {3, 1, 2, 4});
  expect_rejected(c, "key", "rank 3", "rank 4");
  call d;
  d.v = d.make(dtype::float32, {3, 1, 2, 3});
  expect_rejected(d, "value", "rank 3", "rank 4");
}
TEST_CASE("step rejects a non-floating query dtype", "[step][bad_input]") {
  call c;
  c.q = c.make(dtype::int32, {3, 2, 4});
  expect_rejected(c, "query", "dtype float32, float64, bfloat16 or float16", "int32");
}
TEST_CASE("step rejects key and value dtypes that differ from the query's", "[step][bad_input]") {
  call c;
  c.k = c.make(dtype::float64, {3, 2, 4});
  expect_rejected(c, "key", "dtype float32", "float64");
  call d;
  d.v = d.make(dtype::bfloat16, {3, 2, 3});
  expect_rejected(d, "value", "dtype float32", "bfloat16");
}
TEST_CASE("step rejects key and value shapes that do not match the query", "[step][bad_input]") {
  call c;
  c.k = c.make(dtype::float32, {3, 2, 5});
  expect_rejected(c, "key", "shape [3, Hk, 4]", "[3, 2, 5]");
  call d;
  d.v = d.make(dtype::float32, {2, 2, 3});
  expect_rejected(d, "value", "shape [3, Hv, V]", "[2, 2, 3]");
  call e(false);
  e.k = e.make(dtype::float32, {3, 1, 2, 4});
  expect_rejected(e, "key", "shape [3, 2, Hk, 4]", "[3, 1, 2, 4]");
}
TEST_CASE("step rejects head counts that do not divide H", "[step][bad_input]") {
  call c;
  c.q = c.make(dtype::float32, {3, 3, 4});
  expect_rejected(c, "key", "a head count dividing H = 3", "2");
}
TEST_CASE("step rejects empty key and value channels", "[step][bad_input]") {
  call c;
  c.q = c.make(dtype::float32, {3, 2, 0});
  c.k = c.make(dtype::float32, {3, 2, 0});
  expect_rejected(c, "query", "K >= 1", "[3, 2, 0]");
}
TEST_CASE("step rejects null data and a strided last dimension", "[step][bad_input]") {
  call c;
  c.v = null_data(c.v);
  expect_rejected(c, "value", "non-null data", "null pointer");
  call d;
  d.keep.push_back(buffer(dtype::float32, {3, 2, 8}).fill([](const idx&) { return 0.5; }));
  d.q = tensor_view(d.keep.back().data(), dtype::float32, {3, 2, 4}, {16, 8, 2});
  expect_rejected(d, "query", "stride 1 in the last dimension", "stride 2");
}
TEST_CASE("step rejects gates of the wrong shape or dtype", "[step][bad_input]") {
  call c;
  c.o.g = c.make(dtype::float32, {3, 1, 2});
  expect_rejected(c, "g", "shape [3, 2] [B, H] (one token per row)", "[3, 1, 2]");
  call d;
  d.o.gk = d.make(dtype::float32, {3, 2, 3});
  expect_rejected(d, "gk", "shape [3, 2, 4] [B, H, K]", "[3, 2, 3]");
  call e;
  e.o.gv = e.make(dtype::float32, {3, 2, 4});
  expect_rejected(e, "gv", "shape [3, 2, 3] [B, H, V]", "[3, 2, 4]");
  call f;
  f.o.g_gamma = f.make(dtype::float32, {3});
  expect_rejected(f, "g_gamma", "shape [2] [H]", "[3]");
  call g;
  g.o.g_gamma = g.make(dtype::float32, {2, 2});
  expect_rejected(g, "g_gamma", "shape [3, 2] [B, H]", "[2, 2]");
  call h;
  h.o.gk = h.make(dtype::float16, {3, 2, 4});
  expect_rejected(h, "gk", "dtype float32 or float32", "float16");
  call m(false);
  m.o.g = m.make(dtype::float32, {3, 1, 2});
  expect_rejected(m, "g", "shape [3, 2, 2] [B, T, H]", "[3, 1, 2]");
}
TEST_CASE("step rejects a non-finite softmax_scale", "[step][bad_input]") {
  call c;
  c.o.softmax_scale = std::numeric_limits<double>::quiet_NaN();
  expect_rejected(c, "softmax_scale", "a finite value", "nan");
}
TEST_CASE("step rejects an output of the wrong shape, dtype or data", "[step][bad_input]") {
  call c;
  c.out_view = c.sentinel(dtype::float32, {3, 2, 4});
  expect_rejected(c, "output", "shape [3, 2, 3] [B, H, V]", "[3, 2, 4]");
  call d;
  d.out_view = d.sentinel(dtype::float64, {3, 2, 3});
  expect_rejected(d, "output", "dtype float32", "float64");
  call e;
  e.out_view = mutable_tensor_view(nullptr, dtype::float32, {3, 2, 3});
  expect_rejected(e, "output", "non-null data", "null pointer");
  call f;
  f.out_view = mutable_tensor_view(f.pool.data(), dtype::float32, {3, 2, 3});
  expect_rejected(f, "output", "memory disjoint from state_pool", "overlapping");
}
TEST_CASE("step rejects a pool of the wrong rank, shape, layout, dtype or data", "[step][bad_input]") {
  call c;
  c.pool_view = c.sentinel(dtype::float32, {5, 2, 12});
  expect_rejected(c, "state_pool", "rank 4 [P, H, K, V]", "rank 3");
  call d;
  d.pool_view = d.sentinel(dtype::float32, {5, 3, 4, 3});
  expect_rejected(d, "state_pool", "shape [P, 2, 4, 3] [P, H, K, V]", "[5, 3, 4, 3]");
  call e;  // a [V, K] pool passed for the default [K, V] layout
  e.pool_view = e.sentinel(dtype::float32, {5, 2, 3, 4});
  expect_rejected(e, "state_pool", "shape [P, 2, 4, 3] [P, H, K, V]", "[5, 2, 3, 4]");
  call f;  // and a [K, V] pool for state_layout vk
  f.o.state_layout = state_layout::vk;
  f.o.snapshots.reset();
  f.o.snapshot_indices.reset();
  expect_rejected(f, "state_pool", "shape [P, 2, 3, 4] [P, H, V, K] (state_layout vk)", "[5, 2, 4, 3]");
  call g;
  g.pool_view = g.sentinel(dtype::float16, {5, 2, 4, 3});
  expect_rejected(g, "state_pool", "dtype float32 or bfloat16", "float16");
  call h;
  h.pool_view = mutable_tensor_view(nullptr, dtype::float32, {5, 2, 4, 3});
  expect_rejected(h, "state_pool", "non-null data", "null pointer");
}
TEST_CASE("step rejects a pool smaller than the batch without state_indices", "[step][bad_input]") {
  call c;
  c.o.state_indices.reset();
  c.o.snapshots.reset();
  c.o.snapshot_indices.reset();
  c.pool_view = c.sentinel(dtype::float32, {2, 2, 4, 3});
  expect_rejected(c, "state_pool", "at least 3 slots", "P = 2");
}
TEST_CASE("step rejects state_indices of the wrong shape or dtype", "[step][bad_input]") {
  call c;
  c.o.state_indices = c.indices({0, 1});
  expect_rejected(c, "state_indices", "shape [3] [B]", "[2]");
  call d;
  d.o.state_indices = d.make(dtype::float32, {3}, 1.0);
  expect_rejected(d, "state_indices", "dtype int32 or int64", "float32");
}
TEST_CASE("step rejects state_indices out of range", "[step][bad_input]") {
  for (dtype t : {dtype::int32, dtype::int64}) {
    call c;
    c.o.state_indices = c.indices({4, 5, 0}, t);
    expect_rejected(c, "state_indices", "values < P = 5", "state_indices[1] = 5");
  }
}
TEST_CASE("step rejects duplicate non-negative state_indices, and the check leaves no trace", "[step][bad_input]") {
  call c;
  c.o.state_indices = c.indices({3, -1, 3});
  expect_rejected(c, "state_indices", "distinct non-negative values", "state_indices[2] = 3 repeated");
  // Negative duplicates are padding, not a race; and the thread's bitmap was cleared: a valid
  // call afterwards passes.
  call d;
  d.o.state_indices = d.indices({-1, 3, -1});
  d.run();
  CHECK_FALSE(untouched(d.pool));
}
TEST_CASE("step rejects snapshots without snapshot_indices and the reverse", "[step][bad_input]") {
  call c;
  c.o.snapshot_indices.reset();
  expect_rejected(c, "snapshot_indices", "a tensor (snapshots is given)", "none");
  call d;
  d.o.snapshots.reset();
  expect_rejected(d, "snapshots", "a tensor (snapshot_indices is given)", "none");
}
TEST_CASE("step rejects a snapshot pool that does not match the state pool", "[step][bad_input]") {
  call c;
  c.o.snapshots = c.sentinel(dtype::float32, {6, 2, 3, 4});
  expect_rejected(c, "snapshots", "shape [Ps, 2, 4, 3] [P, H, K, V]", "[6, 2, 3, 4]");
  call d;
  d.o.snapshots = d.sentinel(dtype::bfloat16, {6, 2, 4, 3});
  expect_rejected(d, "snapshots", "dtype float32 (the state pool's)", "bfloat16");
  call e;
  e.o.snapshots = mutable_tensor_view(static_cast<float*>(e.pool.data()) + 12, dtype::float32, {2, 2, 4, 3});
  expect_rejected(e, "snapshots", "memory disjoint from state_pool, or state_pool itself", "overlapping");
}
TEST_CASE("step rejects snapshot_indices of the wrong shape, dtype or range, and duplicates", "[step][bad_input]") {
  call c;
  c.o.snapshot_indices = c.indices({0, 1});
  expect_rejected(c, "snapshot_indices", "shape [3] [B]", "[2]");
  call d(false);
  d.o.snapshot_indices = d.indices({0, 1, 2});
  expect_rejected(d, "snapshot_indices", "shape [3, 2] [B, T]", "[3]");
  call e;
  e.o.snapshot_indices = e.make(dtype::float64, {3}, 1.0);
  expect_rejected(e, "snapshot_indices", "dtype int32 or int64", "float64");
  call f;
  f.o.snapshot_indices = f.indices({0, 6, 1});
  expect_rejected(f, "snapshot_indices", "values < Ps = 6", "snapshot_indices[1] = 6");
  call g(false);
  g.keep.push_back(buffer(dtype::int32, {3, 2}));
  g.keep.back().fill([](const idx& i) { return i[0] == 1 && i[1] == 1 ? 0.0 : double(i[0] * 2 + i[1]); });
  g.o.snapshot_indices = g.keep.back().view();
  expect_rejected(g, "snapshot_indices", "distinct non-negative values", "snapshot_indices[1, 1] = 0 repeated");
}
TEST_CASE("step rejects a snapshot slot that is a row's state slot when snapshots is the pool", "[step][bad_input]") {
  call c;
  c.o.snapshots = c.pool.mutable_view();
  c.o.snapshot_indices = c.indices({1, 0, 2});  // row 1 lives in slot 0
  expect_rejected(c, "snapshot_indices", "none equal to a row's state slot", "snapshot_indices[1] = 0 repeated");
  // Padding rows write no snapshot: their snapshot slots may be anything in range.
  call d;
  d.o.snapshots = d.pool.mutable_view();
  d.o.snapshot_indices = d.indices({1, 2, 4});  // row 2 is padding; 4 is row 0's slot
  CHECK_NOTHROW(d.run());
}
TEST_CASE("step rejects cu_seqlens with a single-token query, and bad cu_seqlens", "[step][bad_input]") {
  call c;
  c.o.cu_seqlens = c.indices({0, 1, 2, 3});
  expect_rejected(c, "cu_seqlens", "none with a single-token query", "[4]");
  // Varlen: q [1, 6, H, K], 3 sequences.
  auto varlen = [](call& v, std::vector<std::int64_t> cu) {
    to_varlen_step(v, 6);
    v.o.g_gamma = v.make(dtype::float32, {2});
    v.o.snapshots.reset();
    v.o.snapshot_indices.reset();
    v.o.cu_seqlens = v.indices(cu, dtype::int32);
  };
  call d(false);
  varlen(d, {1, 2, 4, 6});
  expect_rejected(d, "cu_seqlens", "cu_seqlens[0] = 0", "cu_seqlens[0] = 1");
  call e(false);
  varlen(e, {0, 4, 2, 6});
  expect_rejected(e, "cu_seqlens", "non-decreasing values", "cu_seqlens[2] = 2");
  call f(false);
  varlen(f, {0, 2, 4, 5});
  expect_rejected(f, "cu_seqlens", "cu_seqlens[N] = 6", "cu_seqlens[3] = 5");
  call g(false);
  varlen(g, {0, 2, 4, 6});
  g.o.state_indices = g.indices({0, 1});
  expect_rejected(g, "state_indices", "shape [3] [N]", "[2]");
  call h(false);
  varlen(h, {0, 2, 4, 6});
  h.o.cu_seqlens = h.make(dtype::float32, {4}, 0.0);
  expect_rejected(h, "cu_seqlens", "dtype int32 or int64", "float32");
  call m(false);
  varlen(m, {0, 2, 4, 6});
  m.q = m.make(dtype::float32, {2, 3, 2, 4});
  m.k = m.make(dtype::float32, {2, 3, 2, 4});
  m.v = m.make(dtype::float32, {2, 3, 2, 3});
  expect_rejected(m, "query", "batch size B = 1 with cu_seqlens", "B = 2");
}
TEST_CASE("step rejects platform cuda in a translation unit not compiled by nvcc", "[step][bad_input]") {
  call c;
  c.o.platform = platform::cuda;
  expect_rejected(c, "platform", "cpu or automatic", "cuda");
}
