// The CUDA forward kernel: one kernel for every gate policy, direction, layout, dtype and
// state layout (the policy of policy.hpp, through kernel_traits), for every K up to 256.
//
// A thread block owns one (sequence n, head h, block of value columns); its NW warps own
// 8 consecutive columns each. In a warp, lane = rg + 16 * cg holds the state rows
//   a = j * 16 * VW + rg * VW + e     (j < R / VW, e < VW, VW = min(R, 4))
// of the 4 columns cg * 4 .. cg * 4 + 3, in registers (float; double for double inputs):
// R * 4 accumulators per lane, 16 R >= K. Per token a lane updates its R x 4 slice and
// forms partial sums of q . S over its rows; a butterfly over the 16 lanes of a column
// group (a reduce-scatter over 4 tokens at once: xor 8, 4, 2, 1) leaves each total on one lane.
//
// Tokens move in chunks: the raw bytes of q, k, v, gk, gv for chunk c + 2 are copied with
// cp.async (two stages in flight) while chunk c is computed; before its turn a chunk is
// converted once per block into an Acc tile, with q pre-scaled and every gate already
// exponentiated (exp(g + g_gamma + gk) per row, exp(gv [+ g + g_gamma]) per column), so the inner loop is
// multiplies and adds only. The output tile is written back with coalesced stores.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../dtype.hpp"
#include "../policy.hpp"
#include "common.cuh"

/// Tokens of the inner loop unrolled (overlaps one token's reduction with the next's update).
#ifndef RECATTN_CUDA_TOKEN_UNROLL
#define RECATTN_CUDA_TOKEN_UNROLL 1
#endif

/// Blocks of 256 threads a multiprocessor must hold for K in (64, 128] (R = 8): 2 caps the
/// kernel at 128 registers a thread.
#ifndef RECATTN_CUDA_R8_MIN_BLOCKS
#define RECATTN_CUDA_R8_MIN_BLOCKS 1
#endif

namespace recattn::cuda {

/// A tensor read one row (token) at a time: element (i0, t, i2, col) at
/// data + (i0 * s0 + t * s1 + i2 * s2 + col) * es.
struct row_tensor {
  const char* data = nullptr;
  std::int64_t s0 = 0, s1 = 0, s2 = 0;
  int es = 0;     ///< element size in bytes
  int align = 0;  ///< cp.async unit: 16, 8 or 4 bytes; 0: plain loads (2-byte alignment only)
  dtype type = dtype::float32;
};

/// The kernel's arguments: plain values, no host-only members.
struct forward_params {
  row_tensor q, k, v, gk, gv;
  const void* g = nullptr;  ///< [B, T, H] scalar gate; null: absent
  dtype g_type = dtype::float32;
  std::int64_t g_s0 = 0, g_s1 = 0, g_s2 = 0;
  const void* g_gamma = nullptr;  ///< null: absent
  dtype gamma_type = dtype::float32;
  std::int64_t gamma_s0 = 0, gamma_s1 = 0;
  const void* h0 = nullptr;  ///< initial state, Acc; null: zeros
  std::int64_t h0_s0 = 0, h0_s1 = 0, h0_s2 = 0;
  void* ht = nullptr;  ///< final state, Acc; null: not returned
  std::int64_t ht_s0 = 0, ht_s1 = 0, ht_s2 = 0;
  void* out = nullptr;
  std::int64_t out_s0 = 0, out_s1 = 0, out_s2 = 0;
  const void* cu_seqlens = nullptr;  ///< device memory; null: dense
  bool cu_int64 = true;
  bool reverse = false;
  bool kv_layout = true;  ///< state [K, V] (else [V, K])
  std::int64_t T = 0;
  int H = 0, gq = 1, gk_heads = 1, gv_heads = 1;  ///< H / Hq, H / Hk, H / Hv
  int K = 0, V = 0;
  int nvb = 1;    ///< value blocks per head
  int chunk = 16; ///< tokens per stage
  double scale = 1.0;
  // Shared-memory layout, bytes (computed by the launcher, see smem_layout).
  int raw_q = 0, raw_gk = 0, raw_v = 0, raw_gv = 0;  ///< row pitch of each raw tensor
  int raw_stage = 0;                                 ///< bytes of one raw stage
};

namespace detail {

/// Byte offsets of the regions of one raw stage and of the converted tile.
struct smem_layout {
  int raw_q, raw_gk, raw_v, raw_gv, stage;
  std::size_t tile_elems;  ///< Acc elements of the converted tile
  std::size_t bytes;       ///< total dynamic shared memory
};

inline int round16(std::int64_t b) { return int((b + 15) / 16 * 16); }

/// Shared memory of a block: two raw stages, the gate scalars of two stages, the Acc tile.
// `chunk` is a multiple of 4 (the kernel's token groups).
inline smem_layout make_smem_layout(int K, int Kp, int bv, int chunk, int es, int gk_es, int gv_es, bool has_gk,
                                    bool has_gv, bool col_decay, bool scalar_decay, int acc_size) {
  smem_layout s;
  s.raw_q = round16(std::int64_t(K) * es);
  s.raw_gk = has_gk ? round16(std::int64_t(K) * gk_es) : 0;
  s.raw_v = round16(std::int64_t(bv) * es);
  s.raw_gv = has_gv ? round16(std::int64_t(bv) * gv_es) : 0;
  s.stage = chunk * (2 * s.raw_q + s.raw_gk + s.raw_v + s.raw_gv);
  // tile: q, k, dk [chunk][Kp]; v, dv, o [chunk][bv]; gate scalars [2][chunk]; with scalar
  // decays only, the rescale factors of two stages (see scalar_factors): q, k and state
  // factors [2][chunk], group flags [2][chunk / 4], chunk-start and chunk-end factors [2] each.
  s.tile_elems = std::size_t(chunk) * (std::size_t(Kp) * (has_gk ? 3 : 2) + std::size_t(bv) * (col_decay ? 3 : 2)) +
                 2 * std::size_t(chunk) + (scalar_decay ? 6 * std::size_t(chunk) + 2 * std::size_t(chunk / 4) + 4 : 0);
  s.bytes = 2 * std::size_t(s.stage) + s.tile_elems * std::size_t(acc_size);
  return s;
}

template <int R, int C, class Acc>
__device__ __forceinline__ void scale_state(Acc (&S)[R][C], Acc m) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int c = 0; c < C; ++c) S[i][c] *= m;
}

