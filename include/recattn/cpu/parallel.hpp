// Work distribution over independent items: OpenMP when the includer compiles with it,
// std::thread otherwise. Items are handed out dynamically (they can differ in length:
// varlen sequences).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace recattn::cpu {

inline int hardware_threads() {
#if defined(_OPENMP)
  return std::max(1, omp_get_max_threads());
#else
  return std::max(1, int(std::thread::hardware_concurrency()));
#endif
}

/// Calls fn(item, worker) for item in [0, n) on `threads` workers (worker in [0, threads)).
template <class Fn>
void parallel_for(std::int64_t n, int threads, Fn&& fn) {
  threads = int(std::max<std::int64_t>(1, std::min<std::int64_t>(threads, n)));
  if (threads == 1) {
    for (std::int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (std::int64_t i = 0; i < n; ++i) fn(i, omp_get_thread_num());
#else
  std::atomic<std::int64_t> next{0};
  auto work = [&](int worker) {
    for (std::int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i, worker);
  };
  std::vector<std::thread> pool;
  pool.reserve(std::size_t(threads - 1));
  for (int w = 1; w < threads; ++w) pool.emplace_back(work, w);
  work(0);
  for (auto& t : pool) t.join();
#endif
}

}  // namespace recattn::cpu
