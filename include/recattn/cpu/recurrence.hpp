// The CPU forward kernel: one xsimd kernel for every gate policy, direction, layout, dtype
// and state layout (bench/README.md, "What the kernel does", has the measurements).
//
// Work item = (sequence n, G consecutive heads, block of value columns) (group_item; G the
// largest divisor of H whose states fit 512 KiB and that leaves one item per thread). An
// item keeps its heads' K x block_v state slices in aligned scratch and walks the tokens in
// chunks of cfg.chunk; for each head, `stage_group` (or, for float inputs whose K and value
// block are whole registers, the one-pass `stage_group_float`) converts the chunk's q, k, v
// to the accumulator type and exponentiates the gates, then `scan` runs the recurrence over
// it in register tiles (`scan_tile`, RECATTN_CPU_TILE_ROWS key rows x RECATTN_CPU_TILE_REGS
// registers of value columns), right after the staging so that the staged rows are in L1.
//
// Rescaled recurrence: within a segment the state is kept divided by the decay product since
// the segment began (per key row for g, g_gamma and gk, per value column for gv), so the
// scan is, for every gate set,
//
//   for a in [0, K):  s += k'[a] * v' ;  o += q'[a] * s        (two FMAs per element)
//
// with q' = q * R and k' = k / R (and v', o scaled for gv) done by the staging. A segment
// ends before the token that would take a product out of [e^-20, e^20]; that token's decay
// is applied to the true state as a plain multiply (segment_factors: a decay of 0 zeroes the
// state exactly). The next chunk's input and output rows are prefetched a few lines at a
// time inside the register tiles (prefetch_queue).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include <xsimd/xsimd.hpp>

#include "../cfg.hpp"
#include "../detail/seqlen.hpp"
#include "../dtype.hpp"
#include "../policy.hpp"
#include "../problem.hpp"
#include "parallel.hpp"
#include "reference.hpp"

namespace recattn::cpu {

#ifndef RECATTN_CPU_TILE_ROWS
#define RECATTN_CPU_TILE_ROWS 8
#endif
#ifndef RECATTN_CPU_TILE_REGS
#define RECATTN_CPU_TILE_REGS 2
#endif

/// The widest SIMD architecture the includer's compiler flags allow (xsimd::default_arch).
using arch = xsimd::default_arch;

namespace detail {

inline std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

/// Prefetches every 64-byte line that [p, p + bytes) touches, each once; `Write`: the lines will
/// be written (the decode step's state rows), else read (the backward's staged rows). A no-op
/// where the compiler has no prefetch builtin.
/// (The hint is chosen by `if constexpr` with literal arguments: GCC 12 drops a
/// __builtin_prefetch whose rw argument is a template-dependent expression, without a warning.)
template <bool Write = false>
inline void prefetch_lines(const void* p, std::int64_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  if (bytes <= 0) return;
  const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(p) & ~std::uintptr_t(63);
  const std::uintptr_t last = reinterpret_cast<std::uintptr_t>(p) + std::uintptr_t(bytes - 1);
  for (std::uintptr_t a = first; a <= last; a += 64) {
    if constexpr (Write) __builtin_prefetch(reinterpret_cast<const void*>(a), 1, 3);
    else __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 3);
  }
#else
  (void)p, (void)bytes;
#endif
}

template <class T>
struct aligned_buffer {
  struct deleter { void operator()(T* p) const { std::free(p); } };
  std::unique_ptr<T, deleter> ptr;
  explicit aligned_buffer(std::size_t n) {
    const std::size_t bytes = std::max<std::size_t>(64, (n * sizeof(T) + 63) / 64 * 64);
    ptr.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
    if (!ptr) throw std::bad_alloc();
  }
  T* get() const { return ptr.get(); }
};

/// dst[i] = mul * src[i] in Acc, for a row of a tensor of dtype `t`.
template <class Acc>
RECATTN_NOINLINE void convert_row(const void* src, dtype t, std::int64_t n, Acc* dst, Acc mul = Acc(1)) {
  switch (t) {
    case dtype::float32: { auto s = static_cast<const float*>(src); for (std::int64_t i = 0; i < n; ++i) dst[i] = mul * Acc(s[i]); return; }
    case dtype::float64: { auto s = static_cast<const double*>(src); for (std::int64_t i = 0; i < n; ++i) dst[i] = mul * Acc(s[i]); return; }
    case dtype::bfloat16: {
      auto s = static_cast<const std::uint16_t*>(src);
      for (std::int64_t i = 0; i < n; ++i) dst[i] = mul * Acc(recattn::detail::bits_float(std::uint32_t(s[i]) << 16));
      return;
    }
    case dtype::float16: { auto s = static_cast<const half*>(src); for (std::int64_t i = 0; i < n; ++i) dst[i] = mul * Acc(float(s[i])); return; }
    default: return;
  }
}

/// x[i] = exp(x[i] + add) over a padded row (n a multiple of the batch size).
template <class Acc>
RECATTN_NOINLINE void exp_row(Acc* x, std::int64_t n, Acc add) {
  using B = xsimd::batch<Acc, arch>;
  const B addb(add);
  for (std::int64_t i = 0; i < n; i += std::int64_t(B::size)) xsimd::exp(B::load_aligned(x + i) + addb).store_aligned(x + i);
}

template <class T, class Acc>
RECATTN_NOINLINE void store_row(const Acc* src, std::int64_t n, T* dst) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = convert<T>(src[i]);
}

/// One register of the state update s = D .* s + a * b, with D = row_decay * col_decay and
/// an absent decay costing nothing: the update of every CPU kernel, forward and backward.
template <bool DecayRow, bool DecayCol, class B>
inline B decayed_update(const B& s, const B& row_decay, const B& col_decay, const B& a, const B& b) {
  if constexpr (DecayRow && DecayCol) return xsimd::fma(s, row_decay * col_decay, a * b);
  else if constexpr (DecayRow) return xsimd::fma(s, row_decay, a * b);
  else if constexpr (DecayCol) return xsimd::fma(s, col_decay, a * b);
  else return xsimd::fma(a, b, s);
}

/// Factors a segment start applies to the state before its first token: the previous
/// segment's decay products (r1 per key row, c1 per value column) bring the rescaled state
/// back to the true state, then the start token's own decays (r2, c2) are applied as plain
/// multiplies, exactly as the direct recurrence does (a decay of 0 zeroes the state). A null
/// pointer is a factor that is absent (no such gate); all null: no segment start.
template <class Acc>
struct segment_factors {
  const Acc *r1 = nullptr, *r2 = nullptr, *c1 = nullptr, *c2 = nullptr;
  segment_factors at(std::int64_t row, std::int64_t col) const {
    return {r1 ? r1 + row : nullptr, r2 ? r2 + row : nullptr, c1 ? c1 + col : nullptr, c2 ? c2 + col : nullptr};
  }
};

