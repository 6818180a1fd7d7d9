// The runtime arguments of a decode step (SPEC §3.3, issue 6) in one plain struct, the
// validation that builds it (every check of SPEC §5, before anything is written), and the
// step's list of compiled variants.
//
// The checks allocate nothing after the first call of a thread: shapes are compared as fixed
// arrays, and the duplicate-index check uses a thread-local bitmap of one bit per pool slot
// that grows to the largest pool seen and is cleared by walking the indices again (O(B),
// never O(P)).
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "cfg.hpp"
#include "detail/static_switch.hpp"
#include "dispatch.hpp"
#include "dtype.hpp"
#include "error.hpp"
#include "problem.hpp"
#include "tensor.hpp"

#if RECATTN_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

/// Variant cap of the step (config.hpp lists the others): no bfloat16 state storage.
#ifndef RECATTN_DISABLE_BF16_STATE
#define RECATTN_DISABLE_BF16_STATE 0
#endif

namespace recattn {

/// Optional tensors and flags of the step operation.
///
/// Token tensors come in three forms, told apart by the rank of the query:
///   single token  q [B, Hq, K], k [B, Hk, K], v [B, Hv, V], out [B, H, V];
///                 g [B, H], gk [B, H, K], gv [B, H, V]
///   multi-token   q [B, T, Hq, K] ... out [B, T, H, V], the gates of forward_options
///   varlen        q [1, Ttot, Hq, K] with cu_seqlens [N + 1]: N rows of cu_seqlens[n+1] -
///                 cu_seqlens[n] tokens each
/// g_gamma is [H] or [rows, H]. Row n reads and writes pool slot state_indices[n] (n when no
/// indices are given); the pool is [P, H, K, V] ([P, H, V, K] for state_layout::vk).
struct step_options {
  std::optional<tensor_view> g;              ///< scalar log-decay of each token
  std::optional<tensor_view> g_gamma;        ///< [H] or [rows, H]
  std::optional<tensor_view> gk;             ///< key-channel log-decay of each token
  std::optional<tensor_view> gv;             ///< value-channel log-decay of each token
  std::optional<tensor_view> cu_seqlens;     ///< [N + 1], int32 or int64; q is [1, Ttot, ..]
  /// [rows], int32 or int64: the pool slot of each row; negative: a padding row, skipped
  /// (its state and output untouched). Non-negative values must be distinct and < P.
  std::optional<tensor_view> state_indices;
  /// A pool of the state pool's layout, dtype, H, K, V ([Ps, H, K, V]) that receives the
  /// state after chosen tokens (speculative decoding: vLLM's and sglang's intermediate states).
  std::optional<mutable_tensor_view> snapshots;
  /// The snapshot slot of each token: [B] (single token), [B, T] (multi-token) or [1, Ttot]
  /// (varlen), int32 or int64; negative: not kept. Non-negative values must be distinct and
  /// < Ps (and, when `snapshots` is the state pool itself, distinct from the rows' slots).
  std::optional<tensor_view> snapshot_indices;
  std::optional<double> softmax_scale;  ///< default 1 / sqrt(K)
  recattn::state_layout state_layout = recattn::state_layout::kv;
  recattn::platform platform = recattn::platform::automatic;
  std::optional<recattn::cfg> cfg;
  void* stream = nullptr;  ///< cudaStream_t for platform cuda (null: the default stream)
  /// Checks the values of state_indices and snapshot_indices (range, duplicates) before
  /// anything is written. Device-resident indices (platform cuda) are copied to the host for
  /// it, ordered on `stream`, and waited for: a synchronisation per call. Off (the CUDA hot
  /// path): the caller guarantees distinct values; the CUDA kernel still skips a row whose
  /// slot is >= P and a snapshot whose slot is >= Ps, so nothing is written out of bounds.
  bool check_index_values = true;
};

/// All runtime arguments of one step, checked. Kernels read nothing else.
struct step_problem {
  /// The token tensors as a forward problem (B, T, N, H.., q, k, v, gates, out, cu_seqlens,
  /// layout, scale); its h0 / ht are unused. A single-token call is T = 1 with zero time strides.
  problem tok;
  bool single = false;               ///< single-token form (rank-3 query)
  dtype state_type = dtype::float32; ///< storage of the pool and the snapshots
  std::int64_t P = 0;                ///< pool slots
  strided3 pool;                     ///< (slot, h, row), last dim contiguous
  const void* indices = nullptr;     ///< null: row n uses slot n
  dtype index_type = dtype::int64;
  std::int64_t index_stride = 1;
  std::int64_t Ps = 0;               ///< snapshot slots
  strided3 snap;                     ///< data null: no snapshots
  const void* snap_indices = nullptr;
  dtype snap_index_type = dtype::int64;
  std::int64_t snap_s0 = 0, snap_s1 = 0;  ///< (batch row, time) strides of snapshot_indices

