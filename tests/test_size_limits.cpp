// Issue 7, size limits: element offsets are 64-bit. Every tensor of these calls is a view
// whose batch stride is 2^31 + 4096 elements, so that the rows of batch 1 lie more than 2^31
// elements (8 GiB of float) past the data pointer: a 32-bit offset anywhere (wrapped, or
// sign-extended to a negative one) reads or writes the wrong row or faults. The memory is a
// MAP_NORESERVE mapping of about 9 GiB of address space, of which only the rows used are
// touched (a few pages), so the test needs no large memory.
#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "support/forward.hpp"
#include "test_backward_common.hpp"

using namespace recattn;
using namespace recattn::testing;

#if defined(__linux__)
namespace {

constexpr std::int64_t big_stride = (std::int64_t(1) << 31) + 4096;  ///< batch stride, elements
constexpr std::int64_t time_stride = std::int64_t(1) << 27;          ///< time (or head) stride
constexpr std::int64_t slot = 256;                                   ///< elements per tensor in a row block

/// An anonymous MAP_NORESERVE mapping: address space, with pages only where written.
class sparse_region {
 public:
  explicit sparse_region(std::int64_t elements) : bytes_(std::size_t(elements) * sizeof(float)) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    base_ = p == MAP_FAILED ? nullptr : static_cast<float*>(p);
  }
  ~sparse_region() {
    if (base_) munmap(base_, bytes_);
  }
  sparse_region(const sparse_region&) = delete;
  sparse_region& operator=(const sparse_region&) = delete;
  float* base() const { return base_; }

 private:
  std::size_t bytes_;
  float* base_ = nullptr;
};

/// Elements a region needs for tensors of up to 3 time steps in slots [0, slots).
std::int64_t region_elements(int slots) { return big_stride + 2 * time_stride + slots * slot + 4096; }

/// Strides of a tensor of `shape` placed with the batch (or sequence) stride big_stride, the
/// second dimension time_stride, the rest dense.
std::vector<std::int64_t> sparse_strides(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> st(shape.size(), 1);
  for (int d = int(shape.size()) - 2; d >= 2; --d) st[std::size_t(d)] = st[std::size_t(d + 1)] * shape[std::size_t(d + 1)];
  if (shape.size() > 1) st[1] = shape.size() > 2 ? time_stride : 1;
  st[0] = big_stride;
  return st;
}

/// A float view in `r` at slot `s`, holding a copy of `src` (only its elements are touched).
mutable_tensor_view place(const sparse_region& r, int s, const tensor_view& src) {
  const std::vector<std::int64_t> shape = src.shape_vec();
  mutable_tensor_view v(r.base() + s * slot, dtype::float32, shape, sparse_strides(shape));
  for_each_index(shape, [&](const idx& i) { store_as(v.data(), dtype::float32, element_offset(v, i), element(src, i)); });
  return v;
}

/// A float view in `r` at slot `s` of `shape`, every element the sentinel pattern.
mutable_tensor_view place_sentinel(const sparse_region& r, int s, const std::vector<std::int64_t>& shape) {
  const buffer b = sentinel_buffer(dtype::float32, shape);
  mutable_tensor_view v(r.base() + s * slot, dtype::float32, shape, sparse_strides(shape));
  for_each_index(shape, [&](const idx& i) { store_as(v.data(), dtype::float32, element_offset(v, i), b.get(i)); });
  return v;
}

/// The inputs of `d` in `r`: q, k and v at slots 0 to 2, and options holding g, g_gamma, gk,
/// gv and initial_state at slots 3 to 7.
struct placed_inputs {
  tensor_view q, k, v;
  forward_options o;
};
placed_inputs place_inputs(const sparse_region& r, const problem_data& d) {
  placed_inputs p;
  p.q = place(r, 0, d.q), p.k = place(r, 1, d.k), p.v = place(r, 2, d.v);
  p.o.g = place(r, 3, d.g);
  p.o.g_gamma = place(r, 4, d.g_gamma);
  p.o.gk = place(r, 5, d.gk);
  p.o.gv = place(r, 6, d.gv);
  p.o.initial_state = place(r, 7, d.initial_state);
  return p;
}

