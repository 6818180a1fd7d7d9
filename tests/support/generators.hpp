// Test support shared by every recattn test (forward, backward, CUDA): strided host buffers of
// any dtype, random problems of SPEC §2 shapes, tensor rearrangements (slice, flip, repeat
// heads, transpose), relative error and sentinel-filled buffers.
//
// Header-only and free of Catch2, so any test can include it:
//
//   using namespace recattn::testing;
//   problem_spec s;  s.T = 33;  s.K = 5;  s.V = 7;  s.gates = gate_g | gate_gk;
//   const problem_data d = generate(s);
//   auto r = recattn::recurrent_attention(d.q.view(), d.k.view(), d.v.view(), d.options());
//   auto ref = recattn::reference_recurrent_attention(d.q.view(), d.k.view(), d.v.view(), d.options());
//   CHECK(rel_error(r.output, ref.output) < 1e-4);
//
// Including it does not instantiate the kernels: nothing here calls the dispatcher.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <recattn/dtype.hpp>
#include <recattn/problem.hpp>
#include <recattn/tensor.hpp>

namespace recattn::testing {

// ---------------------------------------------------------------------------------------
// Random numbers

/// Deterministic random numbers: a test seeds it, so a failure reproduces.
class rng {
 public:
  explicit rng(std::uint64_t seed = 1) : gen_(seed) {}
  double normal(double mean = 0.0, double sd = 1.0) { return std::normal_distribution<double>(mean, sd)(gen_); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(gen_); }
  /// An integer in [lo, hi], both included.
  std::int64_t integer(std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(gen_);
  }
  bool coin(double p = 0.5) { return uniform(0.0, 1.0) < p; }
  template <class T>
  const T& pick(const std::vector<T>& xs) { return xs[std::size_t(integer(0, std::int64_t(xs.size()) - 1))]; }

 private:
  std::mt19937_64 gen_;
};

/// log(sigmoid(x)) without overflow: the gate distribution of SPEC §6 (always < 0).
inline double log_sigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }

// ---------------------------------------------------------------------------------------
// Strided host buffers

/// A multi-index; entries past the rank are ignored.
using idx = std::array<std::int64_t, max_rank>;

/// The state dtype of an input dtype: float, double for double inputs (SPEC §2).
inline dtype state_dtype(dtype input) { return input == dtype::float64 ? dtype::float64 : dtype::float32; }

/// The byte a sentinel buffer is filled with: every byte of an untouched buffer holds it.
inline constexpr unsigned char sentinel_byte = 0xA5;

/// Offset in elements of multi-index `i` of `v`.
inline std::int64_t element_offset(const tensor_view& v, const idx& i) {
  std::int64_t o = 0;
  for (int d = 0; d < v.rank(); ++d) o += i[std::size_t(d)] * v.stride(d);
  return o;
}

/// The strides of a view, one per dimension.
inline std::vector<std::int64_t> strides_of(const tensor_view& v) {
  return {v.strides().begin(), v.strides().begin() + v.rank()};
}

/// Element `i` of any view, as double.
inline double element(const tensor_view& v, const idx& i) {
  return load_as<double>(v.data(), v.type(), element_offset(v, i));
}

/// Calls f(index) for every multi-index of `shape` in row-major order.
template <class F>
void for_each_index(const std::vector<std::int64_t>& shape, F&& f) {
  for (auto s : shape)
    if (s <= 0) return;
  idx i{};
  const int rank = int(shape.size());
  if (rank == 0) return f(i);
  for (;;) {
    f(static_cast<const idx&>(i));
    int d = rank - 1;
    while (d >= 0 && ++i[std::size_t(d)] == shape[std::size_t(d)]) i[std::size_t(d--)] = 0;
    if (d < 0) return;
  }
}

