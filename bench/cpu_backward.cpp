// CPU backward benchmark (issue 4): cpu_forward/..., cpu_backward/... and
// cpu_forward_backward/... on the same shapes, in one binary so that bwd_over_fwd compares
// times measured in the same run.
//
//   cpu_backward/<gates>/<dtype>/B:1/T:4096/H:16/K:128/V:128/threads:2
//
// Counters: tok_heads_per_s (B * T * H per second); on backward entries bwd_over_fwd (its
// time over the forward's of the same shape, measured just before) and scratch_bytes (the
// kernel's own scratch, which does not grow with T; io_bytes is what the inputs and
// gradients themselves take, for reading a heaptrack peak).
//
// cpu_bwd_over_fwd/... times the two in pairs: each iteration a forward call, then a backward
// call, so that both see the same state of a shared machine (on the 2-core VM the forward
// alone ranges over 17-24 ms from minute to minute); its time is the backward's, its
// counters fwd_ms, bwd_ms and bwd_over_fwd (the sums over the iterations of the
// repetition). Run with repetitions for the median of the ratios. The .../cold entry reads
// 64 MiB (untimed) before each call, so that both start with nothing of their inputs cached;
// without it the backward starts where the forward ended (the last tokens) and finds those
// rows in the L3.
//
// Cuts: the binary runs the forward direction, dense layout and [K, V] state only.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <recattn/recattn.hpp>

namespace {

using namespace recattn;

struct shape {
  std::int64_t B = 1, T = 4096, H = 16, K = 128, V = 128;
  int threads = 2;
  std::string str() const {
    return "B:" + std::to_string(B) + "/T:" + std::to_string(T) + "/H:" + std::to_string(H) + "/K:" + std::to_string(K) +
           "/V:" + std::to_string(V) + "/threads:" + std::to_string(threads);
  }
};

/// Inputs, options and gradient buffers of one benchmark problem (gates in float32).
struct bench_problem {
  shape s;
  unsigned gates;
  tensor q, k, v, g, g_gamma, gk, gv, dO, out;
  tensor dq, dk, dv, dg, dg_gamma, dgk, dgv;
  forward_options opt;
  output_grads grads;
  backward_outputs outs;

  bench_problem(const shape& sh, unsigned gate_mask, dtype type) : s(sh), gates(gate_mask) {
    std::mt19937_64 gen(42);
    std::normal_distribution<float> normal;
    auto fill = [&](tensor& t, bool gate) {
      for (std::int64_t i = 0; i < t.numel(); ++i) {
        float x = normal(gen);
        if (gate) x = -std::log1p(std::exp(-(2.0f + x)));  // log(sigmoid(2 + x))
        store_as(t.raw(), t.type(), i, x);
      }
    };
    q = tensor(type, {s.B, s.T, s.H, s.K});
    k = tensor(type, {s.B, s.T, s.H, s.K});
    v = tensor(type, {s.B, s.T, s.H, s.V});
    dO = tensor(type, {s.B, s.T, s.H, s.V});
    out = tensor(type, {s.B, s.T, s.H, s.V});
    fill(q, false);
    fill(k, false);
    fill(v, false);
    fill(dO, false);
    dq = tensor(type, q.shape());
    dk = tensor(type, k.shape());
    dv = tensor(type, v.shape());
    outs = backward_outputs{dq.view(), dk.view(), dv.view(), {}, {}, {}, {}, {}};
    if (gates & gate_g) {
      g = tensor(dtype::float32, {s.B, s.T, s.H});
      fill(g, true);
      opt.g = g.view();
      dg = tensor(dtype::float32, g.shape());
      outs.dg = dg.view();
    }
    if (gates & gate_g_gamma) {
      g_gamma = tensor(dtype::float32, {s.H});
      fill(g_gamma, true);
      opt.g_gamma = g_gamma.view();
      dg_gamma = tensor(dtype::float32, g_gamma.shape());
      outs.dg_gamma = dg_gamma.view();
    }
    if (gates & gate_gk) {
      gk = tensor(dtype::float32, {s.B, s.T, s.H, s.K});
      fill(gk, true);
      opt.gk = gk.view();
      dgk = tensor(dtype::float32, gk.shape());
      outs.dgk = dgk.view();
    }
    if (gates & gate_gv) {
      gv = tensor(dtype::float32, {s.B, s.T, s.H, s.V});
      fill(gv, true);
      opt.gv = gv.view();
      dgv = tensor(dtype::float32, gv.shape());
      outs.dgv = dgv.view();
    }
    cfg c;
    c.threads = s.threads;
    if (const char* chunk = std::getenv("RECATTN_BENCH_CHUNK")) c.chunk = std::atoi(chunk);  // tuning runs
    opt.cfg = c;
    grads = output_grads{dO.view(), std::nullopt};
  }

  void forward() { recurrent_attention(q.view(), k.view(), v.view(), opt, forward_outputs{out.view(), std::nullopt}); }
  void backward() { recurrent_attention_backward(q.view(), k.view(), v.view(), opt, grads, outs); }

