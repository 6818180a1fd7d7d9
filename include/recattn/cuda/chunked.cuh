// The chunked CUDA forward (issue 8): tensor-core products over chunks of C tokens, for
// bfloat16 and half inputs and every gate (g, g_gamma, gk, gv and their unions).
//
// A thread block of 16 warps owns one (sequence n, head h, block of BV value columns) and
// walks the sequence's chunks in processing order. With G_i the cumulative log decay from the
// chunk's first token to token i (inclusive) and G_C its value at the chunk's last token,
// SPEC §1's recurrence (S_t = d_t S_{t-1} + k_t^T v_t, o_t = scale q_t S_t) unrolled over a
// chunk is
//   o_i = scale * ( e^{G_i} q_i S  +  sum_{j<=i} e^{G_i - G_j} (q_i . k_j) v_j )
//   S  <- e^{G_C} S + sum_j e^{G_C - G_j} k_j^T v_j
// Products are mma.sync m16n8k16 (16-bit operands from ldmatrix, float accumulators), and
// every accumulator stays in registers. The warps have two roles, each in its own loop (so
// each keeps only its own registers live; a named barrier a chunk joins them):
//   - 8 state warps hold the state block S [Kp x BV] (Kp = K rounded up to 16) in float by
//     16-row tiles (state warp w: row tile w, and w + 8 when K > 128: MS tiles, a
//     compile-time count), every column. Each chunk: S *= e^{G_C}, then S += K~^T V with K~
//     the k rows scaled by e^{G_C - G_j} (in the ldmatrix'd operand registers, rounded to the
//     input dtype); then S rounded to the input dtype into shared memory (S~, the operand of
//     the next chunk's Q S~).
//   - 8 output warps: the chunk's C x BV outputs as (C / 16) row tiles, each split over WPM
//     warps by columns (NTW 8-column tiles a warp). The warp of row tile m forms
//     A = Q_m K^T over tokens 0 .. 16 m + 15 in registers, masks it with e^{G_i - G_j}
//     (j <= i), and feeds the accumulators straight back as the A operand of A V (the
//     flash-attention register trick); O = e^{G_i} Q_m S~ + A V.
// Splitting the roles (against 8 warps doing both) doubled the warps a scheduler can pick
// from and took B4 T4096 H16 from 0.53 to 0.47 ms with g on an H100 (bench/README.md).
// q, k, v of chunk c + 1 are copied into the other of two raw stages by cp.async while chunk
// c is computed (zero-filled past the sequence end and past K or BV; by the state warps alone
// without gk or gv, by every warp with them), S~ is double buffered,
// so one barrier a chunk orders everything. With scalar gates one state warp (the scanner)
// scans chunk c + 1's log decays after its work on chunk c (a warp scan in double, kept as
// G log2(e) in float for exp2) into the other of two scan buffers, with the factor tables of
// the decay mask: where no decay in the chunk grows and none is zero, the mask is taken as
// e^{G_i - G_r} e^{G_r - G_j} (r the first row of i's 16-row tile; both <= 1 off the
// diagonal tile, and on it bounded by 2^chunked_gk_fast_log2 or the chunk is formed
// elementwise), two multiplies an element instead of an exp2, a compare and selects.
// The kernel is compiled per chunk length (32, 64), value block (16, 32, 64), whether a
// scalar decay is present (without one: no scan, no factors, only the causal mask) and state
// row tiles a warp (MS: 1 up to K = 128, 2 up to 256).
//
// Splits (cfg.splits, dense inputs): when few sequences and heads leave most multiprocessors
// idle, each sequence is cut into splits of a multiple of 64 tokens and run in three launches:
// the split-state pass (LOCAL: state warps only, each split but the last from a zero state,
// its final state and total decay factor into a workspace), chunked_combine_kernel (the state
// entering each split: S_{s+1} = d_s S_s + L_s, a short scan over the splits), then the
// kernel above on every split at once from its entering state. B1 T16384 H8: see
// bench/README.md.
//
// A decay of exactly 0 (log decay -inf, or below -1e4, where exp is 0 in float and double)
// never forms e^{-inf - (-inf)}: the scan counts such tokens (a segment index), and a factor
// across one of them is exactly 0; other factors are exp2 of differences of cumulative sums
// (summed in double, differenced in float: for |G| up to 2560 over a chunk, strong decays of
// -40 a token, the factor's relative error stays below 2e-4). Positive log decays grow the
// factors like the reference's.
//
// gk (GATE = chunked_gk_decay; g and g_gamma folded in): the decay is per key channel a, so G
// becomes a table B[i][a] (log2 units) that the state warps scan for chunk c + 1 while chunk c
// is computed (double buffered beside S~, so the one barrier still orders everything). The
// gk rows of chunk c + 1 (16- and 32-bit gk) are copied into shared memory by cp.async at the
// start of chunk c, each state warp the 16-channel columns it scans (so it waits for its own
// copies only); a scan that loaded them itself waited for each of its 32 loads in turn (H100
// profile, 2026-12-05: gk 1.36 -> 0.95 ms at B4 T4096 H16):
//   o_i = scale * ( (q_i e^{B_i}) S  +  sum_{j<=i} (q_i e^{B_i - B_r} . k_j e^{B_r - B_j}) v_j )
//   S  <- diag(e^{B_C}) S + sum_j (k_j e^{B_C - B_j})^T v_j
// with r the row before the query's 16-row tile (fla's sub-chunking): for key tiles before the
// query tile both factors are <= 1 (decays <= 1), so neither overflows, and what underflows is
// below what the product would be. On the diagonal tile the k factor grows (up to the decay
// over 15 tokens): the scan flags a tile where any |B_i - B_r| passes 2^64 and that tile's
// 16 x 16 block is then formed elementwise (q_ia k_ja e^{B_i[a] - B_j[a]}, CUDA cores);
// otherwise it takes the tensor cores like the others. The products of A = Q~ K~^T read
// bfloat16 operands for both input dtypes (2^64 is far past half's range). A token's log
// decay is clamped below at -80 (e^-80 is 0 at SPEC §6's tolerances), so -inf never meets
// -inf. Splits carry a decay factor per key channel.
//
// gv (the template flag GV, beside any GATE): the decay per value column b of the block makes
// a second table D[l][b] (log2 units, stored [b][l], double buffered like gk's), scanned by
// the state warps for chunk c + 1 at the end of chunk c from its gv rows, staged in shared
// memory by cp.async at the start of chunk c:
//   o_i[b] = scale * ( e^{D_i[b]} (q~_i S)[b]  +  sum_{j<=i} A_ij e^{D_i[b] - D_j[b]} v_j[b] )
//   S[:, b] <- e^{D_C[b]} S[:, b] + sum_j k~_j^T (v_j[b] e^{D_C[b] - D_j[b]})
// with A and k~ those of the key-side gates. The state warps form V~ = v e^{D_C - D_j} (factors
// <= 1) in shared memory, each element once over the 8 of them, and scale S's columns. The
// output warps take the factor in two parts about the row tile's reference row r: v_j scaled by
// e^{D_r - D_j} in the operand registers (<= 1 for the key tiles before the diagonal one), the
// sum (and the inter-chunk term, first scaled by e^{D_r}) by e^{D_i - D_r} <= 1 after A V. On
// the diagonal tile e^{D_r - D_j} grows with the decay over up to 15 tokens: the warp takes it
// on the tensor cores while every |D_j - D_r| over its columns stays within
// chunked_gk_fast_log2, else adds that tile's terms elementwise (A_ij from the lanes of the
// quad, factors e^{D_i - D_j} <= 1). Those A V products read bfloat16 operands for both input
// dtypes (2^64 is far past half's range). With bfloat16 inputs, a chunk whose every |D_C - D_j|
// is within that bound (the scan's flags) skips all of this: the output warps read the state
// warps' V~ = v e^{D_C - D_j} as the v operand, every tile on the tensor cores, and take
// e^{D_i - D_C} after A V (the inter-chunk term first scaled by e^{D_C}). No sequence splits with gv
// (the split-state pass carries key-side decays only): chunked_splits is 1 there.
//
// Accuracy: the products read 16-bit operands (q, k, v as given; A, the scaled k rows and the
// state S~ rounded to the input dtype each chunk); S itself accumulates in float. Measured
// against the double reference this stays inside SPEC §6's 1e-2 for bfloat16 and half. Float
// inputs are not taken (neither tf32 nor bfloat16 products can meet §6's 1e-4 for float);
// double neither: the dispatcher takes the recurrent kernel for them, and a cfg that forces
// chunked is a recattn::Error, as for gv.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../dtype.hpp"
#include "common.cuh"
#include "recurrence.cuh"

