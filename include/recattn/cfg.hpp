// Options, configuration and platform choice shared by every operation.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace recattn {

/// Where a call runs. `automatic` picks cuda for device pointers when the including
/// translation unit is compiled by nvcc, cpu otherwise.
enum class platform { automatic, cpu, cuda };

inline const char* platform_name(platform p) {
  switch (p) {
    case platform::automatic: return "automatic";
    case platform::cpu: return "cpu";
    case platform::cuda: return "cuda";
  }
  return "?";
}

/// Memory layout of one (sequence, head) state: `kv` is S[K][V] (SPEC default), `vk` S^T.
enum class state_layout { kv, vk };

/// How the CUDA forward computes: the token-by-token scan (`recurrent`, every backend) or
/// chunks of cfg.chunk tokens on tensor cores (`chunked`, CUDA; bfloat16 and half inputs,
/// gates g, g_gamma and gk in this version). `automatic` lets the backend choose.
enum class algorithm { automatic, recurrent, chunked };

inline const char* algorithm_name(algorithm a) {
  switch (a) {
    case algorithm::automatic: return "automatic";
    case algorithm::recurrent: return "recurrent";
    case algorithm::chunked: return "chunked";
  }
  return "?";
}

/// Tuning knobs. Zero means "heuristic choice"; `heuristic_cfg(problem)` fills them in.
struct cfg {
  int threads = 0;   ///< CPU worker threads (0: all hardware threads)
  int block_v = 0;   ///< value columns per work item (CPU and CUDA)
  int chunk = 0;     ///< CPU: tokens staged (converted, gates exponentiated) at once
  int block_k = 0;   ///< CUDA: key rows per thread group
  int num_warps = 0; ///< CUDA: warps per block
  /// CUDA: recurrent or chunked (automatic: the backend's choice). With `automatic`, a cfg
  /// that sets block_v, chunk, block_k or num_warps is read as a recurrent cfg (the meaning
  /// those fields had before this field existed).
  algorithm algo = algorithm::automatic;
  /// CUDA chunked: splits of each sequence run in parallel (a pass for the state entering each
  /// split, then the outputs of every split at once), for few long sequences; 0: the
  /// backend's choice, 1: none. Dense inputs only (with cu_seqlens: 0 or 1).
  int splits = 0;

  friend bool operator==(const cfg& a, const cfg& b) {
    return a.threads == b.threads && a.block_v == b.block_v && a.chunk == b.chunk && a.block_k == b.block_k &&
           a.num_warps == b.num_warps && a.algo == b.algo && a.splits == b.splits;
  }
  friend bool operator!=(const cfg& a, const cfg& b) { return !(a == b); }
  std::string str() const {
    return "threads=" + std::to_string(threads) + " block_v=" + std::to_string(block_v) +
           " chunk=" + std::to_string(chunk) + " block_k=" + std::to_string(block_k) +
           " num_warps=" + std::to_string(num_warps) + " algo=" + algorithm_name(algo) +
           (splits ? " splits=" + std::to_string(splits) : std::string());
  }
};

}  // namespace recattn
