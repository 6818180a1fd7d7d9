// The CUDA decode step (issue 6) against the CPU step on the same inputs (which equals
// forward bit for bit, tests/test_step_*.cpp) and against the double reference: every gate
// combination, float / bfloat16 / half inputs, float and bfloat16 state storage, [K, V] and
// [V, K] pools, state indices (reversed slots, a padding row), multi-token rows with
// snapshots, varlen rows, cfg.block_v, a non-blocking stream; untouched slots, padding
// outputs and snapshots stay bit for bit as they were; bad input (§5), index values in device
// memory included: checked by a stream-ordered copy to the host (check_index_values, the
// default), or, unchecked, out-of-range slots skipped by the kernel.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <recattn/recattn.hpp>

#include "support/forward.hpp"
#include "support/generators.hpp"

using namespace recattn;
using namespace recattn::testing;

namespace {

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

/// A device copy of a host buffer (same bytes, so the same strides and gaps).
struct device_copy {
  void* ptr = nullptr;
  const buffer* host = nullptr;
  explicit device_copy(const buffer& b) : host(&b) {
    cuda_ok(cudaMalloc(&ptr, std::max<std::size_t>(b.bytes().size(), 16)), "cudaMalloc");
    cuda_ok(cudaMemcpy(ptr, b.data(), b.bytes().size(), cudaMemcpyHostToDevice), "upload");
  }
  device_copy(const device_copy&) = delete;
  device_copy& operator=(const device_copy&) = delete;
  ~device_copy() { cudaFree(ptr); }
  tensor_view view() const { return tensor_view(ptr, host->type(), host->shape(), host->strides()); }
  mutable_tensor_view mview() const { return mutable_tensor_view(ptr, host->type(), host->shape(), host->strides()); }
  buffer download() const {
    buffer b = *host;
    cuda_ok(cudaMemcpy(b.data(), ptr, b.bytes().size(), cudaMemcpyDeviceToHost), "download");
    return b;
  }
};

struct step_case {
  dtype type = dtype::float32, state = dtype::float32;
  unsigned gates = 0;
  state_layout layout = state_layout::kv;
  std::int64_t B = 4, T = 1, Hq = 2, Hk = 2, Hv = 2, K = 128, V = 128;
  bool single = true;
  bool snapshots = false;
  std::vector<std::int64_t> seqlens;  // varlen
  std::uint64_t seed = 1;
  int block_v = 0;                 // cfg.block_v of the CUDA call (0: heuristic)
  cudaStream_t stream = nullptr;   // stream of the CUDA call
  std::string str() const {
    return std::string(dtype_name(type)) + " state=" + dtype_name(state) + " gates=" + gate_mask_name(gates) +
           (layout == state_layout::vk ? " vk" : " kv") + " B" + std::to_string(B) + " T" + std::to_string(T) +
           " H" + std::to_string(Hq) + "/" + std::to_string(Hk) + "/" + std::to_string(Hv) + " K" + std::to_string(K) +
           " V" + std::to_string(V) + (single ? " single" : " multi") + (snapshots ? " snapshots" : "") +
           (seqlens.empty() ? "" : " varlen") + (block_v ? " block_v=" + std::to_string(block_v) : "") +
           (stream ? " stream" : "");
  }
};

/// Drops dimension 1 (time) of a [B, 1, ...] buffer view: the single-token form.
tensor_view token0(const tensor_view& x) {
  std::vector<std::int64_t> shape, strides;
  for (int i = 0; i < x.rank(); ++i)
    if (i != 1) shape.push_back(x.size(i)), strides.push_back(x.stride(i));
  return tensor_view(x.data(), x.type(), shape, strides);
}
mutable_tensor_view token0(const mutable_tensor_view& x) {
  const tensor_view v = token0(static_cast<const tensor_view&>(x));
  return mutable_tensor_view(x.data(), v.type(), v.shape_vec(), strides_of(v));
}

void check(const step_case& c) {
  INFO(c.str());
  problem_spec s;
  s.type = c.type;
  s.B = c.B;
  s.T = c.single ? 1 : c.T;
  s.Hq = c.Hq, s.Hk = c.Hk, s.Hv = c.Hv, s.K = c.K, s.V = c.V;
  if (!c.seqlens.empty()) s.with_seqlens(c.seqlens);
  s.gates = c.gates;
  s.g_gamma_per_sequence = c.gates & 1u;
  s.layout = c.layout;
  s.initial_state = true;
  s.seed = c.seed;
  const problem_data d = generate(s);
  const std::int64_t N = s.N(), P = N + 3;
  // Slots: reversed, row 1 padding.
  buffer ix(dtype::int32, {N});
  ix.fill([&](const idx& i) { return i[0] == 1 ? -1.0 : double(P - 1 - i[0]); });
  std::vector<std::int64_t> pool_shape = s.state_shape();
  pool_shape[0] = P;
  buffer pool(c.state, pool_shape);
  pool.fill([&](const idx& i) { return 0.5 * std::sin(double(i[0] * 7 + i[1] * 3 + i[2] * 5 + i[3])); });
  buffer out = sentinel_buffer(c.type, s.output_shape());
  std::vector<std::int64_t> snap_shape = pool_shape;
  snap_shape[0] = s.B * s.T + 1;
  buffer snaps = sentinel_buffer(c.state, snap_shape);
  buffer snap_ix(dtype::int64, {s.B, s.T});
  snap_ix.fill([&](const idx& i) { return (i[1] % 2) ? -1.0 : double(i[0] * s.T + i[1]); });

  device_copy dq(d.q), dk(d.k), dv(d.v), dpool(pool), dout(out), dsnaps(snaps), dsnap_ix(snap_ix), dix(ix);
  std::optional<device_copy> dg, dgg, dgk, dgv, dcu;
  if (d.g.present()) dg.emplace(d.g);
  if (d.g_gamma.present()) dgg.emplace(d.g_gamma);
  if (d.gk.present()) dgk.emplace(d.gk);
  if (d.gv.present()) dgv.emplace(d.gv);
  if (d.cu_seqlens.present()) dcu.emplace(d.cu_seqlens);

  auto options = [&](bool device) {
    step_options o;
    auto pick = [&](const buffer& h, const std::optional<device_copy>& dd) { return device ? dd->view() : h.view(); };
    auto tok = [&](const tensor_view& v) { return c.single ? token0(v) : v; };
    if (d.g.present()) o.g = tok(pick(d.g, dg));
    if (d.g_gamma.present()) o.g_gamma = pick(d.g_gamma, dgg);
    if (d.gk.present()) o.gk = tok(pick(d.gk, dgk));
    if (d.gv.present()) o.gv = tok(pick(d.gv, dgv));
    if (d.cu_seqlens.present()) o.cu_seqlens = pick(d.cu_seqlens, dcu);
    o.state_indices = device ? dix.view() : ix.view();
    o.state_layout = c.layout;
    if (c.snapshots) {
      o.snapshots = device ? dsnaps.mview() : snaps.mutable_view();
      o.snapshot_indices = c.single ? token0(device ? dsnap_ix.view() : snap_ix.view()) : (device ? dsnap_ix.view() : snap_ix.view());
      if (c.single) {
        const tensor_view si = device ? dsnap_ix.view() : snap_ix.view();
        o.snapshot_indices = tensor_view(si.data(), si.type(), {s.B}, {si.stride(0)});
      }
    }
    o.platform = device ? platform::cuda : platform::cpu;
    if (device) {
      o.stream = c.stream;
      if (c.block_v) {
        cfg cf;
        cf.block_v = c.block_v;
        o.cfg = cf;
      }
    }
    return o;
  };
  auto tok = [&](const tensor_view& v) { return c.single ? token0(v) : v; };
  auto mtok = [&](const mutable_tensor_view& v) { return c.single ? token0(v) : v; };

  // CPU step on host copies.
  buffer cpu_pool = pool, cpu_out = out, cpu_snaps = snaps;
  {
    step_options o = options(false);
    if (c.snapshots) o.snapshots = cpu_snaps.mutable_view();
    step(tok(d.q.view()), tok(d.k.view()), tok(d.v.view()), cpu_pool.mutable_view(), mtok(cpu_out.mutable_view()), o);
  }
  // CUDA step.
  step(tok(dq.view()), tok(dk.view()), tok(dv.view()), dpool.mview(), mtok(dout.mview()), options(true));
  cuda_ok(c.stream ? cudaStreamSynchronize(c.stream) : cudaDeviceSynchronize(), "sync");
  const buffer gpu_pool = dpool.download(), gpu_out = dout.download(), gpu_snaps = dsnaps.download();

  const bool low = c.type != dtype::float32 || c.state != dtype::float32;
  const double tol = low ? 1e-2 : 1e-5;
  // Compare rows that were stepped; padding outputs untouched; untouched slots bitwise equal.
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int64_t slot = std::int64_t(ix.get({n}));
    if (slot < 0) continue;
    const buffer a = slice(gpu_pool.view(), 0, slot, 1), b = slice(cpu_pool.view(), 0, slot, 1);
    CHECK(rel_error(a.view(), b.view()) < tol);
  }
  for (std::int64_t slot : {std::int64_t(0), std::int64_t(1), std::int64_t(2), P - 2})
    CHECK(bitwise_equal(slice(gpu_pool.view(), 0, slot, 1).view(), slice(pool.view(), 0, slot, 1).view()));
  if (c.seqlens.empty()) {
    const buffer pad = slice(gpu_out.view(), 0, 1, 1);
    CHECK(untouched(pad));
    for (std::int64_t b : {std::int64_t(0), s.B - 1}) {
      const buffer x = slice(gpu_out.view(), 0, b, 1), y = slice(cpu_out.view(), 0, b, 1);
      CHECK(rel_error(x.view(), y.view()) < tol);
    }
  } else {
    // Tokens of non-padding rows.
    const std::vector<std::int64_t> cu = s.cu_seqlens();
    for (std::int64_t n = 0; n < N; ++n) {
      const std::int64_t L = cu[std::size_t(n) + 1] - cu[std::size_t(n)];
      if (L == 0) continue;
      const buffer x = slice(gpu_out.view(), 1, cu[std::size_t(n)], L), y = slice(cpu_out.view(), 1, cu[std::size_t(n)], L);
      if (n == 1) CHECK(untouched(x));
      else CHECK(rel_error(x.view(), y.view()) < tol);
    }
  }
  if (c.snapshots) {
    // The sequence of token (b, t): b, or (varlen) the n with cu[n] <= t < cu[n + 1].
    const std::vector<std::int64_t> cu = c.seqlens.empty() ? std::vector<std::int64_t>{} : s.cu_seqlens();
    auto row_of = [&](std::int64_t b, std::int64_t t) {
      if (cu.empty()) return b;
      std::int64_t n = 0;
      while (cu[std::size_t(n) + 1] <= t) ++n;
      return n;
    };
    int compared = 0;
    for (std::int64_t b = 0; b < s.B; ++b)
      for (std::int64_t t = 0; t < (c.single ? 1 : s.T); ++t) {
        const std::int64_t sl = std::int64_t(snap_ix.get({b, t}));
        if (sl < 0) continue;
        const buffer x = slice(gpu_snaps.view(), 0, sl, 1), y = slice(cpu_snaps.view(), 0, sl, 1);
        if (row_of(b, t) == 1) {
          CHECK(untouched(x));  // padding row: no snapshot
        } else {
          CHECK(rel_error(x.view(), y.view()) < tol);
          ++compared;
        }
      }
    CHECK(compared > 0);
    CHECK(untouched(slice(gpu_snaps.view(), 0, s.B * s.T, 1)));
  }
}

}  // namespace

