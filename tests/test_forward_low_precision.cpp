// SPEC §6: bfloat16 and half inputs against the double reference, fed the same rounded
// inputs, within 1e-2; gates in float32 or in the input dtype.
#include <catch2/catch.hpp>

#include <vector>

#include "support/forward.hpp"

using namespace recattn;
using namespace recattn::testing;

namespace {

std::vector<problem_spec> shapes() {
  std::vector<problem_spec> out;
  auto add = [&](std::int64_t B, std::int64_t T, std::int64_t Hq, std::int64_t Hk, std::int64_t Hv, std::int64_t K,
                 std::int64_t V) {
    problem_spec s;
    s.B = B, s.T = T, s.Hq = Hq, s.Hk = Hk, s.Hv = Hv, s.K = K, s.V = V;
    out.push_back(s);
    return &out.back();
  };
  add(2, 21, 2, 2, 2, 16, 16);
  add(1, 17, 3, 3, 3, 5, 7);   // odd K and V
  add(2, 9, 1, 1, 1, 1, 1);    // K = V = 1
  add(1, 6, 1, 1, 1, 129, 3);  // K = 129
  add(1, 10, 4, 2, 2, 8, 12);  // grouped-query
  add(1, 10, 1, 1, 3, 6, 10);  // grouped-value
  add(1, 0, 2, 2, 2, 7, 9)->with_seqlens({5, 0, 11, 1, 0});
  return out;
}

}  // namespace

TEST_CASE("bfloat16 and half forward match the reference for every gate combination, gates in float32 or the input dtype",
          "[forward][reference][low_precision]") {
  const dtype type = GENERATE(dtype::bfloat16, dtype::float16);
  const bool gates_in_input_dtype = GENERATE(false, true);
  const unsigned gates = GENERATE(range(0u, 16u));
  std::uint64_t seed = 300 * gates + 7;
  for (problem_spec s : shapes())
    for (const bool reverse : {false, true}) {
      s.type = type;
      s.gates_in_input_dtype = gates_in_input_dtype;
      s.gates = gates;
      s.seed = seed++;
      s.initial_state = seed % 2 == 0;
      s.g_gamma_per_sequence = seed % 3 == 0;
      const problem_data d = generate(s);
      forward_options o = d.options();
      o.reverse = reverse;
      INFO(s.str() << (reverse ? " reverse" : ""));
      const forward_errors e = errors_against_reference(d, o);
      CHECK(e.output < 1e-2);
      CHECK(e.state < 1e-2);
    }
}

TEST_CASE("bfloat16 and half forward match the reference on random shapes", "[forward][reference][low_precision]") {
  const dtype type = GENERATE(dtype::bfloat16, dtype::float16);
  const unsigned gates = GENERATE(range(0u, 16u));
  rng r(555 + gates + 16 * unsigned(type));
  for (int i = 0; i < 4; ++i) {
    problem_spec s = random_spec(r, gates, type);
    s.gates_in_input_dtype = r.coin();
    const problem_data d = generate(s);
    forward_options o = d.options();
    o.reverse = r.coin();
    INFO(s.str() << (o.reverse ? " reverse" : ""));
    const forward_errors e = errors_against_reference(d, o);
    CHECK(e.output < 1e-2);
    CHECK(e.state < 1e-2);
  }
}

TEST_CASE("bfloat16 and half forward stay within 1e-2 of the reference for T = 16384",
          "[forward][reference][low_precision][long]") {
  const dtype type = GENERATE(dtype::bfloat16, dtype::float16);
  const unsigned gates = GENERATE(range(0u, 16u));
  problem_spec s;
  s.type = type;
  s.Hq = s.Hk = s.Hv = 1, s.K = 8, s.V = 8, s.T = 16384;
  s.gates = gates;
  s.gates_in_input_dtype = gates % 2 == 0;
  s.initial_state = true;
  s.seed = 99 + gates;
  const problem_data d = generate(s);
  INFO(s.str());
  const forward_errors e = errors_against_reference(d, d.options());
  CHECK(e.output < 1e-2);
  CHECK(e.state < 1e-2);
}

TEST_CASE("bfloat16 output is the float result rounded once", "[forward][low_precision]") {
  // The kernel accumulates in float and rounds only when storing: each bfloat16 output is
  // within half an ulp (2^-9 relative) of the double reference, plus float accumulation error.
  const unsigned gates = GENERATE(0u, 15u);
  problem_spec s;
  s.type = dtype::bfloat16;
  s.B = 2, s.T = 30, s.K = 16, s.V = 16;
  s.gates = gates;
  s.seed = 3 + gates;
  const problem_data d = generate(s);
  INFO(s.str());
  const forward_result got = run_forward(d, d.options());
  const forward_result ref = run_reference(d, d.options());
  CHECK(got.output.type() == dtype::bfloat16);
  double worst = 0;
  for_each_index(s.output_shape(), [&](const idx& i) {
    const double r = element(ref.output.view(), i), g = element(got.output.view(), i);
    worst = std::max(worst, std::abs(g - r) / (std::abs(r) + 1e-3));
  });
  CHECK(worst < 1.0 / 256);
}
