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
// term, writes the final value in its place. Nothing divides by a decay.
//
// Memory beyond inputs and outputs: per worker the K x V adjoint or state (and tangent) of
// each head of its item plus chunk buffers (about 0.5 MB for K = V = 128, chunk 32), and
// N * H * (K + V + 2) doubles, for every dtype: independent of T (backward_workspace_of
// reports it). Time: two sweeps of about one forward each (the adjoint sweep does one more
// multiply-add per state element). Storing a state checkpoint every C tokens would instead
// cost T / C * K * V per head, and a constant number of checkpoints (revolve) a factor of
// log T in time.
//
// Precision (float, T = 16384, every gate): dq, dk, dv ~8e-8; dgk, dgv, dg ~1e-5 (the
// remaining rounding of the primed terms, summed over the sequence, grows like
// eps * sqrt(T)); dg_gamma ~1e-7 to 1e-6. fla's fused_recurrent backward forms its gate
// gradients from the unprimed terms (and none for g_gamma).
//
// Work items: sweep B, (sequence, group of heads that share key or value rows) with the
// whole K x V adjoint of each head; sweep A, (sequence, group of heads sharing a query row,
// block of key columns). Within a chunk of staged tokens, register tiles of the state stay
// in registers (as in the forward kernel), and grouped heads sum into a float chunk buffer
// before one write, so bfloat16 outputs are rounded once.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include <xsimd/xsimd.hpp>

#include "../backward_problem.hpp"
#include "../cfg.hpp"
#include "../detail/seqlen.hpp"
#include "../dtype.hpp"
#include "../policy.hpp"
#include "parallel.hpp"
#include "recurrence.hpp"

// Register tile of the backward sweeps: state rows x SIMD registers kept in registers over a
// chunk. 4 x 4 measured fastest for K = V = 128 float on AVX-512 (backward 2.1-2.3x the
// forward, against 2.4-2.9x with 8 x 2).
#ifndef RECATTN_CPU_BWD_TILE_ROWS
#define RECATTN_CPU_BWD_TILE_ROWS 4
#endif
#ifndef RECATTN_CPU_BWD_TILE_REGS
#define RECATTN_CPU_BWD_TILE_REGS 4
#endif

