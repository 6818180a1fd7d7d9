// SPEC §1, §2 and §6: the CPU forward against the double-precision reference, for float and
// double inputs, over generated shapes and every gate combination.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "support/forward.hpp"

using namespace recattn;
using namespace recattn::testing;

namespace {

/// The shapes the SPEC names: odd K and V, K = 1, V = 1, K = 129, K != V, grouped-query and
/// grouped-value heads, batches, varlen with empty sequences.
std::vector<problem_spec> named_shapes() {
  std::vector<problem_spec> out;
  auto add = [&](std::int64_t B, std::int64_t T, std::int64_t Hq, std::int64_t Hk, std::int64_t Hv, std::int64_t K,
                 std::int64_t V) {
    problem_spec s;
    s.B = B, s.T = T, s.Hq = Hq, s.Hk = Hk, s.Hv = Hv, s.K = K, s.V = V;
    out.push_back(s);
    return &out.back();
  };
  add(2, 17, 2, 2, 2, 16, 16);   // powers of two, a batch
  add(1, 23, 3, 3, 3, 5, 7);     // odd K and V, K != V
  add(2, 9, 1, 1, 1, 1, 1);      // K = V = 1
  add(1, 11, 2, 2, 2, 1, 19);    // K = 1
  add(1, 11, 2, 2, 2, 13, 1);    // V = 1
  add(1, 6, 1, 1, 1, 129, 3);    // K = 129
  add(1, 6, 1, 1, 1, 3, 129);    // V = 129
  add(3, 8, 2, 2, 2, 16, 40);    // K != V, V past one SIMD tile
  add(2, 10, 4, 2, 2, 8, 12);    // grouped-query: Hk = Hv < Hq
  add(1, 10, 1, 1, 3, 6, 10);    // grouped-value: Hq = Hk < Hv
  add(1, 0, 2, 2, 2, 7, 9)->with_seqlens({5, 0, 11, 1, 0});  // varlen, empty sequences
  add(1, 0, 4, 1, 2, 9, 4)->with_seqlens({0, 7, 3}).cu_type = dtype::int32;
  return out;
}

/// Forward and reverse, with and without an initial state, every named shape: within `tol`.
void check_named_shapes(dtype type, unsigned gates) {
  std::uint64_t seed = 100 * gates + 1;
  for (problem_spec s : named_shapes()) {
    for (const bool reverse : {false, true}) {
      s.type = type;
      s.gates = gates;
      s.seed = seed++;
      s.initial_state = (seed % 2) == 0;
      s.g_gamma_per_sequence = (seed % 3) == 0;
      const problem_data d = generate(s);
      forward_options o = d.options();
      o.reverse = reverse;
      INFO(s.str() << (reverse ? " reverse" : ""));
      const forward_errors e = errors_against_reference(d, o);
      CHECK(e.output < tolerance(type));
      CHECK(e.state < tolerance(type));
    }
  }
}

void check_random_shapes(dtype type, unsigned gates, int count) {
  rng r(7000 + gates);
  for (int i = 0; i < count; ++i) {
    const problem_spec s = random_spec(r, gates, type);
    const problem_data d = generate(s);
    forward_options o = d.options();
    o.reverse = r.coin();
    INFO(s.str() << (o.reverse ? " reverse" : ""));
    const forward_errors e = errors_against_reference(d, o);
    CHECK(e.output < tolerance(type));
    CHECK(e.state < tolerance(type));
  }
}

}  // namespace

TEST_CASE("float forward matches the reference on the named shapes, for every gate combination",
          "[forward][reference][float]") {
  const unsigned gates = GENERATE(range(0u, 16u));
  check_named_shapes(dtype::float32, gates);
}

TEST_CASE("float forward matches the reference on random shapes, for every gate combination",
          "[forward][reference][float]") {
  const unsigned gates = GENERATE(range(0u, 16u));
  check_random_shapes(dtype::float32, gates, 8);
}

TEST_CASE("double forward matches the reference on the named shapes, for every gate combination",
          "[forward][reference][double]") {
  const unsigned gates = GENERATE(range(0u, 16u));
  check_named_shapes(dtype::float64, gates);
}

TEST_CASE("double forward matches the reference on random shapes, for every gate combination",
          "[forward][reference][double]") {
  const unsigned gates = GENERATE(range(0u, 16u));
  check_random_shapes(dtype::float64, gates, 4);
}

TEST_CASE("double inputs take float32 gates as well as double gates", "[forward][reference][double]") {
  const unsigned gates = GENERATE(range(1u, 16u));
  const bool in_input_dtype = GENERATE(false, true);
  problem_spec s;
  s.type = dtype::float64;
  s.gates = gates;
  s.gates_in_input_dtype = in_input_dtype;
  s.B = 2, s.T = 19, s.K = 6, s.V = 11;
  s.initial_state = true;
  s.seed = gates;
  const problem_data d = generate(s);
  INFO(s.str());
  const forward_errors e = errors_against_reference(d, d.options());
  CHECK(e.output < tolerance(s.type));
  CHECK(e.state < tolerance(s.type));
}