namespace recattn::cuda {

namespace detail {

/// Warps of a chunked block.
inline constexpr int chunked_warps = 16;
/// Of them, the warps that form the outputs; the others hold the state.
inline constexpr int chunked_out_warps = 8;

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
  /// Two scans of the scalar decays (chunk c in buffer c & 1, written by the scanning warp
  /// during chunk c - 1); what a buffer holds and where: chunked_scan_buffer.
  unsigned off_scan = 0;
  unsigned scan_bytes = 0;
  // gk: two tables of the chunk's cumulative log2 decays per key channel, [C][ldb] float, and
  // two sets of fallback flags (a word per state warp: bit m, row tile m needs the fallback).
  int ldb = 0;
  unsigned off_tab = 0, tab_bytes = 0, off_flag = 0;
  // gk in 16 or 32 bits: the chunk's gk rows as given, [C][gk_pitch bytes], copied by cp.async
  // beside the q, k, v stage (0 bytes: read from global memory by the scan itself: doubles).
  unsigned off_gks = 0, gks_bytes = 0, gk_pitch = 0;
  // gv: two tables (the state warps scan chunk c + 1 into one while chunk c reads the other)
  // of the chunk's cumulative log2 decays per value column of the block, D^T [BV][ldt] float.
  // Column-major: a scanning lane's tokens are adjacent (16-byte stores). Then the state's
  // V~ = v e^{D_C - D_j} of the chunk, [C][ldv] in the input dtype (one buffer: the state warps
  // form it after the chunk barrier and read it before the next).
  int ldt = 0;
  unsigned off_gvt = 0, gvt_bytes = 0, off_vt = 0, vt_bytes = 0;
  // gv's rows of the next chunk as given, [C][gv_pitch bytes], copied by cp.async.
  unsigned off_gvs = 0, gvs_bytes = 0, gv_pitch = 0;
  // gv: two sets of flags (a word per scanning state warp: whether some |D_C - D_j| of its
  // columns passes chunked_gk_fast_log2), the chunk of a set read as for gk's flags.
  unsigned off_gvflag = 0;
  // Not LOCAL: the output warps' partial A = Q K^T (each warp of a row tile forms it over its
  // share of the key channels), [out warp][2 C/16 column tiles][32 lanes] x 2 words (input dtype),
  // then one mbarrier (8 bytes) a row tile that orders the exchange, and with gv the mbarrier
  // of V~ (after the C / 16 of the exchange).
  unsigned off_xa = 0, off_mbar = 0;
  std::size_t bytes = 0;
};

inline std::size_t align128(std::size_t x) { return (x + 127) / 128 * 128; }

/// Byte offsets within a scan buffer of the scalar decays (chunked_layout::off_scan) for C
/// tokens: the scanning warp writes them, every warp reads them, the layout sizes them from
/// these. G log2(e) (float) at 0, then:
struct chunked_scan_buffer {
  static constexpr int seg(int C) { return 4 * C; }         ///< segment (int) [C]
  static constexpr int fi(int C) { return 8 * C; }          ///< e^{G_i} (float) [C]
  static constexpr int fc(int C) { return 12 * C; }         ///< e^{G_C - G_j} (float) [C]
  static constexpr int gc(int C) { return 16 * C; }         ///< G_C (double)
  static constexpr int segc(int C) { return gc(C) + 8; }    ///< its segment count (int)
  static constexpr int fast(int C) { return gc(C) + 12; }   ///< whether the mask is factored (int)
  static constexpr int rf(int C) { return gc(C) + 16; }     ///< row factors (float) [C]
  static constexpr int cf(int C) { return rf(C) + 4 * C; }  ///< column factors (float) [C / 16][C]
  static constexpr int bytes(int C) { return cf(C) + 4 * (C / 16) * C; }
};

/// The pitch (16-bit elements) of the staged q and k rows of a kernel with MS state row tiles
/// a state warp (Kp up to 128 MS): the same for every K of that kernel.
inline constexpr int chunked_ldk(int MS) { return 128 * MS + 8; }

/// Whether the output warps of a row tile exchange their partial sums of A in float (both
/// then hold the same A, rounded once where A V reads it) rather than rounded to the input
/// dtype: without per-channel or per-column decays (their tables fill shared memory) and
/// for K up to 128 (the stages of larger K do). Saves the packing and unpacking, ~6
/// instructions an accumulator tile.
inline constexpr bool chunked_xa_float(bool gk, bool gv, int Kp) { return !gk && !gv && Kp <= 128; }

/// Layout for key size K (any, <= 256), BV value columns (16, 32 or 64) and C tokens (32 or 64);
/// `local`: the split-state pass (no q rows, no S~, 8 warps); `gk`: the per-channel decay
/// tables instead of the scalar decays' scan buffers.
/// `gk_es`: gk's element size (its rows are staged in shared memory for 2 and 4); `gv`: the
/// per-column decay tables and the staged gv rows (`gv_es`: gv's element size).
inline chunked_layout make_chunked_layout(std::int64_t K, int BV, int C, bool local = false, bool gk = false,
                                          int gk_es = 0, bool gv = false, int gv_es = 0) {
  chunked_layout L;
  L.C = C;
  L.Kp = int((K + 15) / 16 * 16);
  L.BV = BV;
  // 16 bytes of pad a row: ldmatrix's eight 16-byte rows then fall in distinct bank groups.
  // The q and k pitch is that of the largest Kp of the kernel's state row tiles (128 for
  // MS = 1, 256 for MS = 2: chunked_ldk), not Kp's own, so that the kernel knows it at compile
  // time: its ldmatrix addresses are then a register plus immediates (the pitch from the
  // parameters cost an output warp ~130 of its ~900 instructions a chunk in address
  // arithmetic, ncu on an H100, no gate, B4 T4096 H16). Smaller K take more shared memory,
  // which does not bound them (one block an SM by its registers).
  L.ldk = chunked_ldk(L.Kp <= 128 ? 1 : 2);
  L.ldv = BV + 8;
  L.off_k = local ? 0u : unsigned(C * L.ldk * 2);
  L.off_v = L.off_k + unsigned(C * L.ldk * 2);
  L.stage = unsigned(align128(std::size_t(L.off_v) + std::size_t(C) * L.ldv * 2));
  L.off_raw = 0;
  L.st_bytes = local ? 0u : unsigned(align128(std::size_t(L.Kp) * L.ldv * 2));
  L.off_st = 2 * L.stage;
  L.scan_bytes = gk ? 0u : unsigned(align128(std::size_t(chunked_scan_buffer::bytes(C))));
  L.off_scan = L.off_st + 2 * L.st_bytes;
  L.off_tab = L.off_scan + 2 * L.scan_bytes;
  if (gk) {
    L.ldb = L.Kp + 4;  // 4 words of pad: the state warps' reads of 8 channels x 4 tokens hit 32 banks
    L.tab_bytes = unsigned(align128(std::size_t(C) * L.ldb * 4));
  }
  L.off_flag = L.off_tab + 2 * L.tab_bytes;
  L.off_gks = L.off_flag + (gk ? 128u : 0u);
  if (gk && (gk_es == 2 || gk_es == 4)) {
    L.gk_pitch = unsigned(L.Kp * gk_es + 16);  // 16 bytes of pad a row (the scan's reads by channel)
    L.gks_bytes = unsigned(align128(std::size_t(C) * L.gk_pitch));
  }
  L.off_gvt = unsigned(align128(std::size_t(L.off_gks) + L.gks_bytes));
  if (gv) {
    L.ldt = C + 8;  // 8 words of pad: a fragment's 8-byte reads (8 columns x 4 token pairs), 2 wavefronts
    L.gvt_bytes = unsigned(align128(std::size_t(BV) * L.ldt * 4));
    L.vt_bytes = unsigned(align128(std::size_t(C) * L.ldv * 2));
  }
  L.off_vt = L.off_gvt + 2 * L.gvt_bytes;
  L.off_gvs = L.off_vt + L.vt_bytes;
  if (gv) {
    L.gv_pitch = unsigned(BV * gv_es + 16);  // 16 bytes of pad a row
    L.gvs_bytes = unsigned(align128(std::size_t(C) * L.gv_pitch));
  }
  L.off_gvflag = L.off_gvs + L.gvs_bytes;
  L.off_xa = L.off_gvflag + (gv ? 128u : 0u);
  // The A exchange: a lane's 4 accumulators of a tile in float (chunked_xa_float), else as
  // two 16-bit pairs.
  const unsigned xa_lane = chunked_xa_float(gk, gv, L.Kp) ? 16u : 8u;
  L.off_mbar = L.off_xa + (local ? 0u : unsigned(chunked_out_warps * 2 * (C / 16) * 32) * xa_lane);
  L.bytes = std::size_t(L.off_mbar) + (local ? 0u : std::size_t(C / 16 + (gv ? 1 : 0)) * 8);
  return L;
}

template <class T>
struct mma_is_bf16 : std::is_same<T, bfloat16> {};

/// A type as a value (a dtype switch's cases call one generic lambda).
template <class G>
struct type_tag {
  using type = G;
};

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

/// 2^x by the MUFU instruction alone (ex2.approx.ftz: about 2 ulp; results below 2^-126 flush
/// to 0, which a decay factor that small is at SPEC 6's tolerances). exp2f adds a range check
/// and two multiplies for subnormal results: a third of the gk kernel's instructions went to
/// those in an H100 profile (2026-12-05).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// min(x, the largest float), NaN passing (PTX min.NaN: one instruction; fminf would turn a
/// NaN into the bound).
__device__ __forceinline__ float finite_or_nan(float x) {
  float y;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(x), "f"(3.40282347e38f));
  return y;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
/// Stores four 8 x 8 matrices of 16-bit elements from the m16n8 accumulator layout (register
/// i: matrix i; lanes 8 i .. 8 i + 7 give its row addresses).
__device__ __forceinline__ void stsm_x4(void* p, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(p)), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
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

/// mbarrier operations on a shared-memory address (smem_addr): init with the count of
/// arriving threads, arrive, wait for the phase of parity `parity` to complete, invalidate.
/// mbarrier.arrive releases and try_wait acquires at CTA scope, so the shared-memory writes
/// before an arrival are visible to the waiters.
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "MBAR_WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra MBAR_WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_inval(unsigned bar) {
  asm volatile("mbarrier.inval.shared.b64 [%0];\n" ::"r"(bar) : "memory");
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

/// One 16-byte unit of a staged row: the elements [e0, e0 + 8) of a row of a 16-bit tensor
/// (`valid` of them real, the rest zero). Whole units of 16-byte aligned rows go by cp.async
/// (none real: a zero fill that reads nothing); others, and a row's last unit when it is
/// partial (a 16-byte read there could pass the tensor's end: compute-sanitizer's memcheck
/// counts the whole 16 bytes of a cp.async with a smaller source size), by plain 2-byte loads.
__device__ __forceinline__ void stage_unit(void* dst, const row_tensor& x, std::int64_t elem, int valid) {
  const std::uint16_t* data = reinterpret_cast<const std::uint16_t*>(x.data);
  const std::uint16_t* src = data + elem;
  if (x.align == 16 && (valid >= 8 || valid <= 0)) {
    cp_async<16>(dst, valid > 0 ? static_cast<const void*>(src) : static_cast<const void*>(data), valid > 0 ? 16 : 0);
  } else {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const unsigned lo = 2 * i < valid ? unsigned(src[2 * i]) : 0u;
      const unsigned hi = 2 * i + 1 < valid ? unsigned(src[2 * i + 1]) : 0u;
      w[i] = lo | (hi << 16);
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace detail

/// The chunked kernel's arguments: the recurrent kernel's (only the fields for q, k, v, g,
/// g_gamma, states, output, varlen, direction and layout are read) and the shared layout.
struct chunked_params {
  forward_params f;
  detail::chunked_layout L;
  bool out_pairs = false;  ///< output rows 4-byte aligned: pairs of columns stored at once
  std::int64_t N = 0;      ///< sequences
  /// Sequence splits (dense inputs): split s of a sequence is its tokens [s * split_tokens,
  /// (s + 1) * split_tokens) in processing order, nsplit of them (1: the whole sequence).
  int nsplit = 1;
  std::int64_t split_tokens = 0;  ///< a multiple of 64
  /// [N][H][nsplit][K x V, in the state layout]: the split-state pass writes split s's own
  /// final state (from a zero state) at slot s + 1; chunked_combine_kernel turns slot s into
  /// the state entering split s (slot 0: the initial state), which the output pass reads.
  float* split_state = nullptr;
  float* split_decay = nullptr;  ///< [N][H][nsplit - 1] (gk: [..][K]): each split's total decay factor (0 across a zero decay)
  bool decay_rows = false;       ///< gk: split_decay holds a factor per key channel
};

/// The decays a chunked kernel is compiled for: none, scalar (g and/or g_gamma), per key
/// channel (gk, with g and g_gamma folded in when present).
enum chunked_gate : int { chunked_no_decay = 0, chunked_scalar_decay = 1, chunked_gk_decay = 2 };

/// gk: the per-token log decay is clamped below at this (natural log; e^-80 ~ 1.8e-35, a factor
/// that is 0 at SPEC §6's tolerances), so that -inf never meets -inf in a difference.
inline constexpr float chunked_gk_floor = -80.f;
/// gk: the fast path of a diagonal tile scales q and k about the tile's reference row while
/// every |B_i - B_ref| (log2) stays within this; bfloat16 then holds both scaled operands.
inline constexpr float chunked_gk_fast_log2 = 64.f;

/// One kernel per input dtype (bfloat16, half), chunk length (32 or 64), value block (16, 32
/// or 64 columns), decay (GATE, a chunked_gate) and state row tiles a warp (MS): direction,
/// varlen and state layout are uniform run-time values. LOCAL: the split-state pass (state
/// warps only, each split but the last from a zero state, its final state and total decay
/// into P.split_state and P.split_decay; no outputs).
template <class T, int C, int BV, int GATE, int MS, bool LOCAL = false, bool GV = false>
__global__ void __launch_bounds__(LOCAL ? 32 * (detail::chunked_warps - detail::chunked_out_warps) : 32 * detail::chunked_warps,
                                  LOCAL ? 2 : 1) chunked_forward_kernel(const chunked_params P) {
  using namespace detail;
  constexpr int NWO = LOCAL ? 0 : chunked_out_warps;  // output warps; the rest hold the state
  constexpr int NW = chunked_warps - chunked_out_warps + NWO;
  constexpr int NB = BV / 8;                          // 8-column tiles of the block
  constexpr int nM = C / 16;                          // 16-token row tiles of a chunk
  constexpr int OW = LOCAL ? chunked_out_warps : NWO;  // (the output mapping; unused when LOCAL)
  constexpr int WPM = OW / nM < NB ? OW / nM : NB;    // warps a row tile of output
  constexpr int NTW = NB / WPM;                       // their 8-column tiles
  constexpr int NWS = NW - NWO;                       // state warps
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr bool GATED = GATE == chunked_scalar_decay;  // scalar decays: the scanning warp's buffers
  constexpr bool GK = GATE == chunked_gk_decay;         // per-channel decays: the tables
  // Without gk or gv the state warps alone stage q, k, v: they waited at the chunk barrier
  // for the output warps, which set the pace (ncu on an H100, no gate). B4 T4096 H16 on an
  // H100: no gate 0.217 -> 0.198 ms, g_gamma 0.242 -> 0.219. With gk or gv, whose scans keep
  // the state warps busy, every warp stages its share, as before (not measured the other way).
  constexpr bool STATE_STAGES = !GK && !GV;
  constexpr int NSTG = STATE_STAGES ? NWS : NW;       // warps that stage
  constexpr int RPW = C / NSTG;                       // staged rows a staging warp
  static_assert(C == 32 || C == 64, "chunks of 32 or 64 tokens");
  static_assert(!(GK && MS == 2 && C == 64), "gk with K > 128: chunks of 32 (the scan's registers)");
  static_assert(MS == 1 || MS == 2, "K up to 128 (one state row tile a warp) or 256 (two)");
  static_assert(NWS == 8 && C % NSTG == 0, "8 state warps (16 MS rows each: K up to 128 MS); whole rows a warp");
  static_assert(NTW >= 1 && NTW * WPM == NB, "value block");
  static_assert(!(GV && LOCAL), "gv: no split-state pass (chunked_splits is 1 with gv)");
  // gv's scan: state warp sw < BV / 8 takes the block's columns [8 sw, 8 sw + 8) (GV_NCW), its
  // lanes GV_NSEG runs of GV_TS consecutive tokens of each.
  constexpr int GV_NCW = 8, GV_NSEG = 32 / GV_NCW, GV_TS = C / GV_NSEG;
  // The A V products with gv read bfloat16 operands for both input dtypes: the diagonal
  // tile's v rows are scaled by up to 2^64 (chunked_gk_fast_log2), past half's range.
  using AVT = std::conditional_t<GV, bfloat16, T>;
  // gv with bfloat16 inputs: where the chunk's every |D_C - D_j| stays within
  // chunked_gk_fast_log2 (the scan's flags), the output warps take the state warps' V~ as the
  // v operand of A V and the factor e^{D_i - D_C} after it (see the output warps).
  constexpr bool VT_OUT = GV && std::is_same<T, bfloat16>::value;
  // gv: V~ is ordered by an mbarrier (vmbar): the 8 state warps arrive once their share of it is
  // written, and every reader waits for the chunk's phase. (Named barriers of part of the
  // block, 2 of the state warps and 3 of all with arrive, measured the same and were correct
  // by the PTX ISA, but racecheck reported hazards across the chunk barrier, as it did for the
  // A exchange; see there.)
  const forward_params& p = P.f;
  const chunked_layout& L = P.L;
  extern __shared__ __align__(128) unsigned char chunked_smem[];

  const int Kp = L.Kp;
  constexpr int ldk = chunked_ldk(MS), ldv = BV + 8;  // (= L.ldk, L.ldv: compile-time addresses)
  const int nKt = Kp / 16;
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int r4 = lane >> 2, c4 = 2 * (lane & 3);  // an accumulator's row and column in its tile

  const bool reverse = p.reverse;
  const bool kv_layout = p.kv_layout;
  const bool has_g = p.g != nullptr, has_gamma = p.g_gamma != nullptr;

  // Block (n, h, split, value block), the value block fastest.
  const int nsp = LOCAL ? P.nsplit - 1 : P.nsplit;
  const int vb = int(blockIdx.x % unsigned(p.nvb));
  const int sp = int((blockIdx.x / unsigned(p.nvb)) % unsigned(nsp));
  const int h = int((blockIdx.x / unsigned(p.nvb) / unsigned(nsp)) % unsigned(p.H));
  const std::int64_t n = std::int64_t(blockIdx.x / unsigned(p.nvb) / unsigned(nsp) / unsigned(p.H));
  const std::int64_t nh = n * p.H + h;
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
  // The scalar decays' scan of the current chunk (chunk_loop points these at its buffer).
  auto scan_ptr = [&](int s) { return chunked_smem + L.off_scan + unsigned(s) * L.scan_bytes; };
  // Byte offsets in a scan buffer (chunked_scan_buffer): G log2(e) at 0, then these.
  using SBO = chunked_scan_buffer;
  constexpr int SB_SEG = SBO::seg(C), SB_FI = SBO::fi(C), SB_FC = SBO::fc(C), SB_GC = SBO::gc(C),
                SB_SEGC = SBO::segc(C), SB_FAST = SBO::fast(C), SB_RF = SBO::rf(C), SB_CF = SBO::cf(C);
  const float* sG = nullptr;   // G log2(e)
  const int* sSeg = nullptr;   // segment: zero decays before the token
  const float* sFi = nullptr;  // e^{G_i} (0 in a later segment)
  const float* sFc = nullptr;  // e^{G_C - G_j} (0 before the last segment)
  const float* sRf = nullptr;  // the factored mask: e^{G_i - G_r} (r: the first row of i's tile)
  const float* sCf = nullptr;  // e^{G_r - G_j} by row tile, [C / 16][C]
  bool mask_fast = false;      // whether the chunk's mask takes the factored form
  auto tab_ptr = [&](int s) { return reinterpret_cast<float*>(chunked_smem + L.off_tab + unsigned(s) * L.tab_bytes); };
  auto flag_ptr = [&](int s) { return reinterpret_cast<unsigned*>(chunked_smem + L.off_flag) + 8 * s; };
  const int ldb = L.ldb;
  const std::int64_t gk_base = bidx * p.gk.s0 + std::int64_t(h) * p.gk.s2;
  const unsigned vmbar = unsigned(__cvta_generic_to_shared(chunked_smem + L.off_mbar)) + 8u * unsigned(C / 16);
  auto gvflag_ptr = [&](int s) { return reinterpret_cast<unsigned*>(chunked_smem + L.off_gvflag) + 8 * s; };
  auto gvt_ptr = [&](int s) { return reinterpret_cast<float*>(chunked_smem + L.off_gvt + unsigned(s) * L.gvt_bytes); };
  const int ldt = L.ldt;

  const std::int64_t nchunks = (len + C - 1) / C;
  // This block's chunks [c_lo, c_hi): its split's (every chunk without splits).
  const std::int64_t split_chunks = P.nsplit > 1 ? P.split_tokens / C : nchunks;
  const std::int64_t c_lo = std::int64_t(sp) * split_chunks;
  const std::int64_t c_hi = min(nchunks, c_lo + split_chunks);
  const bool last_split = sp == P.nsplit - 1;
  // The incoming state: the caller's without splits; with them slot sp of split_state (in the
  // state layout; slot 0 a copy of the caller's, so that a final state written over the
  // initial one cannot reach a split that starts late); none in the split-state pass.
  const bool split = P.nsplit > 1;
  const float* h0 = LOCAL                  ? nullptr
                    : !split               ? static_cast<const float*>(p.h0)
                    : sp == 0 && !p.h0     ? nullptr
                                           : P.split_state + (nh * P.nsplit + sp) * std::int64_t(p.K) * p.V;
  const std::int64_t h0_s0 = split ? 0 : p.h0_s0, h0_s1 = split ? 0 : p.h0_s1;
  const std::int64_t h0_s2 = !split ? p.h0_s2 : kv_layout ? p.V : p.K;
  const bool has_h0 = h0 != nullptr;
  // Chunk c's q, k, v rows into its stage: staging warp w copies rows w, w + NSTG, ...; lane u the
  // 16-byte unit u of a q and a k row (Kp / 8 <= 32 units) and of a v row (NB <= 8).
  const int UK = Kp / 8;
  // A whole chunk of 16-byte aligned rows with K and the block's columns whole units (the
  // common case) takes the short path: a lane's source pointers advance by a row stride, one
  // 16-byte cp.async a unit, no per-unit bounds, token or 64-bit index arithmetic (ncu on an
  // H100, g at B4: the general path below cost ~400 of an output warp's ~1700 instructions a
  // chunk). Lanes past K (K a multiple of 8, not of 16) zero-fill their unit.
  const bool stage_fast = p.q.align == 16 && p.k.align == 16 && p.v.align == 16 && p.K % 8 == 0 && w % 8 == 0;
  const std::int64_t q_tok = reverse ? -p.q.s1 : p.q.s1, k_tok = reverse ? -p.k.s1 : p.k.s1,
                     v_tok = reverse ? -p.v.s1 : p.v.s1;  // elements from one row of the chunk to the next
  const int sgw = STATE_STAGES ? warp - NWO : warp;  // the warp's index among the staging warps
  auto issue_stage = [&](std::int64_t c) {
    if (sgw < 0) return;  // (an output warp, when the state warps stage)
    unsigned char* s = stage_ptr(int(c & 1));
    const std::int64_t i0 = c * C;
    const int cl = int(len - i0 < C ? len - i0 : C);
    const int e0 = 8 * lane;
    if (stage_fast && cl == C) {
      const std::int64_t t0 = tok(i0 + sgw);  // the warp's first row; row sgw + NSTG j is NSTG j tokens on
      const std::uint16_t* qs = reinterpret_cast<const std::uint16_t*>(p.q.data) + (q_base + t0 * p.q.s1 + e0);
      const std::uint16_t* ks = reinterpret_cast<const std::uint16_t*>(p.k.data) + (k_base + t0 * p.k.s1 + e0);
      const std::uint16_t* vs = reinterpret_cast<const std::uint16_t*>(p.v.data) + (v_base + t0 * p.v.s1 + e0);
      const bool qk_real = e0 < p.K, v_real = e0 < w;
      const int qk_bytes = qk_real ? 16 : 0, v_bytes = v_real ? 16 : 0;
      // (units past K or w: a valid address, nothing read)
      if (!qk_real) qs = ks = reinterpret_cast<const std::uint16_t*>(p.k.data);
      if (!v_real) vs = reinterpret_cast<const std::uint16_t*>(p.v.data);
      const std::int64_t qst = qk_real ? NSTG * q_tok : 0, kst = qk_real ? NSTG * k_tok : 0, vst = v_real ? NSTG * v_tok : 0;
      unsigned char* dq = s + (sgw * ldk + e0) * 2;
      unsigned char* dv = s + L.off_v + (sgw * ldv + e0) * 2;
#pragma unroll
      for (int j = 0; j < RPW; ++j) {
        if (lane < UK) {
          if (!LOCAL) cp_async<16>(dq, qs, qk_bytes);
          cp_async<16>(dq + L.off_k, ks, qk_bytes);
        }
        if (lane < NB) cp_async<16>(dv, vs, v_bytes);
        qs += qst, ks += kst, vs += vst;
        dq += NSTG * ldk * 2, dv += NSTG * ldv * 2;
      }
      cp_async_commit();
      return;
    }
#pragma unroll
    for (int j = 0; j < RPW; ++j) {
      const int l = sgw + NSTG * j;
      const std::int64_t t = tok(i0 + l);
      const bool real = l < cl;
      if (lane < UK) {
        const int valid = real ? min(8, p.K - e0) : 0;
        if (!LOCAL) stage_unit(s + (l * ldk + e0) * 2, p.q, q_base + t * p.q.s1 + e0, valid);
        stage_unit(s + L.off_k + (l * ldk + e0) * 2, p.k, k_base + t * p.k.s1 + e0, valid);
      }
      if (lane < NB) stage_unit(s + L.off_v + (l * ldv + e0) * 2, p.v, v_base + t * p.v.s1 + e0, real ? min(8, w - e0) : 0);
    }
    cp_async_commit();
  };
  // The scalar gate of a lane's tokens (lane * TPL + e) of chunk c, as the bits of its dtype
  // (0 past the sequence end), converted by g_value where the next chunk uses it: a conversion
  // at the load made every warp wait there for global memory once a chunk (H100 profile of g,
  // 2026-12-05). Doubles are converted at the load (rounded to float, as before).
  constexpr int TPL = C / 32;
  // (The lane's first token and its index once; the next one a stride on: the index
  // arithmetic per token was ~45 instructions, ncu on an H100.)
  const std::int64_t g_row = bidx * p.g_s0 + std::int64_t(h) * p.g_s2, g_tok = reverse ? -p.g_s1 : p.g_s1;
  auto load_g = [&](std::int64_t c, unsigned (&x)[TPL]) {
    const std::int64_t i_first = g_row + tok(c * C + lane * TPL) * p.g_s1;
#pragma unroll
    for (int e = 0; e < TPL; ++e) {
      const int l = lane * TPL + e;
      x[e] = 0u;
      if (has_g && c * C + l < len) {
        const std::int64_t i = i_first + e * g_tok;
        switch (p.g_type) {
          case dtype::bfloat16:
          case dtype::float16: x[e] = static_cast<const std::uint16_t*>(p.g)[i]; break;
          case dtype::float64: x[e] = __float_as_uint(float(static_cast<const double*>(p.g)[i])); break;
          default: x[e] = static_cast<const unsigned*>(p.g)[i]; break;
        }
      }
    }
  };
  auto g_value = [&](unsigned x) -> float {
    if (p.g_type == dtype::bfloat16) return __uint_as_float(x << 16);
    if (p.g_type == dtype::float16) return __half2float(__ushort_as_half((unsigned short)x));
    return __uint_as_float(x);
  };
  // One barrier of all NW warps. The two roles run separate loops (each keeps only its own
  // registers live), so the barrier is a named one that the roles reach from two different
  // instructions. That needs the non-.aligned barrier.sync: bar.sync is barrier.sync.aligned,
  // which the PTX ISA defines only where every thread executes the same barrier instruction
  // (compute-sanitizer's synccheck reported "Divergent thread(s) in block" at it, on an H100,
  // 2026-12-05; a __syncwarp() before it did not change that).
  auto block_sync = [] { asm volatile("barrier.sync 1, %0;\n" ::"n"(32 * NW) : "memory"); };

  // The scalar decays' scan of chunk c into buffer c & 1 (one warp, from the gate values of
  // load_g): cumulative sums in double (a warp scan), a new segment at each zero decay; kept
  // as G log2(e) in float, with the chunk's total and segment count.
  auto scan_chunk = [&](std::int64_t c, const unsigned (&gbits)[TPL]) {
    const int cl = int(len - c * C < C ? len - c * C : C);
    unsigned char* sb = scan_ptr(int(c & 1));
    float* wG = reinterpret_cast<float*>(sb);
    int* wSeg = reinterpret_cast<int*>(sb + SB_SEG);
    float* wFi = reinterpret_cast<float*>(sb + SB_FI);
    float* wFc = reinterpret_cast<float*>(sb + SB_FC);
    double y[TPL];
    int z[TPL];
    double s = 0.0;
    int sc = 0;
#pragma unroll
    for (int e = 0; e < TPL; ++e) {
      const int l = lane * TPL + e;
      const double x = l < cl ? gamma + double(g_value(gbits[e])) : 0.0;
      z[e] = x < -1e4 ? 1 : 0;
      y[e] = z[e] ? 0.0 : (x > 1e4 ? 1e4 : x);  // (NaN passes into G)
      s += y[e];
      sc += z[e];
    }
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
      const double t = __shfl_up_sync(0xffffffffu, s, off);
      const int tc = __shfl_up_sync(0xffffffffu, sc, off);
      if (lane >= off) {
        s += t;
        sc += tc;
      }
    }
    double G = __shfl_up_sync(0xffffffffu, s, 1);
    int seg = __shfl_up_sync(0xffffffffu, sc, 1);
    if (lane == 0) {
      G = 0.0;
      seg = 0;
    }
    const double GC = __shfl_sync(0xffffffffu, s, 31);
    const int segC = __shfl_sync(0xffffffffu, sc, 31);
    float Gl[TPL];  // G log2(e) of the lane's tokens
    bool mono = true;
#pragma unroll
    for (int e = 0; e < TPL; ++e) {
      const int l = lane * TPL + e;
      G += y[e];
      seg += z[e];
      Gl[e] = float(G) * kLog2e;
      mono = mono && y[e] <= 0.0;  // (false for NaN)
      wG[l] = Gl[e];
      wSeg[l] = seg;
      wFi[l] = seg == 0 ? fast_exp2(Gl[e]) : 0.f;
      wFc[l] = seg == segC ? fast_exp2(float(GC - G) * kLog2e) : 0.f;
    }
    int fast = 0;
    if constexpr (!LOCAL) {
      // The decay mask's factored form, e^{G_i - G_j} = e^{G_i - G_r} e^{G_r - G_j} with r the
      // first row of i's 16-row tile: where no decay grows (G falls) and the chunk has one
      // segment, e^{G_i - G_r} <= 1, e^{G_r - G_j} <= 1 for the key tiles before i's, and on
      // i's own tile e^{G_r - G_j} grows to the decay over 15 tokens; the form is taken while
      // that stays within 2^chunked_gk_fast_log2 (every tile of the chunk), else the mask is
      // formed elementwise.
      float* wRf = reinterpret_cast<float*>(sb + SB_RF);
      float* wCf = reinterpret_cast<float*>(sb + SB_CF);
      constexpr int LPT = 16 / TPL;  // lanes a 16-token tile
      const float Gr = __shfl_sync(0xffffffffu, Gl[0], lane / LPT * LPT);
      float dev = 0.f;
#pragma unroll
      for (int e = 0; e < TPL; ++e) {
        dev = fmaxf(dev, Gr - Gl[e]);
        wRf[lane * TPL + e] = fast_exp2(Gl[e] - Gr);
      }
#pragma unroll
      for (int m = 0; m < C / 16; ++m) {
        const float Gm = __shfl_sync(0xffffffffu, Gl[0], m * LPT);
        if (lane / LPT <= m) {
#pragma unroll
          for (int e = 0; e < TPL; ++e) wCf[m * C + lane * TPL + e] = fast_exp2(Gm - Gl[e]);
        }
      }
      fast = __all_sync(0xffffffffu, mono && dev <= chunked_gk_fast_log2) && segC == 0 ? 1 : 0;
    }
    if (lane == 0) {
      *reinterpret_cast<double*>(sb + SB_GC) = GC;
      *reinterpret_cast<int*>(sb + SB_SEGC) = segC;
      *reinterpret_cast<int*>(sb + SB_FAST) = fast;
    }
  };
  // The chunk loop of one role: every warp stages its share of chunk c + 1; then the role's
  // work. With scalar decays one warp (the last state warp: the state warps wait at the chunk
  // barrier for the output warps there) scans chunk c + 1 after its work on chunk c, and
  // loads the gate values of chunk c + 2; every warp scanning every chunk for itself cost the
  // output warps ~150 instructions a chunk (ncu, H100, g at B4).
  auto chunk_loop = [&](auto&& work) {
    const bool scanner = GATED && warp == NW - 1;
    unsigned gnext[TPL];
#pragma unroll
    for (int e = 0; e < TPL; ++e) gnext[e] = 0u;
    if (c_lo < c_hi) {
      issue_stage(c_lo);
      if (scanner) {
        load_g(c_lo, gnext);
        scan_chunk(c_lo, gnext);
        if (c_lo + 1 < c_hi) load_g(c_lo + 1, gnext);
      }
    }
    for (std::int64_t c = c_lo; c < c_hi; ++c) {
      const int buf = int(c & 1);
      const std::int64_t i0 = c * C;
      const int cl = int(len - i0 < C ? len - i0 : C);
      cp_async_wait<0>();
      block_sync();  // chunk c staged and scanned, S~ written, by every thread; chunk c - 1 done
      if (c + 1 < c_hi) issue_stage(c + 1);
      float GC2 = 0.f;
      double GC = 0.0;
      int segC = 0;
      if constexpr (GATED) {
        const unsigned char* sb = scan_ptr(buf);
        sG = reinterpret_cast<const float*>(sb);
        sSeg = reinterpret_cast<const int*>(sb + SB_SEG);
        sFi = reinterpret_cast<const float*>(sb + SB_FI);
        sFc = reinterpret_cast<const float*>(sb + SB_FC);
        GC = *reinterpret_cast<const double*>(sb + SB_GC);
        segC = *reinterpret_cast<const int*>(sb + SB_SEGC);
        mask_fast = *reinterpret_cast<const int*>(sb + SB_FAST) != 0;
        sRf = reinterpret_cast<const float*>(sb + SB_RF);
        sCf = reinterpret_cast<const float*>(sb + SB_CF);
        GC2 = float(GC) * kLog2e;
      }
      const unsigned char* stg = stage_ptr(buf);
      work(c, buf, i0, cl, reinterpret_cast<const std::uint16_t*>(stg),
           reinterpret_cast<const std::uint16_t*>(stg + L.off_k), reinterpret_cast<const std::uint16_t*>(stg + L.off_v),
           GC2, GC, segC);
      if (scanner && c + 1 < c_hi) {
        scan_chunk(c + 1, gnext);  // (buffer c + 1 & 1 was last read in chunk c - 1)
        if (c + 2 < c_hi) load_g(c + 2, gnext);
      }
    }
  };

  if (warp >= NWO) {
    // State warps: row tiles sw (and sw + NWS when MS = 2), every column, in float registers
    // (zeros past K and w); S~ (rounded to the input dtype) into the state buffer of the next
    // chunk.
    const int sw = warp - NWO;
    if constexpr (GV) {
      static_assert(WPM > 1, "gv: the kernel's closing barrier orders vmbar's invalidation");
      if (sw == 0 && lane == 0) mbar_init(vmbar, 32 * NWS);
      // (the chunk loop's first barrier orders the init before any arrival)
    }
    float S[MS][NB][4];
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int nt = 0; nt < NB; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int a = 16 * (sw + NWS * ms) + r4 + 8 * (i >> 1), b = 8 * nt + c4 + (i & 1);
          float x = 0.f;
          if (has_h0 && a < p.K && b < w) {
            const std::int64_t off = kv_layout ? n * h0_s0 + h * h0_s1 + a * h0_s2 + (b0 + b)
                                               : n * h0_s0 + h * h0_s1 + (b0 + b) * h0_s2 + a;
            x = h0[off];
          }
          S[ms][nt][i] = x;
        }
    auto write_st = [&](std::uint16_t* st) {
#pragma unroll
      for (int ms = 0; ms < MS; ++ms) {
        const int mt = sw + NWS * ms;
        if (mt >= nKt) continue;
        // Two 8-column tiles a stmatrix: lane l gives row (l & 7) + 8 ((l >> 3) & 1) of columns
        // 8 (nt + (l >> 4)) (NB is even).
        std::uint16_t* dst = st + (16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1)) * ldv + 8 * (lane >> 4);
#pragma unroll
        for (int nt = 0; nt < NB; nt += 2)
          stsm_x4(dst + 8 * nt, pack2<T>(S[ms][nt][0], S[ms][nt][1]), pack2<T>(S[ms][nt][2], S[ms][nt][3]),
                  pack2<T>(S[ms][nt + 1][0], S[ms][nt + 1][1]), pack2<T>(S[ms][nt + 1][2], S[ms][nt + 1][3]));
      }
    };
    if (!LOCAL && has_h0) write_st(st_ptr(c_lo & 1));
    double split_G = 0.0;  // the split's total log decay (LOCAL), and whether a decay was 0
    bool split_zero = false;
    // gk: the table of chunk c, B[l][a] = log2(e) * sum over the chunk's tokens up to l of
    // (gk + g + g_gamma) of key channel a (a token's sum clamped below at chunked_gk_floor;
    // zero past the sequence end and past K), and the fallback flags of its row tiles. The
    // state warp's channels (its row tiles); lane: channel lane & 15, tokens of half lane >> 4
    // (a serial sum in double, then the first half's total added to the second's).
    double split_Gk[MS];  // LOCAL: the split's total log decay of the lane's channel (second half)
#pragma unroll
    for (int ms = 0; ms < MS; ++ms) split_Gk[ms] = 0.0;
    auto scan_gk = [&](std::int64_t c, float* tb) {
      constexpr int HT = C / 2;
      const std::int64_t i0 = c * C;
      const int cl = int(len - i0 < C ? len - i0 : C);
      const int chl = lane & 15, half = lane >> 4;
      unsigned bits = 0;
#pragma unroll
      for (int ms = 0; ms < MS; ++ms) {
        const int ch = 16 * (sw + NWS * ms) + chl;
        if (16 * (sw + NWS * ms) >= Kp) continue;  // (warp-uniform)
        // The lane's gk values: from the stage for 16- and 32-bit gk (issue_gk); doubles are
        // loaded here, each conversion in its load's branch, so each load is waited for in
        // turn (the latency-bound path the stage replaced for the other dtypes).
        float x[HT];
        const bool lane_real = ch < p.K;
        const std::int64_t g_base = bidx * p.g_s0 + std::int64_t(h) * p.g_s2;
        auto load_rows = [&](auto tag, const void* base, std::int64_t off, std::int64_t stride, bool add) {
          using G = typename decltype(tag)::type;
          const G* gp = static_cast<const G*>(base);
#pragma unroll
          for (int e = 0; e < HT; ++e) {
            const int l = half * HT + e;
            const float v = l < cl && lane_real ? to_acc<float>(gp[off + tok(i0 + l) * stride]) : 0.f;
            x[e] = add ? x[e] + v : v;
          }
        };
        auto typed = [&](dtype t, auto&& f) {
          switch (t) {
            case dtype::bfloat16: f(type_tag<bfloat16>()); break;
            case dtype::float16: f(type_tag<recattn::half>()); break;
            case dtype::float64: f(type_tag<double>()); break;
            default: f(type_tag<float>()); break;
          }
        };
        if (L.gks_bytes) {
          // From the rows staged in shared memory (issue_gk: the warp's own columns, its own
          // copies waited for before the scan).
          const unsigned char* rows = chunked_smem + L.off_gks;
          auto read_rows = [&](auto tag) {
            using G = typename decltype(tag)::type;
#pragma unroll
            for (int e = 0; e < HT; ++e)
              x[e] = to_acc<float>(reinterpret_cast<const G*>(rows + (half * HT + e) * L.gk_pitch)[ch]);
          };
          if (p.gk.type == dtype::float32) read_rows(type_tag<float>());
          else if (p.gk.type == dtype::float16) read_rows(type_tag<recattn::half>());
          else read_rows(type_tag<bfloat16>());
        } else {
          typed(p.gk.type, [&](auto tag) { load_rows(tag, p.gk.data, gk_base + ch, p.gk.s1, false); });
        }
        if (has_g) {
          // g is one value a token: lane u loads tokens u and u + 32, the others take theirs by
          // shuffles (32 loads a lane, each waited for, made the scan latency-bound).
          float gl[2] = {0.f, 0.f};
#pragma unroll
          for (int u = 0; u < C / 32; ++u) {
            const int l = lane + 32 * u;
            if (l < cl) gl[u] = load_any<float>(p.g, p.g_type, g_base + tok(i0 + l) * p.g_s1);
          }
#pragma unroll
          for (int e = 0; e < HT; ++e) {
            const int l = half * HT + e;
            const float a = __shfl_sync(0xffffffffu, gl[0], l & 31);
            const float b = C > 32 ? __shfl_sync(0xffffffffu, gl[1], l & 31) : 0.f;
            x[e] += (l >> 5) ? b : a;
          }
        }
#pragma unroll
        for (int e = 0; e < HT; ++e) {
          const int l = half * HT + e;
          float v = x[e] + float(gamma);
          v = v < chunked_gk_floor ? chunked_gk_floor : (v > 1e4f ? 1e4f : v);  // (NaN passes)
          x[e] = l < cl && lane_real ? v : 0.f;
        }
        double tot = 0.0;
#pragma unroll
        for (int e = 0; e < HT; ++e) tot += double(x[e]);
        const double first = __shfl_sync(0xffffffffu, tot, chl);
        double sum = half ? first : 0.0;
        float ref = 0.f, dev = 0.f;
#pragma unroll
        for (int e = 0; e < HT; ++e) {
          if (e % 16 == 0) {
            ref = float(sum) * kLog2e;
            dev = 0.f;
          }
          sum += double(x[e]);
          // (the deviation from the table's values in float: a difference in double, its
          // conversion and scaling were 3 of the scan's ~20 instructions an element)
          const float bl = float(sum) * kLog2e;
          dev = fmaxf(dev, fabsf(bl - ref));
          tb[(half * HT + e) * ldb + ch] = bl;
          if (e % 16 == 15) {
            const unsigned b = __ballot_sync(0xffffffffu, !(dev <= chunked_gk_fast_log2));
            if (b & 0xffffu) bits |= 1u << (e / 16);
            if (b >> 16) bits |= 1u << ((HT + e) / 16);
          }
        }
        if (LOCAL) split_Gk[ms] += sum;  // (read from the second half's lanes: the chunk's total)
      }
      if (lane == 0) flag_ptr(int(c & 1))[sw] = bits;
      (void)tb;
    };
    // gk rows of chunk c into their stage (when the layout has one): each state warp copies
    // the columns it scans itself (its 16-channel row tiles, every token; a lane a 16-byte unit,
    // zero past K and past the sequence end), so the scan waits for its own warp's copies only.
    // (The element size is a template constant in both copies below, es 2 or 4: from the
    // run-time value, a lane's row and unit were integer divisions and the loops' trip counts
    // unknown, ~140 of a state warp's instructions a chunk, ncu on an H100, gk + gv at B4.)
    auto issue_gk_es = [&](std::int64_t c, auto es_c) {
      constexpr int es = decltype(es_c)::value;
      const std::int64_t i0 = c * C;
      const int cl = int(len - i0 < C ? len - i0 : C);
      const int real16 = p.K * es / 2;  // (16-bit units of a row)
      unsigned char* rows = chunked_smem + L.off_gks;
#pragma unroll
      for (int ms = 0; ms < MS; ++ms) {
        const int a0 = 16 * (sw + NWS * ms);
        if (a0 >= Kp) continue;  // (warp-uniform)
        if (cl == C && p.gk.align == 16 && a0 + 16 <= p.K) {
          // A whole chunk of aligned rows and 16 real channels: as issue_stage's short path
          // (a lane's units are 32 / es rows apart).
          const int l0 = lane / es, u = lane % es, first = a0 * es / 2 + 8 * u;
          constexpr int rstep = 32 / es;
          const std::uint16_t* src = reinterpret_cast<const std::uint16_t*>(p.gk.data) +
                                     ((gk_base + tok(i0 + l0) * p.gk.s1) * (es / 2) + first);
          const std::int64_t st = (reverse ? -p.gk.s1 : p.gk.s1) * rstep * (es / 2);
          unsigned char* dst = rows + l0 * L.gk_pitch + 2 * first;
#pragma unroll
          for (int it = 0; it < C * es / 32; ++it) {
            cp_async<16>(dst, src, 16);
            src += st;
            dst += rstep * L.gk_pitch;
          }
          continue;
        }
#pragma unroll
        for (int it = 0; it < C * es / 32; ++it) {  // es units of 16 bytes hold 16 channels
          const int e = lane + 32 * it, l = e / es, u = e % es, first = a0 * es / 2 + 8 * u;
          const std::int64_t t = tok(i0 + (l < cl ? l : 0));
          stage_unit(rows + l * L.gk_pitch + 2 * first, p.gk, (gk_base + t * p.gk.s1) * (es / 2) + first,
                     l < cl ? min(8, real16 - first) : 0);
        }
      }
      cp_async_commit();
    };
    auto issue_gk = [&](std::int64_t c) {
      if (p.gk.es == 2) issue_gk_es(c, std::integral_constant<int, 2>());
      else issue_gk_es(c, std::integral_constant<int, 4>());
    };
    auto staged_scan = [&](std::int64_t c, float* tb) {
      if (L.gks_bytes) {
        cp_async_wait<0>();
        __syncwarp();  // (the copies of the warp's other lanes)
      }
      scan_gk(c, tb);
    };
    // gv: the table of chunk c, D[l][b] = log2(e) * sum over the chunk's tokens up to l of gv
    // of the block's value column b (a token's value clamped below at chunked_gk_floor; zero
    // past the sequence end and past the block's real columns). Lane: column
    // 8 sw + lane % 8, tokens of run lane / 8. Chunk c + 1's gv rows go into shared memory by
    // cp.async at the start of chunk c (each scanning warp its own 8 columns, so it waits for
    // its own copies only) and are scanned at its end. (Loaded into registers instead, the
    // loads were moved by the compiler down to the scan, which then waited for each: a third
    // of gv's time on an H100, bench/README.md.)
    const bool gv_scans = sw < BV / GV_NCW;
    const int gv_col = sw * GV_NCW + lane % GV_NCW, gv_run = lane / GV_NCW;
    // (es a template constant, 2, 4 or 8, as for issue_gk.)
    auto issue_gv_es = [&](std::int64_t c, auto es_c) {
      constexpr int es = decltype(es_c)::value, upt = es / 2;  // 16-byte units a token of the warp's 8 columns
      const std::int64_t i0 = c * C;
      const int cl = int(len - i0 < C ? len - i0 : C);
      const int real16 = (w - sw * GV_NCW) * upt;  // real 16-bit elements of the warp's slice
      unsigned char* rows = chunked_smem + L.off_gvs + sw * GV_NCW * es;
      const std::int64_t base = bidx * p.gv.s0 + std::int64_t(h) * p.gv.s2 + b0 + sw * GV_NCW;
      if (cl == C && p.gv.align == 16 && real16 >= 8 * upt) {
        // A whole chunk of aligned rows and 8 real columns: as issue_stage's short path (a
        // lane's units are 32 / upt rows apart).
        const int l0 = lane / upt, u = lane % upt;
        constexpr int rstep = 32 / upt;
        const std::uint16_t* src = reinterpret_cast<const std::uint16_t*>(p.gv.data) +
                                   ((base + tok(i0 + l0) * p.gv.s1) * upt + 8 * u);
        const std::int64_t st = (reverse ? -p.gv.s1 : p.gv.s1) * rstep * upt;
        unsigned char* dst = rows + l0 * L.gv_pitch + 16 * u;
#pragma unroll
        for (int it = 0; it < C * upt / 32; ++it) {
          cp_async<16>(dst, src, 16);
          src += st;
          dst += rstep * L.gv_pitch;
        }
        cp_async_commit();
        return;
      }
#pragma unroll
      for (int it = 0; it < C * upt / 32; ++it) {
        const int e = lane + 32 * it, l = e / upt, u = e % upt;
        const std::int64_t t = tok(i0 + (l < cl ? l : 0));
        stage_unit(rows + l * L.gv_pitch + 16 * u, p.gv, (base + t * p.gv.s1) * upt + 8 * u,
                   l < cl ? min(8, real16 - 8 * u) : 0);
      }
      cp_async_commit();
    };
    auto issue_gv = [&](std::int64_t c) {
      if (p.gv.es == 2) issue_gv_es(c, std::integral_constant<int, 2>());
      else if (p.gv.es == 4) issue_gv_es(c, std::integral_constant<int, 4>());
      else issue_gv_es(c, std::integral_constant<int, 8>());
    };
    auto scan_gv = [&](std::int64_t c, float* dt) {
      const std::int64_t i0 = c * C;
      const int cl = int(len - i0 < C ? len - i0 : C);
      cp_async_wait<0>();
      __syncwarp();  // (the copies of the warp's other lanes)
      const unsigned char* rows = chunked_smem + L.off_gvs + gv_col * p.gv.es;
      float x[GV_TS];
#pragma unroll
      for (int e = 0; e < GV_TS; ++e) {
        const int l = gv_run * GV_TS + e;
        const unsigned char* q = rows + l * L.gv_pitch;
        float v;
        if (p.gv.type == dtype::bfloat16) v = __uint_as_float(unsigned(*reinterpret_cast<const std::uint16_t*>(q)) << 16);
        else if (p.gv.type == dtype::float16) v = __half2float(*reinterpret_cast<const __half*>(q));
        else if (p.gv.type == dtype::float64) v = float(*reinterpret_cast<const double*>(q));
        else v = *reinterpret_cast<const float*>(q);
        v = v < chunked_gk_floor ? chunked_gk_floor : (v > 1e4f ? 1e4f : v);  // (NaN passes)
        x[e] = l < cl && gv_col < w ? v : 0.f;
      }
      // The run's prefix sums in float, compensated (Kahan), then the runs before this lane's
      // (the lanes GV_NCW apart hold one column's runs in order) in double, added as a
      // two-float offset: no double conversion a token (the scan was a third of gv's cost,
      // bench/README.md).
      float ls[GV_TS], rs = 0.f, comp = 0.f;
#pragma unroll
      for (int e = 0; e < GV_TS; ++e) {
        const float y = x[e] - comp, t = rs + y;
        comp = (t - rs) - y;
        rs = t;
        ls[e] = rs;
      }
      const double tot = double(rs) - double(comp);
      double incl = tot;
#pragma unroll
      for (int off = 1; off < GV_NSEG; off *= 2) {
        const double t = __shfl_up_sync(0xffffffffu, incl, off * GV_NCW);
        if (gv_run >= off) incl += t;
      }
      const double off = incl - tot;
      const float offh = float(off), offl = float(off - double(offh));
      float dv[GV_TS];
#pragma unroll
      for (int e = 0; e < GV_TS; ++e) dv[e] = ((offh + ls[e]) + offl) * kLog2e;
      if constexpr (VT_OUT) {
        // Whether every |D_C - D_j| of the warp's columns is within chunked_gk_fast_log2 (D_C:
        // the last run's last value, the state warps' D_C bit for bit).
        const float dcl = __shfl_sync(0xffffffffu, dv[GV_TS - 1], (GV_NSEG - 1) * GV_NCW + lane % GV_NCW);
        float dev = 0.f;
#pragma unroll
        for (int e = 0; e < GV_TS; ++e) dev = fmaxf(dev, fabsf(dcl - dv[e]));
        const bool far = __any_sync(0xffffffffu, !(dev <= chunked_gk_fast_log2));  // (NaN: far)
        if (lane == 0) gvflag_ptr(int(c & 1))[sw] = far ? 1u : 0u;
      }
      float* drow = dt + gv_col * ldt + gv_run * GV_TS;  // (16-byte aligned for GV_TS >= 4)
      if constexpr (GV_TS % 4 == 0) {
#pragma unroll
        for (int u = 0; u < GV_TS / 4; ++u)
          reinterpret_cast<float4*>(drow)[u] = make_float4(dv[4 * u], dv[4 * u + 1], dv[4 * u + 2], dv[4 * u + 3]);
      } else {
#pragma unroll
        for (int u = 0; u < GV_TS / 2; ++u) reinterpret_cast<float2*>(drow)[u] = make_float2(dv[2 * u], dv[2 * u + 1]);
      }
    };
    if constexpr (GK) {
      if (c_lo < c_hi) {
        if (L.gks_bytes) issue_gk(c_lo);
        staged_scan(c_lo, tab_ptr(int(c_lo & 1)));
      }
    }
    if constexpr (GV) {
      if (c_lo < c_hi && gv_scans) {
        issue_gv(c_lo);
        scan_gv(c_lo, gvt_ptr(int(c_lo & 1)));
      }
    }
    chunk_loop([&](std::int64_t c, int buf, std::int64_t, int cl, const std::uint16_t*, const std::uint16_t* sk,
                   const std::uint16_t* sv, float GC2, double GC, int segC) {
      if (LOCAL) {
        split_G += GC;
        split_zero = split_zero || segC != 0;
      }
      if constexpr (GK) {
        if (L.gks_bytes && c + 1 < c_hi) issue_gk(c + 1);  // (the stage was read by chunk c's scan, before the barrier)
      }
      if constexpr (GV) {
        if (c + 1 < c_hi && gv_scans) issue_gv(c + 1);  // (the stage was read by chunk c's scan, before the barrier)
      }
      // S <- e^{G_C} S + K~^T V (K~: k rows scaled by e^{G_C - G_j}, in the operand registers).
      if constexpr (GATED) {
        const float f = segC == 0 ? fast_exp2(GC2) : 0.f;
#pragma unroll
        for (int ms = 0; ms < MS; ++ms)
#pragma unroll
          for (int nt = 0; nt < NB; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) S[ms][nt][i] = f == 0.f ? 0.f : S[ms][nt][i] * f;
      }
      // gk: row a of S decays by e^{B_C[a]}; K~ = k scaled by e^{B_C[a] - B_j[a]}.
      const float* tb = GK ? tab_ptr(buf) : nullptr;
      float bc[MS][2], fk[MS][2];
      if constexpr (GK) {
#pragma unroll
        for (int ms = 0; ms < MS; ++ms)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int a = 16 * (sw + NWS * ms) + r4 + 8 * hh;
            bc[ms][hh] = a < Kp ? tb[(C - 1) * ldb + a] : 0.f;
            const float f = fast_exp2(bc[ms][hh]);
            // With gv, S's row and column decays are applied below in one multiply by their
            // product (H100, B4 T4096 H16: gk + gv 0.691 -> 0.679 ms, bench/README.md), both
            // factors made finite first so that a zero one still gives 0 and not inf * 0.
            if constexpr (GV) {
              fk[ms][hh] = finite_or_nan(f);
            } else {
#pragma unroll
              for (int nt = 0; nt < NB; ++nt) {
                S[ms][nt][2 * hh] = f == 0.f ? 0.f : S[ms][nt][2 * hh] * f;
                S[ms][nt][2 * hh + 1] = f == 0.f ? 0.f : S[ms][nt][2 * hh + 1] * f;
              }
            }
          }
      }
      // gv: V~ = v scaled by e^{D_C[b] - D_j[b]} (<= 1) into its buffer, each factor once over
      // the state warps: warp sw the tokens [TPW sw, TPW sw + TPW), a lane a token and a column
      // at a time (D's rows read along tokens). vmbar orders the writes before the K~^T V~
      // products below (and the output warps' reads); the chunk barrier orders this chunk's
      // reads before the next chunk's writes. (Each state warp scaling its v operand registers
      // by a factor table instead formed every product 8 times: ~5100 of the ~18000 warp
      // instructions gv added a chunk, ncu on an H100, B4 T4096 H16.) Then column b of S
      // decays by e^{D_C[b]}.
      const float* dt = GV ? gvt_ptr(buf) : nullptr;
      std::uint16_t* const vt = GV ? reinterpret_cast<std::uint16_t*>(chunked_smem + L.off_vt) : nullptr;
      if constexpr (GV) {
        constexpr int TPW = C / NWS, CPI = 32 / TPW;  // tokens a warp; columns an iteration
        const int j = sw * TPW + lane % TPW;
#pragma unroll
        for (int it = 0; it < BV / CPI; ++it) {
          const int b = it * CPI + lane / TPW;
          const float f = fast_exp2(dt[b * ldt + C - 1] - dt[b * ldt + j]);
          const float x = unpack2<T>(unsigned(sv[j * ldv + b])).x;
          vt[j * ldv + b] = std::uint16_t(pack2<T>(f == 0.f ? 0.f : x * f, 0.f) & 0xffffu);
        }
        mbar_arrive(vmbar);
#pragma unroll
        for (int nt = 0; nt < NB; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float fv = finite_or_nan(fast_exp2(dt[(8 * nt + c4 + e) * ldt + C - 1]));
#pragma unroll
            for (int ms = 0; ms < MS; ++ms)
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) {
                float f = fv;
                if constexpr (GK) f *= fk[ms][hh];
                S[ms][nt][2 * hh + e] = f == 0.f ? 0.f : S[ms][nt][2 * hh + e] * f;
              }
          }
        }
      }
      if constexpr (GV) {
        mbar_wait(vmbar, unsigned((c - c_lo) & 1));  // every state warp's share of V~ (a phase a chunk)
      }
      const std::uint16_t* ktrow = sk + ((lane & 7) + (lane >> 4) * 8) * ldk + ((lane >> 3) & 1) * 8;
      const std::uint16_t* vrow = (GV ? vt : sv) + ((lane & 7) + ((lane >> 3) & 1) * 8) * ldv + (lane >> 4) * 8;
      // (Rolled for gv at 64-token chunks; unrolled for gk + gv's 32, measured with this
      // commit's other two changes: bench/README.md, 2026-12-07 18:45 UTC.)
#pragma unroll(GV && C > 32 ? 1 : nM)
      for (int kt = 0; kt < nM; ++kt) {
        if (16 * kt >= cl) break;
        unsigned ka[MS][4];
#pragma unroll
        for (int ms = 0; ms < MS; ++ms) {
          const int mt = sw + NWS * ms;
          if (mt >= nKt) continue;
          ldsm_x4_t(ka[ms], ktrow + 16 * kt * ldk + 16 * mt);
          if constexpr (GATED) {
            const int j0 = 16 * kt + c4;  // a0, a1: tokens j0, j0 + 1; a2, a3: j0 + 8, j0 + 9
            const float f0 = sFc[j0], f1 = sFc[j0 + 1], f8 = sFc[j0 + 8], f9 = sFc[j0 + 9];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const float2 x = unpack2<T>(ka[ms][r]);
              const float fa = (r & 2) ? f8 : f0, fb = (r & 2) ? f9 : f1;
              ka[ms][r] = pack2<T>(fa == 0.f ? 0.f : x.x * fa, fb == 0.f ? 0.f : x.y * fb);
            }
          }
          if constexpr (GK) {
            // Register r: channel 16 mt + r4 + 8 (r & 1), tokens 16 kt + c4 + 8 (r >> 1) + {0, 1}.
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int a = 16 * mt + r4 + 8 * (r & 1), j = 16 * kt + c4 + 8 * (r >> 1);
              const float2 x = unpack2<T>(ka[ms][r]);
              const float fa = fast_exp2(bc[ms][r & 1] - tb[j * ldb + a]);
              const float fb = fast_exp2(bc[ms][r & 1] - tb[(j + 1) * ldb + a]);
              ka[ms][r] = pack2<T>(fa == 0.f ? 0.f : x.x * fa, fb == 0.f ? 0.f : x.y * fb);
            }
          }
        }