/// Tokens of a register tile between two calls of the scan's prefetch (a few lines each):
/// spread thin, the prefetches do not fill the core's miss buffers in bursts.
#ifndef RECATTN_CPU_PREFETCH_EVERY
#define RECATTN_CPU_PREFETCH_EVERY 8
#endif
/// Elements left between a worker's scratch buffers (one cache line of floats).
#ifndef RECATTN_CPU_SKEW
#define RECATTN_CPU_SKEW std::int64_t(xsimd::batch<Acc, arch>::size)
#endif
/// 1: each head's chunk is staged right before its scan (the staged rows stay in L1);
/// 0: the whole head group's chunk is staged first (the kernel before 2026-12-04).
#ifndef RECATTN_CPU_STAGE_PER_HEAD
#define RECATTN_CPU_STAGE_PER_HEAD 1
#endif

/// The recurrence over L staged tokens for one register tile, in the rescaled form
/// (see stage_group): per state element s += k' v' and o += q' s, two FMAs, for every gate
/// policy. R key rows x NV SIMD registers of value columns of the state stay in registers
/// for the whole segment. Each row tile adds its rows' share of q' . S into the partial
/// outputs `os` ([L][ldv]), in P independent sums so the FMA chain per output register is
/// R / P long rather than R. The first row tile (First) starts the sums at zero instead of
/// reading os; the last (Last) writes the finished outputs to orows[l] + ocol instead of os.
/// `prefetch()` is called every RECATTN_CPU_PREFETCH_EVERY tokens (see prefetch_queue).
/// qs, ks: [L][ldk] at the tile's first row; vs: [L][ldv] at its first column; S: [R][lds].
template <class Acc, int R, int NV, bool First, bool Last, class Prefetch>
inline void scan_tile(std::int64_t L, const Acc* qs, const Acc* ks, std::int64_t ldk, const Acc* vs, std::int64_t ldv,
                      Acc* S, std::int64_t lds, Acc* os, const segment_factors<Acc>& f, Acc* const* orows,
                      std::int64_t ocol, Prefetch& prefetch) {
  using B = xsimd::batch<Acc, arch>;
  constexpr std::int64_t W = std::int64_t(B::size);
  constexpr int P = R >= 4 ? 2 : 1;
  B s[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) s[i][j] = B::load_aligned(S + i * lds + j * W);
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
  for (std::int64_t l = 0; l < L; ++l) {
    if (l % RECATTN_CPU_PREFETCH_EVERY == 0) prefetch();
    const Acc* qr = qs + l * ldk;
    const Acc* kr = ks + l * ldk;
    B v[NV], acc[P][NV];
    for (int j = 0; j < NV; ++j) {
      v[j] = B::load_aligned(vs + l * ldv + j * W);
      if constexpr (First) acc[0][j] = B(Acc(0));
      else acc[0][j] = B::load_aligned(os + l * ldv + j * W);
      for (int p = 1; p < P; ++p) acc[p][j] = B(Acc(0));
    }
    for (int i = 0; i < R; ++i) {
      const B kb(kr[i]);
      const B qb(qr[i]);
      for (int j = 0; j < NV; ++j) s[i][j] = xsimd::fma(kb, v[j], s[i][j]);
      for (int j = 0; j < NV; ++j) acc[i % P][j] = xsimd::fma(qb, s[i][j], acc[i % P][j]);
    }
    for (int j = 0; j < NV; ++j) {
      B o = acc[0][j];
      for (int p = 1; p < P; ++p) o += acc[p][j];
      if constexpr (Last) o.store_unaligned(orows[l] + ocol + j * W);
      else o.store_aligned(os + l * ldv + j * W);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) s[i][j].store_aligned(S + i * lds + j * W);
}

/// Register tile sizes: RT key rows x NVT registers of value columns.
template <class Acc> struct tile_shape {
  static constexpr int rows = RECATTN_CPU_TILE_ROWS;
  static constexpr int regs = RECATTN_CPU_TILE_REGS;
};

/// The recurrence over L staged tokens of one segment for one head's whole state slice
/// S [K][ldv]: column tiles of NV registers, row tiles of R rows (remainders one row / one
/// register at a time). `f` applies at the segment's start (all null: none).
/// `prefetch()` issues a few of the next chunk's lines (see scan_tile). `orows` (may be
/// null): the tokens' output rows (Acc outputs), which the last row tile writes directly.
template <class Acc, class Prefetch>
inline void scan(std::int64_t L, std::int64_t K, const Acc* qs, const Acc* ks, std::int64_t ldk, const Acc* vs,
                 std::int64_t ldv, Acc* S, Acc* os, const segment_factors<Acc>& f, Prefetch&& prefetch,
                 Acc* const* orows = nullptr) {
  constexpr std::int64_t W = std::int64_t(xsimd::batch<Acc, arch>::size);
  constexpr int R = tile_shape<Acc>::rows, NV = tile_shape<Acc>::regs;
  // The first row tile starts the outputs' sums at zero, the others add to the partial
  // outputs os; with `orows`, the last row tile writes the finished outputs to orows[l] (at
  // the tile's first column) instead of os.
  auto tile = [&](auto r, auto nv, std::int64_t a, std::int64_t j0) {
    constexpr int Rc = decltype(r)::value, NVc = decltype(nv)::value;
    const Acc* qa = qs + a;
    const Acc* ka = ks + a;
    const Acc* vj = vs + j0;
    Acc* Sa = S + a * ldv + j0;
    Acc* oj = os + j0;
    const segment_factors<Acc> fa = f.at(a, j0);
    const bool first = a == 0, last = orows && a + Rc == K;
    if (first && last) scan_tile<Acc, Rc, NVc, true, true>(L, qa, ka, ldk, vj, ldv, Sa, ldv, oj, fa, orows, j0, prefetch);
    else if (first) scan_tile<Acc, Rc, NVc, true, false>(L, qa, ka, ldk, vj, ldv, Sa, ldv, oj, fa, nullptr, 0, prefetch);
    else if (last) scan_tile<Acc, Rc, NVc, false, true>(L, qa, ka, ldk, vj, ldv, Sa, ldv, oj, fa, orows, j0, prefetch);
    else scan_tile<Acc, Rc, NVc, false, false>(L, qa, ka, ldk, vj, ldv, Sa, ldv, oj, fa, nullptr, 0, prefetch);
  };
  auto rows = [&](auto nv, std::int64_t j0) {
    std::int64_t a = 0;
    for (; a + R <= K; a += R) tile(std::integral_constant<int, R>{}, nv, a, j0);
    for (; a < K; ++a) tile(std::integral_constant<int, 1>{}, nv, a, j0);
  };
  std::int64_t j0 = 0;
  for (; j0 + NV * W <= ldv; j0 += NV * W) rows(std::integral_constant<int, NV>{}, j0);
  for (; j0 < ldv; j0 += W) rows(std::integral_constant<int, 1>{}, j0);
}

/// Whether any run[i] * d[i] leaves [lo, hi] (NaN stays in: it propagates either way).
template <class Acc>
RECATTN_NOINLINE bool leaves_bound(const Acc* run, const Acc* d, std::int64_t n, Acc lo, Acc hi) {
  using B = xsimd::batch<Acc, arch>;
  const B lob(lo), hib(hi);
  auto bad = B(Acc(0)) != B(Acc(0));
  for (std::int64_t i = 0; i < n; i += std::int64_t(B::size)) {
    const B x = B::load_aligned(run + i) * B::load_aligned(d + i);
    bad = bad | (x < lob) | (x > hib);
  }
  return xsimd::any(bad);
}

/// Advances a segment's decay products by one token's decays d: run *= d, or, at a
/// segment start, saves run (f1) and d (f2) for the state and restarts run at 1.
template <class Acc>
RECATTN_NOINLINE void advance_run(Acc* run, const Acc* d, std::int64_t n, bool start, Acc* f1, Acc* f2) {
  using B = xsimd::batch<Acc, arch>;
  for (std::int64_t i = 0; i < n; i += std::int64_t(B::size)) {
    const B r = B::load_aligned(run + i), x = B::load_aligned(d + i);
    if (start) {
      r.store_aligned(f1 + i);
      x.store_aligned(f2 + i);
      B(Acc(1)).store_aligned(run + i);
    } else {
      (r * x).store_aligned(run + i);
    }
  }
}

/// up[i] *= run[i] and down[i] /= run[i] (either may be null).
template <class Acc>
RECATTN_NOINLINE void rescale_rows(Acc* up, Acc* down, const Acc* run, std::int64_t n) {
  using B = xsimd::batch<Acc, arch>;
  for (std::int64_t i = 0; i < n; i += std::int64_t(B::size)) {
    const B r = B::load_aligned(run + i);
    if (up) (B::load_aligned(up + i) * r).store_aligned(up + i);
    if (down) (B::load_aligned(down + i) / r).store_aligned(down + i);
  }
}

/// S[a][j] *= row[a] * col[j] (either may be null): the rescaled state back to the true one.
template <class Acc>
RECATTN_NOINLINE void unscale_state(Acc* S, std::int64_t K, std::int64_t ld, const Acc* row, const Acc* col) {
  using B = xsimd::batch<Acc, arch>;
  for (std::int64_t a = 0; a < K; ++a)
    for (std::int64_t j = 0; j < ld; j += std::int64_t(B::size)) {
      B s = B::load_aligned(S + a * ld + j);
      if (row) s *= B(row[a]);
      if (col) s *= B::load_aligned(col + j);
      s.store_aligned(S + a * ld + j);
    }
}

}  // namespace detail

