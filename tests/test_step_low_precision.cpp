// bfloat16 and half inputs, and bfloat16 state storage (float arithmetic inside the step,
// one rounding on the store): prefill + steps against forward and the double reference, and
// bfloat16 storage against float storage over 4096 steps.
#include <catch2/catch.hpp>

#include <cmath>

#include "test_step_common.hpp"

using namespace recattn;
using namespace recattn::testing;

TEST_CASE("step after a forward prefill equals forward (bfloat16, half inputs; float and bfloat16 state)",
          "[step][low_precision]") {
  for (dtype type : {dtype::bfloat16, dtype::float16})
    for (unsigned gates : {0u, 1u, 2u, 4u, 8u, 6u, 15u})
      for (state_layout layout : {state_layout::kv, state_layout::vk})
        for (dtype state : {dtype::float32, dtype::bfloat16}) {
          problem_spec s;
          s.type = type;
          s.B = 2;
          s.T = 8;
          s.Hq = 4, s.Hk = 2, s.Hv = 4, s.K = 16, s.V = 32;
          if (gates == 6u) s.V = 9;  // the scratch path
          s.gates = gates;
          s.gates_in_input_dtype = gates == 15u;
          s.initial_state = true;
          s.layout = layout;
          s.seed = 300 + gates;
          check_prefill_then_steps(s, 3, state);
        }
}

TEST_CASE("bfloat16 state storage stays within 1e-2 of float storage over 4096 steps", "[step][low_precision]") {
  for (unsigned gates : {unsigned(gate_g), unsigned(gate_gk), unsigned(gate_g | gate_gv)}) {
    problem_spec s;
    s.type = dtype::float32;
    s.B = 2;
    s.T = 4096;
    s.Hq = s.Hk = s.Hv = 2;
    s.K = 16;
    s.V = 32;
    s.gates = gates;
    s.initial_state = true;
    s.seed = 11 + gates;
    INFO(s.str());
    const problem_data d = generate(s);
    buffer pool32 = make_pool(dtype::float32, s.B, s), pool16 = make_pool(dtype::bfloat16, s.B, s);
    for (std::int64_t b = 0; b < s.B; ++b) {
      put_state(pool32, b, d.initial_state.view(), b);
      put_state(pool16, b, d.initial_state.view(), b);
    }
    buffer o32(dtype::float32, {s.B, s.H(), s.V}), o16(dtype::float32, {s.B, s.H(), s.V});
    double diff = 0, norm = 0;
    for (std::int64_t t = 0; t < s.T; ++t) {
      const token_args a = token_of(d, t);
      step(a.q, a.k, a.v, pool32.mutable_view(), o32.mutable_view(), a.opt);
      step(a.q, a.k, a.v, pool16.mutable_view(), o16.mutable_view(), a.opt);
      for_each_index({s.B, s.H(), s.V}, [&](const idx& i) {
        const double x = o16.get(i), y = o32.get(i);
        diff += (x - y) * (x - y);
        norm += y * y;
      });
    }
    CHECK(std::sqrt(diff / norm) < 1e-2);
    CHECK(rel_error(pool16.view(), pool32.view()) < 1e-2);
  }
}