TEST_CASE("cuda step equals the CPU step: gates, dtypes, state storage, layouts", "[cuda][step]") {
  std::uint64_t seed = 1;
  for (dtype t : {dtype::float32, dtype::bfloat16, dtype::float16})
    for (dtype st : {dtype::float32, dtype::bfloat16})
      for (unsigned gates = 0; gates < 16; ++gates)
        for (state_layout layout : {state_layout::kv, state_layout::vk}) {
          step_case c;
          c.type = t;
          c.state = st;
          c.gates = gates;
          c.layout = layout;
          c.seed = seed++;
          check(c);
        }
}

TEST_CASE("cuda step: shapes, grouped heads, multi-token rows with snapshots, varlen", "[cuda][step]") {
  struct sz {
    std::int64_t Hq, Hk, Hv, K, V;
  };
  std::uint64_t seed = 100;
  for (const sz& z : {sz{4, 2, 4, 64, 32}, sz{2, 2, 4, 32, 256}, sz{4, 4, 4, 256, 64}, sz{1, 1, 1, 8, 8}, sz{3, 3, 3, 96, 48}})
    for (state_layout layout : {state_layout::kv, state_layout::vk})
      for (dtype st : {dtype::float32, dtype::bfloat16})
        for (bool single : {true, false}) {
          step_case c;
          c.Hq = z.Hq, c.Hk = z.Hk, c.Hv = z.Hv, c.K = z.K, c.V = z.V;
          c.layout = layout;
          c.state = st;
          c.gates = 15;
          c.single = single;
          c.T = 3;
          c.snapshots = true;
          c.seed = seed++;
          check(c);
        }
  for (state_layout layout : {state_layout::kv, state_layout::vk})
    for (dtype st : {dtype::float32, dtype::bfloat16})
      for (bool snapshots : {false, true}) {
        step_case c;
        c.single = false;
        c.seqlens = {2, 3, 0, 1, 4};  // row 1 is padding; row 2 is empty
        c.gates = 5;
        c.layout = layout;
        c.state = st;
        c.snapshots = snapshots;
        c.K = 64;
        c.V = 64;
        c.seed = seed++;
        check(c);
      }
}

