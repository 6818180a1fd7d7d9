// Running the forward pass of a generated problem, and comparing it with the reference.
//
// Unlike generators.hpp this header calls the dispatcher, so including it compiles every kernel
// variant the translation unit has not cut (RECATTN_DISABLE_*, see tests/CMakeLists.txt).
#pragma once

#include <recattn/recattn.hpp>

#include "generators.hpp"

namespace recattn::testing {

/// SPEC §6: the relative error a dtype's output and state must stay under against the double
/// reference (float 1e-4, bfloat16 and half 1e-2; double, which the SPEC leaves open, 1e-10).
inline double tolerance(dtype t) {
  switch (t) {
    case dtype::float64: return 1e-10;
    case dtype::float32: return 1e-4;
    default: return 1e-2;
  }
}

/// recurrent_attention on the problem's tensors with options `o` (the allocating form).
inline forward_result run_forward(const problem_data& d, const forward_options& o) {
  return recurrent_attention(d.q.view(), d.k.view(), d.v.view(), o);
}

/// reference_recurrent_attention on the same tensors and options.
inline forward_result run_reference(const problem_data& d, const forward_options& o) {
  return reference_recurrent_attention(d.q.view(), d.k.view(), d.v.view(), o);
}

/// Relative errors of one forward call against the reference.
struct forward_errors {
  double output = 0;
  double state = 0;  ///< 0 when the state was not asked for
};

/// Runs the kernel and the reference with the same options (return_state forced on) and
/// returns the relative errors of the output and of the final state.
inline forward_errors errors_against_reference(const problem_data& d, forward_options o) {
  o.return_state = true;
  const forward_result got = run_forward(d, o);
  const forward_result ref = run_reference(d, o);
  return {rel_error(got.output, ref.output), rel_error(*got.final_state, *ref.final_state)};
}

}  // namespace recattn::testing