/// An owning host buffer of any recattn dtype, with explicit strides in elements, that hands
/// out tensor views. `gaps[j]` extra elements are added to the stride of dimension
/// `rank - 2 - j` (j = 0: between rows of the last dimension, j = 1: one level up, ...), which
/// makes the view non-contiguous in every dimension but the last, like a slice of a larger
/// tensor. New storage, gaps included, is filled with NaN (floats) or zero (integers), so a
/// kernel that reads a gap poisons its result; `fill_bytes` re-fills it.
class buffer {
 public:
  buffer() = default;
  buffer(dtype type, std::vector<std::int64_t> shape, const std::vector<std::int64_t>& gaps = {})
      : type_(type), shape_(std::move(shape)), strides_(shape_.size()) {
    std::int64_t s = 1;
    for (int d = rank() - 1; d >= 0; --d) {
      const std::size_t j = std::size_t(rank() - 2 - d);
      if (d < rank() - 1 && j < gaps.size()) s += gaps[j];
      strides_[std::size_t(d)] = s;
      s *= std::max<std::int64_t>(shape_[std::size_t(d)], 1);
    }
    storage_.assign(std::size_t(s) * dtype_size(type_), 0);
    fill_nan();
  }
  /// A dense row-major copy of any view.
  static buffer copy_of(const tensor_view& v) {
    buffer b(v.type(), v.shape_vec());
    for_each_index(b.shape(), [&](const idx& i) { b.set_raw(i, v, i); });
    return b;
  }

  dtype type() const { return type_; }
  int rank() const { return int(shape_.size()); }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  const std::vector<std::int64_t>& strides() const { return strides_; }
  std::int64_t size(int d) const { return shape_[std::size_t(d)]; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : shape_) n *= s;
    return n;
  }
  /// False for a default-constructed buffer: an absent optional tensor.
  bool present() const { return !storage_.empty(); }
  void* data() { return storage_.data(); }
  const void* data() const { return storage_.data(); }
  /// All storage bytes, gaps included.
  const std::vector<unsigned char>& bytes() const { return storage_; }

  tensor_view view() const { return tensor_view(data(), type_, shape_, strides_); }
  mutable_tensor_view mutable_view() { return mutable_tensor_view(data(), type_, shape_, strides_); }
  operator tensor_view() const { return view(); }

  std::int64_t offset(const idx& i) const {
    std::int64_t o = 0;
    for (int d = 0; d < rank(); ++d) o += i[std::size_t(d)] * strides_[std::size_t(d)];
    return o;
  }
  double get(const idx& i) const { return load_as<double>(data(), type_, offset(i)); }
  /// Stores x rounded to the buffer's dtype.
  void set(const idx& i, double x) { store_as(data(), type_, offset(i), x); }
  /// Copies element j of `src` bit for bit when the dtypes agree (NaN payloads included).
  void set_raw(const idx& i, const tensor_view& src, const idx& j) {
    if (src.type() == type_) {
      const std::size_t es = dtype_size(type_);
      std::memcpy(storage_.data() + std::size_t(offset(i)) * es,
                  static_cast<const unsigned char*>(src.data()) + std::size_t(element_offset(src, j)) * es, es);
    } else {
      set(i, element(src, j));
    }
  }
  /// Sets every element to f(index).
  template <class F>
  buffer& fill(F&& f) {
    for_each_index(shape_, [&](const idx& i) { set(i, f(i)); });
    return *this;
  }
  /// Every storage byte, gaps included.
  void fill_bytes(unsigned char byte) { std::fill(storage_.begin(), storage_.end(), byte); }
  void fill_nan() {
    if (type_ == dtype::int32 || type_ == dtype::int64) return fill_bytes(0);
    const std::int64_t n = std::int64_t(storage_.size() / dtype_size(type_));
    for (std::int64_t i = 0; i < n; ++i) store_as(data(), type_, i, std::numeric_limits<double>::quiet_NaN());
  }
  /// Whether storage byte b belongs to an element (not to a gap).
  std::vector<bool> element_mask() const {
    std::vector<bool> m(storage_.size(), false);
    const std::size_t es = dtype_size(type_);
    for_each_index(shape_, [&](const idx& i) {
      for (std::size_t c = 0; c < es; ++c) m[std::size_t(offset(i)) * es + c] = true;
    });
    return m;
  }

 private:
  dtype type_ = dtype::float32;
  std::vector<std::int64_t> shape_, strides_;
  std::vector<unsigned char> storage_;
};