template <class Acc, int N>
__device__ __forceinline__ void load_vec(Acc (&dst)[N], const Acc* src) {
  const avec<Acc, N> x = *reinterpret_cast<const avec<Acc, N>*>(src);
#pragma unroll
  for (int i = 0; i < N; ++i) dst[i] = x.v[i];
}

/// Copies `count` elements of the rows of chunk tokens [i0, i0 + cl) of x into the raw stage
/// (row pitch `pitch`). Aligned tensors go by cp.async; others by plain loads.
__device__ __forceinline__ void stage_rows(unsigned char* dst, int pitch, const row_tensor& x, std::int64_t base,
                                           int count, bool reverse, std::int64_t begin, std::int64_t len,
                                           std::int64_t i0, int cl, int warp, int nw, int lane) {
  const int bytes = count * x.es;
  if (x.align) {
    // Whole units of A bytes, then the tail in 4-byte copies and a last 2-byte element: no
    // copy reads past the row (a partial cp.async still reads its whole unit).
    const int A = x.align;
    const int units = bytes / A;
    const int tail4 = (bytes - units * A) / 4;
    const int pieces = units + tail4 + ((bytes & 3) ? 1 : 0);
    for (int l = warp; l < cl; l += nw) {
      const std::int64_t t = begin + (reverse ? len - 1 - (i0 + l) : i0 + l);
      const char* src = x.data + (base + t * x.s1) * x.es;
      unsigned char* d = dst + l * pitch;
      for (int u = lane; u < pieces; u += 32) {
        if (u < units) {
          if (A == 16) cp_async<16>(d + u * 16, src + u * 16, 16);
          else if (A == 8) cp_async<8>(d + u * 8, src + u * 8, 8);
          else cp_async<4>(d + u * 4, src + u * 4, 4);
        } else if (u < units + tail4) {
          const int o = units * A + (u - units) * 4;
          cp_async<4>(d + o, src + o, 4);
        } else {
          const int o = bytes - 2;
          *reinterpret_cast<std::uint16_t*>(d + o) = *reinterpret_cast<const std::uint16_t*>(src + o);
        }
      }
    }
  } else {
    // 2-byte aligned rows (odd sizes of 16-bit types, odd strides): plain loads.
    for (int l = warp; l < cl; l += nw) {
      const std::int64_t t = begin + (reverse ? len - 1 - (i0 + l) : i0 + l);
      const char* src = x.data + (base + t * x.s1) * x.es;
      unsigned char* d = dst + l * pitch;
      for (int e = lane; e < count; e += 32) {
        if (x.es == 2) reinterpret_cast<std::uint16_t*>(d)[e] = reinterpret_cast<const std::uint16_t*>(src)[e];
        else if (x.es == 4) reinterpret_cast<std::uint32_t*>(d)[e] = reinterpret_cast<const std::uint32_t*>(src)[e];
        else reinterpret_cast<std::uint64_t*>(d)[e] = reinterpret_cast<const std::uint64_t*>(src)[e];
      }
    }
  }
}

/// Converts raw row elements (dtype of x: T, or float for float gates) to Acc.
template <class T, class Acc>
__device__ __forceinline__ Acc raw_at(const unsigned char* row, int i, dtype t) {
  if constexpr (std::is_same<T, float>::value || std::is_same<T, double>::value) {
    if (t == dtype::float32) return Acc(reinterpret_cast<const float*>(row)[i]);
    return Acc(reinterpret_cast<const T*>(row)[i]);
  } else {
    if (t == dtype::float32) return Acc(reinterpret_cast<const float*>(row)[i]);
    return to_acc<Acc>(reinterpret_cast<const T*>(row)[i]);
  }
}

