// Runtime flag -> constexpr, in the manner of flash-attention's static_switch.h. Every
// switch of the library is used in dispatch.hpp, so the compiled variants are listed there.
#pragma once

#include <type_traits>

#include "../error.hpp"

/// BOOL_SWITCH(cond, NAME, ...): runs the lambda body with `constexpr bool NAME`.
#define RECATTN_BOOL_SWITCH(COND, CONST_NAME, ...) \
  [&] {                                            \
    if (COND) {                                    \
      constexpr static bool CONST_NAME = true;     \
      return __VA_ARGS__();                        \
    } else {                                       \
      constexpr static bool CONST_NAME = false;    \
      return __VA_ARGS__();                        \
    }                                              \
  }()

/// Like RECATTN_BOOL_SWITCH, with the `true` branch cut when DISABLED is nonzero: a call
/// that needs it throws recattn::Error naming WHAT (the macro that cut it).
#define RECATTN_BOOL_SWITCH_CAPPED(COND, DISABLED, WHAT, CONST_NAME, ...)                        \
  [&] {                                                                                          \
    if constexpr (DISABLED) {                                                                    \
      if (COND) throw ::recattn::Error(std::string(WHAT) + ": this build was compiled without it"); \
      constexpr static bool CONST_NAME = false;                                                  \
      return __VA_ARGS__();                                                                      \
    } else {                                                                                     \
      if (COND) {                                                                                \
        constexpr static bool CONST_NAME = true;                                                 \
        return __VA_ARGS__();                                                                    \
      } else {                                                                                   \
        constexpr static bool CONST_NAME = false;                                                \
        return __VA_ARGS__();                                                                    \
      }                                                                                          \
    }                                                                                            \
  }()

#define RECATTN_GATE_CASE(M, CONST_NAME, ...) \
  case M: {                                   \
    constexpr static unsigned CONST_NAME = M; \
    return __VA_ARGS__();                     \
  }

#if defined(RECATTN_GATE_MASK_ONLY)
/// Only the one gate combination RECATTN_GATE_MASK_ONLY is compiled.
#define RECATTN_GATE_SWITCH(MASK, CONST_NAME, ...)                                                    \
  [&] {                                                                                               \
    if ((MASK) != unsigned(RECATTN_GATE_MASK_ONLY))                                                  \
      throw ::recattn::Error("gates: this build was compiled for one gate combination only "        \
                             "(RECATTN_GATE_MASK_ONLY)");                                            \
    constexpr static unsigned CONST_NAME = unsigned(RECATTN_GATE_MASK_ONLY);                         \
    return __VA_ARGS__();                                                                             \
  }()
#else
/// GATE_SWITCH(mask, NAME, ...): the 16 combinations of g, g_gamma, gk, gv.
#define RECATTN_GATE_SWITCH(MASK, CONST_NAME, ...)                                                      \
  [&] {                                                                                                 \
    switch (MASK) {                                                                                     \
      RECATTN_GATE_CASE(0u, CONST_NAME, __VA_ARGS__) RECATTN_GATE_CASE(1u, CONST_NAME, __VA_ARGS__)     \
      RECATTN_GATE_CASE(2u, CONST_NAME, __VA_ARGS__) RECATTN_GATE_CASE(3u, CONST_NAME, __VA_ARGS__)     \
      RECATTN_GATE_CASE(4u, CONST_NAME, __VA_ARGS__) RECATTN_GATE_CASE(5u, CONST_NAME, __VA_ARGS__)     \
      RECATTN_GATE_CASE(6u, CONST_NAME, __VA_ARGS__) RECATTN_GATE_CASE(7u, CONST_NAME, __VA_ARGS__)     \
      RECATTN_GATE_CASE(8u, CONST_NAME, __VA_ARGS__) RECATTN_GATE_CASE(9u, CONST_NAME, __VA_ARGS__)     \
      RECATTN_GATE_CASE(10u, CONST_NAME, __VA_ARGS__) RECATTN_GATE_CASE(11u, CONST_NAME, __VA_ARGS__)   \
      RECATTN_GATE_CASE(12u, CONST_NAME, __VA_ARGS__) RECATTN_GATE_CASE(13u, CONST_NAME, __VA_ARGS__)   \
      RECATTN_GATE_CASE(14u, CONST_NAME, __VA_ARGS__) default: {                                        \
        constexpr static unsigned CONST_NAME = 15u;                                                     \
        return __VA_ARGS__();                                                                           \
      }                                                                                                 \
    }                                                                                                   \
  }()
#endif