  std::size_t io_bytes() const {
    std::size_t n = 0;
    for (const tensor* t : {&q, &k, &v, &g, &g_gamma, &gk, &gv, &dO, &out, &dq, &dk, &dv, &dg, &dg_gamma, &dgk, &dgv})
      n += std::size_t(t->numel()) * dtype_size(t->type());
    return n;
  }
};

/// Seconds per forward call of each problem name, from its cpu_forward entry.
std::map<std::string, double>& forward_seconds() {
  static std::map<std::string, double> m;
  return m;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void set_rate(benchmark::State& st, const shape& s) {
  st.counters["tok_heads_per_s"] =
      benchmark::Counter(double(s.B * s.T * s.H) * double(st.iterations()), benchmark::Counter::kIsRate);
}

void run_forward(benchmark::State& st, const shape& s, unsigned gates, dtype type, const std::string& key) {
  bench_problem p(s, gates, type);
  p.forward();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : st) {
    p.forward();
    benchmark::ClobberMemory();
  }
  forward_seconds()[key] = seconds_since(t0) / double(st.iterations());
  set_rate(st, s);
}

void run_backward(benchmark::State& st, const shape& s, unsigned gates, dtype type, const std::string& key,
                  bool with_forward) {
  bench_problem p(s, gates, type);
  if (!forward_seconds().count(key)) {  // the forward entry was filtered out: time it here
    p.forward();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 3; ++i) p.forward();
    forward_seconds()[key] = seconds_since(t0) / 3.0;
  }
  p.backward();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : st) {
    if (with_forward) p.forward();
    p.backward();
    benchmark::ClobberMemory();
  }
  const double per_call = seconds_since(t0) / double(st.iterations());
  set_rate(st, s);
  st.counters[with_forward ? "fwdbwd_over_fwd" : "bwd_over_fwd"] = per_call / forward_seconds()[key];
  const cpu::backward_workspace w = backward_workspace_bytes(p.q.view(), p.k.view(), p.v.view(), p.opt, p.grads, p.outs);
  st.counters["scratch_bytes"] = double(w.total());
  st.counters["io_bytes"] = double(p.io_bytes());
}

/// Reads 64 MiB (two L3s and more; clean lines, so nothing is written back later): what the
/// caches held of the last call is gone.
void cool_caches() {
  static const std::vector<std::uint64_t> junk(std::size_t(64) << 17, 1);
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < junk.size(); i += 8) sum += junk[i];
  benchmark::DoNotOptimize(sum);
}

void run_paired(benchmark::State& st, const shape& s, unsigned gates, dtype type, bool cold) {
  bench_problem p(s, gates, type);
  p.forward();
  p.backward();
  double fwd = 0.0, bwd = 0.0;
  for (auto _ : st) {
    if (cold) cool_caches();
    auto t0 = std::chrono::steady_clock::now();
    p.forward();
    benchmark::ClobberMemory();
    fwd += seconds_since(t0);
    if (cold) cool_caches();
    t0 = std::chrono::steady_clock::now();
    p.backward();
    benchmark::ClobberMemory();
    const double b = seconds_since(t0);
    bwd += b;
    st.SetIterationTime(b);
  }
  set_rate(st, s);
  const double n = double(st.iterations());
  st.counters["fwd_ms"] = 1e3 * fwd / n;
  st.counters["bwd_ms"] = 1e3 * bwd / n;
  st.counters["bwd_over_fwd"] = bwd / fwd;
}

void register_all() {
  struct entry {
    unsigned gates;
    dtype type;
    std::int64_t T;
  };
  const std::vector<entry> entries = {
      {gate_gk, dtype::float32, 4096},   {gate_gk, dtype::float32, 16384}, {gate_gk, dtype::bfloat16, 4096},
      {0u, dtype::float32, 4096},        {gate_g, dtype::float32, 4096},   {gate_gv, dtype::float32, 4096},
      {gate_g | gate_gk | gate_gv | gate_g_gamma, dtype::float32, 4096}};
  for (const entry& e : entries) {
    shape s;
    s.T = e.T;
    const std::string key = gate_mask_name(e.gates) + "/" + dtype_name(e.type) + "/" + s.str();
    const unsigned gates = e.gates;
    const dtype type = e.type;
    benchmark::RegisterBenchmark(("cpu_forward/" + key).c_str(),
                                 [=](benchmark::State& st) { run_forward(st, s, gates, type, key); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("cpu_backward/" + key).c_str(),
                                 [=](benchmark::State& st) { run_backward(st, s, gates, type, key, false); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("cpu_forward_backward/" + key).c_str(),
                                 [=](benchmark::State& st) { run_backward(st, s, gates, type, key, true); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    for (const bool cold : {false, true})
      benchmark::RegisterBenchmark(("cpu_bwd_over_fwd/" + key + (cold ? "/cold" : "")).c_str(),
                                   [=](benchmark::State& st) { run_paired(st, s, gates, type, cold); })
          ->Unit(benchmark::kMillisecond)
          ->UseManualTime();
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