TEST_CASE("float forward stays within 1e-4 of the reference for T = 16384", "[forward][reference][float][long]") {
  const unsigned gates = GENERATE(range(0u, 16u));
  problem_spec s;
  s.Hq = s.Hk = s.Hv = 1, s.K = 8, s.V = 8, s.T = 16384;
  s.gates = gates;
  s.initial_state = true;
  s.seed = 16384 + gates;
  const problem_data d = generate(s);
  forward_options o = d.options();
  o.reverse = gates % 2 == 1;
  INFO(s.str() << (o.reverse ? " reverse" : ""));
  const forward_errors e = errors_against_reference(d, o);
  CHECK(e.output < 1e-4);
  CHECK(e.state < 1e-4);
}

TEST_CASE("softmax_scale defaults to 1/sqrt(K) and an explicit scale is applied", "[forward][reference][float]") {
  const unsigned gates = GENERATE(0u, 1u, 15u);
  problem_spec s;
  s.B = 2, s.T = 13, s.K = 10, s.V = 6;
  s.gates = gates;
  s.seed = 5 + gates;
  const problem_data d = generate(s);
  INFO(s.str());

  forward_options by_default = d.options();
  forward_options explicit_default = d.options();
  explicit_default.softmax_scale = 1.0 / std::sqrt(double(s.K));
  const forward_result a = run_forward(d, by_default);
  const forward_result b = run_forward(d, explicit_default);
  CHECK(bitwise_equal(a.output.view(), b.output.view()));
  CHECK(rel_error(a.output, run_reference(d, explicit_default).output) < 1e-4);

  for (const double scale : {0.37, 1.0, -2.5, 0.0}) {
    forward_options o = d.options();
    o.softmax_scale = scale;
    INFO("softmax_scale " << scale);
    const forward_result got = run_forward(d, o);
    const forward_result ref = run_reference(d, o);
    CHECK(rel_error(got.output, ref.output) < 1e-4);
    // The output is linear in the scale: scale * (the output at scale 1) up to float rounding.
    forward_options unit = d.options();
    unit.softmax_scale = 1.0;
    const forward_result one = run_reference(d, unit);
    buffer scaled = buffer::copy_of(one.output.view());
    scaled.fill([&](const idx& i) { return scale * element(one.output.view(), i); });
    CHECK(rel_error(ref.output, scaled.view()) < 1e-12);
  }
}

TEST_CASE("the initial state is read and the final state returned only when asked", "[forward][reference][float]") {
  const unsigned gates = GENERATE(0u, 5u, 15u);
  const bool with_initial = GENERATE(false, true);
  const bool varlen = GENERATE(false, true);
  problem_spec s;
  s.B = 2, s.T = 12, s.Hq = 2, s.Hk = 2, s.Hv = 2, s.K = 9, s.V = 5;
  if (varlen) s.with_seqlens({4, 0, 9});
  s.gates = gates;
  s.initial_state = with_initial;
  s.seed = 31 + gates;
  const problem_data d = generate(s);
  INFO(s.str());

  forward_options o = d.options();
  const forward_result without = run_forward(d, o);
  CHECK_FALSE(without.final_state.has_value());
  CHECK(without.output.shape() == s.output_shape());

  o.return_state = true;
  const forward_result with = run_forward(d, o);
  REQUIRE(with.final_state.has_value());
  CHECK(with.final_state->shape() == s.state_shape());
  CHECK(with.final_state->type() == dtype::float32);
  CHECK(bitwise_equal(with.output.view(), without.output.view()));

  const forward_result ref = run_reference(d, o);
  CHECK(rel_error(with.output, ref.output) < 1e-4);
  CHECK(rel_error(*with.final_state, *ref.final_state) < 1e-4);

  if (with_initial) {
    // The initial state matters: without it the result differs.
    forward_options zero = o;
    zero.initial_state.reset();
    CHECK(rel_error(run_forward(d, zero).output, ref.output) > 1e-3);
  }
}

