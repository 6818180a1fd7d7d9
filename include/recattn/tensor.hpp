// Non-owning strided tensor views (pointer, shape, strides, dtype), an owning host tensor,
// and the makers from raw pointers and from Eigen tensors.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "dtype.hpp"
#include "error.hpp"

#if !defined(RECATTN_NO_EIGEN)
#include <unsupported/Eigen/CXX11/Tensor>
#endif

namespace recattn {

inline constexpr int max_rank = 4;
using shape_t = std::array<std::int64_t, max_rank>;

/// A read-only view of a strided tensor. Strides are in elements; the last dimension is
/// contiguous (stride 1) for every tensor recattn reads (SPEC §2), which validation checks.
class tensor_view {
 public:
  tensor_view() = default;
  tensor_view(const void* data, dtype type, std::initializer_list<std::int64_t> shape,
              std::initializer_list<std::int64_t> strides = {})
      : tensor_view(data, type, std::vector<std::int64_t>(shape), std::vector<std::int64_t>(strides)) {}
  tensor_view(const void* data, dtype type, const std::vector<std::int64_t>& shape,
              const std::vector<std::int64_t>& strides = {})
      : data_(data), type_(type), rank_(int(shape.size())) {
    if (shape.size() > std::size_t(max_rank)) detail::fail("tensor_view", "rank <= 4", shape.size());
    if (!strides.empty() && strides.size() != shape.size())
      detail::fail("tensor_view strides", detail::cat(shape.size(), " strides"), strides.size());
    std::int64_t s = 1;
    for (int i = rank_ - 1; i >= 0; --i) {
      shape_[i] = shape[i];
      stride_[i] = strides.empty() ? s : strides[i];
      s *= shape[i];
    }
  }

  const void* data() const { return data_; }
  template <class T> const T* data_as() const { return static_cast<const T*>(data_); }
  dtype type() const { return type_; }
  int rank() const { return rank_; }
  std::int64_t size(int d) const { return shape_[d]; }
  std::int64_t stride(int d) const { return stride_[d]; }
  const shape_t& shape() const { return shape_; }
  const shape_t& strides() const { return stride_; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= shape_[i];
    return n;
  }
  std::vector<std::int64_t> shape_vec() const { return {shape_.begin(), shape_.begin() + rank_}; }

 protected:
  const void* data_ = nullptr;
  dtype type_ = dtype::float32;
  int rank_ = 0;
  shape_t shape_{};
  shape_t stride_{};
};

/// A writable view: output and state buffers owned by the caller.
class mutable_tensor_view : public tensor_view {
 public:
  mutable_tensor_view() = default;
  mutable_tensor_view(void* data, dtype type, std::initializer_list<std::int64_t> shape,
                      std::initializer_list<std::int64_t> strides = {})
      : tensor_view(data, type, shape, strides) {}
  mutable_tensor_view(void* data, dtype type, const std::vector<std::int64_t>& shape,
                      const std::vector<std::int64_t>& strides = {})
      : tensor_view(data, type, shape, strides) {}
  void* data() const { return const_cast<void*>(data_); }
  template <class T> T* data_as() const { return static_cast<T*>(data()); }
};

/// View of typed memory: `view(ptr, {B, T, H, K})`, optional strides in elements.
template <class T>
tensor_view view(const T* data, std::initializer_list<std::int64_t> shape, std::initializer_list<std::int64_t> strides = {}) {
  return tensor_view(data, dtype_of<T>, shape, strides);
}
template <class T, class = std::enable_if_t<!std::is_const<T>::value>>
mutable_tensor_view view(T* data, std::initializer_list<std::int64_t> shape, std::initializer_list<std::int64_t> strides = {}) {
  return mutable_tensor_view(data, dtype_of<T>, shape, strides);
}

/// An owning, 64-byte aligned host tensor, returned by the allocating API.
class tensor {
 public:
  tensor() = default;
  tensor(dtype type, const std::vector<std::int64_t>& shape) : type_(type), shape_(shape) {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    bytes_ = std::size_t(n) * dtype_size(type);
    const std::size_t alloc = (std::max<std::size_t>(bytes_, 1) + 63) / 64 * 64;
    data_.reset(static_cast<unsigned char*>(std::aligned_alloc(64, alloc)));
    if (!data_) throw std::bad_alloc();
    std::fill(data_.get(), data_.get() + alloc, static_cast<unsigned char>(0));
  }
  dtype type() const { return type_; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t size(int d) const { return shape_[std::size_t(d)]; }
  std::int64_t numel() const { return std::int64_t(bytes_ / dtype_size(type_)); }
  template <class T> T* data() { check<T>(); return reinterpret_cast<T*>(data_.get()); }
  template <class T> const T* data() const { check<T>(); return reinterpret_cast<const T*>(data_.get()); }
  void* raw() { return data_.get(); }
  const void* raw() const { return data_.get(); }
  mutable_tensor_view view() { return mutable_tensor_view(raw(), type_, shape_); }
  tensor_view view() const { return tensor_view(raw(), type_, shape_); }
  operator tensor_view() const { return view(); }
  operator mutable_tensor_view() { return view(); }

 private:
  template <class T> void check() const {
    if (dtype_of<T> != type_) detail::fail("tensor::data<T>", dtype_name(type_), dtype_name(dtype_of<T>));
  }
  struct free_deleter { void operator()(unsigned char* p) const { std::free(p); } };
  dtype type_ = dtype::float32;
  std::vector<std::int64_t> shape_;
  std::size_t bytes_ = 0;
  std::unique_ptr<unsigned char, free_deleter> data_;
};

#if !defined(RECATTN_NO_EIGEN)
namespace detail {
template <class Dims, int Rank, int Options>
std::vector<std::int64_t> eigen_shape(const Dims& d) {
  std::vector<std::int64_t> s(Rank);
  // A column-major Eigen tensor of dims (K, H, T, B) has the memory order of a row-major
  // [B, T, H, K]: recattn's shapes are read in row-major order, so reverse.
  for (int i = 0; i < Rank; ++i) s[std::size_t(i)] = std::int64_t(d[(Options & Eigen::RowMajor) ? i : Rank - 1 - i]);
  return s;
}
}  // namespace detail

/// View of an Eigen::Tensor. Row-major tensors keep their dimension order; column-major
/// ones are read with the order reversed (Eigen (K, H, T, B) is recattn [B, T, H, K]).
template <class T, int Rank, int Options, class Index>
tensor_view view(const Eigen::Tensor<T, Rank, Options, Index>& t) {
  return tensor_view(t.data(), dtype_of<T>, detail::eigen_shape<decltype(t.dimensions()), Rank, Options>(t.dimensions()));
}
template <class T, int Rank, int Options, class Index>
mutable_tensor_view view(Eigen::Tensor<T, Rank, Options, Index>& t) {
  return mutable_tensor_view(t.data(), dtype_of<T>, detail::eigen_shape<decltype(t.dimensions()), Rank, Options>(t.dimensions()));
}
template <class Plain, int MapOptions, template <class> class MakePointer>
auto view(const Eigen::TensorMap<Plain, MapOptions, MakePointer>& t) {
  using P = std::remove_const_t<Plain>;
  using Elem = std::remove_const_t<typename P::Scalar>;
  auto shape = detail::eigen_shape<decltype(t.dimensions()), P::NumIndices, P::Options>(t.dimensions());
  if constexpr (std::is_const<Plain>::value || std::is_const<typename P::Scalar>::value)
    return tensor_view(t.data(), dtype_of<Elem>, shape);
  else return mutable_tensor_view(t.data(), dtype_of<Elem>, shape);
}
#endif

}  // namespace recattn