/// Columns of V per SIMD register for input type T.
template <class T>
constexpr int simd_width() { return int(xsimd::batch<accum_t<T>, arch>::size); }

#ifndef RECATTN_CPU_CHUNK
#define RECATTN_CPU_CHUNK 32
#endif

/// Heuristic CPU configuration: enough work items for every thread, tiles that keep the
/// state slice in L1.
inline cfg cpu_heuristic_cfg(const problem& p) {
  cfg c;
  c.threads = hardware_threads();
  const int W = p.type == dtype::float64 ? int(xsimd::batch<double, arch>::size) : int(xsimd::batch<float, arch>::size);
  const std::int64_t Vp = detail::round_up(p.V, W);
  std::int64_t bv = std::min<std::int64_t>(Vp, 8 * W);
  // Split the value columns further while there are fewer than 2 items per thread.
  while (bv > W && p.N * p.H * ((Vp + bv - 1) / bv) < 2 * c.threads) bv = detail::round_up(bv / 2, W);
  c.block_v = int(bv);
  c.chunk = RECATTN_CPU_CHUNK;
  return c;
}

/// The largest cfg.chunk the CPU forward and backward take.
inline constexpr int cpu_max_chunk = 4096;

/// Fills zero fields of `c` from the heuristic and checks the rest.
inline cfg cpu_resolve_cfg(const problem& p, const std::optional<cfg>& user) {
  cfg h = cpu_heuristic_cfg(p);
  if (!user) return h;
  cfg c = *user;
  if (c.algo == algorithm::chunked)
    recattn::detail::fail("cfg.algorithm", "automatic or recurrent on platform cpu (the chunked algorithm is CUDA only)",
                          algorithm_name(c.algo));
  if (c.threads < 0) recattn::detail::fail("cfg.threads", "a value >= 0 (0: all hardware threads)", c.threads);
  if (c.block_v < 0) recattn::detail::fail("cfg.block_v", "a value >= 0 (0: heuristic)", c.block_v);
  if (c.chunk < 0) recattn::detail::fail("cfg.chunk", "a value >= 0 (0: heuristic)", c.chunk);
  // Scratch grows with chunk (about 8 (K + V) floats per staged token and thread): without a
  // bound a large value is a std::bad_alloc, not a recattn::Error.
  if (c.chunk > cpu_max_chunk)
    recattn::detail::fail("cfg.chunk", recattn::detail::cat("a value <= ", cpu_max_chunk, " (tokens staged at once)"), c.chunk);
  if (c.threads == 0) c.threads = h.threads;
  if (c.block_v == 0) c.block_v = h.block_v;
  if (c.chunk == 0) c.chunk = h.chunk;
  return c;
}

/// Candidate CPU configurations an autotuner times.
inline std::vector<cfg> cpu_candidate_cfgs(const problem& p) {
  std::vector<cfg> out;
  const cfg h = cpu_heuristic_cfg(p);
  const int W = p.type == dtype::float64 ? int(xsimd::batch<double, arch>::size) : int(xsimd::batch<float, arch>::size);
  const std::int64_t Vp = detail::round_up(p.V, W);
  out.push_back(h);
  for (std::int64_t bv : {std::int64_t(W), std::int64_t(2 * W), std::int64_t(4 * W), std::int64_t(8 * W), Vp})
    for (int chunk : {16, 32, 64}) {
      if (bv > Vp) continue;
      cfg c = h;
      c.block_v = int(bv);
      c.chunk = chunk;
      if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
    }
  return out;
}

