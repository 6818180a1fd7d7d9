// Zero-copy views into other views: one index of a dimension fixed (a token of a sequence, a
// slot of a pool), or a dimension cut to a window (tokens [t0, t0 + n)).
//
// Header-only and free of Catch2, so the libFuzzer target (tests/fuzz) can include it as
// well as the Catch2 tests. Including it does not instantiate the kernels.
#pragma once

#include <cstdint>
#include <vector>

#include <recattn/recattn.hpp>

#include "generators.hpp"

namespace recattn::testing {

/// The view `x` with dimension `dim` fixed at `index` (rank - 1): a single-token step tensor.
template <class View>
View drop_dim(const View& x, int dim, std::int64_t index) {
  std::vector<std::int64_t> shape, strides;
  for (int i = 0; i < x.rank(); ++i)
    if (i != dim) {
      shape.push_back(x.size(i));
      strides.push_back(x.stride(i));
    }
  auto* base = static_cast<const char*>(static_cast<const tensor_view&>(x).data()) +
               index * x.stride(dim) * std::int64_t(dtype_size(x.type()));
  return View(const_cast<char*>(base), x.type(), shape, strides);
}

/// The view `x` with dimension `dim` cut to [begin, begin + length).
template <class View>
View window(const View& x, int dim, std::int64_t begin, std::int64_t length) {
  std::vector<std::int64_t> shape(x.shape().begin(), x.shape().begin() + x.rank());
  std::vector<std::int64_t> strides(x.strides().begin(), x.strides().begin() + x.rank());
  shape[std::size_t(dim)] = length;
  auto* base = static_cast<const char*>(static_cast<const tensor_view&>(x).data()) +
               begin * x.stride(dim) * std::int64_t(dtype_size(x.type()));
  return View(const_cast<char*>(base), x.type(), shape, strides);
}

/// The view `t` with its data replaced by null (same dtype, shape and strides).
inline tensor_view null_data(const tensor_view& t) { return tensor_view(nullptr, t.type(), t.shape_vec(), strides_of(t)); }

}  // namespace recattn::testing
