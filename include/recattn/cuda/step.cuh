// The CUDA decode step: a streaming kernel over the state pool (issue 6). Only compiled by nvcc.
//
// A step reads and writes every state once and does a few flops per element, so the kernel is
// built for memory throughput, which on a GPU means many bytes in flight per SM. A block owns
// a tile of one (row, head) state: [K, V] pool, all K key rows x cw value columns; [V, K] pool,
// a run of value rows x all K columns. Its first act is to issue asynchronous 16-byte copies
// (cp.async, L2 only) of the whole tile into shared memory: the tile costs no registers, so
// a block can have 32-64 KiB of loads in flight and an SM several blocks (the register-held
// design before it, 32 elements a thread and 3 blocks an SM, kept ~96 KiB in flight and
// reached 79 % of the copy bandwidth with float state, 43 % with bfloat16; this one, 128
// threads and a 32 KiB tile, 6 blocks an SM, ~91 % and ~80 %, bench/README.md). Each thread copies
// and later reads back only its own vectors (vector v of thread t at tile[v * threads + t]:
// consecutive lanes, consecutive 16 bytes, no bank conflicts), so the tile needs no barrier of
// its own. While the copies fly, the block stages q * scale, k, the row decays
// exp(g + g_gamma + gk) and the block's v, exp(gv) of the token in shared memory. The update
// runs from the tile; on the row's last token each vector goes straight from registers to the
// pool with a streaming store, otherwise back into the tile. Arithmetic is in float (double
// for double inputs); bfloat16 storage is converted on read and rounded once on store.
//
//   [K, V] pool: a state row (one key index) is contiguous over V. TPR lanes cover the
//   block's cw = TPR * VEC value columns; row group rg of the block's RP takes the NR key
//   rows rg * NR .. rg * NR + NR - 1 (K <= RP * NR). o[b] sums over the key rows: each thread
//   over its rows, then the row groups of a warp by shuffles, then the warps through shared
//   memory. On a row's last token without a snapshot (the common decode step) each updated
//   vector goes from registers straight to the pool.
//   [V, K] pool: a state row (one value index) is contiguous over K. TPR lanes cover the K
//   columns in NC passes; the block's RP row groups take value rows in NR passes. o[b] sums
//   along the row: each thread over its columns, then a shuffle over the TPR lanes.
//
// The gates are block-uniform runtime flags, not template parameters: an absent decay is a
// staged factor of 1 (s * 1 is exact), which costs one multiply per element in a kernel that
// waits on memory, and keeps the variants at dtype x storage x layout (the CPU step, which
// is not memory-bound per element in the same way, has them as template parameters).
//
// Index values: with step_options::check_index_values (the default), make_step_problem copies
// device-resident state_indices and snapshot_indices to the host (stream-ordered on
// opt.stream, then a synchronisation) and rejects out-of-range and duplicate values before
// anything is launched. With it off (an engine's hot path) the kernel still skips a row whose
// slot is >= P and a snapshot whose slot is >= Ps (nothing is written out of bounds), but
// duplicate slots race: the caller guarantees they are distinct.
#pragma once

#include <cstdint>
#include <optional>
#include <type_traits>

#include "../cfg.hpp"
#include "../dtype.hpp"
#include "../error.hpp"
#include "../step_problem.hpp"
#include "common.cuh"

