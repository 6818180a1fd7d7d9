// The CUDA backend of the forward operation: configuration (heuristic, candidates,
// checks; the choice between the recurrent kernel of recurrence.cuh and the chunked one of
// chunked.cuh), argument packing and the launch. Reached from recattn.hpp through
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
#include "chunked.cuh"

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
inline cfg recurrent_heuristic_cfg(const problem& p) {
  detail::check_sizes(p);
  const std::int64_t groups = (p.V + columns_per_warp - 1) / columns_per_warp;  // warps per head
  const int nw = int(std::min<std::int64_t>(8, detail::ceil_pow2(groups)));
  cfg c;
  c.num_warps = nw;
  c.block_v = nw * columns_per_warp;
  c.block_k = 16 * detail::rows_per_lane(p.K, p.type);
  c.chunk = detail::fit_chunk(p, nw, nw >= 4 ? 64 : 16);
  c.algo = algorithm::recurrent;
  return c;
}

namespace detail {

/// Why the chunked kernel cannot take p (null: it can).
inline const char* chunked_unsupported(const problem& p) {
  if (p.type == dtype::float64) return "recurrent for float64 inputs (the chunked kernel takes bfloat16 and float16)";
  if (p.type == dtype::float32)
    return "recurrent for float32 inputs (the chunked kernel takes bfloat16 and float16: tensor-core products in tf32 "
           "or bfloat16 cannot meet SPEC 6's 1e-4 for float)";
  return nullptr;
}

/// Tokens per sequence from which the chunked kernel is the automatic choice (bfloat16 and
/// half inputs, every gate; 0: never). Measured on an H100
/// (bench/README.md, 2026-12-05): with scalar gates or none the chunked kernel takes 0.28 to
/// 0.40 times the recurrent kernel's time on every issue-8 shape (T 2048 to 16384; 0.07 for
/// B1 T16384 H8, split); from 256 tokens a sequence it has four chunks or more. cfg.algo forces either kernel, and candidate_cfgs lists both for an autotuner.
#ifndef RECATTN_CUDA_CHUNKED_MIN_TOKENS
#define RECATTN_CUDA_CHUNKED_MIN_TOKENS 256
#endif
inline constexpr std::int64_t chunked_min_tokens = RECATTN_CUDA_CHUNKED_MIN_TOKENS;


/// gk's element size (0 without gk): the chunked kernel stages gk rows of 2 and 4 bytes.
inline int chunked_gk_es(const problem& p) { return p.has(gate_gk) ? int(dtype_size(p.gk.type)) : 0; }
/// gv's element size (0 without gv): its rows are staged.
inline int chunked_gv_es(const problem& p) { return p.has(gate_gv) ? int(dtype_size(p.gv.type)) : 0; }

inline std::size_t chunked_bytes(const problem& p, int bv, int chunk) {
  return make_chunked_layout(p.K, bv, chunk, false, p.has(gate_gk), chunked_gk_es(p), p.has(gate_gv), chunked_gv_es(p)).bytes;
}

/// The longest chunk the kernel is compiled for: 64, but 32 with gk and K > 128 (the gk scan
/// holds a state warp's share of a chunk in registers, twice as many row tiles there).
inline int chunked_max_chunk(const problem& p) { return p.has(gate_gk) && p.K > 128 ? 32 : 64; }

/// The shrinking of a chunked block that does not fit in shared memory: the value columns
/// first (then the chunk), except with gv, where the chunk gives way first. Measured on an
/// H100 (bench/README.md, 2026-12-06), B4 T4096 H16 K=V=128 (64 columns: 128 blocks, one
/// wave; 32: two): gk + gv, which does not fit 64 tokens x 64 columns, 0.88 ms at 32 x 64
/// against 1.27 at 64 x 32. gv alone fits 64 x 64 at K = 128 with bf16 gates (201640 bytes of
/// the 231424 budget since V~ replaced the factor tables, bench/README.md) and runs there.
inline void fit_chunked(const problem& p, int& bv, int& chunk, bool bv_free, bool chunk_free) {
  const std::size_t budget = smem_budget();
  while (chunk_free && p.has(gate_gv) && chunk > 32 && chunked_bytes(p, bv, chunk) > budget) chunk /= 2;
  while (bv_free && bv > 16 && chunked_bytes(p, bv, chunk) > budget) bv /= 2;
  while (chunk_free && chunk > 32 && chunked_bytes(p, bv, chunk) > budget) chunk /= 2;
}

/// Value columns of a chunked block: the fewest 16-column tiles that hold V, up to 64, halved
/// while the blocks of half as many columns still fit the multiprocessors in one wave (a block
/// fills an SM).
/// Measured on an H200 (bench/README.md, 2026-12-05): B4 T4096 H16 K=V=128 takes 0.50 ms at
/// 64 columns (128 blocks) and 0.84 at 32 (256 blocks, two waves); B1 T16384 H8 takes 2.24 ms
/// at 16 columns (64 blocks), 2.84 at 64 (16 blocks).
inline int chunked_block_v(const problem& p) {
  int bv = p.V <= 16 ? 16 : p.V <= 32 ? 32 : 64;
  const std::int64_t sms = sm_count();
  while (bv > 16 && p.N * p.H * ((p.V + bv / 2 - 1) / (bv / 2)) <= sms) bv /= 2;
  return bv;
}

/// Splits of each sequence (cfg.splits = 0): dense inputs whose blocks fill at most half the
/// multiprocessors get as many splits as fill them (one block each), of at least 256 tokens.
/// None with gv (the split-state pass carries key-side decays only).
inline int chunked_splits(const problem& p, int bv) {
  if (p.varlen || p.has(gate_gv)) return 1;
  const std::int64_t blocks = p.N * p.H * ((p.V + bv - 1) / bv), sms = sm_count();
  if (blocks == 0 || 2 * blocks > sms) return 1;
  const std::int64_t s = std::min(sms / blocks, p.T / 256);
  return int(std::max<std::int64_t>(1, s));
}

/// Tokens of a split: a multiple of 64 (both chunk lengths), the fewest that cover T in
/// `splits` parts; the launch runs ceil(T / split_tokens) splits.
inline std::int64_t chunked_split_tokens(std::int64_t T, int splits) {
  const std::int64_t units = (T + 63) / 64;
  return (units + splits - 1) / splits * 64;
}

/// Whether the chunked kernel pays for this problem: sequences of chunked_min_tokens or more.
/// gk included: measured on an H100 (bench/README.md, 2026-12-06 04:25), the chunked kernel
/// takes 0.57 / 1.53 ms (recurrent) at B4 T4096 H16 K=V=128, 0.40 / 1.14 at B8 T2048 H32
/// K=V=64, 0.53 / 6.10 at B1 T16384 H8 and 0.62 / 1.58 varlen 8 x 2048.
inline bool chunked_pays(const problem& p) {
  const std::int64_t per_seq = p.varlen ? (p.N > 0 ? p.T / p.N : 0) : p.T;
  return chunked_min_tokens > 0 && per_seq >= chunked_min_tokens;
}

}  // namespace detail

