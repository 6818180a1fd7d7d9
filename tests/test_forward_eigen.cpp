// Tensor views made from Eigen tensors and TensorMaps: row-major keeps the dimension order,
// column-major is read with the dimensions reversed (Eigen (K, H, T, B) is recattn's
// [B, T, H, K]), so both give the same result as raw-pointer views of the same memory.
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include <unsupported/Eigen/CXX11/Tensor>

#include "support/forward.hpp"

using namespace recattn;
using namespace recattn::testing;

namespace {

template <class T, int Rank, int Options>
Eigen::Tensor<T, Rank, Options> eigen_copy(const buffer& b) {
  Eigen::array<Eigen::Index, Rank> dims;
  for (int i = 0; i < Rank; ++i)
    dims[std::size_t(i)] = Eigen::Index(b.size((Options & Eigen::RowMajor) ? i : Rank - 1 - i));
  Eigen::Tensor<T, Rank, Options> t(dims);
  std::memcpy(t.data(), b.data(), sizeof(T) * std::size_t(b.numel()));  // b is dense: same memory order
  return t;
}

problem_spec eigen_spec(dtype type, unsigned gates) {
  problem_spec s;
  s.type = type;
  s.B = 2, s.T = 13, s.Hq = 2, s.Hk = 2, s.Hv = 2, s.K = 7, s.V = 10;
  s.gates = gates;
  s.gates_in_input_dtype = true;
  s.g_gamma_per_sequence = true;
  s.initial_state = true;
  s.seed = 70 + gates;
  return s;
}

template <class T, int Options>
void check_eigen_tensors(unsigned gates) {
  const problem_data d = generate(eigen_spec(dtype_of<T>, gates));
  INFO(d.spec.str() << ((Options & Eigen::RowMajor) ? " row-major" : " column-major"));
  const auto q = eigen_copy<T, 4, Options>(d.q);
  const auto k = eigen_copy<T, 4, Options>(d.k);
  const auto v = eigen_copy<T, 4, Options>(d.v);
  Eigen::Tensor<T, 3, Options> g;
  Eigen::Tensor<T, 2, Options> g_gamma;
  Eigen::Tensor<T, 4, Options> gk, gv;
  const auto h0 = eigen_copy<T, 4, Options>(d.initial_state);

  forward_options o;
  if (d.g.present()) o.g = view(g = eigen_copy<T, 3, Options>(d.g));
  if (d.g_gamma.present()) o.g_gamma = view(g_gamma = eigen_copy<T, 2, Options>(d.g_gamma));
  if (d.gk.present()) o.gk = view(gk = eigen_copy<T, 4, Options>(d.gk));
  if (d.gv.present()) o.gv = view(gv = eigen_copy<T, 4, Options>(d.gv));
  o.initial_state = view(h0);
  o.return_state = true;
  REQUIRE(view(q).shape_vec() == d.q.shape());
  REQUIRE(view(h0).shape_vec() == d.initial_state.shape());

  Eigen::Tensor<T, 4, Options> out = eigen_copy<T, 4, Options>(d.make_output());
  Eigen::Tensor<T, 4, Options> state = eigen_copy<T, 4, Options>(d.make_state());
  recurrent_attention(view(q), view(k), view(v), o, forward_outputs{view(out), view(state)});

  forward_options raw = d.options();
  raw.return_state = true;
  const forward_result expected = run_forward(d, raw);
  CHECK(bitwise_equal(view(out), expected.output.view()));
  CHECK(bitwise_equal(view(state), expected.final_state->view()));
  const forward_result ref = run_reference(d, raw);
  CHECK(rel_error(view(out), ref.output) < tolerance(d.spec.type));
}

}  // namespace

TEST_CASE("views of row-major Eigen tensors keep the dimension order", "[forward][eigen]") {
  const unsigned gates = GENERATE(0u, 1u, 2u, 4u, 8u, 15u);
  check_eigen_tensors<float, Eigen::RowMajor>(gates);
  check_eigen_tensors<double, Eigen::RowMajor>(gates);
}

TEST_CASE("views of column-major Eigen tensors reverse the dimensions", "[forward][eigen]") {
  const unsigned gates = GENERATE(0u, 1u, 2u, 4u, 8u, 15u);
  check_eigen_tensors<float, Eigen::ColMajor>(gates);
  check_eigen_tensors<double, Eigen::ColMajor>(gates);
}

TEST_CASE("views of Eigen TensorMaps over caller memory, const inputs and mutable outputs", "[forward][eigen]") {
  const unsigned gates = GENERATE(0u, 5u, 15u);
  const problem_data d = generate(eigen_spec(dtype::float32, gates));
  const problem_spec& s = d.spec;
  INFO(s.str());
  auto as_vector = [](const buffer& b) {
    std::vector<float> x(std::size_t(b.numel()));
    std::memcpy(x.data(), b.data(), x.size() * sizeof(float));
    return x;
  };
  const std::vector<float> qm = as_vector(d.q), km = as_vector(d.k), vm = as_vector(d.v);
  // Const inputs as maps of a const tensor type. (Maps of a tensor of const scalars,
  // TensorMap<Tensor<const float, 4>>, are checked by eigen_const_scalar_map.)
  using in_map = Eigen::TensorMap<const Eigen::Tensor<float, 4, Eigen::RowMajor>>;
  using out_map = Eigen::TensorMap<Eigen::Tensor<float, 4, Eigen::RowMajor>>;
  const in_map q(qm.data(), s.B, s.T, s.Hq, s.K);
  const in_map k(km.data(), s.B, s.T, s.Hk, s.K);
  const in_map v(vm.data(), s.B, s.T, s.Hv, s.V);
  std::vector<float> out_memory(std::size_t(s.B * s.T * s.H() * s.V), -1.0f);
  out_map out(out_memory.data(), s.B, s.T, s.H(), s.V);

  // Column-major maps too: the state as Eigen (V, K, H, N).
  const std::vector<float> h0m = as_vector(d.initial_state);
  std::vector<float> state_memory(h0m.size(), -1.0f);
  Eigen::TensorMap<const Eigen::Tensor<float, 4>> h0(h0m.data(), s.V, s.K, s.H(), s.N());
  Eigen::TensorMap<Eigen::Tensor<float, 4>> state(state_memory.data(), s.V, s.K, s.H(), s.N());

  forward_options o = d.options();
  o.initial_state = view(h0);
  o.return_state = true;
  const tensor_view qv = view(q);
  const mutable_tensor_view outv = view(out);
  CHECK(qv.shape_vec() == d.q.shape());
  CHECK(outv.shape_vec() == s.output_shape());
  recurrent_attention(qv, view(k), view(v), o, forward_outputs{outv, view(state)});

  forward_options raw = d.options();
  raw.return_state = true;
  const forward_result expected = run_forward(d, raw);
  CHECK(bitwise_equal(outv, expected.output.view()));
  CHECK(bitwise_equal(view(state), expected.final_state->view()));
}
