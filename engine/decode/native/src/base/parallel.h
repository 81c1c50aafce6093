// Threads: how many the kernels use, ranges split across them, and the spin barrier the one-region
// kernels (a layer's experts, a whole token) meet at.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <utility>

#include "features.h"

namespace moescope {

// The thread count the caller set (the Python side passes torch's intra-op count); 1 until then.
inline std::atomic<int>& thread_setting() {
  static std::atomic<int> threads{1};
  return threads;
}

inline int threads() { return std::max(1, thread_setting().load(std::memory_order_relaxed)); }

// This thread's [begin, end) of n items, split evenly over a team.
inline std::pair<int64_t, int64_t> thread_share(int64_t n, int tid, int team) {
  const int64_t chunk = (n + team - 1) / team;
  return {std::min<int64_t>(n, tid * chunk), std::min<int64_t>(n, (tid + 1) * chunk)};
}

// f(first, last) over [begin, end) in chunks of at least `grain`, one per thread, as torch's
// at::parallel_for splits a range (inline where one chunk covers it or inside a parallel region).
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t most = (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
  const int team = static_cast<int>(std::min<int64_t>(threads(), most));
  if (team <= 1 || omp_in_parallel()) {
    f(begin, end);
    return;
  }
#pragma omp parallel num_threads(team)
  {
    const auto [first, last] = thread_share(n, omp_get_thread_num(), omp_get_num_threads());
    if (first < last) f(begin + first, begin + last);
  }
}

inline void cpu_relax() {
#if defined(MOESCOPE_X86)
  _mm_pause();
#elif defined(MOESCOPE_ARM)
  asm volatile("yield");
#endif
}

// A barrier for the threads of one parallel region: they spin (as OpenMP's own threads do between
// regions), so a wait costs a cache line's round trip rather than a wake-up. A wait that outlasts
// the spins yields the core each time round: where other work shares the cores (a browser, a second
// process), the thread being waited for may be the one not running, and a spinning waiter would
// hold its core until the scheduler's time slice ends.
struct SpinBarrier {
  static constexpr int kSpinsBeforeYield = 4096;  // pauses: a wait for a running thread ends within them
  alignas(64) std::atomic<int> arrived{0};
  alignas(64) std::atomic<int> generation{0};
  std::atomic<int> count{1};

  // Every thread of the region calls this first, with the team's size (the same value from each,
  // so no thread waits on another's store, as it would behind an `omp single` here).
  void join(int team) { count.store(team, std::memory_order_relaxed); }

  void wait() {
    const int gen = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == count.load(std::memory_order_relaxed) - 1) {
      arrived.store(0, std::memory_order_relaxed);
      generation.fetch_add(1, std::memory_order_release);
    } else {
      for (int spins = 0; generation.load(std::memory_order_acquire) == gen; ++spins) {
        if (spins < kSpinsBeforeYield)
          cpu_relax();
        else
          std::this_thread::yield();
      }
    }
  }
};

}  // namespace moescope
