// Compile-time policies: which gates are present, direction, layout, state layout.
#pragma once

#include "cfg.hpp"
#include "problem.hpp"

namespace recattn {

/// The specialization a kernel is compiled for. A gate that is absent is a `false` here
/// and costs nothing in the inner loop.
template <unsigned Gates, bool Reverse, bool Varlen, state_layout Layout>
struct forward_policy {
  static constexpr unsigned gates = Gates;
  static constexpr bool has_g = (Gates & gate_g) != 0;
  static constexpr bool has_g_gamma = (Gates & gate_g_gamma) != 0;
  static constexpr bool has_gk = (Gates & gate_gk) != 0;
  static constexpr bool has_gv = (Gates & gate_gv) != 0;
  /// A decay that depends on the key row (scalar gates fold into it).
  static constexpr bool decay_k = has_g || has_g_gamma || has_gk;
  /// A decay that depends on the value column.
  static constexpr bool decay_v = has_gv;
  static constexpr bool reverse = Reverse;
  static constexpr bool varlen = Varlen;
  static constexpr state_layout layout = Layout;
};

namespace detail {
template <class T> inline constexpr bool dependent_false = false;
}

}  // namespace recattn