namespace recattn::cuda {

/// The kernel's arguments: plain values, no host-only members.
struct step_params {
  const void *q, *k, *v, *g, *g_gamma, *gk, *gv;
  dtype g_type, gamma_type, gk_type, gv_type;
  std::int64_t q_s0, q_s1, q_s2, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2;
  std::int64_t g_s0, g_s1, g_s2, gamma_s0, gamma_s1;
  std::int64_t gk_s0, gk_s1, gk_s2, gv_s0, gv_s1, gv_s2;
  void* out;
  std::int64_t out_s0, out_s1, out_s2;
  void* pool;
  std::int64_t P, pool_s0, pool_s1, pool_s2;
  const void* indices;  ///< null: row n uses slot n
  bool index_int64;
  std::int64_t index_stride;
  void* snap;  ///< null: no snapshots
  std::int64_t Ps, snap_s0, snap_s1, snap_s2;
  const void* snap_indices;
  bool snap_int64;
  std::int64_t snap_is0, snap_is1;
  const void* cu_seqlens;  ///< device memory; null: dense rows of T tokens
  bool cu_int64;
  std::int64_t T;
  int H, gq, gkh, gvh;  ///< H, H / Hq, H / Hk, H / Hv
  int K, V;
  int tpr;   ///< lanes per state row (power of 2, <= 32)
  int nr;    ///< row passes of a thread
  int nc;    ///< column passes of a thread ([V, K]; 1 for [K, V])
  int nblk;  ///< column blocks ([K, V]) or value-row blocks ([V, K]) per head
  float scale;
  double scale_d;
};

/// Largest block of the step kernel, and the most 16-byte tile vectors a thread copies (a
/// block's tile is at most 256 x 16 x 16 bytes = 64 KiB of shared memory).
inline constexpr int step_max_threads = 256;
inline constexpr int step_max_vectors = 16;
/// The heuristic's block: 128 threads of 16 vectors, a 32 KiB tile (6 blocks and 192 KiB of
/// copies in flight per SM; 256 threads of 8 vectors, 4 blocks an SM, were slower). It takes
/// 256 threads only when the rows need them.
#ifndef RECATTN_CUDA_STEP_THREADS
#define RECATTN_CUDA_STEP_THREADS 128
#endif
#ifndef RECATTN_CUDA_STEP_TILE_VECTORS
#define RECATTN_CUDA_STEP_TILE_VECTORS 16
#endif
inline constexpr int step_threads = RECATTN_CUDA_STEP_THREADS;
inline constexpr int step_tile_vectors = RECATTN_CUDA_STEP_TILE_VECTORS;
static_assert(step_threads % 32 == 0 && step_threads <= 256 && step_tile_vectors >= 1 && step_tile_vectors <= 16,
              "RECATTN_CUDA_STEP_THREADS: a multiple of 32 up to 256; RECATTN_CUDA_STEP_TILE_VECTORS: 1 to 16");
/// Blocks of step_max_threads an SM must hold: at most 64 registers a thread.
inline constexpr int step_min_blocks = 4;
/// Programmatic dependent launch (1, the default): the step is launched with programmatic
/// stream serialization, waits for the grids before it (griddepcontrol.wait) before it reads
/// anything, and lets the next grid launch once all its blocks have started. Its blocks are
/// then placed on the SMs while the grid before it drains, instead of after it: back-to-back
/// steps took 0.100 -> 0.098 ms (bfloat16 state) and 0.190 -> 0.188 ms (float) on an H100
/// (bench/README.md). 0: a plain launch.
#ifndef RECATTN_CUDA_STEP_PDL
#define RECATTN_CUDA_STEP_PDL 1
#endif

namespace detail {

/// Elements of state storage S per 16-byte vector.
template <class S> inline constexpr int step_vec = int(16 / sizeof(S));

template <class Acc, class S>
__device__ __forceinline__ void unpack_vec(const uint4& raw, Acc (&x)[step_vec<S>]) {
  if constexpr (std::is_same<S, bfloat16>::value && std::is_same<Acc, float>::value) {
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};  // two bfloat16 a word, low first
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
    const S* e = reinterpret_cast<const S*>(&raw);
#pragma unroll
    for (int i = 0; i < step_vec<S>; ++i) x[i] = to_acc<Acc>(e[i]);
  }
}

template <class S, class Acc>
__device__ __forceinline__ uint4 pack_vec(const Acc (&x)[step_vec<S>]) {
  uint4 raw;
  if constexpr (std::is_same<S, bfloat16>::value && std::is_same<Acc, float>::value) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // one cvt.rn.bf16x2.f32 per pair: the rounding of from_acc
      const __nv_bfloat162 b = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
      w[i] = *reinterpret_cast<const unsigned*>(&b);
    }
    raw = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    S* e = reinterpret_cast<S*>(&raw);
#pragma unroll
    for (int i = 0; i < step_vec<S>; ++i) e[i] = from_acc<S>(x[i]);
  }
  return raw;
}

/// A key row's coefficients in a [K, V] step: q * scale, k, the row decay; one aligned load.
template <class Acc> struct alignas(4 * sizeof(Acc)) key_coef {
  Acc q, k, d, pad;
};

/// Whether a step stages its key rows as key_coef (a bfloat16 [K, V] pool) rather than as
/// three arrays: the kernel's shared-memory layout and step_launch_shape's size both ask here.
constexpr bool step_packs_key_rows(bool vk, bool bf16_state) { return !vk && bf16_state; }

/// How a step scales the state: no decay; a decay per key row (g, g_gamma, gk); one per key
/// row and one per value column (gv). Block-uniform: the update loop is compiled for each.
enum step_decay : int { decay_none, decay_rows, decay_both };
template <int M> using decay_tag = std::integral_constant<int, M>;

__device__ __forceinline__ std::int64_t load_index(const void* p, bool is64, std::int64_t i) {
  return is64 ? static_cast<const std::int64_t*>(p)[i] : std::int64_t(static_cast<const std::int32_t*>(p)[i]);
}

/// The fast update loop of a bfloat16 [K, V] pool (the row's last token, no snapshot): the
/// thread's nrow consecutive key rows, one 16-byte vector (8 value columns) each, straight to
/// the pool. The arithmetic of the generic loop in step_kernel, in the same order (the results
/// are bit-identical), with leaner addressing: the key_coef, tile and pool pointers advance by
/// an increment a row (no 64-bit multiply a store), and with CS > 0 the tile's row stride (the
/// block's threads) is a constant, so that the unrolled body reads at immediate offsets. Its
/// bfloat16 elements take 6.4 -> 5.2 SASS instructions each (decay_rows), 0.0764 -> 0.0760 ms
/// on issue 6's case (bench/README.md).
#ifndef RECATTN_CUDA_STEP_BF16_UNROLL
#define RECATTN_CUDA_STEP_BF16_UNROLL 8
#endif
template <int M, int CS>
__device__ __forceinline__ void update_bf16_fast(const key_coef<float>* cf, const uint4* src, int stride_rt, uint4* dst,
                                               std::int64_t dstep, int nrow, const float (&vr)[8], const float (&dvr)[8],
                                               float (&o)[8]) {
  const int stride = CS > 0 ? CS : stride_rt;
  constexpr int unroll = RECATTN_CUDA_STEP_BF16_UNROLL;
#pragma unroll unroll
  for (int j = 0; j < nrow; ++j) {
    const key_coef<float> c = *cf;
    float x[8];
    unpack_vec<float, bfloat16>(*src, x);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if constexpr (M == decay_both) x[e] = fmaf(x[e], c.d * dvr[e], c.k * vr[e]);
      else if constexpr (M == decay_rows) x[e] = fmaf(x[e], c.d, c.k * vr[e]);
      else x[e] = fmaf(c.k, vr[e], x[e]);
      o[e] = fmaf(c.q, x[e], o[e]);
    }
    __stcs(dst, pack_vec<bfloat16>(x));  // not read again
    ++cf;
    src += stride;
    dst += dstep;
  }
}

