// The CPU decode step: the forward recurrence applied in place to the states of a pool.
//
// A decode step is memory-bound: per token and (row, head) it reads and writes the whole
// K x V state and does 3 vector operations per element. So the kernel streams: a work item
// (row, head, block of value columns) walks its slice of the state once, R key rows x NV SIMD
// registers at a time, straight from and to the pool when the pool is [K, V] in the
// accumulator type (no copy), and through an L1/L2-resident scratch tile otherwise (bfloat16
// storage: converted on load, rounded once on store; [V, K] layout: transposed). One token
// (decode) streams the rows one at a time with the output of a whole 128-column row in 8
// registers over all K rows (step_stream: measured 5.9 ms against 10.2 ms for the register
// tiles on B64 H32 K=V=128, float, gk, 2 threads; the rows 16 ahead are prefetched, since the
// hardware prefetcher stops at each 4 KiB page); with bfloat16 storage each row is
// converted into an L1 buffer and rounded back in the same pass (step_stream_storage), not
// through a whole-slice scratch tile. A row with several tokens keeps each
// register tile of the state in registers across a chunk of its tokens, so the state passes
// through memory once per chunk, not per token.
//
// The arithmetic is the direct recurrence of SPEC §1 in its order (decayed_update, the
// update of the CPU kernels: s = fma(s, D, k v), o = fma(q, s, o) over the key rows in order),
// so a row's result does not depend on how its tokens are split into calls: one multi-token
// step gives bit for bit what single steps give.
//
// Scratch is thread-local and only grows: after a thread's first call a step allocates nothing.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#include <xsimd/xsimd.hpp>

#include "../cfg.hpp"
#include "../dtype.hpp"
#include "../policy.hpp"
#include "../step_problem.hpp"
#include "parallel.hpp"
#include "recurrence.hpp"

