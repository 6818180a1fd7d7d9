// The CPU backward kernel (SPEC §3.2): one xsimd kernel for every gate policy, direction,
// layout, dtype and state layout.
//
// Two sweeps over each sequence, neither of which stores a state per token:
//
//   sweep B (reverse processing order) carries the adjoint dS (the gradient with respect
//     to the state after token i), starting from d_final_state:
//        dS += scale * q_i dO_i^T;   dk_i = dS v_i;   dv_i = dS^T k_i;   dS = D_i .* dS
//     and ends with d initial_state = dS.
//   sweep A (processing order) carries the state S^T, starting from initial_state:
//        S^T = D_i^T .* S^T + v_i k_i^T;   dq_i = scale * S_i dO_i   (and o_i for dgv)
//
// The gate gradients d log D_i = dS_i .* D_i .* S_{i-1} need the state and the adjoint of
// the same token, which the two sweeps carry in opposite directions. They are obtained
// without either from the telescoping identities (summing d log D over b, over a, or both)
//
//   dgk_i = rowsum(dh0 .* h0) + sum_{j<i} (k_j .* dk'_j - q_j .* dq'_j)
//   dgv_i = colsum(dh0 .* h0) + sum_{j<i} (v_j .* dv'_j - o'_j .* dO_j)
//   dg_i  = sum(dh0 .* h0)    + sum_{j<i} sum_a (k_j .* dk'_j - q_j .* dq'_j)
//
// (per head, before heads are summed for grouped q/k/v), where the primed terms leave out
// token j's own contribution: dk'_j = A_j v_j with A_j = D_{j+1} .* dS_{j+1} (the adjoint
// before q_j dO_j^T is added), dq'_j = scale (D_j .* S_{j-1}) dO_j (the state before k_j v_j^T
// is added), and likewise dv', o'. The unprimed terms would carry scale (q_j . k_j)
// (v_j . dO_j) twice, once in each sweep, cancelling in the difference: with strong decay that
// pair is most of each term, and its float rounding, summed over thousands of tokens, was
// most of the error (2e-4 at T = 16384 with log(sigmoid(N(0, 1))) gates; 1e-5 now). The
// sweeps form dk = dk' + q (v . dO), dq = dq' + k (v . dO) etc. per token, at no extra cost
// in the state loops.
//
// dg_gamma = sum_i dg_i would add up T prefix sums whose rounding errors are correlated (the
// error grew like eps * T: 2e-3 to 6e-2 at T = 16384); it is instead differentiated forward:
// sweep A carries the tangent R = dS / d g_gamma, R_i = D_i .* (R_{i-1} + S_{i-1}), and
//   dg_gamma = sum_i scale q_i^T R_i dO_i + <d final_state, R_{L-1}>,
// one more K x V recurrence only when dg_gamma is asked for (error ~1e-7).
//
// Sweep B runs first and hands its per-token terms to sweep A through the gate gradients'
// own buffers, in the gradient's dtype, with error feedback (the rounding of one token's term
// is carried into the next), so that the running sums sweep A forms from them are off by one
// rounding, not T of them: a 16-bit gate gradient needs no float scratch. Sweep A reads each
// term, writes the final value in its place.
//
// Both sweeps run the forward's rescaled recurrence (recurrence.hpp): within a segment the
// carried matrix is kept divided by the product P of the decays applied since the segment
// began (a key-row factor for g, g_gamma, gk; a value-column factor for gv), so the state
// loops are FMAs only, for every gate set: 3 per state element and token in the adjoint
// sweep (dk', dv', the update), 2 in the state sweep (dq', the update), against a multiply
// more each in the direct form. A segment ends before the token that would take a product
// out of [e^-20, e^20]; that token applies the products and its own decay to the true matrix
// as plain multiplies (a decay of 0 zeroes it exactly). Nothing divides by a decay: only by
// products within those bounds, O(K + V) per token, never to undo a step.
//
// Memory beyond inputs and outputs: per worker the K x V adjoint or state (and tangent) of
// each head of its item plus the chunk's staged rows of those heads (about 1.4 MB for
// K = V = 128, 8 heads, chunk 16; the sweeps run one after the other and share one buffer),
// and N * H * (K + V + 2) doubles, for every dtype: independent of T (backward_workspace_of
// reports it). Storing a state checkpoint every C tokens would instead cost T / C * K * V per
// head, and a constant number of checkpoints (revolve) a factor of log T in time.
//
// Precision (float, T = 16384, every gate): dq, dk, dv ~8e-8; dgk, dgv, dg ~1e-5 (the
// remaining rounding of the primed terms, summed over the sequence, grows like
// eps * sqrt(T)); dg_gamma ~1e-7 to 1e-6. fla's fused_recurrent backward forms its gate
// gradients from the unprimed terms (and none for g_gamma).
//
// Work items: sweep B, (sequence, Mb groups of heads that share key or value rows) with the
// whole K x V adjoint of each head; sweep A, (sequence, Ma groups of heads sharing a query
// row, block of key columns). As in the forward (head-group staging), the rows of one token
// for the item's consecutive heads are adjacent in memory and are staged together, as many
// heads as keep their matrices within 512 KiB while every thread gets an item (shape a: 8).
// Within a chunk of staged tokens, register tiles of the state stay in registers, and grouped
// heads sum into a float chunk buffer before one write, so bfloat16 outputs are rounded once.
// dq, dk, dv rows are written with non-temporal stores where the dtype and alignment allow.
// Float inputs whose K and V are whole SIMD registers (and a float gk, no gv) are staged in
// one pass per row (stage_one_pass: loads, decay, segment bound and rescaling together), with
// the rows of the token RECATTN_CPU_BWD_STAGE_AHEAD ahead prefetched as each head is staged;
// the other inputs by the general staging (a pass per step, no prefetch).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include <xsimd/xsimd.hpp>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "../backward_problem.hpp"
#include "../cfg.hpp"
#include "../detail/seqlen.hpp"
#include "../dtype.hpp"
#include "../policy.hpp"
#include "parallel.hpp"
#include "recurrence.hpp"

// Register tile of the adjoint sweep: state rows x SIMD registers kept in registers over a
// chunk. 4 x 4 measured fastest for K = V = 128 float on AVX-512 (the direct form's sweeps;
// 8 x 2 for both rescaled sweeps measured no faster: 100 against 98.5 ms CPU per call).
#ifndef RECATTN_CPU_BWD_TILE_ROWS
#define RECATTN_CPU_BWD_TILE_ROWS 4
#endif
#ifndef RECATTN_CPU_BWD_TILE_REGS
#define RECATTN_CPU_BWD_TILE_REGS 4
#endif
// The state sweep's tile (2 FMAs per element, like the forward's scan): 8 x 2 as in the
// forward measured a few percent faster than 4 x 4 there (shape a, gk, 2 threads).
#ifndef RECATTN_CPU_BWD_A_TILE_ROWS
#define RECATTN_CPU_BWD_A_TILE_ROWS 8
#endif
#ifndef RECATTN_CPU_BWD_A_TILE_REGS
#define RECATTN_CPU_BWD_A_TILE_REGS 2
#endif

// Non-temporal stores of the dq, dk, dv rows (float on AVX / AVX-512): they are not read
// again by the kernel, and a plain store first reads each line it writes.
#ifndef RECATTN_CPU_BWD_STREAM_STORES
#define RECATTN_CPU_BWD_STREAM_STORES 1
#endif

// Software prefetch of the next chunk's rows, spread over the register tiles (0: none, the
// hardware prefetcher alone). Off by default: with the rows of a head group staged together
// (4 KiB per tensor and token on shape a) it measured slower here (bench/README.md).
#ifndef RECATTN_CPU_BWD_PREFETCH
#define RECATTN_CPU_BWD_PREFETCH 0
#endif

// Prefetch distance, in tokens, of the one-pass float staging: while staging token i it
// prefetches the rows of token i + RECATTN_CPU_BWD_STAGE_AHEAD (in sweep order; 0: none).
#ifndef RECATTN_CPU_BWD_STAGE_AHEAD
#define RECATTN_CPU_BWD_STAGE_AHEAD 2
#endif

// Budget for the matrices of the heads one work item holds (see backward_plan): the
// forward's RECATTN_CPU_GROUP_STATE_BYTES unless set.
#ifndef RECATTN_CPU_BWD_GROUP_BYTES
#define RECATTN_CPU_BWD_GROUP_BYTES RECATTN_CPU_GROUP_STATE_BYTES
#endif

