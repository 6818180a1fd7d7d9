// CPU decode-step benchmark (issue 6): microseconds per call and GB/s of state traffic
// (the state is read and written once per call: 2 B H K V sizeof(state) bytes), against an
// in-place read+write bandwidth probe in this binary: x = a * x + b over a buffer of the same
// size, with the same threads and the same work distribution (recattn's parallel_for).
//
//   ./cpu_step --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <recattn/recattn.hpp>
#include <xsimd/xsimd.hpp>

namespace {

using clock_type = std::chrono::steady_clock;

struct free_deleter {
  void operator()(void* p) const { std::free(p); }
};
template <class T>
std::unique_ptr<T[], free_deleter> aligned_array(std::size_t n) {
  void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
  if (!p) throw std::bad_alloc();
  return std::unique_ptr<T[], free_deleter>(static_cast<T*>(p));
}

/// x = a * x + b in place over `floats` floats on `threads` workers (blocks of 64 KiB handed
/// out like the step's items): one read and one write of every byte.
void axpb_pass(float* x, std::size_t floats, int threads) {
  using B = xsimd::batch<float>;
  constexpr std::size_t block = 16384;  // floats: 64 KiB, the step's item (one 128 x 128 state)
  const std::int64_t blocks = std::int64_t((floats + block - 1) / block);
  recattn::cpu::parallel_for(blocks, threads, [&](std::int64_t i, int) {
    float* p = x + std::size_t(i) * block;
    const std::size_t n = std::min(block, floats - std::size_t(i) * block);
    const B a(0.999f), b(1e-6f);
    std::size_t j = 0;
    for (; j + B::size <= n; j += B::size) xsimd::fma(a, B::load_aligned(p + j), b).store_aligned(p + j);
    for (; j < n; ++j) p[j] = 0.999f * p[j] + 1e-6f;
  });
}

/// Median in-place read+write bandwidth (GB/s, bytes read + written) over `bytes` bytes.
double probe_gbps(std::size_t bytes, int threads) {
  static std::map<std::pair<std::size_t, int>, double> cache;
  const auto key = std::make_pair(bytes, threads);
  if (cache.count(key)) return cache[key];
  const std::size_t floats = bytes / sizeof(float);
  auto x = aligned_array<float>(floats);
  std::fill(x.get(), x.get() + floats, 1.0f);
  axpb_pass(x.get(), floats, threads);  // pages touched
  std::vector<double> rates;
  for (int rep = 0; rep < 15; ++rep) {
    const auto t0 = clock_type::now();
    axpb_pass(x.get(), floats, threads);
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    rates.push_back(2.0 * double(bytes) / s / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  benchmark::DoNotOptimize(x[floats / 2]);
  return cache[key] = rates[rates.size() / 2];
}

struct shape {
  std::int64_t B, H, K, V;
};

template <class T>
std::vector<T> random_vec(std::size_t n, std::mt19937& rng, bool gate, float scale = 1.f) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<T> v(n);
  for (auto& x : v) {
    float f = nd(rng);
    if (gate) f = -std::log1p(std::exp(-(f + 3.f)));  // log(sigmoid(x + 3)): mild decay
    x = T(f * scale);
  }
  return v;
}

template <class T, class S>
void bm_step(benchmark::State& st, shape s, unsigned gates, int threads) {
  using namespace recattn;
  std::mt19937 rng(42);
  const auto nk = std::size_t(s.B * s.H * s.K), nv = std::size_t(s.B * s.H * s.V);
  auto q = random_vec<T>(nk, rng, false), k = random_vec<T>(nk, rng, false, 0.1f), v = random_vec<T>(nv, rng, false);
  auto gk = random_vec<float>(nk, rng, true), gv = random_vec<float>(nv, rng, true);
  auto g = random_vec<float>(std::size_t(s.B * s.H), rng, true);
  std::vector<float> gg(std::size_t(s.H), -0.01f);
  std::vector<T> o(nv);
  const std::size_t state_elems = std::size_t(s.B * s.H * s.K * s.V);
  auto pool = aligned_array<S>(state_elems);
  for (std::size_t i = 0; i < state_elems; ++i) pool[i] = S(0.01f * float(i % 97));
  // An engine's pool: rows in reversed slots.
  std::vector<std::int32_t> slots(std::size_t(s.B));
  for (std::int64_t b = 0; b < s.B; ++b) slots[std::size_t(b)] = std::int32_t(s.B - 1 - b);
  step_options opt;
  if (gates & gate_g) opt.g = view(g.data(), {s.B, s.H});
  if (gates & gate_g_gamma) opt.g_gamma = view(gg.data(), {s.H});
  if (gates & gate_gk) opt.gk = view(gk.data(), {s.B, s.H, s.K});
  if (gates & gate_gv) opt.gv = view(gv.data(), {s.B, s.H, s.V});
  opt.state_indices = view(slots.data(), {s.B});
  cfg c;
  c.threads = threads;
  opt.cfg = c;
  const auto qv = view(q.data(), {s.B, s.H, s.K}), kv = view(k.data(), {s.B, s.H, s.K});
  const auto vv = view(v.data(), {s.B, s.H, s.V});
  const auto pv = view(pool.get(), {s.B, s.H, s.K, s.V});
  const auto ov = view(o.data(), {s.B, s.H, s.V});
  step(qv, kv, vv, pv, ov, opt);  // warm-up: pages touched, scratch and threads made
  for (auto _ : st) {
    step(qv, kv, vv, pv, ov, opt);
    benchmark::ClobberMemory();
  }
  const double bytes = 2.0 * double(state_elems) * double(sizeof(S));
  const double probe = probe_gbps(std::size_t(bytes / 2), threads);
  st.counters["state_GBps"] = benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["pct_probe"] = benchmark::Counter(bytes / 1e9 / probe * 100, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["probe_GBps"] = probe;
}

void bm_probe(benchmark::State& st, std::size_t bytes, int threads) {
  const std::size_t floats = bytes / sizeof(float);
  auto x = aligned_array<float>(floats);
  std::fill(x.get(), x.get() + floats, 1.0f);
  axpb_pass(x.get(), floats, threads);
  for (auto _ : st) {
    axpb_pass(x.get(), floats, threads);
    benchmark::ClobberMemory();
  }
  st.counters["GBps"] = benchmark::Counter(2.0 * double(bytes) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

const char* label(float) { return "float32"; }
const char* label(recattn::bfloat16) { return "bfloat16"; }

template <class T, class S>
void register_cases(const shape& s) {
  for (unsigned gates : {0u, unsigned(recattn::gate_g), unsigned(recattn::gate_gk), 15u})
    for (int threads : {1, 2}) {
      const std::string name = std::string("cpu_step/") + recattn::gate_mask_name(gates) + "/" + label(T{}) +
                               "/state:" + label(S{}) + "/B:" + std::to_string(s.B) + "/H:" + std::to_string(s.H) +
                               "/K:" + std::to_string(s.K) + "/V:" + std::to_string(s.V) +
                               "/threads:" + std::to_string(threads);
      benchmark::RegisterBenchmark(name.c_str(), bm_step<T, S>, s, gates, threads)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime()
          ->MinTime(0.5);
    }
}

}  // namespace

int main(int argc, char** argv) {
  const shape s{64, 32, 128, 128};
  for (std::size_t state_bytes : {std::size_t(4), std::size_t(2)})
    for (int threads : {1, 2}) {
      const std::size_t bytes = std::size_t(s.B * s.H * s.K * s.V) * state_bytes;
      const std::string name = "bw_probe/inplace_axpb/MiB:" + std::to_string(bytes >> 20) + "/threads:" + std::to_string(threads);
      benchmark::RegisterBenchmark(name.c_str(), bm_probe, bytes, threads)->Unit(benchmark::kMicrosecond)->UseRealTime()->MinTime(0.5);
    }
  register_cases<float, float>(s);
  register_cases<float, recattn::bfloat16>(s);
  register_cases<recattn::bfloat16, float>(s);
  register_cases<recattn::bfloat16, recattn::bfloat16>(s);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