/// A buffer for an output or state, every byte the sentinel: `untouched` and `gaps_untouched`
/// tell whether a call wrote where it must not.
inline buffer sentinel_buffer(dtype type, std::vector<std::int64_t> shape, const std::vector<std::int64_t>& gaps = {}) {
  buffer b(type, std::move(shape), gaps);
  b.fill_bytes(sentinel_byte);
  return b;
}

/// Whether every byte of a sentinel buffer still holds the sentinel.
inline bool untouched(const buffer& b) {
  return std::all_of(b.bytes().begin(), b.bytes().end(), [](unsigned char c) { return c == sentinel_byte; });
}

/// Whether every gap byte (not part of an element) of a sentinel buffer still holds the sentinel.
inline bool gaps_untouched(const buffer& b) {
  const std::vector<bool> m = b.element_mask();
  for (std::size_t i = 0; i < m.size(); ++i)
    if (!m[i] && b.bytes()[i] != sentinel_byte) return false;
  return true;
}

/// A [n] index buffer (cu_seqlens, state indices) of integer dtype `t` holding `values`.
inline buffer index_buffer(const std::vector<std::int64_t>& values, dtype t = dtype::int64) {
  buffer b(t, {std::int64_t(values.size())});
  b.fill([&](const idx& i) { return double(values[std::size_t(i[0])]); });
  return b;
}

/// Whether two views hold the same elements bit for bit (a NaN equals the same NaN).
inline bool bitwise_equal(const tensor_view& a, const tensor_view& b) {
  if (a.type() != b.type() || a.shape_vec() != b.shape_vec()) return false;
  const std::size_t es = dtype_size(a.type());
  bool same = true;
  for_each_index(a.shape_vec(), [&](const idx& i) {
    same = same && std::memcmp(static_cast<const unsigned char*>(a.data()) + std::size_t(element_offset(a, i)) * es,
                               static_cast<const unsigned char*>(b.data()) + std::size_t(element_offset(b, i)) * es,
                               es) == 0;
  });
  return same;
}

// ---------------------------------------------------------------------------------------
// Errors

/// ||out - ref|| / ||ref|| (Frobenius norms, in double) over two views of the same shape, of
/// any dtypes. NaN when either holds a NaN or infinity, or the shapes differ, so that a
/// `rel_error(...) < tol` check fails; the absolute ||out - ref|| when ||ref|| = 0.
inline double rel_error(const tensor_view& out, const tensor_view& ref) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (out.shape_vec() != ref.shape_vec()) return nan;
  double diff = 0, norm = 0;
  bool finite = true;
  for_each_index(ref.shape_vec(), [&](const idx& i) {
    const double a = element(out, i), b = element(ref, i);
    finite = finite && std::isfinite(a) && std::isfinite(b);
    diff += (a - b) * (a - b);
    norm += b * b;
  });
  if (!finite) return nan;
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// ---------------------------------------------------------------------------------------
// Rearrangements (for invariants: reverse, varlen, grouped heads, state layout)

/// A dense copy of src with dimension `dim` cut to [begin, begin + length).
inline buffer slice(const tensor_view& src, int dim, std::int64_t begin, std::int64_t length) {
  std::vector<std::int64_t> shape = src.shape_vec();
  shape[std::size_t(dim)] = length;
  buffer b(src.type(), shape);
  for_each_index(shape, [&](const idx& i) {
    idx j = i;
    j[std::size_t(dim)] += begin;
    b.set_raw(i, src, j);
  });
  return b;
}

/// A dense copy of src with the range [begin, begin + length) of dimension `dim` reversed.
inline buffer flip(const tensor_view& src, int dim, std::int64_t begin, std::int64_t length) {
  buffer b = buffer::copy_of(src);
  for_each_index(src.shape_vec(), [&](const idx& i) {
    const std::int64_t x = i[std::size_t(dim)];
    if (x < begin || x >= begin + length) return;
    idx j = i;
    j[std::size_t(dim)] = begin + length - 1 - (x - begin);
    b.set_raw(i, src, j);
  });
  return b;
}

