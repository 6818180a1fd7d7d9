// The backward gives the true gradient: central finite differences of the double reference
// forward, on small shapes, for every input (q, k, v, g, g_gamma, gk, gv, initial_state) and
// every gate combination, both directions; and the double kernel against the double reference gradient.
#include <catch2/catch.hpp>

#include "test_backward_common.hpp"

using namespace recattn;
using namespace recattn::testing;

namespace {

/// The scalar loss whose gradient the backward computes: sum(dO .* o) + sum(dht .* ht).
double loss(const problem_data& d, const forward_options& o, const incoming& in) {
  forward_options fo = o;
  fo.return_state = true;
  const forward_result f = reference_recurrent_attention(d.q.view(), d.k.view(), d.v.view(), fo);
  double l = 0;
  for_each_index(in.dO.shape(), [&](const idx& i) { l += in.dO.get(i) * element(f.output, i); });
  if (in.dht.present())
    for_each_index(in.dht.shape(), [&](const idx& i) { l += in.dht.get(i) * element(*f.final_state, i); });
  return l;
}

/// Central differences of the loss with respect to every element of x (a buffer of d).
buffer finite_differences(problem_data& d, buffer& x, const forward_options& o, const incoming& in) {
  buffer fd(dtype::float64, x.shape());
  const double eps = 1e-5;
  for_each_index(x.shape(), [&](const idx& i) {
    const double x0 = x.get(i);
    x.set(i, x0 + eps);
    const double up = loss(d, o, in);
    x.set(i, x0 - eps);
    const double down = loss(d, o, in);
    x.set(i, x0);
    fd.set(i, (up - down) / (2 * eps));
  });
  return fd;
}

}  // namespace

TEST_CASE("backward: gradients equal central finite differences for every input", "[backward][finite-differences]") {
  rng r(11);
  for (unsigned gates = 0; gates < 16; ++gates) {
    problem_spec s;
    s.type = dtype::float64;
    s.gates_in_input_dtype = true;
    s.gates = gates;
    s.initial_state = true;
    s.g_gamma_per_sequence = gates % 3 == 0;
    s.seed = 100 + gates;
    s.K = 3;
    s.V = 2;
    if (gates % 4 == 1) {
      s.B = 1;
      s.T = 5;
      s.Hq = 2;
      s.Hk = 1;
      s.Hv = 2;
    } else {
      s.B = 2;
      s.T = 4;
      s.Hq = 1;
      s.Hk = 1;
      s.Hv = 2;
    }
    problem_data d = generate(s);
    forward_options o = d.options();
    o.reverse = gates % 2 == 0;
    const incoming in = make_incoming(s, gates % 5 != 0, 7 + gates);
    INFO(s.str() << (o.reverse ? " reverse" : "") << (in.dht.present() ? " d_final_state" : ""));
    const backward_result got = run_backward(d, o, in);
    const backward_result ref = run_reference_backward(d, o, in);

    auto check = [&](const char* name, buffer& x, const tensor& kernel, const tensor& reference) {
      const buffer fd = finite_differences(d, x, o, in);
      INFO(name << ": kernel " << rel_error(kernel, fd) << " reference " << rel_error(reference, fd));
      CHECK(rel_error(kernel, fd) < 1e-6);
      CHECK(rel_error(reference, fd) < 1e-6);
    };
    check("q", d.q, got.dq, ref.dq);
    check("k", d.k, got.dk, ref.dk);
    check("v", d.v, got.dv, ref.dv);
    check("initial_state", d.initial_state, *got.d_initial_state, *ref.d_initial_state);
    if (gates & gate_g) check("g", d.g, *got.dg, *ref.dg);
    if (gates & gate_g_gamma) check("g_gamma", d.g_gamma, *got.dg_gamma, *ref.dg_gamma);
    if (gates & gate_gk) check("gk", d.gk, *got.dgk, *ref.dgk);
    if (gates & gate_gv) check("gv", d.gv, *got.dgv, *ref.dgv);
  }
}

TEST_CASE("backward: double inputs match the double reference to 1e-9", "[backward][reference]") {
  rng r(12);
  for (unsigned gates = 0; gates < 16; ++gates)
    for (int rep = 0; rep < 3; ++rep) {
      spec_limits lim;
      lim.varlen_probability = 0;  // this executable is built without varlen (tests/backward.cmake)
      problem_spec s = random_spec(r, gates, dtype::float64, lim);
      s.gates_in_input_dtype = rep != 1;
      const problem_data d = generate(s);
      forward_options o = d.options();
      o.reverse = rep == 2;
      const incoming in = make_incoming(s, rep != 0, s.seed);
      INFO(s.str() << (o.reverse ? " reverse" : ""));
      grad_errors e = compare(run_backward(d, o, in), run_reference_backward(d, o, in));
      INFO(e.str());
      // Gate gradients come back in the gate's dtype: float32 gates get float rounding.
      const double gate_tol = s.gates_in_input_dtype ? 1e-9 : 1e-6;
      CHECK(std::max({e.dg, e.dg_gamma, e.dgk, e.dgv}) < gate_tol);
      e.dg = e.dg_gamma = e.dgk = e.dgv = 0;
      CHECK(e.max() < 1e-9);
    }
}