namespace detail {

/// One work item of the forward: sequence n, heads [h0, h0 + G), value columns [b0, b0 + w)
/// padded to wp.
struct group_item {
  std::int64_t n, h0, G, b0, w, wp, batch;
};

/// S[a][j] = state[n, h][a][b0 + j] (zero padded to wp columns), in either layout.
template <state_layout Layout, class Acc>
RECATTN_NOINLINE void load_state(const problem& p, const group_item& it, std::int64_t h, Acc* S) {
  for (std::int64_t a = 0; a < p.K; ++a) {
    Acc* row = S + a * it.wp;
    for (std::int64_t j = 0; j < it.wp; ++j) row[j] = Acc(0);
    if (!p.h0.data) continue;
    const Acc* src = static_cast<const Acc*>(p.h0.data);
    if constexpr (Layout == state_layout::kv) {
      const Acc* s = src + p.h0.offset(it.n, h, a) + it.b0;
      for (std::int64_t j = 0; j < it.w; ++j) row[j] = s[j];
    } else {
      for (std::int64_t j = 0; j < it.w; ++j) row[j] = src[p.h0.offset(it.n, h, it.b0 + j) + a];
    }
  }
}

template <state_layout Layout, class Acc>
RECATTN_NOINLINE void store_state(const problem& p, const group_item& it, std::int64_t h, const Acc* S) {
  Acc* dst = static_cast<Acc*>(p.ht_data());
  for (std::int64_t a = 0; a < p.K; ++a) {
    const Acc* row = S + a * it.wp;
    if constexpr (Layout == state_layout::kv) {
      Acc* d = dst + p.ht.offset(it.n, h, a) + it.b0;
      for (std::int64_t j = 0; j < it.w; ++j) d[j] = row[j];
    } else {
      for (std::int64_t j = 0; j < it.w; ++j) dst[p.ht.offset(it.n, h, it.b0 + j) + a] = row[j];
    }
  }
}

/// The rescaled recurrence. Within a segment of tokens, with R_l the product of the row
/// decays (g, g_gamma, gk) and C_l that of the column decays (gv) since the segment began,
/// the state is kept as s' with s_l = (R_l C_l^T) .* s'_l, so that
///   s'_l = s'_{l-1} + (k_l / R_l) (v_l / C_l)^T   and   o_l = C_l .* ((R_l q_l)^T s'_l):
/// the scan does two FMAs per state element whatever the gates, and the gates cost O(K + V)
/// per token here. A segment ends before the token that would take any R or C out of
/// [e^-B, e^B] (so neither k / R nor q R can overflow or underflow: errors stay relative to
/// the current magnitudes, as in the direct recurrence); that token starts the next segment
/// with its decay applied to the true state as a plain multiply (segment_factors).
template <class Acc> struct rescale_bound {
  static constexpr Acc lo = Acc(2.061153622438558e-9);  // e^-20
  static constexpr Acc hi = Acc(4.851651954097903e8);   // e^20
};

/// Staging buffers of one forward worker: per head of the item, a chunk of tokens.
template <class Acc>
struct group_buffers {
  Acc *qs, *ks;          ///< [G][chunk][Kp]: q R * scale, k / R
  Acc *vs, *cs;          ///< [G][chunk][wp]: v / C, C
  Acc *fr1, *fr2;        ///< [G][chunk][Kp]: segment-start row factors
  Acc *fc1, *fc2;        ///< [G][chunk][wp]: segment-start column factors
  Acc *run_r, *run_c;    ///< [G][Kp], [G][wp]: R and C of the current segment
  Acc *dr, *dc;          ///< [Kp], [wp]: one token's decays
  Acc* os;               ///< [chunk][wp]: outputs of one head
  Acc** orows;           ///< [chunk]: output rows of one head (float outputs)
  Acc* prev;             ///< [Kp]: one head's R before a token (stage_group_float)
  std::int64_t* hoff;    ///< [4][G]: per head, the offsets of its q, k, v, gk rows at token 0
  unsigned char* starts; ///< [G][chunk]: token starts a segment
  std::int64_t Kp, chunk;
  bool per_head = false;  ///< one head's chunk staged at a time: all heads share one slot
  Acc* head(Acc* base, std::int64_t j, std::int64_t row) const { return per_head ? base : base + j * chunk * row; }
  unsigned char* start_row(std::int64_t j) const { return per_head ? starts : starts + j * chunk; }
};

/// Whether stage_group_float can stage this item: float inputs (and float gk), whole
/// registers of K and of the item's value columns, no column decay.
template <class T, unsigned Gates, class Acc>
bool can_stage_float(const problem& p, const group_item& it, std::int64_t Kp) {
  using Pol = forward_policy<Gates, false, false, state_layout::kv>;
  if constexpr (std::is_same_v<T, float> && std::is_same_v<Acc, float> && !Pol::decay_v)
    return p.K == Kp && it.w == it.wp && (!Pol::has_gk || p.gk.type == dtype::float32);
  else
    return false;
}

/// stage_group for float inputs in one pass per row (see can_stage_float): q, k and v are
/// read in place with SIMD loads, the row decays exponentiated, the segment bound checked and
/// the rescaling applied in the same pass, assuming the token starts no segment; the rare
/// token that does is redone (q and k as given, R restarted at 1, the factors saved). The
/// arithmetic is stage_group's, operation for operation.
template <unsigned Gates, class Acc>
RECATTN_NOINLINE void stage_group_float(const problem& p, const group_item& it, const std::int64_t* t, std::int64_t cl,
                                        const Acc* gamma, const group_buffers<Acc>& sb, std::int64_t jb, std::int64_t je) {
  using Pol = forward_policy<Gates, false, false, state_layout::kv>;
  using B = xsimd::batch<Acc, arch>;
  constexpr std::int64_t W = std::int64_t(B::size);
  const std::int64_t K = p.K, Kp = sb.Kp, wp = it.wp, b = it.batch, G = it.G;
  const B scale(Acc(p.scale));
  const B lo(rescale_bound<Acc>::lo), hi(rescale_bound<Acc>::hi);
  const float* qd = static_cast<const float*>(p.q.data);
  const float* kd = static_cast<const float*>(p.k.data);
  const float* vd = static_cast<const float*>(p.v.data);
  const float* gkd = static_cast<const float*>(p.gk.data);
  std::int64_t *hq = sb.hoff, *hk = hq + G, *hv = hk + G, *hg = hv + G;
  for (std::int64_t j = jb; j < je; ++j) {
    const std::int64_t h = it.h0 + j;
    hq[j] = p.q.offset(0, 0, h / (p.H / p.Hq));
    hk[j] = p.k.offset(0, 0, h / (p.H / p.Hk));
    hv[j] = p.v.offset(0, 0, h / (p.H / p.Hv)) + it.b0;
    if constexpr (Pol::has_gk) hg[j] = p.gk.offset(0, 0, h);
  }
  for (std::int64_t l = 0; l < cl; ++l) {
    const float* ql = qd + p.q.offset(b, t[l], 0);
    const float* kl = kd + p.k.offset(b, t[l], 0);
    const float* vl = vd + p.v.offset(b, t[l], 0);
    const float* gl = Pol::has_gk ? gkd + p.gk.offset(b, t[l], 0) : nullptr;
    for (std::int64_t j = jb; j < je; ++j) {
      const float* qsrc = ql + hq[j];
      const float* ksrc = kl + hk[j];
      const float* vsrc = vl + hv[j];
      Acc* qr = sb.head(sb.qs, j, Kp) + l * Kp;
      Acc* kr = sb.head(sb.ks, j, Kp) + l * Kp;
      Acc* vr = sb.head(sb.vs, j, wp) + l * wp;
      for (std::int64_t c = 0; c < wp; c += W) B::load_unaligned(vsrc + c).store_aligned(vr + c);
      if constexpr (!Pol::decay_k) {
        for (std::int64_t a = 0; a < K; a += W) {
          (B::load_unaligned(qsrc + a) * scale).store_aligned(qr + a);
          B::load_unaligned(ksrc + a).store_aligned(kr + a);
        }
      } else {
        Acc base = gamma[j];
        if constexpr (Pol::has_g) base += load_as<Acc>(p.g.data, p.g.type, p.g.offset(b, t[l], it.h0 + j));
        const B baseb(base);
        B dconst(Acc(0));
        if constexpr (!Pol::has_gk) dconst = B(Acc(std::exp(base)));
        Acc* run = sb.run_r + j * Kp;
        auto bad = B(Acc(0)) != B(Acc(0));
        for (std::int64_t a = 0; a < K; a += W) {
          B d = dconst;
          if constexpr (Pol::has_gk) d = xsimd::exp(B::load_unaligned(gl + hg[j] + a) + baseb);
          const B r = B::load_aligned(run + a);
          const B x = r * d;
          bad = bad | (x < lo) | (x > hi);
          d.store_aligned(sb.dr + a);
          r.store_aligned(sb.prev + a);
          x.store_aligned(run + a);
          ((B::load_unaligned(qsrc + a) * scale) * x).store_aligned(qr + a);
          (B::load_unaligned(ksrc + a) / x).store_aligned(kr + a);
        }
        const bool start = xsimd::any(bad);
        sb.start_row(j)[l] = start;
        if (start) {  // the token starts a segment: its decay goes to the true state
          Acc* f1 = sb.head(sb.fr1, j, Kp) + l * Kp;
          Acc* f2 = sb.head(sb.fr2, j, Kp) + l * Kp;
          for (std::int64_t a = 0; a < K; a += W) {
            B::load_aligned(sb.prev + a).store_aligned(f1 + a);
            B::load_aligned(sb.dr + a).store_aligned(f2 + a);
            B(Acc(1)).store_aligned(run + a);
            const B one(Acc(1));
            ((B::load_unaligned(qsrc + a) * scale) * one).store_aligned(qr + a);
            (B::load_unaligned(ksrc + a) / one).store_aligned(kr + a);
          }
        }
      }
    }
  }
}

/// Converts the chunk's tokens `t[0..cl)` of every head of the item to Acc, exponentiates
/// the gates and applies the segment rescaling. Tokens outer, heads inner: the rows of one
/// token for consecutive heads are adjacent in memory.
template <class T, unsigned Gates, class Acc>
RECATTN_NOINLINE void stage_group(const problem& p, const group_item& it, const std::int64_t* t, std::int64_t cl,
                                  const Acc* gamma, const group_buffers<Acc>& sb, std::int64_t jb, std::int64_t je) {
  using Pol = forward_policy<Gates, false, false, state_layout::kv>;
  const std::int64_t K = p.K, Kp = sb.Kp, wp = it.wp, b = it.batch;
  const Acc scale = Acc(p.scale);
  const Acc lo = rescale_bound<Acc>::lo, hi = rescale_bound<Acc>::hi;
  if (can_stage_float<T, Gates, Acc>(p, it, Kp)) return stage_group_float<Gates, Acc>(p, it, t, cl, gamma, sb, jb, je);
  for (std::int64_t l = 0; l < cl; ++l)
    for (std::int64_t j = jb; j < je; ++j) {
      const std::int64_t h = it.h0 + j;
      const std::int64_t hq = h / (p.H / p.Hq), hk = h / (p.H / p.Hk), hv = h / (p.H / p.Hv);
      Acc* qr = sb.head(sb.qs, j, Kp) + l * Kp;
      Acc* kr = sb.head(sb.ks, j, Kp) + l * Kp;
      Acc* vr = sb.head(sb.vs, j, wp) + l * wp;
      convert_row<Acc>(static_cast<const T*>(p.q.data) + p.q.offset(b, t[l], hq), p.type, K, qr, scale);
      convert_row<Acc>(static_cast<const T*>(p.k.data) + p.k.offset(b, t[l], hk), p.type, K, kr);
      for (std::int64_t a = K; a < Kp; ++a) qr[a] = kr[a] = Acc(0);
      convert_row<Acc>(static_cast<const T*>(p.v.data) + p.v.offset(b, t[l], hv) + it.b0, p.type, it.w, vr);
      for (std::int64_t c = it.w; c < wp; ++c) vr[c] = Acc(0);
      if constexpr (Pol::decay_k || Pol::decay_v) {
        bool start = false;
        Acc* run_r = sb.run_r + j * Kp;
        Acc* run_c = sb.run_c + j * wp;
        if constexpr (Pol::decay_k) {
          Acc base = gamma[j];
          if constexpr (Pol::has_g) base += load_as<Acc>(p.g.data, p.g.type, p.g.offset(b, t[l], h));
          if constexpr (Pol::has_gk) {
            const std::size_t es = dtype_size(p.gk.type);
            convert_row<Acc>(static_cast<const char*>(p.gk.data) + std::size_t(p.gk.offset(b, t[l], h)) * es, p.gk.type, K,
                             sb.dr);
            for (std::int64_t a = K; a < Kp; ++a) sb.dr[a] = Acc(0);
            exp_row(sb.dr, Kp, base);
          } else {
            const Acc d = std::exp(base);
            for (std::int64_t a = 0; a < K; ++a) sb.dr[a] = d;
          }
          for (std::int64_t a = K; a < Kp; ++a) sb.dr[a] = Acc(1);
          start = leaves_bound(run_r, sb.dr, Kp, lo, hi);
        }
        if constexpr (Pol::decay_v) {
          const std::size_t es = dtype_size(p.gv.type);
          convert_row<Acc>(static_cast<const char*>(p.gv.data) + std::size_t(p.gv.offset(b, t[l], h) + it.b0) * es,
                           p.gv.type, it.w, sb.dc);
          for (std::int64_t c = it.w; c < wp; ++c) sb.dc[c] = Acc(0);
          exp_row(sb.dc, wp, Acc(0));
          for (std::int64_t c = it.w; c < wp; ++c) sb.dc[c] = Acc(1);
          start = leaves_bound(run_c, sb.dc, wp, lo, hi) || start;
        }
        sb.start_row(j)[l] = start;
        if constexpr (Pol::decay_k) {
          advance_run(run_r, sb.dr, Kp, start, sb.head(sb.fr1, j, Kp) + l * Kp, sb.head(sb.fr2, j, Kp) + l * Kp);
          rescale_rows<Acc>(qr, kr, run_r, Kp);
        }
        if constexpr (Pol::decay_v) {
          advance_run(run_c, sb.dc, wp, start, sb.head(sb.fc1, j, wp) + l * wp, sb.head(sb.fc2, j, wp) + l * wp);
          rescale_rows<Acc>(nullptr, vr, run_c, wp);
          Acc* cr = sb.head(sb.cs, j, wp) + l * wp;
          for (std::int64_t c = 0; c < wp; ++c) cr[c] = run_c[c];
        }
      }
    }
}

#ifndef RECATTN_CPU_PREFETCH_HINT
#define RECATTN_CPU_PREFETCH_HINT 3
#endif

/// The input rows the next chunk's staging will read, prefetched a few cache lines at a
/// time while the current chunk is scanned. The token rows of one head lie H rows apart in
/// memory, a stride the hardware prefetcher does not follow across pages. The queue spreads
/// the prefetches evenly over the scan's register tiles rather than issuing one burst per
/// chunk (the burst is what the kernel did before; the spread form is part of the measured
/// gain in bench/README.md, not measured alone).
struct prefetch_queue {
  struct span { const char *begin, *end; };  ///< cache-line aligned
  std::vector<span> spans;
  std::size_t next = 0;
  const char* at = nullptr;
  std::int64_t lines = 0;  ///< lines in the queue when planned