problem_spec big_offset_spec() {
  problem_spec s;
  s.B = 2;
  s.T = 3;
  s.Hq = 2, s.Hk = 1, s.Hv = 2;
  s.K = 8, s.V = 6;
  s.gates = 15;
  s.g_gamma_per_sequence = true;
  s.initial_state = true;
  s.seed = 31;
  return s;
}

}  // namespace

TEST_CASE("forward: offsets past 2^31 elements (batch stride 2^31 + 4096) are indexed in 64 bits",
          "[size_limits][forward]") {
  const problem_spec s = big_offset_spec();
  const problem_data d = generate(s);
  sparse_region r(region_elements(10));
  REQUIRE(r.base() != nullptr);
  const placed_inputs p = place_inputs(r, d);
  const tensor_view &q = p.q, &k = p.k, &v = p.v;
  forward_options o = p.o;
  o.return_state = true;
  const mutable_tensor_view out = place_sentinel(r, 8, s.output_shape());
  const mutable_tensor_view state = place_sentinel(r, 9, s.state_shape());
  REQUIRE(q.stride(0) > (std::int64_t(1) << 31));

  recurrent_attention(q, k, v, o, {out, state});

  forward_options dense = d.options();
  dense.return_state = true;
  const forward_result ref = run_reference(d, dense);
  const forward_result compact = run_forward(d, dense);
  CHECK(rel_error(out, ref.output) < 1e-4);
  CHECK(rel_error(state, *ref.final_state) < 1e-4);
  // The same arithmetic on the same values: bit for bit what dense tensors give.
  CHECK(bitwise_equal(buffer::copy_of(out).view(), compact.output.view()));
  CHECK(bitwise_equal(buffer::copy_of(state).view(), compact.final_state->view()));
}

TEST_CASE("backward: offsets past 2^31 elements are indexed in 64 bits, inputs and gradients",
          "[size_limits][backward]") {
  const problem_spec s = big_offset_spec();
  const problem_data d = generate(s);
  const incoming in = make_incoming(s, true, 32);
  // Inputs share one region; each gradient gets its own (gradients may overlap nothing).
  sparse_region r(region_elements(10));
  REQUIRE(r.base() != nullptr);
  const placed_inputs p = place_inputs(r, d);
  const tensor_view &q = p.q, &k = p.k, &v = p.v;
  forward_options o = p.o;
  output_grads g{place(r, 8, in.dO), tensor_view(place(r, 9, in.dht))};

  const buffer* like[] = {&d.q, &d.k, &d.v, &d.g, &d.g_gamma, &d.gk, &d.gv, &d.initial_state};
  std::vector<std::unique_ptr<sparse_region>> regions;
  std::vector<mutable_tensor_view> grads;
  for (const buffer* b : like) {
    regions.push_back(std::make_unique<sparse_region>(region_elements(1)));
    REQUIRE(regions.back()->base() != nullptr);
    grads.push_back(place_sentinel(*regions.back(), 0, b->shape()));
  }
  backward_outputs bo{grads[0], grads[1], grads[2], grads[3], grads[4], grads[5], grads[6], grads[7]};
  recurrent_attention_backward(q, k, v, o, g, bo);

  const backward_result ref = run_reference_backward(d, d.options(), in);
  const backward_result compact = run_backward(d, d.options(), in);
  const tensor* refs[] = {&ref.dq, &ref.dk, &ref.dv, &*ref.dg, &*ref.dg_gamma, &*ref.dgk, &*ref.dgv, &*ref.d_initial_state};
  const tensor* kernel[] = {&compact.dq, &compact.dk, &compact.dv, &*compact.dg, &*compact.dg_gamma, &*compact.dgk,
                            &*compact.dgv, &*compact.d_initial_state};
  const char* names[] = {"dq", "dk", "dv", "dg", "dg_gamma", "dgk", "dgv", "d_initial_state"};
  for (std::size_t i = 0; i < grads.size(); ++i) {
    INFO(names[i]);
    CHECK(rel_error(grads[i], *refs[i]) < 1e-4);
    CHECK(bitwise_equal(buffer::copy_of(grads[i]).view(), kernel[i]->view()));
  }
}
#endif