#pragma unroll
        for (int np = 0; np < NB / 2; ++np) {
          unsigned vb4[4];
          ldsm_x4_t(vb4, vrow + 16 * kt * ldv + 16 * np);
#pragma unroll
          for (int ms = 0; ms < MS; ++ms) {
            if (sw + NWS * ms >= nKt) continue;
            mma16816<T>(S[ms][2 * np], ka[ms], vb4[0], vb4[1]);
            mma16816<T>(S[ms][2 * np + 1], ka[ms], vb4[2], vb4[3]);
          }
        }
      }
      if (!LOCAL && c + 1 < c_hi) write_st(st_ptr(buf ^ 1));
      if constexpr (GK) {
        if (c + 1 < c_hi) staged_scan(c + 1, tab_ptr(buf ^ 1));
      }
      if constexpr (GV) {
        if (c + 1 < c_hi && gv_scans) scan_gv(c + 1, gvt_ptr(buf ^ 1));
      }
    });
    if constexpr (LOCAL) {
      // The split's own final state into its slot; its total decay factor once.
      float* dst = P.split_state + (nh * P.nsplit + sp + 1) * std::int64_t(p.K) * p.V;
#pragma unroll
      for (int ms = 0; ms < MS; ++ms)
#pragma unroll
        for (int nt = 0; nt < NB; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int a = 16 * (sw + NWS * ms) + r4 + 8 * (i >> 1), b = 8 * nt + c4 + (i & 1);
            if (a < p.K && b < w) dst[kv_layout ? std::int64_t(a) * p.V + (b0 + b) : std::int64_t(b0 + b) * p.K + a] = S[ms][nt][i];
          }
      if constexpr (GK) {
        if (vb == 0 && lane >= 16) {
#pragma unroll
          for (int ms = 0; ms < MS; ++ms) {
            const int a = 16 * (sw + NWS * ms) + (lane & 15);
            if (a < p.K) P.split_decay[(nh * (P.nsplit - 1) + sp) * p.K + a] = float(exp(split_Gk[ms]));
          }
        }
      } else {
        if (vb == 0 && sw == 0 && lane == 0) P.split_decay[nh * (P.nsplit - 1) + sp] = split_zero ? 0.f : float(exp(split_G));
      }
      return;
    }
    // The final state, from the registers (the last split's).
    if (p.ht && last_split) {
#pragma unroll
      for (int ms = 0; ms < MS; ++ms)
#pragma unroll
        for (int nt = 0; nt < NB; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int a = 16 * (sw + NWS * ms) + r4 + 8 * (i >> 1), b = 8 * nt + c4 + (i & 1);
            if (a < p.K && b < w) {
              const std::int64_t off = kv_layout ? n * p.ht_s0 + h * p.ht_s1 + a * p.ht_s2 + (b0 + b)
                                                 : n * p.ht_s0 + h * p.ht_s1 + (b0 + b) * p.ht_s2 + a;
              static_cast<float*>(p.ht)[off] = S[ms][nt][i];
            }
          }
    }
    // The output role's mbarriers are invalidated at the end (below); this is the state warps'
    // side of the barrier that orders that after every wait on them.
    if constexpr (WPM > 1) block_sync();
    if constexpr (GV) {
      if (sw == 0 && lane == 0) mbar_inval(vmbar);
    }
    return;
  }

  if constexpr (!LOCAL) {
  // Output warps. Row tile: tile m costs m + 1 token tiles of A and of A V, so with 4 tiles of
  // 2 warps the warps that share a scheduler (w, w + 4) get tiles 0 + 3 or 1 + 2.
  const bool out_warp = warp < nM * WPM;
  const int mi = (nM == 4 && WPM == 2 && warp >= 4) ? 3 - ((warp - 4) >> 1) : warp / WPM;
  const int nbase = (warp % WPM) * NTW * 8;  // first column of the warp's output
  // The thread's output columns (nbase + c4 + 8 t, + 1) from token 0's row; every one of them
  // real and each pair 4-byte aligned: one 32-bit store a pair at compile-time offsets.
  T* const out_col = static_cast<T*>(p.out) + bidx * p.out_s0 + std::int64_t(h) * p.out_s2 + b0 + nbase + c4;
  const bool out_whole = P.out_pairs && nbase + 8 * NTW <= w;
  // The WPM warps of a row tile (warps grp0 .. grp0 + WPM - 1) each form A over a share of the
  // key channels [16 ks0, 16 ks1) and add the others' partial sums (shared memory, an mbarrier
  // each tile): A once a tile, not WPM times (H100 profile, 2026-12-05: the
  // gk operand scaling, repeated by both warps of a tile, was half of the kernel's instructions).
  const int grp = warp % WPM, grp0 = warp - grp;
  const int ks0 = grp * nKt / WPM, ks1 = (grp + 1) * nKt / WPM;
  auto owns = [&](int ks) { return ks >= ks0 && ks < ks1; };  // the warp's own key channels
  // The exchange is ordered by an mbarrier a row tile (arrive, then wait for the phase), not by
  // a named barrier of the tile's warps: compute-sanitizer's racecheck (H100, 2026-12-05)
  // reported hazards across the chunk barrier whenever a named barrier of part of the block
  // was used beside it.
  const unsigned mbar = unsigned(__cvta_generic_to_shared(chunked_smem + L.off_mbar)) + 8u * unsigned(mi);
  if (WPM > 1 && out_warp && grp == 0 && lane == 0)
    mbar_init(mbar, 32 * WPM);
  // (the chunk loop's first barrier orders the init before any arrival)
  chunk_loop([&](std::int64_t c, int buf, std::int64_t i0, int cl, const std::uint16_t* sq, const std::uint16_t* sk,
                 const std::uint16_t* sv, float, double, int) {
    if (!out_warp || 16 * mi >= cl) return;
    const std::uint16_t* st = st_ptr(buf);
    // A = Q_m K^T (tokens 0 .. 16 mi + 15) and O = Q_m S~ (the warp's columns).
    float A[2 * nM][4], O[NTW][4];
#pragma unroll
    for (int t = 0; t < 2 * nM; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) A[t][i] = 0.f;
#pragma unroll
    for (int t = 0; t < NTW; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) O[t][i] = 0.f;
    const bool inter = c > c_lo || has_h0;
    const std::uint16_t* qrow = sq + (16 * mi + (lane & 15)) * ldk + (lane >> 4) * 8;
    const std::uint16_t* krow = sk + ((lane & 7) + (lane >> 4) * 8) * ldk + ((lane >> 3) & 1) * 8;
    const std::uint16_t* srow = st + ((lane & 7) + ((lane >> 3) & 1) * 8) * ldv + nbase + (lane >> 4) * 8;
    // gk: the table of the chunk; the row tile's reference row 16 mi - 1 (B_ref = 0 for the
    // first tile). A's tiles before the diagonal one take q scaled by e^{B_i - B_ref} (<= 1)
    // and k by e^{B_ref - B_j} (<= 1), products in bfloat16 (its range holds what half's
    // cannot); the diagonal tile the same when the tile's flag allows (every |B_i - B_ref| <=
    // chunked_gk_fast_log2), else elementwise below. The inter-chunk product takes q scaled by
    // e^{B_i}.
    const float* tb = GK ? tab_ptr(buf) : nullptr;
    bool fast = true;
    if constexpr (GK) {
      const unsigned* fl = flag_ptr(buf);
      unsigned bits = 0;
#pragma unroll
      for (int s8 = 0; s8 < 8; ++s8) bits |= fl[s8];
      fast = ((bits >> mi) & 1u) == 0u;
    }
    const int ref_row = 16 * mi - 1;
    // gk: the inter-chunk operand q e^{B_i} spans every key channel, so each warp of the row
    // tile would scale all of them. Where the tile takes no elementwise diagonal (`fast`: the
    // only other reader of its q rows), each warp writes its own channels' scaled q over the
    // raw q rows (a row tile's rows are read by its warps alone; the stage is next written
    // after the chunk barrier) and the others read them with ldmatrix after the A exchange,
    // whose mbarrier orders the writes (ncu on an H100, B4 T4096 H16: the scaling was 11 % of
    // gk's and 12 % of gk + gv's instructions, WPM times over).
    const bool share_q = GK && WPM > 1 && inter && fast;
    auto inter_product = [&](const unsigned (&qa)[4], int ks) {
      if constexpr (NTW >= 2) {
#pragma unroll
        for (int np = 0; np < NTW / 2; ++np) {
          unsigned sb[4];
          ldsm_x4_t(sb, srow + 16 * ks * ldv + 16 * np);
          mma16816<T>(O[2 * np], qa, sb[0], sb[1]);
          mma16816<T>(O[2 * np + 1], qa, sb[2], sb[3]);
        }
      } else {
        unsigned sb[2];
        ldsm_x2_t(sb, srow + 16 * ks * ldv);
        mma16816<T>(O[0], qa, sb[0], sb[1]);
      }
    };
    // With share_q the warp's own channels only (the others' after the exchange, from the
    // owners' scaled rows).
    const int ks_b = share_q ? ks0 : 0, ks_e = share_q ? ks1 : nKt;
#pragma unroll(GK ? 1 : 2)
    for (int ks = ks_b; ks < ks_e; ++ks) {
      const bool mine = owns(ks);
      unsigned qa[4];
      ldsm_x4(qa, qrow + 16 * ks);
      if constexpr (GK) {
        if (mine) {
        // Register r of q: row 16 mi + r4 + 8 (r & 1), channels 16 ks + c4 + 8 (r >> 1) + {0, 1};
        // of k (kb[m]): token 16 np + r4 + 8 (m >> 1), channels 16 ks + c4 + 8 (m & 1) + {0, 1}.
        float bref[2][2];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int e = 0; e < 2; ++e) bref[u][e] = mi > 0 ? tb[ref_row * ldb + 16 * ks + c4 + 8 * u + e] : 0.f;
        // (a: even, ldb even: the pairs of B below are 8-byte aligned)
        unsigned qi[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 16 * mi + r4 + 8 * (r & 1), a = 16 * ks + c4 + 8 * (r >> 1);
          const float2 x = unpack2<T>(qa[r]);
          const float2 b = *reinterpret_cast<const float2*>(tb + i * ldb + a);
          qi[r] = pack2<bfloat16>(x.x * fast_exp2(b.x - bref[r >> 1][0]), x.y * fast_exp2(b.y - bref[r >> 1][1]));
        }
#pragma unroll
        for (int np = 0; np < nM; ++np) {
          if (np > mi || (np == mi && !fast)) break;
          unsigned kb[4];
          ldsm_x4(kb, krow + 16 * np * ldk + 16 * ks);
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const int j = 16 * np + r4 + 8 * (m >> 1), a = 16 * ks + c4 + 8 * (m & 1);
            const float2 x = unpack2<T>(kb[m]);
            const float2 b = *reinterpret_cast<const float2*>(tb + j * ldb + a);
            kb[m] = pack2<bfloat16>(x.x * fast_exp2(bref[m & 1][0] - b.x), x.y * fast_exp2(bref[m & 1][1] - b.y));
          }
          mma16816<bfloat16>(A[2 * np], qi, kb[0], kb[1]);
          mma16816<bfloat16>(A[2 * np + 1], qi, kb[2], kb[3]);
        }
        }
        if (inter) {  // the inter-chunk product's operand: q scaled by e^{B_i}
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int i = 16 * mi + r4 + 8 * (r & 1), a = 16 * ks + c4 + 8 * (r >> 1);
            const float2 x = unpack2<T>(qa[r]);
            const float2 b = *reinterpret_cast<const float2*>(tb + i * ldb + a);
            qa[r] = pack2<T>(x.x * fast_exp2(b.x), x.y * fast_exp2(b.y));
          }
          if (share_q) {  // (mine: the loop skipped the others' channels)
            std::uint16_t* const qw = const_cast<std::uint16_t*>(sq);
#pragma unroll
            for (int r = 0; r < 4; ++r)
              *reinterpret_cast<unsigned*>(qw + (16 * mi + r4 + 8 * (r & 1)) * ldk + 16 * ks + c4 + 8 * (r >> 1)) = qa[r];
          }
        }
      } else {
#pragma unroll
        for (int np = 0; np < nM; ++np) {
          if (np > mi || !mine) break;
          unsigned kb[4];
          ldsm_x4(kb, krow + 16 * np * ldk + 16 * ks);
          mma16816<T>(A[2 * np], qa, kb[0], kb[1]);
          mma16816<T>(A[2 * np + 1], qa, kb[2], kb[3]);
        }
      }
      if (inter) inter_product(qa, ks);
    }
    // The partial sums of the tile's other warps: in float without per-channel or per-column
    // decays and K <= 128 (chunked_xa_float), else rounded to the input dtype (as A is for A V).
    if constexpr (WPM > 1) {
      constexpr bool XF = chunked_xa_float(GK, GV, 128 * MS);  // (MS 1: Kp <= 128, launch.cuh's by_ms)
      uint2* xa = reinterpret_cast<uint2*>(chunked_smem + L.off_xa) + lane;
      float4* xf = reinterpret_cast<float4*>(chunked_smem + L.off_xa) + lane;
#pragma unroll
      for (int t = 0; t < 2 * nM; ++t) {
        if (t >= 2 * (mi + 1)) break;
        if constexpr (XF) xf[(warp * 2 * nM + t) * 32] = make_float4(A[t][0], A[t][1], A[t][2], A[t][3]);
        else xa[(warp * 2 * nM + t) * 32] = make_uint2(pack2<T>(A[t][0], A[t][1]), pack2<T>(A[t][2], A[t][3]));
      }
      mbar_arrive(mbar);
      // A phase a chunk: a tile skips the exchange only past the end of the sequence, in its
      // last chunk.
      mbar_wait(mbar, unsigned((c - c_lo) & 1));
#pragma unroll
      for (int o = 1; o < WPM; ++o) {
        const int pw = grp0 + (grp + o) % WPM;
#pragma unroll
        for (int t = 0; t < 2 * nM; ++t) {
          if (t >= 2 * (mi + 1)) break;
          if constexpr (XF) {
            const float4 x = xf[(pw * 2 * nM + t) * 32];
            A[t][0] += x.x;
            A[t][1] += x.y;
            A[t][2] += x.z;
            A[t][3] += x.w;
          } else {
            const uint2 x = xa[(pw * 2 * nM + t) * 32];
            const float2 lo = unpack2<T>(x.x), hi = unpack2<T>(x.y);
            A[t][0] += lo.x;
            A[t][1] += lo.y;
            A[t][2] += hi.x;
            A[t][3] += hi.y;
          }
        }
      }
      if (share_q) {  // the other warps' key channels, scaled by them (ordered by the exchange)
#pragma unroll
        for (int ks = 0; ks < 8 * MS; ++ks) {
          if (ks >= nKt) break;
          if (owns(ks)) continue;
          unsigned qa[4];
          ldsm_x4(qa, qrow + 16 * ks);
          inter_product(qa, ks);
        }
      }
    }
    // The decay mask of A (causal; e^{G_i - G_j} within a segment) and the incoming state's
    // row factors e^{G_i}.
    const int i_lo = 16 * mi + r4, i_hi = i_lo + 8;
    if constexpr (GATED) {
      const float Gi[2] = {sG[i_lo], sG[i_hi]};
      const int segi[2] = {sSeg[i_lo], sSeg[i_hi]};
      const float fi[2] = {sFi[i_lo], sFi[i_hi]};
#pragma unroll
      for (int t = 0; t < NTW; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) O[t][i] = fi[i >> 1] == 0.f ? 0.f : O[t][i] * fi[i >> 1];
      if (mask_fast) {  // (block-uniform) the factored form (scan_chunk)
        const float rf[2] = {sRf[i_lo], sRf[i_hi]};
        const float* cf = sCf + mi * C;
#pragma unroll
        for (int t = 0; t < 2 * nM; ++t) {
          if (t >= 2 * (mi + 1)) break;
          const bool diag = t >= 2 * mi;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = 8 * t + c4 + e;
            const float f = cf[j];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const float a = A[t][2 * hh + e] * f * rf[hh];
              A[t][2 * hh + e] = diag && j > (hh ? i_hi : i_lo) ? 0.f : a;
            }
          }
        }
      } else {
#pragma unroll
        for (int t = 0; t < 2 * nM; ++t) {
          if (t >= 2 * (mi + 1)) break;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = 8 * t + c4 + e;
            const float Gj = sG[j];
            const int segj = sSeg[j];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int i = hh ? i_hi : i_lo;
              const float m = segi[hh] == segj ? fast_exp2(Gi[hh] - Gj) : 0.f;
              const float a = A[t][2 * hh + e];
              A[t][2 * hh + e] = (j > i || m == 0.f) ? 0.f : a * m;
            }
          }
        }
      }
    } else {
      if constexpr (GK) {
        if (!fast) {
          // The diagonal tile elementwise: A_ij = sum_a q_ia k_ja e^{B_i[a] - B_j[a]}, j <= i.
#pragma unroll
          for (int t = 0; t < 2 * nM; ++t) {
            if (t / 2 != mi) continue;  // (A's registers by compile-time index)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int i = hh ? i_hi : i_lo, j = 8 * t + c4 + e;
                float acc = 0.f;
                if (j <= i) {
                  const unsigned* qp = reinterpret_cast<const unsigned*>(sq + i * ldk);
                  const unsigned* kp = reinterpret_cast<const unsigned*>(sk + j * ldk);
                  for (int a2 = 0; a2 < Kp / 2; ++a2) {
                    const float2 qx = unpack2<T>(qp[a2]), kx = unpack2<T>(kp[a2]);
                    const float2 bi = *reinterpret_cast<const float2*>(tb + i * ldb + 2 * a2);
                    const float2 bj = *reinterpret_cast<const float2*>(tb + j * ldb + 2 * a2);
                    acc = fmaf(qx.x * kx.x, fast_exp2(bi.x - bj.x), acc);
                    acc = fmaf(qx.y * kx.y, fast_exp2(bi.y - bj.y), acc);
                  }
                }
                A[t][2 * hh + e] = acc;
              }
          }
        }
      }
