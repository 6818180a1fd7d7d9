// Google Benchmark of the CUDA decode step (issue 6): one H200, a state pool with int32
// state_indices (rows in reversed slots), one token per row. Each iteration times about 10 ms
// of back-to-back calls of the public API with CUDA events, after a warm-up, and reports the
// mean per call (manual time; recattn_bench::time_calls in cuda_bench_common.cuh); run with
// --benchmark_repetitions=N for medians.
//
//   cuda_step/<gate>/<dtype>/state:<float32|bfloat16>/B:128/H:32/K:128/V:128
//
//   cuda_step/gk/bfloat16/state:<..>/B:128/H:32/K:128/V:128/block_v:<n>   cfg.block_v sweep
//   inplace_probe/axpb/MiB:<n>  x = a x + b in place over one pool's bytes (float4 streaming
//                             loads and stores, 4 in flight a thread): in-place bandwidth
//   copy_probe/d2d/MiB:<n>    cudaMemcpyAsync device to device of one pool's bytes (GB/s
//                             counts bytes read + written: the copy bandwidth of the GPU)
//
// Counters: ms per call and GB/s of state traffic (2 B H K V sizeof(state): the state is read
// and written once per call). The calls pass check_index_values = false (an engine's hot
// path: the indices are device memory, and checking their values costs a copy to the host).
//
//   ./cuda_step --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include <recattn/recattn.hpp>

#include "cuda_bench_common.cuh"

namespace {

using recattn_bench::fill_kind;
using recattn_bench::ok;

template <class T>
T* device_random(std::int64_t n, std::uint64_t seed, fill_kind kind) {
  T* p = nullptr;
  ok(cudaMalloc(&p, std::size_t(n) * sizeof(T)), "cudaMalloc");
  recattn_bench::fill(p, n, seed, kind);
  return p;
}

struct shape {
  std::int64_t B, H, K, V;
};

template <class T, class S>
void bm_step(benchmark::State& st, shape s, unsigned gates, int block_v) {
  using namespace recattn;
  const std::int64_t nk = s.B * s.H * s.K, nv = s.B * s.H * s.V, ns = s.B * s.H * s.K * s.V;
  T* q = device_random<T>(nk, 1, fill_kind::unit);
  T* k = device_random<T>(nk, 2, fill_kind::unit);
  T* v = device_random<T>(nv, 3, fill_kind::unit);
  T* gk = device_random<T>(nk, 4, fill_kind::log_sigmoid);
  T* gv = device_random<T>(nv, 5, fill_kind::log_sigmoid);
  T* g = device_random<T>(s.B * s.H, 6, fill_kind::log_sigmoid);
  T* gg = device_random<T>(s.H, 7, fill_kind::log_sigmoid);
  T* o = device_random<T>(nv, 8, fill_kind::unit);
  S* pool = device_random<S>(ns, 9, fill_kind::small);
  std::vector<std::int32_t> slots(std::size_t(s.B));
  for (std::int64_t b = 0; b < s.B; ++b) slots[std::size_t(b)] = std::int32_t(s.B - 1 - b);
  std::int32_t* ix = nullptr;
  ok(cudaMalloc(&ix, slots.size() * 4), "cudaMalloc");
  ok(cudaMemcpy(ix, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice), "indices");
  ok(cudaDeviceSynchronize(), "fill");

  step_options opt;
  if (gates & gate_g) opt.g = view(g, {s.B, s.H});
  if (gates & gate_g_gamma) opt.g_gamma = view(gg, {s.H});
  if (gates & gate_gk) opt.gk = view(gk, {s.B, s.H, s.K});
  if (gates & gate_gv) opt.gv = view(gv, {s.B, s.H, s.V});
  opt.state_indices = view(ix, {s.B});
  opt.check_index_values = false;
  opt.platform = platform::cuda;
  if (block_v) {
    cfg c;
    c.block_v = block_v;
    opt.cfg = c;
  }
  const auto qv = view(q, {s.B, s.H, s.K}), kv = view(k, {s.B, s.H, s.K}), vv = view(v, {s.B, s.H, s.V});
  const auto pv = view(pool, {s.B, s.H, s.K, s.V});
  const auto ov = view(o, {s.B, s.H, s.V});
  const std::string why = can_implement_step(qv, kv, vv, pv, ov, opt);
  if (!why.empty()) {
    st.SkipWithError(why.c_str());
    for (void* x : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(gk),
                    static_cast<void*>(gv), static_cast<void*>(g), static_cast<void*>(gg), static_cast<void*>(o),
                    static_cast<void*>(pool), static_cast<void*>(ix)})
      cudaFree(x);
    return;
  }
  const double ms = recattn_bench::time_calls(st, [&] { step(qv, kv, vv, pv, ov, opt); }, 10.0f, 20);
  const double bytes = 2.0 * double(ns) * double(sizeof(S));
  st.counters["ms"] = ms;
  st.counters["state_GBps"] = bytes / (ms / 1e3) / 1e9;
  for (void* p : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(gk),
                  static_cast<void*>(gv), static_cast<void*>(g), static_cast<void*>(gg), static_cast<void*>(o),
                  static_cast<void*>(pool), static_cast<void*>(ix)})
    cudaFree(p);
}