  void* pool_data() const { return const_cast<void*>(pool.data); }
  void* snap_data() const { return const_cast<void*>(snap.data); }
  /// Pool slot of row n; negative: padding row.
  std::int64_t slot(std::int64_t n) const {
    return indices ? load_as<std::int64_t>(indices, index_type, n * index_stride) : n;
  }
  /// Snapshot slot of the token at (batch row b, time t); negative: not kept.
  std::int64_t snapshot_slot(std::int64_t b, std::int64_t t) const {
    return snap_indices ? load_as<std::int64_t>(snap_indices, snap_index_type, b * snap_s0 + t * snap_s1) : -1;
  }
};

namespace detail {

/// Shape check against a fixed list (no allocation on the hot path).
inline void check_dims(const char* name, const tensor_view& t, std::initializer_list<std::int64_t> want,
                       const char* layout) {
  bool ok = t.rank() == int(want.size());
  int i = 0;
  for (auto w : want) ok = ok && t.size(i++) == w;
  if (!ok) {
    const std::vector<std::int64_t> w(want);
    fail(name, cat("shape ", shape_str(w), " ", layout), dims(t));
  }
}

// problem.hpp's checks take std::string names, which allocate for names past the small-string
// buffer ("snapshot_indices"): the step's own take const char*.
inline void require_rank(const char* name, const tensor_view& t, int rank, const char* layout) {
  if (t.rank() != rank) fail(name, cat("rank ", rank, " ", layout), cat("rank ", t.rank(), " ", dims(t)));
}
inline void require_data(const char* name, const tensor_view& t) {
  if (t.numel() > 0 && t.data() == nullptr) fail(name, "non-null data", "null pointer");
  if (t.rank() > 0 && t.size(t.rank() - 1) > 1 && t.stride(t.rank() - 1) != 1)
    fail(name, "stride 1 in the last dimension", cat("stride ", t.stride(t.rank() - 1)));
  for (int i = 0; i < t.rank(); ++i)
    if (t.size(i) < 0) fail(name, "non-negative sizes", dims(t));
}
inline void require_dtype(const char* name, const tensor_view& t, dtype want) {
  if (t.type() != want) fail(name, cat("dtype ", dtype_name(want)), cat("dtype ", dtype_name(t.type())));
}
inline void require_gate_dtype(const char* name, const tensor_view& t, dtype q) {
  if (t.type() != dtype::float32 && t.type() != q)
    fail(name, cat("dtype float32 or ", dtype_name(q), " (the query's)"), cat("dtype ", dtype_name(t.type())));
}

inline void check_index_dtype(const char* name, const tensor_view& t) {
  if (t.type() != dtype::int32 && t.type() != dtype::int64)
    fail(name, "dtype int32 or int64", cat("dtype ", dtype_name(t.type())));
}

/// A host-readable pointer to an index tensor's values: the tensor itself, or (device memory,
/// CUDA builds) a copy in a thread-local buffer that only grows. The copy is ordered on
/// `stream` (work queued there before the call, such as the kernel that wrote the indices, is
/// seen) and waited for: a synchronisation, which is why check_index_values can be turned off.
inline const void* host_readable(const char* name, const tensor_view& t, std::vector<unsigned char>& copy,
                                 void* stream) {
#if RECATTN_HAS_CUDA
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, t.data()) != cudaSuccess) {
    (void)cudaGetLastError();
  } else if (attr.type == cudaMemoryTypeDevice) {
    // The extent of the view in elements (non-negative strides, checked by the caller).
    std::int64_t ext = 1;
    for (int i = 0; i < t.rank(); ++i) ext += (t.size(i) - 1) * t.stride(i);
    const std::size_t bytes = std::size_t(ext) * dtype_size(t.type());
    if (copy.size() < bytes) copy.resize(bytes);
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    cudaError_t e = cudaMemcpyAsync(copy.data(), t.data(), bytes, cudaMemcpyDeviceToHost, st);
    if (e == cudaSuccess) e = cudaStreamSynchronize(st);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      fail(name, "device memory that can be copied to the host", cudaGetErrorString(e));
    }
    return copy.data();
  }
