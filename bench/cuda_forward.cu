// Google Benchmark of the CUDA forward pass (issue 5's table): one H200, bf16 inputs and
// gates, float state. Each iteration times `launches` back-to-back calls of the public API
// with CUDA events and reports the mean per call (manual time); run with
// --benchmark_repetitions=N to get medians.
//
//   cuda_forward/<algo>/<gate>/<dtype>/B:../T:../H:../K:../V:..       dense
//   cuda_forward/<algo>/<gate>/<dtype>/varlen:N/T:../H:../K:../V:..   N sequences, T tokens in all
//   --tune: instead, every candidate cfg of each case (cuda_forward_tune/...)
// <algo> is the kernel the cfg forces (cfg.algo): recurrent (issue 5) or chunked (issue 8:
// gates none, g, g_gamma, gk). The label is the resolved cfg.
//
// Counters: ms per call, tok_heads_per_s (tokens x heads per second), GB/s (the bytes a call
// must move through HBM: q, k, v and gates read, o written, initial state read, final state
// written, over the time).
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <recattn/recattn.hpp>

#include "cuda_bench_common.cuh"

namespace {

using recattn::dtype;

using recattn_bench::fill_kind;
using recattn_bench::ok;

struct buffer {
  void* p = nullptr;
  std::size_t bytes = 0;
  buffer() = default;
  buffer(dtype t, std::int64_t n, std::uint64_t seed, fill_kind kind) : bytes(std::size_t(n) * recattn::dtype_size(t)) {
    ok(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)), "cudaMalloc");
    if (t == dtype::bfloat16) recattn_bench::fill(static_cast<recattn::bfloat16*>(p), n, seed, kind);
    else recattn_bench::fill(static_cast<float*>(p), n, seed, kind);
  }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  buffer& operator=(buffer&& o) noexcept {
    std::swap(p, o.p);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~buffer() {
    if (p) cudaFree(p);
  }
};

struct bench_case {
  std::string gate;  // none, g, g_gamma, gk, gv, gk_gv
  std::int64_t B, T, H, K, V;
  int varlen_seqs = 0;  // > 0: B = 1, T tokens split into this many equal sequences
  bool initial_state = false;
  recattn::algorithm algo = recattn::algorithm::recurrent;
};

unsigned gate_mask(const std::string& g) {
  if (g == "g") return recattn::gate_g;
  if (g == "g_gamma") return recattn::gate_g_gamma;
  if (g == "gk") return recattn::gate_gk;
  if (g == "gv") return recattn::gate_gv;
  if (g == "gk_gv") return recattn::gate_gk | recattn::gate_gv;
  return 0;
}

struct prepared {
  bench_case c;
  dtype t = dtype::bfloat16;
  std::int64_t N = 0;
  buffer q, k, v, g, gg, gk, gv, h0, out, ht, cu;
  recattn::forward_options opt;
  recattn::forward_outputs outs;
  double bytes = 0;

  prepared(const bench_case& bc, dtype type) : c(bc), t(type) {
    const std::int64_t B = c.B, T = c.T, H = c.H, K = c.K, V = c.V;
    N = c.varlen_seqs ? c.varlen_seqs : B;
    const std::int64_t tok = B * T;
    q = buffer(t, tok * H * K, 1, fill_kind::unit);
    k = buffer(t, tok * H * K, 2, fill_kind::unit);
    v = buffer(t, tok * H * V, 3, fill_kind::unit);
    out = buffer(t, tok * H * V, 4, fill_kind::unit);
    ht = buffer(dtype::float32, N * H * K * V, 5, fill_kind::unit);
    const unsigned m = gate_mask(c.gate);
    const double es = double(recattn::dtype_size(t));
    bytes = es * double(tok * H) * double(2 * K + 2 * V) + 4.0 * double(N * H * K * V);
    opt.platform = recattn::platform::cuda;
    opt.return_state = true;
    if (m & recattn::gate_g) {
      g = buffer(t, tok * H, 6, fill_kind::log_sigmoid);
      opt.g = recattn::tensor_view(g.p, t, {B, T, H});
      bytes += es * double(tok * H);
    }
    if (m & recattn::gate_g_gamma) {
      gg = buffer(t, H, 7, fill_kind::log_sigmoid);
      opt.g_gamma = recattn::tensor_view(gg.p, t, {H});
    }
    if (m & recattn::gate_gk) {
      gk = buffer(t, tok * H * K, 8, fill_kind::log_sigmoid);
      opt.gk = recattn::tensor_view(gk.p, t, {B, T, H, K});
      bytes += es * double(tok * H * K);
    }
    if (m & recattn::gate_gv) {
      gv = buffer(t, tok * H * V, 9, fill_kind::log_sigmoid);
      opt.gv = recattn::tensor_view(gv.p, t, {B, T, H, V});
      bytes += es * double(tok * H * V);
    }
    if (c.initial_state) {
      h0 = buffer(dtype::float32, N * H * K * V, 10, fill_kind::unit);
      opt.initial_state = recattn::tensor_view(h0.p, dtype::float32, {N, H, K, V});
      bytes += 4.0 * double(N * H * K * V);
    }
    if (c.varlen_seqs) {
      std::vector<std::int64_t> cuh(std::size_t(N) + 1);
      for (std::int64_t i = 0; i <= N; ++i) cuh[std::size_t(i)] = i * T / N;
      cu.bytes = cuh.size() * 8;
      ok(cudaMalloc(&cu.p, cu.bytes), "cudaMalloc");
      ok(cudaMemcpy(cu.p, cuh.data(), cu.bytes, cudaMemcpyHostToDevice), "cu upload");
      opt.cu_seqlens = recattn::tensor_view(cu.p, dtype::int64, {N + 1});
    }
    outs.output = recattn::mutable_tensor_view(out.p, t, {B, T, H, V});
    outs.final_state = recattn::mutable_tensor_view(ht.p, dtype::float32, {N, H, K, V});
    ok(cudaDeviceSynchronize(), "setup");
  }