namespace recattn::cpu {

namespace detail {

/// Applies a segment start's factors (segment_factors, as in the forward's scan_tile) to a
/// register tile: the rescaled values back to the true ones, then the start token's decays.
template <class Acc, int R, int NV, class B>
inline void apply_segment_factors(B (&s)[R][NV], const segment_factors<Acc>& f) {
  constexpr std::int64_t W = std::int64_t(B::size);
  if (f.r1)
    for (int i = 0; i < R; ++i) {
      const B a(f.r1[i]), b(f.r2[i]);
      for (int j = 0; j < NV; ++j) s[i][j] = (s[i][j] * a) * b;
    }
  if (f.c1)
    for (int j = 0; j < NV; ++j) {
      const B a = B::load_unaligned(f.c1 + j * W), b = B::load_unaligned(f.c2 + j * W);
      for (int i = 0; i < R; ++i) s[i][j] = (s[i][j] * a) * b;
    }
}

/// One segment of the adjoint sweep for a register tile of R key rows x NV registers of
/// value columns of dS, in the rescaled form (see sweep B): tokens in sweep order (reverse
/// processing order), the tile holding dS' = dS / P with P the product of the decays applied
/// since the segment began. At token u the tile holds A'_u (the adjoint without token u's own
/// output: A_u = P_u .* A'_u); it adds the tile's share of A'^T k'' to dvp ([L][ldv]), stores
/// (first column tile) or adds its lane partials of A' v'' to kpart ([L][ldk][W]), then
/// dS' += q' dO'^T. Three FMAs per state element for every gate set; the caller stages
/// k'' = k * Pr, v'' = v * Pc, q' = q / Pr, dO' = dO / Pc and scales the results by Pr, Pc.
template <class Acc, int R, int NV>
inline void adjoint_tile(std::int64_t L, const Acc* qs, const Acc* ks, std::int64_t ldk, const Acc* vs, const Acc* dos,
                         std::int64_t ldv, Acc* S, std::int64_t lds, Acc* dvp, Acc* kpart, bool first,
                         const segment_factors<Acc>& f) {
  using B = xsimd::batch<Acc, arch>;
  constexpr std::int64_t W = std::int64_t(B::size);
  B s[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) s[i][j] = B::load_aligned(S + i * lds + j * W);
  apply_segment_factors<Acc>(s, f);
  for (std::int64_t l = 0; l < L; ++l) {
    const Acc* qr = qs + l * ldk;
    const Acc* kr = ks + l * ldk;
    B v[NV], d[NV], dva[NV];
    for (int j = 0; j < NV; ++j) {
      v[j] = B::load_aligned(vs + l * ldv + j * W);
      d[j] = B::load_aligned(dos + l * ldv + j * W);
      dva[j] = B::load_aligned(dvp + l * ldv + j * W);
    }
    Acc* kp = kpart + l * ldk * W;
    for (int i = 0; i < R; ++i) {
      const B qb(qr[i]), kb(kr[i]);
      B dka(Acc(0));
      for (int j = 0; j < NV; ++j) {
        dva[j] = xsimd::fma(kb, s[i][j], dva[j]);
        dka = xsimd::fma(s[i][j], v[j], dka);
        s[i][j] = xsimd::fma(qb, d[j], s[i][j]);
      }
      if (first) dka.store_aligned(kp + i * W);
      else (B::load_aligned(kp + i * W) + dka).store_aligned(kp + i * W);
    }
    for (int j = 0; j < NV; ++j) dva[j].store_aligned(dvp + l * ldv + j * W);
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) s[i][j].store_aligned(S + i * lds + j * W);
}

/// One segment of the state sweep on S^T for a register tile of R value rows x NV registers
/// of key columns, in processing order and the rescaled form (see sweep A): the tile holds
/// S'^T = S^T / P. At token l it reads S'_{l-1} (after the segment start's factors: D_l .*
/// S_{l-1} = P_l .* S'_{l-1}) for its share of dq' (dO'' . S', added to dqp, [L][ldk]) and,
/// with NeedO, the lane partials of o' (S' q'', stored or added to opart, [L][ldv][W]); then
/// S' += v' k'^T. With NeedR it carries the rescaled tangent R' = R' + S'_{l-1} (R_l = D_l .*
/// (R_{l-1} + S_{l-1})) in Rt and adds dO'' . R' to rqp. Two FMAs per state element (and one
/// add and one FMA for the tangent); the caller stages dO'' = scale dO * Pr, v' = v / Pr,
/// k' = k / Pc, q'' = q * Pc (rows r: value index, columns c: key index) and scales the results.
template <class Acc, bool NeedO, bool NeedR, int R, int NV>
inline void state_tile(std::int64_t L, const Acc* dos, const Acc* vs, std::int64_t ldv, const Acc* ks, const Acc* qs,
                       std::int64_t ldk, Acc* S, Acc* Rt, std::int64_t lds, Acc* dqp, Acc* rqp, Acc* opart, bool first,
                       const segment_factors<Acc>& f) {
  using B = xsimd::batch<Acc, arch>;
  constexpr std::int64_t W = std::int64_t(B::size);
  B s[R][NV];
  B rt[NeedR ? R : 1][NeedR ? NV : 1];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) {
      s[i][j] = B::load_aligned(S + i * lds + j * W);
      if constexpr (NeedR) rt[i][j] = B::load_aligned(Rt + i * lds + j * W);
    }
  apply_segment_factors<Acc>(s, f);
  if constexpr (NeedR) apply_segment_factors<Acc>(rt, f);
  for (std::int64_t l = 0; l < L; ++l) {
    const Acc* vr = vs + l * ldv;
    const Acc* dr = dos + l * ldv;
    B k[NV], q[NV], dqa[NV], rqa[NeedR ? NV : 1];
    for (int j = 0; j < NV; ++j) {
      k[j] = B::load_aligned(ks + l * ldk + j * W);
      if constexpr (NeedO) q[j] = B::load_aligned(qs + l * ldk + j * W);
      dqa[j] = B::load_aligned(dqp + l * ldk + j * W);
      if constexpr (NeedR) rqa[j] = B::load_aligned(rqp + l * ldk + j * W);
    }
    Acc* op = opart + l * ldv * W;
    for (int i = 0; i < R; ++i) {
      const B vb(vr[i]), ob(dr[i]);
      B oa(Acc(0));
      for (int j = 0; j < NV; ++j) {
        if constexpr (NeedR) {
          rt[i][j] = rt[i][j] + s[i][j];
          rqa[j] = xsimd::fma(ob, rt[i][j], rqa[j]);
        }
        dqa[j] = xsimd::fma(ob, s[i][j], dqa[j]);
        if constexpr (NeedO) oa = xsimd::fma(s[i][j], q[j], oa);
        s[i][j] = xsimd::fma(vb, k[j], s[i][j]);
      }
      if constexpr (NeedO) {
        if (first) oa.store_aligned(op + i * W);
        else (B::load_aligned(op + i * W) + oa).store_aligned(op + i * W);
      }
    }
    for (int j = 0; j < NV; ++j) {
      dqa[j].store_aligned(dqp + l * ldk + j * W);
      if constexpr (NeedR) rqa[j].store_aligned(rqp + l * ldk + j * W);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) {
      s[i][j].store_aligned(S + i * lds + j * W);
      if constexpr (NeedR) rt[i][j].store_aligned(Rt + i * lds + j * W);
    }
}

/// store_row with non-temporal stores where the row allows (float, aligned destination);
/// stream_fence() orders them before the work item ends.
template <class T, class Acc>
inline void store_row_stream(const Acc* src, std::int64_t n, T* dst) {
#if RECATTN_CPU_BWD_STREAM_STORES && (defined(__AVX512F__) || defined(__AVX__))
  if constexpr (std::is_same_v<T, float> && std::is_same_v<Acc, float>) {
#if defined(__AVX512F__)
    constexpr std::int64_t w = 16;
    constexpr std::uintptr_t align = 63;
#else
    constexpr std::int64_t w = 8;
    constexpr std::uintptr_t align = 31;
#endif
    if ((reinterpret_cast<std::uintptr_t>(dst) & align) == 0) {
      std::int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + w <= n; i += w) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#else
      for (; i + w <= n; i += w) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
#endif
      for (; i < n; ++i) dst[i] = src[i];
      return;
    }
  }
#endif
  store_row(src, n, dst);
}

inline void stream_fence() {
#if RECATTN_CPU_BWD_STREAM_STORES && (defined(__AVX512F__) || defined(__AVX__))
  _mm_sfence();
#endif
}

/// x[i] *= y[i] over a padded row.
template <class Acc>
inline void mul_row(Acc* x, const Acc* y, std::int64_t n_padded) {
  using B = xsimd::batch<Acc, arch>;
  for (std::int64_t i = 0; i < n_padded; i += std::int64_t(B::size))
    (B::load_aligned(x + i) * B::load_aligned(y + i)).store_aligned(x + i);
}

/// up[i] = x[i] * r[i] and down[i] = y[i] / r[i] over padded rows (either output may be null).
template <class Acc>
inline void scale_rows(const Acc* r, const Acc* x, Acc* up, const Acc* y, Acc* down, std::int64_t n_padded) {
  using B = xsimd::batch<Acc, arch>;
  for (std::int64_t i = 0; i < n_padded; i += std::int64_t(B::size)) {
    const B rb = B::load_aligned(r + i);
    if (up) (B::load_aligned(x + i) * rb).store_aligned(up + i);
    if (down) (B::load_aligned(y + i) / rb).store_aligned(down + i);
  }
}

/// Horizontal sums of W registers at once (xsimd::haddp), in row order. xsimd 8.1's AVX-512
/// haddp returns the W sums permuted; the order is probed once and undone, and were the
/// probe ever to find something other than a permutation, plain per-row sums are used.
template <class Acc>
struct lane_sums {
  using B = xsimd::batch<Acc, arch>;
  static constexpr std::size_t W = B::size;
  std::array<int, W> where{};  ///< haddp's output lane of row r's sum
  bool permutation = true;
  bool identity = false;  ///< where[r] == r
#if defined(__AVX512F__)
  alignas(64) std::int32_t where32[16] = {};  ///< where, for one vector permute (float)
#endif

  static const lane_sums& get() {
    static const lane_sums s;
    return s;
  }
  lane_sums() {
    for (int probe = 0; probe < 2 && permutation; ++probe) {
      alignas(64) Acc m[W * W];
      alignas(64) Acc out[W];
      B rows[W];
      for (std::size_t r = 0; r < W; ++r) {
        for (std::size_t c = 0; c < W; ++c)
          m[r * W + c] = probe == 0 ? Acc(r * W + c) : Acc(std::ldexp(double(c + 1), int(r)));
        rows[r] = B::load_aligned(m + r * W);
      }
      xsimd::haddp(rows).store_aligned(out);
      for (std::size_t r = 0; r < W; ++r) {
        Acc sum = 0;
        for (std::size_t c = 0; c < W; ++c) sum += m[r * W + c];
        int found = -1;
        for (std::size_t o = 0; o < W; ++o)
          if (out[o] == sum) found = int(o);
        if (found < 0 || (probe == 1 && found != where[r])) permutation = false;
        where[r] = found;
      }
    }
    identity = permutation;
    for (std::size_t r = 0; r < W; ++r) identity = identity && where[r] == int(r);
#if defined(__AVX512F__)
    for (std::size_t r = 0; r < W && r < 16; ++r) where32[r] = where[r];
#endif
  }

  /// out[r] = sum of the lanes of part[r] for r in [0, W).
  void operator()(const Acc* part, Acc* out) const {
    if (permutation) {
      B rows[W];
      for (std::size_t r = 0; r < W; ++r) rows[r] = B::load_aligned(part + r * W);
      const B sums = xsimd::haddp(rows);
      if (identity) return sums.store_unaligned(out);
#if defined(__AVX512F__)
      // One vector permute instead of W scalar copies (xsimd 8.1's AVX-512 haddp permutes).
      if constexpr (std::is_same_v<Acc, float> && W == 16) {
        _mm512_storeu_ps(out, _mm512_permutexvar_ps(_mm512_load_si512(where32), sums));
        return;
      }
#endif
      alignas(64) Acc h[W];
      sums.store_aligned(h);
      for (std::size_t r = 0; r < W; ++r) out[r] = h[where[r]];
    } else {
      for (std::size_t r = 0; r < W; ++r) out[r] = xsimd::hadd(B::load_aligned(part + r * W));
    }
  }
};

/// out[l][r] = sum of the W lanes of part[l][r] for r in [0, rows_p), rows_p a multiple of W.
template <class Acc>
inline void reduce_lanes(std::int64_t L, std::int64_t rows_p, const Acc* part, Acc* out, std::int64_t ldo) {
  constexpr std::int64_t W = std::int64_t(xsimd::batch<Acc, arch>::size);
  const lane_sums<Acc>& sums = lane_sums<Acc>::get();
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t r0 = 0; r0 < rows_p; r0 += W) sums(part + (l * rows_p + r0) * W, out + l * ldo + r0);
}

/// Calls tile(R, NV, row, col) over a [rows x cols_p] state in register tiles: column
/// tiles of NV registers (then single registers), row tiles of R rows (then single rows).
template <class Acc, int R, int NV, class Tile>
inline void for_each_tile(std::int64_t rows, std::int64_t cols_p, Tile&& tile) {
  constexpr std::int64_t W = std::int64_t(xsimd::batch<Acc, arch>::size);
  auto row_tiles = [&](auto nv, std::int64_t j0) {
    std::int64_t r = 0;
    for (; r + R <= rows; r += R) tile(std::integral_constant<int, R>{}, nv, r, j0);
    for (; r < rows; ++r) tile(std::integral_constant<int, 1>{}, nv, r, j0);
  };
  std::int64_t j0 = 0;
  for (; j0 + NV * W <= cols_p; j0 += NV * W) row_tiles(std::integral_constant<int, NV>{}, j0);
  for (; j0 < cols_p; j0 += W) row_tiles(std::integral_constant<int, 1>{}, j0);
}