#else
  (void)name;
  (void)copy;
  (void)stream;
#endif
  return t.data();
}

/// One bit per slot, for the duplicate checks; thread-local, grown to the largest pool seen.
inline std::vector<std::uint64_t>& slot_bitmap(std::int64_t slots) {
  thread_local std::vector<std::uint64_t> bits;
  const std::size_t words = std::size_t(slots / 64 + 1);
  if (bits.size() < words) bits.resize(words, 0);
  return bits;
}

}  // namespace detail

/// Checks every argument of a step (SPEC §5, issue 6 item 4) and returns the plain problem.
/// Throws recattn::Error naming the argument, the expected and the actual value; nothing is
/// written by the check.
inline step_problem make_step_problem(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                      const mutable_tensor_view& state_pool, const mutable_tensor_view& out,
                                      const step_options& opt) {
  using namespace detail;
  step_problem sp;
  problem& p = sp.tok;
  if (q.rank() != 3 && q.rank() != 4)
    fail("query", "rank 3 [B, Hq, K] (one token per row) or rank 4 [B, T, Hq, K]", cat("rank ", q.rank(), " ", dims(q)));
  sp.single = q.rank() == 3;
  const bool single = sp.single;
  const int r = q.rank();
  if (k.rank() != r) fail("key", cat("rank ", r, " ", single ? "[B, Hk, K]" : "[B, T, Hk, K]", " (the query's)"), cat("rank ", k.rank(), " ", dims(k)));
  if (v.rank() != r) fail("value", cat("rank ", r, " ", single ? "[B, Hv, V]" : "[B, T, Hv, V]", " (the query's)"), cat("rank ", v.rank(), " ", dims(v)));
  const dtype qt = q.type();
  if (qt != dtype::float32 && qt != dtype::float64 && qt != dtype::bfloat16 && qt != dtype::float16)
    fail("query", "dtype float32, float64, bfloat16 or float16", cat("dtype ", dtype_name(qt)));
  require_dtype("key", k, qt);
  require_dtype("value", v, qt);
  p.type = qt;
  p.state_type = qt == dtype::float64 ? dtype::float64 : dtype::float32;

  // Dimensions: (B, T, heads, channels); a single-token tensor has T = 1.
  const int hd = single ? 1 : 2;
  p.B = q.size(0);
  p.T = single ? 1 : q.size(1);
  p.Hq = q.size(hd);
  p.K = q.size(hd + 1);
  const bool k_ok = k.size(0) == p.B && (single || k.size(1) == p.T) && k.size(hd + 1) == p.K;
  if (!k_ok)
    fail("key", single ? cat("shape [", p.B, ", Hk, ", p.K, "] (B and K of query)")
                       : cat("shape [", p.B, ", ", p.T, ", Hk, ", p.K, "] (B, T and K of query)"), dims(k));
  if (v.size(0) != p.B || (!single && v.size(1) != p.T))
    fail("value", single ? cat("shape [", p.B, ", Hv, V] (B of query)") : cat("shape [", p.B, ", ", p.T, ", Hv, V] (B and T of query)"),
         dims(v));
  p.Hk = k.size(hd);
  p.Hv = v.size(hd);
  p.V = v.size(hd + 1);
  check_heads(p, q, k, v);
  require_data("query", q);
  require_data("key", k);
  require_data("value", v);

  // (b, t, h) strides of a token tensor, whatever its form.
  auto tok3 = [&](const tensor_view& t) {
    strided3 s;
    s.data = t.data();
    s.type = t.type();
    s.s0 = t.stride(0);
    s.s1 = single ? 0 : t.stride(1);
    s.s2 = t.rank() > hd ? t.stride(hd) : 0;
    return s;
  };

  // Variable length.
  p.varlen = opt.cu_seqlens.has_value();
  p.N = p.B;
  const void* cu_host = nullptr;  // cu_seqlens, host-readable (a copy when it is device memory)
  if (p.varlen) {
    const tensor_view& cu = *opt.cu_seqlens;
    if (single) fail("cu_seqlens", "none with a single-token query [B, Hq, K] (varlen needs [1, Ttot, Hq, K])", dims(cu));
    require_rank("cu_seqlens", cu, 1, "[N + 1]");
    check_index_dtype("cu_seqlens", cu);
    if (cu.size(0) < 1) fail("cu_seqlens", "at least one entry [N + 1]", dims(cu));
    require_data("cu_seqlens", cu);
    if (p.B != 1) fail("query", "batch size B = 1 with cu_seqlens (varlen)", cat("B = ", p.B));
    p.N = cu.size(0) - 1;
    p.cu_seqlens = cu.data();
    p.cu_type = cu.type();
    thread_local std::vector<unsigned char> cu_copy;
    cu_host = host_readable("cu_seqlens", cu, cu_copy, opt.stream);
    std::int64_t prev = load_as<std::int64_t>(cu_host, cu.type(), 0);
    if (prev != 0) fail("cu_seqlens", "cu_seqlens[0] = 0", cat("cu_seqlens[0] = ", prev));
    for (std::int64_t i = 1; i <= p.N; ++i) {
      const std::int64_t c = load_as<std::int64_t>(cu_host, cu.type(), i * cu.stride(0));
      if (c < prev)
        fail("cu_seqlens", cat("non-decreasing values (cu_seqlens[", i, "] >= ", prev, ")"), cat("cu_seqlens[", i, "] = ", c));
      prev = c;
    }
    if (prev != p.T)
      fail("cu_seqlens", cat("cu_seqlens[N] = ", p.T, " (the token count of query)"), cat("cu_seqlens[", p.N, "] = ", prev));
    if (cu.stride(0) != 1) fail("cu_seqlens", "a contiguous tensor", cat("stride ", cu.stride(0)));
  }
  const char* rows = p.varlen ? "N" : "B";

  p.q = tok3(q);
  p.k = tok3(k);
  p.v = tok3(v);

  if (opt.g) {
    if (single) check_dims("g", *opt.g, {p.B, p.H}, "[B, H] (one token per row)");
    else check_dims("g", *opt.g, {p.B, p.T, p.H}, "[B, T, H]");
    require_gate_dtype("g", *opt.g, qt);
    require_data("g", *opt.g);
    const tensor_view& g = *opt.g;
    p.g.data = g.data();
    p.g.type = g.type();
    p.g.s0 = g.stride(0);
    p.g.s1 = single ? 0 : g.stride(1);
    p.g.s2 = single ? g.stride(1) : g.stride(2);
    p.gates |= gate_g;
  }
  if (opt.g_gamma) {
    const tensor_view& gg = *opt.g_gamma;
    if (gg.rank() == 1) check_dims("g_gamma", gg, {p.H}, "[H]");
    else if (gg.rank() == 2) check_dims("g_gamma", gg, {p.N, p.H}, p.varlen ? "[N, H]" : "[B, H]");
    else fail("g_gamma", cat("rank 1 [H] or rank 2 [", rows, ", H]"), cat("rank ", gg.rank(), " ", dims(gg)));
    require_gate_dtype("g_gamma", gg, qt);
    require_data("g_gamma", gg);
    p.g_gamma = strided_of(gg);
    if (gg.rank() == 1) {
      p.g_gamma.s1 = p.g_gamma.s0;
      p.g_gamma.s0 = 0;
    }
    p.gates |= gate_g_gamma;
  }
  if (opt.gk) {
    if (single) check_dims("gk", *opt.gk, {p.B, p.H, p.K}, "[B, H, K] (one token per row)");
    else check_dims("gk", *opt.gk, {p.B, p.T, p.H, p.K}, "[B, T, H, K]");
    require_gate_dtype("gk", *opt.gk, qt);
    require_data("gk", *opt.gk);
    p.gk = tok3(*opt.gk);
    p.gates |= gate_gk;
  }
  if (opt.gv) {
    if (single) check_dims("gv", *opt.gv, {p.B, p.H, p.V}, "[B, H, V] (one token per row)");
    else check_dims("gv", *opt.gv, {p.B, p.T, p.H, p.V}, "[B, T, H, V]");
    require_gate_dtype("gv", *opt.gv, qt);
    require_data("gv", *opt.gv);
    p.gv = tok3(*opt.gv);
    p.gates |= gate_gv;
  }

  if (opt.softmax_scale) {
    p.scale = *opt.softmax_scale;
    if (!std::isfinite(p.scale)) fail("softmax_scale", "a finite value", p.scale);
  } else {
    p.scale = 1.0 / std::sqrt(double(p.K));
  }
  p.layout = opt.state_layout;
  const bool kv = p.layout == state_layout::kv;
  const std::int64_t r2 = kv ? p.K : p.V, r3 = kv ? p.V : p.K;
  const char* pool_str = kv ? "[P, H, K, V]" : "[P, H, V, K] (state_layout vk)";

  // Output.
  if (single) check_dims("output", out, {p.B, p.H, p.V}, "[B, H, V]");
  else check_dims("output", out, {p.B, p.T, p.H, p.V}, "[B, T, H, V]");
  require_dtype("output", out, qt);
  require_data("output", out);
  p.out = tok3(out);

  // State pool.
  if (state_pool.rank() != 4) fail("state_pool", cat("rank 4 ", pool_str), cat("rank ", state_pool.rank(), " ", dims(state_pool)));
  sp.P = state_pool.size(0);
  if (state_pool.size(1) != p.H || state_pool.size(2) != r2 || state_pool.size(3) != r3)
    fail("state_pool", cat("shape [P, ", p.H, ", ", r2, ", ", r3, "] ", pool_str), dims(state_pool));
  const dtype st = state_pool.type();
  if (qt == dtype::float64) {
    if (st != dtype::float64) fail("state_pool", "dtype float64 (the state of float64 inputs)", cat("dtype ", dtype_name(st)));
  } else if (st != dtype::float32 && st != dtype::bfloat16) {
    fail("state_pool", cat("dtype float32 or bfloat16 (state storage for ", dtype_name(qt), " inputs)"), cat("dtype ", dtype_name(st)));
  }
  require_data("state_pool", state_pool);
  for (int i = 0; i < 3; ++i)
    if (state_pool.stride(i) < 0) fail("state_pool", "non-negative strides", cat("stride ", state_pool.stride(i), " in dimension ", i));
  sp.state_type = st;
  sp.pool = strided4(state_pool);

  // State indices.
  const void* idx_host = nullptr;
  thread_local std::vector<unsigned char> idx_copy, snap_copy;
  if (opt.state_indices) {
    const tensor_view& ix = *opt.state_indices;
    check_dims("state_indices", ix, {p.N}, p.varlen ? "[N] (one slot per sequence)" : "[B] (one slot per row)");
    check_index_dtype("state_indices", ix);
    require_data("state_indices", ix);
    if (ix.stride(0) < 0) fail("state_indices", "a non-negative stride", cat("stride ", ix.stride(0)));
    sp.indices = ix.data();
    sp.index_type = ix.type();
    sp.index_stride = ix.stride(0);
    if (opt.check_index_values && p.N > 0) idx_host = host_readable("state_indices", ix, idx_copy, opt.stream);
  } else if (sp.P < p.N) {
    fail("state_pool", cat("at least ", p.N, " slots (row n uses slot n without state_indices)"), cat("P = ", sp.P));
  }

  // Snapshots.
  if (opt.snapshots.has_value() != opt.snapshot_indices.has_value())
    fail(opt.snapshots ? "snapshot_indices" : "snapshots", cat("a tensor (", opt.snapshots ? "snapshots" : "snapshot_indices", " is given)"), "none");
  const void* snap_host = nullptr;
  if (opt.snapshots) {
    const mutable_tensor_view& sn = *opt.snapshots;
    if (sn.rank() != 4) fail("snapshots", cat("rank 4 ", pool_str, " (the state pool's layout)"), cat("rank ", sn.rank(), " ", dims(sn)));
    if (sn.size(1) != p.H || sn.size(2) != r2 || sn.size(3) != r3)
      fail("snapshots", cat("shape [Ps, ", p.H, ", ", r2, ", ", r3, "] ", pool_str, " (the state pool's layout)"), dims(sn));
    if (sn.type() != st) fail("snapshots", cat("dtype ", dtype_name(st), " (the state pool's)"), cat("dtype ", dtype_name(sn.type())));
    require_data("snapshots", sn);
    for (int i = 0; i < 3; ++i)
      if (sn.stride(i) < 0) fail("snapshots", "non-negative strides", cat("stride ", sn.stride(i), " in dimension ", i));
    const bool same = sn.data() == state_pool.data() && sn.strides() == state_pool.strides() && sn.size(0) == sp.P;
    if (!same && overlaps(sn, state_pool))
      fail("snapshots", "memory disjoint from state_pool, or state_pool itself", "a buffer overlapping state_pool");
    if (overlaps(sn, out) || overlaps(state_pool, out))
      fail("output", "memory disjoint from state_pool and snapshots", "a buffer overlapping them");
    sp.Ps = sn.size(0);
    sp.snap = strided4(sn);
    const tensor_view& si = *opt.snapshot_indices;
    if (single) check_dims("snapshot_indices", si, {p.B}, "[B] (one token per row)");
    else check_dims("snapshot_indices", si, {p.B, p.T}, p.varlen ? "[1, Ttot] (one slot per token)" : "[B, T] (one slot per token)");
    check_index_dtype("snapshot_indices", si);
    require_data("snapshot_indices", si);
    for (int i = 0; i < si.rank(); ++i)
      if (si.stride(i) < 0) fail("snapshot_indices", "non-negative strides", cat("stride ", si.stride(i)));
    sp.snap_indices = si.data();
    sp.snap_index_type = si.type();
    sp.snap_s0 = si.stride(0);
    sp.snap_s1 = single ? 0 : si.stride(1);
    if (opt.check_index_values && si.numel() > 0) snap_host = host_readable("snapshot_indices", si, snap_copy, opt.stream);
  } else if (overlaps(state_pool, out)) {
    fail("output", "memory disjoint from state_pool", "a buffer overlapping state_pool");
  }

  // Index values: range, then duplicates (two rows, or two tokens, writing one slot would race).
  if (idx_host) {
    for (std::int64_t n = 0; n < p.N; ++n) {
      const std::int64_t s = load_as<std::int64_t>(idx_host, sp.index_type, n * sp.index_stride);
      if (s >= sp.P) fail("state_indices", cat("values < P = ", sp.P, " (or negative: padding)"), cat("state_indices[", n, "] = ", s));
    }
  }
  if (snap_host) {
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::int64_t t = 0; t < p.T; ++t) {
        const std::int64_t s = load_as<std::int64_t>(snap_host, sp.snap_index_type, b * sp.snap_s0 + t * sp.snap_s1);
        if (s >= sp.Ps)
          fail("snapshot_indices", cat("values < Ps = ", sp.Ps, " (or negative: not kept)"),
               single ? cat("snapshot_indices[", b, "] = ", s) : cat("snapshot_indices[", b, ", ", t, "] = ", s));
      }
  }
  const bool check_rows = idx_host != nullptr;
  const bool check_snaps = snap_host != nullptr;
  if (check_rows || check_snaps) {
    const bool aliased = opt.snapshots && opt.snapshots->data() == state_pool.data();
    auto row_slot = [&](std::int64_t n) {
      return idx_host ? load_as<std::int64_t>(idx_host, sp.index_type, n * sp.index_stride) : n;
    };
    // Rows that are padding write nothing, their snapshot slots included.
    auto is_padding_row = [&](std::int64_t n) { return sp.indices && row_slot(n) < 0; };
    auto snap_at = [&](std::int64_t i) {  // token i in row-major (b, t) order
      const std::int64_t b = i / p.T, t = i % p.T;
      return load_as<std::int64_t>(snap_host, sp.snap_index_type, b * sp.snap_s0 + t * sp.snap_s1);
    };
    // Sequence (row) of the token at (b, t).
    auto row_of = [&](std::int64_t b, std::int64_t t) {
      if (!p.varlen) return b;
      std::int64_t lo = 0, hi = p.N;  // largest n with cu[n] <= t and cu[n + 1] > t
      const void* cu = cu_host;
      while (hi - lo > 1) {
        const std::int64_t mid = (lo + hi) / 2;
        if (load_as<std::int64_t>(cu, p.cu_type, mid) <= t) lo = mid; else hi = mid;
      }
      return lo;
    };
    const std::int64_t slots = std::max(sp.P, sp.Ps);
    std::vector<std::uint64_t>& bits = slot_bitmap(slots);
    std::int64_t marked_rows = 0, marked_snaps = 0;
    auto clear = [&] {
      for (std::int64_t n = 0; n < marked_rows; ++n) {
        const std::int64_t s = row_slot(n);
        if (s >= 0) bits[std::size_t(s >> 6)] &= ~(std::uint64_t(1) << (s & 63));
      }
      for (std::int64_t i = 0; i < marked_snaps; ++i) {
        const std::int64_t s = snap_at(i);
        if (s >= 0) bits[std::size_t(s >> 6)] &= ~(std::uint64_t(1) << (s & 63));
      }
    };
    // Marks s; returns false (and clears every mark) if it was marked already.
    auto mark = [&](std::int64_t s) {
      std::uint64_t& w = bits[std::size_t(s >> 6)];
      const std::uint64_t m = std::uint64_t(1) << (s & 63);
      if (w & m) return false;
      w |= m;
      return true;
    };
    // Row slots and snapshot slots share the bitmap only when they share memory.
    if (check_rows) {
      for (std::int64_t n = 0; n < p.N; ++n, ++marked_rows) {
        const std::int64_t s = row_slot(n);
        if (s >= 0 && !mark(s)) {
          clear();
          fail("state_indices", "distinct non-negative values (two rows would race on one slot)",
               cat("state_indices[", n, "] = ", s, " repeated"));
        }
      }
    }
    if (check_snaps) {
      if (!aliased) {
        clear();
        marked_rows = 0;
      } else if (!check_rows) {
        for (std::int64_t n = 0; n < p.N; ++n, ++marked_rows) (void)mark(row_slot(n));
      }
      for (std::int64_t i = 0; i < p.B * p.T; ++i, ++marked_snaps) {
        const std::int64_t b = i / p.T, t = i % p.T;
        const std::int64_t s = snap_at(i);
        if (s < 0 || is_padding_row(row_of(b, t))) continue;
        if (!mark(s)) {
          clear();  // s's bit belongs to an earlier entry, which clear() walks
          fail("snapshot_indices",
               aliased ? "distinct non-negative values, none equal to a row's state slot (snapshots is state_pool)"
                       : "distinct non-negative values (two tokens would race on one slot)",
               single ? cat("snapshot_indices[", b, "] = ", s, " repeated")
                      : cat("snapshot_indices[", b, ", ", t, "] = ", s, " repeated"));
        }
      }
    }
    clear();
  }
  return sp;
}