/// One step for one (row, head, block). T: input dtype; S: state storage; VK: [V, K] pool.
template <class T, class S, bool VK>
__global__ void __launch_bounds__(step_max_threads, step_min_blocks) step_kernel(const step_params p) {
  using Acc = std::conditional_t<std::is_same<T, double>::value, double, float>;
  constexpr int VEC = step_vec<S>;
  extern __shared__ __align__(32) unsigned char smem_raw[];

#if RECATTN_CUDA_STEP_PDL
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the grids before this one are done
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const int tpr = p.tpr, nthreads = int(blockDim.x), rp = nthreads / tpr;
  const int tid = int(threadIdx.x);
  const int lane_r = tid & (tpr - 1), rg = tid / tpr;
  const int nr = p.nr, nc = VK ? p.nc : 1;
  const std::int64_t blk = blockIdx.x % p.nblk;
  const int h = int((blockIdx.x / p.nblk) % p.H);
  const std::int64_t n = std::int64_t(blockIdx.x) / (std::int64_t(p.nblk) * p.H);
  const std::int64_t slot = p.indices ? load_index(p.indices, p.index_int64, n * p.index_stride) : n;
  if (slot < 0 || slot >= p.P) return;  // padding row (or, unchecked, out of range: skipped)
  std::int64_t t0 = 0, len = p.T, bidx = n;
  if (p.cu_seqlens) {
    t0 = load_index(p.cu_seqlens, p.cu_int64, n);
    len = load_index(p.cu_seqlens, p.cu_int64, n + 1) - t0;
    bidx = 0;
  }
  if (len <= 0) return;

  // The thread's vector (j, i), j < nr, i < nc, in the pool's own layout: state row
  // row0 + j * rstep, columns col0 + i * cw .. + VEC (a row length is a multiple of VEC,
  // checked by step_launch_shape: a vector is whole). [K, V]: rows are key indices, nr
  // consecutive ones a thread (its q, k and decays are adjacent in shared memory), the
  // block's columns start at blk * cw; [V, K]: rows are value indices from blk * rp * nr,
  // rp apart.
  const int cw = tpr * VEC;
  const int r0 = VK ? int(blk) * rp * nr : 0;
  const int c0 = VK ? 0 : int(blk) * cw;
  const int rstep = VK ? rp : 1;
  const int row0 = VK ? r0 + rg : rg * nr, col0 = c0 + lane_r * VEC;
  const int rows_total = VK ? p.V : p.K, cols_total = VK ? p.K : p.V;
  // Rows and columns grow with j and i: the thread's vectors inside the state are
  // j < nrow, i < ncol.
  const int nrow = row0 < rows_total ? min(nr, (rows_total - row0 + rstep - 1) / rstep) : 0;
  const int ncol = col0 < cols_total ? min(nc, (cols_total - col0 + cw - 1) / cw) : 0;
  const std::int64_t s2 = p.pool_s2;

  S* pool = static_cast<S*>(p.pool) + slot * p.pool_s0 + std::int64_t(h) * p.pool_s1;
  // The whole tile in one commit group (vector v = j * nc + i); the first token waits for it
  // once its staging is done.
  uint4* tile = reinterpret_cast<uint4*>(smem_raw);
  for (int j = 0; j < nrow; ++j)
    for (int i = 0; i < ncol; ++i)
      cp_async<16>(tile + (j * nc + i) * nthreads + tid, pool + std::int64_t(row0 + j * rstep) * s2 + col0 + i * cw, 16);
  cp_async_commit();

  // Shared memory after the tile (a multiple of 512 bytes): q * scale, k and the row decay
  // as three arrays [K]; with a bfloat16 [K, V] pool, the same as one array of {q * scale,
  // k, decay, 0} [K] instead (key_coef: a thread reads a key row's three in one load; with
  // twice the elements per 16-byte vector, the bfloat16 update is short of instructions, not
  // registers: 0.0781 -> 0.0768 ms on the H200; the float state, packed too, spilled and
  // slowed down, 0.1393 -> 0.1412 ms, bench/README.md). Then the block's v and column decay
  // [vw] (vw = cw value columns for [K, V], rp * nr value rows for [V, K], from v0); [K, V]:
  // the partial outputs of the warps [nthreads / 32][cw].
  constexpr bool packed = step_packs_key_rows(VK, std::is_same<S, bfloat16>::value);
  const int vw = VK ? rp * nr : cw;
  const std::int64_t v0 = VK ? r0 : c0;
  Acc* qs = reinterpret_cast<Acc*>(tile + nr * nc * nthreads);
  Acc* ks = qs + p.K;
  Acc* dks = ks + p.K;
  key_coef<Acc>* coef = reinterpret_cast<key_coef<Acc>*>(qs);
  Acc* vs = qs + (packed ? 4 : 3) * p.K;
  Acc* dvs = vs + vw;
  Acc* red = dvs + vw;
  const int hq = h / p.gq, hk = h / p.gkh, hv = h / p.gvh;
  const Acc scale = std::is_same<Acc, double>::value ? Acc(p.scale_d) : Acc(p.scale);
  Acc gamma = Acc(0);
  if (p.g_gamma) gamma = load_any<Acc>(p.g_gamma, p.gamma_type, n * p.gamma_s0 + h * p.gamma_s1);
  const bool decay_k = p.g || p.g_gamma || p.gk, decay_v = p.gv != nullptr;

  for (std::int64_t l = 0; l < len; ++l) {
    const std::int64_t t = t0 + l;
    __syncthreads();  // the previous token's staging and partial sums are consumed
    {
      const T* qr = static_cast<const T*>(p.q) + bidx * p.q_s0 + t * p.q_s1 + hq * p.q_s2;
      const T* kr = static_cast<const T*>(p.k) + bidx * p.k_s0 + t * p.k_s1 + hk * p.k_s2;
      const T* vr = static_cast<const T*>(p.v) + bidx * p.v_s0 + t * p.v_s1 + hv * p.v_s2;
      Acc base = gamma;
      if (p.g) base += load_any<Acc>(p.g, p.g_type, bidx * p.g_s0 + t * p.g_s1 + h * p.g_s2);
      const Acc dk_scalar = decay_k && !p.gk ? exp_acc(base) : Acc(1);
      for (int a = tid; a < p.K; a += nthreads) {
        const Acc qa = scale * to_acc<Acc>(qr[a]), ka = to_acc<Acc>(kr[a]);
        const Acc da = p.gk ? exp_acc(base + load_any<Acc>(p.gk, p.gk_type, bidx * p.gk_s0 + t * p.gk_s1 + h * p.gk_s2 + a))
                            : dk_scalar;
        if constexpr (!packed) {
          qs[a] = qa;
          ks[a] = ka;
          dks[a] = da;
        } else {
          coef[a] = key_coef<Acc>{qa, ka, da, Acc(0)};
        }
      }
      for (int j = tid; j < vw; j += nthreads) {
        const std::int64_t b = v0 + j;
        const bool in = b < p.V;
        vs[j] = in ? to_acc<Acc>(vr[b]) : Acc(0);
        dvs[j] = in && decay_v ? exp_acc(load_any<Acc>(p.gv, p.gv_type, bidx * p.gv_s0 + t * p.gv_s1 + h * p.gv_s2 + b))
                               : Acc(1);
      }
    }
    __syncthreads();
    // Before the first token reads the tile: the thread's own copies have landed (no other
    // thread reads them).
    if (l == 0) cp_async_wait<0>();

    // Where the updated vectors go: the pool on the row's last token, else back to the tile;
    // and the snapshot slot of this token, if any.
    const bool last = l == len - 1;
    S* sn = nullptr;
    if (p.snap) {
      const std::int64_t ss = load_index(p.snap_indices, p.snap_int64, bidx * p.snap_is0 + t * p.snap_is1);
      if (ss >= 0 && ss < p.Ps) sn = static_cast<S*>(p.snap) + ss * p.snap_s0 + std::int64_t(h) * p.snap_s1;
    }
    auto put = [&](int j, int i, const uint4& raw) {
      const int row = row0 + j * rstep, col = col0 + i * cw;
      if (last) __stcs(reinterpret_cast<uint4*>(pool + std::int64_t(row) * s2 + col), raw);  // not read again
      else tile[(j * nc + i) * nthreads + tid] = raw;
      if (sn) __stcs(reinterpret_cast<uint4*>(sn + std::int64_t(row) * p.snap_s2 + col), raw);
    };

    T* out = static_cast<T*>(p.out) + bidx * p.out_s0 + t * p.out_s1 + std::int64_t(h) * p.out_s2;
    if constexpr (!VK) {
      // The thread's VEC columns are the same in every pass: v and exp(gv) in registers.
      const int cl = lane_r * VEC;
      Acc vr[VEC], dvr[VEC], o[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        vr[e] = vs[cl + e];
        dvr[e] = dvs[cl + e];
        o[e] = Acc(0);
      }
      // Fast: the row's last token and no snapshot, the common decode step: each vector goes
      // from registers to the pool along a pointer, nothing else.
      auto update = [&](auto mode, auto fast) {
        constexpr int M = decltype(mode)::value;
        constexpr bool fast_path = decltype(fast)::value;
        if constexpr (packed && fast_path) {
          uint4* dst = reinterpret_cast<uint4*>(pool + std::int64_t(row0) * s2 + col0);
          if (nthreads == step_threads)
            update_bf16_fast<M, step_threads>(coef + row0, tile + tid, nthreads, dst, s2 / VEC, nrow, vr, dvr, o);
          else
            update_bf16_fast<M, 0>(coef + row0, tile + tid, nthreads, dst, s2 / VEC, nrow, vr, dvr, o);
        } else
        {
          const key_coef<Acc>* cf = coef + row0;
          const Acc *qa_p = qs + row0, *ka_p = ks + row0, *da_p = dks + row0;
          (void)cf, (void)qa_p, (void)ka_p, (void)da_p;  // one of the two sets is unused
          const uint4* src = tile + tid;
          uint4* dst = reinterpret_cast<uint4*>(pool + std::int64_t(row0) * s2 + col0);
          const std::int64_t dstep = s2 / VEC;  // a row in 16-byte vectors (s2 % VEC == 0)
#pragma unroll 2
          for (int j = 0; j < nrow; ++j) {
            Acc qa, ka, da;
            if constexpr (packed) {
              const key_coef<Acc> c = cf[j];
              qa = c.q, ka = c.k, da = c.d;
            } else {
              qa = qa_p[j], ka = ka_p[j], da = da_p[j];
            }
            Acc x[VEC];
            unpack_vec<Acc, S>(src[j * nthreads], x);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              if constexpr (M == decay_both) x[e] = fma(x[e], da * dvr[e], ka * vr[e]);
              else if constexpr (M == decay_rows) x[e] = fma(x[e], da, ka * vr[e]);
              else x[e] = fma(ka, vr[e], x[e]);
              o[e] = fma(qa, x[e], o[e]);
            }
            if constexpr (fast_path) __stcs(dst + j * dstep, pack_vec<S>(x));  // not read again
            else put(j, 0, pack_vec<S>(x));
          }
        }
      };
      auto run = [&](auto fast) {
        if (decay_v) update(decay_tag<decay_both>{}, fast);
        else if (decay_k) update(decay_tag<decay_rows>{}, fast);
        else update(decay_tag<decay_none>{}, fast);
      };
      if (ncol) {
        if (last && !sn) run(std::true_type{});
        else run(std::false_type{});
      }
      // Row groups of a warp (lanes tpr apart) by shuffles, then the warps in shared memory.
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        for (int m = 16; m >= tpr; m /= 2) o[e] += __shfl_xor_sync(0xffffffffu, o[e], m);
      const int warp = tid / 32, nwarps = nthreads / 32;
      if ((tid & 31) < tpr) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) red[warp * cw + cl + e] = o[e];
      }
      __syncthreads();
      for (int c = tid; c < cw; c += nthreads) {
        const std::int64_t b = c0 + c;
        if (b >= p.V) continue;
        Acc x = Acc(0);
        for (int w = 0; w < nwarps; ++w) x += red[w * cw + c];
        out[b] = from_acc<T>(x);
      }
    } else {
      for (int j = 0; j < nr; ++j) {
        const int bl = rg + j * rp;  // value row, local to the block
        const Acc vb = vs[bl], db = dvs[bl];
        Acc o = Acc(0);
        auto update = [&](auto mode) {
          constexpr int M = decltype(mode)::value;
#pragma unroll 2
          for (int i = 0; i < ncol; ++i) {
            const int c = col0 + i * cw;
            Acc x[VEC];
            unpack_vec<Acc, S>(tile[(j * nc + i) * nthreads + tid], x);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              if constexpr (M == decay_both) x[e] = fma(x[e], dks[c + e] * db, ks[c + e] * vb);
              else if constexpr (M == decay_rows) x[e] = fma(x[e], dks[c + e], ks[c + e] * vb);
              else x[e] = fma(ks[c + e], vb, x[e]);
              o = fma(qs[c + e], x[e], o);
            }
            put(j, i, pack_vec<S>(x));
          }
        };
        if (j < nrow) {
          if (decay_v) update(decay_tag<decay_both>{});
          else if (decay_k) update(decay_tag<decay_rows>{});
          else update(decay_tag<decay_none>{});
        }
        // The tpr lanes of a row are consecutive lanes of one warp; every lane of the block
        // is here (rows past V hold zeros).
        for (int m = tpr / 2; m > 0; m /= 2) o += __shfl_xor_sync(0xffffffffu, o, m, tpr);
        const std::int64_t b = r0 + bl;
        if (lane_r == 0 && b < p.V) out[b] = from_acc<T>(o);
      }
    }
  }
}

