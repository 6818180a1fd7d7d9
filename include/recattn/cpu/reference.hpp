// The scalar reference: SPEC §1 written out, accumulating in double. It is the oracle of
// every test and is public so that users can check a backend (or their own kernel) too.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "../problem.hpp"

namespace recattn::cpu {

namespace detail {
/// Offset of state element S[a][b] (a over K, b over V) in a (n, h) state of `p.layout`.
inline std::int64_t state_offset(const problem& p, const strided3& s, std::int64_t n, std::int64_t h, std::int64_t a,
                                 std::int64_t b) {
  return p.layout == state_layout::kv ? s.offset(n, h, a) + b : s.offset(n, h, b) + a;
}
}  // namespace detail

/// Runs the recurrence of SPEC §1 for a checked problem, in double, one (n, h) at a time.
/// Writes p.out (any float dtype) and p.ht when present.
inline void reference_forward(const problem& p) {
  const std::int64_t K = p.K, V = p.V;
  const std::size_t Ks = std::size_t(K), Vs = std::size_t(V);
  std::vector<double> S(Ks * Vs), dk(Ks), dv(Vs), qv(Ks), kv(Ks), vv(Vs);
  for (std::int64_t n = 0; n < p.N; ++n) {
    const std::int64_t b = p.seq_batch(n), t0 = p.seq_begin(n), L = p.seq_len(n);
    for (std::int64_t h = 0; h < p.H; ++h) {
      const std::int64_t hq = h / (p.H / p.Hq), hk = h / (p.H / p.Hk), hv = h / (p.H / p.Hv);
      for (std::int64_t a = 0; a < K; ++a)
        for (std::int64_t c = 0; c < V; ++c)
          S[std::size_t(a * V + c)] =
              p.h0.data ? load_as<double>(p.h0.data, p.h0.type, detail::state_offset(p, p.h0, n, h, a, c)) : 0.0;
      const double gamma = p.has(gate_g_gamma) ? load_as<double>(p.g_gamma.data, p.g_gamma.type, p.g_gamma.offset(n, h, 0)) : 0.0;
      for (std::int64_t i = 0; i < L; ++i) {
        const std::int64_t t = t0 + (p.reverse ? L - 1 - i : i);
        const double gs = (p.has(gate_g) ? load_as<double>(p.g.data, p.g.type, p.g.offset(b, t, h)) : 0.0) + gamma;
        for (std::int64_t a = 0; a < K; ++a) {
          dk[std::size_t(a)] = gs + (p.has(gate_gk) ? load_as<double>(p.gk.data, p.gk.type, p.gk.offset(b, t, h) + a) : 0.0);
          qv[std::size_t(a)] = load_as<double>(p.q.data, p.q.type, p.q.offset(b, t, hq) + a);
          kv[std::size_t(a)] = load_as<double>(p.k.data, p.k.type, p.k.offset(b, t, hk) + a);
        }
        for (std::int64_t c = 0; c < V; ++c) {
          dv[std::size_t(c)] = p.has(gate_gv) ? load_as<double>(p.gv.data, p.gv.type, p.gv.offset(b, t, h) + c) : 0.0;
          vv[std::size_t(c)] = load_as<double>(p.v.data, p.v.type, p.v.offset(b, t, hv) + c);
        }
        const bool decays = p.gates != 0;
        for (std::int64_t a = 0; a < K; ++a)
          for (std::int64_t c = 0; c < V; ++c) {
            double& s = S[std::size_t(a * V + c)];
            if (decays) s *= std::exp(dk[std::size_t(a)] + dv[std::size_t(c)]);
            s += kv[std::size_t(a)] * vv[std::size_t(c)];
          }
        for (std::int64_t c = 0; c < V; ++c) {
          double o = 0;
          for (std::int64_t a = 0; a < K; ++a) o += qv[std::size_t(a)] * S[std::size_t(a * V + c)];
          store_as(p.out_data(), p.out.type, p.out.offset(b, t, h) + c, p.scale * o);
        }
      }
      if (p.ht.data)
        for (std::int64_t a = 0; a < K; ++a)
          for (std::int64_t c = 0; c < V; ++c)
            store_as(p.ht_data(), p.ht.type, detail::state_offset(p, p.ht, n, h, a, c), S[std::size_t(a * V + c)]);
    }
  }
}

}  // namespace recattn::cpu
