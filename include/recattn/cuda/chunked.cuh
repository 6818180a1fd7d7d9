// The chunked CUDA forward (issue 8, phase 1): tensor-core products over chunks of C tokens,
// for bfloat16 and half inputs and the scalar gates g and g_gamma.
//
// A thread block (4 warps) owns one (sequence n, head h, block of BV value columns) and walks
// the sequence's chunks in processing order, keeping the state block S [Kp x BV] in float in
// shared memory (Kp = K rounded up to 16; padded rows and columns stay zero and are never
// written out). With G_i the cumulative log decay from the chunk's first token to token i
// (inclusive) and G_C its value at the chunk's last token, SPEC §1's recurrence
// (S_t = d_t S_{t-1} + k_t^T v_t, o_t = scale q_t S_t) unrolled over a chunk is
//   o_i = scale * ( e^{G_i} q_i S  +  sum_{j<=i} e^{G_i - G_j} (q_i . k_j) v_j )
//   S  <- e^{G_C} S + sum_j e^{G_C - G_j} k_j^T v_j
// Per chunk (nvcuda::wmma, 16x16x16, 16-bit operands, float accumulators):
//   (a) q, k [C x Kp] and v [C x BV] staged into shared memory (zero padded), the log decays
//       of the chunk's tokens (g + g_gamma, in double);
//   (b) one lane scans the log decays (double); meanwhile A = Q K^T (lower triangle of
//       16 x 16 tiles) and O = Q S~ (S~: S rounded to the input dtype) on tensor cores;
//   (c) A masked by e^{G_i - G_j} (j <= i) and rounded to the input dtype; k rows scaled by
//       e^{G_C - G_j}; O rows by e^{G_i}; S by e^{G_C} (all in float);
//   (d) O += A V and S += K~^T V on tensor cores;
//   (e) o = scale * O written out; S~ refreshed from S.
// A decay of exactly 0 (log decay -inf, or below -1e4, where exp is 0 in float and double)
// never forms e^{-inf - (-inf)}: the scan counts such tokens (a segment index), and a factor
// across one of them is exactly 0; other factors are exp of differences of cumulative sums
// in double. Positive log decays grow the factors like the reference's.
//
// Accuracy: the products read 16-bit operands (q, k, v as given; A, the scaled k rows and the
// state S~ rounded to the input dtype each chunk); S itself accumulates in float. Measured
// against the double reference this stays inside SPEC §6's 1e-2 for bfloat16 and half. Float
// inputs are not taken (neither tf32 nor bfloat16 products can meet §6's 1e-4 for float);
// double neither: the dispatcher takes the recurrent kernel for them, and a cfg that forces
// chunked is a recattn::Error, as for gk and gv (phase 2).
//
// Phase 1 is correctness first: plain (not asynchronous) staging loads (8 bytes a lane where
// the rows are 8-byte aligned), one stage.
#pragma once

#include <mma.h>

#include <cstdint>
#include <type_traits>

#include "../dtype.hpp"
#include "common.cuh"
#include "recurrence.cuh"