/// Elements a .. a + 3 of a raw row of U (a a multiple of 4; the row 16-byte aligned), as Acc;
/// those at or past `count` read as 0 (and are not read).
template <class U, class Acc>
__device__ __forceinline__ void load4_raw(Acc (&x)[4], const unsigned char* row, int a, int count) {
  const U* r = reinterpret_cast<const U*>(row) + a;
  if (a + 4 <= count) {
    const avec<U, 4> v = *reinterpret_cast<const avec<U, 4>*>(r);
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = to_acc<Acc>(v.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = a + e < count ? to_acc<Acc>(r[e]) : Acc(0);
  }
}

/// q, k, v rows: always of the input dtype T.
template <class T, class Acc>
__device__ __forceinline__ void load4(Acc (&x)[4], const unsigned char* row, int a, int count) {
  load4_raw<T, Acc>(x, row, a, count);
}

/// Gate rows: float or the input dtype.
template <class T, class Acc>
__device__ __forceinline__ void load4_gate(Acc (&x)[4], const unsigned char* row, int a, int count, dtype t) {
  if (t == dtype::float32) load4_raw<float, Acc>(x, row, a, count);
  else load4_raw<T, Acc>(x, row, a, count);
}

/// dst[0..3] = mul * x, as one vector store (dst 4-element aligned).
template <class Acc>
__device__ __forceinline__ void store4(Acc* dst, const Acc (&x)[4], Acc mul) {
  avec<Acc, 4> v;
#pragma unroll
  for (int e = 0; e < 4; ++e) v.v[e] = mul * x[e];
  *reinterpret_cast<avec<Acc, 4>*>(dst) = v;
}

}  // namespace detail

/// The part of a forward_policy the inner loop is compiled for: is there a decay per key
/// row (gk, with g and g_gamma folded in as exp(gk + g + g_gamma)), one per value column
/// (gv, with g and g_gamma folded in when there is no gk), or scalar decays alone (g,
/// g_gamma: the no-decay loop with the rescaling of scalar_factors). The rest (direction,
/// varlen, state layout, which scalar gates are present) is read per chunk or per block,
/// never per state element, so it is passed as uniform run-time values: the 256
/// specializations per dtype that dispatch_forward reaches share 5 kernels per K class,
/// which keeps the build of a CUDA translation unit in minutes rather than hours.
template <class Policy>
struct kernel_traits {
  static constexpr bool row = Policy::has_gk;
  static constexpr bool col = Policy::has_gv;
  static constexpr bool scalar = !row && !col && (Policy::has_g || Policy::has_g_gamma);
};

