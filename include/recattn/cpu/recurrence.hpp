// The CPU forward kernel: one xsimd kernel for every gate policy, direction, layout, dtype
// and state layout.
//
// Work item = (sequence n, head h, block of value columns). An item keeps its K x block_v
// slice of the state in an aligned scratch tile (L1-resident for the default sizes) and walks
// its tokens in chunks: `stage` converts a chunk of q, k, v to the accumulator type and
// exponentiates its gates (so the inner loop sees only multiplies), then `scan_tile` runs the
// recurrence over the chunk, NV SIMD registers of value columns at a time:
//
//   for a in [0, K):  s = D[a, :] * s + k[a] * v ;  o += q[a] * s
//
// which is 3 vector operations per state element and token (2 without a decay).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
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

/// The recurrence over L staged tokens for one register tile: R key rows x NV SIMD
/// registers of value columns of the state stay in registers for the whole chunk, so the
/// state is never loaded or stored per token. Each row tile adds its rows' share of
/// q . S into the chunk's partial outputs `os` ([L][ldv], zeroed before the first tile).
/// qs, ks, dks: [L][ldk] starting at the tile's first row; vs, dvs: [L][ldv] at the tile's
/// first column; S: [R][lds] at the tile's corner.
template <class Acc, bool DecayK, bool DecayV, int R, int NV>
inline void scan_tile(std::int64_t L, const Acc* qs, const Acc* ks, const Acc* dks, std::int64_t ldk, const Acc* vs,
                      const Acc* dvs, std::int64_t ldv, Acc* S, std::int64_t lds, Acc* os) {
  using B = xsimd::batch<Acc, arch>;
  constexpr std::int64_t W = std::int64_t(B::size);
  B s[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) s[i][j] = B::load_aligned(S + i * lds + j * W);
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
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) s[i][j].store_aligned(S + i * lds + j * W);
}

/// Register tile sizes: RT key rows x NVT registers of value columns.
template <class Acc> struct tile_shape {
  static constexpr int rows = RECATTN_CPU_TILE_ROWS;
  static constexpr int regs = RECATTN_CPU_TILE_REGS;
};

/// The recurrence over one staged chunk for the item's whole state slice S [K][ldv]:
/// column tiles of NV registers, row tiles of R rows (remainders one row / one register
/// at a time).
template <class Acc, bool DecayK, bool DecayV>
RECATTN_NOINLINE void scan(std::int64_t L, std::int64_t K, const Acc* qs, const Acc* ks, const Acc* dks, std::int64_t ldk,
                 const Acc* vs, const Acc* dvs, std::int64_t ldv, Acc* S, Acc* os) {
  constexpr std::int64_t W = std::int64_t(xsimd::batch<Acc, arch>::size);
  constexpr int R = tile_shape<Acc>::rows, NV = tile_shape<Acc>::regs;
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t j = 0; j < ldv; ++j) os[l * ldv + j] = Acc(0);
  auto rows = [&](auto nv, std::int64_t j0) {
    constexpr int NVc = decltype(nv)::value;
    std::int64_t a = 0;
    for (; a + R <= K; a += R)
      scan_tile<Acc, DecayK, DecayV, R, NVc>(L, qs + a, ks + a, dks + a, ldk, vs + j0, dvs + j0, ldv, S + a * ldv + j0,
                                             ldv, os + j0);
    for (; a < K; ++a)
      scan_tile<Acc, DecayK, DecayV, 1, NVc>(L, qs + a, ks + a, dks + a, ldk, vs + j0, dvs + j0, ldv, S + a * ldv + j0,
                                             ldv, os + j0);
  };
  std::int64_t j0 = 0;
  for (; j0 + NV * W <= ldv; j0 += NV * W) rows(std::integral_constant<int, NV>{}, j0);
  for (; j0 < ldv; j0 += W) rows(std::integral_constant<int, 1>{}, j0);
}

}  // namespace detail

/// Columns of V per SIMD register for input type T.
template <class T>
constexpr int simd_width() { return int(xsimd::batch<accum_t<T>, arch>::size); }

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
  c.chunk = 32;
  return c;
}

