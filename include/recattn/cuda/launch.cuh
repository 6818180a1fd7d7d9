// The CUDA backend of the forward operation: configuration (heuristic, candidates,
// checks), argument packing and the launch. Reached from recattn.hpp through
// detail::dispatch_forward, like the CPU backend; only compiled by nvcc.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "../cfg.hpp"
#include "../dispatch.hpp"
#include "../error.hpp"
#include "../policy.hpp"
#include "../problem.hpp"
#include "common.cuh"
#include "recurrence.cuh"

namespace recattn::cuda {

/// Largest K the kernel holds in registers (16 lanes x 16 rows per lane).
inline constexpr std::int64_t max_k = 256;
/// Columns of V per warp.
inline constexpr int columns_per_warp = 8;

namespace detail {

/// Rows per lane for a key size: the kernel is compiled for R in {4, 8, 16} (16 R >= K).
inline int rows_per_lane(std::int64_t K, dtype t = dtype::float32) {
  if (t == dtype::float64) return 16;
  return K <= 64 ? 4 : K <= 128 ? 8 : 16;
}

inline std::size_t acc_size(const problem& p) { return p.type == dtype::float64 ? 8 : 4; }

inline smem_layout layout_for(const problem& p, int nw, int chunk) {
  const int Kp = 16 * rows_per_lane(p.K, p.type);
  return make_smem_layout(int(p.K), Kp, nw * columns_per_warp, chunk, int(dtype_size(p.type)),
                          p.has(gate_gk) ? int(dtype_size(p.gk.type)) : 0,
                          p.has(gate_gv) ? int(dtype_size(p.gv.type)) : 0, p.has(gate_gk), p.has(gate_gv),
                          p.has(gate_gv),
                          !p.has(gate_gk) && !p.has(gate_gv) && (p.has(gate_g) || p.has(gate_g_gamma)),
                          int(acc_size(p)));
}

/// Shared memory a block may use: the device's opt-in limit, minus a margin for the
/// runtime's reserve.
inline std::size_t smem_budget() { return std::size_t(std::max(48 * 1024, max_smem_optin() - 1024)); }

/// Largest chunk <= want (a multiple of 4, the kernel's token groups, and <= the block's
/// threads, which stage the scalar gates) that fits in shared memory.
inline int fit_chunk(const problem& p, int nw, int want) {
  int chunk = std::max(4, std::min(want, 32 * nw) / 4 * 4);
  const std::size_t budget = smem_budget();
  while (chunk > 4 && layout_for(p, nw, chunk).bytes > budget) chunk = std::max(4, chunk / 2 / 4 * 4);
  return chunk;
}

inline int ceil_pow2(std::int64_t x) {
  int r = 1;
  while (r < x && r < (1 << 30)) r *= 2;
  return r;
}

inline void check_sizes(const problem& p) {
  if (p.K > max_k)
    recattn::detail::fail("query", recattn::detail::cat("K <= ", max_k, " on platform cuda (the state rows a warp holds in registers)"),
                          recattn::detail::cat("K = ", p.K));
  if (p.N * p.H * ((p.V + 7) / 8) > (std::int64_t(1) << 31) - 1)
    recattn::detail::fail("query", "fewer than 2^31 (sequence, head, value block) work items on platform cuda",
                          recattn::detail::cat("N = ", p.N, ", H = ", p.H, ", V = ", p.V));
}

}  // namespace detail

/// A good default: as many warps per block as the value columns allow, up to 8 (the
/// staging, the gate exponentials and the barriers are shared by a block's warps), and
/// the longest chunk that fits (fewer barriers). Measured on an H200 (bench/CUDA_RESULTS.md):
/// 8 warps beat 4 warps at twice the blocks on every case of issue 5, by 1.3x to 2x, and
/// chunks of 32 or 64 tokens beat 16 with 8 warps.
inline cfg heuristic_cfg(const problem& p) {
  detail::check_sizes(p);
  const std::int64_t groups = (p.V + columns_per_warp - 1) / columns_per_warp;  // warps per head
  const int nw = int(std::min<std::int64_t>(8, detail::ceil_pow2(groups)));
  cfg c;
  c.num_warps = nw;
  c.block_v = nw * columns_per_warp;
  c.block_k = 16 * detail::rows_per_lane(p.K, p.type);
  c.chunk = detail::fit_chunk(p, nw, nw >= 4 ? 64 : 16);
  return c;
}

/// Fills zero fields of `user` from the heuristic and checks the rest; throws for sizes the
/// kernel cannot take (K > 256).
inline cfg resolve_cfg(const problem& p, const std::optional<cfg>& user) {
  const cfg h = heuristic_cfg(p);
  if (!user) return h;
  cfg c = *user;
  using recattn::detail::fail;
  if (c.threads < 0) fail("cfg.threads", "a value >= 0", c.threads);
  if (c.block_v != 0 && c.block_v != 8 && c.block_v != 16 && c.block_v != 32 && c.block_v != 64)
    fail("cfg.block_v", "0, 8, 16, 32 or 64 on platform cuda (8 columns per warp)", c.block_v);
  if (c.num_warps != 0 && c.num_warps != 1 && c.num_warps != 2 && c.num_warps != 4 && c.num_warps != 8)
    fail("cfg.num_warps", "0, 1, 2, 4 or 8 on platform cuda", c.num_warps);
  if (c.block_v && c.num_warps && c.block_v != c.num_warps * columns_per_warp)
    fail("cfg.block_v", recattn::detail::cat("8 * num_warps = ", 8 * c.num_warps, " on platform cuda"), c.block_v);
  if (c.block_k != 0 && c.block_k != h.block_k)
    fail("cfg.block_k", recattn::detail::cat("0 or ", h.block_k, " on platform cuda (a warp holds all K rows)"), c.block_k);
  if (c.chunk < 0 || c.chunk > 64 || c.chunk % 4)
    fail("cfg.chunk", "0 or a multiple of 4 in [4, 64] on platform cuda", c.chunk);
  if (c.num_warps == 0) c.num_warps = c.block_v ? c.block_v / columns_per_warp : h.num_warps;
  c.block_v = c.num_warps * columns_per_warp;
  c.block_k = h.block_k;
  const int want = c.chunk ? c.chunk : (c.num_warps >= 4 ? 64 : 16);
  if (want > 32 * c.num_warps)
    fail("cfg.chunk", recattn::detail::cat("at most 32 * num_warps = ", 32 * c.num_warps, " on platform cuda"), c.chunk);
  c.chunk = detail::fit_chunk(p, c.num_warps, want);
  if (c.chunk != want && user->chunk != 0)
    fail("cfg.chunk", recattn::detail::cat("at most ", c.chunk, " (shared memory of this problem)"), user->chunk);
  return c;
}

/// The configurations an autotuner times: warps per block x chunk length.
inline std::vector<cfg> candidate_cfgs(const problem& p) {
  std::vector<cfg> out;
  const cfg h = heuristic_cfg(p);
  out.push_back(h);
  const std::int64_t groups = (p.V + columns_per_warp - 1) / columns_per_warp;
  for (int nw : {1, 2, 4, 8}) {
    if (nw > 1 && nw > detail::ceil_pow2(groups)) continue;
    for (int chunk : {8, 16, 32, 64}) {
      if (chunk > 32 * nw) continue;
      cfg c = h;
      c.num_warps = nw;
      c.block_v = nw * columns_per_warp;
      c.chunk = detail::fit_chunk(p, nw, chunk);
      if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
    }
  }
  return out;
}

namespace detail {

inline int row_align(const void* data, int es, std::initializer_list<std::int64_t> stride_bytes) {
  for (int A = 16; A >= 4; A /= 2) {
    if (A < es) break;
    bool ok = reinterpret_cast<std::uintptr_t>(data) % std::uintptr_t(A) == 0;
    for (std::int64_t s : stride_bytes) ok = ok && s % A == 0;
    if (ok) return A;
  }
  return 0;
}

/// A tensor read row by row; `sizes` are the extents of the three indexed dims (a stride of
/// an extent-1 dim never moves the address), `col_step` the element offset between value blocks.
inline row_tensor make_rows(const strided3& s, std::int64_t e0, std::int64_t e1, std::int64_t e2, std::int64_t col_step) {
  row_tensor r;
  r.data = static_cast<const char*>(s.data);
  r.s0 = s.s0;
  r.s1 = s.s1;
  r.s2 = s.s2;
  r.type = s.type;
  r.es = int(dtype_size(s.type));
  if (!s.data) return r;
  const std::int64_t es = r.es;
  r.align = row_align(s.data, r.es,
                      {e0 > 1 ? s.s0 * es : 0, e1 > 1 ? s.s1 * es : 0, e2 > 1 ? s.s2 * es : 0, col_step * es});
  return r;
}

inline void require_device(const char* name, const void* ptr) {
  if (ptr && !is_device_pointer(ptr))
    recattn::detail::fail(name, "device (or managed) memory on platform cuda", "host memory");
}

struct launch_args {
  cfg c;
  cudaStream_t stream = nullptr;
  const void* cu_seqlens = nullptr;  ///< device copy
};

struct cuda_backend {
  template <class T, class Policy>
  static void forward(const problem& p, const launch_args& a) {
    const int nw = a.c.num_warps;
    const int bv = nw * columns_per_warp;
    const int nvb = int((p.V + bv - 1) / bv);
    const std::int64_t blocks = p.N * p.H * nvb;
    if (blocks == 0) return;
    const smem_layout L = layout_for(p, nw, a.c.chunk);

    forward_params f;
    const std::int64_t Bt = p.varlen ? 1 : p.B;
    f.q = make_rows(p.q, Bt, p.T, p.Hq, 0);
    f.k = make_rows(p.k, Bt, p.T, p.Hk, 0);
    f.v = make_rows(p.v, Bt, p.T, p.Hv, nvb > 1 ? bv : 0);
    if (p.has(gate_gk)) f.gk = make_rows(p.gk, Bt, p.T, p.H, 0);
    if (p.has(gate_gv)) f.gv = make_rows(p.gv, Bt, p.T, p.H, nvb > 1 ? bv : 0);
    f.g = p.g.data;
    f.g_type = p.g.type;
    f.g_s0 = p.g.s0;
    f.g_s1 = p.g.s1;
    f.g_s2 = p.g.s2;
    f.g_gamma = p.g_gamma.data;
    f.gamma_type = p.g_gamma.type;
    f.gamma_s0 = p.g_gamma.s0;
    f.gamma_s1 = p.g_gamma.s1;
    f.h0 = p.h0.data;
    f.h0_s0 = p.h0.s0;
    f.h0_s1 = p.h0.s1;
    f.h0_s2 = p.h0.s2;
    f.ht = p.ht_data();
    f.ht_s0 = p.ht.s0;
    f.ht_s1 = p.ht.s1;
    f.ht_s2 = p.ht.s2;
    f.out = p.out_data();
    f.out_s0 = p.out.s0;
    f.out_s1 = p.out.s1;
    f.out_s2 = p.out.s2;
    f.cu_seqlens = Policy::varlen ? a.cu_seqlens : nullptr;
    f.cu_int64 = p.cu_type == dtype::int64;
    f.reverse = Policy::reverse;
    f.kv_layout = Policy::layout == state_layout::kv;
    if (!Policy::has_g) f.g = nullptr;
    if (!Policy::has_g_gamma) f.g_gamma = nullptr;
    f.T = p.T;
    f.H = int(p.H);
    f.gq = int(p.H / p.Hq);
    f.gk_heads = int(p.H / p.Hk);
    f.gv_heads = int(p.H / p.Hv);
    f.K = int(p.K);
    f.V = int(p.V);
    f.nvb = nvb;
    f.chunk = a.c.chunk;
    f.scale = p.scale;
    f.raw_q = L.raw_q;
    f.raw_gk = L.raw_gk;
    f.raw_v = L.raw_v;
    f.raw_gv = L.raw_gv;
    f.raw_stage = L.stage;

    auto launch = [&](auto kernel) {
      if (L.bytes > 48 * 1024)
        check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(L.bytes)),
              "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
      kernel<<<unsigned(blocks), unsigned(nw * 32), L.bytes, a.stream>>>(f);
      check(cudaGetLastError(), "forward kernel launch");
    };
    constexpr bool row = kernel_traits<Policy>::row;
    constexpr bool col = kernel_traits<Policy>::col;
    if constexpr (std::is_same<T, double>::value) {
      launch(forward_kernel<T, row, col, 16>);  // double: correct at every K, speed not a goal
    } else {
      switch (rows_per_lane(p.K, p.type)) {
        case 4: launch(forward_kernel<T, row, col, 4>); break;
        case 8: launch(forward_kernel<T, row, col, 8>); break;
        default: launch(forward_kernel<T, row, col, 16>); break;
      }
    }
  }
};

}  // namespace detail

