// How the CPU kernels split their work over threads: kvfleet's pool (thread_pool.cpp, a
// library of its own that each kernel library links), whose helpers poll while a step runs.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

extern "C" void kvfleet_parallel(int threads, void (*task)(void* context, int thread, int threads), void* context);

namespace parallel {

// share(thread, threads) on `threads` threads, the calling one among them.
template <class Share>
void run(int threads, const Share& share) {
  if (threads <= 1) {
    share(0, 1);
    return;
  }
  kvfleet_parallel(
      threads, [](void* context, int thread, int count) { (*static_cast<const Share*>(context))(thread, count); },
      const_cast<Share*>(&share));
}

// body(i) for i in [0, n), split into as many contiguous ranges as there are threads.
template <class Body>
void for_each(int threads, int64_t n, const Body& body) {
  run(static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(n, 1))), [&](int thread, int count) {
    const int64_t first = n * thread / count, last = n * (thread + 1) / count;
    for (int64_t i = first; i < last; ++i) body(i);
  });
}

// body(i) for i in [0, n), each thread claiming the next item until none is left: where the
// items are coarse (a run of a matmul's panels), a thread that starts late, its core taken
// for a moment, leaves its items to the others instead of holding up the region.
template <class Body>
void for_each_claimed(int threads, int64_t n, const Body& body) {
  std::atomic<int64_t> next{0};
  run(static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(n, 1))), [&](int, int) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) body(i);
  });
}

}  // namespace parallel