/// The chunked kernel's default: chunks of 64 tokens, 16 warps; value columns: with splits
/// (few long sequences, detail::chunked_splits) the fewest 16-column tiles that hold V up to
/// 64, else detail::chunked_block_v; shrunk (detail::fit_chunked) until the block
/// fits in shared memory.
inline cfg chunked_heuristic_cfg(const problem& p) {
  detail::check_sizes(p);
  cfg c;
  c.algo = algorithm::chunked;
  c.num_warps = detail::chunked_warps;
  c.block_k = int((p.K + 15) / 16 * 16);
  const int widest = p.V <= 16 ? 16 : p.V <= 32 ? 32 : 64;
  const int splits = detail::chunked_splits(p, widest);
  int bv = splits > 1 ? widest : detail::chunked_block_v(p), chunk = detail::chunked_max_chunk(p);
  detail::fit_chunked(p, bv, chunk, true, true);
  c.block_v = bv;
  c.chunk = chunk;
  c.splits = splits > 1 ? detail::chunked_splits(p, bv) : 1;
  return c;
}

/// The default: the chunked kernel where it can run and the sequences are long enough to pay
/// (detail::chunked_min_tokens), else the recurrent one.
inline cfg heuristic_cfg(const problem& p) {
  detail::check_sizes(p);
  if (!detail::chunked_unsupported(p) && detail::chunked_pays(p)) return chunked_heuristic_cfg(p);
  return recurrent_heuristic_cfg(p);
}

