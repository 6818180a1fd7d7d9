// Element types: float, double, bfloat16, half, with exact round-to-nearest-even conversion.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "config.hpp"

namespace recattn {

enum class dtype : std::uint8_t { float32, float64, bfloat16, float16, int32, int64 };

inline const char* dtype_name(dtype t) {
  switch (t) {
    case dtype::float32: return "float32";
    case dtype::float64: return "float64";
    case dtype::bfloat16: return "bfloat16";
    case dtype::float16: return "float16";
    case dtype::int32: return "int32";
    case dtype::int64: return "int64";
  }
  return "?";
}

inline std::size_t dtype_size(dtype t) {
  switch (t) {
    case dtype::float32: case dtype::int32: return 4;
    case dtype::float64: case dtype::int64: return 8;
    case dtype::bfloat16: case dtype::float16: return 2;
  }
  return 0;
}

namespace detail {
RECATTN_HOST_DEVICE std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
RECATTN_HOST_DEVICE float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace detail

/// bfloat16 storage type (the upper 16 bits of an IEEE float), bit-compatible with
/// `__nv_bfloat16`. Conversions round to nearest even; NaN stays NaN.
struct bfloat16 {
  std::uint16_t bits = 0;
  bfloat16() = default;
  RECATTN_HOST_DEVICE explicit bfloat16(float f) : bits(from_float(f)) {}
  RECATTN_HOST_DEVICE explicit operator float() const { return detail::bits_float(std::uint32_t(bits) << 16); }
  RECATTN_HOST_DEVICE static std::uint16_t from_float(float f) {
    std::uint32_t u = detail::float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return std::uint16_t(u >> 16);
  }
};

/// IEEE binary16 storage type, bit-compatible with `__half`. Round to nearest even,
/// overflow to infinity, subnormals kept.
struct half {
  std::uint16_t bits = 0;
  half() = default;
  RECATTN_HOST_DEVICE explicit half(float f) : bits(from_float(f)) {}
  RECATTN_HOST_DEVICE explicit operator float() const { return to_float(bits); }
  RECATTN_HOST_DEVICE static float to_float(std::uint16_t h) {
    const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1fu;
    const std::uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) return detail::bits_float(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
      // zero or subnormal: man * 2^-24, exact in float
      const float mag = float(man) * 5.9604644775390625e-8f;
      return sign ? -mag : mag;
    }
    return detail::bits_float(sign | ((exp + 112u) << 23) | (man << 13));
  }
  RECATTN_HOST_DEVICE static std::uint16_t from_float(float f) {
    const std::uint32_t u = detail::float_bits(f);
    const std::uint16_t sign = std::uint16_t((u >> 16) & 0x8000u);
    const std::uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return std::uint16_t(sign | 0x7e00u);  // NaN
    if (a >= 0x477ff000u) return std::uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (a < 0x38800000u) {
      // result is subnormal or zero: value / 2^-24 rounded to nearest even
      const float mag = detail::bits_float(a) * 16777216.0f;  // exact scaling by 2^24
      // round half to even on the integer part
      std::uint32_t m = std::uint32_t(mag);
      const float frac = mag - float(m);
      if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
      return std::uint16_t(sign | m);
    }
    std::uint32_t r = a - 0x38000000u;  // rebias exponent (127 - 15) << 23
    r += 0x0fffu + ((r >> 13) & 1u);
    return std::uint16_t(sign | (r >> 13));
  }
};

template <class T> struct dtype_of_t;
template <> struct dtype_of_t<float> { static constexpr dtype value = dtype::float32; };
template <> struct dtype_of_t<double> { static constexpr dtype value = dtype::float64; };
template <> struct dtype_of_t<bfloat16> { static constexpr dtype value = dtype::bfloat16; };
template <> struct dtype_of_t<half> { static constexpr dtype value = dtype::float16; };
template <> struct dtype_of_t<std::int32_t> { static constexpr dtype value = dtype::int32; };
template <> struct dtype_of_t<std::int64_t> { static constexpr dtype value = dtype::int64; };
template <class T> constexpr dtype dtype_of = dtype_of_t<std::remove_cv_t<T>>::value;

/// Accumulator of an input type: double for double, float otherwise (SPEC §6).
template <class T> using accum_t = std::conditional_t<std::is_same<T, double>::value, double, float>;

template <class To, class From>
RECATTN_HOST_DEVICE To convert(From x) {
  if constexpr (std::is_same<To, From>::value) {
    return x;
  } else if constexpr (std::is_same<From, bfloat16>::value || std::is_same<From, half>::value) {
    return To(float(x));
  } else if constexpr (std::is_same<To, bfloat16>::value || std::is_same<To, half>::value) {
    return To(float(x));
  } else {
    return To(x);
  }
}

/// Reads element `i` of an untyped array of dtype `t` as To.
template <class To>
inline To load_as(const void* p, dtype t, std::int64_t i) {
  switch (t) {
    case dtype::float32: return To(static_cast<const float*>(p)[i]);
    case dtype::float64: return To(static_cast<const double*>(p)[i]);
    case dtype::bfloat16: return To(float(static_cast<const bfloat16*>(p)[i]));
    case dtype::float16: return To(float(static_cast<const half*>(p)[i]));
    case dtype::int32: return To(static_cast<const std::int32_t*>(p)[i]);
    case dtype::int64: return To(static_cast<const std::int64_t*>(p)[i]);
  }
  return To(0);
}

/// Writes `x` to element `i` of an untyped array of dtype `t`.
template <class From>
inline void store_as(void* p, dtype t, std::int64_t i, From x) {
  switch (t) {
    case dtype::float32: static_cast<float*>(p)[i] = float(x); return;
    case dtype::float64: static_cast<double*>(p)[i] = double(x); return;
    case dtype::bfloat16: static_cast<bfloat16*>(p)[i] = bfloat16(float(x)); return;
    case dtype::float16: static_cast<half*>(p)[i] = half(float(x)); return;
    case dtype::int32: static_cast<std::int32_t*>(p)[i] = std::int32_t(x); return;
    case dtype::int64: static_cast<std::int64_t*>(p)[i] = std::int64_t(x); return;
  }
}

}  // namespace recattn