namespace detail {

/// Half-width of the log-decay range a rescaled segment spans: factors stay in
/// [e^-30, e^30], far from float overflow and underflow.
inline constexpr double rescale_bucket = 30.0;

/// Scalar decays without gk or gv: the state update s = d s + k v^T costs a multiply per
/// element on top of the two FMAs of the no-decay loop. Instead, inside a segment of tokens
/// whose cumulative log decays P (from the chunk's first token) stay within one bucket of
/// width 2 * rescale_bucket, the kernel keeps s' with s_l = exp(P_l - P_r) s'_l, r the
/// segment's first token, so that
///   s'_l = s'_{l-1} + (exp(P_r - P_l) k_l) v_l^T,   o_l = (exp(P_l - P_r) q_l) . s'_l,
/// and multiplies the state only where a segment starts (by exp(P_l - P_r_prev), the true
/// decay since the previous reference; it may underflow to 0 like the plain recurrence) and
/// at chunk boundaries (the end factor of the chunk times the first token's own decay).
/// The factors are exponentials of differences of log decays summed in double, so they are
/// as exact as the product of the per-token decays of the plain recurrence (no division by
/// a decay, nothing undone). NaN in the gates flows into the factors and from there into
/// the state, as in the plain recurrence.
///
/// Run by one warp for chunk c (cl tokens, cl <= 64, two tokens per lane). g: the chunk's
/// scalar gates (null: g_gamma only). Writes, for stage s: fq, fk, fm [chunk] (q, k factors
/// and the state multiplier before each token, 1 where none), fgrp [chunk / 4] (1 where a
/// group of 4 tokens has a multiplier), fpre (state multiplier at the chunk start) and fend
/// (exp(P_last - P_ref), carried to the next chunk in `pending`).
template <class Acc>
__device__ __forceinline__ void scalar_factors(const Acc* g, Acc gamma, int cl, Acc* fq, Acc* fk, Acc* fm, Acc* fgrp,
                                               Acc* fpre, Acc* fend, double& pending, int lane, int chunk) {
  const double B = rescale_bucket;
  auto glog = [&](int l) -> double {
    double x = double(gamma) + (g ? double(g[l]) : 0.0);
    // Clamp (NaN passes): exp of either bound is 0 or inf in float, as exp of the gate is.
    return x < -1e4 ? -1e4 : (x > 1e4 ? 1e4 : x);
  };
  const int l0 = 2 * lane, l1 = 2 * lane + 1;
  // Log decay of each token after the first (the first one's goes into fpre).
  const double x0 = (l0 >= 1 && l0 < cl) ? glog(l0) : 0.0;
  const double x1 = (l1 < cl) ? glog(l1) : 0.0;
  double incl = x0 + x1;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const double y = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += y;
  }
  double excl = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == 0) excl = 0.0;
  const double P0 = excl + x0, P1 = P0 + x1;
  const double b0 = floor(P0 / (2 * B) + 0.5), b1 = floor(P1 / (2 * B) + 0.5);
  double bprev = __shfl_up_sync(0xffffffffu, b1, 1);
  // Token l starts a segment where its bucket differs from token l - 1's (NaN: always).
  const bool s0 = l0 >= 1 && l0 < cl && !(b0 == bprev);
  const bool s1 = l1 < cl && !(b1 == b0);
  const unsigned me = __ballot_sync(0xffffffffu, s0), mo = __ballot_sync(0xffffffffu, s1);
  // The reference (segment start) of token 2 i + e: the last start at or before it (token 0
  // when none).
  auto last_at_or_below = [](unsigned m, int i) -> int {  // highest set bit <= i, or -1
    if (i < 0) return -1;
    const unsigned mm = m & (i >= 31 ? 0xffffffffu : ((2u << i) - 1u));
    return mm ? 31 - __clz(mm) : -1;
  };
  auto ref_of = [&](int e) -> int {
    const int je = last_at_or_below(me, lane), jo = last_at_or_below(mo, e ? lane : lane - 1);
    const int r = max(je >= 0 ? 2 * je : 0, jo >= 0 ? 2 * jo + 1 : 0);
    return r;
  };
  const int r0 = ref_of(0), r1 = ref_of(1);
  auto P_of = [&](int r) -> double {  // P of token r (all lanes take part)
    const double a = __shfl_sync(0xffffffffu, P0, r >> 1), b = __shfl_sync(0xffffffffu, P1, r >> 1);
    return (r & 1) ? b : a;
  };
  const double Pr0 = P_of(r0), Pr1 = P_of(r1);
  const double Pr_prev0 = __shfl_up_sync(0xffffffffu, Pr1, 1);  // reference of token l0 - 1
  if (l0 < chunk) {
    const double d0 = P0 - Pr0;
    fq[l0] = Acc(exp(d0));
    fk[l0] = Acc(exp(-d0));
    fm[l0] = s0 ? Acc(exp(P0 - Pr_prev0)) : Acc(1);
  }
  if (l1 < chunk) {
    const double d1 = P1 - Pr1;
    fq[l1] = Acc(exp(d1));
    fk[l1] = Acc(exp(-d1));
    fm[l1] = s1 ? Acc(exp(P1 - Pr0)) : Acc(1);
  }
  // Group of 4 tokens = lanes 2 j, 2 j + 1.
  // (The shuffle is outside any short-circuit: every lane of the mask must reach it.)
  const bool any = s0 || s1;
  const bool other = __shfl_xor_sync(0xffffffffu, any, 1);
  const bool grp = any || other;
  if ((lane & 1) == 0 && 4 * (lane >> 1) < chunk) fgrp[lane >> 1] = grp ? Acc(1) : Acc(0);
  // Chunk end: the state is s_last = exp(P_last - P_ref_last) s'; carried into the next
  // chunk's start factor together with that chunk's first decay.
  const int last = cl - 1;
  const double Pl = P_of(last);
  const int last_r0 = __shfl_sync(0xffffffffu, r0, last >> 1), last_r1 = __shfl_sync(0xffffffffu, r1, last >> 1);
  const double Prl = P_of(last == 0 ? 0 : ((last & 1) ? last_r1 : last_r0));
  if (lane == 0) {
    *fpre = Acc(pending * exp(glog(0)));
    *fend = Acc(exp(Pl - Prl));
  }
  pending = exp(Pl - Prl);
}

}  // namespace detail

