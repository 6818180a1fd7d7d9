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
inline void convert_row(const void* src, dtype t, std::int64_t n, Acc* dst, Acc mul = Acc(1)) {
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
inline void exp_row(Acc* x, std::int64_t n, Acc add) {
  using B = xsimd::batch<Acc, arch>;
  const B addb(add);
  for (std::int64_t i = 0; i < n; i += std::int64_t(B::size)) xsimd::exp(B::load_aligned(x + i) + addb).store_aligned(x + i);
}

template <class T, class Acc>
inline void store_row(const Acc* src, std::int64_t n, T* dst) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = convert<T>(src[i]);
}

/// The recurrence over L staged tokens for one tile of NV registers of value columns.
/// qs, ks, dks: [L][ldk]; vs, dvs, os: [L][ldv] (tile columns at offset 0); S: [K][lds].
template <class Acc, bool DecayK, bool DecayV, int NV>
inline void scan_tile(std::int64_t L, std::int64_t K, const Acc* qs, const Acc* ks, const Acc* dks, std::int64_t ldk,
                      const Acc* vs, const Acc* dvs, std::int64_t ldv, Acc* S, std::int64_t lds, Acc* os) {
  using B = xsimd::batch<Acc, arch>;
  constexpr std::int64_t W = std::int64_t(B::size);
  for (std::int64_t l = 0; l < L; ++l) {
    B v[NV], dv[NV], acc[NV];
    for (int j = 0; j < NV; ++j) {
      v[j] = B::load_aligned(vs + l * ldv + j * W);
      if constexpr (DecayV) dv[j] = B::load_aligned(dvs + l * ldv + j * W);
      acc[j] = B(Acc(0));
    }
    const Acc* qr = qs + l * ldk;
    const Acc* kr = ks + l * ldk;
    const Acc* dr = dks + l * ldk;
    for (std::int64_t a = 0; a < K; ++a) {
      const B kb(kr[a]), qb(qr[a]);
      Acc* row = S + a * lds;
      if constexpr (DecayK) {
        const B db(dr[a]);
        for (int j = 0; j < NV; ++j) {
          B s = B::load_aligned(row + j * W);
          if constexpr (DecayV) s = xsimd::fma(s, db * dv[j], kb * v[j]);
          else s = xsimd::fma(s, db, kb * v[j]);
          s.store_aligned(row + j * W);
          acc[j] = xsimd::fma(qb, s, acc[j]);
        }
      } else {
        for (int j = 0; j < NV; ++j) {
          B s = B::load_aligned(row + j * W);
          if constexpr (DecayV) s = xsimd::fma(s, dv[j], kb * v[j]);
          else s = xsimd::fma(kb, v[j], s);
          s.store_aligned(row + j * W);
          acc[j] = xsimd::fma(qb, s, acc[j]);
        }
      }
    }
    for (int j = 0; j < NV; ++j) acc[j].store_aligned(os + l * ldv + j * W);
  }
}

