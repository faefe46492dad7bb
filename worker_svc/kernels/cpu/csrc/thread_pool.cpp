// The helper threads that kvfleet's CPU kernels share (parallel.h), in place of OpenMP's.
//
// Why not OpenMP: kvfleet runs OpenMP with OMP_WAIT_POLICY=PASSIVE, because spin-waiting
// threads burned the cores that other threads and processes needed (worker_svc/kernels/cpu/threads.py).
// A sleeping thread then has to be woken for each parallel region, about 0.1-0.2 ms in a VM
// (the idle vCPU halts), and a decode step runs some 150 regions: matmuls, attention, norms.
// Here the helpers poll while a step runs (kvfleet_pool_steps), so a region starts as soon
// as it is dispatched, and sleep on a futex between steps, as OpenMP's passive threads do.
// The 64-request mixed batch (benchmarks/peer_vllm.py's, 4-bit, 2 threads) ran 1.18-1.29x
// faster than on OpenMP's threads, alternated on the same 2-core VM, and 1.2x faster again
// once helpers told a thread that wants their core from the machine's housekeeping (kWindow).
//
// One caller at a time: a region dispatched while another runs (a second thread calling a
// kernel) runs on its caller's thread alone.
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <thread>

namespace {

using Task = void (*)(void* context, int thread, int threads);

// Every kWindow a helper reads how long it waited for its core while another thread had
// it; over 1 / kContended of the window, that thread wants the core, and the helper sleeps
// between regions for kQuiet. Beside a busy loop on a 2-core VM, a 24-request batch took 42 s
// polling regardless, 32-33 yielding so (31-33 with OpenMP's sleeping threads alone). It once
// went quiet at any gap of 200 us in its polling instead; but most such gaps were the
// machine's housekeeping (a kworker, memory compaction, the host pausing the vCPU), 28 in a
// 47 s batch, and they kept the helpers asleep for more than half of the run.
constexpr std::chrono::milliseconds kWindow{100};
constexpr int kContended = 10;
constexpr std::chrono::milliseconds kQuiet{1000};
// The longest a helper polls for one region; a step's regions come much sooner than this.
constexpr std::chrono::milliseconds kMaxPoll{10};

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Nanoseconds the calling thread has spent ready to run while others had its core (the
// scheduler's count, in /proc/thread-self/schedstat); -1 where the kernel keeps none.
int64_t waited_for_core() {
  FILE* file = std::fopen("/proc/thread-self/schedstat", "r");
  if (file == nullptr) return -1;
  long long waited = -1;
  if (std::fscanf(file, "%*lld %lld", &waited) != 1) waited = -1;
  std::fclose(file);
  return waited;
}

// Whether a thread that had waited `before` and then `after` ns for its core, `window` apart,
// shares it with another that wants it. Without the scheduler's count, it is taken to: the
// helpers then sleep between regions, as OpenMP's threads do.
bool contended(int64_t before, int64_t after, std::chrono::nanoseconds window) {
  return before < 0 || after < 0 || (after - before) * kContended > window.count();
}

class Pool {
 public:
  void run(int threads, Task task, void* context) {
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (threads <= 1 || !lock.owns_lock()) {
      task(context, 0, 1);
      return;
    }
    grow(threads - 1);
    task_ = task, context_ = context, threads_ = threads;
    // Every helper answers every region, those it leaves out too: none can then lag a region
    // behind and read the next one's task as its own.
    pending_.store(helpers_, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);  // publishes the task
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&generation_);
    task(context, 0, threads);
    // The helpers' shares are as large as this thread's: they finish within microseconds of it.
    for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
      if (spins < 4096)
        _mm_pause();
      else
        sched_yield();
    }
  }

  void count_steps(int change) { steps_.fetch_add(change, std::memory_order_relaxed); }

  // After fork() the child has none of the parent's threads: it starts again without helpers.
  void forget_helpers() {
    new (&busy_) std::mutex();
    helpers_ = 0;
    sleepers_.store(0);
  }

 private:
  void grow(int helpers) {
    // A new helper starts from the region before the one it is made for.
    const uint32_t seen = generation_.load(std::memory_order_relaxed);
    for (; helpers_ < helpers; ++helpers_)
      std::thread([this, index = helpers_ + 1, seen] { serve(index, seen); }).detach();
  }

  void serve(int index, uint32_t seen) {
    using Clock = std::chrono::steady_clock;
    Clock::time_point quiet_until, window_start = Clock::now();
    int64_t waited = waited_for_core();
    for (;;) {
      uint32_t now = generation_.load(std::memory_order_acquire);
      const Clock::time_point idle_since = Clock::now();
      if (idle_since - window_start > kWindow) {
        const int64_t waited_now = waited_for_core();
        if (contended(waited, waited_now, idle_since - window_start)) quiet_until = idle_since + kQuiet;
        waited = waited_now, window_start = idle_since;
      }
      const bool quiet = idle_since < quiet_until;
      for (int polls = 1; now == seen; ++polls) {
        bool poll = !quiet && steps_.load(std::memory_order_relaxed) > 0;
        // 64 pauses take a few microseconds; a step that stalls this long waits asleep
        if (poll && polls % 64 == 0 && Clock::now() - idle_since > kMaxPoll) poll = false;
        if (poll) {
          _mm_pause();
        } else {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          if (generation_.load(std::memory_order_seq_cst) == seen) futex_wait(&generation_, seen);
          sleepers_.fetch_sub(1, std::memory_order_relaxed);
        }
        now = generation_.load(std::memory_order_acquire);
      }
      seen = now;
      if (index < threads_) task_(context_, index, threads_);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::mutex busy_;
  int helpers_ = 0;
  Task task_ = nullptr;
  void* context_ = nullptr;
  int threads_ = 1;
  std::atomic<uint32_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> steps_{0};  // running now, in this process (one per engine)
};

// Never destroyed: helpers may still be waiting on it while the process exits.
Pool* const pool = [] {
  Pool* created = new Pool();
  pthread_atfork(nullptr, nullptr, [] { pool->forget_helpers(); });
  return created;
}();

}  // namespace

// task(context, t, threads) for t = 0 .. threads - 1, t = 0 on the calling thread; returns when all have.
extern "C" void kvfleet_parallel(int threads, Task task, void* context) { pool->run(threads, task, context); }

// A step begins (+1) or ends (-1): while any runs, idle helpers poll for the next region
// instead of sleeping, and one engine's step ending leaves another's polled.
extern "C" void kvfleet_pool_steps(int change) { pool->count_steps(change); }
