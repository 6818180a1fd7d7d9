// The scalar reference gradient: the forward of SPEC §1 with every per-token state kept,
// differentiated by hand, in double. It is the oracle of the backward tests; its memory is
// O(T * K * V) per (sequence, head) by design, unlike the kernels.
//
// With S_i the state after the i-th processed token, D_i its decay, and dS_i the gradient
// of the loss with respect to S_i (the adjoint):
//
//   dS_{L-1} = d_final_state + scale * q_{L-1} dO_{L-1}^T
//   dS_{i-1} = D_i .* dS_i   + scale * q_{i-1} dO_{i-1}^T
//   dq_i = scale * S_i dO_i      dk_i = dS_i v_i      dv_i = dS_i^T k_i
//   d log D_i = dS_i .* D_i .* S_{i-1}   (summed over b for gk, over a for gv, over both
//                                          for g, and over tokens too for g_gamma)
//   d initial_state = D_0 .* dS_0
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "../backward_problem.hpp"
#include "reference.hpp"

namespace recattn::cpu {

/// The gradients of SPEC §3.2 for a checked backward problem, in double. Writes every
/// buffer the problem names (any float dtype).
inline void reference_backward(const backward_problem& bp) {
  const problem& p = bp.fwd;
  const std::int64_t K = p.K, V = p.V, KV = K * V;
  const std::size_t KVs = std::size_t(KV);
  const std::int64_t gq = p.H / p.Hq, gk_ = p.H / p.Hk, gv_ = p.H / p.Hv;
  // Grouped heads sum into one row: accumulate every q/k/v gradient in double first.
  std::vector<double> dq(std::size_t(p.B * p.T * p.Hq * K), 0.0), dk(std::size_t(p.B * p.T * p.Hk * K), 0.0),
      dv(std::size_t(p.B * p.T * p.Hv * V), 0.0), dgamma(std::size_t(p.N * p.H), 0.0);
  auto at = [&](std::int64_t b, std::int64_t t, std::int64_t hh, std::int64_t Hx, std::int64_t C) {
    return std::size_t(((b * p.T + t) * Hx + hh) * C);
  };
  auto ld = [](const strided3& s, std::int64_t off) { return load_as<double>(s.data, s.type, off); };

  const std::size_t Ks = std::size_t(K), Vs = std::size_t(V);
  std::vector<double> states, R(KVs), logd(KVs), qv(Ks), kv(Ks), vv(Vs), dov(Vs);
  for (std::int64_t n = 0; n < p.N; ++n) {
    const std::int64_t b = p.seq_batch(n), t0 = p.seq_begin(n), L = p.seq_len(n);
    auto token = [&](std::int64_t i) { return t0 + (p.reverse ? L - 1 - i : i); };
    for (std::int64_t h = 0; h < p.H; ++h) {
      const std::int64_t hq = h / gq, hk = h / gk_, hv = h / gv_;
      const double gamma = p.has(gate_g_gamma) ? ld(p.g_gamma, p.g_gamma.offset(n, h, 0)) : 0.0;
      // logd = log D_i for the token of processing index i.
      auto decay = [&](std::int64_t i) {
        const std::int64_t t = token(i);
        const double gs = gamma + (p.has(gate_g) ? ld(p.g, p.g.offset(b, t, h)) : 0.0);
        for (std::int64_t a = 0; a < K; ++a)
          for (std::int64_t c = 0; c < V; ++c)
            logd[std::size_t(a * V + c)] = gs + (p.has(gate_gk) ? ld(p.gk, p.gk.offset(b, t, h) + a) : 0.0) +
                                           (p.has(gate_gv) ? ld(p.gv, p.gv.offset(b, t, h) + c) : 0.0);
      };
      auto load_token = [&](std::int64_t t) {
        for (std::int64_t a = 0; a < K; ++a) {
          qv[std::size_t(a)] = ld(p.q, p.q.offset(b, t, hq) + a);
          kv[std::size_t(a)] = ld(p.k, p.k.offset(b, t, hk) + a);
        }
        for (std::int64_t c = 0; c < V; ++c) {
          vv[std::size_t(c)] = ld(p.v, p.v.offset(b, t, hv) + c);
          dov[std::size_t(c)] = ld(bp.d_out, bp.d_out.offset(b, t, h) + c);
        }
      };

      // Forward, keeping states[i + 1] = S_i (states[0] = the initial state).
      states.assign(std::size_t(L + 1) * KVs, 0.0);
      if (p.h0.data)
        for (std::int64_t a = 0; a < K; ++a)
          for (std::int64_t c = 0; c < V; ++c)
            states[std::size_t(a * V + c)] = ld(p.h0, detail::state_offset(p, p.h0, n, h, a, c));
      for (std::int64_t i = 0; i < L; ++i) {
        decay(i);
        load_token(token(i));
        const double* prev = states.data() + std::size_t(i) * KVs;
        double* cur = states.data() + std::size_t(i + 1) * KVs;
        for (std::int64_t a = 0; a < K; ++a)
          for (std::int64_t c = 0; c < V; ++c) {
            const std::size_t e = std::size_t(a * V + c);
            cur[e] = (p.gates ? std::exp(logd[e]) : 1.0) * prev[e] + kv[std::size_t(a)] * vv[std::size_t(c)];
          }
      }

      // Backward.
      for (std::int64_t a = 0; a < K; ++a)
        for (std::int64_t c = 0; c < V; ++c)
          R[std::size_t(a * V + c)] = bp.d_ht.data ? ld(bp.d_ht, detail::state_offset(p, bp.d_ht, n, h, a, c)) : 0.0;
      for (std::int64_t i = L - 1; i >= 0; --i) {
        const std::int64_t t = token(i);
        decay(i);
        load_token(t);
        const double* prev = states.data() + std::size_t(i) * KVs;
        const double* cur = states.data() + std::size_t(i + 1) * KVs;
        for (std::int64_t a = 0; a < K; ++a)
          for (std::int64_t c = 0; c < V; ++c) R[std::size_t(a * V + c)] += p.scale * qv[std::size_t(a)] * dov[std::size_t(c)];
        double dg_t = 0.0;
        for (std::int64_t a = 0; a < K; ++a) {
          double dq_a = 0.0, dk_a = 0.0, dgk_a = 0.0;
          for (std::int64_t c = 0; c < V; ++c) {
            const std::size_t e = std::size_t(a * V + c);
            dq_a += cur[e] * dov[std::size_t(c)];
            dk_a += R[e] * vv[std::size_t(c)];
            dgk_a += R[e] * std::exp(logd[e]) * prev[e];
          }
          dq[at(b, t, hq, p.Hq, K) + std::size_t(a)] += p.scale * dq_a;
          dk[at(b, t, hk, p.Hk, K) + std::size_t(a)] += dk_a;
          if (bp.dgk.data) store_as(backward_problem::data(bp.dgk), bp.dgk.type, bp.dgk.offset(b, t, h) + a, dgk_a);
          dg_t += dgk_a;
        }
        for (std::int64_t c = 0; c < V; ++c) {
          double dv_c = 0.0, dgv_c = 0.0;
          for (std::int64_t a = 0; a < K; ++a) {
            const std::size_t e = std::size_t(a * V + c);
            dv_c += R[e] * kv[std::size_t(a)];
            dgv_c += R[e] * std::exp(logd[e]) * prev[e];
          }
          dv[at(b, t, hv, p.Hv, V) + std::size_t(c)] += dv_c;
          if (bp.dgv.data) store_as(backward_problem::data(bp.dgv), bp.dgv.type, bp.dgv.offset(b, t, h) + c, dgv_c);
        }
        if (bp.dg.data) store_as(backward_problem::data(bp.dg), bp.dg.type, bp.dg.offset(b, t, h), dg_t);
        dgamma[std::size_t(n * p.H + h)] += dg_t;
        for (std::size_t e = 0; e < KVs; ++e) R[e] *= p.gates ? std::exp(logd[e]) : 1.0;
      }
      if (bp.dh0.data)
        for (std::int64_t a = 0; a < K; ++a)
          for (std::int64_t c = 0; c < V; ++c)
            store_as(backward_problem::data(bp.dh0), bp.dh0.type, detail::state_offset(p, bp.dh0, n, h, a, c),
                     R[std::size_t(a * V + c)]);
    }
  }

  // Sequences own disjoint tokens, so every row written below was summed completely.
  auto store_all = [&](const strided3& dst, const std::vector<double>& src, std::int64_t Hx, std::int64_t C) {
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::int64_t t = 0; t < p.T; ++t)
        for (std::int64_t hh = 0; hh < Hx; ++hh)
          for (std::int64_t c = 0; c < C; ++c)
            store_as(backward_problem::data(dst), dst.type, dst.offset(b, t, hh) + c, src[at(b, t, hh, Hx, C) + std::size_t(c)]);
  };
  store_all(bp.dq, dq, p.Hq, K);
  store_all(bp.dk, dk, p.Hk, K);
  store_all(bp.dv, dv, p.Hv, V);
  if (bp.dg_gamma.data)
    for (std::int64_t h = 0; h < p.H; ++h) {
      if (bp.dg_gamma_summed) {
        double s = 0.0;
        for (std::int64_t n = 0; n < p.N; ++n) s += dgamma[std::size_t(n * p.H + h)];
        store_as(backward_problem::data(bp.dg_gamma), bp.dg_gamma.type, bp.dg_gamma.offset(0, h, 0), s);
      } else {
        for (std::int64_t n = 0; n < p.N; ++n)
          store_as(backward_problem::data(bp.dg_gamma), bp.dg_gamma.type, bp.dg_gamma.offset(n, h, 0),
                   dgamma[std::size_t(n * p.H + h)]);
      }
    }
}

}  // namespace recattn::cpu