/// The launch shape of a step: lanes per state row, passes, threads and blocks per head,
/// shared memory.
struct step_shape {
  int tpr = 1, nr = 1, nc = 1, threads = 32, nblk = 1;
  std::size_t smem = 0;
};

inline int pow2_at_least(std::int64_t x) {
  int r = 1;
  while (r < x) r *= 2;
  return r;
}

inline int pow2_at_most(std::int64_t x) {
  int r = 1;
  while (2 * std::int64_t(r) <= x) r *= 2;
  return r;
}

inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

inline int round_up_warp(std::int64_t x) { return int((x + 31) / 32 * 32); }

}  // namespace detail

/// Checks the sizes and alignment the CUDA step needs and returns its launch shape.
/// `user`: cfg.block_v, when set, is the value columns of a block ([K, V]; a power of 2 times
/// the 16-byte vector, at most 32 vectors) or the value rows of a block ([V, K]). `sms`: the
/// device's multiprocessors (0: unknown); a step with fewer than two blocks per
/// multiprocessor splits the state into smaller tiles.
inline detail::step_shape step_launch_shape(const step_problem& sp, const std::optional<cfg>& user = std::nullopt,
                                            int sms = 0) {
  using recattn::detail::cat;
  using recattn::detail::fail;
  using detail::ceil_div;
  using detail::round_up_warp;
  const problem& p = sp.tok;
  const int es = int(dtype_size(sp.state_type));
  const int VEC = 16 / es;
  const bool vk = p.layout == state_layout::vk;
  const std::int64_t cols = vk ? p.K : p.V;
  auto aligned = [&](const void* data, std::int64_t s0, std::int64_t s1, std::int64_t s2) {
    return reinterpret_cast<std::uintptr_t>(data) % 16 == 0 && s0 % VEC == 0 && s1 % VEC == 0 && s2 % VEC == 0;
  };
  if (cols % VEC || !aligned(sp.pool.data, sp.pool.s0, sp.pool.s1, sp.pool.s2))
    fail("state_pool", cat("16-byte aligned rows on platform cuda (data aligned to 16 bytes, strides and the last dimension multiples of ",
                           VEC, " ", dtype_name(sp.state_type), " elements)"),
         cat("last dimension ", cols, ", strides [", sp.pool.s0, ", ", sp.pool.s1, ", ", sp.pool.s2, "]"));
  if (sp.snap.data && !aligned(sp.snap.data, sp.snap.s0, sp.snap.s1, sp.snap.s2))
    fail("snapshots", "16-byte aligned rows on platform cuda (like state_pool)",
         cat("strides [", sp.snap.s0, ", ", sp.snap.s1, ", ", sp.snap.s2, "]"));
  const int block_v = user ? user->block_v : 0;
  if (block_v < 0) fail("cfg.block_v", "a value >= 0 (0: heuristic)", block_v);
  const int maxt = step_max_threads, maxv = step_max_vectors;
  const std::int64_t heads = p.N * p.H;
  auto few_blocks = [&](std::int64_t nblk) { return sms > 0 && heads * nblk < 2 * std::int64_t(sms); };
  detail::step_shape sh;
  // `rows` state rows of a block over row groups of tpr lanes, nc column passes: the fewest
  // threads (step_threads, else step_max_threads) whose passes fit step_max_vectors.
  auto fit_rows = [&](std::int64_t rows) {
    for (const int base : {step_threads, maxt}) {
      const std::int64_t rp = base / sh.tpr, nr = ceil_div(rows, rp);
      if (nr * sh.nc <= maxv) {
        sh.nr = int(nr);
        sh.threads = round_up_warp(std::int64_t(sh.tpr) * ceil_div(rows, nr));
        return true;
      }
    }
    return false;
  };
  if (!vk) {
    // K rows over rp row groups x nr passes; V columns over tpr lanes (blocks across V).
    const std::int64_t max_k = std::int64_t(maxt) * maxv;
    if (p.K > max_k)
      fail("query", cat("K <= ", max_k, " on platform cuda with a [K, V] pool (", maxv, " state vectors per thread, ", maxt,
                        " threads)"), cat("K = ", p.K));
    sh.nc = 1;
    if (block_v) {
      const int t = block_v / VEC;
      const std::int64_t most = std::min<std::int64_t>(32, maxt * maxv / p.K);  // lanes whose rows fit
      if (block_v % VEC || t > most || (t & (t - 1)))
        fail("cfg.block_v", cat("a power of 2 times ", VEC, " columns, at most ", detail::pow2_at_most(std::max<std::int64_t>(1, most)) * VEC,
                                " for K = ", p.K, " (0: heuristic)"), block_v);
      sh.tpr = t;
    } else {
      // A tile of step_threads x step_tile_vectors vectors: K rows x tpr lanes.
      const std::int64_t want = std::int64_t(step_threads) * step_tile_vectors / p.K;  // lanes
      sh.tpr = detail::pow2_at_most(std::max<std::int64_t>(1, std::min<std::int64_t>(want, 32)));
      sh.tpr = std::min(sh.tpr, detail::pow2_at_least(ceil_div(cols, VEC)));
      while (sh.tpr > 1 && few_blocks(ceil_div(p.V, std::int64_t(sh.tpr) * VEC))) sh.tpr /= 2;
    }
    (void)fit_rows(p.K);  // K <= max_k and tpr <= maxt * maxv / K: 256 threads fit
    sh.nblk = int(ceil_div(p.V, std::int64_t(sh.tpr) * VEC));
  } else {
    // K columns over tpr lanes x nc passes; value rows over rp row groups x nr passes.
    const std::int64_t max_k = 32 * std::int64_t(VEC) * maxv;
    if (p.K > max_k)
      fail("query", cat("K <= ", max_k, " on platform cuda with a [V, K] ", dtype_name(sp.state_type),
                        " pool (32 lanes x ", maxv * VEC, " keys per state row)"), cat("K = ", p.K));
    sh.tpr = std::min(32, detail::pow2_at_least(ceil_div(p.K, VEC)));
    sh.nc = int(ceil_div(p.K, std::int64_t(sh.tpr) * VEC));
    std::int64_t rows;  // value rows of a block
    if (block_v) {
      const std::int64_t most = std::int64_t(maxt / sh.tpr) * (maxv / sh.nc);
      if (block_v > most)
        fail("cfg.block_v", cat("at most ", most, " value rows per block for K = ", p.K, " with a [V, K] pool (0: heuristic)"),
             block_v);
      rows = block_v;
    } else {
      const std::int64_t rp = step_threads / sh.tpr;
      rows = std::min<std::int64_t>(rp * std::max(1, step_tile_vectors / sh.nc), p.V);
      while (rows > rp && few_blocks(ceil_div(p.V, rows))) rows = std::max<std::int64_t>(rp, rows / 2);
      while (rows > 1 && rows <= rp && few_blocks(ceil_div(p.V, rows))) rows = ceil_div(rows, 2);
    }
    (void)fit_rows(rows);  // rows <= (maxt / tpr) * (maxv / nc): 256 threads fit
    sh.nblk = int(ceil_div(p.V, std::int64_t(sh.threads / sh.tpr) * sh.nr));
  }
  const std::size_t acc = p.type == dtype::float64 ? 8 : 4;
  const int rp = sh.threads / sh.tpr;
  const int vw = vk ? rp * sh.nr : sh.tpr * VEC;
  const std::size_t tile = std::size_t(sh.nr) * std::size_t(sh.nc) * std::size_t(sh.threads) * 16;
  const bool packed = detail::step_packs_key_rows(vk, sp.state_type == dtype::bfloat16);
  sh.smem = tile + acc * std::size_t((packed ? 4 : 3) * p.K + 2 * vw + (vk ? 0 : std::int64_t(sh.threads / 32) * sh.tpr * VEC));
  if (heads * std::int64_t(sh.nblk) > (std::int64_t(1) << 31) - 1)
    fail("query", "fewer than 2^31 (row, head, block) work items on platform cuda", cat("N = ", p.N, ", H = ", p.H));
  return sh;
}