TEST_CASE("non-contiguous batch, time and head strides give the reference result", "[forward][reference][float]") {
  const unsigned gates = GENERATE(range(0u, 16u));
  for (const bool varlen : {false, true}) {
    problem_spec s;
    s.B = 2, s.T = 14, s.Hq = 4, s.Hk = 2, s.Hv = 4, s.K = 7, s.V = 12;
    if (varlen) s.with_seqlens({6, 0, 8, 3});
    s.gates = gates;
    s.g_gamma_per_sequence = true;
    s.initial_state = true;
    s.strided = true;  // every input a view into a larger buffer whose gaps hold NaN
    s.seed = 900 + gates;
    const problem_data d = generate(s);
    INFO(s.str());
    forward_options o = d.options();
    o.reverse = gates % 3 == 0;
    o.return_state = true;

    // Caller-owned output and state with gaps too: the gaps stay untouched.
    buffer out = d.make_output({3, 5, 7});
    buffer state = d.make_state({2, 1, 4});
    recurrent_attention(d.q, d.k, d.v, o, forward_outputs{out.mutable_view(), state.mutable_view()});
    const forward_result ref = run_reference(d, o);
    CHECK(rel_error(out, ref.output) < 1e-4);
    CHECK(rel_error(state, *ref.final_state) < 1e-4);
    CHECK(gaps_untouched(out));
    CHECK(gaps_untouched(state));
  }
}

TEST_CASE("g_gamma as [H] and as [B, H] or [N, H]", "[forward][reference][float]") {
  const unsigned other_gates = GENERATE(0u, unsigned(gate_g), unsigned(gate_gk | gate_gv), 13u);
  const bool varlen = GENERATE(false, true);
  problem_spec s;
  s.B = 3, s.T = 10, s.Hq = 3, s.Hk = 3, s.Hv = 3, s.K = 6, s.V = 9;
  if (varlen) s.with_seqlens({3, 0, 12, 5});
  s.gates = other_gates | gate_g_gamma;
  s.seed = 77 + other_gates;

  for (const bool per_sequence : {false, true}) {
    s.g_gamma_per_sequence = per_sequence;
    const problem_data d = generate(s);
    INFO(s.str());
    const forward_errors e = errors_against_reference(d, d.options());
    CHECK(e.output < 1e-4);
    CHECK(e.state < 1e-4);
  }

  // [N, H] with every row equal to the [H] vector is the [H] form.
  s.g_gamma_per_sequence = false;
  const problem_data d = generate(s);
  buffer rows(d.g_gamma.type(), {s.N(), s.H()});
  rows.fill([&](const idx& i) { return d.g_gamma.get({i[1]}); });
  forward_options shared = d.options();
  forward_options per_row = d.options();
  per_row.g_gamma = rows.view();
  shared.return_state = per_row.return_state = true;
  const forward_result a = run_forward(d, shared);
  const forward_result b = run_forward(d, per_row);
  CHECK(rel_error(b.output, a.output) < 1e-6);
  CHECK(rel_error(*b.final_state, *a.final_state) < 1e-6);
}

TEST_CASE("every cfg (threads, block_v, chunk) gives the same result", "[forward][reference][float][cfg]") {
  const unsigned gates = GENERATE(0u, unsigned(gate_gk), unsigned(gate_gv), 15u);
  const bool varlen = GENERATE(false, true);
  problem_spec s;
  s.B = 2, s.T = 45, s.Hq = 2, s.Hk = 1, s.Hv = 2, s.K = 11, s.V = 70;
  if (varlen) s.with_seqlens({20, 0, 1, 24});
  s.gates = gates;
  s.initial_state = true;
  s.seed = 4242 + gates;
  const problem_data d = generate(s);
  INFO(s.str());
  forward_options o = d.options();
  o.return_state = true;
  const forward_result ref = run_reference(d, o);
  const forward_result base = run_forward(d, o);

  for (const int threads : {1, 2, 3})
    for (const int block_v : {0, 1, 8, 16, 33, 64, 70, 1000})
      for (const int chunk : {0, 1, 7, 64}) {
        forward_options c = o;
        c.cfg = cfg{};
        c.cfg->threads = threads;
        c.cfg->block_v = block_v;
        c.cfg->chunk = chunk;
        INFO("cfg " << c.cfg->str());
        const forward_result got = run_forward(d, c);
        CHECK(rel_error(got.output, ref.output) < 1e-4);
        CHECK(rel_error(*got.final_state, *ref.final_state) < 1e-4);
        CHECK(rel_error(got.output, base.output) < 1e-6);
        CHECK(rel_error(*got.final_state, *base.final_state) < 1e-6);
      }
}

TEST_CASE("the reference accepts the native float initial state and a float64 one alike", "[reference][float]") {
  problem_spec s;
  s.B = 2, s.T = 9, s.K = 5, s.V = 4;
  s.gates = 15;
  s.initial_state = true;
  const problem_data d = generate(s);
  buffer h0_double(dtype::float64, s.state_shape());
  h0_double.fill([&](const idx& i) { return d.initial_state.get(i); });
  forward_options native = d.options();
  forward_options wide = d.options();
  wide.initial_state = h0_double.view();
  native.return_state = wide.return_state = true;
  const forward_result a = run_reference(d, native);
  const forward_result b = run_reference(d, wide);
  CHECK(bitwise_equal(a.output.view(), b.output.view()));
  CHECK(bitwise_equal(a.final_state->view(), b.final_state->view()));
}
