// The runtime arguments of a backward call (SPEC §3.2) in one plain struct, and the
// validation that builds it: every check of SPEC §5 runs before anything is written.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "problem.hpp"

namespace recattn {

/// The gradients flowing into the backward pass.
struct output_grads {
  tensor_view d_output;                      ///< dO: [B, T, H, V], the query's dtype
  std::optional<tensor_view> d_final_state;  ///< [N, H, K, V] ([N, H, V, K] for vk); absent: zero
};

/// Caller-owned gradient buffers. dq, dk, dv are required; a gate or initial-state gradient
/// is computed when its buffer is given (which needs the matching input in the options).
struct backward_outputs {
  mutable_tensor_view dq;  ///< shape of query, query's dtype
  mutable_tensor_view dk;  ///< shape of key
  mutable_tensor_view dv;  ///< shape of value
  std::optional<mutable_tensor_view> dg;               ///< shape and dtype of g
  std::optional<mutable_tensor_view> dg_gamma;         ///< shape and dtype of g_gamma ([H]: summed over sequences)
  std::optional<mutable_tensor_view> dgk;              ///< shape and dtype of gk
  std::optional<mutable_tensor_view> dgv;              ///< shape and dtype of gv
  std::optional<mutable_tensor_view> d_initial_state;  ///< shape and dtype of initial_state
};

/// All runtime arguments of one backward call, checked. Kernels read nothing else.
struct backward_problem {
  problem fwd;              ///< the forward's arguments (its out/ht are unused)
  strided3 d_out;           ///< (b, t, h), V contiguous
  strided3 d_ht;            ///< (n, h, row) of the state; data null: zero
  strided3 dq, dk, dv;      ///< indexed like q, k, v
  strided3 dg;              ///< (b, t, h); data null: not wanted
  strided3 dg_gamma;        ///< (n, h, -), s0 = 0 for [H]; data null: not wanted
  bool dg_gamma_summed = false;  ///< [H]: the sum over sequences
  strided3 dgk, dgv;        ///< (b, t, h), then K or V contiguous; data null: not wanted
  strided3 dh0;             ///< (n, h, row) of the state; data null: not wanted

