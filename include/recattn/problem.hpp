// The runtime arguments of a call in one plain struct (flash-attention's Flash_fwd_params),
// and the validation that builds it: every check of SPEC §5, before anything is written.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cfg.hpp"
#include "dtype.hpp"
#include "error.hpp"
#include "tensor.hpp"

#if RECATTN_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace recattn {

/// Optional tensors and flags of the forward operation (ejkernel's keyword arguments).
struct forward_options {
  std::optional<tensor_view> g;              ///< [B, T, H] scalar log-decay
  std::optional<tensor_view> g_gamma;        ///< [H] or [B|N, H] per-head constant log-decay
  std::optional<tensor_view> gk;             ///< [B, T, H, K] key-channel log-decay
  std::optional<tensor_view> gv;             ///< [B, T, H, V] value-channel log-decay
  std::optional<tensor_view> initial_state;  ///< [N, H, K, V] ([N, H, V, K] for state_layout::vk)
  std::optional<tensor_view> cu_seqlens;     ///< [N + 1] int32 or int64; B must be 1
  std::optional<double> softmax_scale;       ///< default 1 / sqrt(K)
  bool reverse = false;
  bool return_state = false;
  recattn::state_layout state_layout = recattn::state_layout::kv;
  recattn::platform platform = recattn::platform::automatic;
  std::optional<recattn::cfg> cfg;
  void* stream = nullptr;  ///< cudaStream_t for platform cuda (null: the default stream)
};

/// Caller-owned output buffers of the forward operation.
struct forward_outputs {
  mutable_tensor_view output;                      ///< [B, T, H, V], q's dtype
  std::optional<mutable_tensor_view> final_state;  ///< [N, H, K, V]; may alias initial_state
};

/// Bit of each gate in `problem::gates`.
enum gate_bit : unsigned { gate_g = 1u, gate_g_gamma = 2u, gate_gk = 4u, gate_gv = 8u };

inline std::string gate_mask_name(unsigned m) {
  if (m == 0) return "none";
  if (m == 15) return "all";
  std::string s;
  const char* names[4] = {"g", "g_gamma", "gk", "gv"};
  for (int i = 0; i < 4; ++i)
    if (m & (1u << i)) s += (s.empty() ? "" : "+") + std::string(names[i]);
  return s;
}

/// A tensor indexed by (i0, i1, i2) with a contiguous last dimension.
struct strided3 {
  const void* data = nullptr;
  dtype type = dtype::float32;
  std::int64_t s0 = 0, s1 = 0, s2 = 0;
  std::int64_t offset(std::int64_t i0, std::int64_t i1, std::int64_t i2) const { return i0 * s0 + i1 * s1 + i2 * s2; }
};

/// All runtime arguments of one call, checked. Kernels read nothing else.
struct problem {
  std::int64_t B = 0, T = 0, N = 0, H = 0, Hq = 0, Hk = 0, Hv = 0, K = 0, V = 0;
  dtype type = dtype::float32;        ///< q, k, v and output dtype
  dtype state_type = dtype::float32;  ///< initial and final state dtype
  unsigned gates = 0;                 ///< gate_bit mask
  bool reverse = false;
  bool varlen = false;
  recattn::state_layout layout = recattn::state_layout::kv;
  double scale = 1.0;

  strided3 q, k, v;          ///< (b, t, head of the tensor), then K or V contiguous
  strided3 g;                ///< (b, t, h)
  strided3 g_gamma;          ///< (n, h, -): s0 is 0 for [H]
  strided3 gk, gv;           ///< (b, t, h), then K or V contiguous
  strided3 h0;               ///< (n, h, row) of the state, last dim contiguous; data null: zeros
  strided3 out;              ///< (b, t, h)
  strided3 ht;               ///< (n, h, row); data null: not returned
  const void* cu_seqlens = nullptr;
  dtype cu_type = dtype::int64;

  void* out_data() const { return const_cast<void*>(out.data); }
  void* ht_data() const { return const_cast<void*>(ht.data); }
  bool has(unsigned bit) const { return (gates & bit) != 0; }
  /// Token range of sequence n: batch row, first time index and length.
  std::int64_t seq_begin(std::int64_t n) const { return varlen ? load_as<std::int64_t>(cu_seqlens, cu_type, n) : 0; }
  std::int64_t seq_len(std::int64_t n) const {
    return varlen ? load_as<std::int64_t>(cu_seqlens, cu_type, n + 1) - seq_begin(n) : T;
  }
  std::int64_t seq_batch(std::int64_t n) const { return varlen ? 0 : n; }
  std::int64_t state_rows() const { return layout == state_layout::kv ? K : V; }
  std::int64_t state_cols() const { return layout == state_layout::kv ? V : K; }
  std::string signature() const;
};