/// The forward kernel. Grid: one block per (n, h, value block); block: NW warps of 8 columns.
// Up to 8 warps a block; with R = 4 (K <= 64) two blocks a multiprocessor (128 registers).
// Scalar: only g and g_gamma decay the state (kernel_traits::scalar).
template <class T, bool RowDecay, bool ColDecay, bool Scalar, int R>
__global__ void __launch_bounds__(256, (R <= 4 ? 2 : R <= 8 ? RECATTN_CUDA_R8_MIN_BLOCKS : 1))
    forward_kernel(const forward_params p) {
  using Acc = accum_t<T>;
  using namespace detail;
  constexpr int RG = 16, C = 4;
  constexpr int Kp = RG * R;
  constexpr int VW = R >= 4 ? 4 : R;
  constexpr int NJ = R / VW;
  constexpr bool gk_vec = RowDecay;   // dk tile: exp(gk + g + g_gamma) per key row
  constexpr int G = 4;  // tokens reduced together (G x C = 16 values over 16 lanes)
  constexpr int token_unroll = RECATTN_CUDA_TOKEN_UNROLL;  // (#pragma unroll takes no macro)
  constexpr bool dv_gate = ColDecay;  // dv tile: exp(gv [+ g + g_gamma without gk]) per column
  const bool reverse = p.reverse;
  const bool kv_layout = p.kv_layout;
  const bool has_g = p.g != nullptr;
  const bool has_gv = p.gv.data != nullptr;
  // Scalar decays only: the no-decay loop with rescaled q and k (detail::scalar_factors).
  static_assert(!Scalar || (!RowDecay && !ColDecay), "Scalar: g and g_gamma only");
  constexpr bool rescale = Scalar;

  extern __shared__ __align__(16) unsigned char smem[];
  const int nw = int(blockDim.x) >> 5;
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int tid = int(threadIdx.x), nthreads = int(blockDim.x);
  const int bv = nw * 8;
  const int chunk = p.chunk;

  const int vb = int(blockIdx.x % unsigned(p.nvb));
  const int h = int((blockIdx.x / unsigned(p.nvb)) % unsigned(p.H));
  const std::int64_t n = std::int64_t(blockIdx.x / unsigned(p.nvb) / unsigned(p.H));
  const int b0 = vb * bv;
  const int w = min(bv, p.V - b0);  // real columns of this block

  std::int64_t begin = 0, len = p.T, bidx = n;
  if (p.cu_seqlens) {
    bidx = 0;
    if (p.cu_int64) {
      begin = static_cast<const std::int64_t*>(p.cu_seqlens)[n];
      len = static_cast<const std::int64_t*>(p.cu_seqlens)[n + 1] - begin;
    } else {
      begin = static_cast<const std::int32_t*>(p.cu_seqlens)[n];
      len = static_cast<const std::int32_t*>(p.cu_seqlens)[n + 1] - begin;
    }
  }

  // Shared memory: raw[2] | tile (q, k, dk | v, dv, o | ds | gs[2]).
  Acc* tile = reinterpret_cast<Acc*>(smem + 2 * std::size_t(p.raw_stage));
  Acc* qf = tile;
  Acc* kf = qf + chunk * Kp;
  Acc* dkf = kf + chunk * Kp;
  Acc* vf = dkf + (gk_vec ? chunk * Kp : 0);
  Acc* dvf = vf + chunk * bv;
  Acc* of = dvf + (dv_gate ? chunk * bv : 0);
  Acc* gs = of + chunk * bv;  // [2][chunk]: the scalar gate g of each stage
  // Rescale factors of each stage (scalar decays only; see scalar_factors).
  Acc* fq = gs + 2 * chunk;
  Acc* fk = fq + 2 * chunk;
  Acc* fm = fk + 2 * chunk;
  Acc* fgrp = fm + 2 * chunk;
  Acc* fpre = fgrp + 2 * (chunk / 4);
  Acc* fend = fpre + 2;

  auto raw_q = [&](int s) { return smem + s * p.raw_stage; };
  auto raw_k = [&](int s) { return raw_q(s) + chunk * p.raw_q; };
  auto raw_gk = [&](int s) { return raw_q(s) + 2 * chunk * p.raw_q; };
  auto raw_v = [&](int s) { return raw_q(s) + chunk * (2 * p.raw_q + p.raw_gk); };
  auto raw_gv = [&](int s) { return raw_q(s) + chunk * (2 * p.raw_q + p.raw_gk + p.raw_v); };

  const std::int64_t q_base = bidx * p.q.s0 + std::int64_t(h / p.gq) * p.q.s2;
  const std::int64_t k_base = bidx * p.k.s0 + std::int64_t(h / p.gk_heads) * p.k.s2;
  const std::int64_t v_base = bidx * p.v.s0 + std::int64_t(h / p.gv_heads) * p.v.s2 + b0;
  const std::int64_t gk_base = bidx * p.gk.s0 + std::int64_t(h) * p.gk.s2;
  const std::int64_t gv_base = bidx * p.gv.s0 + std::int64_t(h) * p.gv.s2 + b0;

  Acc gamma = Acc(0);
  if (p.g_gamma) gamma = load_any<Acc>(p.g_gamma, p.gamma_type, n * p.gamma_s0 + h * p.gamma_s1);

  const int nchunks = int((len + chunk - 1) / chunk);
  auto chunk_len = [&](int c) {
    const std::int64_t r = len - std::int64_t(c) * chunk;
    return r < chunk ? int(r) : chunk;
  };
  auto load_g = [&](int c) -> Acc {  // this thread's token of chunk c
    const std::int64_t i = std::int64_t(c) * chunk + tid;
    const std::int64_t t = begin + (reverse ? len - 1 - i : i);
    return load_any<Acc>(p.g, p.g_type, bidx * p.g_s0 + t * p.g_s1 + std::int64_t(h) * p.g_s2);
  };
  auto issue = [&](int c) {  // copies of chunk c into stage c & 1
    const int s = c & 1;
    const std::int64_t i0 = std::int64_t(c) * chunk;
    const int cl = chunk_len(c);
    stage_rows(raw_q(s), p.raw_q, p.q, q_base, p.K, reverse, begin, len, i0, cl, warp, nw, lane);
    stage_rows(raw_k(s), p.raw_q, p.k, k_base, p.K, reverse, begin, len, i0, cl, warp, nw, lane);
    if constexpr (gk_vec) stage_rows(raw_gk(s), p.raw_gk, p.gk, gk_base, p.K, reverse, begin, len, i0, cl, warp, nw, lane);
    stage_rows(raw_v(s), p.raw_v, p.v, v_base, w, reverse, begin, len, i0, cl, warp, nw, lane);
    if (dv_gate && has_gv) stage_rows(raw_gv(s), p.raw_gv, p.gv, gv_base, w, reverse, begin, len, i0, cl, warp, nw, lane);
  };

  // The lane's slice of the state.
  const int rg = lane & 15, cg = lane >> 4;
  const int col0 = warp * 8 + cg * C;  // first column of the lane, inside the block
  Acc S[R][C];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < VW; ++e)
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int a = j * RG * VW + rg * VW + e, b = b0 + col0 + c;
        Acc x = Acc(0);
        if (p.h0 && a < p.K && b < p.V) {
          const std::int64_t off = kv_layout ? n * p.h0_s0 + h * p.h0_s1 + a * p.h0_s2 + b
                                             : n * p.h0_s0 + h * p.h0_s1 + b * p.h0_s2 + a;
          x = static_cast<const Acc*>(p.h0)[off];
        }
        S[j * VW + e][c] = x;
      }

  // Prologue: two chunks in flight; the scalar gates of chunks 0 and 1 go straight to smem.
  if (nchunks > 0) issue(0);
  cp_async_commit();
  if (nchunks > 1) issue(1);
  cp_async_commit();
  Acc g_next = Acc(0);  // scalar gate of chunk c + 2, held in a register until stage c & 1 is free
  if (has_g) {
    for (int c = 0; c < 2 && c < nchunks; ++c)
      if (tid < chunk_len(c)) gs[c * chunk + tid] = load_g(c);
  }
  double pending = 1.0;  // warp 0, rescale: exp(P_last - P_ref) of the last chunk with factors
  auto factors = [&](int c) {  // warp 0: rescale factors of chunk c into stage c & 1
    const int s = c & 1;
    detail::scalar_factors<Acc>(has_g ? gs + s * chunk : nullptr, gamma, chunk_len(c), fq + s * chunk,
                                fk + s * chunk, fm + s * chunk, fgrp + s * (chunk / 4), fpre + s, fend + s,
                                pending, lane, chunk);
  };
  // g_gamma without g: the decay of every token is the same, so the factors of chunk c
  // depend on c only through `pending` (1 before chunk 0, then the same for every full
  // chunk) and on the chunk's length. Stage 0 holds chunk 0's, stage 1 chunk 1's; chunk 2
  // rewrites stage 0 with the steady ones, which every later full chunk reuses; a partial
  // last chunk gets its own.
  const bool gamma_only = rescale && !has_g;
  auto needs_factors = [&](int c) {
    return !gamma_only || c <= 2 || (c == nchunks - 1 && chunk_len(c) != chunk);
  };
  if (rescale && nchunks > 0) {
    __syncthreads();  // the gates of chunk 0
    if (warp == 0) factors(0);
  }

  const Acc scale = Acc(p.scale);
  const bool hi8 = (lane & 8) != 0, hi4 = (lane & 4) != 0, hi2 = (lane & 2) != 0, hi1 = (lane & 1) != 0;

  for (int c = 0; c < nchunks; ++c) {
    const int s = c & 1;
    const int cl = chunk_len(c);
    // The scalar gates of chunk c + 1 (loaded during chunk c - 1) into their stage.
    if (has_g)
      if (c >= 1 && c + 1 < nchunks && tid < chunk_len(c + 1)) gs[((c + 1) & 1) * chunk + tid] = g_next;
    cp_async_wait<1>();
    __syncthreads();  // (A) stage s has landed; the tile of chunk c - 1 has been consumed
    // The factors of chunk c + 1 (its gates are in; stage (c + 1) & 1's factors were last
    // read by chunk c - 1, which every warp has finished).
    if (rescale && warp == 0 && c + 1 < nchunks && needs_factors(c + 1)) factors(c + 1);

    // Write back the outputs of chunk c - 1.
    if (c > 0) {
      const int pl = chunk_len(c - 1);
      const std::int64_t pi0 = std::int64_t(c - 1) * chunk;
      for (int l = warp; l < pl; l += nw) {
        const std::int64_t t = begin + (reverse ? len - 1 - (pi0 + l) : pi0 + l);
        T* dst = static_cast<T*>(p.out) + bidx * p.out_s0 + t * p.out_s1 + std::int64_t(h) * p.out_s2 + b0;
        for (int j = lane; j < w; j += 32) dst[j] = from_acc<T>(of[l * bv + j]);
      }
    }
    // Convert stage s into the tile, 4 elements a lane (one 8- or 16-byte shared load).
    // Tokens [cl, round_up(cl, G)) are padding with k = v = 0 and unit decays: they leave
    // the state exactly as it is, so the inner loop runs whole groups without branches.
    {
      const int clp = (cl + G - 1) / G * G;
      const unsigned char* rq = raw_q(s);
      const unsigned char* rk = raw_k(s);
      // Key side: Kp / 4 lanes a token row (rows side by side in a warp when Kp < 128).
      constexpr int KL = Kp / 4 < 32 ? Kp / 4 : 32;
      constexpr int KT = 32 / KL;
      for (int l = warp * KT + lane / KL; l < clp; l += nw * KT) {
        const bool tok = l < cl;
        const int count = tok ? p.K : 0;
        Acc gsum = gamma;
        if (has_g && tok) gsum += gs[s * chunk + l];
        const Acc qs = rescale && tok ? scale * fq[s * chunk + l] : scale;
        const Acc ks = rescale && tok ? fk[s * chunk + l] : Acc(1);
        for (int a = 4 * (lane % KL); a < Kp; a += 4 * KL) {
          Acc x[4];
          load4<T, Acc>(x, rq + l * p.raw_q, a, count);
          store4<Acc>(qf + l * Kp + a, x, qs);
          load4<T, Acc>(x, rk + l * p.raw_q, a, count);
          store4<Acc>(kf + l * Kp + a, x, ks);
          if constexpr (gk_vec) {
            load4_gate<T, Acc>(x, raw_gk(s) + l * p.raw_gk, a, count, p.gk.type);
#pragma unroll
            for (int e = 0; e < 4; ++e) x[e] = a + e < count ? exp_acc(gsum + x[e]) : Acc(1);
            store4<Acc>(dkf + l * Kp + a, x, Acc(1));
          }
        }
      }
      // Value side: bv / 4 lanes a token row.
      const int VL = bv / 4 < 32 ? bv / 4 : 32;
      const int VT = 32 / VL;
      for (int l = warp * VT + lane / VL; l < clp; l += nw * VT) {
        const bool tok = l < cl;
        const int count = tok ? w : 0;
        Acc col_add = Acc(0);  // scalar gates go to the columns without gk
        if (!gk_vec) {
          col_add = gamma;
          if (has_g && tok) col_add += gs[s * chunk + l];
        }
        for (int j = 4 * (lane % VL); j < bv; j += 4 * VL) {
          Acc x[4];
          load4<T, Acc>(x, raw_v(s) + l * p.raw_v, j, count);
          store4<Acc>(vf + l * bv + j, x, Acc(1));
          if constexpr (dv_gate) {
            if (has_gv) load4_gate<T, Acc>(x, raw_gv(s) + l * p.raw_gv, j, count, p.gv.type);
            else x[0] = x[1] = x[2] = x[3] = Acc(0);
#pragma unroll
            for (int e = 0; e < 4; ++e) x[e] = j + e < count ? exp_acc(col_add + x[e]) : Acc(1);
            store4<Acc>(dvf + l * bv + j, x, Acc(1));
          }
        }
      }
    }
    __syncthreads();  // (B) tile ready; stage s is free
    if (c + 2 < nchunks) issue(c + 2);
    cp_async_commit();
    if (has_g)
      if (c + 2 < nchunks && tid < chunk_len(c + 2)) g_next = load_g(c + 2);

    // The recurrence over the chunk, G tokens at a time: the partial sums of the G tokens
    // (G x 4 per lane) are reduced together, a reduce-scatter over the 16 lanes of the
    // column group (xor 8, 4, 2, 1: 15 shuffles) that leaves lane rg with token rg / 4,
    // column rg % 4. The state update of the next token does not wait on the shuffles.
    const int clp = (cl + G - 1) / G * G;
    if (rescale) {
      const Acc m = fpre[s];
      if (m != Acc(1)) scale_state<R, C>(S, m);
    }
    // One group of G tokens into part (G x C partial sums a lane); WithMul: a segment starts
    // at one of them (rescale only), so each token first multiplies the state by its factor.
    auto group = [&](int l0, Acc (&part)[G * C], auto with_mul) {
      constexpr bool WithMul = decltype(with_mul)::value;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int l = l0 + g;
        if constexpr (WithMul) {
          const Acc m = fm[s * chunk + l];
          if (m != Acc(1)) scale_state<R, C>(S, m);
        }
        Acc qv[R], kv[R];
        [[maybe_unused]] Acc dk[R];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int a0 = j * RG * VW + rg * VW;
          Acc t4[VW];
          load_vec<Acc, VW>(t4, qf + l * Kp + a0);
#pragma unroll
          for (int e = 0; e < VW; ++e) qv[j * VW + e] = t4[e];
          load_vec<Acc, VW>(t4, kf + l * Kp + a0);
#pragma unroll
          for (int e = 0; e < VW; ++e) kv[j * VW + e] = t4[e];
          if constexpr (gk_vec) {
            load_vec<Acc, VW>(t4, dkf + l * Kp + a0);
#pragma unroll
            for (int e = 0; e < VW; ++e) dk[j * VW + e] = t4[e];
          }
        }
        Acc vv[C];
        [[maybe_unused]] Acc dv[C];
        load_vec<Acc, C>(vv, vf + l * bv + col0);
        if constexpr (dv_gate) load_vec<Acc, C>(dv, dvf + l * bv + col0);
#pragma unroll
        for (int c2 = 0; c2 < C; ++c2) part[g * C + c2] = Acc(0);
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
          for (int c2 = 0; c2 < C; ++c2) {
            Acc x = S[i][c2];
            if constexpr (gk_vec && dv_gate) x = fma(x, dk[i] * dv[c2], kv[i] * vv[c2]);
            else if constexpr (gk_vec) x = fma(x, dk[i], kv[i] * vv[c2]);
            else if constexpr (dv_gate) x = fma(x, dv[c2], kv[i] * vv[c2]);
            else x = fma(kv[i], vv[c2], x);
            S[i][c2] = x;
            part[g * C + c2] = fma(qv[i], x, part[g * C + c2]);
          }
      }
    };
    // Reduce-scatter of a group's partial sums (each step keeps the half of the values its
    // lane bit selects) and the store of the lane's total; l0 < 0: nothing to store.
    auto reduce_store = [&](const Acc (&part)[G * C], int l0) {
      Acc r8[8], r4[4], r2[2];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const Acc send = hi8 ? part[i] : part[i + 8];
        r8[i] = (hi8 ? part[i + 8] : part[i]) + __shfl_xor_sync(0xffffffffu, send, 8);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const Acc send = hi4 ? r8[i] : r8[i + 4];
        r4[i] = (hi4 ? r8[i + 4] : r8[i]) + __shfl_xor_sync(0xffffffffu, send, 4);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const Acc send = hi2 ? r4[i] : r4[i + 2];
        r2[i] = (hi2 ? r4[i + 2] : r4[i]) + __shfl_xor_sync(0xffffffffu, send, 2);
      }
      const Acc x = (hi1 ? r2[1] : r2[0]) + __shfl_xor_sync(0xffffffffu, hi1 ? r2[0] : r2[1], 1);
      if (l0 >= 0) of[(l0 + (rg >> 2)) * bv + col0 + (rg & 3)] = x;
    };
    // The shuffles of a group's reduction wait on each other; they run beside the next
    // group's update (the same straight-line code, so the compiler may interleave them)
    // instead of after their own group. Measured on an H200 (2026-12-04): no change in the
    // no-gate time (1.259 against 1.265 ms), kept since it costs nothing either.
    Acc prev[G * C];
