// The chunked CUDA forward (issue 8): tensor-core products over chunks of C tokens, for
// bfloat16 and half inputs and the scalar gates g and g_gamma.
//
// A thread block (8 warps) owns one (sequence n, head h, block of BV value columns) and walks
// the sequence's chunks in processing order. With G_i the cumulative log decay from the
// chunk's first token to token i (inclusive) and G_C its value at the chunk's last token,
// SPEC §1's recurrence (S_t = d_t S_{t-1} + k_t^T v_t, o_t = scale q_t S_t) unrolled over a
// chunk is
//   o_i = scale * ( e^{G_i} q_i S  +  sum_{j<=i} e^{G_i - G_j} (q_i . k_j) v_j )
//   S  <- e^{G_C} S + sum_j e^{G_C - G_j} k_j^T v_j
// Products are mma.sync m16n8k16 (16-bit operands from ldmatrix, float accumulators), and
// every accumulator stays in registers:
//   - the state block S [Kp x BV] (Kp = K rounded up to 16) in float, spread over the warps
//     by 16-row tiles (warp w holds row tiles w and w + 8, every column); each chunk it is
//     also written to shared memory rounded to the input dtype (S~, the operand of Q S~);
//   - output tiles: the chunk's C x BV outputs as (C / 16) row tiles, each split over WPM
//     warps by columns (NTW 8-column tiles a warp). The warp of row tile m forms
//     A = Q_m K^T over tokens 0 .. 16 m + 15 in registers, masks it with e^{G_i - G_j}
//     (j <= i), and feeds the accumulators straight back as the A operand of A V (the
//     flash-attention register trick); O = e^{G_i} Q_m S~ + A V.
//   - S update: K~^T V with K~ = the k rows scaled by e^{G_C - G_j} (in the ldmatrix'd
//     operand registers, rounded to the input dtype), after S *= e^{G_C}.
// q, k, v of chunk c + 1 are copied into the other of two raw stages by cp.async while chunk
// c is computed (zero-filled past the sequence end and past K or BV), S~ is double buffered,
// so one barrier a chunk orders everything; the scalar gates of chunk c + 1 are loaded into
// registers during chunk c, and every warp scans the chunk's log decays itself (in double,
// a warp scan), so the factors need no barrier either.
//
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
#pragma once

#include <cstdint>
#include <type_traits>

#include "../dtype.hpp"
#include "common.cuh"
#include "recurrence.cuh"

namespace recattn::cuda {

namespace detail {

/// Warps of a chunked block.
inline constexpr int chunked_warps = 8;

/// Shared memory of a chunked block: pitches (16-bit elements) and byte offsets.
struct chunked_layout {
  int C = 64, Kp = 16, BV = 16;
  int ldk = 0;         ///< q, k rows [C][ldk]
  int ldv = 0;         ///< v rows [C][ldv]; S~ [Kp][ldv]
  unsigned stage = 0;  ///< bytes of one raw stage: q, k, v
  unsigned off_k = 0, off_v = 0;  ///< within a stage
  unsigned off_raw = 0;           ///< two stages
  unsigned off_st = 0;            ///< two S~ buffers of st_bytes
  unsigned st_bytes = 0;
  unsigned off_scan = 0;  ///< per warp: G (double), segment (int), e^{G_i}, e^{G_C - G_j} (float), [C] each
  unsigned scan_bytes = 0;
  std::size_t bytes = 0;
};

inline std::size_t align128(std::size_t x) { return (x + 127) / 128 * 128; }

/// Layout for key size K (any, <= 256), BV value columns (16, 32 or 64) and C tokens (16, 32 or 64).
inline chunked_layout make_chunked_layout(std::int64_t K, int BV, int C) {
  chunked_layout L;
  L.C = C;
  L.Kp = int((K + 15) / 16 * 16);
  L.BV = BV;
  // 16 bytes of pad a row: ldmatrix's eight 16-byte rows then fall in distinct bank groups.
  L.ldk = L.Kp + 8;
  L.ldv = BV + 8;
  L.off_k = unsigned(C * L.ldk * 2);
  L.off_v = unsigned(2 * C * L.ldk * 2);
  L.stage = unsigned(align128(std::size_t(L.off_v) + std::size_t(C) * L.ldv * 2));
  L.off_raw = 0;
  L.st_bytes = unsigned(align128(std::size_t(L.Kp) * L.ldv * 2));
  L.off_st = 2 * L.stage;
  L.scan_bytes = unsigned(align128(std::size_t(C) * (8 + 4 + 4 + 4)));
  L.off_scan = L.off_st + 2 * L.st_bytes;
  L.bytes = std::size_t(L.off_scan) + std::size_t(chunked_warps) * L.scan_bytes;
  return L;
}

template <class T>
struct mma_is_bf16 : std::is_same<T, bfloat16> {};

/// Two floats as a 16-bit pair (round to nearest even), `lo` in the low half.
template <class T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  if constexpr (mma_is_bf16<T>::value) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
  }
}

