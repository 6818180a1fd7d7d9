// Views of Eigen TensorMaps over const scalars (TensorMap<Tensor<const float, N>>, the usual
// way to map read-only memory) must be read-only tensor views with the map's shape.
//
// A plain program rather than a Catch2 test: it is built by a CTest test of its own
// (tests/CMakeLists.txt), so that a compile failure fails that test, not the whole build.
#include <cstdio>
#include <type_traits>
#include <vector>

#include <recattn/tensor.hpp>

int main() {
  const std::vector<float> memory(2 * 3 * 4 * 5, 1.0f);
  const Eigen::TensorMap<Eigen::Tensor<const float, 4, Eigen::RowMajor>> row_major(memory.data(), 2, 3, 4, 5);
  const Eigen::TensorMap<Eigen::Tensor<const float, 4>> col_major(memory.data(), 5, 4, 3, 2);
  const auto a = recattn::view(row_major);
  const auto b = recattn::view(col_major);
  static_assert(!std::is_base_of<recattn::mutable_tensor_view, std::decay_t<decltype(a)>>::value,
                "a map of const scalars gives a read-only view");
  const std::vector<std::int64_t> want{2, 3, 4, 5};
  int failures = 0;
  for (const recattn::tensor_view& v : {recattn::tensor_view(a), recattn::tensor_view(b)}) {
    if (v.shape_vec() != want || v.data() != memory.data() || v.type() != recattn::dtype::float32) {
      std::printf("wrong view of a TensorMap of const float\n");
      ++failures;
    }
  }
  return failures;
}
