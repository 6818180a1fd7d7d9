// Gate laws that stress the rescaled recurrences of the CPU kernels (forward and backward):
// strong decays down to -20 per token, strong and weak channels mixed, moderate decays whose
// segments span chunks, and growth. Used by tests/test_forward_decay.cpp and
// tests/test_backward_decay.cpp. Catch2-free.
#pragma once

#include <cstdint>

#include "generators.hpp"

namespace recattn::testing {

/// Gate values as a function of (token, channel): channel is the K or V index of gk or gv,
/// 0 for g and g_gamma.
using gate_law = double (*)(rng&, std::int64_t t, std::int64_t c);

/// Replaces every present gate of `d` with values drawn from `law` (g_gamma scaled down by
/// 64: it applies to every token).
inline void set_gates(problem_data& d, gate_law law, std::uint64_t seed) {
  rng r(seed);
  if (d.g.present()) d.g.fill([&](const idx& i) { return law(r, i[1], 0); });
  if (d.g_gamma.present()) d.g_gamma.fill([&](const idx&) { return law(r, 0, 0) / 64; });
  if (d.gk.present()) d.gk.fill([&](const idx& i) { return law(r, i[1], i[3]); });
  if (d.gv.present()) d.gv.fill([&](const idx& i) { return law(r, i[1], i[3]); });
}

inline double strong(rng& r, std::int64_t, std::int64_t) { return r.uniform(-20.0, 0.0); }
/// Even channels barely decay (long memory), odd ones decay by e^-5 .. e^-20 per token.
inline double mixed(rng& r, std::int64_t, std::int64_t c) {
  return c % 2 == 0 ? -1e-3 * r.uniform(0.0, 1.0) : r.uniform(-20.0, -5.0);
}
/// Moderate decays: segments of tens of tokens, spanning chunks.
inline double moderate(rng& r, std::int64_t, std::int64_t) { return r.uniform(-0.8, 0.0); }
/// Growth and decay mixed: the state grows by about e^0.01 per token on average.
inline double growing(rng& r, std::int64_t, std::int64_t c) {
  return c % 3 == 0 ? r.uniform(-0.05, 0.01) : r.uniform(0.0, 0.03);
}

/// The laws in the order the tests index them, and their names.
inline constexpr gate_law decay_laws[] = {strong, mixed, moderate, growing};
inline constexpr const char* decay_law_names[] = {"strong", "mixed", "moderate", "growing"};

}  // namespace recattn::testing