  std::vector<std::int64_t> offsets;  ///< plan_prefetch's scratch

  /// Room for `n` spans, taken before the kernel writes anything.
  explicit prefetch_queue(std::size_t n) { spans.reserve(n); }
  /// `n` offsets of scratch (reserved by the forward before it writes anything).
  std::int64_t* head_offsets(std::size_t n) {
    if (offsets.size() < n) offsets.resize(n);
    return offsets.data();
  }
  void clear() { spans.clear(), next = 0, at = nullptr, lines = 0; }
  void add(const void* p, std::size_t bytes) {
    const auto line = [](const char* c) { return reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(c) & ~std::uintptr_t(63)); };
    const char* b = line(static_cast<const char*>(p));
    const char* e = line(static_cast<const char*>(p) + bytes + 63);
    if (!spans.empty() && b >= spans.back().begin && b <= spans.back().end) {  // adjacent rows: one span
      lines += std::max<std::int64_t>(0, (e - spans.back().end) / 64);
      spans.back().end = std::max(spans.back().end, e);
      return;
    }
    spans.push_back({b, e});
    lines += (e - b) / 64;
  }
  void issue(std::int64_t n) {
    for (; n > 0 && next < spans.size(); --n) {
      if (!at) at = spans[next].begin;
#if defined(__GNUC__) || defined(__clang__)
      __builtin_prefetch(at, 0, RECATTN_CPU_PREFETCH_HINT);
#endif
      at += 64;
      if (at >= spans[next].end) ++next, at = nullptr;
    }
  }
  void issue_all() { issue(std::numeric_limits<std::int64_t>::max()); }
};

