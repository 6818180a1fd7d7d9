// The one place where runtime flags become template arguments. Each backend's kernel is
// reached through `dispatch_forward<Backend>`; the switches below are the full list of
// compiled variants (dtype x gates x direction x layout x state layout), each one cut by a
// RECATTN_DISABLE_* macro (config.hpp).
#pragma once

#include <string>

#include "backward_problem.hpp"
#include "config.hpp"
#include "detail/static_switch.hpp"
#include "policy.hpp"
#include "problem.hpp"

#ifndef RECATTN_DISABLE_REVERSE
#define RECATTN_DISABLE_REVERSE 0
#endif
#ifndef RECATTN_DISABLE_VARLEN
#define RECATTN_DISABLE_VARLEN 0
#endif
#ifndef RECATTN_DISABLE_VK_STATE
#define RECATTN_DISABLE_VK_STATE 0
#endif
#ifndef RECATTN_DISABLE_FLOAT64
#define RECATTN_DISABLE_FLOAT64 0
#endif
#ifndef RECATTN_DISABLE_BFLOAT16
#define RECATTN_DISABLE_BFLOAT16 0
#endif
#ifndef RECATTN_DISABLE_FLOAT16
#define RECATTN_DISABLE_FLOAT16 0
#endif

namespace recattn::detail {

/// Calls fn(T{}) with the element type of dtype `t`.
template <class Fn>
decltype(auto) dtype_switch(dtype t, Fn&& fn) {
  switch (t) {
    case dtype::float32: return fn(float{});
    case dtype::float64:
      if constexpr (RECATTN_DISABLE_FLOAT64) throw Error("query: dtype float64: this build was compiled without it (RECATTN_DISABLE_FLOAT64)");
      else return fn(double{});
    case dtype::bfloat16:
      if constexpr (RECATTN_DISABLE_BFLOAT16) throw Error("query: dtype bfloat16: this build was compiled without it (RECATTN_DISABLE_BFLOAT16)");
      else return fn(bfloat16{});
    case dtype::float16:
      if constexpr (RECATTN_DISABLE_FLOAT16) throw Error("query: dtype float16: this build was compiled without it (RECATTN_DISABLE_FLOAT16)");
      else return fn(half{});
    default: break;
  }
  fail("query", "dtype float32, float64, bfloat16 or float16", dtype_name(t));
}

/// Calls `Backend::template forward<T, forward_policy<...>>(p, c)` for the specialization
/// that matches the checked problem p.
template <class Backend, class Cfg>
void dispatch_forward(const problem& p, const Cfg& c) {
  dtype_switch(p.type, [&](auto tag) {
    using T = decltype(tag);
    RECATTN_GATE_SWITCH(p.gates, Gates, [&] {
      RECATTN_BOOL_SWITCH_CAPPED(p.reverse, RECATTN_DISABLE_REVERSE, "reverse (RECATTN_DISABLE_REVERSE)", Reverse, [&] {
        RECATTN_BOOL_SWITCH_CAPPED(p.varlen, RECATTN_DISABLE_VARLEN, "cu_seqlens (RECATTN_DISABLE_VARLEN)", Varlen, [&] {
          RECATTN_BOOL_SWITCH_CAPPED(p.layout == state_layout::vk, RECATTN_DISABLE_VK_STATE,
                                     "state_layout vk (RECATTN_DISABLE_VK_STATE)", VK, [&] {
            constexpr state_layout L = VK ? state_layout::vk : state_layout::kv;
            Backend::template forward<T, forward_policy<Gates, Reverse, Varlen, L>>(p, c);
          });
        });
      });
    });
  });
}

/// Calls `Backend::template backward<T, forward_policy<...>>(bp, c)` for the specialization
/// that matches the checked backward problem bp: the same variants (and caps) as forward.
template <class Backend, class Cfg>
void dispatch_backward(const backward_problem& bp, const Cfg& c) {
  const problem& p = bp.fwd;
  dtype_switch(p.type, [&](auto tag) {
    using T = decltype(tag);
    RECATTN_GATE_SWITCH(p.gates, Gates, [&] {
      RECATTN_BOOL_SWITCH_CAPPED(p.reverse, RECATTN_DISABLE_REVERSE, "reverse (RECATTN_DISABLE_REVERSE)", Reverse, [&] {
        RECATTN_BOOL_SWITCH_CAPPED(p.varlen, RECATTN_DISABLE_VARLEN, "cu_seqlens (RECATTN_DISABLE_VARLEN)", Varlen, [&] {
          RECATTN_BOOL_SWITCH_CAPPED(p.layout == state_layout::vk, RECATTN_DISABLE_VK_STATE,
                                     "state_layout vk (RECATTN_DISABLE_VK_STATE)", VK, [&] {
            constexpr state_layout L = VK ? state_layout::vk : state_layout::kv;
            Backend::template backward<T, forward_policy<Gates, Reverse, Varlen, L>>(bp, c);
          });
        });
      });
    });
  });
}

}  // namespace recattn::detail
