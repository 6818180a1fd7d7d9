// Backward pass (SPEC §3.2): public API.
//
//   recattn::forward_options opt;  opt.gk = view(gk, {B, T, H, K});
//   auto o = recattn::recurrent_attention(q, k, v, opt);
//   auto grads = recattn::recurrent_attention_backward(q, k, v, opt, {dO});
//   // grads.dq, grads.dk, grads.dv, *grads.dgk
//
// The gradients are exact (SPEC §1 differentiated, not estimated) and the CPU kernel keeps
// no state per token: see cpu/backward.hpp for the algorithm and its memory bound.
#pragma once

#include <optional>
#include <string>

#include "backward_problem.hpp"
#include "cpu/backward.hpp"
#include "cpu/reference_backward.hpp"
#include "recattn.hpp"

namespace recattn {

/// Gradients returned by the allocating backward: dq, dk, dv always; a gate or
/// initial-state gradient for each of those inputs that was given.
struct backward_result {
  tensor dq, dk, dv;
  std::optional<tensor> dg, dg_gamma, dgk, dgv, d_initial_state;
};

namespace detail {

struct cpu_backward_backend {
  template <class T, class Policy>
  static void backward(const backward_problem& bp, const cfg& c) { cpu::backward_kernel<T, Policy>(bp, c); }
};

/// The backward pass runs on the CPU only (so far): a CUDA request or device memory is
/// rejected with a clear error.
inline platform resolve_backward_platform(platform requested, const problem& p) {
  const platform pl = resolve_platform(requested, p);
  if (pl != platform::cpu) fail("platform", "cpu (the backward pass has no CUDA implementation yet)", platform_name(pl));
  return pl;
}

/// Checks the arguments, allocates every gradient the inputs call for (zeroed), then runs.
template <class Run>
backward_result allocate_grads_and_run(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                       const forward_options& opt, const output_grads& grads, output_kind kind,
                                       Run&& run) {
  const backward_problem shape_only = make_backward_problem(q, k, v, opt, grads, nullptr, kind);
  const bool ref = kind == output_kind::reference;
  auto like = [&](const tensor_view& t, dtype native) { return tensor(ref ? dtype::float64 : native, t.shape_vec()); };
  backward_result r;
  r.dq = like(q, q.type());
  r.dk = like(k, k.type());
  r.dv = like(v, v.type());
  backward_outputs outs{r.dq.view(), r.dk.view(), r.dv.view(), {}, {}, {}, {}, {}};
  auto opt_grad = [&](const std::optional<tensor_view>& in, std::optional<tensor>& dst,
                      std::optional<mutable_tensor_view>& view, dtype native) {
    if (!in) return;
    dst = like(*in, native);
    view = dst->view();
  };
  opt_grad(opt.g, r.dg, outs.dg, opt.g ? opt.g->type() : dtype::float32);
  opt_grad(opt.g_gamma, r.dg_gamma, outs.dg_gamma, opt.g_gamma ? opt.g_gamma->type() : dtype::float32);
  opt_grad(opt.gk, r.dgk, outs.dgk, opt.gk ? opt.gk->type() : dtype::float32);
  opt_grad(opt.gv, r.dgv, outs.dgv, opt.gv ? opt.gv->type() : dtype::float32);
  opt_grad(opt.initial_state, r.d_initial_state, outs.d_initial_state, shape_only.fwd.state_type);
  run(outs);
  return r;
}

}  // namespace detail

template <class Backend>
void RecurrentAttention::backward(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                  const forward_options& opt, const output_grads& grads,
                                  const backward_outputs& outs) const {
  const backward_problem bp = make_backward_problem(q, k, v, opt, grads, &outs);
  const recattn::platform pl = detail::resolve_backward_platform(pick(opt), bp.fwd);
  const cfg c = cpu::cpu_backward_resolve_cfg(bp.fwd, opt.cfg, detail::resolve_cfg(pl, bp.fwd, opt.cfg));
  detail::dispatch_backward<Backend>(bp, c);
}

template <class Backend>
backward_result RecurrentAttention::backward(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                             const forward_options& opt, const output_grads& grads) const {
  return detail::allocate_grads_and_run(q, k, v, opt, grads, output_kind::native, [&](const backward_outputs& outs) {
    this->template backward<Backend>(q, k, v, opt, grads, outs);
  });
}

/// recurrent_attention_backward(q, k, v, options, {dO, d_final_state}) -> gradients.
/// `options` are the forward call's (the same tensors, scale, direction, layout); the
/// gradient of an input of fewer heads than H sums over the heads that share it, and a
/// g_gamma of shape [H] gets the sum over sequences. (Templates, like RecurrentAttention's
/// members, so that a translation unit compiles the backward kernels only where it calls them.)
template <class Backend = detail::cpu_backward_backend>
backward_result recurrent_attention_backward(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                             const forward_options& opt, const output_grads& grads) {
  return RecurrentAttention().backward<Backend>(q, k, v, opt, grads);
}

/// Backward into caller-owned gradient buffers. Every argument is checked first: on a
/// recattn::Error the buffers are untouched.
template <class Backend = detail::cpu_backward_backend>
void recurrent_attention_backward(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                  const forward_options& opt, const output_grads& grads,
                                  const backward_outputs& outs) {
  RecurrentAttention().backward<Backend>(q, k, v, opt, grads, outs);
}

/// The scalar double-precision reference gradient (per-token states kept): every gradient
/// in float64. For checking any backend; slow and O(T * K * V) in memory by design.
inline backward_result reference_recurrent_attention_backward(const tensor_view& q, const tensor_view& k,
                                                              const tensor_view& v, const forward_options& opt,
                                                              const output_grads& grads) {
  return detail::allocate_grads_and_run(q, k, v, opt, grads, output_kind::reference, [&](const backward_outputs& outs) {
    cpu::reference_backward(make_backward_problem(q, k, v, opt, grads, &outs, output_kind::reference));
  });
}

/// Checks the arguments of a backward call without running it: the reason a call would be
/// rejected, or an empty string.
inline std::string can_implement_backward(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                          const forward_options& opt, const output_grads& grads,
                                          const backward_outputs& outs) {
  try {
    const backward_problem bp = make_backward_problem(q, k, v, opt, grads, &outs);
    const platform pl = detail::resolve_backward_platform(opt.platform, bp.fwd);
    (void)detail::resolve_cfg(pl, bp.fwd, opt.cfg);
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

/// The scratch memory (bytes) the CPU backward takes for a call: per worker and shared, for
/// every dtype independent of T.
inline cpu::backward_workspace backward_workspace_bytes(const tensor_view& q, const tensor_view& k,
                                                        const tensor_view& v, const forward_options& opt,
                                                        const output_grads& grads, const backward_outputs& outs) {
  const backward_problem bp = make_backward_problem(q, k, v, opt, grads, &outs);
  if (opt.cfg) cpu::check_cpu_threads(opt.cfg->threads);
  return cpu::backward_workspace_of(bp, cpu::cpu_backward_resolve_cfg(bp.fwd, opt.cfg, cpu::cpu_resolve_cfg(bp.fwd, opt.cfg)));
}

}  // namespace recattn