namespace recattn::cpu {

/// Heuristic step configuration: value blocks of up to 8 SIMD registers (a whole 128-column
/// row of floats with AVX-512), split further while there are fewer than 2 items per thread;
/// chunks of 16 tokens for multi-token rows.
inline cfg cpu_step_heuristic_cfg(const step_problem& sp) {
  const problem& p = sp.tok;
  cfg c;
  c.threads = hardware_threads();
  const int W = p.type == dtype::float64 ? int(xsimd::batch<double, arch>::size) : int(xsimd::batch<float, arch>::size);
  const std::int64_t Vp = detail::round_up(p.V, W);
  std::int64_t bv = std::min<std::int64_t>(Vp, 8 * W);
  while (bv > W && p.N * p.H * ((Vp + bv - 1) / bv) < 2 * c.threads) bv = detail::round_up(bv / 2, W);
  c.block_v = int(bv);
  c.chunk = 16;
  return c;
}

/// Fills zero fields of `user` from the heuristic and checks the rest.
inline cfg cpu_step_resolve_cfg(const step_problem& sp, const std::optional<cfg>& user) {
  const cfg h = cpu_step_heuristic_cfg(sp);
  if (!user) return h;
  cfg c = *user;
  if (c.threads < 0) recattn::detail::fail("cfg.threads", "a value >= 0 (0: all hardware threads)", c.threads);
  check_cpu_threads(c.threads);
  if (c.block_v < 0) recattn::detail::fail("cfg.block_v", "a value >= 0 (0: heuristic)", c.block_v);
  if (c.chunk < 0) recattn::detail::fail("cfg.chunk", "a value >= 0 (0: heuristic)", c.chunk);
  if (c.threads == 0) c.threads = h.threads;
  if (c.block_v == 0) c.block_v = h.block_v;
  if (c.chunk == 0) c.chunk = h.chunk;
  return c;
}

namespace detail {

#ifndef RECATTN_CPU_STEP_TILE_ROWS
#define RECATTN_CPU_STEP_TILE_ROWS 4
#endif
#ifndef RECATTN_CPU_STEP_TILE_REGS
#define RECATTN_CPU_STEP_TILE_REGS 4
#endif
/// Column registers of the one-token streaming loop (8 x 16 floats: a 128-column row).
#ifndef RECATTN_CPU_STEP_STREAM_REGS
#define RECATTN_CPU_STEP_STREAM_REGS 8
#endif
/// Software prefetch distance of the one-token streaming loop, in state rows (0: none): the
/// row that many rows ahead is prefetched (for writing) as each row is updated. The hardware
/// prefetcher does not cross 4 KiB pages, 8 rows of a float [128 x 128] slice; measured on
/// B64 H32 K=V=128, gk, 2 threads, interleaved in one process: float state 4.9 -> 4.0 ms,
/// bfloat16 state 3.6 -> 3.0 ms at 16 rows (8: about the same, 32: slower; bench/README.md).
#ifndef RECATTN_CPU_STEP_PREFETCH_ROWS
#define RECATTN_CPU_STEP_PREFETCH_ROWS 16
#endif

/// Prefetches the lines of [p, p + bytes) for writing (no-op where the compiler has no
/// prefetch builtin).
inline void prefetch_for_write(const void* p, std::int64_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  const char* c = static_cast<const char*>(p);
  for (std::int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 1, 3);
#else
  (void)p, (void)bytes;
#endif
}

/// Thread-local scratch of n elements, 64-byte aligned; grows, never shrinks.
template <class E>
E* thread_scratch(std::size_t n) {
  thread_local aligned_buffer<E> buf(1);
  thread_local std::size_t cap = 1;
  if (cap < n) {
    buf = aligned_buffer<E>(n);
    cap = n;
  }
  return buf.get();
}

/// One work item of the step: batch row n (pool slot `slot`), head h, value columns
/// [b0, b0 + w) padded to wp; `batch` indexes the token tensors' first dimension.
struct step_item {
  std::int64_t n, h, b0, w, wp, batch, slot;
};

/// Staging buffers of one worker for a chunk of a row's tokens.
template <class Acc>
struct step_stage {
  Acc *qs, *ks, *dks;  ///< [chunk][Kp]: q * scale, k, exp(g + g_gamma + gk)
  Acc *vs, *dvs, *os;  ///< [chunk][wp]: v, exp(gv), output
  std::int64_t Kp;
};

/// Converts the item's tokens t[0..cl) to Acc, q pre-scaled, the gates exponentiated (so the
/// update sees only multiplies): the direct recurrence of SPEC §1, the row decay
/// exp(g + g_gamma + gk[a]) and the column decay exp(gv[b]) of each token.
template <class T, unsigned Gates, class Acc>
RECATTN_NOINLINE void stage_step_chunk(const problem& p, const step_item& it, const std::int64_t* t, std::int64_t cl,
                                       Acc gamma, const step_stage<Acc>& sb) {
  using Pol = forward_policy<Gates, false, false, state_layout::kv>;
  const std::int64_t K = p.K, Kp = sb.Kp, b = it.batch, h = it.h;
  const std::int64_t hq = h / (p.H / p.Hq), hk = h / (p.H / p.Hk), hv = h / (p.H / p.Hv);
  const Acc scale = Acc(p.scale);
  for (std::int64_t l = 0; l < cl; ++l) {
    convert_row<Acc>(static_cast<const T*>(p.q.data) + p.q.offset(b, t[l], hq), p.type, K, sb.qs + l * Kp, scale);
    convert_row<Acc>(static_cast<const T*>(p.k.data) + p.k.offset(b, t[l], hk), p.type, K, sb.ks + l * Kp);
    if constexpr (Pol::decay_k) {
      Acc* dr = sb.dks + l * Kp;
      Acc base = gamma;
      if constexpr (Pol::has_g) base += load_as<Acc>(p.g.data, p.g.type, p.g.offset(b, t[l], h));
      if constexpr (Pol::has_gk) {
        const std::size_t es = dtype_size(p.gk.type);
        convert_row<Acc>(static_cast<const char*>(p.gk.data) + std::size_t(p.gk.offset(b, t[l], h)) * es, p.gk.type, K, dr);
        for (std::int64_t a = K; a < Kp; ++a) dr[a] = Acc(0);
        exp_row(dr, Kp, base);
      } else {
        const Acc d = std::exp(base);
        for (std::int64_t a = 0; a < K; ++a) dr[a] = d;
      }
    }
    Acc* vr = sb.vs + l * it.wp;
    convert_row<Acc>(static_cast<const T*>(p.v.data) + p.v.offset(b, t[l], hv) + it.b0, p.type, it.w, vr);
    for (std::int64_t j = it.w; j < it.wp; ++j) vr[j] = Acc(0);
    if constexpr (Pol::decay_v) {
      Acc* dr = sb.dvs + l * it.wp;
      const std::size_t es = dtype_size(p.gv.type);
      convert_row<Acc>(static_cast<const char*>(p.gv.data) + std::size_t(p.gv.offset(b, t[l], h) + it.b0) * es,
                       p.gv.type, it.w, dr);
      for (std::int64_t j = it.w; j < it.wp; ++j) dr[j] = Acc(0);
      exp_row(dr, it.wp, Acc(0));
    }
  }
}

/// Where the state after a staged token goes: snapshot slot per token (negative: not kept).
struct snapshot_sink {
  const step_problem* sp = nullptr;
  const std::int64_t* slots = nullptr;  ///< [L]; null: no snapshots in this call
  std::int64_t h = 0, b0 = 0, w = 0;    ///< head, first column and columns of the item
};

/// Stores rows x cols of a register tile (tile[i * ld + j], state rows row0.., item columns
/// col0..) as the state after token l, in the pool's layout and storage dtype.
template <class Acc>
RECATTN_NOINLINE void write_snapshot(const snapshot_sink& sk, std::int64_t l, std::int64_t row0, int rows,
                                     std::int64_t col0, std::int64_t cols, const Acc* tile, std::int64_t ld) {
  const step_problem& sp = *sk.sp;
  const std::int64_t slot = sk.slots[l];
  const std::int64_t n = std::min(cols, sk.w - col0);
  const bool kv = sp.tok.layout == state_layout::kv;
  auto put = [&](auto* dst) {
    using S = std::remove_pointer_t<decltype(dst)>;
    for (int i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        const std::int64_t a = row0 + i, b = sk.b0 + col0 + j;
        const std::int64_t off = kv ? sp.snap.offset(slot, sk.h, a) + b : sp.snap.offset(slot, sk.h, b) + a;
        dst[off] = convert<S>(tile[i * ld + j]);
      }
  };
  switch (sp.state_type) {
    case dtype::float32: put(static_cast<float*>(sp.snap_data())); break;
    case dtype::float64: put(static_cast<double*>(sp.snap_data())); break;
    default: put(static_cast<bfloat16*>(sp.snap_data())); break;
  }
}

/// The recurrence over L staged tokens for one R x NV register tile of the state, which is
/// loaded from S (row stride lds, unaligned) once and stored once: per token and row
/// s = decayed_update(s, ...), then o = fma(q, s, o), rows in order. After each token whose snapshot slot is set, the tile goes there.
template <class Acc, bool DecayK, bool DecayV, int R, int NV>
inline void step_tile(std::int64_t L, const Acc* qs, const Acc* ks, const Acc* dks, std::int64_t ldk, const Acc* vs,
                      const Acc* dvs, std::int64_t ldv, Acc* S, std::int64_t lds, Acc* os, const snapshot_sink& sk,
                      std::int64_t row0, std::int64_t col0) {
  using B = xsimd::batch<Acc, arch>;
  constexpr std::int64_t W = std::int64_t(B::size);
  B s[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) s[i][j] = B::load_unaligned(S + i * lds + j * W);
  for (std::int64_t l = 0; l < L; ++l) {
    const Acc* qr = qs + l * ldk;
    const Acc* kr = ks + l * ldk;
    const Acc* dr = dks + l * ldk;
    B v[NV], dv[NV], acc[NV];
    for (int j = 0; j < NV; ++j) {
      v[j] = B::load_aligned(vs + l * ldv + j * W);
      if constexpr (DecayV) dv[j] = B::load_aligned(dvs + l * ldv + j * W);
      acc[j] = B::load_aligned(os + l * ldv + j * W);
    }
    for (int i = 0; i < R; ++i) {
      const B kb(kr[i]);
      const B qb(qr[i]);
      B db(Acc(1));
      if constexpr (DecayK) db = B(dr[i]);
      for (int j = 0; j < NV; ++j) s[i][j] = decayed_update<DecayK, DecayV>(s[i][j], db, dv[j], kb, v[j]);
      for (int j = 0; j < NV; ++j) acc[j] = xsimd::fma(qb, s[i][j], acc[j]);
    }
    for (int j = 0; j < NV; ++j) acc[j].store_aligned(os + l * ldv + j * W);
    if (sk.slots && sk.slots[l] >= 0) {
      alignas(64) Acc tile[R][NV * W];
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < NV; ++j) s[i][j].store_aligned(&tile[i][j * W]);
      write_snapshot(sk, l, row0, R, col0, NV * W, &tile[0][0], NV * W);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) s[i][j].store_unaligned(S + i * lds + j * W);
}

/// One token (the decode case) for NV registers of columns of the slice: the rows stream
/// through once, one at a time, while the NV output registers stay in registers over all K
/// rows; the same operations in the same order as step_tile.
template <class Acc, bool DecayK, bool DecayV, int NV, class Storage = Acc>
inline void step_stream(std::int64_t K, const Acc* qs, const Acc* ks, const Acc* dks, const Acc* vs, const Acc* dvs,
                        Storage* S, std::int64_t lds, Acc* os, const snapshot_sink& sk, std::int64_t col0) {
  using B = xsimd::batch<Acc, arch>;
  constexpr std::int64_t W = std::int64_t(B::size);
  // Storage other than Acc (bfloat16): a row is converted into an L1 buffer, updated there
  // and rounded back once, the same operations on the same values as the scratch tile.
  constexpr bool direct = std::is_same<Storage, Acc>::value;
  B v[NV], dv[NV], acc[NV];
  for (int j = 0; j < NV; ++j) {
    v[j] = B::load_aligned(vs + j * W);
    if constexpr (DecayV) dv[j] = B::load_aligned(dvs + j * W);
    acc[j] = B(Acc(0));
  }
  const bool snap = sk.slots && sk.slots[0] >= 0;
  for (std::int64_t a = 0; a < K; ++a) {
    Storage* srow = S + a * lds;
    if (RECATTN_CPU_STEP_PREFETCH_ROWS > 0 && a + RECATTN_CPU_STEP_PREFETCH_ROWS < K)
      prefetch_for_write(srow + RECATTN_CPU_STEP_PREFETCH_ROWS * lds, std::int64_t(NV * W * sizeof(Storage)));
    const B kb(ks[a]);
    const B qb(qs[a]);
    B db(Acc(1));
    if constexpr (DecayK) db = B(dks[a]);
    alignas(64) Acc tile[NV * W];
    Acc* row;
    if constexpr (direct) {
      row = srow;
    } else {
      row = tile;
      for (std::int64_t j = 0; j < NV * W; ++j) tile[j] = convert<Acc>(srow[j]);
    }
    for (int j = 0; j < NV; ++j) {
      const B x = decayed_update<DecayK, DecayV>(B::load_unaligned(row + j * W), db, dv[j], kb, v[j]);
      acc[j] = xsimd::fma(qb, x, acc[j]);
      x.store_unaligned(row + j * W);
      if (direct && snap) x.store_aligned(tile + j * W);
    }
    if constexpr (!direct)
      for (std::int64_t j = 0; j < NV * W; ++j) srow[j] = convert<Storage>(tile[j]);
    if (snap) write_snapshot(sk, 0, a, 1, col0, NV * W, tile, NV * W);
  }
  for (int j = 0; j < NV; ++j) acc[j].store_aligned(os + j * W);
}

/// The step over one staged chunk for an item's state slice S [K] rows x ldv columns (row
/// stride lds): one token streams (step_stream); several take column tiles of NV registers
/// and row tiles of R rows held in registers across the chunk, remainders one at a time.
template <class Acc, bool DecayK, bool DecayV>
RECATTN_NOINLINE void step_scan(std::int64_t L, std::int64_t K, const Acc* qs, const Acc* ks, const Acc* dks,
                                std::int64_t ldk, const Acc* vs, const Acc* dvs, std::int64_t ldv, Acc* S,
                                std::int64_t lds, Acc* os, const snapshot_sink& sk) {
  constexpr std::int64_t W = std::int64_t(xsimd::batch<Acc, arch>::size);
  constexpr int R = RECATTN_CPU_STEP_TILE_ROWS, NV = RECATTN_CPU_STEP_TILE_REGS;
  if (L == 1) {
    constexpr int NVS = RECATTN_CPU_STEP_STREAM_REGS;
    std::int64_t j0 = 0;
    for (; j0 + NVS * W <= ldv; j0 += NVS * W)
      step_stream<Acc, DecayK, DecayV, NVS>(K, qs, ks, dks, vs + j0, dvs + j0, S + j0, lds, os + j0, sk, j0);
    for (; j0 < ldv; j0 += W) step_stream<Acc, DecayK, DecayV, 1>(K, qs, ks, dks, vs + j0, dvs + j0, S + j0, lds, os + j0, sk, j0);
    return;
  }
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t j = 0; j < ldv; ++j) os[l * ldv + j] = Acc(0);
  auto rows = [&](auto nv, std::int64_t j0) {
    constexpr int NVc = decltype(nv)::value;
    std::int64_t a = 0;
    for (; a + R <= K; a += R)
      step_tile<Acc, DecayK, DecayV, R, NVc>(L, qs + a, ks + a, dks + a, ldk, vs + j0, dvs + j0, ldv, S + a * lds + j0,
                                             lds, os + j0, sk, a, j0);
    for (; a < K; ++a)
      step_tile<Acc, DecayK, DecayV, 1, NVc>(L, qs + a, ks + a, dks + a, ldk, vs + j0, dvs + j0, ldv, S + a * lds + j0,
                                             lds, os + j0, sk, a, j0);
  };
  std::int64_t j0 = 0;
  for (; j0 + NV * W <= ldv; j0 += NV * W) rows(std::integral_constant<int, NV>{}, j0);
  for (; j0 < ldv; j0 += W) rows(std::integral_constant<int, 1>{}, j0);
}

/// One token over an item's slice of a [K, V] pool in storage other than Acc (bfloat16),
/// streamed in place (ldv columns, a multiple of the SIMD width; row stride lds).
template <class Acc, bool DecayK, bool DecayV, class Storage>
RECATTN_NOINLINE void step_stream_storage(std::int64_t K, const Acc* qs, const Acc* ks, const Acc* dks, const Acc* vs,
                                          const Acc* dvs, std::int64_t ldv, Storage* S, std::int64_t lds, Acc* os,
                                          const snapshot_sink& sk) {
  constexpr std::int64_t W = std::int64_t(xsimd::batch<Acc, arch>::size);
  constexpr int NVS = RECATTN_CPU_STEP_STREAM_REGS;
  std::int64_t j0 = 0;
  for (; j0 + NVS * W <= ldv; j0 += NVS * W)
    step_stream<Acc, DecayK, DecayV, NVS, Storage>(K, qs, ks, dks, vs + j0, dvs + j0, S + j0, lds, os + j0, sk, j0);
  for (; j0 < ldv; j0 += W)
    step_stream<Acc, DecayK, DecayV, 1, Storage>(K, qs, ks, dks, vs + j0, dvs + j0, S + j0, lds, os + j0, sk, j0);
}

/// An item's state slice as the kernel walks it: the pool itself, or a scratch tile.
template <class Acc>
struct state_slice {
  Acc* S;
  std::int64_t lds;
  bool direct;
};

/// The slice of pool slot `slot` for item `it`: in place when the pool is [K, V] in Acc and
/// the block is whole SIMD registers wide; else loaded into `tile` [K][wp] (zero padded).
template <class Acc, class Storage>
RECATTN_NOINLINE state_slice<Acc> open_slice(const step_problem& sp, const step_item& it, Acc* tile) {
  const std::int64_t slot = it.slot;
  const problem& p = sp.tok;
  Storage* pool = static_cast<Storage*>(sp.pool_data());
  if constexpr (std::is_same<Storage, Acc>::value) {
    if (p.layout == state_layout::kv && it.w == it.wp) return {pool + sp.pool.offset(slot, it.h, 0) + it.b0, sp.pool.s2, true};
  }
  for (std::int64_t a = 0; a < p.K; ++a)
    for (std::int64_t j = it.w; j < it.wp; ++j) tile[a * it.wp + j] = Acc(0);
  if (p.layout == state_layout::kv) {
    for (std::int64_t a = 0; a < p.K; ++a) {
      const Storage* src = pool + sp.pool.offset(slot, it.h, a) + it.b0;
      Acc* row = tile + a * it.wp;
      for (std::int64_t j = 0; j < it.w; ++j) row[j] = convert<Acc>(src[j]);
    }
  } else {
    for (std::int64_t j = 0; j < it.w; ++j) {
      const Storage* src = pool + sp.pool.offset(slot, it.h, it.b0 + j);
      for (std::int64_t a = 0; a < p.K; ++a) tile[a * it.wp + j] = convert<Acc>(src[a]);
    }
  }
  return {tile, it.wp, false};
}

/// Writes a scratch slice back to the pool (one rounding for bfloat16 storage).
template <class Acc, class Storage>
RECATTN_NOINLINE void close_slice(const step_problem& sp, const step_item& it, const state_slice<Acc>& s) {
  const std::int64_t slot = it.slot;
  if (s.direct) return;
  const problem& p = sp.tok;
  Storage* pool = static_cast<Storage*>(sp.pool_data());
  if (p.layout == state_layout::kv) {
    for (std::int64_t a = 0; a < p.K; ++a) {
      Storage* dst = pool + sp.pool.offset(slot, it.h, a) + it.b0;
      const Acc* row = s.S + a * it.wp;
      for (std::int64_t j = 0; j < it.w; ++j) dst[j] = convert<Storage>(row[j]);
    }
  } else {
    for (std::int64_t j = 0; j < it.w; ++j) {
      Storage* dst = pool + sp.pool.offset(slot, it.h, it.b0 + j);
      for (std::int64_t a = 0; a < p.K; ++a) dst[a] = convert<Storage>(s.S[a * it.wp + j]);
    }
  }
}

}  // namespace detail

