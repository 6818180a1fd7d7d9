// CPU forward benchmark (issue 3): tokens x heads per second, GFLOP/s (5 K V flops per
// token and head) and the share of the float FMA peak, which a probe in this binary
// measures on the same machine and thread count.
//
//   ./cpu_forward --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <unistd.h>
#endif

#include <recattn/recattn.hpp>
#include <xsimd/xsimd.hpp>

namespace {

using clock_type = std::chrono::steady_clock;

/// Float FMA throughput of one thread: 16 independent accumulator chains, long enough to
/// hide the FMA latency, over `iters` rounds. Returns flops (2 per lane per FMA).
double fma_probe_thread(std::int64_t iters) {
  using B = xsimd::batch<float>;
  B acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = B(1.0f + 1e-3f * float(i));
  const B m(0.999999f), a(1e-7f);
  for (std::int64_t r = 0; r < iters; ++r)
    for (int i = 0; i < 16; ++i) acc[i] = xsimd::fma(acc[i], m, a);
  float s = 0;
  for (int i = 0; i < 16; ++i) s += xsimd::hadd(acc[i]);
  benchmark::DoNotOptimize(s);
  return double(iters) * 16 * B::size * 2;
}

/// Pins the calling thread to the `index`-th CPU the process may run on (Linux; elsewhere
/// nothing). Unpinned, the scheduler can put both probe threads on one CPU while another
/// session's job holds the other (seen here: 2 threads measured 229 GFLOP/s, the same as 1,
/// and the percentages against it were inflated).
void pin_to_cpu(int index) {
#if defined(__linux__)
  // The online CPUs, not this thread's mask: OMP_PROC_BIND may have bound the main thread
  // (and so the threads it starts) to one CPU. A CPU the process may not use is refused.
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  if (cpus < 1) return;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(int(index % cpus), &one);
  pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
#else
  (void)index;
#endif
}

/// Measured peak float FMA GFLOP/s on `threads` threads (best of 5 runs), each thread on its
/// own CPU.
double fma_peak_gflops(int threads) {
  static std::map<int, double> cache;
  auto it = cache.find(threads);
  if (it != cache.end()) return it->second;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const std::int64_t iters = 20'000'000;
    std::vector<std::thread> pool;
    std::vector<double> flops(static_cast<std::size_t>(threads), 0.0);
    const auto t0 = clock_type::now();
    for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] {
        pin_to_cpu(t);
        flops[std::size_t(t)] = fma_probe_thread(iters);
      });
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    double total = 0;
    for (double f : flops) total += f;
    best = std::max(best, total / s / 1e9);
  }
  return cache[threads] = best;
}

struct shape {
  std::int64_t B, T, H, K, V;
};

// Inputs and outputs start on a 64-byte boundary, as an engine's tensors do (a plain
// std::vector of this size starts 16 bytes past one: every row load would cross a line).
template <class T>
using aligned_vec = std::vector<T, xsimd::aligned_allocator<T, 64>>;

template <class T>
aligned_vec<T> random_vec(std::size_t n, std::mt19937& rng, bool gate) {
  std::normal_distribution<float> nd(0.f, 1.f);
  aligned_vec<T> v(n);
  for (auto& x : v) {
    float f = nd(rng);
    if (gate) f = -std::log1p(std::exp(-(f + 3.f)));  // log(sigmoid(x + 3)): mild decay
    x = T(f);
  }
  return v;
}

template <class T>
void bm_forward(benchmark::State& st, shape s, unsigned gates, int threads) {
  using namespace recattn;
  std::mt19937 rng(42);
  const auto nqk = std::size_t(s.B * s.T * s.H * s.K), nv = std::size_t(s.B * s.T * s.H * s.V);
  auto q = random_vec<T>(nqk, rng, false), k = random_vec<T>(nqk, rng, false), v = random_vec<T>(nv, rng, false);
  auto gk = random_vec<float>(nqk, rng, true), gv = random_vec<float>(nv, rng, true);
  auto g = random_vec<float>(std::size_t(s.B * s.T * s.H), rng, true);
  aligned_vec<float> gg(std::size_t(s.H), -0.01f);
  aligned_vec<T> o(nv);
  forward_options opt;
  if (gates & gate_g) opt.g = view(g.data(), {s.B, s.T, s.H});
  if (gates & gate_g_gamma) opt.g_gamma = view(gg.data(), {s.H});
  if (gates & gate_gk) opt.gk = view(gk.data(), {s.B, s.T, s.H, s.K});
  if (gates & gate_gv) opt.gv = view(gv.data(), {s.B, s.T, s.H, s.V});
  cfg c;
  c.threads = threads;
  opt.cfg = c;
  const auto qv = view(q.data(), {s.B, s.T, s.H, s.K}), kv = view(k.data(), {s.B, s.T, s.H, s.K});
  const auto vv = view(v.data(), {s.B, s.T, s.H, s.V});
  const forward_outputs outs{view(o.data(), {s.B, s.T, s.H, s.V}), std::nullopt};
  recurrent_attention(qv, kv, vv, opt, outs);  // warm-up: pages touched, caches primed
  for (auto _ : st) {
    recurrent_attention(qv, kv, vv, opt, outs);
    benchmark::ClobberMemory();
  }
  const double tok_heads = double(s.B * s.T * s.H);
  const double flops = 5.0 * double(s.K * s.V) * tok_heads;
  const double peak = fma_peak_gflops(threads);
  st.counters["tok_heads_per_s"] = benchmark::Counter(tok_heads, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["gflops"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  // pct_fma_peak = gflops / peak * 100, as a rate so that it follows the timing.
  st.counters["pct_fma_peak"] = benchmark::Counter(flops / 1e9 / peak * 100, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["fma_peak_gflops"] = peak;
}

void bm_fma_peak(benchmark::State& st, int threads) {
  for (auto _ : st) benchmark::DoNotOptimize(fma_peak_gflops(threads));
  st.counters["gflops"] = fma_peak_gflops(threads);
}

const char* dtype_label(float) { return "float32"; }
const char* dtype_label(recattn::bfloat16) { return "bfloat16"; }

template <class T>
void register_all() {
  const shape shapes[] = {{1, 4096, 16, 128, 128}, {4, 1024, 16, 64, 64}};
  const unsigned gate_sets[] = {0u, recattn::gate_g, recattn::gate_g_gamma, recattn::gate_gk, recattn::gate_gv, 15u};
  for (const shape& s : shapes)
    for (unsigned gates : gate_sets)
      for (int threads : {1, 2}) {
        const std::string name = "cpu_forward/" + recattn::gate_mask_name(gates) + "/" + dtype_label(T{}) +
                                 "/B:" + std::to_string(s.B) + "/T:" + std::to_string(s.T) +
                                 "/H:" + std::to_string(s.H) + "/K:" + std::to_string(s.K) +
                                 "/V:" + std::to_string(s.V) + "/threads:" + std::to_string(threads);
        benchmark::RegisterBenchmark(name.c_str(), bm_forward<T>, s, gates, threads)->Unit(benchmark::kMillisecond)->UseRealTime();
      }
}

}  // namespace

int main(int argc, char** argv) {
  for (int threads : {1, 2})
    benchmark::RegisterBenchmark(("fma_peak/float32/threads:" + std::to_string(threads)).c_str(), bm_fma_peak, threads)
        ->Iterations(1);
  register_all<float>();
  register_all<recattn::bfloat16>();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
