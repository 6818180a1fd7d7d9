// Shared by the backward tests: incoming gradients for a generated problem, running the
// kernel and the reference backward, and comparing every gradient.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>
#include <string>

#include <recattn/recattn.hpp>

#include "support/generators.hpp"

namespace recattn::testing {

/// SPEC §6 tolerances for gradients (float 1e-4, 16-bit 1e-2); double gets 1e-9.
inline double grad_tolerance(dtype t) {
  switch (t) {
    case dtype::float64: return 1e-9;
    case dtype::float32: return 1e-4;
    default: return 1e-2;
  }
}

/// The gradients flowing in: dO ~ N(0, 1) in the input dtype, d_final_state ~ N(0, 1).
struct incoming {
  buffer dO, dht;
  output_grads view() const {
    output_grads g{dO.view(), std::nullopt};
    if (dht.present()) g.d_final_state = dht.view();
    return g;
  }
};

inline incoming make_incoming(const problem_spec& s, bool with_dht, std::uint64_t seed) {
  rng r(seed);
  incoming in;
  in.dO = buffer(s.type, s.output_shape()).fill([&](const idx&) { return r.normal(); });
  if (with_dht) in.dht = buffer(s.state_type(), s.state_shape()).fill([&](const idx&) { return r.normal(); });
  return in;
}

inline backward_result run_backward(const problem_data& d, const forward_options& o, const incoming& in) {
  return recurrent_attention_backward(d.q.view(), d.k.view(), d.v.view(), o, in.view());
}

inline backward_result run_reference_backward(const problem_data& d, const forward_options& o, const incoming& in) {
  return reference_recurrent_attention_backward(d.q.view(), d.k.view(), d.v.view(), o, in.view());
}

/// Relative errors of every gradient (0 for one neither side has; NaN when only one has it).
struct grad_errors {
  double dq = 0, dk = 0, dv = 0, dg = 0, dg_gamma = 0, dgk = 0, dgv = 0, dh0 = 0;
  double max() const {
    double m = 0;
    for (double x : {dq, dk, dv, dg, dg_gamma, dgk, dgv, dh0}) m = std::isnan(x) ? std::numeric_limits<double>::infinity() : std::max(m, x);
    return m;
  }
  std::string str() const {
    std::ostringstream os;
    os << "dq " << dq << " dk " << dk << " dv " << dv << " dg " << dg << " dg_gamma " << dg_gamma << " dgk " << dgk
       << " dgv " << dgv << " dh0 " << dh0;
    return os.str();
  }
};

inline double opt_error(const std::optional<tensor>& a, const std::optional<tensor>& b) {
  if (!a && !b) return 0;
  if (!a || !b) return std::numeric_limits<double>::quiet_NaN();
  return rel_error(*a, *b);
}

inline grad_errors compare(const backward_result& got, const backward_result& ref) {
  grad_errors e;
  e.dq = rel_error(got.dq, ref.dq);
  e.dk = rel_error(got.dk, ref.dk);
  e.dv = rel_error(got.dv, ref.dv);
  e.dg = opt_error(got.dg, ref.dg);
  e.dg_gamma = opt_error(got.dg_gamma, ref.dg_gamma);
  e.dgk = opt_error(got.dgk, ref.dgk);
  e.dgv = opt_error(got.dgv, ref.dgv);
  e.dh0 = opt_error(got.d_initial_state, ref.d_initial_state);
  return e;
}

/// Gate combinations by name, for generating a TEST_CASE section per combination.
inline std::string gates_name(unsigned m) { return gate_mask_name(m); }

}  // namespace recattn::testing