#pragma unroll
      for (int t = 0; t < 2 * nM; ++t) {
        if (t >= 2 * (mi + 1)) break;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (8 * t + c4 + (i & 1) > (i < 2 ? i_lo : i_hi)) A[t][i] = 0.f;
      }
    }
    // gv (D: the chunk's table, r = ref_row, D_r = 0 for the first tile): o_i[b] takes
    // e^{D_i[b]} on the inter-chunk term and e^{D_i[b] - D_j[b]} on token j's term, formed as
    // e^{D_i - D_r} (<= 1, on the sum) times e^{D_r - D_j} (on v_j: <= 1 for the key tiles
    // before the diagonal one; on the diagonal tile it grows up to the decay over 15 tokens,
    // so that tile takes the tensor cores only while every |D_j - D_r| <= chunked_gk_fast_log2
    // (log2) over the warp's columns, else it is added elementwise below). So the inter-chunk
    // term is first scaled by e^{D_r}, and the whole sum by e^{D_i - D_r} after A V.
    //
    // With VT_OUT, a chunk whose every |D_C - D_j| is within chunked_gk_fast_log2 (the scan's
    // flags; D_C the chunk's last value) takes instead the reference C for every row tile:
    // e^{D_i - D_j} = e^{D_i - D_C} e^{D_C - D_j}, the second factor the state warps' V~ (so no
    // v operand is scaled here, and the diagonal tile takes the tensor cores too), the first
    // (bounded by 2^64 both ways) on the sum, whose inter-chunk term is first scaled by e^{D_C}.
    const float* dt = GV ? gvt_ptr(buf) : nullptr;
    bool gv_whole = false;
    if constexpr (VT_OUT) {
      const unsigned* fl = gvflag_ptr(buf);
      unsigned bits = 0;
#pragma unroll
      for (int s8 = 0; s8 < BV / GV_NCW; ++s8) bits |= fl[s8];
      gv_whole = bits == 0u;
    }
    // D_r of column b (reread from shared memory where needed: registers are short here); D_C
    // where the chunk takes V~.
    auto d_ref = [&](int b) { return gv_whole ? dt[b * ldt + C - 1] : mi > 0 ? dt[b * ldt + ref_row] : 0.f; };
    float drv[GV ? NTW : 1];  // D_r of the thread's v operand's column nbase + 8 t + r4
    bool gv_fast = true;
    if constexpr (GV) {
#pragma unroll
      for (int t = 0; t < NTW; ++t) {
        drv[t] = d_ref(nbase + 8 * t + r4);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float f = fast_exp2(d_ref(nbase + 8 * t + c4 + e));
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) O[t][2 * hh + e] = f == 0.f ? 0.f : O[t][2 * hh + e] * f;
        }
      }
      if (!gv_whole) {
        // The diagonal tile's rows (lane & 15) against D_r, over half the warp's columns a lane.
        float dev = 0.f;
        const int jr = 16 * mi + (lane & 15);
#pragma unroll
        for (int u = 0; u < 4 * NTW; ++u) {
          const int b = nbase + (lane >> 4) * 4 * NTW + u;
          dev = fmaxf(dev, fabsf(dt[b * ldt + jr] - d_ref(b)));
        }
        gv_fast = __all_sync(0xffffffffu, dev <= chunked_gk_fast_log2);
      }
    }
    if constexpr (VT_OUT) {
      if (gv_whole) mbar_wait(vmbar, unsigned((c - c_lo) & 1));  // V~ written (the state warps arrive once a chunk)
    }
    // O += A V (A's accumulators as the A operand, 16 tokens a step).
    const std::uint16_t* vsrc = VT_OUT && gv_whole ? reinterpret_cast<const std::uint16_t*>(chunked_smem + L.off_vt) : sv;
    const std::uint16_t* vrow = vsrc + ((lane & 7) + ((lane >> 3) & 1) * 8) * ldv + nbase + (lane >> 4) * 8;