namespace detail {

inline void require_device_step(const char* name, const void* ptr) {
  if (ptr && !is_device_pointer(ptr)) recattn::detail::fail(name, "device (or managed) memory on platform cuda", "host memory");
}

inline step_params make_step_params(const step_problem& sp, const step_shape& sh) {
  const problem& p = sp.tok;
  step_params f{};
  f.q = p.q.data, f.k = p.k.data, f.v = p.v.data;
  f.q_s0 = p.q.s0, f.q_s1 = p.q.s1, f.q_s2 = p.q.s2;
  f.k_s0 = p.k.s0, f.k_s1 = p.k.s1, f.k_s2 = p.k.s2;
  f.v_s0 = p.v.s0, f.v_s1 = p.v.s1, f.v_s2 = p.v.s2;
  f.g = p.has(gate_g) ? p.g.data : nullptr;
  f.g_type = p.g.type, f.g_s0 = p.g.s0, f.g_s1 = p.g.s1, f.g_s2 = p.g.s2;
  f.g_gamma = p.has(gate_g_gamma) ? p.g_gamma.data : nullptr;
  f.gamma_type = p.g_gamma.type, f.gamma_s0 = p.g_gamma.s0, f.gamma_s1 = p.g_gamma.s1;
  f.gk = p.has(gate_gk) ? p.gk.data : nullptr;
  f.gk_type = p.gk.type, f.gk_s0 = p.gk.s0, f.gk_s1 = p.gk.s1, f.gk_s2 = p.gk.s2;
  f.gv = p.has(gate_gv) ? p.gv.data : nullptr;
  f.gv_type = p.gv.type, f.gv_s0 = p.gv.s0, f.gv_s1 = p.gv.s1, f.gv_s2 = p.gv.s2;
  f.out = p.out_data();
  f.out_s0 = p.out.s0, f.out_s1 = p.out.s1, f.out_s2 = p.out.s2;
  f.pool = sp.pool_data();
  f.P = sp.P;
  f.pool_s0 = sp.pool.s0, f.pool_s1 = sp.pool.s1, f.pool_s2 = sp.pool.s2;
  f.indices = sp.indices;
  f.index_int64 = sp.index_type == dtype::int64;
  f.index_stride = sp.index_stride;
  f.snap = sp.snap_data();
  f.Ps = sp.Ps;
  f.snap_s0 = sp.snap.s0, f.snap_s1 = sp.snap.s1, f.snap_s2 = sp.snap.s2;
  f.snap_indices = sp.snap_indices;
  f.snap_int64 = sp.snap_index_type == dtype::int64;
  f.snap_is0 = sp.snap_s0, f.snap_is1 = sp.snap_s1;
  f.cu_seqlens = p.varlen ? p.cu_seqlens : nullptr;
  f.cu_int64 = p.cu_type == dtype::int64;
  f.T = p.T;
  f.H = int(p.H), f.gq = int(p.H / p.Hq), f.gkh = int(p.H / p.Hk), f.gvh = int(p.H / p.Hv);
  f.K = int(p.K), f.V = int(p.V);
  f.tpr = sh.tpr;
  f.nr = sh.nr;
  f.nc = sh.nc;
  f.nblk = sh.nblk;
  f.scale = float(p.scale);
  f.scale_d = p.scale;
  return f;
}

/// Launches the kernel of one (input dtype, storage, layout).
template <class T, class S, bool VK>
void launch_step(const step_params& f, const step_shape& sh, std::int64_t blocks, cudaStream_t stream) {
  auto kernel = step_kernel<T, S, VK>;
  // As much shared memory as the SM has (the tiles, not L1, hold the loads in flight).
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, int(cudaSharedmemCarveoutMaxShared)),
        "cudaFuncSetAttribute(PreferredSharedMemoryCarveout)");
  if (sh.smem > 48 * 1024)
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sh.smem)),
          "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
