// Decode step (SPEC §3.3, issue 6): public API.
//
//   // pool [P, H, K, V] float (or bfloat16), updated in place; rows -> slots by indices
//   recattn::step_options so;
//   so.gk = recattn::view(gk, {B, H, K});
//   so.state_indices = recattn::view(slots, {B});          // int32 or int64; -1: padding
//   recattn::step(recattn::view(q, {B, H, K}), recattn::view(k, {B, H, K}),
//                 recattn::view(v, {B, H, V}), recattn::view(pool, {P, H, K, V}),
//                 recattn::view(out, {B, H, V}), so);
//
// A step gives exactly what forward gives on the same tokens, token after token (bit for bit
// with float or double state storage on the CPU). Every argument is checked first
// (make_step_problem); on a recattn::Error the pool, the snapshots and the output are untouched.
#pragma once

#include <optional>
#include <string>
#include <type_traits>

#include "cpu/step.hpp"
#include "recattn.hpp"
#include "step_problem.hpp"

// The CUDA step (translation units compiled by nvcc).
#if RECATTN_HAS_CUDA
#define RECATTN_STEP_HAS_CUDA 1
#include "cuda/step.cuh"
#else
#define RECATTN_STEP_HAS_CUDA 0
#endif

namespace recattn {

namespace detail {

struct cpu_step_backend {
  template <class T, unsigned Gates, class Storage>
  static void step(const step_problem& sp, const cfg& c) { cpu::step_kernel<T, Gates, Storage>(sp, c); }
};

/// The platform of a step: forward's rule (device pointers -> cuda when compiled by nvcc).
inline platform resolve_step_platform(platform requested, const step_problem& sp) {
  const platform pl = resolve_platform(requested, sp.tok);
#if RECATTN_STEP_HAS_CUDA
  if (pl == platform::cpu && cuda::is_device_pointer(sp.pool.data))
    fail("platform", "cuda (state_pool is device memory)", "cpu");
#endif
  return pl;
}

}  // namespace detail

template <class StepOptions>
void RecurrentAttention::step(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                              const mutable_tensor_view& state_pool, const mutable_tensor_view& out,
                              const StepOptions& opt) const {
  static_assert(std::is_same<StepOptions, step_options>::value, "RecurrentAttention::step takes recattn::step_options");
  const step_problem sp = make_step_problem(q, k, v, state_pool, out, opt);
  const recattn::platform requested = opt.platform != recattn::platform::automatic ? opt.platform : platform_;
  const recattn::platform pl = detail::resolve_step_platform(requested, sp);
#if RECATTN_STEP_HAS_CUDA
  if (pl == recattn::platform::cuda) return cuda::run_step(sp, opt);
#else
  if (pl == recattn::platform::cuda) detail::fail("platform", "cpu (no CUDA step in this build)", "cuda");
#endif
  (void)pl;
  const cfg c = cpu::cpu_step_resolve_cfg(sp, opt.cfg);
  detail::dispatch_step<detail::cpu_step_backend>(sp, c);
}

/// step(q, k, v, state_pool, out, options): one decode step (one or more new tokens per row)
/// against the states of `state_pool`, updated in place; `out` is caller-owned. Allocates
/// nothing after a thread's first call (CPU). (A template for the reason given at
/// RecurrentAttention::step: it is compiled only where it is called.)
template <class StepOptions = step_options>
void step(const tensor_view& q, const tensor_view& k, const tensor_view& v, const mutable_tensor_view& state_pool,
          const mutable_tensor_view& out, const StepOptions& opt = {}) {
  RecurrentAttention().step(q, k, v, state_pool, out, opt);
}

/// Checks the arguments of a step without running it: the reason a call would be rejected,
/// or an empty string.
inline std::string can_implement_step(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                      const mutable_tensor_view& state_pool, const mutable_tensor_view& out,
                                      const step_options& opt) {
  try {
    const step_problem sp = make_step_problem(q, k, v, state_pool, out, opt);
    const platform pl = detail::resolve_step_platform(opt.platform, sp);
#if RECATTN_STEP_HAS_CUDA
    if (pl == platform::cuda) (void)cuda::step_launch_shape(sp, opt.cfg);
#endif
    (void)pl;
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

}  // namespace recattn