TEST_CASE("cuda step: cfg.block_v, int64 and large K, a non-blocking stream", "[cuda][step]") {
  cudaStream_t stream = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  std::uint64_t seed = 300;
  for (state_layout layout : {state_layout::kv, state_layout::vk})
    for (dtype st : {dtype::float32, dtype::bfloat16}) {
      const int vec = st == dtype::float32 ? 4 : 8;
      for (int block_v : {0, vec, 4 * vec, 8 * vec}) {
        step_case c;
        c.layout = layout;
        c.state = st;
        c.gates = 15;
        c.single = false;
        c.T = 2;
        c.snapshots = true;
        c.block_v = layout == state_layout::vk ? block_v / vec * 4 : block_v;  // [V, K]: value rows
        c.stream = block_v ? stream : nullptr;
        c.seed = seed++;
        check(c);
      }
      step_case big;  // K beyond one block's rows at the heuristic width
      big.layout = layout;
      big.state = st;
      big.gates = 15;
      big.K = 512;
      big.V = 64;
      big.B = 3;
      big.seed = seed++;
      check(big);
    }
  cuda_ok(cudaStreamDestroy(stream), "stream");
}

TEST_CASE("cuda step: one block a whole state slice, many heads", "[cuda][step]") {
  // Enough (row, head) slices that the heuristic keeps a block per slice (>= 2 an SM on 132
  // SMs, as in issue 6's benchmark, which the other cases are too small for), or cfg.block_v
  // = V; V = 40 leaves lanes of the block without columns.
  struct sz {
    std::int64_t B, H, K, V;
    int block_v;
  };
  std::uint64_t seed = 500;
  for (const sz& z : {sz{34, 8, 128, 128, 0}, sz{68, 4, 64, 40, 0}, sz{4, 2, 128, 128, 128}, sz{4, 2, 96, 64, 64}})
    for (dtype st : {dtype::bfloat16, dtype::float32})
      for (bool single : {true, false}) {
        step_case c;
        c.B = z.B, c.Hq = c.Hk = c.Hv = z.H, c.K = z.K, c.V = z.V;
        c.block_v = st == dtype::bfloat16 ? z.block_v : z.block_v / 2;
        c.state = st;
        c.type = dtype::bfloat16;
        c.gates = single ? 4 : 15;  // gk; every gate
        c.single = single;
        c.T = 3;
        c.snapshots = !single;
        c.seed = seed++;
        check(c);
      }
}