#if RECATTN_CUDA_STEP_PDL
  cudaLaunchConfig_t lc{};
  lc.gridDim = dim3(unsigned(blocks));
  lc.blockDim = dim3(unsigned(sh.threads));
  lc.dynamicSmemBytes = sh.smem;
  lc.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  lc.attrs = attr;
  lc.numAttrs = 1;
  check(cudaLaunchKernelEx(&lc, kernel, f), "step kernel launch");
#else
  kernel<<<unsigned(blocks), unsigned(sh.threads), sh.smem, stream>>>(f);
  check(cudaGetLastError(), "step kernel launch");
#endif
}

/// The step's own dispatch: input dtype x state storage x layout (the gates and varlen are
/// runtime values of the kernel), with the caps of dispatch.hpp and step_problem.hpp.
inline void dispatch_cuda_step(const step_problem& sp, const step_shape& sh, cudaStream_t stream) {
  const problem& p = sp.tok;
  if (RECATTN_DISABLE_VARLEN && p.varlen)
    throw Error("cu_seqlens (RECATTN_DISABLE_VARLEN): this build was compiled without it");
  if (RECATTN_DISABLE_VK_STATE && p.layout == state_layout::vk)
    throw Error("state_layout vk (RECATTN_DISABLE_VK_STATE): this build was compiled without it");
  const step_params f = make_step_params(sp, sh);
  const std::int64_t blocks = p.N * p.H * sh.nblk;
  if (blocks == 0) return;
  recattn::detail::dtype_switch(p.type, [&](auto tag) {
    using T = decltype(tag);
    using Acc = accum_t<T>;
    RECATTN_BOOL_SWITCH_CAPPED(sp.state_type == dtype::bfloat16,
                               (RECATTN_DISABLE_BF16_STATE || std::is_same<T, double>::value),
                               "state_pool dtype bfloat16 (RECATTN_DISABLE_BF16_STATE)", Bf16, [&] {
      using S = std::conditional_t<Bf16, bfloat16, Acc>;
      RECATTN_BOOL_SWITCH_CAPPED(p.layout == state_layout::vk, RECATTN_DISABLE_VK_STATE,
                                 "state_layout vk (RECATTN_DISABLE_VK_STATE)", VK, [&] {
        launch_step<T, S, VK>(f, sh, blocks, stream);
      });
    });
  });
}

}  // namespace detail