namespace recattn::cpu {

namespace detail {

/// One chunk of the adjoint sweep for a register tile of R key rows x NV registers of value
/// columns of dS, in reverse token order. The tile holds A_l = D_{l+1} .* dS_{l+1} (the
/// adjoint without token l's own output) when token l is reached; adds the tile's share of
/// dv'_l = A_l^T k to dvp ([L][ldv]); stores (first column tile) or adds the tile's lane
/// partials of dk'_l = A_l v to kpart ([L][ldk][W]); then dS_l = A_l + q_l dO_l^T and
/// A_{l-1} = D_l .* dS_l. (dk = dk' + q (dO . v) and dv = dv' + dO (q . k) are completed per
/// token by the caller: the gate gradients need the primed terms, see the top of the file.)
template <class Acc, bool DecayRow, bool DecayCol, int R, int NV>
inline void adjoint_tile(std::int64_t L, const Acc* qs, const Acc* ks, const Acc* drs, std::int64_t ldk,
                         const Acc* vs, const Acc* dos, const Acc* dcs, std::int64_t ldv, Acc* S, std::int64_t lds,
                         Acc* dvp, Acc* kpart, bool first) {
  using B = xsimd::batch<Acc, arch>;
  constexpr std::int64_t W = std::int64_t(B::size);
  B s[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) s[i][j] = B::load_aligned(S + i * lds + j * W);
  for (std::int64_t l = L - 1; l >= 0; --l) {
    const Acc* qr = qs + l * ldk;
    const Acc* kr = ks + l * ldk;
    const Acc* dr = drs + l * ldk;
    B v[NV], d[NV], dc[NV], dva[NV];
    for (int j = 0; j < NV; ++j) {
      v[j] = B::load_aligned(vs + l * ldv + j * W);
      d[j] = B::load_aligned(dos + l * ldv + j * W);
      if constexpr (DecayCol) dc[j] = B::load_aligned(dcs + l * ldv + j * W);
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
      if constexpr (DecayRow) {
        const B db(dr[i]);
        for (int j = 0; j < NV; ++j) {
          if constexpr (DecayCol) s[i][j] = s[i][j] * (db * dc[j]);
          else s[i][j] = s[i][j] * db;
        }
      } else if constexpr (DecayCol) {
        for (int j = 0; j < NV; ++j) s[i][j] = s[i][j] * dc[j];
      }
      if (first) dka.store_aligned(kp + i * W);
      else (B::load_aligned(kp + i * W) + dka).store_aligned(kp + i * W);
    }
    for (int j = 0; j < NV; ++j) dva[j].store_aligned(dvp + l * ldv + j * W);
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) s[i][j].store_aligned(S + i * lds + j * W);
}

/// One chunk of the state sweep on S^T for a register tile of R value rows x NV registers of
/// key columns, in token order. At token l the tile first decays, D_l .* S_{l-1}, and reads
/// that (not S_l) for its shares of dq'_l = scale * (D_l .* S_{l-1}) dO (added to dqp,
/// [L][ldk]) and, with NeedO, the lane partials of o'_l = (D_l .* S_{l-1})^T q (stored or
/// added to opart, [L][ldv][W]); then S_l = D_l .* S_{l-1} + k v^T. (The caller adds token
/// l's own terms, dq = dq' + scale k (v . dO), o = o' + v (k . q).) With NeedR it also
/// carries the tangent R = dS / d g_gamma, R_l = D_l .* (R_{l-1} + S_{l-1}), in Rt ([R][lds])
/// and adds the tile's share of scale * R_l dO to rqp ([L][ldk]). dos is dO pre-multiplied
/// by the scale.
template <class Acc, bool DecayRow, bool DecayCol, bool NeedO, bool NeedR, int R, int NV>
inline void state_tile(std::int64_t L, const Acc* dos, const Acc* vs, const Acc* drs, std::int64_t ldv,
                       const Acc* ks, const Acc* qs, const Acc* dcs, std::int64_t ldk, Acc* S, Acc* Rt, std::int64_t lds,
                       Acc* dqp, Acc* rqp, Acc* opart, bool first) {
  using B = xsimd::batch<Acc, arch>;
  constexpr std::int64_t W = std::int64_t(B::size);
  B s[R][NV];
  B rt[NeedR ? R : 1][NeedR ? NV : 1];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) {
      s[i][j] = B::load_aligned(S + i * lds + j * W);
      if constexpr (NeedR) rt[i][j] = B::load_aligned(Rt + i * lds + j * W);
    }
  for (std::int64_t l = 0; l < L; ++l) {
    const Acc* vr = vs + l * ldv;
    const Acc* dr = dos + l * ldv;
    const Acc* er = drs + l * ldv;
    B k[NV], dc[NV], q[NV], dqa[NV], rqa[NeedR ? NV : 1];
    for (int j = 0; j < NV; ++j) {
      k[j] = B::load_aligned(ks + l * ldk + j * W);
      if constexpr (DecayCol) dc[j] = B::load_aligned(dcs + l * ldk + j * W);
      if constexpr (NeedO) q[j] = B::load_aligned(qs + l * ldk + j * W);
      dqa[j] = B::load_aligned(dqp + l * ldk + j * W);
      if constexpr (NeedR) rqa[j] = B::load_aligned(rqp + l * ldk + j * W);
    }
    Acc* op = opart + l * ldv * W;
    for (int i = 0; i < R; ++i) {
      const B vb(vr[i]), ob(dr[i]);
      B eb(Acc(1));
      if constexpr (DecayRow) eb = B(er[i]);
      B oa(Acc(0));
      for (int j = 0; j < NV; ++j) {
        B dec = s[i][j];  // D_l .* S_{l-1}
        if constexpr (DecayRow && DecayCol) dec = s[i][j] * (eb * dc[j]);
        else if constexpr (DecayRow) dec = s[i][j] * eb;
        else if constexpr (DecayCol) dec = s[i][j] * dc[j];
        if constexpr (NeedR) {
          if constexpr (DecayRow && DecayCol) rt[i][j] = xsimd::fma(rt[i][j], eb * dc[j], dec);
          else if constexpr (DecayRow) rt[i][j] = xsimd::fma(rt[i][j], eb, dec);
          else if constexpr (DecayCol) rt[i][j] = xsimd::fma(rt[i][j], dc[j], dec);
          else rt[i][j] = rt[i][j] + dec;
          rqa[j] = xsimd::fma(ob, rt[i][j], rqa[j]);
        }
        dqa[j] = xsimd::fma(ob, dec, dqa[j]);
        if constexpr (NeedO) oa = xsimd::fma(dec, q[j], oa);
        s[i][j] = xsimd::fma(vb, k[j], dec);
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

/// Horizontal sums of W registers at once (xsimd::haddp), in row order. xsimd 8.1's AVX-512
/// haddp returns the W sums permuted; the order is probed once and undone, and were the
/// probe ever to find something other than a permutation, plain per-row sums are used.
template <class Acc>
struct lane_sums {
  using B = xsimd::batch<Acc, arch>;
  static constexpr std::size_t W = B::size;
  std::array<int, W> where{};  ///< haddp's output lane of row r's sum
  bool permutation = true;

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
  }

  /// out[r] = sum of the lanes of part[r] for r in [0, W).
  void operator()(const Acc* part, Acc* out) const {
    if (permutation) {
      B rows[W];
      for (std::size_t r = 0; r < W; ++r) rows[r] = B::load_aligned(part + r * W);
      alignas(64) Acc h[W];
      xsimd::haddp(rows).store_aligned(h);
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

/// Asks for the n elements of size es at p to be brought into cache (the next chunk's rows,
/// while the current one is computed: the inputs are read at a stride of H rows).
inline void prefetch(const void* p, std::int64_t n, std::size_t es) {
#if defined(__GNUC__)
  const char* c = static_cast<const char*>(p);
  const std::int64_t bytes = n * std::int64_t(es);
  for (std::int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
#else
  (void)p; (void)n; (void)es;
#endif
}

inline std::int64_t lcm64(std::int64_t a, std::int64_t b) { return a / std::gcd(a, b) * b; }

}  // namespace detail

/// Scratch sizes of one backward call (bytes), for the memory figures of the benchmark.
struct backward_workspace {
  std::size_t per_thread_b = 0, per_thread_a = 0;  ///< sweep B, sweep A scratch of one worker
  int threads_b = 0, threads_a = 0;
  std::size_t shared = 0;  ///< per-(n, h) constants
  std::size_t total() const {
    return per_thread_b * std::size_t(threads_b) + per_thread_a * std::size_t(threads_a) + shared;
  }
};

namespace detail {

/// Sizes and blockings of one call, shared by the kernel and backward_workspace_of.
template <class Acc>
struct backward_plan {
  std::int64_t W, K, V, Kp, Vp, C, Ga, Gb, bk, nkb, items_a, items_b;
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
    items_b = p.N * (p.H / Gb);
    items_a = p.N * (p.H / Ga) * nkb;
    threads_b = int(std::max<std::int64_t>(1, std::min<std::int64_t>(threads, items_b)));
    threads_a = int(std::max<std::int64_t>(1, std::min<std::int64_t>(threads, items_a)));
    const std::int64_t nk = Gb / (p.H / p.Hk), nv = Gb / (p.H / p.Hv);
    // Sweep B: adjoints, staged chunk (q k dr / v dO dc), dk/dv of a head and of its groups,
    // dk lane partials; then the rounding carries of the gate terms (double).
    per_b = sizeof(Acc) * std::size_t(Gb * K * Vp + 3 * C * Kp + 3 * C * Vp + C * Kp + C * Vp + nk * C * Kp +
                                      nv * C * Vp + C * Kp * W) +
            sizeof(double) * std::size_t(Gb * (K + V + 1));
    // Sweep A: states S^T (and their g_gamma tangents), staged chunk (dO v dr / k q dc), dq
    // of a head (and the tangent's R dO), dq of the group, o and its lane partials; then
    // running sums.
    const std::int64_t nr = want_gamma ? 1 : 0;
    per_a = sizeof(Acc) * std::size_t((1 + nr) * Ga * V * bk + 3 * C * Vp + 3 * C * bk + (2 + nr) * C * bk + C * Vp +
                                      C * Vp * W) +
            sizeof(double) * std::size_t(Ga * (bk + V + 2));
    // Every worker's slice starts 64-byte aligned.
    per_b = (per_b + 63) / 64 * 64;
    per_a = (per_a + 63) / 64 * 64;
    consts = sizeof(double) * std::size_t(p.N * p.H * (K + V + 2));
  }
};

}  // namespace detail

/// The backward pass for one compiled specialization. `bp` is checked; `c` resolved.
template <class T, class Policy>
void backward_kernel(const backward_problem& bp, const cfg& c) {
  using Acc = accum_t<T>;
  namespace d = detail;
  const problem& p = bp.fwd;
  const d::backward_plan<Acc> plan(bp, c);
  const std::int64_t W = plan.W, K = plan.K, V = plan.V, Kp = plan.Kp, Vp = plan.Vp, C = plan.C;
  const std::int64_t Ga = plan.Ga, Gb = plan.Gb, bk = plan.bk;
  const std::int64_t gq = p.H / p.Hq, gkh = p.H / p.Hk, gvh = p.H / p.Hv;
  const std::int64_t nk = Gb / gkh, nv = Gb / gvh;
  const bool want_k = plan.want_k, want_v = plan.want_v, want_s = plan.want_s, want_gamma = plan.want_gamma;
  const bool want_any = want_k || want_v || want_s;
  constexpr int TR = RECATTN_CPU_BWD_TILE_ROWS, TV = RECATTN_CPU_BWD_TILE_REGS;
  // Decays of sweep B's adjoint rows (a) and columns (b), as in the forward; sweep A holds
  // S^T, so there the scalar gates fold into the rows (b) and gk decays the columns (a).
  constexpr bool b_row = Policy::decay_k, b_col = Policy::decay_v;
  constexpr bool a_row = Policy::has_g || Policy::has_g_gamma || Policy::has_gv, a_col = Policy::has_gk;
  const Acc scale = Acc(p.scale);

  // All scratch is taken before anything is written.
  d::aligned_buffer<Acc> scratch_b(plan.per_b / sizeof(Acc) * std::size_t(plan.threads_b) + 1);
  d::aligned_buffer<Acc> scratch_a(plan.per_a / sizeof(Acc) * std::size_t(plan.threads_a) + 1);
  std::vector<double> consts(std::size_t(p.N * p.H * (K + V + 2)), 0.0);
  // Sweep B's lane partials of dk must be zero in the padding rows [K, Kp).
  std::fill_n(scratch_b.get(), plan.per_b / sizeof(Acc) * std::size_t(plan.threads_b), Acc(0));
  std::fill_n(scratch_a.get(), plan.per_a / sizeof(Acc) * std::size_t(plan.threads_a), Acc(0));

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
  parallel_for(plan.items_b, plan.threads_b, [&](std::int64_t item, int worker) {
    const std::int64_t hb = (item % (p.H / Gb)) * Gb;
    const std::int64_t n = item / (p.H / Gb);
    const recattn::detail::seqlen_info<Policy::varlen> seq(p, n);
    const std::int64_t bidx = seq.batch, L = seq.len;
    Acc* base = scratch_b.get() + plan.per_b / sizeof(Acc) * std::size_t(worker);
    Acc* Sall = base;
    Acc* qs = Sall + Gb * K * Vp;
    Acc* ks = qs + C * Kp;
    Acc* drs = ks + C * Kp;
    Acc* vs = drs + C * Kp;
    Acc* dos = vs + C * Vp;
    Acc* dcs = dos + C * Vp;
    Acc* dkh = dcs + C * Vp;
    Acc* dvh = dkh + C * Kp;
    Acc* dkg = dvh + C * Vp;
    Acc* dvg = dkg + nk * C * Kp;
    Acc* kpart = dvg + nv * C * Vp;
    double* run = reinterpret_cast<double*>(kpart + C * Kp * W);  // [Gb][K + V + 1] rounding carries
    const std::int64_t rs = K + V + 1;
    for (std::int64_t i = 0; i < Gb * rs; ++i) run[i] = 0.0;

    for (std::int64_t hl = 0; hl < Gb; ++hl)
      d::load_state<Acc>(p, bp.d_ht, n, hb + hl, false, K, 0, V, Sall + hl * K * Vp, Vp);

    const std::int64_t nchunks = (L + C - 1) / C;
    for (std::int64_t ci = nchunks - 1; ci >= 0; --ci) {
      const std::int64_t i0 = ci * C, cl = std::min(C, L - i0);
      std::fill_n(dkg, nk * C * Kp, Acc(0));
      std::fill_n(dvg, nv * C * Vp, Acc(0));
      for (std::int64_t hl = 0; hl < Gb; ++hl) {
        const std::int64_t h = hb + hl;
        const Acc gamma = gamma_of(n, h);
        for (std::int64_t l = 0; l < cl; ++l) {
          const std::int64_t t = seq.template token<Policy::reverse>(i0 + l);
          d::convert_row<Acc>(qd + p.q.offset(bidx, t, h / gq), p.type, K, qs + l * Kp, scale);
          d::convert_row<Acc>(kd + p.k.offset(bidx, t, h / gkh), p.type, K, ks + l * Kp);
          for (std::int64_t a = K; a < Kp; ++a) qs[l * Kp + a] = ks[l * Kp + a] = Acc(0);
          if constexpr (b_row) {
            Acc* dr = drs + l * Kp;
            Acc g0 = gamma;
            if constexpr (Policy::has_g) g0 += load_as<Acc>(p.g.data, p.g.type, p.g.offset(bidx, t, h));
            if constexpr (Policy::has_gk) {
              d::convert_row<Acc>(gate_row(p.gk, p.gk.offset(bidx, t, h)), p.gk.type, K, dr);
              for (std::int64_t a = K; a < Kp; ++a) dr[a] = Acc(0);
              d::exp_row(dr, Kp, g0);
            } else {
              const Acc e = std::exp(g0);
              for (std::int64_t a = 0; a < Kp; ++a) dr[a] = e;
            }
          }
          Acc* vr = vs + l * Vp;
          Acc* dr = dos + l * Vp;
          d::convert_row<Acc>(vd + p.v.offset(bidx, t, h / gvh), p.type, V, vr);
          d::convert_row<Acc>(dod + bp.d_out.offset(bidx, t, h), p.type, V, dr);
          for (std::int64_t j = V; j < Vp; ++j) vr[j] = dr[j] = Acc(0);
          if constexpr (b_col) {
            Acc* er = dcs + l * Vp;
            d::convert_row<Acc>(gate_row(p.gv, p.gv.offset(bidx, t, h)), p.gv.type, V, er);
            for (std::int64_t j = V; j < Vp; ++j) er[j] = Acc(0);
            d::exp_row(er, Vp, Acc(0));
          }
        }
        if (ci > 0)
          for (std::int64_t l = 0; l < C; ++l) {
            const std::int64_t t = seq.template token<Policy::reverse>(i0 - C + l);
            d::prefetch(qd + p.q.offset(bidx, t, h / gq), K, sizeof(T));
            d::prefetch(kd + p.k.offset(bidx, t, h / gkh), K, sizeof(T));
            d::prefetch(vd + p.v.offset(bidx, t, h / gvh), V, sizeof(T));
            d::prefetch(dod + bp.d_out.offset(bidx, t, h), V, sizeof(T));
            if constexpr (Policy::has_gk) d::prefetch(gate_row(p.gk, p.gk.offset(bidx, t, h)), K, dtype_size(p.gk.type));
            if constexpr (Policy::has_gv) d::prefetch(gate_row(p.gv, p.gv.offset(bidx, t, h)), V, dtype_size(p.gv.type));
          }
        std::fill_n(dvh, cl * Vp, Acc(0));
        Acc* S = Sall + hl * K * Vp;
        d::for_each_tile<Acc, TR, TV>(K, Vp, [&](auto r, auto nvr, std::int64_t a, std::int64_t j0) {
          d::adjoint_tile<Acc, b_row, b_col, decltype(r)::value, decltype(nvr)::value>(
              cl, qs + a, ks + a, drs + a, Kp, vs + j0, dos + j0, dcs + j0, Vp, S + a * Vp + j0, Vp, dvh + j0,
              kpart + a * W, j0 == 0);
        });
        d::reduce_lanes(cl, Kp, kpart, dkh, Kp);

        // Per token: the gate terms k .* dk' and v .* dv' go to sweep A through the gate
        // gradients' own buffers; dk and dv get the token's own output term and are summed
        // over the group.
        double* cK = run + hl * rs;
        double* cV = cK + K;
        double* cS = cV + V;
        for (std::int64_t l = cl - 1; l >= 0; --l) {
          const std::int64_t t = seq.template token<Policy::reverse>(i0 + l);
          const Acc* qr = qs + l * Kp;
          const Acc* kr = ks + l * Kp;
          const Acc* vr = vs + l * Vp;
          const Acc* dr = dos + l * Vp;
          const Acc* dk = dkh + l * Kp;
          const Acc* dv = dvh + l * Vp;
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
          Acc* gk = dkg + (hl / gkh) * C * Kp + l * Kp;
          Acc* gv = dvg + (hl / gvh) * C * Vp + l * Vp;
          for (std::int64_t a = 0; a < K; ++a) gk[a] += dk[a] + qr[a] * vdo;
          for (std::int64_t j = 0; j < V; ++j) gv[j] += dv[j] + dr[j] * qk;
        }
      }
      for (std::int64_t l = 0; l < cl; ++l) {
        const std::int64_t t = seq.template token<Policy::reverse>(i0 + l);
        for (std::int64_t x = 0; x < nk; ++x)
          d::store_row(dkg + x * C * Kp + l * Kp, K,
                       static_cast<T*>(backward_problem::data(bp.dk)) + bp.dk.offset(bidx, t, hb / gkh + x));
        for (std::int64_t x = 0; x < nv; ++x)
          d::store_row(dvg + x * C * Vp + l * Vp, V,
                       static_cast<T*>(backward_problem::data(bp.dv)) + bp.dv.offset(bidx, t, hb / gvh + x));
      }
    }

    // d initial_state = the adjoint now; the constants of sweep A's gate gradients.
    for (std::int64_t hl = 0; hl < Gb; ++hl) {
      const std::int64_t h = hb + hl;
      const Acc* S = Sall + hl * K * Vp;
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
  const std::int64_t nkb = plan.nkb;
  parallel_for(plan.items_a, plan.threads_a, [&](std::int64_t item, int worker) {
    const std::int64_t kb = item % nkb;
    const std::int64_t hg = (item / nkb) % (p.H / Ga);
    const std::int64_t n = item / (nkb * (p.H / Ga));
    const std::int64_t hb = hg * Ga;
    const std::int64_t a0 = kb * bk, w = std::min(bk, K - a0), wp = d::round_up(w, W);
    const recattn::detail::seqlen_info<Policy::varlen> seq(p, n);
    const std::int64_t bidx = seq.batch, L = seq.len;
    const std::int64_t nr = want_gamma ? 1 : 0;
    Acc* base = scratch_a.get() + plan.per_a / sizeof(Acc) * std::size_t(worker);
    Acc* Sall = base;                      // [Ga][V][wp]
    Acc* Rall = Sall + Ga * V * bk;        // [Ga][V][wp] tangents d S^T / d g_gamma
    Acc* dos = Rall + nr * Ga * V * bk;
    Acc* vs = dos + C * Vp;
    Acc* drs = vs + C * Vp;
    Acc* ks = drs + C * Vp;
    Acc* qs = ks + C * bk;
    Acc* dcs = qs + C * bk;
    Acc* dqh = dcs + C * bk;
    Acc* dqg = dqh + C * bk;
    Acc* rqh = dqg + C * bk;
    Acc* oh = rqh + nr * C * bk;
    Acc* opart = oh + C * Vp;
    double* run = reinterpret_cast<double*>(opart + C * Vp * W);  // [Ga][w + V + 2]
    const std::int64_t rs = bk + V + 2;
    for (std::int64_t i = 0; i < Ga * rs; ++i) run[i] = 0.0;
    for (std::int64_t hl = 0; hl < Ga; ++hl)
      d::load_state<Acc>(p, p.h0, n, hb + hl, true, V, a0, w, Sall + hl * V * wp, wp);
    std::fill_n(Rall, nr * Ga * V * bk, Acc(0));

    for (std::int64_t i0 = 0; i0 < L; i0 += C) {
      const std::int64_t cl = std::min(C, L - i0);
      std::fill_n(dqg, cl * wp, Acc(0));
      for (std::int64_t hl = 0; hl < Ga; ++hl) {
        const std::int64_t h = hb + hl;
        const Acc gamma = gamma_of(n, h);
        for (std::int64_t l = 0; l < cl; ++l) {
          const std::int64_t t = seq.template token<Policy::reverse>(i0 + l);
          Acc* dr = dos + l * Vp;
          Acc* vr = vs + l * Vp;
          d::convert_row<Acc>(dod + bp.d_out.offset(bidx, t, h), p.type, V, dr, scale);
          d::convert_row<Acc>(vd + p.v.offset(bidx, t, h / gvh), p.type, V, vr);
          for (std::int64_t j = V; j < Vp; ++j) vr[j] = dr[j] = Acc(0);
          if constexpr (a_row) {
            Acc* er = drs + l * Vp;
            Acc g0 = gamma;
            if constexpr (Policy::has_g) g0 += load_as<Acc>(p.g.data, p.g.type, p.g.offset(bidx, t, h));
            if constexpr (Policy::has_gv) {
              d::convert_row<Acc>(gate_row(p.gv, p.gv.offset(bidx, t, h)), p.gv.type, V, er);
              for (std::int64_t j = V; j < Vp; ++j) er[j] = Acc(0);
              d::exp_row(er, Vp, g0);
            } else {
              const Acc e = std::exp(g0);
              for (std::int64_t j = 0; j < Vp; ++j) er[j] = e;
            }
          }
          Acc* kr = ks + l * wp;
          Acc* qr = qs + l * wp;
          d::convert_row<Acc>(kd + p.k.offset(bidx, t, h / gkh) + a0, p.type, w, kr);
          d::convert_row<Acc>(qd + p.q.offset(bidx, t, h / gq) + a0, p.type, w, qr);
          for (std::int64_t j = w; j < wp; ++j) kr[j] = qr[j] = Acc(0);
          if constexpr (a_col) {
            Acc* er = dcs + l * wp;
            d::convert_row<Acc>(gate_row(p.gk, p.gk.offset(bidx, t, h) + a0), p.gk.type, w, er);
            for (std::int64_t j = w; j < wp; ++j) er[j] = Acc(0);
            d::exp_row(er, wp, Acc(0));
          }
        }
        if (i0 + C < L)
          for (std::int64_t l = 0; l < std::min(C, L - i0 - C); ++l) {
            const std::int64_t t = seq.template token<Policy::reverse>(i0 + C + l);
            d::prefetch(dod + bp.d_out.offset(bidx, t, h), V, sizeof(T));
            d::prefetch(vd + p.v.offset(bidx, t, h / gvh), V, sizeof(T));
            d::prefetch(kd + p.k.offset(bidx, t, h / gkh) + a0, w, sizeof(T));
            d::prefetch(qd + p.q.offset(bidx, t, h / gq) + a0, w, sizeof(T));
            if constexpr (Policy::has_gk) d::prefetch(gate_row(p.gk, p.gk.offset(bidx, t, h) + a0), w, dtype_size(p.gk.type));
            if constexpr (Policy::has_gv) d::prefetch(gate_row(p.gv, p.gv.offset(bidx, t, h)), V, dtype_size(p.gv.type));
            if (want_k) d::prefetch(gate_row(bp.dgk, bp.dgk.offset(bidx, t, h) + a0), w, dtype_size(bp.dgk.type));
          }
        std::fill_n(dqh, cl * wp, Acc(0));
        if (want_gamma) std::fill_n(rqh, cl * wp, Acc(0));
        Acc* S = Sall + hl * V * wp;
        Acc* Rt = Rall + nr * hl * V * wp;
        auto sweep = [&](auto need_o, auto need_r) {
          constexpr bool NO = decltype(need_o)::value, NR = decltype(need_r)::value;
          // The tangent doubles the state registers: half as many columns per tile then.
          constexpr int NVt = NR && TV > 1 ? TV / 2 : TV;
          d::for_each_tile<Acc, TR, NVt>(V, wp, [&](auto r, auto nvr, std::int64_t b, std::int64_t j0) {
            d::state_tile<Acc, a_row, a_col, NO, NR, decltype(r)::value, decltype(nvr)::value>(
                cl, dos + b, vs + b, drs + b, Vp, ks + j0, qs + j0, dcs + j0, wp, S + b * wp + j0, Rt + b * wp + j0, wp,
                dqh + j0, rqh + j0, opart + b * W, j0 == 0);
          });
          if constexpr (NO) d::reduce_lanes(cl, Vp, opart, oh, Vp);
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

        // Per token: the final gate gradients (sweep B's stored terms, read before they are
        // overwritten, minus this sweep's, summed over the tokens before), the tangent's
        // share of dg_gamma, and dq with the token's own term, summed over the group.
        double* pK = run + hl * rs;
        double* pV = pK + bk;
        double* pS = pV + V;  // [0] running sum for dg, [1] dg_gamma
        const double* cs = cst(n, h);
        for (std::int64_t l = 0; l < cl; ++l) {
          const std::int64_t t = seq.template token<Policy::reverse>(i0 + l);
          const Acc* qr = qs + l * wp;
          const Acc* kr = ks + l * wp;
          const Acc* vr = vs + l * Vp;
          const Acc* dr = dos + l * Vp;
          const Acc* dq = dqh + l * wp;
          if constexpr (Policy::has_gk)
            if (want_k)
              d::with_gate_row(dgk_out, bp.dgk.type, bp.dgk.offset(bidx, t, h) + a0,
                               [&](auto* row) { d::drain_row(row, cs + a0, pK, qr, dq, w); });
          if constexpr (Policy::has_gv)
            if (want_v)
              d::with_gate_row(dgv_out, bp.dgv.type, bp.dgv.offset(bidx, t, h),
                               [&](auto* row) { d::drain_row(row, cs + K, pV, oh + l * Vp, dr, V); });
          if (want_s) {
            const std::int64_t off = bp.dg.offset(bidx, t, h);
            const double fed = load_as<double>(dg_out, bp.dg.type, off);
            store_as(dg_out, bp.dg.type, off, cs[K + V] + pS[0]);
            pS[0] += fed - d::dot_double(qr, dq, w);
          }
          if (want_gamma) pS[1] += d::dot_double(qr, rqh + l * wp, w);
          const Acc vdo = d::dot_padded(vr, dr, Vp);
          Acc* g = dqg + l * wp;
          for (std::int64_t a = 0; a < w; ++a) g[a] += dq[a] + kr[a] * vdo;
        }
      }
      for (std::int64_t l = 0; l < cl; ++l) {
        const std::int64_t t = seq.template token<Policy::reverse>(i0 + l);
        d::store_row(dqg + l * wp, w, static_cast<T*>(backward_problem::data(bp.dq)) + bp.dq.offset(bidx, t, hb / gq) + a0);
      }
    }
    if (want_gamma)
      for (std::int64_t hl = 0; hl < Ga; ++hl) {
        const std::int64_t h = hb + hl;
        // dg_gamma = sum_i scale q_i^T R_i dO_i + <d final_state, R_{L-1}> (bk = Kp here).
        double g = run[hl * rs + bk + V + 1];
        if (bp.d_ht.data) {
          const Acc* R = Rall + hl * V * wp;
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