namespace detail {

inline std::string dims(const tensor_view& t) { return shape_str(t.shape().data(), t.rank()); }

inline void check_rank(const std::string& name, const tensor_view& t, int rank, const char* layout) {
  if (t.rank() != rank) fail(name, cat("rank ", rank, " ", layout), cat("rank ", t.rank(), " ", dims(t)));
}

inline void check_shape(const std::string& name, const tensor_view& t, const std::vector<std::int64_t>& want,
                        const char* layout) {
  bool ok = t.rank() == int(want.size());
  for (int i = 0; ok && i < t.rank(); ++i) ok = t.size(i) == want[std::size_t(i)];
  if (!ok) fail(name, cat("shape ", shape_str(want), " ", layout), dims(t));
}

inline void check_data(const std::string& name, const tensor_view& t) {
  if (t.numel() > 0 && t.data() == nullptr) fail(name, "non-null data", "null pointer");
  if (t.rank() > 0 && t.size(t.rank() - 1) > 1 && t.stride(t.rank() - 1) != 1)
    fail(name, "stride 1 in the last dimension", cat("stride ", t.stride(t.rank() - 1)));
  for (int i = 0; i < t.rank(); ++i)
    if (t.size(i) < 0) fail(name, "non-negative sizes", dims(t));
}

inline void check_dtype(const std::string& name, const tensor_view& t, dtype want) {
  if (t.type() != want) fail(name, cat("dtype ", dtype_name(want)), cat("dtype ", dtype_name(t.type())));
}

inline void check_gate_dtype(const std::string& name, const tensor_view& t, dtype q) {
  if (t.type() != dtype::float32 && t.type() != q)
    fail(name, cat("dtype float32 or ", dtype_name(q), " (the query's)"), cat("dtype ", dtype_name(t.type())));
}

/// K and V at least 1 and the head counts of q, k, v (p.K, p.V, p.Hq, p.Hk, p.Hv, already
/// read from the shapes) each at least one and dividing H, the largest, which it sets.
/// Shared by the forward's and the decode step's checks; allocates only to fail.
inline void check_heads(problem& p, const tensor_view& q, const tensor_view& k, const tensor_view& v) {
  if (p.K < 1) fail("query", "K >= 1 (last dimension)", dims(q));
  if (p.V < 1) fail("value", "V >= 1 (last dimension)", dims(v));
  if (p.Hq < 1) fail("query", "at least one head", dims(q));
  if (p.Hk < 1) fail("key", "at least one head", dims(k));
  if (p.Hv < 1) fail("value", "at least one head", dims(v));
  p.H = std::max(p.Hq, std::max(p.Hk, p.Hv));
  if (p.H % p.Hq) fail("query", cat("a head count dividing H = ", p.H), p.Hq);
  if (p.H % p.Hk) fail("key", cat("a head count dividing H = ", p.H), p.Hk);
  if (p.H % p.Hv) fail("value", cat("a head count dividing H = ", p.H), p.Hv);
}

/// Up to 3-d tensors: strides left-aligned, missing dims 0.
inline strided3 strided_of(const tensor_view& t) {
  strided3 s;
  s.data = t.data();
  s.type = t.type();
  std::int64_t st[3] = {0, 0, 0};
  for (int i = 0; i < t.rank() && i < 3; ++i) st[i] = t.stride(i);
  s.s0 = st[0];
  s.s1 = st[1];
  s.s2 = st[2];
  return s;
}

/// 4-d tensors (b, t, h, c) or (n, h, row, col): strides of the first three dims.
inline strided3 strided4(const tensor_view& t) {
  strided3 s;
  s.data = t.data();
  s.type = t.type();
  s.s0 = t.stride(0);
  s.s1 = t.stride(1);
  s.s2 = t.stride(2);
  return s;
}

}  // namespace detail

/// What the forward output and state buffers must hold.
enum class output_kind {
  native,     ///< output in q's dtype, state in float (double for double inputs)
  reference,  ///< output and state in double: the scalar reference oracle
};