/// Runs a checked step on the GPU: token tensors, output, pool, snapshots and indices in
/// device (or managed) memory; cu_seqlens may be host memory (then copied to a stream-ordered
/// allocation, freed after the launch: the one case that allocates). Asynchronous on opt.stream.
inline void run_step(const step_problem& sp, const step_options& opt) {
  const problem& p = sp.tok;
  const detail::step_shape sh = step_launch_shape(sp, opt.cfg, detail::sm_count());
  detail::require_device_step("query", p.q.data);
  detail::require_device_step("key", p.k.data);
  detail::require_device_step("value", p.v.data);
  detail::require_device_step("output", p.out.data);
  detail::require_device_step("state_pool", sp.pool.data);
  if (p.has(gate_g)) detail::require_device_step("g", p.g.data);
  if (p.has(gate_g_gamma)) detail::require_device_step("g_gamma", p.g_gamma.data);
  if (p.has(gate_gk)) detail::require_device_step("gk", p.gk.data);
  if (p.has(gate_gv)) detail::require_device_step("gv", p.gv.data);
  detail::require_device_step("state_indices", sp.indices);
  detail::require_device_step("snapshots", sp.snap.data);
  detail::require_device_step("snapshot_indices", sp.snap_indices);
  const cudaStream_t stream = static_cast<cudaStream_t>(opt.stream);
  step_problem dev = sp;
  void* cu_tmp = nullptr;
  if (p.varlen && !is_device_pointer(p.cu_seqlens)) {
    const std::size_t bytes = std::size_t(p.N + 1) * dtype_size(p.cu_type);
    detail::check(cudaMallocAsync(&cu_tmp, bytes, stream), "cudaMallocAsync(cu_seqlens)");
    const cudaError_t e = cudaMemcpyAsync(cu_tmp, p.cu_seqlens, bytes, cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess) {
      (void)cudaFreeAsync(cu_tmp, stream);
      detail::check(e, "cudaMemcpyAsync(cu_seqlens)");
    }
    dev.tok.cu_seqlens = cu_tmp;
  }
  try {
    detail::dispatch_cuda_step(dev, sh, stream);
  } catch (...) {
    if (cu_tmp) (void)cudaFreeAsync(cu_tmp, stream);
    throw;
  }
  if (cu_tmp) detail::check(cudaFreeAsync(cu_tmp, stream), "cudaFreeAsync(cu_seqlens)");
}

}  // namespace recattn::cuda
