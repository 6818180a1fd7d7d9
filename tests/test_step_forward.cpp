// SPEC §3.3: a step gives what forward gives on the same tokens, token after token.
// Prefill with forward, then step token after token: every step's output and the final pool
// agree with forward over the whole sequence (to float rounding: the step is the direct
// recurrence; at 2df9cfd, whose forward was the direct recurrence too, they were equal bit
// for bit) and with the double reference (SPEC §6). Every gate combination, grouped heads, [K, V] and [V, K] state, shapes that take
// the in-place path (V a multiple of the SIMD width) and the scratch path (odd V).
#include <catch2/catch.hpp>

#include <algorithm>

#include "test_step_common.hpp"

using namespace recattn;
using namespace recattn::testing;

namespace {

struct case_shape {
  std::int64_t Hq, Hk, Hv, K, V;
};

}  // namespace

TEST_CASE("step after a forward prefill equals forward over the whole sequence (float, double)", "[step][forward]") {
  const case_shape shapes[] = {{4, 2, 4, 16, 32}, {2, 2, 4, 5, 7}, {3, 3, 3, 9, 16}};
  for (dtype type : {dtype::float32, dtype::float64})
    for (unsigned gates = 0; gates < 16; ++gates)
      for (state_layout layout : {state_layout::kv, state_layout::vk})
        for (const case_shape& c : shapes) {
          problem_spec s;
          s.type = type;
          s.B = 3;
          s.T = 9;
          s.Hq = c.Hq, s.Hk = c.Hk, s.Hv = c.Hv, s.K = c.K, s.V = c.V;
          s.gates = gates;
          s.g_gamma_per_sequence = gates % 2 == 1;
          s.initial_state = true;
          s.layout = layout;
          s.seed = 100 + gates;
          check_prefill_then_steps(s, 4, state_dtype(type));
        }
}

TEST_CASE("step on strided token views and gates in the input dtype (float, double)", "[step][forward]") {
  for (dtype type : {dtype::float32, dtype::float64})
    for (unsigned gates : {0u, 5u, 15u}) {
      problem_spec s;
      s.type = type;
      s.B = 2;
      s.T = 6;
      s.Hq = 2, s.Hk = 2, s.Hv = 2, s.K = 12, s.V = 16;
      s.gates = gates;
      s.gates_in_input_dtype = true;
      s.strided = true;
      s.initial_state = true;
      s.seed = 7 + gates;
      check_prefill_then_steps(s, 2, state_dtype(type));
    }
}