/// Checks every argument of a forward call (SPEC §5) and returns the plain problem.
/// Throws recattn::Error naming the argument, the expected and the actual value.
/// `outs` may be null (sizes only: the allocating API checks before it allocates).
inline problem make_problem(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                            const forward_options& opt, const forward_outputs* outs,
                            output_kind kind = output_kind::native) {
  using namespace detail;
  problem p;
  check_rank("query", q, 4, "[B, T, Hq, K]");
  check_rank("key", k, 4, "[B, T, Hk, K]");
  check_rank("value", v, 4, "[B, T, Hv, V]");
  const dtype qt = q.type();
  if (qt != dtype::float32 && qt != dtype::float64 && qt != dtype::bfloat16 && qt != dtype::float16)
    fail("query", "dtype float32, float64, bfloat16 or float16", cat("dtype ", dtype_name(qt)));
  check_dtype("key", k, qt);
  check_dtype("value", v, qt);
  p.type = qt;
  p.state_type = qt == dtype::float64 ? dtype::float64 : dtype::float32;
  const dtype state_t = kind == output_kind::reference ? dtype::float64 : p.state_type;
  const dtype out_t = kind == output_kind::reference ? dtype::float64 : qt;

  p.B = q.size(0);
  p.T = q.size(1);
  p.Hq = q.size(2);
  p.K = q.size(3);
  if (k.size(0) != p.B || k.size(1) != p.T || k.size(3) != p.K)
    fail("key", cat("shape [", p.B, ", ", p.T, ", Hk, ", p.K, "] (B, T and K of query)"), dims(k));
  if (v.size(0) != p.B || v.size(1) != p.T)
    fail("value", cat("shape [", p.B, ", ", p.T, ", Hv, V] (B and T of query)"), dims(v));
  p.Hk = k.size(2);
  p.Hv = v.size(2);
  p.V = v.size(3);
  check_heads(p, q, k, v);
  check_data("query", q);
  check_data("key", k);
  check_data("value", v);

  // Variable length.
  p.varlen = opt.cu_seqlens.has_value();
  p.N = p.B;
  if (p.varlen) {
    const tensor_view& cu = *opt.cu_seqlens;
    check_rank("cu_seqlens", cu, 1, "[N + 1]");
    if (cu.type() != dtype::int32 && cu.type() != dtype::int64)
      fail("cu_seqlens", "dtype int32 or int64", cat("dtype ", dtype_name(cu.type())));
    if (cu.size(0) < 1) fail("cu_seqlens", "at least one entry [N + 1]", dims(cu));
    check_data("cu_seqlens", cu);
    if (p.B != 1) fail("query", "batch size B = 1 with cu_seqlens (varlen)", cat("B = ", p.B));
    p.N = cu.size(0) - 1;
    p.cu_seqlens = cu.data();
    p.cu_type = cu.type();
    const void* cu_host = cu.data();
#if RECATTN_HAS_CUDA
    // cu_seqlens in device memory: validate a host copy (the kernels read the original).
    std::vector<unsigned char> cu_copy;
    cudaPointerAttributes cu_attr{};
    if (cudaPointerGetAttributes(&cu_attr, cu.data()) != cudaSuccess) {
      (void)cudaGetLastError();  // no device, or not a CUDA pointer: read it as host memory
    } else if (cu_attr.type == cudaMemoryTypeDevice) {
      cu_copy.resize(std::size_t(cu.size(0)) * dtype_size(cu.type()));
      const cudaError_t e = cudaMemcpy(cu_copy.data(), cu.data(), cu_copy.size(), cudaMemcpyDeviceToHost);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        fail("cu_seqlens", "device memory that can be copied to the host", cudaGetErrorString(e));
      }
      cu_host = cu_copy.data();
    }
#endif
    std::int64_t prev = load_as<std::int64_t>(cu_host, cu.type(), 0);
    if (prev != 0) fail("cu_seqlens", "cu_seqlens[0] = 0", cat("cu_seqlens[0] = ", prev));
    for (std::int64_t i = 1; i <= p.N; ++i) {
      const std::int64_t c = load_as<std::int64_t>(cu_host, cu.type(), i);
      if (c < prev)
        fail("cu_seqlens", cat("non-decreasing values (cu_seqlens[", i, "] >= ", prev, ")"),
             cat("cu_seqlens[", i, "] = ", c));
      prev = c;
    }
    if (prev != p.T)
      fail("cu_seqlens", cat("cu_seqlens[N] = ", p.T, " (the token count of query)"),
           cat("cu_seqlens[", p.N, "] = ", prev));
  }
  const char* nb = p.varlen ? "N" : "B";

  p.q = strided4(q);
  p.k = strided4(k);
  p.v = strided4(v);

  if (opt.g) {
    check_shape("g", *opt.g, {p.B, p.T, p.H}, "[B, T, H]");
    check_gate_dtype("g", *opt.g, qt);
    check_data("g", *opt.g);
    p.g = strided_of(*opt.g);
    p.gates |= gate_g;
  }
  if (opt.g_gamma) {
    const tensor_view& gg = *opt.g_gamma;
    if (gg.rank() == 1) {
      check_shape("g_gamma", gg, {p.H}, "[H]");
    } else if (gg.rank() == 2) {
      check_shape("g_gamma", gg, {p.N, p.H}, p.varlen ? "[N, H]" : "[B, H]");
    } else {
      fail("g_gamma", cat("rank 1 [H] or rank 2 [", nb, ", H]"), cat("rank ", gg.rank(), " ", dims(gg)));
    }
    check_gate_dtype("g_gamma", gg, qt);
    check_data("g_gamma", gg);
    p.g_gamma = strided_of(gg);
    if (gg.rank() == 1) {  // [H]: the same row for every sequence
      p.g_gamma.s1 = p.g_gamma.s0;
      p.g_gamma.s0 = 0;
    }
    p.gates |= gate_g_gamma;
  }
  if (opt.gk) {
    check_shape("gk", *opt.gk, {p.B, p.T, p.H, p.K}, "[B, T, H, K]");
    check_gate_dtype("gk", *opt.gk, qt);
    check_data("gk", *opt.gk);
    p.gk = strided4(*opt.gk);
    p.gates |= gate_gk;
  }
  if (opt.gv) {
    check_shape("gv", *opt.gv, {p.B, p.T, p.H, p.V}, "[B, T, H, V]");
    check_gate_dtype("gv", *opt.gv, qt);
    check_data("gv", *opt.gv);
    p.gv = strided4(*opt.gv);
    p.gates |= gate_gv;
  }

  p.layout = opt.state_layout;
  const bool kv = p.layout == state_layout::kv;
  const std::vector<std::int64_t> state_shape = kv ? std::vector<std::int64_t>{p.N, p.H, p.K, p.V}
                                                   : std::vector<std::int64_t>{p.N, p.H, p.V, p.K};
  const char* state_layout_str = kv ? (p.varlen ? "[N, H, K, V]" : "[B, H, K, V]")
                                    : (p.varlen ? "[N, H, V, K] (state_layout vk)" : "[B, H, V, K] (state_layout vk)");
  if (opt.initial_state) {
    check_shape("initial_state", *opt.initial_state, state_shape, state_layout_str);
    // The reference reads the native state dtype too, so that one options value serves both.
    if (!(kind == output_kind::reference && opt.initial_state->type() == p.state_type))
      check_dtype("initial_state", *opt.initial_state, state_t);
    check_data("initial_state", *opt.initial_state);
    p.h0 = strided4(*opt.initial_state);
  }

  if (opt.softmax_scale) {
    p.scale = *opt.softmax_scale;
    if (!std::isfinite(p.scale)) fail("softmax_scale", "a finite value", p.scale);
  } else {
    p.scale = 1.0 / std::sqrt(double(p.K));
  }
  p.reverse = opt.reverse;

  if (outs) {
    check_shape("output", outs->output, {p.B, p.T, p.H, p.V}, "[B, T, H, V]");
    check_dtype("output", outs->output, out_t);
    check_data("output", outs->output);
    p.out = strided4(outs->output);
    if (opt.return_state && !outs->final_state)
      fail("final_state", "a buffer (return_state is true)", "none");
    if (outs->final_state) {
      check_shape("final_state", *outs->final_state, state_shape, state_layout_str);
      check_dtype("final_state", *outs->final_state, state_t);
      check_data("final_state", *outs->final_state);
      p.ht = strided4(*outs->final_state);
      if (opt.initial_state && opt.initial_state->data() == outs->final_state->data() &&
          opt.initial_state->strides() != outs->final_state->strides())
        fail("final_state", "the strides of initial_state when both share memory", "different strides");
    }
  }
  return p;
}

inline std::string problem::signature() const {
  return detail::cat(dtype_name(type), "/", gate_mask_name(gates), reverse ? "/rev" : "", varlen ? "/varlen" : "",
                     layout == state_layout::vk ? "/vk" : "", "/N", N, "/T", T, "/H", H, "/Hq", Hq, "/Hk", Hk, "/Hv",
                     Hv, "/K", K, "/V", V);
}

}  // namespace recattn