#pragma unroll
    for (int i = 0; i < G * C; ++i) prev[i] = Acc(0);
    int prev_l0 = -1;
#pragma unroll token_unroll
    for (int l0 = 0; l0 < clp; l0 += G) {
      Acc part[G * C];
      if (rescale && fgrp[s * (chunk / 4) + l0 / G] != Acc(0)) {  // rare: uniform branch
        group(l0, part, std::true_type{});
        reduce_store(prev, prev_l0);
      } else {
        group(l0, part, std::false_type{});
        reduce_store(prev, prev_l0);
      }
#pragma unroll
      for (int i = 0; i < G * C; ++i) prev[i] = part[i];
      prev_l0 = l0;
    }
    reduce_store(prev, prev_l0);
  }
  cp_async_wait<0>();
  __syncthreads();
  if (nchunks > 0) {
    const int c = nchunks - 1;
    const int pl = chunk_len(c);
    const std::int64_t pi0 = std::int64_t(c) * chunk;
    for (int l = warp; l < pl; l += nw) {
      const std::int64_t t = begin + (reverse ? len - 1 - (pi0 + l) : pi0 + l);
      T* dst = static_cast<T*>(p.out) + bidx * p.out_s0 + t * p.out_s1 + std::int64_t(h) * p.out_s2 + b0;
      for (int j = lane; j < w; j += 32) dst[j] = from_acc<T>(of[l * bv + j]);
    }
  }
  if (rescale && nchunks > 0) scale_state<R, C>(S, fend[(nchunks - 1) & 1]);
  if (p.ht) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < VW; ++e)
#pragma unroll
        for (int c2 = 0; c2 < C; ++c2) {
          const int a = j * RG * VW + rg * VW + e, b = b0 + col0 + c2;
          if (a < p.K && b < p.V) {
            const std::int64_t off = kv_layout ? n * p.ht_s0 + h * p.ht_s1 + a * p.ht_s2 + b
                                               : n * p.ht_s0 + h * p.ht_s1 + b * p.ht_s2 + a;
            static_cast<Acc*>(p.ht)[off] = S[j * VW + e][c2];
          }
        }
  }
  (void)nthreads;
}

}  // namespace recattn::cuda