template <class Acc, bool DecayK, bool DecayV>
inline void scan(std::int64_t L, std::int64_t K, const Acc* qs, const Acc* ks, const Acc* dks, std::int64_t ldk,
                 const Acc* vs, const Acc* dvs, std::int64_t ldv, Acc* S, std::int64_t lds, Acc* os) {
  constexpr std::int64_t W = std::int64_t(xsimd::batch<Acc, arch>::size);
  constexpr int NVmax = 4;
  std::int64_t j0 = 0;
  for (; j0 + NVmax * W <= ldv; j0 += NVmax * W)
    scan_tile<Acc, DecayK, DecayV, NVmax>(L, K, qs, ks, dks, ldk, vs + j0, dvs + j0, ldv, S + j0, lds, os + j0);
  switch ((ldv - j0) / W) {
    case 1: scan_tile<Acc, DecayK, DecayV, 1>(L, K, qs, ks, dks, ldk, vs + j0, dvs + j0, ldv, S + j0, lds, os + j0); break;
    case 2: scan_tile<Acc, DecayK, DecayV, 2>(L, K, qs, ks, dks, ldk, vs + j0, dvs + j0, ldv, S + j0, lds, os + j0); break;
    case 3: scan_tile<Acc, DecayK, DecayV, 3>(L, K, qs, ks, dks, ldk, vs + j0, dvs + j0, ldv, S + j0, lds, os + j0); break;
    default: break;
  }
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
  std::int64_t bv = std::min<std::int64_t>(Vp, 4 * W);
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

/// The forward pass for one compiled specialization. `p` is checked; `c` resolved.
template <class T, class Policy>
void forward_kernel(const problem& p, const cfg& c) {
  using Acc = accum_t<T>;
  using B = xsimd::batch<Acc, arch>;
  constexpr std::int64_t W = std::int64_t(B::size);
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
  const Acc scale = Acc(p.scale);
  const std::int64_t gq = p.H / p.Hq, gk_ = p.H / p.Hk, gv_ = p.H / p.Hv;

  parallel_for(items, threads, [&](std::int64_t item, int worker) {
    const std::int64_t vb = item % nvb;
    const std::int64_t h = (item / nvb) % p.H;
    const std::int64_t n = item / (nvb * p.H);
    const std::int64_t b0 = vb * bv;
    const std::int64_t w = std::min(bv, V - b0);  // real columns of this item
    const std::int64_t wp = detail::round_up(w, W);
    Acc* S = scratch.get() + per_thread * std::size_t(worker);
    Acc* qs = S + K * bv;
    Acc* ks = qs + chunk * Kp;
    Acc* dks = ks + chunk * Kp;
    Acc* vs = dks + chunk * Kp;
    Acc* dvs = vs + chunk * bv;
    Acc* os = dvs + chunk * bv;
    const recattn::detail::seqlen_info<Policy::varlen> seq(p, n);
    const std::int64_t bidx = seq.batch;

    // Load the state slice S[:, b0:b0+w] (zero padded).
    for (std::int64_t a = 0; a < K; ++a) {
      Acc* row = S + a * wp;
      for (std::int64_t j = 0; j < wp; ++j) row[j] = Acc(0);
      if (p.h0.data) {
        const Acc* src = static_cast<const Acc*>(p.h0.data);
        if constexpr (Policy::layout == state_layout::kv) {
          const Acc* s = src + p.h0.offset(n, h, a) + b0;
          for (std::int64_t j = 0; j < w; ++j) row[j] = s[j];
        } else {
          for (std::int64_t j = 0; j < w; ++j) row[j] = src[p.h0.offset(n, h, b0 + j) + a];
        }
      }
    }
    Acc gamma = Acc(0);
    if constexpr (Policy::has_g_gamma) gamma = load_as<Acc>(p.g_gamma.data, p.g_gamma.type, p.g_gamma.offset(n, h, 0));

    for (std::int64_t i0 = 0; i0 < seq.len; i0 += chunk) {
      const std::int64_t cl = std::min(chunk, seq.len - i0);
      // Stage the chunk.
      for (std::int64_t l = 0; l < cl; ++l) {
        const std::int64_t t = seq.template token<Policy::reverse>(i0 + l);
        Acc* qr = qs + l * Kp;
        Acc* kr = ks + l * Kp;
        detail::convert_row<Acc>(static_cast<const T*>(p.q.data) + p.q.offset(bidx, t, h / gq), p.type, K, qr, scale);
        detail::convert_row<Acc>(static_cast<const T*>(p.k.data) + p.k.offset(bidx, t, h / gk_), p.type, K, kr);
        if constexpr (Policy::decay_k) {
          Acc* dr = dks + l * Kp;
          Acc base = gamma;
          if constexpr (Policy::has_g) base += load_as<Acc>(p.g.data, p.g.type, p.g.offset(bidx, t, h));
          if constexpr (Policy::has_gk) {
            const std::size_t es = dtype_size(p.gk.type);
            detail::convert_row<Acc>(static_cast<const char*>(p.gk.data) + std::size_t(p.gk.offset(bidx, t, h)) * es,
                                     p.gk.type, K, dr);
            for (std::int64_t a = K; a < Kp; ++a) dr[a] = Acc(0);
            detail::exp_row(dr, Kp, base);
          } else {
            const Acc d = std::exp(base);
            for (std::int64_t a = 0; a < K; ++a) dr[a] = d;
          }
        }
        Acc* vr = vs + l * wp;
        detail::convert_row<Acc>(static_cast<const T*>(p.v.data) + p.v.offset(bidx, t, h / gv_) + b0, p.type, w, vr);
        for (std::int64_t j = w; j < wp; ++j) vr[j] = Acc(0);
        if constexpr (Policy::decay_v) {
          Acc* dr = dvs + l * wp;
          const std::size_t es = dtype_size(p.gv.type);
          detail::convert_row<Acc>(
              static_cast<const char*>(p.gv.data) + std::size_t(p.gv.offset(bidx, t, h) + b0) * es, p.gv.type, w, dr);
          for (std::int64_t j = w; j < wp; ++j) dr[j] = Acc(0);
          detail::exp_row(dr, wp, Acc(0));
        }
      }
      detail::scan<Acc, Policy::decay_k, Policy::decay_v>(cl, K, qs, ks, dks, Kp, vs, dvs, wp, S, wp, os);
      for (std::int64_t l = 0; l < cl; ++l) {
        const std::int64_t t = seq.template token<Policy::reverse>(i0 + l);
        detail::store_row(os + l * wp, w, static_cast<T*>(p.out_data()) + p.out.offset(bidx, t, h) + b0);
      }
    }

    if (p.ht.data) {
      Acc* dst = static_cast<Acc*>(p.ht_data());
      for (std::int64_t a = 0; a < K; ++a) {
        const Acc* row = S + a * wp;
        if constexpr (Policy::layout == state_layout::kv) {
          Acc* d = dst + p.ht.offset(n, h, a) + b0;
          for (std::int64_t j = 0; j < w; ++j) d[j] = row[j];
        } else {
          for (std::int64_t j = 0; j < w; ++j) dst[p.ht.offset(n, h, b0 + j) + a] = row[j];
        }
      }
    }
  });
}

}  // namespace recattn::cpu