TEST_CASE("cuda step from an initial state equals the double reference over the same tokens", "[cuda][step]") {
  // The pool holds the initial states (no indices: row b is slot b); T tokens in one call.
  for (dtype type : {dtype::float32, dtype::bfloat16})
    for (unsigned gates = 0; gates < 16; ++gates)
      for (state_layout layout : {state_layout::kv, state_layout::vk}) {
        problem_spec s;
        s.type = type;
        s.B = 3;
        s.T = 24;
        s.Hq = 4, s.Hk = 2, s.Hv = 4, s.K = 64, s.V = 32;
        s.gates = gates;
        s.g_gamma_per_sequence = gates & 1u;
        s.layout = layout;
        s.initial_state = true;
        s.seed = 500 + gates;
        INFO(s.str());
        const problem_data d = generate(s);
        forward_options fo = d.options();
        fo.return_state = true;
        const forward_result ref = reference_recurrent_attention(d.q.view(), d.k.view(), d.v.view(), fo);
        const buffer pool = buffer::copy_of(d.initial_state.view());
        const buffer out = sentinel_buffer(type, s.output_shape());
        device_copy dq(d.q), dk(d.k), dv(d.v), dpool(pool), dout(out);
        std::optional<device_copy> dg, dgg, dgk, dgv;
        step_options o;
        if (d.g.present()) o.g = dg.emplace(d.g).view();
        if (d.g_gamma.present()) o.g_gamma = dgg.emplace(d.g_gamma).view();
        if (d.gk.present()) o.gk = dgk.emplace(d.gk).view();
        if (d.gv.present()) o.gv = dgv.emplace(d.gv).view();
        o.state_layout = layout;
        step(dq.view(), dk.view(), dv.view(), dpool.mview(), dout.mview(), o);  // platform automatic
        cuda_ok(cudaDeviceSynchronize(), "sync");
        CHECK(rel_error(dout.download().view(), ref.output.view()) < tolerance(type));
        CHECK(rel_error(dpool.download().view(), ref.final_state->view()) < tolerance(type));
      }
}