/// Stores x + carry into element off of a gate-gradient row of dtype t and keeps in carry
/// what the rounding to t lost (error feedback): the stored values then add up to the sum of
/// the x's within one rounding of the last of them, however many are added. Sweep B hands
/// its per-token terms to sweep A this way, through the gate gradient's own buffer, so a
/// 16-bit gradient needs no float scratch of its size.
inline void store_fed(void* dst, dtype t, std::int64_t off, double x, double& carry) {
  x += carry;
  store_as(dst, t, off, x);
  carry = x - load_as<double>(dst, t, off);
}

/// Gate-gradient element conversions (float32, float64, bfloat16, half).
template <class G>
inline G to_gate(double x) {
  if constexpr (std::is_same_v<G, double>) return x;
  else if constexpr (std::is_same_v<G, float>) return float(x);
  else return G(float(x));
}
template <class G>
inline double from_gate(G g) {
  if constexpr (std::is_same_v<G, double> || std::is_same_v<G, float>) return double(g);
  else return double(float(g));
}

/// Calls f with the gate-gradient row at element off of dst, typed by t (once per row, so
/// that the per-element loops below have no dtype switch).
template <class F>
inline void with_gate_row(void* dst, dtype t, std::int64_t off, F&& f) {
  switch (t) {
    case dtype::float64: f(static_cast<double*>(dst) + off); return;
    case dtype::bfloat16: f(static_cast<bfloat16*>(dst) + off); return;
    case dtype::float16: f(static_cast<half*>(dst) + off); return;
    default: f(static_cast<float*>(dst) + off); return;
  }
}

/// sum_i x[i] * y[i] in double, in 4 independent chains (a single chain is one add latency
/// per element, which the per-token bookkeeping of a 128-wide row cannot afford).
template <class Acc>
inline double dot_double(const Acc* x, const Acc* y, std::int64_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  std::int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int u = 0; u < 4; ++u) s[u] += double(x[i + u]) * double(y[i + u]);
  for (; i < n; ++i) s[0] += double(x[i]) * double(y[i]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

/// sum_i x[i] * y[i] over rows padded with zeros to a multiple of the SIMD width.
template <class Acc>
inline Acc dot_padded(const Acc* x, const Acc* y, std::int64_t n_padded) {
  using B = xsimd::batch<Acc, arch>;
  constexpr std::int64_t W = std::int64_t(B::size);
  B s(Acc(0));
  for (std::int64_t i = 0; i < n_padded; i += W) s = xsimd::fma(B::load_unaligned(x + i), B::load_unaligned(y + i), s);
  return xsimd::hadd(s);
}

/// Sweep B's half of a gate-gradient row: dst[i] = x[i] * y[i] with error feedback (store_fed).
template <class G, class Acc>
inline void feed_row(G* dst, const Acc* x, const Acc* y, std::int64_t n, double* carry) {
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = double(x[i]) * double(y[i]) + carry[i];
    dst[i] = to_gate<G>(v);
    carry[i] = v - from_gate(dst[i]);
  }
}

/// Sweep A's half: reads sweep B's term, writes the final value c[i] + run[i] in its place and
/// adds the term minus x[i] * y[i] to the running sum.
template <class G, class Acc>
inline void drain_row(G* dst, const double* c, double* run, const Acc* x, const Acc* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const double fed = from_gate(dst[i]);
    dst[i] = to_gate<G>(c[i] + run[i]);
    run[i] += fed - double(x[i]) * double(y[i]);
  }
}

/// Loads one (n, h) state slice as M[r][c] (r over rows, c over cols, row stride ldm) from
/// a state of the problem's layout, transposed when `transposed` (M = S^T). Zero padded
/// where the buffer is wider.
template <class Acc>
inline void load_state(const problem& p, const strided3& st, std::int64_t n, std::int64_t h, bool transposed,
                       std::int64_t rows, std::int64_t c0, std::int64_t cols, Acc* M, std::int64_t ldm) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < ldm; ++c) M[r * ldm + c] = Acc(0);
  if (!st.data) return;
  const Acc* src = static_cast<const Acc*>(st.data);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::int64_t a = transposed ? c0 + c : r, b = transposed ? r : c0 + c;  // S[a][b]
      M[r * ldm + c] = src[state_offset(p, st, n, h, a, b)];
    }
}

/// Whether a sweep can stage its rows in one pass (stage_one_pass): float inputs (and a float
/// gk, and no value-side decay, which the one-pass staging does not do), rows of whole
/// registers (`whole`).
template <class T, class Acc>
inline bool one_pass_rows(const problem& p, bool gv_decay, bool whole) {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<Acc, float>)
    return !gv_decay && whole && (!p.has(gate_gk) || p.gk.type == dtype::float32);
  else
    return false;
}

inline std::int64_t lcm64(std::int64_t a, std::int64_t b) { return a / std::gcd(a, b) * b; }

}  // namespace detail

/// Scratch sizes of one backward call (bytes), for the memory figures of the benchmark.
struct backward_workspace {
  std::size_t per_thread_b = 0, per_thread_a = 0;  ///< sweep B, sweep A scratch of one worker
  int threads_b = 0, threads_a = 0;
  std::size_t shared = 0;  ///< per-(n, h) constants
  /// The sweeps run one after the other and share one buffer.
  std::size_t total() const {
    return std::max(per_thread_b * std::size_t(threads_b), per_thread_a * std::size_t(threads_a)) + shared;
  }
};

namespace detail {

/// Hands out consecutive slices of a worker's scratch, each rounded up to whole SIMD
/// registers (so every slice is aligned); with a null base it only counts.
template <class Acc>
struct carver {
  Acc* base;
  std::int64_t W;
  std::size_t off = 0;
  Acc* operator()(std::int64_t n) {
    Acc* r = base ? base + off : nullptr;
    off += std::size_t(round_up(std::max<std::int64_t>(n, 0), W));
    return r;
  }
};

/// Sweep B's scratch of one worker (Gh heads per item). Per head of the item: the rescaled adjoint dS' [K][Vp],
/// the decay products of its segment (runr [Kp], runc [Vp]) and the decays of the token
/// processed last (pendr, pendc). Per head, a staged chunk in sweep order: q * scale,
/// k, v, dO as given; their rescaled forms q' = q / Pr, k'' = k * Pr, v'' = v * Pc,
/// dO' = dO / Pc; the products Pr, Pc of each token; the segment-start factors; one token's
/// decays (dr, dc) and the products before it (prev: the one-pass staging); starts;
/// dk', dv' of the head and dk, dv of the head groups; the lane partials of dk'. Then the
/// rounding carries of the gate terms (double).
template <class Acc>
struct sweep_b_buffers {
  Acc *S, *runr, *pendr, *runc, *pendc;
  Acc *qs, *ks, *q1, *k2, *rr, *fr1, *fr2;
  Acc *vs, *dos, *v2, *do1, *rc, *fc1, *fc2;
  Acc *dr, *dc, *prev, *starts, *dkh, *dvh, *dkg, *dvg, *kpart;
  double* run;
  std::size_t bytes;
  sweep_b_buffers(Acc* base, std::int64_t W, std::int64_t Gh, std::int64_t K, std::int64_t V, std::int64_t Kp,
                  std::int64_t Vp, std::int64_t C, std::int64_t nk, std::int64_t nv, bool row, bool col) {
    carver<Acc> take{base, W};
    const std::int64_t r = row ? 1 : 0, c = col ? 1 : 0;
    S = take(Gh * K * Vp);
    runr = take(r * Gh * Kp), pendr = take(r * Gh * Kp), runc = take(c * Gh * Vp), pendc = take(c * Gh * Vp);
    qs = take(Gh * C * Kp), ks = take(Gh * C * Kp);
    q1 = take(r * Gh * C * Kp), k2 = take(r * Gh * C * Kp), rr = take(r * Gh * C * Kp);
    fr1 = take(r * Gh * C * Kp), fr2 = take(r * Gh * C * Kp);
    vs = take(Gh * C * Vp), dos = take(Gh * C * Vp);
    v2 = take(c * Gh * C * Vp), do1 = take(c * Gh * C * Vp), rc = take(c * Gh * C * Vp);
    fc1 = take(c * Gh * C * Vp), fc2 = take(c * Gh * C * Vp);
    dr = take(Kp), dc = take(Vp), prev = take(r * Kp), starts = take(Gh * round_up(C, W));
    dkh = take(C * Kp), dvh = take(C * Vp), dkg = take(nk * C * Kp), dvg = take(nv * C * Vp), kpart = take(C * Kp * W);
    run = base ? reinterpret_cast<double*>(base + take.off) : nullptr;
    bytes = (sizeof(Acc) * take.off + sizeof(double) * std::size_t(Gh * (K + V + 1)) + 63) / 64 * 64;
  }
};

/// Sweep A's scratch of one worker (Gh heads per item, nq query rows). Per head: the rescaled state S'^T [V][bk] (and the
/// g_gamma tangent R'), the decay products of its segment (runr [Vp] over value rows: g,
/// g_gamma, gv; runc [bk] over key columns: gk). Per head, a staged chunk: dO * scale, v,
/// k, q as given; dO'' = dO * Pr, v' = v / Pr, k' = k / Pc, q'' = q * Pc; the products; the
/// segment-start factors; one token's decays (er, ec) and the products before it (prevr,
/// prevc: the one-pass staging); starts; dq' of the head (and R dO), dq of the group, o' and its lane
/// partials. Then the running sums (double).
template <class Acc>
struct sweep_a_buffers {
  Acc *S, *Rt, *runr, *runc;
  Acc *dos, *vs, *do2, *v1, *cr, *fr1, *fr2;
  Acc *ks, *qs, *k1, *q2, *cc, *fc1, *fc2;
  Acc *er, *ec, *prevr, *prevc, *starts, *dqh, *dqg, *rqh, *oh, *opart;
  double* run;
  std::size_t bytes;
  sweep_a_buffers(Acc* base, std::int64_t W, std::int64_t Gh, std::int64_t nq, std::int64_t V, std::int64_t Vp,
                  std::int64_t bk, std::int64_t C, std::int64_t nr, bool row, bool col) {
    carver<Acc> take{base, W};
    const std::int64_t r = row ? 1 : 0, c = col ? 1 : 0;
    S = take(Gh * V * bk), Rt = take(nr * Gh * V * bk), runr = take(r * Gh * Vp), runc = take(c * Gh * bk);
    dos = take(Gh * C * Vp), vs = take(Gh * C * Vp);
    do2 = take(r * Gh * C * Vp), v1 = take(r * Gh * C * Vp), cr = take(r * Gh * C * Vp);
    fr1 = take(r * Gh * C * Vp), fr2 = take(r * Gh * C * Vp);
    ks = take(Gh * C * bk), qs = take(Gh * C * bk);
    k1 = take(c * Gh * C * bk), q2 = take(c * Gh * C * bk), cc = take(c * Gh * C * bk);
    fc1 = take(c * Gh * C * bk), fc2 = take(c * Gh * C * bk);
    er = take(Vp), ec = take(bk), prevr = take(r * Vp), prevc = take(c * bk), starts = take(Gh * round_up(C, W));
    dqh = take(C * bk), dqg = take(nq * C * bk), rqh = take(nr * C * bk), oh = take(C * Vp), opart = take(C * Vp * W);
    run = base ? reinterpret_cast<double*>(base + take.off) : nullptr;
    bytes = (sizeof(Acc) * take.off + sizeof(double) * std::size_t(Gh * (bk + V + 2)) + 63) / 64 * 64;
  }
};

/// Sizes and blockings of one call, shared by the kernel and backward_workspace_of.
template <class Acc>
struct backward_plan {
  std::int64_t W, K, V, Kp, Vp, C, Ga, Gb, bk, nkb, items_a, items_b, nk, nv, nr;
  std::int64_t Ma, Mb;  ///< head groups (of Ga, Gb heads) per work item of sweep A, B
  int threads_a, threads_b;
  bool want_k, want_v, want_s, want_gamma, need_o;
  std::size_t per_b, per_a, consts;