/// Queues every input row that stage_group will read for tokens t[0..cl), and the output
/// rows the scan will write (a store to a line not in cache waits for the line).
template <class T, unsigned Gates>
RECATTN_NOINLINE void plan_prefetch(const problem& p, const group_item& it, const std::int64_t* t, std::int64_t cl,
                                    prefetch_queue& pq) {
  using Pol = forward_policy<Gates, false, false, state_layout::kv>;
  const std::int64_t b = it.batch, G = it.G;
  const std::size_t kb = std::size_t(p.K) * sizeof(T), vb = std::size_t(it.w) * sizeof(T);
  pq.clear();
  // A row's offset is (b, t) + (head); the head parts once per call.
  constexpr int X = 5;  // q, k, v, gk or gv, output
  const char* bases[X] = {static_cast<const char*>(p.q.data), static_cast<const char*>(p.k.data),
                          static_cast<const char*>(p.v.data), nullptr, static_cast<const char*>(p.out.data)};
  const strided3* ts[X] = {&p.q, &p.k, &p.v, nullptr, &p.out};
  std::size_t es[X] = {sizeof(T), sizeof(T), sizeof(T), 0, sizeof(T)};
  std::size_t bytes[X] = {kb, kb, vb, 0, vb};
  if constexpr (Pol::has_gk) bases[3] = static_cast<const char*>(p.gk.data), ts[3] = &p.gk, es[3] = dtype_size(p.gk.type), bytes[3] = std::size_t(p.K) * es[3];
  if constexpr (Pol::has_gv) bases[3] = static_cast<const char*>(p.gv.data), ts[3] = &p.gv, es[3] = dtype_size(p.gv.type), bytes[3] = std::size_t(it.w) * es[3];
  std::int64_t* off = pq.head_offsets(std::size_t(2 * X * G));
  for (int x = 0; x < X; ++x) {
    if (!bases[x]) continue;
    for (std::int64_t j = 0; j < G; ++j) {
      const std::int64_t h = it.h0 + j;
      const std::int64_t hh = x == 0 ? h / (p.H / p.Hq) : x == 1 ? h / (p.H / p.Hk) : x == 2 ? h / (p.H / p.Hv) : h;
      const std::int64_t col = (x == 2 || x == 4 || (x == 3 && Pol::has_gv)) ? it.b0 : 0;
      off[x * G + j] = (ts[x]->offset(0, 0, hh) + col) * std::int64_t(es[x]);
    }
  }
  // The heads' rows of one token, merged where adjacent or overlapping (consecutive heads
  // are usually adjacent: one span per tensor and token).
  std::int64_t* len = off + X * G;
  std::int64_t n[X] = {};
  for (int x = 0; x < X; ++x) {
    if (!bases[x]) continue;
    for (std::int64_t j = 0; j < G; ++j) {
      const std::int64_t o = off[x * G + j], e = o + std::int64_t(bytes[x]);
      std::int64_t& m = n[x];
      if (m > 0 && o >= off[x * G + m - 1] && o <= off[x * G + m - 1] + len[x * G + m - 1]) {
        len[x * G + m - 1] = std::max(len[x * G + m - 1], e - off[x * G + m - 1]);
      } else {
        off[x * G + m] = o;
        len[x * G + m] = e - o;
        ++m;
      }
    }
  }
  // Tensor by tensor, so that the rows of consecutive heads merge into one span.
  for (std::int64_t l = 0; l < cl; ++l)
    for (int x = 0; x < X; ++x) {
      if (!bases[x]) continue;
      const char* row = bases[x] + ts[x]->offset(b, t[l], 0) * std::int64_t(es[x]);
      for (std::int64_t m = 0; m < n[x]; ++m) pq.add(row + off[x * G + m], std::size_t(len[x * G + m]));
    }
}