/// Checks a cfg that forces the chunked kernel and fills its zero fields.
inline cfg resolve_chunked_cfg(const problem& p, const cfg& u) {
  using recattn::detail::cat;
  using recattn::detail::fail;
  if (const char* why = detail::chunked_unsupported(p)) fail("cfg.algorithm", why, "chunked");
  const int Kp = int((p.K + 15) / 16 * 16);
  if (u.block_v != 0 && u.block_v != 16 && u.block_v != 32 && u.block_v != 64)
    fail("cfg.block_v", "0, 16, 32 or 64 with algorithm chunked", u.block_v);
  if (u.chunk != 0 && u.chunk != 32 && u.chunk != 64)
    fail("cfg.chunk", "0, 32 or 64 with algorithm chunked", u.chunk);
  if (u.num_warps != 0 && u.num_warps != detail::chunked_warps)
    fail("cfg.num_warps", cat("0 or ", detail::chunked_warps, " with algorithm chunked"), u.num_warps);
  if (u.block_k != 0 && u.block_k != Kp)
    fail("cfg.block_k", cat("0 or ", Kp, " with algorithm chunked (K rounded up to 16)"), u.block_k);
  if (u.chunk > detail::chunked_max_chunk(p))
    fail("cfg.chunk", "0 or 32 with algorithm chunked, gk and K > 128", u.chunk);
  if (u.splits < 0) fail("cfg.splits", "a value >= 0", u.splits);
  if (u.splits > 1 && p.varlen) fail("cfg.splits", "0 or 1 with cu_seqlens (splits take dense inputs)", u.splits);
  if (u.splits > 1 && p.has(gate_gv))
    fail("cfg.splits", "0 or 1 with gv (the chunked kernel's split pass takes g, g_gamma and gk)", u.splits);
  cfg c = u;
  const cfg h = chunked_heuristic_cfg(p);
  int bv = u.block_v ? u.block_v : u.splits == 1 ? detail::chunked_block_v(p) : h.block_v;
  int chunk = u.chunk ? u.chunk : detail::chunked_max_chunk(p);
  const std::size_t budget = detail::smem_budget();
  detail::fit_chunked(p, bv, chunk, !u.block_v, !u.chunk);
  const std::size_t bytes = detail::chunked_bytes(p, bv, chunk);
  if (bytes > budget) {
    const bool by_bv = u.block_v != 0;
    fail(by_bv ? "cfg.block_v" : "cfg.chunk",
         cat("a smaller value (block_v = ", bv, ", chunk = ", chunk, " with K = ", p.K, " needs ", bytes,
             " bytes of shared memory, the device allows ", budget, ")"),
         by_bv ? u.block_v : u.chunk);
  }
  c.algo = algorithm::chunked;
  c.block_v = bv;
  c.chunk = chunk;
  c.num_warps = detail::chunked_warps;
  c.block_k = Kp;
  c.splits = u.splits ? u.splits : bv == h.block_v ? h.splits : detail::chunked_splits(p, bv);
  return c;
}

