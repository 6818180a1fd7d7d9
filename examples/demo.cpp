// recattn demo: a recurrent-attention prefill on the CPU.
//
//   recattn_demo [T [H [K [V [threads]]]]]      (defaults: 4096 16 128 128, all threads)
//
// One batch row of T tokens and H heads with a key-channel gate gk = log(sigmoid(x)), an
// initial state and the final state returned, in float32 and then in bfloat16. Each run is
// checked against the double-precision reference on its first heads, then timed.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <recattn/recattn.hpp>

namespace {

using clock_type = std::chrono::steady_clock;

struct shape {
  std::int64_t B = 1, T = 4096, H = 16, K = 128, V = 128;
};

std::vector<float> normal_values(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(n);
  for (auto& e : x) e = normal(rng);
  return x;
}

template <class T>
std::vector<T> cast_to(const std::vector<float>& x) {
  std::vector<T> y(x.size());
  std::transform(x.begin(), x.end(), y.begin(), [](float f) { return T(f); });
  return y;
}

/// ||got - ref|| / ||ref|| over the first `heads` heads of a [B, T, H, V]-like array, where
/// `ref` holds only those heads ([B, T, heads, V]).
template <class T>
double rel_err(const T* got, const double* ref, std::int64_t outer, std::int64_t H, std::int64_t heads,
               std::int64_t row) {
  double num = 0, den = 0;
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < row; ++i) {
        const double x = double(float(got[(o * H + h) * row + i]));
        const double y = ref[(o * heads + h) * row + i];
        num += (x - y) * (x - y);
        den += y * y;
      }
  return std::sqrt(num / den);
}