  void call() const {
    recattn::recurrent_attention(recattn::tensor_view(q.p, t, {c.B, c.T, c.H, c.K}),
                                 recattn::tensor_view(k.p, t, {c.B, c.T, c.H, c.K}),
                                 recattn::tensor_view(v.p, t, {c.B, c.T, c.H, c.V}), opt, outs);
  }

  recattn::problem problem() const {
    return recattn::make_problem(recattn::tensor_view(q.p, t, {c.B, c.T, c.H, c.K}),
                                 recattn::tensor_view(k.p, t, {c.B, c.T, c.H, c.K}),
                                 recattn::tensor_view(v.p, t, {c.B, c.T, c.H, c.V}), opt, &outs);
  }
};

void run_bench(benchmark::State& state, const bench_case& bc, std::optional<recattn::cfg> cfg) {
  prepared pr(bc, dtype::bfloat16);
  if (!cfg) {
    recattn::cfg c;
    c.algo = bc.algo;
    cfg = c;
  }
  pr.opt.cfg = cfg;
  const double ms = recattn_bench::time_calls(state, [&] { pr.call(); }, 20.0f, 3);
  state.counters["ms"] = ms;
  state.counters["tok_heads_per_s"] = double(bc.B * bc.T * bc.H) / (ms / 1e3);
  state.counters["GB/s"] = pr.bytes / (ms / 1e3) / 1e9;
  state.SetLabel(recattn::cuda::resolve_cfg(pr.problem(), cfg).str());
}

std::string case_name(const bench_case& c) {
  std::string s = std::string("cuda_forward/") + recattn::algorithm_name(c.algo) + "/" + c.gate + "/bf16/";
  if (c.varlen_seqs) s += "varlen:" + std::to_string(c.varlen_seqs) + "/T:" + std::to_string(c.T);
  else s += "B:" + std::to_string(c.B) + "/T:" + std::to_string(c.T);
  s += "/H:" + std::to_string(c.H) + "/K:" + std::to_string(c.K) + "/V:" + std::to_string(c.V);
  if (c.initial_state) s += "/h0";
  return s;
}

const std::vector<bench_case>& cases() {
  // Issue 5's rows (recurrent), then issue 8's shapes for the chunked kernel (the gk rows of
  // its table, gv and gk + gv, and the same shapes with g) and the recurrent kernel beside them.
  static const std::vector<bench_case> all = [] {
    std::vector<bench_case> v = {
        {"none", 4, 4096, 16, 128, 128},     {"g", 4, 4096, 16, 128, 128},  {"g_gamma", 4, 4096, 16, 128, 128},
        {"gk", 4, 4096, 16, 128, 128},       {"gv", 4, 4096, 16, 128, 128}, {"gk", 8, 2048, 32, 64, 64},
        {"gk", 1, 16384, 8, 128, 128},       {"gk", 1, 16384, 16, 128, 128, 8, true},
        {"gk_gv", 4, 4096, 16, 128, 128},
    };
    const bench_case shapes[] = {{"g", 8, 2048, 32, 64, 64}, {"g", 1, 16384, 8, 128, 128},
                                 {"g", 1, 16384, 16, 128, 128, 8, true}};
    for (const bench_case& c : shapes) v.push_back(c);  // recurrent, for the side-by-side
    for (const char* g : {"none", "g", "g_gamma", "gk", "gv", "gk_gv"}) {
      bench_case c{g, 4, 4096, 16, 128, 128};
      c.algo = recattn::algorithm::chunked;
      v.push_back(c);
    }
    for (const char* g : {"g", "gk"})
      for (bench_case c : shapes) {
        c.gate = g;
        c.algo = recattn::algorithm::chunked;
        v.push_back(c);
      }
    return v;
  }();
  return all;
}

}  // namespace

int main(int argc, char** argv) {
  bool tune = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--tune") == 0) tune = true;
    else args.push_back(argv[i]);
  }
  int n = int(args.size());
  for (const bench_case& c : cases()) {
    if (!tune) {
      benchmark::RegisterBenchmark(case_name(c).c_str(), [c](benchmark::State& s) { run_bench(s, c, std::nullopt); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(10);
      continue;
    }
    prepared probe(c, dtype::bfloat16);
    const auto cands = recattn::RecurrentAttention(recattn::platform::cuda).candidate_cfgs(probe.problem());
    for (const recattn::cfg& cf : cands) {
      if (c.algo != cf.algo) continue;  // each case row times its own kernel's candidates
      const std::string name = "cuda_forward_tune/" + case_name(c).substr(13) + "/num_warps:" +
                               std::to_string(cf.num_warps) + "/chunk:" + std::to_string(cf.chunk) +
                               "/block_v:" + std::to_string(cf.block_v);
      benchmark::RegisterBenchmark(name.c_str(), [c, cf](benchmark::State& s) { run_bench(s, c, cf); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(3);
    }
  }
  benchmark::Initialize(&n, args.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