template <class T>
__device__ __forceinline__ float2 unpack2(unsigned x) {
  if constexpr (mma_is_bf16<T>::value) {
    return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&x));
  }
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x2_t(unsigned (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(p)));
}

/// d += a b for one m16n8k16 tile (a: 4 registers of 16-bit pairs, b: 2; d: 4 floats).
template <class T>
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (mma_is_bf16<T>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

/// Copies the rows of chunk tokens [i0, i0 + C) of a 16-bit tensor into a stage tile
/// ([C][pitch] elements): `count` elements of each row from `col0`, zeros up to `units` * 8
/// and in the rows past the sequence end (cl real rows). 16-byte aligned rows go by cp.async
/// (zero fill in the copy); others by plain 2-byte loads.
__device__ __forceinline__ void stage_tile16(std::uint16_t* dst, int pitch, const row_tensor& x, std::int64_t base,
                                             int count, int units, int C, int cl, bool reverse, std::int64_t begin,
                                             std::int64_t len, std::int64_t i0) {
  const std::uint16_t* data = reinterpret_cast<const std::uint16_t*>(x.data);
  for (int u = int(threadIdx.x); u < C * units; u += 32 * chunked_warps) {
    const int l = u / units, e0 = (u - l * units) * 8;
    std::uint16_t* d = dst + l * pitch + e0;
    const bool real = l < cl;
    const std::int64_t t = begin + (reverse ? len - 1 - (i0 + l) : i0 + l);
    const std::uint16_t* src = data + base + t * x.s1 + e0;
    const int valid = real ? max(0, min(8, count - e0)) : 0;
    if (x.align == 16) {
      cp_async<16>(d, valid ? static_cast<const void*>(src) : static_cast<const void*>(data), 2 * valid);
    } else {
      unsigned w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const unsigned lo = 2 * i < valid ? unsigned(src[2 * i]) : 0u;
        const unsigned hi = 2 * i + 1 < valid ? unsigned(src[2 * i + 1]) : 0u;
        w[i] = lo | (hi << 16);
      }
      *reinterpret_cast<uint4*>(d) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

}  // namespace detail

/// The chunked kernel's arguments: the recurrent kernel's (only the fields for q, k, v, g,
/// g_gamma, states, output, varlen, direction and layout are read) and the shared layout.
struct chunked_params {
  forward_params f;
  detail::chunked_layout L;
  bool out_pairs = false;  ///< output rows 4-byte aligned: pairs of columns stored at once
};

/// One kernel per input dtype (bfloat16, half) and value block (16, 32 or 64 columns): gates,
/// direction, varlen, chunk length and state layout are uniform run-time values.
template <class T, int BV>
__global__ void __launch_bounds__(32 * detail::chunked_warps, 1) chunked_forward_kernel(const chunked_params P) {
  using namespace detail;
  constexpr int NW = chunked_warps;
  constexpr int NB = BV / 8;                 // 8-column tiles of the block
  constexpr int NTW_MAX = NB >= 2 ? NB / 2 : 1;  // 8-column tiles of a warp's output (C = 64)
  const forward_params& p = P.f;
  const chunked_layout& L = P.L;
  extern __shared__ __align__(128) unsigned char chunked_smem[];

  const int C = L.C, Kp = L.Kp, ldk = L.ldk, ldv = L.ldv;
  const int nKt = Kp / 16, nM = C / 16;
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int WPM = min(NW / nM, NB);  // warps a row tile of output
  const int NTW = NB / WPM;          // their 8-column tiles
  const bool out_warp = warp < nM * WPM;
  const int mi = warp / WPM;                 // output row tile
  const int nbase = (warp % WPM) * NTW * 8;  // first column of the warp's output
  const int r4 = lane >> 2, c4 = 2 * (lane & 3);  // an accumulator's row and column in its tile

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
  auto tok = [&](std::int64_t i) -> std::int64_t { return begin + (reverse ? len - 1 - i : i); };
  const std::int64_t q_base = bidx * p.q.s0 + std::int64_t(h / p.gq) * p.q.s2;
  const std::int64_t k_base = bidx * p.k.s0 + std::int64_t(h / p.gk_heads) * p.k.s2;
  const std::int64_t v_base = bidx * p.v.s0 + std::int64_t(h / p.gv_heads) * p.v.s2 + b0;
  const double gamma = has_gamma ? load_any<double>(p.g_gamma, p.gamma_type, n * p.gamma_s0 + h * p.gamma_s1) : 0.0;
  const float scale = float(p.scale);

  auto stage_ptr = [&](int s) { return chunked_smem + L.off_raw + unsigned(s) * L.stage; };
  auto st_ptr = [&](int s) { return reinterpret_cast<std::uint16_t*>(chunked_smem + L.off_st + unsigned(s) * L.st_bytes); };
  unsigned char* scan = chunked_smem + L.off_scan + unsigned(warp) * L.scan_bytes;
  double* sG = reinterpret_cast<double*>(scan);
  int* sSeg = reinterpret_cast<int*>(scan + 8 * C);
  float* sFi = reinterpret_cast<float*>(scan + 12 * C);
  float* sFc = reinterpret_cast<float*>(scan + 16 * C);

  const std::int64_t nchunks = (len + C - 1) / C;
  auto issue_stage = [&](std::int64_t c) {
    unsigned char* s = stage_ptr(int(c & 1));
    const std::int64_t i0 = c * C;
    const int cl = int(len - i0 < C ? len - i0 : C);
    stage_tile16(reinterpret_cast<std::uint16_t*>(s), ldk, p.q, q_base, p.K, Kp / 8, C, cl, reverse, begin, len, i0);
    stage_tile16(reinterpret_cast<std::uint16_t*>(s + L.off_k), ldk, p.k, k_base, p.K, Kp / 8, C, cl, reverse, begin,
                 len, i0);
    stage_tile16(reinterpret_cast<std::uint16_t*>(s + L.off_v), ldv, p.v, v_base, w, NB, C, cl, reverse, begin, len,
                 i0);
    cp_async_commit();
  };
  // The scalar gate of a lane's tokens (lane * tpl + e) of chunk c; 0 past the sequence end.
  const int tpl = C == 64 ? 2 : 1;
  auto load_g = [&](std::int64_t c, float (&x)[2]) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int l = lane * tpl + e;
      x[e] = 0.f;
      if (has_g && e < tpl && l < C && c * C + l < len)
        x[e] = load_any<float>(p.g, p.g_type, bidx * p.g_s0 + tok(c * C + l) * p.g_s1 + std::int64_t(h) * p.g_s2);
    }
  };

  // The state block: row tiles warp and warp + 8, every column (zeros past K and w).
  float S[2][NB][4];
#pragma unroll
  for (int ms = 0; ms < 2; ++ms)
#pragma unroll
    for (int nt = 0; nt < NB; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int a = 16 * (warp + NW * ms) + r4 + 8 * (i >> 1), b = 8 * nt + c4 + (i & 1);
        float x = 0.f;
        if (p.h0 && a < p.K && b < w) {
          const std::int64_t off = kv_layout ? n * p.h0_s0 + h * p.h0_s1 + a * p.h0_s2 + (b0 + b)
                                             : n * p.h0_s0 + h * p.h0_s1 + (b0 + b) * p.h0_s2 + a;
          x = static_cast<const float*>(p.h0)[off];
        }
        S[ms][nt][i] = x;
      }
  // S~ (the state rounded to the input dtype) of a state buffer.
  auto write_st = [&](std::uint16_t* st) {
#pragma unroll
    for (int ms = 0; ms < 2; ++ms) {
      const int mt = warp + NW * ms;
      if (mt >= nKt) continue;
#pragma unroll
      for (int nt = 0; nt < NB; ++nt) {
        unsigned* row0 = reinterpret_cast<unsigned*>(st + (16 * mt + r4) * ldv + 8 * nt + c4);
        unsigned* row8 = reinterpret_cast<unsigned*>(st + (16 * mt + r4 + 8) * ldv + 8 * nt + c4);
        *row0 = pack2<T>(S[ms][nt][0], S[ms][nt][1]);
        *row8 = pack2<T>(S[ms][nt][2], S[ms][nt][3]);
      }
    }
  };
  const bool has_h0 = p.h0 != nullptr;
  if (has_h0) write_st(st_ptr(0));

  float gnext[2] = {0.f, 0.f};
  if (nchunks > 0) {
    issue_stage(0);
    load_g(0, gnext);
  }

  for (std::int64_t c = 0; c < nchunks; ++c) {
    const int buf = int(c & 1);
    const std::int64_t i0 = c * C;
    const int cl = int(len - i0 < C ? len - i0 : C);
    float gcur[2] = {gnext[0], gnext[1]};
    cp_async_wait<0>();
    __syncthreads();  // chunk c staged and S~ written, by every thread; chunk c - 1 done
    if (c + 1 < nchunks) {
      issue_stage(c + 1);
      load_g(c + 1, gnext);
    }
    const unsigned char* stg = stage_ptr(buf);
    const std::uint16_t* sq = reinterpret_cast<const std::uint16_t*>(stg);
    const std::uint16_t* sk = reinterpret_cast<const std::uint16_t*>(stg + L.off_k);
    const std::uint16_t* sv = reinterpret_cast<const std::uint16_t*>(stg + L.off_v);
    const std::uint16_t* st = st_ptr(buf);

    // The decay scan of the chunk, by every warp for itself (double; a new segment at each
    // zero decay).
    double GC = 0.0;
    int segC = 0;
    if (gated) {
      double y[2];
      int z[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int l = lane * tpl + e;
        double x = 0.0;
        if (e < tpl && l < cl) x = gamma + double(gcur[e]);
        z[e] = x < -1e4 ? 1 : 0;
        y[e] = z[e] ? 0.0 : (x > 1e4 ? 1e4 : x);  // (NaN passes into G)
      }
      double s = y[0] + y[1];
      int sc = z[0] + z[1];
#pragma unroll
      for (int off = 1; off < 32; off *= 2) {
        const double t = __shfl_up_sync(0xffffffffu, s, off);
        const int tc = __shfl_up_sync(0xffffffffu, sc, off);
        if (lane >= off) {
          s += t;
          sc += tc;
        }
      }
      double ex = __shfl_up_sync(0xffffffffu, s, 1);
      int exc = __shfl_up_sync(0xffffffffu, sc, 1);
      if (lane == 0) {
        ex = 0.0;
        exc = 0;
      }
      const int last = (C / tpl) - 1;  // the lane of token C - 1
      GC = __shfl_sync(0xffffffffu, s, last);
      segC = __shfl_sync(0xffffffffu, sc, last);
      double G = ex;
      int seg = exc;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int l = lane * tpl + e;
        G += y[e];
        seg += z[e];
        if (e < tpl && l < C) {
          sG[l] = G;
          sSeg[l] = seg;
          sFi[l] = seg == 0 ? expf(float(G)) : 0.f;
          sFc[l] = seg == segC ? expf(float(GC - G)) : 0.f;
        }
      }
      __syncwarp();
    }

    if (out_warp && 16 * mi < cl) {
      // A = Q_m K^T (tokens 0 .. 16 mi + 15) and O = Q_m S~ (the warp's columns).
      float A[8][4], O[NTW_MAX][4];
#pragma unroll
      for (int t = 0; t < 8; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) A[t][i] = 0.f;
#pragma unroll
      for (int t = 0; t < NTW_MAX; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) O[t][i] = 0.f;
      const bool inter = c > 0 || has_h0;
      for (int ks = 0; ks < nKt; ++ks) {
        unsigned qa[4];
        ldsm_x4(qa, sq + (16 * mi + (lane & 15)) * ldk + 16 * ks + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          if (np > mi) break;
          unsigned kb[4];
          ldsm_x4(kb, sk + (16 * np + (lane & 7) + (lane >> 4) * 8) * ldk + 16 * ks + ((lane >> 3) & 1) * 8);
          mma16816<T>(A[2 * np], qa, kb[0], kb[1]);
          mma16816<T>(A[2 * np + 1], qa, kb[2], kb[3]);
        }
        if (inter) {
          const std::uint16_t* srow = st + (16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8) * ldv + nbase;
          if (NTW_MAX >= 2 && NTW >= 2) {
#pragma unroll
            for (int np = 0; np < NTW_MAX / 2; ++np) {
              if (2 * np >= NTW) break;
              unsigned sb[4];
              ldsm_x4_t(sb, srow + 16 * np + (lane >> 4) * 8);
              mma16816<T>(O[2 * np], qa, sb[0], sb[1]);
              mma16816<T>(O[2 * np + 1], qa, sb[2], sb[3]);
            }
          } else {
            unsigned sb[2];
            ldsm_x2_t(sb, srow);
            mma16816<T>(O[0], qa, sb[0], sb[1]);
          }
        }
      }
      // The decay mask of A (causal, e^{G_i - G_j} within a segment) and the incoming state's
      // row factors e^{G_i}.
      const int i_lo = 16 * mi + r4, i_hi = i_lo + 8;
      double Gi[2] = {0.0, 0.0};
      int segi[2] = {0, 0};
      if (gated) {
        Gi[0] = sG[i_lo];
        Gi[1] = sG[i_hi];
        segi[0] = sSeg[i_lo];
        segi[1] = sSeg[i_hi];
        const float fi0 = sFi[i_lo], fi1 = sFi[i_hi];
#pragma unroll
        for (int t = 0; t < NTW_MAX; ++t) {
          O[t][0] = fi0 == 0.f ? 0.f : O[t][0] * fi0;
          O[t][1] = fi0 == 0.f ? 0.f : O[t][1] * fi0;
          O[t][2] = fi1 == 0.f ? 0.f : O[t][2] * fi1;
          O[t][3] = fi1 == 0.f ? 0.f : O[t][3] * fi1;
        }
      }
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        if (t >= 2 * (mi + 1)) break;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = 8 * t + c4 + e;
          double Gj = 0.0;
          int segj = 0;
          if (gated) {
            Gj = sG[j];
            segj = sSeg[j];
          }
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int i = hh ? i_hi : i_lo;
            float a = A[t][2 * hh + e];
            if (j > i) {
              a = 0.f;
            } else if (gated) {
              const float m = segi[hh] == segj ? expf(float(Gi[hh] - Gj)) : 0.f;
              a = m == 0.f ? 0.f : a * m;
            }
            A[t][2 * hh + e] = a;
          }
        }
      }
      // O += A V (A's accumulators as the A operand, 16 tokens a step).
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) {
        if (kt > mi) break;
        const unsigned aa[4] = {pack2<T>(A[2 * kt][0], A[2 * kt][1]), pack2<T>(A[2 * kt][2], A[2 * kt][3]),
                                pack2<T>(A[2 * kt + 1][0], A[2 * kt + 1][1]),
                                pack2<T>(A[2 * kt + 1][2], A[2 * kt + 1][3])};
        const std::uint16_t* vrow = sv + (16 * kt + (lane & 7) + ((lane >> 3) & 1) * 8) * ldv + nbase;
        if (NTW_MAX >= 2 && NTW >= 2) {
#pragma unroll
          for (int np = 0; np < NTW_MAX / 2; ++np) {
            if (2 * np >= NTW) break;
            unsigned vb4[4];
            ldsm_x4_t(vb4, vrow + 16 * np + (lane >> 4) * 8);
            mma16816<T>(O[2 * np], aa, vb4[0], vb4[1]);
            mma16816<T>(O[2 * np + 1], aa, vb4[2], vb4[3]);
          }
        } else {
          unsigned vb2[2];
          ldsm_x2_t(vb2, vrow);
          mma16816<T>(O[0], aa, vb2[0], vb2[1]);
        }
      }
      // The chunk's outputs (rows < cl, columns < w).
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = hh ? i_hi : i_lo;
        if (i >= cl) continue;
        T* row = static_cast<T*>(p.out) + bidx * p.out_s0 + tok(i0 + i) * p.out_s1 + std::int64_t(h) * p.out_s2 + b0;