  backward_plan(const backward_problem& bp, const cfg& c) {
    const problem& p = bp.fwd;
    W = std::int64_t(xsimd::batch<Acc, arch>::size);
    K = p.K;
    V = p.V;
    Kp = round_up(K, W);
    Vp = round_up(V, W);
    C = std::max<std::int64_t>(1, c.chunk);
    Ga = p.H / p.Hq;
    Gb = lcm64(p.H / p.Hk, p.H / p.Hv);
    want_k = p.has(gate_gk) && bp.wants(bp.dgk);
    want_v = p.has(gate_gv) && bp.wants(bp.dgv);
    want_s = p.has(gate_g) && bp.wants(bp.dg);
    want_gamma = p.has(gate_g_gamma) && bp.wants(bp.dg_gamma);
    need_o = want_v;
    const int threads = std::max(1, c.threads);
    // Sweep A needs whole rows of S (sums over a) for o and the scalar gates.
    if (need_o || want_s || want_gamma) {
      bk = Kp;
    } else {
      // Whole rows unless there are too few items for the threads: a key block re-reads
      // the value-side inputs of its tokens.
      bk = Kp;
      while (bk > W && p.N * (p.H / Ga) * ((Kp + bk - 1) / bk) < 2 * threads) bk = round_up(bk / 2, W);
    }
    nkb = (Kp + bk - 1) / bk;
    nr = want_gamma ? 1 : 0;
    // Head groups per item, as in the forward (heads_per_item): the rows of one token for
    // consecutive heads are adjacent in memory and are staged together, as many heads as
    // keep their matrices within the forward's budget while every thread still gets an item.
    auto groups = [&](std::int64_t total, std::int64_t per_group_bytes, std::int64_t other) {
      std::int64_t best = 1;
      const std::int64_t min_items = std::min<std::int64_t>(threads, p.N * total * other);
      for (std::int64_t m = 2; m <= total; ++m)
        if (total % m == 0 && m * per_group_bytes <= std::int64_t(RECATTN_CPU_BWD_GROUP_BYTES) &&
            p.N * (total / m) * other >= min_items)
          best = m;
      return best;
    };
    Mb = groups(p.H / Gb, Gb * K * Vp * std::int64_t(sizeof(Acc)), 1);
    Ma = groups(p.H / Ga, (1 + nr) * Ga * V * bk * std::int64_t(sizeof(Acc)), nkb);
    items_b = p.N * (p.H / (Gb * Mb));
    items_a = p.N * (p.H / (Ga * Ma)) * nkb;
    threads_b = int(std::max<std::int64_t>(1, std::min<std::int64_t>(threads, items_b)));
    threads_a = int(std::max<std::int64_t>(1, std::min<std::int64_t>(threads, items_a)));
    nk = Gb / (p.H / p.Hk);
    nv = Gb / (p.H / p.Hv);
    const bool scalar = p.has(gate_g) || p.has(gate_g_gamma);
    per_b = sweep_b_buffers<Acc>(nullptr, W, Mb * Gb, K, V, Kp, Vp, C, Mb * nk, Mb * nv, scalar || p.has(gate_gk),
                                 p.has(gate_gv)).bytes;
    per_a = sweep_a_buffers<Acc>(nullptr, W, Ma * Ga, Ma, V, Vp, bk, C, nr, scalar || p.has(gate_gv),
                                 p.has(gate_gk)).bytes;
    consts = sizeof(double) * std::size_t(p.N * p.H * (K + V + 2));
  }
};

/// Calls body(l0, l1, start) for each segment [l0, l1) of a staged chunk of cl tokens:
/// a segment begins where starts[l] is set (and at 0); without decays one segment.
template <bool Decay, class Acc, class Body>
inline void for_each_segment(const Acc* starts, std::int64_t cl, Body&& body) {
  for (std::int64_t l0 = 0, l1; l0 < cl; l0 = l1) {
    l1 = l0 + 1;
    if constexpr (Decay)
      while (l1 < cl && starts[l1] == Acc(0)) ++l1;
    else
      l1 = cl;
    body(l0, l1, Decay && starts[l0] != Acc(0));
  }
}

/// Register-tile calls of one pass of for_each_tile over a [rows x cols_p] state.
template <class Acc, int R, int NV>
inline std::int64_t tile_count(std::int64_t rows, std::int64_t cols_p) {
  constexpr std::int64_t W = std::int64_t(xsimd::batch<Acc, arch>::size);
  return (rows / R + rows % R) * (cols_p / (NV * W) + cols_p % (NV * W) / W);
}

}  // namespace detail

/// Tokens staged at once by the backward when cfg.chunk is 0 (the heuristic): shorter than
/// the forward's, since a work item stages the rows of all its heads and both sweeps keep
/// more rows per token (measured on shape a, gk, 2 threads: see bench/README.md).
#ifndef RECATTN_CPU_BWD_CHUNK
#define RECATTN_CPU_BWD_CHUNK 16
#endif

/// The backward's cfg: the forward's resolution (cpu_resolve_cfg), with the backward's own
/// chunk where the caller left it to the heuristic.
inline cfg cpu_backward_resolve_cfg(const problem& /*p*/, const std::optional<cfg>& user, cfg resolved) {
  if (!user || user->chunk == 0) resolved.chunk = RECATTN_CPU_BWD_CHUNK;
  return resolved;
}