  bool wants(const strided3& s) const { return s.data != nullptr; }
  static void* data(const strided3& s) { return const_cast<void*>(s.data); }
};

namespace detail {

/// [first, last) bytes spanned by a view; empty for an empty view.
inline std::pair<const char*, const char*> byte_span(const tensor_view& t) {
  if (t.numel() == 0 || !t.data()) return {nullptr, nullptr};
  std::int64_t lo = 0, hi = 0;
  for (int i = 0; i < t.rank(); ++i) {
    const std::int64_t ext = (t.size(i) - 1) * t.stride(i);
    if (ext < 0) lo += ext; else hi += ext;
  }
  const char* base = static_cast<const char*>(t.data());
  const std::int64_t es = std::int64_t(dtype_size(t.type()));
  return {base + lo * es, base + (hi + 1) * es};
}

inline bool overlaps(const tensor_view& a, const tensor_view& b) {
  const auto x = byte_span(a), y = byte_span(b);
  return x.first && y.first && x.first < y.second && y.first < x.second;
}

inline void check_grad(const std::string& name, const tensor_view& t, const tensor_view& like, dtype want,
                       const char* layout) {
  check_shape(name, t, like.shape_vec(), layout);
  check_dtype(name, t, want);
  check_data(name, t);
}

}  // namespace detail

/// Checks every argument of a backward call (SPEC §5) and returns the plain problem.
/// `outs` may be null (sizes only: the allocating API checks before it allocates). With
/// `output_kind::reference` every gradient buffer is float64.
inline backward_problem make_backward_problem(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                              const forward_options& opt, const output_grads& grads,
                                              const backward_outputs* outs, output_kind kind = output_kind::native) {
  using namespace detail;
  backward_problem bp;
  problem& p = bp.fwd;
  p = make_problem(q, k, v, opt, nullptr, kind);
  const bool ref = kind == output_kind::reference;
  const bool kv = p.layout == state_layout::kv;
  const std::vector<std::int64_t> state_shape = kv ? std::vector<std::int64_t>{p.N, p.H, p.K, p.V}
                                                   : std::vector<std::int64_t>{p.N, p.H, p.V, p.K};
  const char* state_str = kv ? (p.varlen ? "[N, H, K, V]" : "[B, H, K, V]")
                             : (p.varlen ? "[N, H, V, K] (state_layout vk)" : "[B, H, V, K] (state_layout vk)");

  const tensor_view& dO = grads.d_output;
  check_shape("d_output", dO, {p.B, p.T, p.H, p.V}, "[B, T, H, V] (the forward output's)");
  check_dtype("d_output", dO, p.type);
  check_data("d_output", dO);
  bp.d_out = strided4(dO);
  if (grads.d_final_state) {
    const tensor_view& d = *grads.d_final_state;
    check_shape("d_final_state", d, state_shape, state_str);
    if (!(ref && d.type() == dtype::float64)) check_dtype("d_final_state", d, p.state_type);
    check_data("d_final_state", d);
    bp.d_ht = strided4(d);
  }
  if (!outs) return bp;

  const dtype f64 = dtype::float64;
  check_grad("dq", outs->dq, q, ref ? f64 : p.type, "(the query's)");
  check_grad("dk", outs->dk, k, ref ? f64 : p.type, "(the key's)");
  check_grad("dv", outs->dv, v, ref ? f64 : p.type, "(the value's)");
  bp.dq = strided4(outs->dq);
  bp.dk = strided4(outs->dk);
  bp.dv = strided4(outs->dv);

  struct gate_out {
    const char* name;
    const std::optional<mutable_tensor_view>& out;
    const std::optional<tensor_view>& in;
    const char* input;
    bool state;
  };
  const gate_out gates[] = {{"dg", outs->dg, opt.g, "g", false},
                            {"dg_gamma", outs->dg_gamma, opt.g_gamma, "g_gamma", false},
                            {"dgk", outs->dgk, opt.gk, "gk", false},
                            {"dgv", outs->dgv, opt.gv, "gv", false},
                            {"d_initial_state", outs->d_initial_state, opt.initial_state, "initial_state", true}};
  for (const gate_out& g : gates) {
    if (!g.out) continue;
    if (!g.in) fail(g.name, cat("no buffer (no ", g.input, " was given to the forward)"), dims(*g.out));
    const dtype want = ref ? f64 : (g.state ? p.state_type : g.in->type());
    check_grad(g.name, *g.out, *g.in, want, cat("(", g.input, "'s)").c_str());
  }
  if (outs->dg) bp.dg = strided_of(*outs->dg);
  if (outs->dg_gamma) {
    bp.dg_gamma = strided_of(*outs->dg_gamma);
    if (outs->dg_gamma->rank() == 1) {
      bp.dg_gamma.s1 = bp.dg_gamma.s0;
      bp.dg_gamma.s0 = 0;
      bp.dg_gamma_summed = true;
    }
  }
  if (outs->dgk) bp.dgk = strided4(*outs->dgk);
  if (outs->dgv) bp.dgv = strided4(*outs->dgv);
  if (outs->d_initial_state) bp.dh0 = strided4(*outs->d_initial_state);

  // The kernel writes partial sums into gate-gradient buffers before it has read every
  // input: a gradient buffer may share memory with no input and no other gradient.
  std::vector<std::pair<const char*, tensor_view>> ins{{"query", q}, {"key", k}, {"value", v}, {"d_output", dO}};
  if (grads.d_final_state) ins.emplace_back("d_final_state", *grads.d_final_state);
  if (opt.g) ins.emplace_back("g", *opt.g);
  if (opt.g_gamma) ins.emplace_back("g_gamma", *opt.g_gamma);
  if (opt.gk) ins.emplace_back("gk", *opt.gk);
  if (opt.gv) ins.emplace_back("gv", *opt.gv);
  if (opt.initial_state) ins.emplace_back("initial_state", *opt.initial_state);
  if (opt.cu_seqlens) ins.emplace_back("cu_seqlens", *opt.cu_seqlens);
  std::vector<std::pair<const char*, tensor_view>> out_views{{"dq", outs->dq}, {"dk", outs->dk}, {"dv", outs->dv}};
  for (const gate_out& g : gates)
    if (g.out) out_views.emplace_back(g.name, *g.out);
  for (std::size_t i = 0; i < out_views.size(); ++i) {
    for (const auto& in : ins)
      if (overlaps(out_views[i].second, in.second))
        fail(out_views[i].first, cat("memory disjoint from every input"), cat("a buffer overlapping ", in.first));
    for (std::size_t j = 0; j < i; ++j)
      if (overlaps(out_views[i].second, out_views[j].second))
        fail(out_views[i].first, cat("memory disjoint from the other gradients"),
             cat("a buffer overlapping ", out_views[j].first));
  }
  return bp;
}

}  // namespace recattn