/// The recurrence of one staged chunk for head j of the item: the chunk's segments in
/// order, then its outputs (times C for a column decay) stored at their positions.
/// `pq`: the next chunk's rows, of which this head's share (1/G) is prefetched.
template <class T, class Acc, bool DecayK, bool DecayV>
RECATTN_NOINLINE void scan_chunk(const problem& p, const group_item& it, std::int64_t j, const std::int64_t* t,
                                 std::int64_t cl, const group_buffers<Acc>& sb, Acc* S, prefetch_queue& pq) {
  const std::int64_t Kp = sb.Kp, wp = it.wp;
  constexpr std::int64_t W = std::int64_t(xsimd::batch<Acc, arch>::size);
  constexpr int R = tile_shape<Acc>::rows, NV = tile_shape<Acc>::regs;
  const std::int64_t tiles = (p.K / R + p.K % R) * (wp / (NV * W) + wp % (NV * W) / W);
  // Spread over the tiles, a few lines every RECATTN_CPU_PREFETCH_EVERY tokens of each.
  const std::int64_t calls = tiles * ((cl + RECATTN_CPU_PREFETCH_EVERY - 1) / RECATTN_CPU_PREFETCH_EVERY);
  const std::int64_t per_call = (pq.lines / it.G + calls - 1) / calls + 1;
  auto prefetch = [&] { pq.issue(per_call); };
  const unsigned char* starts = sb.start_row(j);
  const Acc* qs = sb.head(sb.qs, j, Kp);
  const Acc* ks = sb.head(sb.ks, j, Kp);
  const Acc* vs = sb.head(sb.vs, j, wp);
  T* out = static_cast<T*>(p.out_data());
  const std::int64_t h = it.h0 + j;
  // Outputs straight from the scan's last row tile when nothing is left to apply to them
  // (no column decay) and the row holds whole registers; otherwise through os.
  Acc* const* orows = nullptr;
  if constexpr (std::is_same_v<T, Acc>)
    if (!DecayV && it.w == wp) {
      for (std::int64_t l = 0; l < cl; ++l) sb.orows[l] = out + p.out.offset(it.batch, t[l], h) + it.b0;
      orows = sb.orows;
    }
  for (std::int64_t l0 = 0, l1; l0 < cl; l0 = l1) {
    l1 = l0 + 1;
    if constexpr (DecayK || DecayV)
      while (l1 < cl && !starts[l1]) ++l1;
    else
      l1 = cl;
    segment_factors<Acc> f;
    if ((DecayK || DecayV) && starts[l0]) {
      if (DecayK) f.r1 = sb.head(sb.fr1, j, Kp) + l0 * Kp, f.r2 = sb.head(sb.fr2, j, Kp) + l0 * Kp;
      if (DecayV) f.c1 = sb.head(sb.fc1, j, wp) + l0 * wp, f.c2 = sb.head(sb.fc2, j, wp) + l0 * wp;
    }
    scan(l1 - l0, p.K, qs + l0 * Kp, ks + l0 * Kp, Kp, vs + l0 * wp, wp, S, sb.os + l0 * wp, f, prefetch,
         orows ? orows + l0 : nullptr);
  }
  if (orows) return;
  if constexpr (DecayV) rescale_rows<Acc>(sb.os, nullptr, sb.head(sb.cs, j, wp), cl * wp);
  for (std::int64_t l = 0; l < cl; ++l) store_row(sb.os + l * wp, it.w, out + p.out.offset(it.batch, t[l], h) + it.b0);
}

/// Heads per work item: the item stages the rows of consecutive heads together (adjacent
/// in memory), as many as keep their states within `state_budget` bytes while leaving at
/// least two items per thread.
#ifndef RECATTN_CPU_GROUP_STATE_BYTES
#define RECATTN_CPU_GROUP_STATE_BYTES (512 * 1024)
#endif
#ifndef RECATTN_CPU_ITEMS_PER_THREAD
#define RECATTN_CPU_ITEMS_PER_THREAD 1
#endif
inline std::int64_t heads_per_item(const problem& p, std::int64_t state_bytes, std::int64_t nvb, int threads) {
  constexpr std::int64_t state_budget = RECATTN_CPU_GROUP_STATE_BYTES;
  const std::int64_t min_items = std::min<std::int64_t>(RECATTN_CPU_ITEMS_PER_THREAD * std::int64_t(threads), p.N * p.H * nvb);
  std::int64_t best = 1;
  for (std::int64_t G = 2; G <= p.H; ++G)
    if (p.H % G == 0 && G * state_bytes <= state_budget && p.N * (p.H / G) * nvb >= min_items) best = G;
  return best;
}

}  // namespace detail