/// Runs the float32 or bfloat16 case; returns false when the check fails.
template <class T>
bool run_case(const char* name, double tolerance, const shape& s, const std::vector<float>& q32,
              const std::vector<float>& k32, const std::vector<float>& v32, const std::vector<float>& gk,
              const std::vector<float>& h0, const recattn::cfg& c) {
  const std::int64_t B = s.B, T_ = s.T, H = s.H, K = s.K, V = s.V;
  const std::vector<T> q = cast_to<T>(q32), k = cast_to<T>(k32), v = cast_to<T>(v32);
  std::vector<T> out(std::size_t(B * T_ * H * V));
  std::vector<float> state(std::size_t(B * H * K * V));

  recattn::forward_options opt;
  opt.gk = recattn::view(gk.data(), {B, T_, H, K});
  opt.initial_state = recattn::view(h0.data(), {B, H, K, V});
  opt.return_state = true;
  opt.cfg = c;
  const recattn::forward_outputs outs{recattn::view(out.data(), {B, T_, H, V}),
                                      recattn::view(state.data(), {B, H, K, V})};
  auto forward = [&] {
    recattn::recurrent_attention(recattn::view(q.data(), {B, T_, H, K}), recattn::view(k.data(), {B, T_, H, K}),
                                 recattn::view(v.data(), {B, T_, H, V}), opt, outs);
  };

  // The reference is scalar double: check the first heads only, through strided views of
  // the same buffers (a slice [B, T, hc, .] of [B, T, H, .]).
  forward();
  const std::int64_t hc = std::min<std::int64_t>(H, 2);
  recattn::forward_options ref_opt = opt;
  ref_opt.cfg.reset();
  ref_opt.gk = recattn::view(gk.data(), {B, T_, hc, K}, {T_ * H * K, H * K, K, 1});
  ref_opt.initial_state = recattn::view(h0.data(), {B, hc, K, V}, {H * K * V, K * V, V, 1});
  const auto t_ref = clock_type::now();
  const recattn::forward_result ref = recattn::reference_recurrent_attention(
      recattn::view(q.data(), {B, T_, hc, K}, {T_ * H * K, H * K, K, 1}),
      recattn::view(k.data(), {B, T_, hc, K}, {T_ * H * K, H * K, K, 1}),
      recattn::view(v.data(), {B, T_, hc, V}, {T_ * H * V, H * V, V, 1}), ref_opt);
  const double ref_s = std::chrono::duration<double>(clock_type::now() - t_ref).count();
  const double e_out = rel_err(out.data(), ref.output.data<double>(), B * T_, H, hc, V);
  const double e_state = rel_err(state.data(), ref.final_state->data<double>(), B, H, hc, K * V);
  const bool ok = e_out < tolerance && e_state < tolerance;
  std::printf("%-9s check vs reference (heads 0-%lld, %.1f s): output rel err %.2e, state %.2e (< %.0e) %s\n", name,
              static_cast<long long>(hc - 1), ref_s, e_out, e_state, tolerance, ok ? "ok" : "FAIL");

  // Median of several runs, at least 10 or about 2 s of work.
  std::vector<double> ms;
  const auto t_all = clock_type::now();
  while (ms.size() < 10 || (ms.size() < 100 && std::chrono::duration<double>(clock_type::now() - t_all).count() < 2.0)) {
    const auto t0 = clock_type::now();
    forward();
    ms.push_back(std::chrono::duration<double, std::milli>(clock_type::now() - t0).count());
    if (std::chrono::duration<double>(clock_type::now() - t_all).count() > 20.0) break;
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const double tok_heads = double(B * T_ * H) / (med * 1e-3);
  std::printf("%-9s median %.2f ms over %zu runs: %.2f M token·heads/s, %.1f GFLOP/s\n", name, med, ms.size(),
              tok_heads * 1e-6, tok_heads * 5.0 * double(K * V) * 1e-9);
  return ok;
}

std::int64_t arg(int argc, char** argv, int i, std::int64_t fallback) {
  if (argc <= i) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(argv[i], &end, 10);
  if (end == argv[i] || *end != '\0' || x < 0) {
    std::fprintf(stderr, "usage: %s [T [H [K [V [threads]]]]]  (bad argument '%s')\n", argv[0], argv[i]);
    std::exit(2);
  }
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  shape s;
  s.T = arg(argc, argv, 1, s.T);
  s.H = arg(argc, argv, 2, s.H);
  s.K = arg(argc, argv, 3, s.K);
  s.V = arg(argc, argv, 4, s.V);
  const int threads = int(arg(argc, argv, 5, 0));
  const std::int64_t B = s.B, T = s.T, H = s.H, K = s.K, V = s.V;

  std::mt19937 rng(2024);
  const std::vector<float> q = normal_values(std::size_t(B * T * H * K), rng);
  const std::vector<float> k = normal_values(std::size_t(B * T * H * K), rng);
  const std::vector<float> v = normal_values(std::size_t(B * T * H * V), rng);
  std::vector<float> gk = normal_values(std::size_t(B * T * H * K), rng);
  for (auto& g : gk) g = -std::log1p(std::exp(-g));  // log(sigmoid(x)): a decay in (0, 1)
  const std::vector<float> h0 = normal_values(std::size_t(B * H * K * V), rng);

  try {
    // The configuration the call will use: the heuristic, with the thread count if given.
    recattn::forward_options opt;
    opt.gk = recattn::view(gk.data(), {B, T, H, K});
    const recattn::problem p = recattn::make_problem(recattn::view(q.data(), {B, T, H, K}),
                                                     recattn::view(k.data(), {B, T, H, K}),
                                                     recattn::view(v.data(), {B, T, H, V}), opt, nullptr);
    recattn::cfg c = recattn::RecurrentAttention(recattn::platform::cpu).heuristic_cfg(p);
    if (threads > 0) c.threads = threads;

#if defined(_OPENMP)
    const char* pool = "OpenMP";
#else
    const char* pool = "std::thread";
#endif
    std::printf("recattn %s demo: CPU forward (prefill), SIMD %s, %s, %d threads\n", RECATTN_VERSION_STRING,
                recattn::cpu::arch::name(), pool, c.threads);
    std::printf("  q, k [%lld, %lld, %lld, %lld]  v [%lld, %lld, %lld, %lld]  ->  o [%lld, %lld, %lld, %lld], "
                "final state [%lld, %lld, %lld, %lld]\n",
                (long long)B, (long long)T, (long long)H, (long long)K, (long long)B, (long long)T, (long long)H,
                (long long)V, (long long)B, (long long)T, (long long)H, (long long)V, (long long)B, (long long)H,
                (long long)K, (long long)V);
    std::printf("  gates: gk = log(sigmoid(x)) float32 [%lld, %lld, %lld, %lld]; initial state float32; "
                "scale 1/sqrt(%lld)\n",
                (long long)B, (long long)T, (long long)H, (long long)K, (long long)K);
    std::printf("  cfg: threads=%d block_v=%d chunk=%d (heuristic_cfg%s)\n", c.threads, c.block_v, c.chunk,
                threads > 0 ? ", threads from the command line" : "");

    bool ok = run_case<float>("float32", 1e-4, s, q, k, v, gk, h0, c);
    ok = run_case<recattn::bfloat16>("bfloat16", 1e-2, s, q, k, v, gk, h0, c) && ok;
    return ok ? 0 : 1;
  } catch (const recattn::Error& e) {
    std::fprintf(stderr, "recattn error: %s\n", e.what());
    return 2;
  }
}
