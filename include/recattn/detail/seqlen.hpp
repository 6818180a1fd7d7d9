// Dense versus varlen indexing behind one small type (flash-attention's SeqlenInfo).
#pragma once

#include <cstdint>

#include "../problem.hpp"

namespace recattn::detail {

template <bool Varlen>
struct seqlen_info {
  std::int64_t batch;  ///< index into the B dimension of the tensors
  std::int64_t begin;  ///< first time index of the sequence
  std::int64_t len;    ///< tokens in the sequence
  seqlen_info(const problem& p, std::int64_t n) {
    if constexpr (Varlen) {
      batch = 0;
      begin = load_as<std::int64_t>(p.cu_seqlens, p.cu_type, n);
      len = load_as<std::int64_t>(p.cu_seqlens, p.cu_type, n + 1) - begin;
    } else {
      batch = n;
      begin = 0;
      len = p.T;
    }
  }
  /// Time index of the i-th processed token.
  template <bool Reverse>
  std::int64_t token(std::int64_t i) const { return begin + (Reverse ? len - 1 - i : i); }
};

}  // namespace recattn::detail