/// The backward pass for one compiled specialization. `bp` is checked; `c` resolved. Both
/// sweeps run the rescaled recurrence (see the top of the file): Pr, Pc below are a head's
/// current segment products over key rows and value columns.
template <class T, class Policy>
void backward_kernel(const backward_problem& bp, const cfg& c) {
  using Acc = accum_t<T>;
  namespace d = detail;
  const problem& p = bp.fwd;
  const d::backward_plan<Acc> plan(bp, c);
  const std::int64_t W = plan.W, K = plan.K, V = plan.V, Kp = plan.Kp, Vp = plan.Vp, C = plan.C;
  const std::int64_t Ga = plan.Ga, Gb = plan.Gb, bk = plan.bk;
  const std::int64_t gq = p.H / p.Hq, gkh = p.H / p.Hk, gvh = p.H / p.Hv;
  const std::int64_t nk = plan.nk, nv = plan.nv;
  const bool want_k = plan.want_k, want_v = plan.want_v, want_s = plan.want_s, want_gamma = plan.want_gamma;
  const bool want_any = want_k || want_v || want_s;
  constexpr int TR = RECATTN_CPU_BWD_TILE_ROWS, TV = RECATTN_CPU_BWD_TILE_REGS;
  constexpr int TRa = RECATTN_CPU_BWD_A_TILE_ROWS, TVa = RECATTN_CPU_BWD_A_TILE_REGS;
  // Decays of sweep B's adjoint rows (a) and columns (b), as in the forward; sweep A holds
  // S^T, so there the scalar gates fold into the rows (b) and gk decays the columns (a).
  constexpr bool b_row = Policy::decay_k, b_col = Policy::decay_v;
  constexpr bool a_row = Policy::has_g || Policy::has_g_gamma || Policy::has_gv, a_col = Policy::has_gk;
  constexpr bool b_decay = b_row || b_col, a_decay = a_row || a_col;
  const Acc scale = Acc(p.scale);
  const Acc lo = d::rescale_bound<Acc>::lo, hi = d::rescale_bound<Acc>::hi;

  // All scratch is taken before anything is written.
  // The sweeps run one after the other: one buffer serves both.
  d::aligned_buffer<Acc> scratch(std::max(plan.per_b / sizeof(Acc) * std::size_t(plan.threads_b),
                                          plan.per_a / sizeof(Acc) * std::size_t(plan.threads_a)) +
                                 1);
  std::vector<double> consts(std::size_t(p.N * p.H * (K + V + 2)), 0.0);
  const int max_threads = std::max(plan.threads_a, plan.threads_b);
  std::vector<d::prefetch_queue> queues(std::size_t(max_threads), d::prefetch_queue(std::size_t(7 * C)));

  // consts[(n * H + h)]: rowsum(dh0 .* h0) [K], colsum(dh0 .* h0) [V], sum(dh0 .* h0), each
  // plus sweep B's last rounding carry; then dg_gamma of (n, h).
  const std::int64_t cstride = K + V + 2;
  auto cst = [&](std::int64_t n, std::int64_t h) { return consts.data() + std::size_t((n * p.H + h) * cstride); };
  void* const dgk_out = want_k ? backward_problem::data(bp.dgk) : nullptr;
  void* const dgv_out = want_v ? backward_problem::data(bp.dgv) : nullptr;
  void* const dg_out = want_s ? backward_problem::data(bp.dg) : nullptr;

  const T* qd = static_cast<const T*>(p.q.data);
  const T* kd = static_cast<const T*>(p.k.data);
  const T* vd = static_cast<const T*>(p.v.data);
  const T* dod = static_cast<const T*>(bp.d_out.data);
  auto gate_row = [](const strided3& g, std::int64_t off) {
    return static_cast<const char*>(g.data) + std::size_t(off) * dtype_size(g.type);
  };
  auto gamma_of = [&](std::int64_t n, std::int64_t h) {
    if constexpr (Policy::has_g_gamma) return load_as<Acc>(p.g_gamma.data, p.g_gamma.type, p.g_gamma.offset(n, h, 0));
    else return Acc(0);
  };

  // ---- Sweep B: the adjoint, in reverse processing order. ----
  // An item is (sequence, Mb groups of Gb heads): the chunk's rows of all its heads are
  // staged together, tokens outer and heads inner (adjacent in memory), then each head's
  // adjoint runs over them. Chunk ci holds processing indices [i0, i0 + cl), staged in sweep
  // order: position u is processing index i0 + cl - 1 - u. The decay applied at position u
  // is that of the token processed just before (pendr, pendc: A_u = D_{u+1} .* dS_{u+1});
  // after the last one, d initial_state = D_0 .* dS_0.
  const std::int64_t Gbh = plan.Mb * Gb, nkg = plan.Mb * nk, nvg = plan.Mb * nv;
  parallel_for(plan.items_b, plan.threads_b, [&](std::int64_t item, int worker) {
    const std::int64_t hb = (item % (p.H / Gbh)) * Gbh;
    const std::int64_t n = item / (p.H / Gbh);
    const recattn::detail::seqlen_info<Policy::varlen> seq(p, n);
    const std::int64_t bidx = seq.batch, L = seq.len;
    const d::sweep_b_buffers<Acc> sb(scratch.get() + plan.per_b / sizeof(Acc) * std::size_t(worker), W, Gbh, K, V,
                                     Kp, Vp, C, nkg, nvg, b_row, b_col);
    d::prefetch_queue& pq = queues[std::size_t(worker)];
    double* run = sb.run;  // [Gbh][K + V + 1] rounding carries
    const std::int64_t rs = K + V + 1;
    const std::int64_t CK = C * Kp, CV = C * Vp, CS = d::round_up(C, W);
    for (std::int64_t i = 0; i < Gbh * rs; ++i) run[i] = 0.0;
    // The lane partials of dk in the padding rows [K, Kp), which no tile writes, are zero.
    for (std::int64_t u = 0; u < C; ++u) std::fill(sb.kpart + (u * Kp + K) * W, sb.kpart + (u + 1) * Kp * W, Acc(0));

    for (std::int64_t hl = 0; hl < Gbh; ++hl)
      d::load_state<Acc>(p, bp.d_ht, n, hb + hl, false, K, 0, V, sb.S + hl * K * Vp, Vp);
    if constexpr (b_row) std::fill_n(sb.runr, Gbh * Kp, Acc(1)), std::fill_n(sb.pendr, Gbh * Kp, Acc(1));
    if constexpr (b_col) std::fill_n(sb.runc, Gbh * Vp, Acc(1)), std::fill_n(sb.pendc, Gbh * Vp, Acc(1));
    const std::int64_t tiles = d::tile_count<Acc, TR, TV>(K, Vp);

    // Stages token t (sweep position u) of head hl.
    auto stage = [&](std::int64_t hl, std::int64_t u, std::int64_t t) {
      const std::int64_t h = hb + hl;
      Acc* qr = sb.qs + hl * CK + u * Kp;
      Acc* kr = sb.ks + hl * CK + u * Kp;
      d::convert_row<Acc>(qd + p.q.offset(bidx, t, h / gq), p.type, K, qr, scale);
      d::convert_row<Acc>(kd + p.k.offset(bidx, t, h / gkh), p.type, K, kr);
      for (std::int64_t a = K; a < Kp; ++a) qr[a] = kr[a] = Acc(0);
      Acc* vr = sb.vs + hl * CV + u * Vp;
      Acc* dr = sb.dos + hl * CV + u * Vp;
      d::convert_row<Acc>(vd + p.v.offset(bidx, t, h / gvh), p.type, V, vr);
      d::convert_row<Acc>(dod + bp.d_out.offset(bidx, t, h), p.type, V, dr);
      for (std::int64_t j = V; j < Vp; ++j) vr[j] = dr[j] = Acc(0);
      if constexpr (b_row) {
        Acc g0 = gamma_of(n, h);
        if constexpr (Policy::has_g) g0 += load_as<Acc>(p.g.data, p.g.type, p.g.offset(bidx, t, h));
        if constexpr (Policy::has_gk) {
          d::convert_row<Acc>(gate_row(p.gk, p.gk.offset(bidx, t, h)), p.gk.type, K, sb.dr);
          for (std::int64_t a = K; a < Kp; ++a) sb.dr[a] = Acc(0);
          d::exp_row(sb.dr, Kp, g0);
        } else {
          const Acc e = std::exp(g0);
          for (std::int64_t a = 0; a < K; ++a) sb.dr[a] = e;
        }
        for (std::int64_t a = K; a < Kp; ++a) sb.dr[a] = Acc(1);
      }
      if constexpr (b_col) {
        d::convert_row<Acc>(gate_row(p.gv, p.gv.offset(bidx, t, h)), p.gv.type, V, sb.dc);
        for (std::int64_t j = V; j < Vp; ++j) sb.dc[j] = Acc(0);
        d::exp_row(sb.dc, Vp, Acc(0));
        for (std::int64_t j = V; j < Vp; ++j) sb.dc[j] = Acc(1);
      }
      if constexpr (b_decay) {
        Acc* runr = sb.runr + hl * Kp;
        Acc* pendr = sb.pendr + hl * Kp;
        Acc* runc = sb.runc + hl * Vp;
        Acc* pendc = sb.pendc + hl * Vp;
        bool start = false;
        if constexpr (b_row) start = d::leaves_bound(runr, pendr, Kp, lo, hi);
        if constexpr (b_col) start = d::leaves_bound(runc, pendc, Vp, lo, hi) || start;
        sb.starts[hl * CS + u] = start ? Acc(1) : Acc(0);
        if constexpr (b_row) {
          const std::int64_t o = hl * CK + u * Kp;
          d::advance_run(runr, pendr, Kp, start, sb.fr1 + o, sb.fr2 + o);
          std::copy_n(sb.dr, Kp, pendr);
          std::copy_n(runr, Kp, sb.rr + o);
          d::scale_rows(runr, kr, sb.k2 + o, qr, sb.q1 + o, Kp);
        }
        if constexpr (b_col) {
          const std::int64_t o = hl * CV + u * Vp;
          d::advance_run(runc, pendc, Vp, start, sb.fc1 + o, sb.fc2 + o);
          std::copy_n(sb.dc, Vp, pendc);
          std::copy_n(runc, Vp, sb.rc + o);
          d::scale_rows(runc, vr, sb.v2 + o, dr, sb.do1 + o, Vp);
        }
      }
    };
    // `stage` in one pass per row for float inputs (and float gk) whose K and V are whole
    // registers, without gv: q, k, v, dO read in place with SIMD loads, the decay
    // exponentiated, the segment bound checked and the rescaling applied in the same pass,
    // assuming the token starts no segment; the rare token that does is redone. The
    // arithmetic is stage's, operation for operation (the forward's stage_group_float).
    const bool one_pass_b = d::one_pass_rows<T, Acc>(p, b_col, K == Kp && V == Vp);
    auto stage_one_pass = [&](std::int64_t hl, std::int64_t u, std::int64_t t, std::int64_t ta) {
      if constexpr (std::is_same_v<T, float> && std::is_same_v<Acc, float> && !b_col) {
        using B = xsimd::batch<Acc, arch>;
        const std::int64_t h = hb + hl;
        if (RECATTN_CPU_BWD_STAGE_AHEAD > 0 && ta >= 0) {
          d::prefetch_lines(qd + p.q.offset(bidx, ta, h / gq), K * 4);
          d::prefetch_lines(kd + p.k.offset(bidx, ta, h / gkh), K * 4);
          d::prefetch_lines(vd + p.v.offset(bidx, ta, h / gvh), V * 4);
          d::prefetch_lines(dod + bp.d_out.offset(bidx, ta, h), V * 4);
          if constexpr (Policy::has_gk) {
            d::prefetch_lines(static_cast<const float*>(p.gk.data) + p.gk.offset(bidx, ta, h), K * 4);
            // (the row of dgk that this sweep writes the token's gate term into)
            if (want_k) d::prefetch_lines(gate_row(bp.dgk, bp.dgk.offset(bidx, ta, h)), K * dtype_size(bp.dgk.type));
          }
        }
        const float* qsrc = qd + p.q.offset(bidx, t, h / gq);
        const float* ksrc = kd + p.k.offset(bidx, t, h / gkh);
        const float* vsrc = vd + p.v.offset(bidx, t, h / gvh);
        const float* dsrc = dod + bp.d_out.offset(bidx, t, h);
        Acc* qr = sb.qs + hl * CK + u * Kp;
        Acc* kr = sb.ks + hl * CK + u * Kp;
        Acc* vr = sb.vs + hl * CV + u * Vp;
        Acc* dr = sb.dos + hl * CV + u * Vp;
        for (std::int64_t j = 0; j < V; j += W) {
          B::load_unaligned(vsrc + j).store_aligned(vr + j);
          B::load_unaligned(dsrc + j).store_aligned(dr + j);
        }
        const B scaleb(scale);
        if constexpr (!b_row) {
          for (std::int64_t a = 0; a < K; a += W) {
            (B::load_unaligned(qsrc + a) * scaleb).store_aligned(qr + a);
            B::load_unaligned(ksrc + a).store_aligned(kr + a);
          }
        } else {
          Acc g0 = gamma_of(n, h);
          if constexpr (Policy::has_g) g0 += load_as<Acc>(p.g.data, p.g.type, p.g.offset(bidx, t, h));
          const B g0b(g0);
          B dconst(Acc(0));
          if constexpr (!Policy::has_gk) dconst = B(Acc(std::exp(g0)));
          const float* gsrc = nullptr;
          if constexpr (Policy::has_gk) gsrc = static_cast<const float*>(p.gk.data) + p.gk.offset(bidx, t, h);
          Acc* runr = sb.runr + hl * Kp;
          Acc* pendr = sb.pendr + hl * Kp;
          const std::int64_t o = hl * CK + u * Kp;
          const B lob(lo), hib(hi);
          auto bad = B(Acc(0)) != B(Acc(0));
          for (std::int64_t a = 0; a < K; a += W) {
            const B q = B::load_unaligned(qsrc + a) * scaleb, k = B::load_unaligned(ksrc + a);
            q.store_aligned(qr + a);
            k.store_aligned(kr + a);
            B dn = dconst;
            if constexpr (Policy::has_gk) dn = xsimd::exp(B::load_unaligned(gsrc + a) + g0b);
            const B r = B::load_aligned(runr + a), pd = B::load_aligned(pendr + a);
            const B x = r * pd;
            bad = bad | (x < lob) | (x > hib);
            r.store_aligned(sb.prev + a);
            pd.store_aligned(sb.dr + a);
            dn.store_aligned(pendr + a);
            x.store_aligned(runr + a);
            x.store_aligned(sb.rr + o + a);
            (k * x).store_aligned(sb.k2 + o + a);
            (q / x).store_aligned(sb.q1 + o + a);
          }
          const bool start = xsimd::any(bad);
          sb.starts[hl * CS + u] = start ? Acc(1) : Acc(0);
          if (start) {  // the pending decay goes to the true adjoint; the products restart at 1
            const B one(Acc(1));
            for (std::int64_t a = 0; a < K; a += W) {
              B::load_aligned(sb.prev + a).store_aligned(sb.fr1 + o + a);
              B::load_aligned(sb.dr + a).store_aligned(sb.fr2 + o + a);
              one.store_aligned(runr + a);
              one.store_aligned(sb.rr + o + a);
              (B::load_aligned(kr + a) * one).store_aligned(sb.k2 + o + a);
              (B::load_aligned(qr + a) / one).store_aligned(sb.q1 + o + a);
            }
          }
        }
      } else {
        (void)hl, (void)u, (void)t, (void)ta;
      }
    };
    // Queues the rows that chunk ci's staging reads, tensor by tensor so that the rows of
    // consecutive heads merge into one span.
    auto plan_prefetch = [&](std::int64_t ci) {
      pq.clear();
      if (ci < 0) return;
      const std::int64_t ni0 = ci * C, ncl = std::min(C, L - ni0);
      for (std::int64_t u = 0; u < ncl; ++u) {
        const std::int64_t t = seq.template token<Policy::reverse>(ni0 + ncl - 1 - u);
        for (std::int64_t h = hb; h < hb + Gbh; ++h) pq.add(qd + p.q.offset(bidx, t, h / gq), std::size_t(K) * sizeof(T));
        for (std::int64_t h = hb; h < hb + Gbh; ++h) pq.add(kd + p.k.offset(bidx, t, h / gkh), std::size_t(K) * sizeof(T));
        for (std::int64_t h = hb; h < hb + Gbh; ++h) pq.add(vd + p.v.offset(bidx, t, h / gvh), std::size_t(V) * sizeof(T));
        for (std::int64_t h = hb; h < hb + Gbh; ++h) pq.add(dod + bp.d_out.offset(bidx, t, h), std::size_t(V) * sizeof(T));
        if constexpr (Policy::has_gk)
          for (std::int64_t h = hb; h < hb + Gbh; ++h)
            pq.add(gate_row(p.gk, p.gk.offset(bidx, t, h)), std::size_t(K) * dtype_size(p.gk.type));
        if constexpr (Policy::has_gv)
          for (std::int64_t h = hb; h < hb + Gbh; ++h)
            pq.add(gate_row(p.gv, p.gv.offset(bidx, t, h)), std::size_t(V) * dtype_size(p.gv.type));
      }
    };

    const std::int64_t nchunks = (L + C - 1) / C;
    for (std::int64_t ci = nchunks - 1; ci >= 0; --ci) {
      const std::int64_t i0 = ci * C, cl = std::min(C, L - i0);
      std::fill_n(sb.dkg, nkg * C * Kp, Acc(0));
      std::fill_n(sb.dvg, nvg * C * Vp, Acc(0));
      for (std::int64_t u = 0; u < cl; ++u) {
        const std::int64_t t = seq.template token<Policy::reverse>(i0 + cl - 1 - u);
        const std::int64_t ia = i0 + cl - 1 - u - RECATTN_CPU_BWD_STAGE_AHEAD;
        const std::int64_t ta = ia >= 0 ? seq.template token<Policy::reverse>(ia) : -1;
        if (one_pass_b)
          for (std::int64_t hl = 0; hl < Gbh; ++hl) stage_one_pass(hl, u, t, ta);
        else
          for (std::int64_t hl = 0; hl < Gbh; ++hl) stage(hl, u, t);
      }
      // The next chunk's rows arrive while this one's adjoints run.
      if (RECATTN_CPU_BWD_PREFETCH) plan_prefetch(ci - 1);
      else pq.clear();
      const std::int64_t per_tile = (pq.lines / Gbh + tiles - 1) / tiles + 1;
      for (std::int64_t hl = 0; hl < Gbh; ++hl) {
        const std::int64_t h = hb + hl;
        const Acc* qt = (b_row ? sb.q1 : sb.qs) + hl * CK;
        const Acc* kt = (b_row ? sb.k2 : sb.ks) + hl * CK;
        const Acc* vt = (b_col ? sb.v2 : sb.vs) + hl * CV;
        const Acc* dt = (b_col ? sb.do1 : sb.dos) + hl * CV;
        std::fill_n(sb.dvh, cl * Vp, Acc(0));
        Acc* S = sb.S + hl * K * Vp;
        d::for_each_segment<b_decay>(sb.starts + hl * CS, cl, [&](std::int64_t u0, std::int64_t u1, bool start) {
          d::segment_factors<Acc> f;
          if (start) {
            if (b_row) f.r1 = sb.fr1 + hl * CK + u0 * Kp, f.r2 = sb.fr2 + hl * CK + u0 * Kp;
            if (b_col) f.c1 = sb.fc1 + hl * CV + u0 * Vp, f.c2 = sb.fc2 + hl * CV + u0 * Vp;
          }
          d::for_each_tile<Acc, TR, TV>(K, Vp, [&](auto r, auto nvr, std::int64_t a, std::int64_t j0) {
            pq.issue(per_tile);
            d::adjoint_tile<Acc, decltype(r)::value, decltype(nvr)::value>(
                u1 - u0, qt + u0 * Kp + a, kt + u0 * Kp + a, Kp, vt + u0 * Vp + j0, dt + u0 * Vp + j0, Vp,
                S + a * Vp + j0, Vp, sb.dvh + u0 * Vp + j0, sb.kpart + (u0 * Kp + a) * W, j0 == 0, f.at(a, j0));
          });
        });
        d::reduce_lanes(cl, Kp, sb.kpart, sb.dkh, Kp);
        if constexpr (b_row)
          for (std::int64_t u = 0; u < cl; ++u) d::mul_row(sb.dkh + u * Kp, sb.rr + hl * CK + u * Kp, Kp);
        if constexpr (b_col)
          for (std::int64_t u = 0; u < cl; ++u) d::mul_row(sb.dvh + u * Vp, sb.rc + hl * CV + u * Vp, Vp);

        // Per token: the gate terms k .* dk' and v .* dv' go to sweep A through the gate
        // gradients' own buffers; dk and dv get the token's own output term and are summed
        // over the group.
        double* cK = run + hl * rs;
        double* cV = cK + K;
        double* cS = cV + V;
        for (std::int64_t u = 0; u < cl; ++u) {
          const std::int64_t t = seq.template token<Policy::reverse>(i0 + cl - 1 - u);
          const Acc* qr = sb.qs + hl * CK + u * Kp;
          const Acc* kr = sb.ks + hl * CK + u * Kp;
          const Acc* vr = sb.vs + hl * CV + u * Vp;
          const Acc* dr = sb.dos + hl * CV + u * Vp;
          const Acc* dk = sb.dkh + u * Kp;
          const Acc* dv = sb.dvh + u * Vp;
          if constexpr (Policy::has_gk)
            if (want_k)
              d::with_gate_row(dgk_out, bp.dgk.type, bp.dgk.offset(bidx, t, h),
                               [&](auto* row) { d::feed_row(row, kr, dk, K, cK); });
          if constexpr (Policy::has_gv)
            if (want_v)
              d::with_gate_row(dgv_out, bp.dgv.type, bp.dgv.offset(bidx, t, h),
                               [&](auto* row) { d::feed_row(row, vr, dv, V, cV); });
          if (want_s) d::store_fed(dg_out, bp.dg.type, bp.dg.offset(bidx, t, h), d::dot_double(kr, dk, K), cS[0]);
          const Acc vdo = d::dot_padded(vr, dr, Vp), qk = d::dot_padded(qr, kr, Kp);
          Acc* gk = sb.dkg + (hl / gkh) * C * Kp + u * Kp;
          Acc* gv = sb.dvg + (hl / gvh) * C * Vp + u * Vp;
          for (std::int64_t a = 0; a < K; ++a) gk[a] += dk[a] + qr[a] * vdo;
          for (std::int64_t j = 0; j < V; ++j) gv[j] += dv[j] + dr[j] * qk;
        }
      }
      pq.issue_all();
      for (std::int64_t u = 0; u < cl; ++u) {
        const std::int64_t t = seq.template token<Policy::reverse>(i0 + cl - 1 - u);
        for (std::int64_t x = 0; x < nkg; ++x)
          d::store_row_stream(sb.dkg + x * C * Kp + u * Kp, K,
                       static_cast<T*>(backward_problem::data(bp.dk)) + bp.dk.offset(bidx, t, hb / gkh + x));
        for (std::int64_t x = 0; x < nvg; ++x)
          d::store_row_stream(sb.dvg + x * C * Vp + u * Vp, V,
                       static_cast<T*>(backward_problem::data(bp.dv)) + bp.dv.offset(bidx, t, hb / gvh + x));
      }
    }

    d::stream_fence();
    // d initial_state = D_0 .* dS_0 = D_0 .* P .* dS' (two plain multiplies, as the direct
    // recurrence would); the constants of sweep A's gate gradients.
    for (std::int64_t hl = 0; hl < Gbh; ++hl) {
      const std::int64_t h = hb + hl;
      Acc* S = sb.S + hl * K * Vp;
      if constexpr (b_decay) {
        d::unscale_state<Acc>(S, K, Vp, b_row ? sb.runr + hl * Kp : nullptr, b_col ? sb.runc + hl * Vp : nullptr);
        d::unscale_state<Acc>(S, K, Vp, b_row ? sb.pendr + hl * Kp : nullptr, b_col ? sb.pendc + hl * Vp : nullptr);
      }
      if (bp.dh0.data) {
        Acc* dst = static_cast<Acc*>(backward_problem::data(bp.dh0));
        for (std::int64_t a = 0; a < K; ++a)
          for (std::int64_t j = 0; j < V; ++j) dst[d::state_offset(p, bp.dh0, n, h, a, j)] = S[a * Vp + j];
      }
      if (!want_any) continue;
      double* cs = cst(n, h);
      const double* cK = run + hl * rs;
      double c0 = 0.0;
      for (std::int64_t x = 0; x < K + V; ++x) cs[x] = 0.0;
      if (p.h0.data) {
        const Acc* h0 = static_cast<const Acc*>(p.h0.data);
        for (std::int64_t a = 0; a < K; ++a)
          for (std::int64_t j = 0; j < V; ++j) {
            const double x = double(S[a * Vp + j]) * double(h0[d::state_offset(p, p.h0, n, h, a, j)]);
            cs[a] += x;
            cs[K + j] += x;
            c0 += x;
          }
      }
      for (std::int64_t x = 0; x < K + V; ++x) cs[x] += cK[x];
      cs[K + V] = c0 + cK[K + V];
    }
  });

  // ---- Sweep A: the state (as S^T), in processing order. ----
  // An item is (sequence, Ma groups of Ga heads, block of key columns), staged like sweep B's.
  const std::int64_t nkb = plan.nkb, Gah = plan.Ma * Ga;
  parallel_for(plan.items_a, plan.threads_a, [&](std::int64_t item, int worker) {
    const std::int64_t kb = item % nkb;
    const std::int64_t hg = (item / nkb) % (p.H / Gah);
    const std::int64_t n = item / (nkb * (p.H / Gah));
    const std::int64_t hb = hg * Gah;
    const std::int64_t a0 = kb * bk, w = std::min(bk, K - a0), wp = d::round_up(w, W);
    const recattn::detail::seqlen_info<Policy::varlen> seq(p, n);
    const std::int64_t bidx = seq.batch, L = seq.len;
    const std::int64_t nr = plan.nr;
    const d::sweep_a_buffers<Acc> sa(scratch.get() + plan.per_a / sizeof(Acc) * std::size_t(worker), W, Gah, plan.Ma,
                                     V, Vp, bk, C, nr, a_row, a_col);
    d::prefetch_queue& pq = queues[std::size_t(worker)];
    double* run = sa.run;  // [Gah][w + V + 2]
    const std::int64_t rs = bk + V + 2;
    const std::int64_t CV = C * Vp, CB = C * bk, CS = d::round_up(C, W);
    for (std::int64_t i = 0; i < Gah * rs; ++i) run[i] = 0.0;
    // Likewise the lane partials of o in the padding rows [V, Vp).
    if (plan.need_o)
      for (std::int64_t l = 0; l < C; ++l) std::fill(sa.opart + (l * Vp + V) * W, sa.opart + (l + 1) * Vp * W, Acc(0));
    for (std::int64_t hl = 0; hl < Gah; ++hl)
      d::load_state<Acc>(p, p.h0, n, hb + hl, true, V, a0, w, sa.S + hl * V * wp, wp);
    std::fill_n(sa.Rt, nr * Gah * V * bk, Acc(0));
    if constexpr (a_row) std::fill_n(sa.runr, Gah * Vp, Acc(1));
    if constexpr (a_col) std::fill_n(sa.runc, Gah * bk, Acc(1));

    // Stages token t (chunk position l) of head hl.
    auto stage = [&](std::int64_t hl, std::int64_t l, std::int64_t t) {
      const std::int64_t h = hb + hl;
      Acc* dr = sa.dos + hl * CV + l * Vp;
      Acc* vr = sa.vs + hl * CV + l * Vp;
      d::convert_row<Acc>(dod + bp.d_out.offset(bidx, t, h), p.type, V, dr, scale);
      d::convert_row<Acc>(vd + p.v.offset(bidx, t, h / gvh), p.type, V, vr);
      for (std::int64_t j = V; j < Vp; ++j) vr[j] = dr[j] = Acc(0);
      Acc* kr = sa.ks + hl * CB + l * wp;
      Acc* qr = sa.qs + hl * CB + l * wp;
      d::convert_row<Acc>(kd + p.k.offset(bidx, t, h / gkh) + a0, p.type, w, kr);
      d::convert_row<Acc>(qd + p.q.offset(bidx, t, h / gq) + a0, p.type, w, qr);
      for (std::int64_t j = w; j < wp; ++j) kr[j] = qr[j] = Acc(0);
      if constexpr (a_row) {
        Acc g0 = gamma_of(n, h);
        if constexpr (Policy::has_g) g0 += load_as<Acc>(p.g.data, p.g.type, p.g.offset(bidx, t, h));
        if constexpr (Policy::has_gv) {
          d::convert_row<Acc>(gate_row(p.gv, p.gv.offset(bidx, t, h)), p.gv.type, V, sa.er);
          for (std::int64_t j = V; j < Vp; ++j) sa.er[j] = Acc(0);
          d::exp_row(sa.er, Vp, g0);
        } else {
          const Acc e = std::exp(g0);
          for (std::int64_t j = 0; j < V; ++j) sa.er[j] = e;
        }
        for (std::int64_t j = V; j < Vp; ++j) sa.er[j] = Acc(1);
      }
      if constexpr (a_col) {
        d::convert_row<Acc>(gate_row(p.gk, p.gk.offset(bidx, t, h) + a0), p.gk.type, w, sa.ec);
        for (std::int64_t j = w; j < wp; ++j) sa.ec[j] = Acc(0);
        d::exp_row(sa.ec, wp, Acc(0));
        for (std::int64_t j = w; j < wp; ++j) sa.ec[j] = Acc(1);
      }
      if constexpr (a_decay) {
        Acc* runr = sa.runr + hl * Vp;
        Acc* runc = sa.runc + hl * bk;
        bool start = false;
        if constexpr (a_row) start = d::leaves_bound(runr, sa.er, Vp, lo, hi);
        if constexpr (a_col) start = d::leaves_bound(runc, sa.ec, wp, lo, hi) || start;
        sa.starts[hl * CS + l] = start ? Acc(1) : Acc(0);
        if constexpr (a_row) {
          const std::int64_t o = hl * CV + l * Vp;
          d::advance_run(runr, sa.er, Vp, start, sa.fr1 + o, sa.fr2 + o);
          std::copy_n(runr, Vp, sa.cr + o);
          d::scale_rows(runr, dr, sa.do2 + o, vr, sa.v1 + o, Vp);
        }
        if constexpr (a_col) {
          const std::int64_t o = hl * CB + l * wp;
          d::advance_run(runc, sa.ec, wp, start, sa.fc1 + o, sa.fc2 + o);
          std::copy_n(runc, wp, sa.cc + o);
          d::scale_rows(runc, qr, plan.need_o ? sa.q2 + o : nullptr, kr, sa.k1 + o, wp);
        }
      }
    };
    // `stage` in one pass per row, as sweep B's stage_one_pass (float inputs and gk, whole
    // registers, no gv).
    const bool one_pass_a = d::one_pass_rows<T, Acc>(p, Policy::has_gv, K == Kp && V == Vp);
    auto stage_one_pass = [&](std::int64_t hl, std::int64_t l, std::int64_t t, std::int64_t ta) {
      if constexpr (std::is_same_v<T, float> && std::is_same_v<Acc, float> && !Policy::has_gv) {
        using B = xsimd::batch<Acc, arch>;
        const std::int64_t h = hb + hl;
        if (RECATTN_CPU_BWD_STAGE_AHEAD > 0 && ta >= 0) {
          d::prefetch_lines(dod + bp.d_out.offset(bidx, ta, h), V * 4);
          d::prefetch_lines(vd + p.v.offset(bidx, ta, h / gvh), V * 4);
          d::prefetch_lines(kd + p.k.offset(bidx, ta, h / gkh) + a0, w * 4);
          d::prefetch_lines(qd + p.q.offset(bidx, ta, h / gq) + a0, w * 4);
          if constexpr (a_col) {
            d::prefetch_lines(static_cast<const float*>(p.gk.data) + p.gk.offset(bidx, ta, h) + a0, w * 4);
            // (sweep B's gate term, which this sweep reads and overwrites with dgk)
            if (want_k)
              d::prefetch_lines(gate_row(bp.dgk, bp.dgk.offset(bidx, ta, h) + a0), w * dtype_size(bp.dgk.type));
          }
        }
        const float* dsrc = dod + bp.d_out.offset(bidx, t, h);
        const float* vsrc = vd + p.v.offset(bidx, t, h / gvh);
        const float* ksrc = kd + p.k.offset(bidx, t, h / gkh) + a0;
        const float* qsrc = qd + p.q.offset(bidx, t, h / gq) + a0;
        Acc* dr = sa.dos + hl * CV + l * Vp;
        Acc* vr = sa.vs + hl * CV + l * Vp;
        Acc* kr = sa.ks + hl * CB + l * wp;
        Acc* qr = sa.qs + hl * CB + l * wp;
        const B scaleb(scale), lob(lo), hib(hi), one(Acc(1));
        auto bad = B(Acc(0)) != B(Acc(0));
        const std::int64_t orow = hl * CV + l * Vp, ocol = hl * CB + l * wp;
        Acc* runr = a_row ? sa.runr + hl * Vp : nullptr;
        Acc* runc = a_col ? sa.runc + hl * bk : nullptr;
        B e(Acc(0));
        if constexpr (a_row) {
          Acc g0 = gamma_of(n, h);
          if constexpr (Policy::has_g) g0 += load_as<Acc>(p.g.data, p.g.type, p.g.offset(bidx, t, h));
          e = B(Acc(std::exp(g0)));
        }
        for (std::int64_t j = 0; j < V; j += W) {
          const B dO = B::load_unaligned(dsrc + j) * scaleb, v = B::load_unaligned(vsrc + j);
          dO.store_aligned(dr + j);
          v.store_aligned(vr + j);
          if constexpr (a_row) {
            const B r = B::load_aligned(runr + j), x = r * e;
            bad = bad | (x < lob) | (x > hib);
            r.store_aligned(sa.prevr + j);
            x.store_aligned(runr + j);
            x.store_aligned(sa.cr + orow + j);
            (dO * x).store_aligned(sa.do2 + orow + j);
            (v / x).store_aligned(sa.v1 + orow + j);
          }
        }
        const float* gsrc = nullptr;
        if constexpr (a_col) gsrc = static_cast<const float*>(p.gk.data) + p.gk.offset(bidx, t, h) + a0;
        for (std::int64_t a = 0; a < w; a += W) {
          const B k = B::load_unaligned(ksrc + a), q = B::load_unaligned(qsrc + a);
          k.store_aligned(kr + a);
          q.store_aligned(qr + a);
          if constexpr (a_col) {
            const B ea = xsimd::exp(B::load_unaligned(gsrc + a) + B(Acc(0)));
            const B r = B::load_aligned(runc + a), x = r * ea;
            bad = bad | (x < lob) | (x > hib);
            r.store_aligned(sa.prevc + a);
            ea.store_aligned(sa.ec + a);
            x.store_aligned(runc + a);
            x.store_aligned(sa.cc + ocol + a);
            if (plan.need_o) (q * x).store_aligned(sa.q2 + ocol + a);
            (k / x).store_aligned(sa.k1 + ocol + a);
          }
        }
        if constexpr (a_decay) {
          const bool start = xsimd::any(bad);
          sa.starts[hl * CS + l] = start ? Acc(1) : Acc(0);
          if (start) {  // the token's decays go to the true state; the products restart at 1
            if constexpr (a_row)
              for (std::int64_t j = 0; j < V; j += W) {
                B::load_aligned(sa.prevr + j).store_aligned(sa.fr1 + orow + j);
                e.store_aligned(sa.fr2 + orow + j);
                one.store_aligned(runr + j);
                one.store_aligned(sa.cr + orow + j);
                (B::load_aligned(dr + j) * one).store_aligned(sa.do2 + orow + j);
                (B::load_aligned(vr + j) / one).store_aligned(sa.v1 + orow + j);
              }
            if constexpr (a_col)
              for (std::int64_t a = 0; a < w; a += W) {
                B::load_aligned(sa.prevc + a).store_aligned(sa.fc1 + ocol + a);
                B::load_aligned(sa.ec + a).store_aligned(sa.fc2 + ocol + a);
                one.store_aligned(runc + a);
                one.store_aligned(sa.cc + ocol + a);
                if (plan.need_o) (B::load_aligned(qr + a) * one).store_aligned(sa.q2 + ocol + a);
                (B::load_aligned(kr + a) / one).store_aligned(sa.k1 + ocol + a);
              }
          }
        }
      } else {
        (void)hl, (void)l, (void)t, (void)ta;
      }
    };
    // Queues the rows that the staging of the chunk at ni0 reads, tensor by tensor.
    auto plan_prefetch = [&](std::int64_t ni0) {
      pq.clear();
      for (std::int64_t l = 0; l < std::min(C, L - ni0); ++l) {
        const std::int64_t t = seq.template token<Policy::reverse>(ni0 + l);
        for (std::int64_t h = hb; h < hb + Gah; ++h) pq.add(dod + bp.d_out.offset(bidx, t, h), std::size_t(V) * sizeof(T));
        for (std::int64_t h = hb; h < hb + Gah; ++h) pq.add(vd + p.v.offset(bidx, t, h / gvh), std::size_t(V) * sizeof(T));
        for (std::int64_t h = hb; h < hb + Gah; ++h)
          pq.add(kd + p.k.offset(bidx, t, h / gkh) + a0, std::size_t(w) * sizeof(T));
        for (std::int64_t h = hb; h < hb + Gah; ++h)
          pq.add(qd + p.q.offset(bidx, t, h / gq) + a0, std::size_t(w) * sizeof(T));
        if constexpr (Policy::has_gk)
          for (std::int64_t h = hb; h < hb + Gah; ++h)
            pq.add(gate_row(p.gk, p.gk.offset(bidx, t, h) + a0), std::size_t(w) * dtype_size(p.gk.type));
        if constexpr (Policy::has_gv)
          for (std::int64_t h = hb; h < hb + Gah; ++h)
            pq.add(gate_row(p.gv, p.gv.offset(bidx, t, h)), std::size_t(V) * dtype_size(p.gv.type));
        if (want_k)
          for (std::int64_t h = hb; h < hb + Gah; ++h)
            pq.add(gate_row(bp.dgk, bp.dgk.offset(bidx, t, h) + a0), std::size_t(w) * dtype_size(bp.dgk.type));
      }
    };

    for (std::int64_t i0 = 0; i0 < L; i0 += C) {
      const std::int64_t cl = std::min(C, L - i0);
      std::fill_n(sa.dqg, plan.Ma * C * bk, Acc(0));
      for (std::int64_t l = 0; l < cl; ++l) {
        const std::int64_t t = seq.template token<Policy::reverse>(i0 + l);
        const std::int64_t ia = i0 + l + RECATTN_CPU_BWD_STAGE_AHEAD;
        const std::int64_t ta = ia < L ? seq.template token<Policy::reverse>(ia) : -1;
        if (one_pass_a)
          for (std::int64_t hl = 0; hl < Gah; ++hl) stage_one_pass(hl, l, t, ta);
        else
          for (std::int64_t hl = 0; hl < Gah; ++hl) stage(hl, l, t);
      }
      if (RECATTN_CPU_BWD_PREFETCH) plan_prefetch(i0 + C);
      else pq.clear();
      for (std::int64_t hl = 0; hl < Gah; ++hl) {
        const std::int64_t h = hb + hl;
        const Acc* dt = (a_row ? sa.do2 : sa.dos) + hl * CV;
        const Acc* vt = (a_row ? sa.v1 : sa.vs) + hl * CV;
        const Acc* kt = (a_col ? sa.k1 : sa.ks) + hl * CB;
        const Acc* qt = (a_col ? sa.q2 : sa.qs) + hl * CB;
        std::fill_n(sa.dqh, cl * wp, Acc(0));
        if (want_gamma) std::fill_n(sa.rqh, cl * wp, Acc(0));
        Acc* S = sa.S + hl * V * wp;
        Acc* Rt = sa.Rt + nr * hl * V * wp;
        auto sweep = [&](auto need_o, auto need_r) {
          constexpr bool NO = decltype(need_o)::value, NR = decltype(need_r)::value;
          // The tangent doubles the state registers: half as many columns per tile then.
          constexpr int NVt = NR && TVa > 1 ? TVa / 2 : TVa;
          const std::int64_t tiles = d::tile_count<Acc, TRa, NVt>(V, wp);
          const std::int64_t per_tile = (pq.lines / Gah + tiles - 1) / tiles + 1;
          d::for_each_segment<a_decay>(sa.starts + hl * CS, cl, [&](std::int64_t l0, std::int64_t l1, bool start) {
            d::segment_factors<Acc> f;
            if (start) {
              if (a_row) f.r1 = sa.fr1 + hl * CV + l0 * Vp, f.r2 = sa.fr2 + hl * CV + l0 * Vp;
              if (a_col) f.c1 = sa.fc1 + hl * CB + l0 * wp, f.c2 = sa.fc2 + hl * CB + l0 * wp;
            }
            d::for_each_tile<Acc, TRa, NVt>(V, wp, [&](auto r, auto nvr, std::int64_t b, std::int64_t j0) {
              pq.issue(per_tile);
              d::state_tile<Acc, NO, NR, decltype(r)::value, decltype(nvr)::value>(
                  l1 - l0, dt + l0 * Vp + b, vt + l0 * Vp + b, Vp, kt + l0 * wp + j0, qt + l0 * wp + j0, wp,
                  S + b * wp + j0, Rt + b * wp + j0, wp, sa.dqh + l0 * wp + j0, sa.rqh + l0 * wp + j0,
                  sa.opart + (l0 * Vp + b) * W, j0 == 0, f.at(b, j0));
            });
          });
          if constexpr (NO) d::reduce_lanes(cl, Vp, sa.opart, sa.oh, Vp);
        };
        auto sweep_o = [&](auto need_r) {
          if (plan.need_o) sweep(std::true_type{}, need_r);
          else sweep(std::false_type{}, need_r);
        };
        if constexpr (Policy::has_g_gamma) {
          if (want_gamma) sweep_o(std::true_type{});
          else sweep_o(std::false_type{});
        } else {
          sweep_o(std::false_type{});
        }
        if constexpr (a_col)
          for (std::int64_t l = 0; l < cl; ++l) {
            d::mul_row(sa.dqh + l * wp, sa.cc + hl * CB + l * wp, wp);
            if (want_gamma) d::mul_row(sa.rqh + l * wp, sa.cc + hl * CB + l * wp, wp);
          }
        if constexpr (a_row)
          if (plan.need_o)
            for (std::int64_t l = 0; l < cl; ++l) d::mul_row(sa.oh + l * Vp, sa.cr + hl * CV + l * Vp, Vp);

        // Per token: the final gate gradients (sweep B's stored terms, read before they are
        // overwritten, minus this sweep's, summed over the tokens before), the tangent's
        // share of dg_gamma, and dq with the token's own term, summed over the group.
        double* pK = run + hl * rs;
        double* pV = pK + bk;
        double* pS = pV + V;  // [0] running sum for dg, [1] dg_gamma
        const double* cs = cst(n, h);
        for (std::int64_t l = 0; l < cl; ++l) {
          const std::int64_t t = seq.template token<Policy::reverse>(i0 + l);
          const Acc* qr = sa.qs + hl * CB + l * wp;
          const Acc* kr = sa.ks + hl * CB + l * wp;
          const Acc* vr = sa.vs + hl * CV + l * Vp;
          const Acc* dr = sa.dos + hl * CV + l * Vp;
          const Acc* dq = sa.dqh + l * wp;
          if constexpr (Policy::has_gk)
            if (want_k)
              d::with_gate_row(dgk_out, bp.dgk.type, bp.dgk.offset(bidx, t, h) + a0,
                               [&](auto* row) { d::drain_row(row, cs + a0, pK, qr, dq, w); });
          if constexpr (Policy::has_gv)
            if (want_v)
              d::with_gate_row(dgv_out, bp.dgv.type, bp.dgv.offset(bidx, t, h),
                               [&](auto* row) { d::drain_row(row, cs + K, pV, sa.oh + l * Vp, dr, V); });
          if (want_s) {
            const std::int64_t off = bp.dg.offset(bidx, t, h);
            const double fed = load_as<double>(dg_out, bp.dg.type, off);
            store_as(dg_out, bp.dg.type, off, cs[K + V] + pS[0]);
            pS[0] += fed - d::dot_double(qr, dq, w);
          }
          if (want_gamma) pS[1] += d::dot_double(qr, sa.rqh + l * wp, w);
          const Acc vdo = d::dot_padded(vr, dr, Vp);
          Acc* g = sa.dqg + (hl / Ga) * C * bk + l * wp;
          for (std::int64_t a = 0; a < w; ++a) g[a] += dq[a] + kr[a] * vdo;
        }
      }
      pq.issue_all();
      for (std::int64_t l = 0; l < cl; ++l) {
        const std::int64_t t = seq.template token<Policy::reverse>(i0 + l);
        for (std::int64_t x = 0; x < plan.Ma; ++x)
          d::store_row_stream(sa.dqg + x * C * bk + l * wp, w,
                       static_cast<T*>(backward_problem::data(bp.dq)) + bp.dq.offset(bidx, t, hb / gq + x) + a0);
      }
    }
    d::stream_fence();
    if (want_gamma)
      for (std::int64_t hl = 0; hl < Gah; ++hl) {
        const std::int64_t h = hb + hl;
        // dg_gamma = sum_i scale q_i^T R_i dO_i + <d final_state, R_{L-1}> (bk = Kp here),
        // R_{L-1} = P .* R'.
        double g = run[hl * rs + bk + V + 1];
        if (bp.d_ht.data) {
          Acc* R = sa.Rt + hl * V * wp;
          if constexpr (a_decay)
            d::unscale_state<Acc>(R, V, wp, a_row ? sa.runr + hl * Vp : nullptr, a_col ? sa.runc + hl * bk : nullptr);
          const Acc* dht = static_cast<const Acc*>(bp.d_ht.data);
          for (std::int64_t b = 0; b < V; ++b)
            for (std::int64_t a = 0; a < w; ++a)
              g += double(R[b * wp + a]) * double(dht[d::state_offset(p, bp.d_ht, n, h, a0 + a, b)]);
        }
        cst(n, h)[K + V + 1] = g;
      }
  });

  if (want_gamma) {
    void* dst = backward_problem::data(bp.dg_gamma);
    for (std::int64_t h = 0; h < p.H; ++h) {
      if (bp.dg_gamma_summed) {
        double s = 0.0;
        for (std::int64_t n = 0; n < p.N; ++n) s += cst(n, h)[K + V + 1];
        store_as(dst, bp.dg_gamma.type, bp.dg_gamma.offset(0, h, 0), s);
      } else {
        for (std::int64_t n = 0; n < p.N; ++n)
          store_as(dst, bp.dg_gamma.type, bp.dg_gamma.offset(n, h, 0), cst(n, h)[K + V + 1]);
      }
    }
  }
}

/// The scratch one backward call takes (bytes), by the same plan as the kernel.
inline backward_workspace backward_workspace_of(const backward_problem& bp, const cfg& c) {
  auto of = [&](auto acc) {
    using Acc = decltype(acc);
    const detail::backward_plan<Acc> plan(bp, c);
    backward_workspace w;
    w.per_thread_b = plan.per_b;
    w.per_thread_a = plan.per_a;
    w.threads_b = plan.threads_b;
    w.threads_a = plan.threads_a;
    w.shared = plan.consts;
    return w;
  };
  return bp.fwd.type == dtype::float64 ? of(double{}) : of(float{});
}

}  // namespace recattn::cpu