#pragma unroll
        for (int t = 0; t < NTW_MAX; ++t) {
          if (t >= NTW) break;
          const int b = nbase + 8 * t + c4;
          const float x0 = scale * O[t][2 * hh], x1 = scale * O[t][2 * hh + 1];
          if (P.out_pairs && b + 1 < w) {
            *reinterpret_cast<unsigned*>(row + b) = pack2<T>(x0, x1);
          } else {
            if (b < w) row[b] = from_acc<T>(x0);
            if (b + 1 < w) row[b + 1] = from_acc<T>(x1);
          }
        }
      }
    }

    // S <- e^{G_C} S + K~^T V (K~: k rows scaled by e^{G_C - G_j}, in the operand registers).
    if (gated) {
      const float f = segC == 0 ? expf(float(GC)) : 0.f;
#pragma unroll
      for (int ms = 0; ms < 2; ++ms)
#pragma unroll
        for (int nt = 0; nt < NB; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) S[ms][nt][i] = f == 0.f ? 0.f : S[ms][nt][i] * f;
    }
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      if (kt >= nM || 16 * kt >= cl) break;
      unsigned ka[2][4];
#pragma unroll
      for (int ms = 0; ms < 2; ++ms) {
        const int mt = warp + NW * ms;
        if (mt >= nKt) continue;
        ldsm_x4_t(ka[ms], sk + (16 * kt + (lane & 7) + (lane >> 4) * 8) * ldk + 16 * mt + ((lane >> 3) & 1) * 8);
        if (gated) {
          const int j0 = 16 * kt + c4;  // a0, a1: tokens j0, j0 + 1; a2, a3: j0 + 8, j0 + 9
          const float f0 = sFc[j0], f1 = sFc[j0 + 1], f8 = sFc[j0 + 8], f9 = sFc[j0 + 9];
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const float2 x = unpack2<T>(ka[ms][r]);
            const float fa = r < 2 ? f0 : f8, fb = r < 2 ? f1 : f9;
            ka[ms][r] = pack2<T>(fa == 0.f ? 0.f : x.x * fa, fb == 0.f ? 0.f : x.y * fb);
          }
        }
      }
      const std::uint16_t* vrow = sv + (16 * kt + (lane & 7) + ((lane >> 3) & 1) * 8) * ldv;