/// The forward pass for one compiled specialization. `p` is checked; `c` resolved.
/// The specialization only steers (token order, varlen bounds, state layout, gates);
/// the work is in helpers shared by every specialization of one dtype.
template <class T, class Policy>
void forward_kernel(const problem& p, const cfg& c) {
  using Acc = accum_t<T>;
  constexpr std::int64_t W = std::int64_t(xsimd::batch<Acc, arch>::size);
  constexpr bool decay = Policy::decay_k || Policy::decay_v;
  const std::int64_t K = p.K, V = p.V;
  const std::int64_t Kp = detail::round_up(K, W);
  const std::int64_t bv = std::min(detail::round_up(std::max<std::int64_t>(c.block_v, 1), W), detail::round_up(V, W));
  const std::int64_t nvb = (V + bv - 1) / bv;
  const std::int64_t chunk = std::max<std::int64_t>(1, c.chunk);
  const int want_threads = std::max(1, c.threads);
  const std::int64_t G = detail::heads_per_item(p, K * bv * std::int64_t(sizeof(Acc)), nvb, want_threads);
  const std::int64_t items = p.N * (p.H / G) * nvb;
  const int threads = int(std::max<std::int64_t>(1, std::min<std::int64_t>(want_threads, items)));
  if (items == 0) return;

  // All scratch is taken before anything is written: an allocation failure leaves the
  // caller's buffers as they were.
  const std::size_t per_thread = std::size_t(G * K * bv + G * chunk * (4 * Kp + 4 * bv) + G * (Kp + bv) + 2 * Kp + bv +
                                             chunk * bv + 16 * W);
  detail::aligned_buffer<Acc> scratch(per_thread * std::size_t(threads));
  std::vector<std::int64_t> token_buf(std::size_t(2 * chunk * threads));
  std::vector<unsigned char> start_buf(std::size_t(G * chunk * threads));
  std::vector<Acc*> orow_buf(std::size_t(chunk * threads));
  std::vector<std::int64_t> hoff_buf(std::size_t(4 * G * threads));
  std::vector<Acc> gamma_buf(std::size_t(G * threads));
  std::vector<detail::prefetch_queue> queues(std::size_t(threads), detail::prefetch_queue(std::size_t(6 * chunk * G)));
  for (auto& q : queues) q.head_offsets(std::size_t(10 * G));

  parallel_for(items, threads, [&](std::int64_t item, int worker) {
    detail::group_item it;
    const std::int64_t vb = item % nvb;
    it.G = G;
    it.h0 = ((item / nvb) % (p.H / G)) * G;
    it.n = item / (nvb * (p.H / G));
    it.b0 = vb * bv;
    it.w = std::min(bv, V - it.b0);
    it.wp = detail::round_up(it.w, W);
    const recattn::detail::seqlen_info<Policy::varlen> seq(p, it.n);
    it.batch = seq.batch;

    Acc* states = scratch.get() + per_thread * std::size_t(worker);
    const std::int64_t sstride = K * it.wp;
    detail::group_buffers<Acc> sb;
    sb.Kp = Kp;
    sb.chunk = chunk;
    sb.per_head = RECATTN_CPU_STAGE_PER_HEAD;
    Acc* m = states + G * K * bv;
    // One cache line between buffers: [chunk][row] buffers a multiple of 4 KiB long would
    // otherwise put the same token's rows of every buffer in one L1 set.
    auto take = [&m](std::int64_t n) { Acc* r = m; m += n + (RECATTN_CPU_SKEW); return r; };
    sb.qs = take(G * chunk * Kp);
    sb.ks = take(G * chunk * Kp);
    sb.fr1 = take(G * chunk * Kp);
    sb.fr2 = take(G * chunk * Kp);
    sb.vs = take(G * chunk * bv);
    sb.cs = take(G * chunk * bv);
    sb.fc1 = take(G * chunk * bv);
    sb.fc2 = take(G * chunk * bv);
    sb.run_r = take(G * Kp);
    sb.run_c = take(G * bv);
    sb.dr = take(Kp);
    sb.dc = take(bv);
    sb.prev = take(Kp);
    sb.os = take(chunk * bv);
    sb.starts = start_buf.data() + std::size_t(G * chunk * worker);
    sb.orows = orow_buf.data() + std::size_t(chunk * worker);
    sb.hoff = hoff_buf.data() + std::size_t(4 * G * worker);
    std::int64_t* tok = token_buf.data() + 2 * chunk * worker;
    std::int64_t* next = tok + chunk;
    Acc* gamma = gamma_buf.data() + G * worker;

    for (std::int64_t j = 0; j < G; ++j) {
      detail::load_state<Policy::layout>(p, it, it.h0 + j, states + j * sstride);
      gamma[j] = Acc(0);
      if constexpr (Policy::has_g_gamma)
        gamma[j] = load_as<Acc>(p.g_gamma.data, p.g_gamma.type, p.g_gamma.offset(it.n, it.h0 + j, 0));
    }
    if constexpr (decay) {
      for (std::int64_t i = 0; i < G * Kp; ++i) sb.run_r[i] = Acc(1);
      for (std::int64_t i = 0; i < G * it.wp; ++i) sb.run_c[i] = Acc(1);
    }

    for (std::int64_t i0 = 0; i0 < seq.len; i0 += chunk) {
      const std::int64_t cl = std::min(chunk, seq.len - i0);
      for (std::int64_t l = 0; l < cl; ++l) tok[l] = seq.template token<Policy::reverse>(i0 + l);
      if (!sb.per_head) detail::stage_group<T, Policy::gates>(p, it, tok, cl, static_cast<const Acc*>(gamma), sb, 0, G);
      // The next chunk's rows arrive while this one is scanned.
      const std::int64_t ncl = std::min(chunk, seq.len - i0 - cl);
      for (std::int64_t l = 0; l < ncl; ++l) next[l] = seq.template token<Policy::reverse>(i0 + cl + l);
      detail::prefetch_queue& pq = queues[std::size_t(worker)];
      detail::plan_prefetch<T, Policy::gates>(p, it, next, ncl, pq);
      for (std::int64_t j = 0; j < G; ++j) {
        if (sb.per_head) detail::stage_group<T, Policy::gates>(p, it, tok, cl, static_cast<const Acc*>(gamma), sb, j, j + 1);
        detail::scan_chunk<T, Acc, Policy::decay_k, Policy::decay_v>(p, it, j, tok, cl, sb, states + j * sstride, pq);
      }
      pq.issue_all();
    }
    for (std::int64_t j = 0; j < G; ++j) {
      Acc* S = states + j * sstride;
      if constexpr (decay)
        detail::unscale_state<Acc>(S, K, it.wp, Policy::decay_k ? sb.run_r + j * Kp : nullptr,
                                   Policy::decay_v ? sb.run_c + j * it.wp : nullptr);
      if (p.ht.data) detail::store_state<Policy::layout>(p, it, it.h0 + j, S);
    }
  });
}

}  // namespace recattn::cpu