/// Device-to-device copy of `bytes` bytes: the copy bandwidth the issue's targets refer to.
void bm_copy(benchmark::State& st, std::size_t bytes) {
  void *a = nullptr, *b = nullptr;
  ok(cudaMalloc(&a, bytes), "cudaMalloc");
  ok(cudaMalloc(&b, bytes), "cudaMalloc");
  ok(cudaMemset(a, 0, bytes), "memset");
  const double ms = recattn_bench::time_calls(
      st, [&] { ok(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice), "copy"); }, 10.0f, 5);
  st.counters["ms"] = ms;
  st.counters["GBps"] = 2.0 * double(bytes) / (ms / 1e3) / 1e9;
  cudaFree(a);
  cudaFree(b);
}

/// x = a x + b over float4 vectors, in place: the in-place read + write bandwidth a step's
/// state traffic is bound by (each thread keeps 4 vectors in flight, grid-stride).
__global__ void inplace_axpb(float4* x, std::int64_t n, float a, float b) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x * 4;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x * 4 + threadIdx.x; i < n; i += stride) {
    float4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * blockDim.x < n) v[u] = __ldcs(x + i + u * blockDim.x);
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * blockDim.x < n)
        __stcs(x + i + u * blockDim.x, make_float4(a * v[u].x + b, a * v[u].y + b, a * v[u].z + b, a * v[u].w + b));
  }
}

void bm_inplace(benchmark::State& st, std::size_t bytes) {
  float4* x = nullptr;
  ok(cudaMalloc(&x, bytes), "cudaMalloc");
  ok(cudaMemset(x, 0, bytes), "memset");
  int sms = 0;
  ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "attribute");
  const std::int64_t n = std::int64_t(bytes / sizeof(float4));
  const double ms = recattn_bench::time_calls(
      st, [&] { inplace_axpb<<<unsigned(sms * 8), 256>>>(x, n, 0.5f, 1.0f); }, 10.0f, 5);
  st.counters["ms"] = ms;
  st.counters["GBps"] = 2.0 * double(bytes) / (ms / 1e3) / 1e9;
  cudaFree(x);
}

const char* label(float) { return "float32"; }
const char* label(recattn::bfloat16) { return "bfloat16"; }

template <class T, class S>
std::string case_name(const shape& s, unsigned gates) {
  return std::string("cuda_step/") + recattn::gate_mask_name(gates) + "/" + label(T{}) + "/state:" + label(S{}) +
         "/B:" + std::to_string(s.B) + "/H:" + std::to_string(s.H) + "/K:" + std::to_string(s.K) +
         "/V:" + std::to_string(s.V);
}

template <class T, class S>
void register_cases(const shape& s) {
  for (unsigned gates : {unsigned(recattn::gate_gk), unsigned(recattn::gate_g), 0u, 15u})
    benchmark::RegisterBenchmark(case_name<T, S>(s, gates).c_str(), bm_step<T, S>, s, gates, 0)
        ->UseManualTime()
        ->Iterations(10)
        ->Unit(benchmark::kMillisecond);
}

/// The issue's target case (gk) at other column blocks than the heuristic's (16 lanes of 16
/// bytes for K = 128: 64 float or 128 bfloat16 columns, a 32 KiB tile).
template <class T, class S>
void register_block_v(const shape& s) {
  constexpr int vec = int(16 / sizeof(S));
  for (int bv : {2 * vec, 4 * vec, 8 * vec, 16 * vec, 32 * vec}) {
    if (bv > s.V) continue;
    const std::string name = case_name<T, S>(s, recattn::gate_gk) + "/block_v:" + std::to_string(bv);
    benchmark::RegisterBenchmark(name.c_str(), bm_step<T, S>, s, unsigned(recattn::gate_gk), bv)
        ->UseManualTime()
        ->Iterations(10)
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const shape s{128, 32, 128, 128};
  register_cases<recattn::bfloat16, float>(s);
  register_cases<recattn::bfloat16, recattn::bfloat16>(s);
  register_cases<float, float>(s);
  register_block_v<recattn::bfloat16, float>(s);
  register_block_v<recattn::bfloat16, recattn::bfloat16>(s);
  for (std::size_t elem : {std::size_t(4), std::size_t(2)}) {
    const std::size_t bytes = std::size_t(s.B * s.H * s.K * s.V) * elem;
    const std::string name = "copy_probe/d2d/MiB:" + std::to_string(bytes >> 20);
    benchmark::RegisterBenchmark(name.c_str(), bm_copy, bytes)->UseManualTime()->Iterations(10)->Unit(benchmark::kMillisecond);
    const std::string in = "inplace_probe/axpb/MiB:" + std::to_string(bytes >> 20);
    benchmark::RegisterBenchmark(in.c_str(), bm_inplace, bytes)->UseManualTime()->Iterations(10)->Unit(benchmark::kMillisecond);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