/// Fills zero fields of `user` from the heuristic and checks the rest; throws for sizes the
/// kernel cannot take (K > 256). cfg.algo: `chunked` forces the chunked kernel (an Error
/// where it cannot run: float, double), `recurrent` the recurrent one; `automatic`
/// with every kernel field zero is the heuristic's choice, and with any of them set a
/// recurrent cfg (those fields' meaning before cfg.algo existed).
inline cfg resolve_cfg(const problem& p, const std::optional<cfg>& user) {
  if (!user) return heuristic_cfg(p);
  using recattn::detail::fail;
  if (user->threads < 0) fail("cfg.threads", "a value >= 0", user->threads);
  if (user->algo == algorithm::chunked) return resolve_chunked_cfg(p, *user);
  if (user->algo == algorithm::automatic && !user->block_v && !user->chunk && !user->block_k && !user->num_warps) {
    cfg c = heuristic_cfg(p);
    if (user->splits && c.algo == algorithm::chunked) {
      cfg u = *user;
      u.algo = algorithm::chunked;
      c = resolve_chunked_cfg(p, u);
    } else if (user->splits > 1) {
      fail("cfg.splits", "0 or 1 where the recurrent kernel runs (splits are the chunked kernel's)", user->splits);
    }
    c.threads = user->threads;
    return c;
  }
  const cfg h = recurrent_heuristic_cfg(p);
  cfg c = *user;
  c.algo = algorithm::recurrent;
  if (c.splits < 0 || c.splits > 1)
    fail("cfg.splits", "0 or 1 with the recurrent kernel (splits are the chunked kernel's)", c.splits);
  c.splits = 0;
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

/// The configurations an autotuner times: the heuristic's choice first; recurrent: warps per
/// block x chunk length; chunked (where it can run): chunk length x value columns that fit.
inline std::vector<cfg> candidate_cfgs(const problem& p) {
  std::vector<cfg> out;
  out.push_back(heuristic_cfg(p));
  const cfg h = recurrent_heuristic_cfg(p);
  if (std::find(out.begin(), out.end(), h) == out.end()) out.push_back(h);
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
  if (!detail::chunked_unsupported(p)) {
    const std::size_t budget = detail::smem_budget();
    const cfg ch = chunked_heuristic_cfg(p);
    for (int chunk : {32, 64})
      for (int bv : {16, 32, 64}) {
        if (chunk > detail::chunked_max_chunk(p)) continue;
        if (bv > 16 && bv / 2 >= p.V) continue;  // a block of padding columns
        if (detail::chunked_bytes(p, bv, chunk) > budget) continue;
        cfg c = ch;
        c.chunk = chunk;
        c.block_v = bv;
        for (int splits : {1, detail::chunked_splits(p, bv)}) {
          c.splits = splits;
          if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
        }
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

/// The kernel arguments both kernels read (value blocks of bv columns).
template <class Policy>
forward_params make_forward_params(const problem& p, const launch_args& a, int bv, int nvb) {
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
  return f;
}

struct cuda_backend {
  template <class T, class Policy>
  static void forward(const problem& p, const launch_args& a) {
    const int nw = a.c.num_warps;
    const int bv = nw * columns_per_warp;
    const int nvb = int((p.V + bv - 1) / bv);
    const std::int64_t blocks = p.N * p.H * nvb;
    if (blocks == 0) return;
    const smem_layout L = layout_for(p, nw, a.c.chunk);
    forward_params f = make_forward_params<Policy>(p, a, bv, nvb);
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
    constexpr bool scalar = kernel_traits<Policy>::scalar;
    if constexpr (std::is_same<T, double>::value) {
      launch(forward_kernel<T, row, col, scalar, 16>);  // double: correct at every K, speed not a goal
    } else {
      switch (rows_per_lane(p.K, p.type)) {
        case 4: launch(forward_kernel<T, row, col, scalar, 4>); break;
        case 8: launch(forward_kernel<T, row, col, scalar, 8>); break;
        default: launch(forward_kernel<T, row, col, scalar, 16>); break;
      }
    }
  }
};

/// The chunked kernel (chunked.cuh): bfloat16 and half, gates g, g_gamma and gk.
struct chunked_backend {
  template <class T, class Policy>
  static void forward(const problem& p, const launch_args& a) {
    if constexpr (!std::is_same<T, bfloat16>::value && !std::is_same<T, half>::value) {
      recattn::detail::fail("cfg.algorithm", chunked_unsupported(p), "chunked");
    } else {
      const int bv = a.c.block_v;
      const int nvb = int((p.V + bv - 1) / bv);
      if (p.N * p.H * nvb == 0) return;
      chunked_params P;
      P.f = make_forward_params<Policy>(p, a, bv, nvb);
      constexpr bool gk = Policy::has_gk, gv = Policy::has_gv;
      P.L = make_chunked_layout(p.K, bv, a.c.chunk, false, gk, chunked_gk_es(p), gv, chunked_gv_es(p));
      P.decay_rows = gk;
      P.N = p.N;
      const std::int64_t Bt = p.varlen ? 1 : p.B;
      P.out_pairs = row_align(p.out_data(), 2,
                              {Bt > 1 ? p.out.s0 * 2 : 0, p.T > 1 ? p.out.s1 * 2 : 0, p.H > 1 ? p.out.s2 * 2 : 0}) >= 4;
      // Splits (dense inputs): split_tokens a multiple of 64, ceil(T / split_tokens) splits.
      if (!p.varlen && a.c.splits > 1 && p.T > 64) {
        P.split_tokens = chunked_split_tokens(p.T, a.c.splits);
        P.nsplit = int((p.T + P.split_tokens - 1) / P.split_tokens);
      }
      const std::int64_t blocks = p.N * p.H * nvb * P.nsplit;
      // The split workspace: the state entering each split (slot 0: the initial state), then
      // the splits' decay factors; stream-ordered, freed after the launches.
      void* ws = nullptr;
      if (P.nsplit > 1) {
        const std::int64_t slots = p.N * p.H * P.nsplit;
        const std::size_t state_bytes = std::size_t(slots * p.K * p.V) * sizeof(float);
        const std::int64_t factors = p.N * p.H * (P.nsplit - 1) * (gk ? p.K : 1);
        check(cudaMallocAsync(&ws, state_bytes + std::size_t(factors) * sizeof(float), a.stream),
              "cudaMallocAsync(chunked split workspace)");
        P.split_state = static_cast<float*>(ws);
        P.split_decay = reinterpret_cast<float*>(static_cast<char*>(ws) + state_bytes);
      }
      auto launch = [&](auto kernel, const chunked_params& Q, std::int64_t nblocks, int warps) {
        if (Q.L.bytes > 48 * 1024)
          check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Q.L.bytes)),
                "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
        kernel<<<unsigned(nblocks), unsigned(32 * warps), Q.L.bytes, a.stream>>>(Q);
        check(cudaGetLastError(), "chunked forward kernel launch");
      };
      constexpr int gate = gk                                     ? chunked_gk_decay
                           : Policy::has_g || Policy::has_g_gamma ? chunked_scalar_decay
                                                                  : chunked_no_decay;
      auto by_bv = [&](auto chunk, auto ms, auto local) {
        constexpr int C = decltype(chunk)::value, MS = decltype(ms)::value;
        constexpr bool LOCAL = decltype(local)::value;
        chunked_params Q = P;
        if (LOCAL) Q.L = make_chunked_layout(p.K, bv, C, true, gk, chunked_gk_es(p), false);
        const std::int64_t nb = LOCAL ? blocks / P.nsplit * (P.nsplit - 1) : blocks;
        const int warps = LOCAL ? chunked_warps - chunked_out_warps : chunked_warps;
        if constexpr (gk && MS == 2 && C == 64) {
          recattn::detail::fail("cfg.chunk", "32 with gk and K > 128 (resolve_cfg's choice)", C);
        } else if constexpr (gv && LOCAL) {
          recattn::detail::fail("cfg.splits", "0 or 1 with gv (resolve_cfg's choice)", P.nsplit);
        } else {
          switch (bv) {
            case 16: launch(chunked_forward_kernel<T, C, 16, gate, MS, LOCAL, gv>, Q, nb, warps); break;
            case 32: launch(chunked_forward_kernel<T, C, 32, gate, MS, LOCAL, gv>, Q, nb, warps); break;
            default: launch(chunked_forward_kernel<T, C, 64, gate, MS, LOCAL, gv>, Q, nb, warps); break;
          }
        }
      };
      // State row tiles a state warp: one up to K = 128 (8 warps of 16 rows), two beyond.
      auto by_ms = [&](auto f) {
        if (P.L.Kp <= 16 * (chunked_warps - chunked_out_warps)) f(std::integral_constant<int, 1>());
        else f(std::integral_constant<int, 2>());
      };
      try {
        if (P.nsplit > 1) {
          // Pass 1 (chunks of 64: split_tokens is a multiple of 64), the combine, then pass 2.
          by_ms([&](auto ms) {
            if constexpr (gk && decltype(ms)::value == 2) by_bv(std::integral_constant<int, 32>(), ms, std::true_type());
            else by_bv(std::integral_constant<int, 64>(), ms, std::true_type());
          });
          const std::int64_t total = p.N * p.H * p.K * p.V;
          const std::int64_t cb = std::min<std::int64_t>((total + 255) / 256, std::int64_t(sm_count()) * 8);
          chunked_combine_kernel<<<unsigned(cb), 256, 0, a.stream>>>(P);
          check(cudaGetLastError(), "chunked combine kernel launch");
        }
        by_ms([&](auto ms) {
          if (a.c.chunk == 32) by_bv(std::integral_constant<int, 32>(), ms, std::false_type());
          else by_bv(std::integral_constant<int, 64>(), ms, std::false_type());
        });
      } catch (...) {
        if (ws) (void)cudaFreeAsync(ws, a.stream);
        throw;
      }
      if (ws) check(cudaFreeAsync(ws, a.stream), "cudaFreeAsync(chunked split workspace)");
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
  const bool chunked = c.algo == algorithm::chunked;
  if (chunked) {
    if (const char* why = detail::chunked_unsupported(p)) recattn::detail::fail("cfg.algorithm", why, "chunked");
    if (c.num_warps != detail::chunked_warps || (c.chunk != 32 && c.chunk != 64) || c.chunk > detail::chunked_max_chunk(p) ||
        (c.block_v != 16 && c.block_v != 32 && c.block_v != 64))
      recattn::detail::fail("cfg", "a configuration from cuda::resolve_cfg", c.str());
  } else if (c.num_warps < 1 || c.num_warps > 8 || c.chunk < 4 || c.chunk % 4 || c.chunk > 32 * c.num_warps) {
    recattn::detail::fail("cfg", "a configuration from cuda::resolve_cfg", c.str());
  }

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
    if (chunked) recattn::detail::dispatch_forward<detail::chunked_backend>(p, a);
    else recattn::detail::dispatch_forward<detail::cuda_backend>(p, a);
  } catch (...) {
    if (cu_tmp) (void)cudaFreeAsync(cu_tmp, a.stream);
    throw;
  }
  if (cu_tmp) detail::check(cudaFreeAsync(cu_tmp, a.stream), "cudaFreeAsync(cu_seqlens)");
}

}  // namespace recattn::cuda
