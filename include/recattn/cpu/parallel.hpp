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

#include "../error.hpp"

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

/// The largest cfg.threads the CPU backends take: the workers are started per call (up to
/// the number of work items), so without a bound a huge value tries to start that many
/// threads, a std::system_error or an OpenMP runtime abort rather than a recattn::Error.
inline constexpr int cpu_max_threads = 1024;

/// Checks a user's cfg.threads against cpu_max_threads (its sign is checked with the other
/// cfg fields where they are resolved), before anything is written.
inline void check_cpu_threads(int threads) {
  if (threads > cpu_max_threads)
    recattn::detail::fail("cfg.threads", recattn::detail::cat("a value <= ", cpu_max_threads, " (worker threads per call)"),
                          threads);
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