/// A dense copy of a time-indexed tensor ([B, T, ...]) reversed in time: the whole of T when
/// cu_seqlens is empty, else each sequence [cu[n], cu[n+1]) on its own.
inline buffer flip_time(const tensor_view& src, const std::vector<std::int64_t>& cu_seqlens = {}) {
  if (cu_seqlens.empty()) return flip(src, 1, 0, src.size(1));
  buffer b = buffer::copy_of(src);
  for (std::size_t n = 0; n + 1 < cu_seqlens.size(); ++n)
    b = flip(b.view(), 1, cu_seqlens[n], cu_seqlens[n + 1] - cu_seqlens[n]);
  return b;
}

/// A dense copy of src with every index of dimension `dim` repeated `factor` times in a row
/// (head h of the result reads head h / factor of src: SPEC §1's grouped heads made explicit).
inline buffer repeat_interleave(const tensor_view& src, int dim, std::int64_t factor) {
  std::vector<std::int64_t> shape = src.shape_vec();
  shape[std::size_t(dim)] *= factor;
  buffer b(src.type(), shape);
  for_each_index(shape, [&](const idx& i) {
    idx j = i;
    j[std::size_t(dim)] /= factor;
    b.set_raw(i, src, j);
  });
  return b;
}

/// A dense copy of src with its last two dimensions swapped ([N, H, K, V] <-> [N, H, V, K]).
inline buffer transpose_last2(const tensor_view& src) {
  std::vector<std::int64_t> shape = src.shape_vec();
  const int r = src.rank();
  std::swap(shape[std::size_t(r - 1)], shape[std::size_t(r - 2)]);
  buffer b(src.type(), shape);
  for_each_index(shape, [&](const idx& i) {
    idx j = i;
    std::swap(j[std::size_t(r - 1)], j[std::size_t(r - 2)]);
    b.set_raw(i, src, j);
  });
  return b;
}

// ---------------------------------------------------------------------------------------
// Random problems

/// What to generate: the sizes of SPEC §2 and which optional tensors are present.
struct problem_spec {
  std::int64_t B = 1, T = 16, Hq = 2, Hk = 2, Hv = 2, K = 8, V = 8;
  /// Non-empty: variable length (B must be 1 and T their sum); zero lengths are legal.
  std::vector<std::int64_t> seqlens;
  dtype type = dtype::float32;          ///< q, k, v
  bool gates_in_input_dtype = false;    ///< gates in `type` instead of float32
  unsigned gates = 0;                   ///< recattn::gate_bit mask
  bool g_gamma_per_sequence = false;    ///< g_gamma as [N, H] instead of [H]
  bool initial_state = false;
  recattn::state_layout layout = recattn::state_layout::kv;
  dtype cu_type = dtype::int64;         ///< cu_seqlens dtype
  bool strided = false;                 ///< inputs are views with gaps in every dimension but the last
  double gate_bias = 2.0;               ///< gates are log(sigmoid(gate_bias + N(0, 1)))
  std::uint64_t seed = 1;

  std::int64_t H() const { return std::max(Hq, std::max(Hk, Hv)); }
  bool varlen() const { return !seqlens.empty(); }
  std::int64_t N() const { return varlen() ? std::int64_t(seqlens.size()) : B; }
  dtype gate_type() const { return gates_in_input_dtype ? type : dtype::float32; }
  dtype state_type() const { return state_dtype(type); }
  std::vector<std::int64_t> cu_seqlens() const {
    std::vector<std::int64_t> cu{0};
    for (auto l : seqlens) cu.push_back(cu.back() + l);
    return cu;
  }
  std::vector<std::int64_t> output_shape() const { return {B, T, H(), V}; }
  std::vector<std::int64_t> state_shape() const {
    return layout == recattn::state_layout::kv ? std::vector<std::int64_t>{N(), H(), K, V}
                                               : std::vector<std::int64_t>{N(), H(), V, K};
  }
  /// Sets seqlens (and B = 1, T = their sum).
  problem_spec& with_seqlens(std::vector<std::int64_t> lens) {
    seqlens = std::move(lens);
    B = 1;
    T = 0;
    for (auto l : seqlens) T += l;
    return *this;
  }
  /// One line naming everything, for INFO().
  std::string str() const {
    std::ostringstream os;
    os << dtype_name(type) << " B" << B << " T" << T << " Hq" << Hq << " Hk" << Hk << " Hv" << Hv << " K" << K
       << " V" << V << " gates=" << gate_mask_name(gates);
    if (varlen()) {
      os << " seqlens=[";
      for (std::size_t i = 0; i < seqlens.size(); ++i) os << (i ? "," : "") << seqlens[i];
      os << "] cu=" << dtype_name(cu_type);
    }
    if (gates & gate_g_gamma) os << (g_gamma_per_sequence ? " g_gamma[N,H]" : " g_gamma[H]");
    if (gates) os << " gate_dtype=" << dtype_name(gate_type());
    if (initial_state) os << " h0";
    if (layout == recattn::state_layout::vk) os << " vk";
    if (strided) os << " strided";
    os << " seed=" << seed;
    return os.str();
  }
};

