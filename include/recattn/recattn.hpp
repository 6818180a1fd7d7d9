// recattn: recurrent (linear) attention kernels. The public API.
//
//   #include <recattn/recattn.hpp>
//   auto r = recattn::recurrent_attention(recattn::view(q, {B, T, H, K}), ..., opts);
//
// See SPEC.md for the recurrence; README.md for a tour.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "cfg.hpp"
#include "config.hpp"
#include "cpu/recurrence.hpp"
#include "cpu/reference.hpp"
#include "dispatch.hpp"
#include "dtype.hpp"
#include "error.hpp"
#include "policy.hpp"
#include "problem.hpp"
#include "tensor.hpp"

#if RECATTN_HAS_CUDA
#include "cuda/launch.cuh"
#endif

namespace recattn {

/// Output of the allocating forward: `o` and, with return_state, the final state.
struct forward_result {
  tensor output;
  std::optional<tensor> final_state;
};

/// An implementation of the forward operation on one platform.
struct forward_impl {
  recattn::platform platform;
  const char* name;
  void (*run)(const problem&, const cfg&, const forward_options&);
};

namespace detail {

struct cpu_backend {
  template <class T, class Policy>
  static void forward(const problem& p, const cfg& c) { cpu::forward_kernel<T, Policy>(p, c); }
};

/// RECATTN_DISABLE_CPU_FORWARD=1: this translation unit compiles no CPU forward kernel (a
/// CUDA-only unit, such as the CUDA tests, which check against the scalar reference, and
/// benchmarks); a forward that would run on the CPU is then a recattn::Error.
inline void run_cpu(const problem& p, const cfg& c, const forward_options&) {
#if RECATTN_DISABLE_CPU_FORWARD
  (void)p;
  (void)c;
  fail("platform", "cuda (this translation unit was compiled with RECATTN_DISABLE_CPU_FORWARD: no CPU forward kernels)",
       "cpu");
#else
  dispatch_forward<cpu_backend>(p, c);
#endif
}

/// platform::automatic -> cuda for device pointers (when compiled by nvcc), else cpu.
inline platform resolve_platform(platform requested, const problem& p) {
#if RECATTN_HAS_CUDA
  const bool on_device = cuda::is_device_pointer(p.q.data);
  if (requested == platform::automatic) return on_device ? platform::cuda : platform::cpu;
  if (requested == platform::cpu && on_device)
    fail("platform", "cuda (query is device memory)", "cpu");
  if (requested == platform::cuda && !on_device && p.q.data)
    fail("platform", "cpu (query is host memory)", "cuda");
  return requested;
#else
  (void)p;
  if (requested == platform::cuda)
    fail("platform", "cpu or automatic (this translation unit was not compiled by nvcc, or with RECATTN_DISABLE_CUDA)",
         "cuda");
  return platform::cpu;
#endif
}

/// The platform a forward call runs on: resolve_platform, and an Error for the CPU in a
/// translation unit compiled without the CPU forward kernels.
inline platform forward_platform(platform requested, const problem& p) {
  const platform pl = resolve_platform(requested, p);
  if (RECATTN_DISABLE_CPU_FORWARD && pl == platform::cpu)
    fail("platform", "cuda (this translation unit was compiled with RECATTN_DISABLE_CPU_FORWARD: no CPU forward kernels)",
         "cpu");
  return pl;
}

inline forward_impl impl_for(platform pl) {
  switch (pl) {
    case platform::cpu: return {platform::cpu, "cpu/xsimd", &run_cpu};
#if RECATTN_HAS_CUDA
    case platform::cuda: return {platform::cuda, "cuda/recurrent", &cuda::run_forward};
#endif
    default: break;
  }
  fail("platform", "cpu or cuda (compiled into this translation unit)", platform_name(pl));
}

inline cfg resolve_cfg(platform pl, const problem& p, const std::optional<cfg>& user) {
#if RECATTN_HAS_CUDA
  if (pl == platform::cuda) return cuda::resolve_cfg(p, user);
#endif
  (void)pl;
  if (user) cpu::check_cpu_threads(user->threads);
  return cpu::cpu_resolve_cfg(p, user);
}

inline std::vector<std::int64_t> state_shape(const problem& p) {
  return p.layout == state_layout::kv ? std::vector<std::int64_t>{p.N, p.H, p.K, p.V}
                                      : std::vector<std::int64_t>{p.N, p.H, p.V, p.K};
}

template <class Run>
forward_result allocate_and_run(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                const forward_options& opt, output_kind kind, Run&& run) {
  const problem shape_only = make_problem(q, k, v, opt, nullptr, kind);
  const dtype out_t = kind == output_kind::reference ? dtype::float64 : shape_only.type;
  const dtype state_t = kind == output_kind::reference ? dtype::float64 : shape_only.state_type;
  forward_result r;
  r.output = tensor(out_t, {shape_only.B, shape_only.T, shape_only.H, shape_only.V});
  forward_outputs outs{r.output.view(), std::nullopt};
  if (opt.return_state) {
    r.final_state = tensor(state_t, state_shape(shape_only));
    outs.final_state = r.final_state->view();
  }
  run(outs);
  return r;
}

}  // namespace detail

struct backward_result;  // backward.hpp
namespace detail {
struct cpu_backward_backend;  // backward.hpp
}  // namespace detail
struct step_options;     // step_problem.hpp

/// The recurrent-attention kernel object, with ejkernel's roles: `run`, `heuristic_cfg`,
/// `candidate_cfgs`, `get_impl`.
class RecurrentAttention {
 public:
  explicit RecurrentAttention(recattn::platform pl = recattn::platform::automatic) : platform_(pl) {}