namespace recattn::cuda {

namespace detail {

template <class T>
struct mma_elem;
template <>
struct mma_elem<bfloat16> {
  using type = __nv_bfloat16;
};
template <>
struct mma_elem<half> {
  using type = __half;
};

template <class E>
__device__ __forceinline__ E to_elem(float x) {
  if constexpr (std::is_same<E, __nv_bfloat16>::value) return __float2bfloat16_rn(x);
  else return __float2half_rn(x);
}
template <class E>
__device__ __forceinline__ float from_elem(E x) {
  if constexpr (std::is_same<E, __nv_bfloat16>::value) return __bfloat162float(x);
  else return __half2float(x);
}

/// Shared memory of a chunked block: leading dimensions (elements) and byte offsets.
struct chunked_layout {
  int C = 64, Kp = 16, BV = 16;
  int ldk = 0;   ///< q, k tiles [C][ldk], 16-bit
  int ldv = 0;   ///< v tile [C][ldv] and S~ [Kp][ldv], 16-bit
  int lds = 0;   ///< S [Kp][lds] and O [C][lds], float
  int lda = 0;   ///< A [C][lda], float
  int ldat = 0;  ///< A~ [C][ldat], 16-bit
  unsigned off_q = 0, off_k = 0, off_v = 0, off_st = 0, off_s = 0, off_af = 0, off_at = 0, off_o = 0;
  unsigned off_glog = 0, off_gf = 0, off_seg = 0, off_gi = 0, off_gc = 0, off_misc = 0;
  std::size_t bytes = 0;
};

inline std::size_t align128(std::size_t x) { return (x + 127) / 128 * 128; }

/// Layout for key size K (any, <= 256), BV value columns (16, 32 or 64) and C tokens (16, 32 or 64).
inline chunked_layout make_chunked_layout(std::int64_t K, int BV, int C) {
  chunked_layout L;
  L.C = C;
  L.Kp = int((K + 15) / 16 * 16);
  L.BV = BV;
  // Pads of 16 bytes a row (wmma needs 16-bit rows a multiple of 8 elements, float rows of 4,
  // and tiles 32-byte aligned: 16 rows of any of these pitches keep that).
  L.ldk = L.Kp + 8;
  L.ldv = BV + 8;
  L.lds = BV + 4;
  L.lda = C + 4;
  L.ldat = C + 8;
  std::size_t o = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t at = o;
    o = align128(o + bytes);
    return unsigned(at);
  };
  L.off_q = take(std::size_t(C) * L.ldk * 2);
  L.off_k = take(std::size_t(C) * L.ldk * 2);
  L.off_v = take(std::size_t(C) * L.ldv * 2);
  L.off_st = take(std::size_t(L.Kp) * L.ldv * 2);
  L.off_s = take(std::size_t(L.Kp) * L.lds * 4);
  L.off_af = take(std::size_t(C) * L.lda * 4);
  L.off_at = take(std::size_t(C) * L.ldat * 2);
  L.off_o = take(std::size_t(C) * L.lds * 4);
  L.off_glog = take(std::size_t(C) * 8);
  L.off_gf = take(std::size_t(C) * 8);
  L.off_seg = take(std::size_t(C) * 4);
  L.off_gi = take(std::size_t(C) * 4);
  L.off_gc = take(std::size_t(C) * 4);
  L.off_misc = take(16);
  L.bytes = o;
  return L;
}

/// Threads of a chunked block.
inline constexpr int chunked_warps = 4;

/// One warp copies a row of 16-bit elements into shared memory: `count` elements of src,
/// zeros up to `width` (a multiple of 4; dst 8-byte aligned), zeros only when !real. With
/// `vec` (src 8-byte aligned: the tensor's cp.async unit is >= 8) 4 elements a lane at once.
__device__ __forceinline__ void stage_row16(std::uint16_t* dst, const std::uint16_t* src, int count, int width,
                                            bool real, bool vec, int lane) {
  if (vec) {
    for (int a = 4 * lane; a < width; a += 128) {
      uint2 x = make_uint2(0u, 0u);
      if (real) {
        if (a + 4 <= count) {
          x = *reinterpret_cast<const uint2*>(src + a);
        } else {
          unsigned e[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) e[i] = a + i < count ? unsigned(src[a + i]) : 0u;
          x.x = e[0] | (e[1] << 16);
          x.y = e[2] | (e[3] << 16);
        }
      }
      *reinterpret_cast<uint2*>(dst + a) = x;
    }
  } else {
    for (int a = lane; a < width; a += 32) dst[a] = (real && a < count) ? src[a] : std::uint16_t(0);
  }
}

}  // namespace detail

/// The chunked kernel's arguments: the recurrent kernel's (only the fields for q, k, v, g,
/// g_gamma, states, output, varlen, direction and layout are read) and the shared layout.
struct chunked_params {
  forward_params f;
  detail::chunked_layout L;
};