/// The tensors of one generated problem; absent ones are default-constructed buffers.
struct problem_data {
  problem_spec spec;
  buffer q, k, v, g, g_gamma, gk, gv, initial_state, cu_seqlens;

  /// forward_options viewing every present tensor of this object (keep it alive); flags
  /// (reverse, return_state, scale, cfg) at their defaults, state layout from the spec.
  forward_options options() const {
    forward_options o;
    if (g.present()) o.g = g.view();
    if (g_gamma.present()) o.g_gamma = g_gamma.view();
    if (gk.present()) o.gk = gk.view();
    if (gv.present()) o.gv = gv.view();
    if (initial_state.present()) o.initial_state = initial_state.view();
    if (cu_seqlens.present()) o.cu_seqlens = cu_seqlens.view();
    o.state_layout = spec.layout;
    return o;
  }
  /// A sentinel-filled output buffer of the spec's shape (`type` defaults to the input dtype).
  buffer make_output(const std::vector<std::int64_t>& gaps = {}) const {
    return sentinel_buffer(spec.type, spec.output_shape(), gaps);
  }
  buffer make_state(const std::vector<std::int64_t>& gaps = {}) const {
    return sentinel_buffer(spec.state_type(), spec.state_shape(), gaps);
  }
};

/// Random tensors for a spec: q, k, v ~ N(0, 1) rounded to the input dtype (so every
/// consumer reads the same rounded values), gates log(sigmoid(bias + N(0, 1))), initial state
/// ~ N(0, 1). With spec.strided every tensor but cu_seqlens is a view with gaps. `Rng`: a
/// generator with rng's constructor(seed), normal() and integer(lo, hi) (the fuzz target
/// passes a faster one that draws the same numbers).
template <class Rng>
problem_data generate_with(const problem_spec& s) {
  Rng r(s.seed);
  auto gaps = [&](int rank) {
    std::vector<std::int64_t> g;
    if (s.strided)
      for (int j = 0; j + 1 < rank; ++j) g.push_back(j + 1 + r.integer(0, 3));
    return g;
  };
  auto normal = [&](const idx&) { return r.normal(); };
  auto gate = [&](const idx&) { return log_sigmoid(s.gate_bias + r.normal()); };
  problem_data d;
  d.spec = s;
  const std::int64_t H = s.H();
  d.q = buffer(s.type, {s.B, s.T, s.Hq, s.K}, gaps(4)).fill(normal);
  d.k = buffer(s.type, {s.B, s.T, s.Hk, s.K}, gaps(4)).fill(normal);
  d.v = buffer(s.type, {s.B, s.T, s.Hv, s.V}, gaps(4)).fill(normal);
  if (s.gates & gate_g) d.g = buffer(s.gate_type(), {s.B, s.T, H}, gaps(3)).fill(gate);
  if (s.gates & gate_g_gamma) {
    d.g_gamma = s.g_gamma_per_sequence ? buffer(s.gate_type(), {s.N(), H}, gaps(2)) : buffer(s.gate_type(), {H});
    d.g_gamma.fill(gate);
  }
  if (s.gates & gate_gk) d.gk = buffer(s.gate_type(), {s.B, s.T, H, s.K}, gaps(4)).fill(gate);
  if (s.gates & gate_gv) d.gv = buffer(s.gate_type(), {s.B, s.T, H, s.V}, gaps(4)).fill(gate);
  if (s.initial_state) d.initial_state = buffer(s.state_type(), s.state_shape(), gaps(4)).fill(normal);
  if (s.varlen()) {
    const std::vector<std::int64_t> cu = s.cu_seqlens();
    d.cu_seqlens = buffer(s.cu_type, {std::int64_t(cu.size())});
    d.cu_seqlens.fill([&](const idx& i) { return double(cu[std::size_t(i[0])]); });
  }
  return d;
}