/// Fills zero fields of `c` from the heuristic and checks the rest.
inline cfg cpu_resolve_cfg(const problem& p, const std::optional<cfg>& user) {
  cfg h = cpu_heuristic_cfg(p);
  if (!user) return h;
  cfg c = *user;
  if (c.threads < 0) recattn::detail::fail("cfg.threads", "a value >= 0 (0: all hardware threads)", c.threads);
  if (c.block_v < 0) recattn::detail::fail("cfg.block_v", "a value >= 0 (0: heuristic)", c.block_v);
  if (c.chunk < 0) recattn::detail::fail("cfg.chunk", "a value >= 0 (0: heuristic)", c.chunk);
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

/// One work item: sequence n, head h, value columns [b0, b0 + w) padded to wp.
struct work_item {
  std::int64_t n, h, b0, w, wp, batch;
};

/// S[a][j] = state[n, h][a][b0 + j] (zero padded to wp columns), in either layout.
template <state_layout Layout, class Acc>
RECATTN_NOINLINE void load_state(const problem& p, const work_item& it, Acc* S) {
  for (std::int64_t a = 0; a < p.K; ++a) {
    Acc* row = S + a * it.wp;
    for (std::int64_t j = 0; j < it.wp; ++j) row[j] = Acc(0);
    if (!p.h0.data) continue;
    const Acc* src = static_cast<const Acc*>(p.h0.data);
    if constexpr (Layout == state_layout::kv) {
      const Acc* s = src + p.h0.offset(it.n, it.h, a) + it.b0;
      for (std::int64_t j = 0; j < it.w; ++j) row[j] = s[j];
    } else {
      for (std::int64_t j = 0; j < it.w; ++j) row[j] = src[p.h0.offset(it.n, it.h, it.b0 + j) + a];
    }
  }
}

template <state_layout Layout, class Acc>
RECATTN_NOINLINE void store_state(const problem& p, const work_item& it, const Acc* S) {
  Acc* dst = static_cast<Acc*>(p.ht_data());
  for (std::int64_t a = 0; a < p.K; ++a) {
    const Acc* row = S + a * it.wp;
    if constexpr (Layout == state_layout::kv) {
      Acc* d = dst + p.ht.offset(it.n, it.h, a) + it.b0;
      for (std::int64_t j = 0; j < it.w; ++j) d[j] = row[j];
    } else {
      for (std::int64_t j = 0; j < it.w; ++j) dst[p.ht.offset(it.n, it.h, it.b0 + j) + a] = row[j];
    }
  }
}

/// Staging buffers of one worker for a chunk of tokens.
template <class Acc>
struct stage_buffers {
  Acc *qs, *ks, *dks;  ///< [chunk][Kp]: q * scale, k, exp(row decay)
  Acc *vs, *dvs, *os;  ///< [chunk][wp]: v, exp(gv), output
  std::int64_t Kp;
};

/// Converts the chunk's tokens `t[0..cl)` of the item to Acc and exponentiates its gates.
template <class T, unsigned Gates, class Acc>
RECATTN_NOINLINE void stage_chunk(const problem& p, const work_item& it, const std::int64_t* t, std::int64_t cl,
                                  Acc gamma, const stage_buffers<Acc>& sb) {
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

/// Asks for a row of `bytes` bytes to be brought into the cache ahead of use. The token
/// rows of one head are H rows apart in memory, a stride the hardware prefetcher does not
/// follow across pages; without this the kernel waits on memory a third of its time.
inline void prefetch_row(const void* row, std::size_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  const char* c = static_cast<const char*>(row);
  for (std::size_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
#else
  (void)row;
  (void)bytes;
#endif
}

/// Prefetches every input row that stage_chunk will read for tokens t[0..cl).
template <class T, unsigned Gates>
RECATTN_NOINLINE void prefetch_chunk(const problem& p, const work_item& it, const std::int64_t* t, std::int64_t cl) {
  using Pol = forward_policy<Gates, false, false, state_layout::kv>;
  const std::int64_t b = it.batch, h = it.h;
  const std::int64_t hq = h / (p.H / p.Hq), hk = h / (p.H / p.Hk), hv = h / (p.H / p.Hv);
  const std::size_t kb = std::size_t(p.K) * sizeof(T), vb = std::size_t(it.w) * sizeof(T);
  for (std::int64_t l = 0; l < cl; ++l) {
    prefetch_row(static_cast<const T*>(p.q.data) + p.q.offset(b, t[l], hq), kb);
    prefetch_row(static_cast<const T*>(p.k.data) + p.k.offset(b, t[l], hk), kb);
    prefetch_row(static_cast<const T*>(p.v.data) + p.v.offset(b, t[l], hv) + it.b0, vb);
    if constexpr (Pol::has_gk) {
      const std::size_t es = dtype_size(p.gk.type);
      prefetch_row(static_cast<const char*>(p.gk.data) + std::size_t(p.gk.offset(b, t[l], h)) * es, std::size_t(p.K) * es);
    }
    if constexpr (Pol::has_gv) {
      const std::size_t es = dtype_size(p.gv.type);
      prefetch_row(static_cast<const char*>(p.gv.data) + std::size_t(p.gv.offset(b, t[l], h) + it.b0) * es,
                   std::size_t(it.w) * es);
    }
  }
}

}  // namespace detail

/// The forward pass for one compiled specialization. `p` is checked; `c` resolved.
/// The specialization only steers (token order, varlen bounds, state layout, gates);
/// the work is in helpers shared by every specialization of one dtype.
template <class T, class Policy>
void forward_kernel(const problem& p, const cfg& c) {
  using Acc = accum_t<T>;
  constexpr std::int64_t W = std::int64_t(xsimd::batch<Acc, arch>::size);
  const std::int64_t K = p.K, V = p.V;
  const std::int64_t Kp = detail::round_up(K, W);
  const std::int64_t bv = std::min(detail::round_up(std::max<std::int64_t>(c.block_v, 1), W), detail::round_up(V, W));
  const std::int64_t nvb = (V + bv - 1) / bv;
  const std::int64_t chunk = std::max<std::int64_t>(1, c.chunk);
  const std::int64_t items = p.N * p.H * nvb;
  const int threads = int(std::max<std::int64_t>(1, std::min<std::int64_t>(c.threads, items)));
  if (items == 0) return;

  // All scratch is taken before anything is written: an allocation failure leaves the
  // caller's buffers as they were.
  const std::size_t per_thread = std::size_t(K * bv + 3 * chunk * Kp + 3 * chunk * bv);
  detail::aligned_buffer<Acc> scratch(per_thread * std::size_t(threads));
  std::vector<std::int64_t> token_buf(std::size_t(2 * chunk * threads));

  parallel_for(items, threads, [&](std::int64_t item, int worker) {
    detail::work_item it;
    const std::int64_t vb = item % nvb;
    it.h = (item / nvb) % p.H;
    it.n = item / (nvb * p.H);
    it.b0 = vb * bv;
    it.w = std::min(bv, V - it.b0);
    it.wp = detail::round_up(it.w, W);
    const recattn::detail::seqlen_info<Policy::varlen> seq(p, it.n);
    it.batch = seq.batch;

    Acc* S = scratch.get() + per_thread * std::size_t(worker);
    detail::stage_buffers<Acc> sb;
    sb.Kp = Kp;
    sb.qs = S + K * bv;
    sb.ks = sb.qs + chunk * Kp;
    sb.dks = sb.ks + chunk * Kp;
    sb.vs = sb.dks + chunk * Kp;
    sb.dvs = sb.vs + chunk * bv;
    sb.os = sb.dvs + chunk * bv;
    std::int64_t* tok = token_buf.data() + 2 * chunk * worker;
    std::int64_t* next = tok + chunk;

    detail::load_state<Policy::layout>(p, it, S);
    Acc gamma = Acc(0);
    if constexpr (Policy::has_g_gamma) gamma = load_as<Acc>(p.g_gamma.data, p.g_gamma.type, p.g_gamma.offset(it.n, it.h, 0));

    for (std::int64_t i0 = 0; i0 < seq.len; i0 += chunk) {
      const std::int64_t cl = std::min(chunk, seq.len - i0);
      for (std::int64_t l = 0; l < cl; ++l) tok[l] = seq.template token<Policy::reverse>(i0 + l);
      detail::stage_chunk<T, Policy::gates>(p, it, tok, cl, gamma, sb);
      // The next chunk's rows arrive while this one is scanned.
      const std::int64_t ncl = std::min(chunk, seq.len - i0 - cl);
      for (std::int64_t l = 0; l < ncl; ++l) next[l] = seq.template token<Policy::reverse>(i0 + cl + l);
      detail::prefetch_chunk<T, Policy::gates>(p, it, next, ncl);
      detail::scan<Acc, Policy::decay_k, Policy::decay_v>(cl, K, sb.qs, sb.ks, sb.dks, Kp, sb.vs, sb.dvs, it.wp, S, sb.os);
      T* out = static_cast<T*>(p.out_data());
      for (std::int64_t l = 0; l < cl; ++l)
        detail::store_row(sb.os + l * it.wp, it.w, out + p.out.offset(it.batch, tok[l], it.h) + it.b0);
    }
    if (p.ht.data) detail::store_state<Policy::layout>(p, it, S);
  });
}

}  // namespace recattn::cpu