#pragma unroll
    for (int kt = 0; kt < nM; ++kt) {
      if (kt > mi || (GV && kt == mi && !gv_fast)) break;
      const unsigned aa[4] = {pack2<AVT>(A[2 * kt][0], A[2 * kt][1]), pack2<AVT>(A[2 * kt][2], A[2 * kt][3]),
                              pack2<AVT>(A[2 * kt + 1][0], A[2 * kt + 1][1]),
                              pack2<AVT>(A[2 * kt + 1][2], A[2 * kt + 1][3])};
      // gv: register r of the v operand holds tokens 16 kt + c4 + 8 (r & 1) + {0, 1} of column
      // nbase + 8 (np-th 8-column tile) + r4; scaled by e^{D_r - D_j} into bfloat16.
      auto scale_v = [&](unsigned& x, int r, int t8) {
        const int j = 16 * kt + c4 + 8 * (r & 1), b = nbase + 8 * t8 + r4;
        const float2 y = unpack2<T>(x);
        const float2 d = *reinterpret_cast<const float2*>(dt + b * ldt + j);  // (j even, ldt even)
        const float fa = fast_exp2(drv[t8] - d.x), fb = fast_exp2(drv[t8] - d.y);
        x = pack2<bfloat16>(fa == 0.f ? 0.f : y.x * fa, fb == 0.f ? 0.f : y.y * fb);
      };
      if constexpr (NTW >= 2) {
#pragma unroll
        for (int np = 0; np < NTW / 2; ++np) {
          unsigned vb4[4];
          ldsm_x4_t(vb4, vrow + 16 * kt * ldv + 16 * np);
          if constexpr (GV) {
            if (!gv_whole) {
#pragma unroll
              for (int r = 0; r < 4; ++r) scale_v(vb4[r], r, 2 * np + (r >> 1));
            }
          }
          mma16816<AVT>(O[2 * np], aa, vb4[0], vb4[1]);
          mma16816<AVT>(O[2 * np + 1], aa, vb4[2], vb4[3]);
        }
      } else {
        unsigned vb2[2];
        ldsm_x2_t(vb2, vrow + 16 * kt * ldv);
        if constexpr (GV) {
          if (!gv_whole) {
            scale_v(vb2[0], 0, 0);
            scale_v(vb2[1], 1, 0);
          }
        }
        mma16816<AVT>(O[0], aa, vb2[0], vb2[1]);
      }
    }
    if constexpr (GV) {
      // The whole sum by e^{D_i - D_r}; then, where the diagonal tile was left out, its terms
      // A_ij e^{D_i[b] - D_j[b]} v_j[b] (j <= i: factors <= 1), A_ij from the lanes of the quad.
#pragma unroll
      for (int t = 0; t < NTW; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int b = nbase + 8 * t + c4 + e;
          const float dr = d_ref(b);
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const float f = fast_exp2(dt[b * ldt + (hh ? i_hi : i_lo)] - dr);
            O[t][2 * hh + e] = f == 0.f ? 0.f : O[t][2 * hh + e] * f;
          }
        }
      if (!gv_fast) {
        float ad[2][4];  // the diagonal tile of A (compile-time register indices)
#pragma unroll
        for (int t = 0; t < 2 * nM; ++t) {
          if (t / 2 != mi) continue;
#pragma unroll
          for (int i = 0; i < 4; ++i) ad[t & 1][i] = A[t][i];
        }
#pragma unroll 1
        for (int jj = 0; jj < 16; ++jj) {
          const int src = (lane & ~3) | ((jj & 7) >> 1);
          const int hi8 = jj >> 3, odd = jj & 1;  // (selects, not a run-time register index)
          const float a_lo = __shfl_sync(0xffffffffu, hi8 ? (odd ? ad[1][1] : ad[1][0]) : (odd ? ad[0][1] : ad[0][0]), src);
          const float a_hi = __shfl_sync(0xffffffffu, hi8 ? (odd ? ad[1][3] : ad[1][2]) : (odd ? ad[0][3] : ad[0][2]), src);
          const int j = 16 * mi + jj;
#pragma unroll
          for (int t = 0; t < NTW; ++t)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int b = nbase + 8 * t + c4 + e;
              const float vj = unpack2<T>(unsigned(sv[j * ldv + b])).x;
              const float dj = dt[b * ldt + j];
              if (j <= i_lo) O[t][e] = fmaf(a_lo * vj, fast_exp2(dt[b * ldt + i_lo] - dj), O[t][e]);
              if (j <= i_hi) O[t][2 + e] = fmaf(a_hi * vj, fast_exp2(dt[b * ldt + i_hi] - dj), O[t][2 + e]);
            }
        }
      }
    }
    // The chunk's outputs (rows < cl, columns < w).
    T* const row_lo = out_col + tok(i0 + i_lo) * p.out_s1;
    const std::int64_t row8 = (reverse ? -8 : 8) * p.out_s1;  // row i_hi = i_lo + 8
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if ((hh ? i_hi : i_lo) >= cl) continue;
      T* const row = hh ? row_lo + row8 : row_lo;
      if (out_whole) {
#pragma unroll
        for (int t = 0; t < NTW; ++t)
          *reinterpret_cast<unsigned*>(row + 8 * t) = pack2<T>(scale * O[t][2 * hh], scale * O[t][2 * hh + 1]);
        continue;
      }