inline problem_data generate(const problem_spec& s) { return generate_with<rng>(s); }

/// `n` lengths summing to `total`, some of them zero (when n > 1: the first empty sequence is
/// placed at random).
inline std::vector<std::int64_t> random_seqlens(rng& r, std::int64_t n, std::int64_t total) {
  std::vector<std::int64_t> cuts{0, total};
  for (std::int64_t i = 1; i < n; ++i) cuts.push_back(r.integer(0, total));
  std::sort(cuts.begin(), cuts.end());
  std::vector<std::int64_t> lens;
  for (std::size_t i = 1; i < cuts.size(); ++i) lens.push_back(cuts[i] - cuts[i - 1]);
  if (n > 1 && std::find(lens.begin(), lens.end(), 0) == lens.end()) {
    // Force one empty sequence: move its tokens to a neighbour.
    const std::size_t e = std::size_t(r.integer(0, n - 1));
    const std::size_t to = e + 1 < lens.size() ? e + 1 : e - 1;
    lens[to] += lens[e];
    lens[e] = 0;
  }
  return lens;
}

/// Limits of random_spec: small enough that the scalar reference stays fast.
struct spec_limits {
  std::int64_t max_B = 3, max_T = 40, max_H = 4, max_K = 24, max_V = 24;
  double varlen_probability = 0.3;
};

/// A random spec: sizes within `limits` (any K and V >= 1), grouped heads (query, key and
/// value head counts each a random divisor of H, sometimes grouped-query or grouped-value
/// exactly), sometimes varlen with empty sequences, random g_gamma form, initial state and
/// strides. gates, dtype and layout are the caller's.
inline problem_spec random_spec(rng& r, unsigned gates, dtype type = dtype::float32, spec_limits lim = {}) {
  problem_spec s;
  s.type = type;
  s.gates = gates;
  s.seed = std::uint64_t(r.integer(1, 1 << 30));
  s.K = r.integer(1, lim.max_K);
  s.V = r.integer(1, lim.max_V);
  const std::int64_t H = r.integer(1, lim.max_H);
  std::vector<std::int64_t> divisors;
  for (std::int64_t d = 1; d <= H; ++d)
    if (H % d == 0) divisors.push_back(d);
  switch (r.integer(0, 3)) {
    case 0: s.Hq = s.Hk = s.Hv = H; break;                               // plain multi-head
    case 1: s.Hq = H; s.Hk = s.Hv = r.pick(divisors); break;             // grouped-query
    case 2: s.Hq = s.Hk = r.pick(divisors); s.Hv = H; break;             // grouped-value
    default: s.Hq = r.pick(divisors); s.Hk = r.pick(divisors); s.Hv = r.pick(divisors); break;
  }
  // H is the largest count: make sure one tensor has all H heads.
  if (std::max(s.Hq, std::max(s.Hk, s.Hv)) != H) s.Hq = H;
  if (r.coin(lim.varlen_probability)) {
    s.with_seqlens(random_seqlens(r, r.integer(1, 5), r.integer(0, lim.max_T)));
    s.cu_type = r.coin() ? dtype::int32 : dtype::int64;
  } else {
    s.B = r.integer(1, lim.max_B);
    s.T = r.integer(1, lim.max_T);
  }
  s.g_gamma_per_sequence = r.coin();
  s.initial_state = r.coin();
  s.strided = r.coin(0.25);
  return s;
}

}  // namespace recattn::testing