  /// Forward into caller-owned buffers; allocates nothing the caller sees. Every argument
  /// is checked first: on a recattn::Error the buffers are untouched.
  void run(const tensor_view& q, const tensor_view& k, const tensor_view& v, const forward_options& opt,
           const forward_outputs& outs) const {
    const problem p = make_problem(q, k, v, opt, &outs);
    const recattn::platform pl = detail::forward_platform(pick(opt), p);
    const cfg c = detail::resolve_cfg(pl, p, opt.cfg);
    detail::impl_for(pl).run(p, c, opt);
  }

  /// Forward returning newly allocated host tensors (output, and the final state when
  /// opt.return_state).
  forward_result run(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                     const forward_options& opt = {}) const {
    return detail::allocate_and_run(q, k, v, opt, output_kind::native,
                                    [&](const forward_outputs& outs) { run(q, k, v, opt, outs); });
  }

  /// Backward (SPEC §3.2) into caller-owned gradient buffers; defined in backward.hpp. A
  /// template (on the backend, never given by callers) only so that translation units that
  /// never call it never compile its kernels, like step.
  template <class Backend = detail::cpu_backward_backend>
  void backward(const tensor_view& q, const tensor_view& k, const tensor_view& v, const forward_options& opt,
                const output_grads& grads, const backward_outputs& outs) const;

  /// Backward returning newly allocated gradients; defined in backward.hpp.
  template <class Backend = detail::cpu_backward_backend>
  backward_result backward(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                           const forward_options& opt, const output_grads& grads) const;

  /// Decode step (SPEC §3.3) on a state pool updated in place; defined in step.hpp (a
  /// template only so that translation units that never call it never compile its kernels).
  template <class StepOptions = step_options>
  void step(const tensor_view& q, const tensor_view& k, const tensor_view& v, const mutable_tensor_view& state_pool,
            const mutable_tensor_view& out, const StepOptions& opt = {}) const;

  /// A good default configuration for the problem on this object's platform.
  cfg heuristic_cfg(const problem& p) const { return detail::resolve_cfg(resolved(p), p, std::nullopt); }

  /// The configurations an autotuner times for the problem.
  std::vector<cfg> candidate_cfgs(const problem& p) const {
#if RECATTN_HAS_CUDA
    if (resolved(p) == recattn::platform::cuda) return cuda::candidate_cfgs(p);
#endif
    return cpu::cpu_candidate_cfgs(p);
  }

  /// The implementation for a platform (automatic: this object's choice for host memory).
  forward_impl get_impl(recattn::platform pl) const {
    if (pl == recattn::platform::automatic) pl = platform_ == recattn::platform::automatic ? recattn::platform::cpu : platform_;
    return detail::impl_for(pl);
  }

  recattn::platform platform() const { return platform_; }

 private:
  recattn::platform pick(const forward_options& opt) const {
    return opt.platform != recattn::platform::automatic ? opt.platform : platform_;
  }
  recattn::platform resolved(const problem& p) const { return detail::resolve_platform(platform_, p); }
  recattn::platform platform_;
};

/// recurrent_attention(query, key, value, options) -> {output, final_state}.
/// The free-function form of RecurrentAttention::run (SPEC §3.1).
inline forward_result recurrent_attention(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                          const forward_options& opt = {}) {
  return RecurrentAttention().run(q, k, v, opt);
}

/// Forward into caller-owned output (and final state) buffers, without allocating.
inline void recurrent_attention(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                const forward_options& opt, const forward_outputs& outs) {
  RecurrentAttention().run(q, k, v, opt, outs);
}

/// The scalar double-precision reference (SPEC §1 written out): output and state in double.
/// For checking any backend; slow by design.
inline forward_result reference_recurrent_attention(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                                    const forward_options& opt = {}) {
  return detail::allocate_and_run(q, k, v, opt, output_kind::reference, [&](const forward_outputs& outs) {
    cpu::reference_forward(make_problem(q, k, v, opt, &outs, output_kind::reference));
  });
}

/// The reference into caller-owned float64 buffers.
inline void reference_recurrent_attention(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                          const forward_options& opt, const forward_outputs& outs) {
  cpu::reference_forward(make_problem(q, k, v, opt, &outs, output_kind::reference));
}

/// Checks the arguments of a forward call without running it (CUTLASS's can_implement):
/// returns the reason a call would be rejected, or an empty string.
inline std::string can_implement(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                 const forward_options& opt, const forward_outputs& outs) {
  try {
    const problem p = make_problem(q, k, v, opt, &outs);
    const platform pl = detail::forward_platform(opt.platform, p);
    (void)detail::resolve_cfg(pl, p, opt.cfg);
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

}  // namespace recattn

#include "backward.hpp"
#include "step.hpp"