#pragma unroll
      for (int np = 0; np < NB / 2; ++np) {
        unsigned vb4[4];
        ldsm_x4_t(vb4, vrow + 16 * np + (lane >> 4) * 8);
#pragma unroll
        for (int ms = 0; ms < 2; ++ms) {
          if (warp + NW * ms >= nKt) continue;
          mma16816<T>(S[ms][2 * np], ka[ms], vb4[0], vb4[1]);
          mma16816<T>(S[ms][2 * np + 1], ka[ms], vb4[2], vb4[3]);
        }
      }
    }
    if (c + 1 < nchunks) write_st(st_ptr(buf ^ 1));
  }

  // The final state, from the registers.
  if (p.ht) {
#pragma unroll
    for (int ms = 0; ms < 2; ++ms)
#pragma unroll
      for (int nt = 0; nt < NB; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int a = 16 * (warp + NW * ms) + r4 + 8 * (i >> 1), b = 8 * nt + c4 + (i & 1);
          if (a < p.K && b < w) {
            const std::int64_t off = kv_layout ? n * p.ht_s0 + h * p.ht_s1 + a * p.ht_s2 + (b0 + b)
                                               : n * p.ht_s0 + h * p.ht_s1 + (b0 + b) * p.ht_s2 + a;
            static_cast<float*>(p.ht)[off] = S[ms][nt][i];
          }
        }
  }
}

}  // namespace recattn::cuda