/// One kernel per input dtype (bfloat16, half): gates, direction, varlen and state layout are
/// uniform run-time values read per chunk or per block.
template <class T>
__global__ void __launch_bounds__(32 * detail::chunked_warps) chunked_forward_kernel(const chunked_params P) {
  using namespace nvcuda;
  using namespace detail;
  using E = typename mma_elem<T>::type;
  const forward_params& p = P.f;
  const chunked_layout& L = P.L;
  extern __shared__ __align__(128) unsigned char chunked_smem[];
  unsigned char* smem = chunked_smem;
  E* sq = reinterpret_cast<E*>(smem + L.off_q);
  E* sk = reinterpret_cast<E*>(smem + L.off_k);
  E* sv = reinterpret_cast<E*>(smem + L.off_v);
  E* sst = reinterpret_cast<E*>(smem + L.off_st);
  float* ss = reinterpret_cast<float*>(smem + L.off_s);
  float* saf = reinterpret_cast<float*>(smem + L.off_af);
  E* sat = reinterpret_cast<E*>(smem + L.off_at);
  float* so = reinterpret_cast<float*>(smem + L.off_o);
  double* glog = reinterpret_cast<double*>(smem + L.off_glog);
  double* gf = reinterpret_cast<double*>(smem + L.off_gf);
  int* segv = reinterpret_cast<int*>(smem + L.off_seg);
  float* gi = reinterpret_cast<float*>(smem + L.off_gi);
  float* gc = reinterpret_cast<float*>(smem + L.off_gc);
  float* misc = reinterpret_cast<float*>(smem + L.off_misc);

  const int C = L.C, Kp = L.Kp, BV = L.BV;
  const int ldk = L.ldk, ldv = L.ldv, lds = L.lds, lda = L.lda, ldat = L.ldat;
  const int nC = C / 16, nB = BV / 16, nKt = Kp / 16;
  const int nw = int(blockDim.x) >> 5;
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const bool reverse = p.reverse;
  const bool kv_layout = p.kv_layout;
  const bool has_g = p.g != nullptr, has_gamma = p.g_gamma != nullptr;
  const bool gated = has_g || has_gamma;

  const int vb = int(blockIdx.x % unsigned(p.nvb));
  const int h = int((blockIdx.x / unsigned(p.nvb)) % unsigned(p.H));
  const std::int64_t n = std::int64_t(blockIdx.x / unsigned(p.nvb) / unsigned(p.H));
  const int b0 = vb * BV;
  const int w = min(BV, p.V - b0);  // real columns of this block

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
  const std::int64_t q_base = bidx * p.q.s0 + std::int64_t(h / p.gq) * p.q.s2;
  const std::int64_t k_base = bidx * p.k.s0 + std::int64_t(h / p.gk_heads) * p.k.s2;
  const std::int64_t v_base = bidx * p.v.s0 + std::int64_t(h / p.gv_heads) * p.v.s2 + b0;
  const std::uint16_t* qd = reinterpret_cast<const std::uint16_t*>(p.q.data);
  const std::uint16_t* kd = reinterpret_cast<const std::uint16_t*>(p.k.data);
  const std::uint16_t* vd = reinterpret_cast<const std::uint16_t*>(p.v.data);
  const double gamma = has_gamma ? load_any<double>(p.g_gamma, p.gamma_type, n * p.gamma_s0 + h * p.gamma_s1) : 0.0;
  const float scale = float(p.scale);
  const bool vec_q = p.q.align >= 8, vec_k = p.k.align >= 8, vec_v = p.v.align >= 8;

  // The initial state (zeros when none; padded rows and columns always zero).
  for (int a = warp; a < Kp; a += nw)
    for (int b = lane; b < BV; b += 32) {
      float x = 0.f;
      if (p.h0 && a < p.K && b < w) {
        const std::int64_t off = kv_layout ? n * p.h0_s0 + h * p.h0_s1 + a * p.h0_s2 + (b0 + b)
                                           : n * p.h0_s0 + h * p.h0_s1 + (b0 + b) * p.h0_s2 + a;
        x = static_cast<const float*>(p.h0)[off];
      }
      ss[a * lds + b] = x;
      sst[a * ldv + b] = to_elem<E>(x);
    }

  const std::int64_t nchunks = (len + C - 1) / C;
  for (std::int64_t c = 0; c < nchunks; ++c) {
    const std::int64_t i0 = c * C;
    const int cl = int(len - i0 < C ? len - i0 : C);
    auto tok = [&](int l) -> std::int64_t { return begin + (reverse ? len - 1 - (i0 + l) : i0 + l); };

    // (a) Stage q, k, v (16-bit bit patterns, zero padded) and the log decays.
    for (int l = warp; l < C; l += nw) {
      const bool real = l < cl;
      const std::int64_t t = real ? tok(l) : 0;
      std::uint16_t* rq = reinterpret_cast<std::uint16_t*>(sq + l * ldk);
      std::uint16_t* rk = reinterpret_cast<std::uint16_t*>(sk + l * ldk);
      std::uint16_t* rv = reinterpret_cast<std::uint16_t*>(sv + l * ldv);
      const std::uint16_t* gq = qd + q_base + t * p.q.s1;
      const std::uint16_t* gk = kd + k_base + t * p.k.s1;
      const std::uint16_t* gv = vd + v_base + t * p.v.s1;
      stage_row16(rq, gq, p.K, Kp, real, vec_q, lane);
      stage_row16(rk, gk, p.K, Kp, real, vec_k, lane);
      stage_row16(rv, gv, w, BV, real, vec_v, lane);
      if (gated && lane == 0) {
        double x = gamma;
        if (has_g && real) x += load_any<double>(p.g, p.g_type, bidx * p.g_s0 + t * p.g_s1 + std::int64_t(h) * p.g_s2);
        glog[l] = x;
      }
    }
    __syncthreads();

    // (b) The decay scan (one lane of warp 0, then warp 0's lanes for the factors); the
    // products that do not need it on tensor cores.
    if (gated && warp == 0) {
      if (lane == 0) {
        double G = 0.0;
        int seg = 0;
        for (int l = 0; l < cl; ++l) {
          const double x = glog[l];
          if (x < -1e4) ++seg;  // a decay of 0 (exp underflows in double too): a new segment
          else G += (x > 1e4 ? 1e4 : x);  // (NaN passes into G)
          gf[l] = G;
          segv[l] = seg;
        }
        misc[0] = seg == 0 ? float(::exp(G)) : 0.f;  // e^{G_C}
      }
      __syncwarp();
      const double GC = gf[cl - 1];
      const int segC = segv[cl - 1];
      for (int l = lane; l < C; l += 32) {
        if (l < cl) {
          gi[l] = segv[l] == 0 ? float(::exp(gf[l])) : 0.f;
          gc[l] = segv[l] == segC ? expf(float(GC - gf[l])) : 0.f;
        } else {
          gi[l] = 0.f;
          gc[l] = 0.f;
        }
      }
    }
    {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::col_major> fbt;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::row_major> fb;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      // A = Q K^T, tiles (ti, tj) with tj <= ti and real rows.
      for (int t = warp; t < nC * nC; t += nw) {
        const int ti = t / nC, tj = t % nC;
        if (tj > ti || ti * 16 >= cl) continue;
        wmma::fill_fragment(acc, 0.f);
        for (int kk = 0; kk < Kp; kk += 16) {
          wmma::load_matrix_sync(fa, sq + ti * 16 * ldk + kk, unsigned(ldk));
          wmma::load_matrix_sync(fbt, sk + tj * 16 * ldk + kk, unsigned(ldk));
          wmma::mma_sync(acc, fa, fbt, acc);
        }
        wmma::store_matrix_sync(saf + ti * 16 * lda + tj * 16, acc, unsigned(lda), wmma::mem_row_major);
      }
      // O = Q S~.
      for (int t = warp; t < nC * nB; t += nw) {
        const int ti = t / nB, tb = t % nB;
        if (ti * 16 >= cl) continue;
        wmma::fill_fragment(acc, 0.f);
        for (int kk = 0; kk < Kp; kk += 16) {
          wmma::load_matrix_sync(fa, sq + ti * 16 * ldk + kk, unsigned(ldk));
          wmma::load_matrix_sync(fb, sst + kk * ldv + tb * 16, unsigned(ldv));
          wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(so + ti * 16 * lds + tb * 16, acc, unsigned(lds), wmma::mem_row_major);
      }
    }
    __syncthreads();

    // (c) Decay factors, in float: the causal mask of A (rounded to the input dtype), the k
    // rows for the state update, the rows of O (the incoming state's share) and S.
    for (int i = warp; i < C; i += nw)
      for (int j = lane; j < C; j += 32) {
        float x = 0.f;
        if (i < cl && j <= i) {
          x = saf[i * lda + j];
          if (gated) {
            const float m = segv[i] == segv[j] ? expf(float(gf[i] - gf[j])) : 0.f;
            x = m == 0.f ? 0.f : x * m;
          }
        }
        sat[i * ldat + j] = to_elem<E>(x);
      }
    if (gated) {
      for (int l = warp; l < cl; l += nw) {
        const float f = gc[l];
        if (f != 1.f)
          for (int a = lane; a < p.K; a += 32) sk[l * ldk + a] = to_elem<E>(f == 0.f ? 0.f : from_elem(sk[l * ldk + a]) * f);
      }
      for (int i = warp; i < cl; i += nw) {
        const float f = gi[i];
        for (int b = lane; b < BV; b += 32) so[i * lds + b] = f == 0.f ? 0.f : so[i * lds + b] * f;
      }
      const float f = misc[0];
      if (f != 1.f)
        for (int a = warp; a < Kp; a += nw)
          for (int b = lane; b < BV; b += 32) ss[a * lds + b] = f == 0.f ? 0.f : ss[a * lds + b] * f;
    }
    __syncthreads();

    // (d) O += A~ V, S += K~^T V.
    {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::col_major> fat;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::row_major> fb;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      for (int t = warp; t < nC * nB; t += nw) {
        const int ti = t / nB, tb = t % nB;
        if (ti * 16 >= cl) continue;
        wmma::load_matrix_sync(acc, so + ti * 16 * lds + tb * 16, unsigned(lds), wmma::mem_row_major);
        for (int tj = 0; tj <= ti; ++tj) {
          wmma::load_matrix_sync(fa, sat + ti * 16 * ldat + tj * 16, unsigned(ldat));
          wmma::load_matrix_sync(fb, sv + tj * 16 * ldv + tb * 16, unsigned(ldv));
          wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(so + ti * 16 * lds + tb * 16, acc, unsigned(lds), wmma::mem_row_major);
      }
      for (int t = warp; t < nKt * nB; t += nw) {
        const int ta = t / nB, tb = t % nB;
        wmma::load_matrix_sync(acc, ss + ta * 16 * lds + tb * 16, unsigned(lds), wmma::mem_row_major);
        for (int tj = 0; tj * 16 < cl; ++tj) {
          // K~^T: element (m, k) = K~[tj * 16 + k][ta * 16 + m], column-major with pitch ldk.
          wmma::load_matrix_sync(fat, sk + tj * 16 * ldk + ta * 16, unsigned(ldk));
          wmma::load_matrix_sync(fb, sv + tj * 16 * ldv + tb * 16, unsigned(ldv));
          wmma::mma_sync(acc, fat, fb, acc);
        }
        wmma::store_matrix_sync(ss + ta * 16 * lds + tb * 16, acc, unsigned(lds), wmma::mem_row_major);
      }
    }
    __syncthreads();

    // (e) The chunk's outputs; S~ for the next chunk. (The next chunk's staging touches
    // neither O nor S; its barrier orders these against its products.)
    for (int l = warp; l < cl; l += nw) {
      T* dst = static_cast<T*>(p.out) + bidx * p.out_s0 + tok(l) * p.out_s1 + std::int64_t(h) * p.out_s2 + b0;
      for (int b = lane; b < w; b += 32) dst[b] = from_acc<T>(scale * so[l * lds + b]);
    }
    if (c + 1 < nchunks)
      for (int a = warp; a < Kp; a += nw)
        for (int b = lane; b < BV; b += 32) sst[a * ldv + b] = to_elem<E>(ss[a * lds + b]);
  }

  // The final state (S was last written before the barrier that ends step (d)).
  if (p.ht) {
    for (int a = warp; a < p.K; a += nw)
      for (int b = lane; b < w; b += 32) {
        const std::int64_t off = kv_layout ? n * p.ht_s0 + h * p.ht_s1 + a * p.ht_s2 + (b0 + b)
                                           : n * p.ht_s0 + h * p.ht_s1 + (b0 + b) * p.ht_s2 + a;
        static_cast<float*>(p.ht)[off] = ss[a * lds + b];
      }
  }
}

}  // namespace recattn::cuda