TEST_CASE("cuda step rejects host memory and unaligned pools", "[cuda][step]") {
  buffer q(dtype::float32, {2, 2, 8}), v(dtype::float32, {2, 2, 8}), pool(dtype::float32, {2, 2, 8, 8}),
      out(dtype::float32, {2, 2, 8});
  device_copy dq(q), dv(v), dpool(pool), dout(out);
  step_options o;
  o.platform = platform::cuda;
  CHECK_THROWS_WITH(step(dq.view(), dq.view(), dv.view(), pool.mutable_view(), dout.mview(), o),
                    Catch::Matchers::Contains("state_pool: expected device (or managed) memory on platform cuda"));
  // V = 6: rows of 24 bytes are not 16-byte aligned.
  buffer v6(dtype::float32, {2, 2, 6}), pool6(dtype::float32, {2, 2, 8, 6}), out6(dtype::float32, {2, 2, 6});
  device_copy dv6(v6), dpool6(pool6), dout6(out6);
  CHECK_THROWS_WITH(step(dq.view(), dq.view(), dv6.view(), dpool6.mview(), dout6.mview(), o),
                    Catch::Matchers::Contains("state_pool: expected 16-byte aligned rows on platform cuda"));
}

TEST_CASE("cuda step checks index values in device memory before any write; unchecked, out-of-range slots are skipped",
          "[cuda][step]") {
  const std::int64_t B = 3, H = 2, K = 16, V = 16, P = 4;
  auto wave = [](const idx& i) {
    double x = 0;
    for (std::size_t j = 0; j < i.size(); ++j) x = x * 3.1 + double(i[j]);
    return 0.5 * std::sin(x);
  };
  buffer q(dtype::float32, {B, H, K}), v(dtype::float32, {B, H, V}), pool(dtype::float32, {P, H, K, V});
  q.fill(wave), v.fill(wave), pool.fill(wave);
  const buffer out = sentinel_buffer(dtype::float32, {B, H, V});
  const buffer snaps = sentinel_buffer(dtype::float32, {P, H, K, V});
  device_copy dq(q), dv(v), dpool(pool), dout(out), dsnaps(snaps);
  auto run = [&](const std::vector<std::int64_t>& slots, const std::vector<std::int64_t>& snap_slots, bool checked) {
    buffer ix(dtype::int32, {B}), six(dtype::int64, {B});
    ix.fill([&](const idx& i) { return double(slots[std::size_t(i[0])]); });
    six.fill([&](const idx& i) { return double(snap_slots[std::size_t(i[0])]); });
    device_copy dix(ix), dsix(six);
    step_options o;
    o.state_indices = dix.view();
    o.snapshots = dsnaps.mview();
    o.snapshot_indices = dsix.view();
    o.check_index_values = checked;
    o.platform = platform::cuda;
    step(dq.view(), dq.view(), dv.view(), dpool.mview(), dout.mview(), o);
    cuda_ok(cudaDeviceSynchronize(), "sync");
  };
  const std::vector<std::int64_t> none{-1, -1, -1};
  CHECK_THROWS_WITH(run({0, 2, 2}, none, true),
                    Catch::Matchers::Contains("state_indices: expected distinct non-negative values"));
  CHECK_THROWS_WITH(run({0, 4, 1}, none, true), Catch::Matchers::Contains("state_indices: expected values < P = 4"));
  CHECK_THROWS_WITH(run({0, 1, 2}, {3, -1, 3}, true),
                    Catch::Matchers::Contains("snapshot_indices: expected distinct non-negative values"));
  CHECK_THROWS_WITH(run({0, 1, 2}, {5, -1, -1}, true),
                    Catch::Matchers::Contains("snapshot_indices: expected values < Ps = 4"));
  CHECK(bitwise_equal(dpool.download().view(), pool.view()));
  CHECK(untouched(dout.download()));
  CHECK(untouched(dsnaps.download()));

  // Unchecked: row 1's slot 4 and row 0's snapshot slot 7 are out of range: skipped, nothing
  // written out of bounds (compute-sanitizer memcheck sees that); row 0 is stepped.
  run({0, 4, -1}, {7, 2, -1}, false);
  buffer cpu_pool = pool, cpu_out = out;
  {
    const buffer ix = [&] {
      buffer b(dtype::int32, {B});
      b.fill([](const idx& i) { return i[0] == 0 ? 0.0 : -1.0; });
      return b;
    }();
    step_options o;
    o.state_indices = ix.view();
    step(q.view(), q.view(), v.view(), cpu_pool.mutable_view(), cpu_out.mutable_view(), o);
  }
  const buffer gpu_pool = dpool.download(), gpu_out = dout.download();
  CHECK(rel_error(slice(gpu_pool.view(), 0, 0, 1).view(), slice(cpu_pool.view(), 0, 0, 1).view()) < 1e-5);
  CHECK(rel_error(slice(gpu_out.view(), 0, 0, 1).view(), slice(cpu_out.view(), 0, 0, 1).view()) < 1e-5);
  CHECK(bitwise_equal(slice(gpu_pool.view(), 0, 1, 3).view(), slice(pool.view(), 0, 1, 3).view()));
  CHECK(untouched(slice(gpu_out.view(), 0, 1, 2)));
  CHECK(untouched(dsnaps.download()));
}