/// Runs the forward pass on the GPU: every pointer of p must be device (or managed) memory,
/// except cu_seqlens, which may be host memory (it is copied). Asynchronous on opt.stream.
inline void run_forward(const problem& p, const cfg& c, const forward_options& opt) {
  detail::check_sizes(p);
  detail::require_device("query", p.q.data);
  detail::require_device("key", p.k.data);
  detail::require_device("value", p.v.data);
  detail::require_device("output", p.out.data);
  if (p.has(gate_g)) detail::require_device("g", p.g.data);
  if (p.has(gate_g_gamma)) detail::require_device("g_gamma", p.g_gamma.data);
  if (p.has(gate_gk)) detail::require_device("gk", p.gk.data);
  if (p.has(gate_gv)) detail::require_device("gv", p.gv.data);
  detail::require_device("initial_state", p.h0.data);
  detail::require_device("final_state", p.ht.data);
  if (c.num_warps < 1 || c.num_warps > 8 || c.chunk < 4 || c.chunk % 4 || c.chunk > 32 * c.num_warps)
    recattn::detail::fail("cfg", "a configuration from cuda::resolve_cfg", c.str());

  detail::launch_args a;
  a.c = c;
  a.stream = static_cast<cudaStream_t>(opt.stream);
  void* cu_tmp = nullptr;
  if (p.varlen) {
    if (is_device_pointer(p.cu_seqlens)) {
      a.cu_seqlens = p.cu_seqlens;
    } else {
      const std::size_t bytes = std::size_t(p.N + 1) * dtype_size(p.cu_type);
      detail::check(cudaMallocAsync(&cu_tmp, bytes, a.stream), "cudaMallocAsync(cu_seqlens)");
      detail::check(cudaMemcpyAsync(cu_tmp, p.cu_seqlens, bytes, cudaMemcpyHostToDevice, a.stream),
                    "cudaMemcpyAsync(cu_seqlens)");
      a.cu_seqlens = cu_tmp;
    }
  }
  try {
    recattn::detail::dispatch_forward<detail::cuda_backend>(p, a);
  } catch (...) {
    if (cu_tmp) (void)cudaFreeAsync(cu_tmp, a.stream);
    throw;
  }
  if (cu_tmp) detail::check(cudaFreeAsync(cu_tmp, a.stream), "cudaFreeAsync(cu_seqlens)");
}

}  // namespace recattn::cuda