#pragma unroll
      for (int t = 0; t < NTW; ++t) {
        const int b = nbase + 8 * t + c4;
        const float x0 = scale * O[t][2 * hh], x1 = scale * O[t][2 * hh + 1];
        if (P.out_pairs && b + 1 < w) {
          *reinterpret_cast<unsigned*>(row + 8 * t) = pack2<T>(x0, x1);
        } else {
          if (b < w) row[8 * t] = from_acc<T>(x0);
          if (b + 1 < w) row[8 * t + 1] = from_acc<T>(x1);
        }
      }
    }
  });
  // Invalidate the exchange's mbarriers once every warp of the block is past its last wait on
  // them (PTX: an mbarrier object is invalidated before its shared memory is used for anything
  // else; racecheck on an H100, 2026-12-06, reported the next uses of that memory, cp.async
  // copies into a q/k/v stage, as write-write hazards with the init).
  if constexpr (WPM > 1) {
    block_sync();
    if (out_warp && grp == 0 && lane == 0) mbar_inval(mbar);
  }
  }
}

/// Between the two passes of a split launch: slot 0 of P.split_state gets the initial state
/// (or zeros), and slot s + 1 (split s's own final state L_s) becomes the state entering split
/// s + 1, S_{s+1} = d_s S_s + L_s; one thread an element of a (sequence, head) state.
__global__ void chunked_combine_kernel(const chunked_params P) {
  const forward_params& p = P.f;
  const std::int64_t KV = std::int64_t(p.K) * p.V, total = P.N * p.H * KV;
  const int ns = P.nsplit;
  for (std::int64_t idx = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t e = idx % KV, nh = idx / KV, n = nh / p.H, h = nh % p.H;
    const std::int64_t a = p.kv_layout ? e / p.V : e % p.K, b = p.kv_layout ? e % p.V : e / p.K;
    float acc = 0.f;
    if (p.h0)
      acc = static_cast<const float*>(p.h0)[p.kv_layout ? n * p.h0_s0 + h * p.h0_s1 + a * p.h0_s2 + b
                                                          : n * p.h0_s0 + h * p.h0_s1 + b * p.h0_s2 + a];
    float* slot = P.split_state + nh * ns * KV + e;
    slot[0] = acc;
    for (int s = 1; s < ns; ++s) {
      const float f = P.decay_rows ? P.split_decay[(nh * (ns - 1) + s - 1) * p.K + a] : P.split_decay[nh * (ns - 1) + s - 1];
      acc = (f == 0.f ? 0.f : f * acc) + slot[s * KV];
      slot[s * KV] = acc;
    }
  }
}

}  // namespace recattn::cuda
