// Shared by the CUDA benchmarks (cuda_forward.cu, cuda_step.cu): error exits, random device
// data, and the timing loop (CUDA events around back-to-back calls, Google Benchmark manual
// time per call).
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

namespace recattn_bench {

inline void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

__device__ inline float hash_uniform(std::uint64_t i, std::uint64_t seed) {
  std::uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return float(x >> 40) * (1.0f / 16777216.0f);  // [0, 1)
}

/// What fill() writes: unit-variance values, log-sigmoid gates (log sigmoid(x), x in [1, 5]),
/// or small values (states).
enum class fill_kind { unit, log_sigmoid, small };

template <class T>
__global__ void fill_kernel(T* p, std::int64_t n, std::uint64_t seed, fill_kind kind) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n; i += std::int64_t(gridDim.x) * blockDim.x) {
    const float u = hash_uniform(std::uint64_t(i), seed);
    const float x = kind == fill_kind::unit          ? 3.4641016f * (u - 0.5f)
                    : kind == fill_kind::log_sigmoid ? -log1pf(expf(-(1.0f + 4.0f * u)))
                                                     : 0.1f * (u - 0.5f);
    if constexpr (std::is_same<T, float>::value) p[i] = x;
    else p[i] = T(x);
  }
}

/// n random elements of T at p (device memory), on the default stream.
template <class T>
void fill(T* p, std::int64_t n, std::uint64_t seed, fill_kind kind) {
  fill_kernel<T><<<1024, 256>>>(p, n, seed, kind);
  ok(cudaGetLastError(), "fill");
}

/// Times call() (asynchronous work on the default stream): a few warm-up calls, then per
/// benchmark iteration as many back-to-back calls as take about `batch_ms`, between two CUDA
/// events; the manual time of an iteration is the mean per call. Returns the mean ms per call
/// over every timed call. Register the benchmark with UseManualTime() and a fixed
/// Iterations(n): with manual time per call, Google Benchmark's own iteration count would aim
/// at its minimum time in calls, not in batches, and run far longer than measured.
template <class Call>
double time_calls(benchmark::State& state, Call&& call, float batch_ms = 20.0f, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) call();  // module load, first touch, clocks up
  ok(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t e0, e1;
  ok(cudaEventCreate(&e0), "event");
  ok(cudaEventCreate(&e1), "event");
  ok(cudaEventRecord(e0), "record");
  call();
  ok(cudaEventRecord(e1), "record");
  ok(cudaEventSynchronize(e1), "sync");
  float one = 0;
  ok(cudaEventElapsedTime(&one, e0, e1), "elapsed");
  const int launches = std::max(1, std::min(1000, int(batch_ms / std::max(one, 1e-3f))));
  double total_ms = 0;
  std::int64_t calls = 0;
  for (auto _ : state) {
    ok(cudaEventRecord(e0), "record");
    for (int i = 0; i < launches; ++i) call();
    ok(cudaEventRecord(e1), "record");
    ok(cudaEventSynchronize(e1), "sync");
    float ms = 0;
    ok(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    state.SetIterationTime(double(ms) / 1e3 / launches);
    total_ms += ms;
    calls += launches;
  }
  ok(cudaGetLastError(), "run");
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return total_ms / double(std::max<std::int64_t>(calls, 1));
}

}  // namespace recattn_bench