/// The step for one compiled specialization (input dtype T, gate mask, state storage). `sp`
/// is checked; `c` resolved. Padding rows and empty rows are skipped before anything is read.
template <class T, unsigned Gates, class Storage>
void step_kernel(const step_problem& sp, const cfg& c) {
  using Acc = accum_t<T>;
  using Pol = forward_policy<Gates, false, false, state_layout::kv>;
  const problem& p = sp.tok;
  constexpr std::int64_t W = std::int64_t(xsimd::batch<Acc, arch>::size);
  const std::int64_t K = p.K, V = p.V;
  const std::int64_t Kp = detail::round_up(K, W);
  const std::int64_t bv = std::min(detail::round_up(std::max<std::int64_t>(c.block_v, 1), W), detail::round_up(V, W));
  const std::int64_t nvb = (V + bv - 1) / bv;
  // A row has at most T tokens (varlen: Ttot).
  const std::int64_t chunk = std::max<std::int64_t>(1, std::min<std::int64_t>(c.chunk, std::max<std::int64_t>(p.T, 1)));
  const std::int64_t items = p.N * p.H * nvb;
  const int threads = int(std::max<std::int64_t>(1, std::min<std::int64_t>(c.threads, items)));
  if (items == 0) return;
  const std::size_t per_thread = std::size_t(K * bv + 3 * chunk * Kp + 3 * chunk * bv);

  parallel_for(items, threads, [&](std::int64_t item, int) {
    detail::step_item it;
    const std::int64_t vb = item % nvb;
    it.h = (item / nvb) % p.H;
    it.n = item / (nvb * p.H);
    it.slot = sp.slot(it.n);
    if (it.slot < 0) return;  // padding row
    it.b0 = vb * bv;
    it.w = std::min(bv, V - it.b0);
    it.wp = detail::round_up(it.w, W);
    const std::int64_t begin = p.varlen ? p.seq_begin(it.n) : 0;
    const std::int64_t len = p.seq_len(it.n);
    it.batch = p.varlen ? 0 : it.n;
    if (len == 0) return;

    Acc* tile = detail::thread_scratch<Acc>(per_thread);
    detail::step_stage<Acc> sb;
    sb.Kp = Kp;
    sb.qs = tile + K * bv;
    sb.ks = sb.qs + chunk * Kp;
    sb.dks = sb.ks + chunk * Kp;
    sb.vs = sb.dks + chunk * Kp;
    sb.dvs = sb.vs + chunk * bv;
    sb.os = sb.dvs + chunk * bv;
    std::int64_t* tok = detail::thread_scratch<std::int64_t>(std::size_t(2 * chunk));
    std::int64_t* snap_slots = tok + chunk;
    detail::snapshot_sink sk;
    sk.sp = &sp;
    sk.slots = sp.snap.data ? snap_slots : nullptr;
    sk.h = it.h;
    sk.b0 = it.b0;
    sk.w = it.w;

    Acc gamma = Acc(0);
    if constexpr (Pol::has_g_gamma) gamma = load_as<Acc>(p.g_gamma.data, p.g_gamma.type, p.g_gamma.offset(it.n, it.h, 0));
    T* out = static_cast<T*>(p.out_data());
    if constexpr (!std::is_same<Storage, Acc>::value) {
      // One token on a [K, V] pool of whole registers: streamed in place, no scratch tile.
      if (len == 1 && p.layout == state_layout::kv && it.w == it.wp) {
        tok[0] = begin;
        if (sk.slots) snap_slots[0] = sp.snapshot_slot(it.batch, tok[0]);
        detail::stage_step_chunk<T, Gates>(p, it, tok, 1, gamma, sb);
        Storage* S = static_cast<Storage*>(sp.pool_data()) + sp.pool.offset(it.slot, it.h, 0) + it.b0;
        detail::step_stream_storage<Acc, Pol::decay_k, Pol::decay_v>(K, sb.qs, sb.ks, sb.dks, sb.vs, sb.dvs, it.wp, S,
                                                                   sp.pool.s2, sb.os, sk);
        detail::store_row(sb.os, it.w, out + p.out.offset(it.batch, tok[0], it.h) + it.b0);
        return;
      }
    }
    const detail::state_slice<Acc> S = detail::open_slice<Acc, Storage>(sp, it, tile);
    for (std::int64_t i0 = 0; i0 < len; i0 += chunk) {
      const std::int64_t cl = std::min(chunk, len - i0);
      for (std::int64_t l = 0; l < cl; ++l) tok[l] = begin + i0 + l;
      if (sk.slots)
        for (std::int64_t l = 0; l < cl; ++l) snap_slots[l] = sp.snapshot_slot(it.batch, tok[l]);
      detail::stage_step_chunk<T, Gates>(p, it, tok, cl, gamma, sb);
      detail::step_scan<Acc, Pol::decay_k, Pol::decay_v>(cl, K, sb.qs, sb.ks, sb.dks, Kp, sb.vs, sb.dvs, it.wp, S.S,
                                                         S.lds, sb.os, sk);
      for (std::int64_t l = 0; l < cl; ++l)
        detail::store_row(sb.os + l * it.wp, it.w, out + p.out.offset(it.batch, tok[l], it.h) + it.b0);
    }
    detail::close_slice<Acc, Storage>(sp, it, S);
  });
}

}  // namespace recattn::cpu