namespace detail {

/// Calls `Backend::template step<T, Gates, Storage>(sp, c)` for the specialization that matches
/// the checked step problem: input dtype x gate combination x state storage (the accumulator
/// type or bfloat16). Varlen and the state layout are steered at run time inside the kernels
/// (they change only the item's bounds and the state's load and store), but their caps hold.
template <class Backend, class Cfg>
void dispatch_step(const step_problem& sp, const Cfg& c) {
  const problem& p = sp.tok;
  if (RECATTN_DISABLE_VARLEN && p.varlen)
    throw Error("cu_seqlens (RECATTN_DISABLE_VARLEN): this build was compiled without it");
  if (RECATTN_DISABLE_VK_STATE && p.layout == state_layout::vk)
    throw Error("state_layout vk (RECATTN_DISABLE_VK_STATE): this build was compiled without it");
  dtype_switch(p.type, [&](auto tag) {
    using T = decltype(tag);
    using Acc = accum_t<T>;
    RECATTN_GATE_SWITCH(p.gates, Gates, [&] {
      RECATTN_BOOL_SWITCH_CAPPED(sp.state_type == dtype::bfloat16,
                                 (RECATTN_DISABLE_BF16_STATE || std::is_same<T, double>::value),
                                 "state_pool dtype bfloat16 (RECATTN_DISABLE_BF16_STATE)", Bf16, [&] {
        using Storage = std::conditional_t<Bf16, bfloat16, Acc>;
        Backend::template step<T, Gates, Storage>(sp, c);
      });
    });
  });
}

}  // namespace detail
}  // namespace recattn
