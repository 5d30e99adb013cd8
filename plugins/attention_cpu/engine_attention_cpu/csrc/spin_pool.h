// A small thread pool for kernels called many times per decode step: its workers spin for a short while after each
// job (the first 50 us without a system call, then yielding the core to any other runnable thread), so the next
// product of the step starts without a wake up, then sleep on a condition variable. OpenMP with
// OMP_WAIT_POLICY=PASSIVE (engine.thread_policy) puts its threads to sleep after every parallel region: 30-60 us to
// wake them, paid by each of a decode step's products.
//
// Joining a job is optional: a job's work is claimed piece by piece by whichever threads take part, and the caller
// waits only for the workers that joined before it finished. A worker that has no core at that moment (another
// process, or OpenMP threads spinning after a torch operation in a script that imported torch before engine) is
// never waited for: the caller runs the job alone instead of stalling for a scheduler tick per product.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <x86intrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace engine_pool {

// How many times this process has been forked into a child, counted in the child (pthread_atfork): a pool built
// before the last fork has no threads in this process. Reading it costs a load, where getpid() is a system call
// (about a microsecond in a virtual machine, paid by each of a decode step's few hundred kernel calls: 4% of a
// SmolLM2 step at batch 1 on a 2-core AMD EPYC).
inline uint64_t fork_count() {
  static std::atomic<uint64_t> forks{0};
  static const bool counting = [] { return pthread_atfork(nullptr, nullptr, [] { forks.fetch_add(1); }) == 0; }();
  (void)counting;
  return forks.load(std::memory_order_relaxed);
}

// Waits about 100 ns, whatever a PAUSE lasts on this CPU (a few cycles on Zen 1, about 65 on Zen 2 and later, about
// 140 on recent Intel cores): an idle worker then polls the pool's state at about the same rate everywhere, not
// hundreds of times more often on the CPUs whose PAUSE is short.
inline void pause_briefly() {
  const uint64_t until = __rdtsc() + 256;
  do _mm_pause();
  while (__rdtsc() < until);
}

class SpinPool {
 public:
  explicit SpinPool(int threads) : threads_(threads), born_(fork_count()) {
    for (int t = 1; t < threads_; ++t) workers_.emplace_back([this] { work(); });
  }
  ~SpinPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
      state_.fetch_add(kGeneration);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int threads() const { return threads_; }
  // built in this process (not inherited across a fork)
  bool ours() const { return born_ == fork_count(); }

  // job() on the caller and on each worker that joins in time (at most `helpers` of them); job claims its own work
  // (every participant runs it until no work is left), so the result never depends on who took part. Returns when
  // the caller's job and every joined worker's are done; false (nothing run) when another caller holds the pool.
  bool run(const std::function<void()>& job, int helpers) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    job_ = &job;
    finished_.store(0, std::memory_order_relaxed);
    uint64_t generation;
    {
      std::lock_guard<std::mutex> lock(mutex_);  // a sleeper cannot miss the new generation
      generation = (state_.load(std::memory_order_relaxed) & ~kLow) + kGeneration;
      state_.store(generation | static_cast<uint64_t>(std::min(helpers, threads_ - 1)) << kSeatShift,
                   std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    job();
    // no worker joins from now on; wait for those that did
    const uint64_t closed = state_.fetch_or(kClosed, std::memory_order_acq_rel);
    const uint64_t joined = closed & kJoined;
    for (int spins = 0; finished_.load(std::memory_order_acquire) < joined;) {
      if (++spins % 64 == 0) sched_yield();  // a joined worker sharing this core gets it
      else _mm_pause();
    }
    return true;
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(2000);
  // An idle worker spins this long before it starts yielding its core: a decode step's jobs follow each other within
  // microseconds, and a job posted while the worker is inside sched_yield (a system call, about a microsecond in a
  // virtual machine) waited for it. A 2-core AMD EPYC (AVX-512), SmolLM2 Q4_1 at batch 1, yields alternated in one
  // process (8-10 runs each): yielding every 64 spins from the start 221.9 / 231.6 / 245.4 tok/s, never 230.4 /
  // 234.7 / 251.0 (+1.3-3.8%); the worker had spent 8% of a step in the scheduler (perf).
  static constexpr auto kYieldAfter = std::chrono::microseconds(50);
  // state_: generation (upper bits) | closed | seats offered | workers joined
  static constexpr uint64_t kJoined = 0xFFFF, kSeatShift = 16, kSeats = 0xFFFFull << kSeatShift,
                            kClosed = 1ull << 32, kLow = (1ull << 33) - 1, kGeneration = 1ull << 33;

  // join the job of `generation` if it is still open and has a seat
  bool join(uint64_t generation) {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      if ((s & ~kLow) != generation || (s & kClosed) || (s & kJoined) >= ((s & kSeats) >> kSeatShift)) return false;
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) return true;
    }
  }

  void work() {
    // the generation the pool was built with (0), not the one this thread first reads: a thread that starts late (a
    // busy machine) after a job or after the destructor must still see that generation change, or it would sleep
    // through the destructor's wake up and its join would never return
    uint64_t seen = 0;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      uint64_t current;
      int spins = 0;
      while ((current = state_.load(std::memory_order_acquire) & ~kLow) == seen) {
        if (++spins % 64 == 0) {
          const auto waited = std::chrono::steady_clock::now() - start;
          if (waited > kYieldAfter) sched_yield();  // a busy machine gets the core back
          if (waited > kSpin) break;
        } else {
          pause_briefly();
        }
      }
      if (current == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return stop_.load() || (state_.load() & ~kLow) != seen; });
        sleepers_.fetch_sub(1);
        current = state_.load() & ~kLow;
      }
      seen = current;
      if (stop_) return;
      if (!join(current)) continue;
      (*job_)();
      finished_.fetch_add(1, std::memory_order_release);
    }
  }

  const int threads_;
  const uint64_t born_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> state_{0};
  std::atomic<uint64_t> finished_{0};
  std::atomic<int> sleepers_{0};
  const std::function<void()>* job_ = nullptr;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<bool> stop_{false};
  std::mutex run_mutex_;
};

// The guard of pool()'s instance. A fork waits until no thread holds it, and the child starts with it free
// (pthread_atfork): a child forked while another thread was inside pool() (rebuilding the pool takes a thread's
// start or join) had inherited it locked, and its first kernel waited forever (15 of 40 forks in
// tests/test_cpu_spin_pool.py's check, before).
inline std::mutex& pool_guard() {
  static std::mutex guard;
  static const bool released_across_forks = [] {
    const auto release = [] { pool_guard().unlock(); };
    return pthread_atfork([] { pool_guard().lock(); }, release, release) == 0;
  }();
  (void)released_across_forks;
  return guard;
}

// The process's pool, sized to torch's thread count (rebuilt when that changes, or in a forked child, which has
// none of its parent's threads).
inline SpinPool& pool() {
  static std::unique_ptr<SpinPool> instance;
  std::lock_guard<std::mutex> lock(pool_guard());
  const int threads = std::max(1, at::get_num_threads());
  const bool inherited = instance && !instance->ours();
  if (inherited) instance.release();  // built before a fork: its threads do not exist here
  if (!instance || instance->threads() != threads) instance = std::make_unique<SpinPool>(threads);
  return *instance;
}

// body() on up to `threads` threads (the caller included), each claiming its own work (an atomic counter of
// items): for kernels that split work themselves. Inline when threads <= 1 or the pool is taken.
template <class F>
void run_shared(int64_t threads, const F& body) {
  SpinPool& p = pool();
  threads = std::min<int64_t>(threads, p.threads());
  if (threads <= 1) {
    body();
    return;
  }
  const std::function<void()> job = [&] { body(); };
  if (!p.run(job, static_cast<int>(threads - 1))) body();
}

// body(begin, end) over [0, n): a few `align`-aligned chunks per thread, claimed in order by whichever thread is
// free (inline when n is small). Every element is computed by exactly one call, whoever makes it.
template <class F>
void parallel_range(int64_t n, int64_t min_per_thread, const F& body, int64_t align = 1) {
  const int64_t threads =
      std::min<int64_t>(pool().threads(), std::max<int64_t>(1, n / std::max<int64_t>(1, min_per_thread)));
  if (threads <= 1) {
    body(0, n);
    return;
  }
  constexpr int64_t kChunksPerThread = 4;
  const int64_t chunks = threads * kChunksPerThread;
  const int64_t chunk = std::max<int64_t>(1, ((n + chunks - 1) / chunks + align - 1) / align) * align;
  std::atomic<int64_t> next{0};
  run_shared(threads, [&] {
    for (int64_t begin = next.fetch_add(chunk); begin < n; begin = next.fetch_add(chunk))
      body(begin, std::min(n, begin + chunk));
  });
}

// body(begin, end, stream_end, continued) over [0, n) for kernels that stream their data from memory: one contiguous
// range per thread, which the thread that takes it walks forward in pieces (its reads are one stream, which its
// prefetches can run ahead in up to `stream_end`, the end of what is still its own; `continued`: this piece follows
// the one the same thread just finished, so its start was asked for already); a thread done with its range takes
// pieces from the back of another's, so a worker that joins late or never costs the caller only what the worker did
// not take. Every element is computed by exactly one call, whoever makes it.
//
// Measured against parallel_range's four chunks per thread (a 2-core AMD EPYC, a Q4_1 576 x 576 product on one row,
// the weight read from memory): 10.0 against 13.5 us; each chunk had started its stream anew.
template <class F>
void parallel_stream(int64_t n, int64_t min_per_thread, const F& body, int64_t align = 1) {
  const int64_t threads =
      std::min<int64_t>(pool().threads(), std::max<int64_t>(1, n / std::max<int64_t>(1, min_per_thread)));
  if (threads <= 1) {
    body(0, n, n, false);
    return;
  }
  constexpr int64_t kPiecesPerRange = 8;
  const int64_t units = (n + align - 1) / align;  // in whole `align`-sized units, the last one maybe shorter
  // per range: front (next unit its owner takes) in the high half, back (one past the last unit left) in the low
  std::vector<std::atomic<uint64_t>> ranges(threads);
  std::vector<int64_t> piece(threads);
  for (int64_t t = 0; t < threads; ++t) {
    const uint64_t front = units * t / threads, back = units * (t + 1) / threads;
    ranges[t].store(front << 32 | back, std::memory_order_relaxed);
    piece[t] = std::max<int64_t>(1, (back - front + kPiecesPerRange - 1) / kPiecesPerRange);
  }
  auto elements = [&](uint64_t unit) { return std::min<int64_t>(n, static_cast<int64_t>(unit) * align); };
  std::atomic<int64_t> next_owner{0};
  run_shared(threads, [&] {
    const int64_t own = next_owner.fetch_add(1);
    if (own < threads) {  // forward through its own range
      bool continued = false;
      for (uint64_t s = ranges[own].load(std::memory_order_acquire);;) {
        const uint64_t front = s >> 32, back = s & 0xFFFFFFFFull;
        if (front >= back) break;
        const uint64_t end = std::min<uint64_t>(back, front + piece[own]);
        if (ranges[own].compare_exchange_weak(s, end << 32 | back, std::memory_order_acq_rel)) {
          body(elements(front), elements(end), elements(back), continued);
          continued = true;
        }
      }
    }
    for (int64_t other = 0; other < threads; ++other) {  // then the backs of the others'
      if (other == own) continue;
      for (uint64_t s = ranges[other].load(std::memory_order_acquire);;) {
        const uint64_t front = s >> 32, back = s & 0xFFFFFFFFull;
        if (front >= back) break;
        const uint64_t begin = back - std::min<uint64_t>(back - front, piece[other]);
        if (ranges[other].compare_exchange_weak(s, front << 32 | begin, std::memory_order_acq_rel))
          body(elements(begin), elements(back), elements(back), false);
      }
    }
  });
}

}  // namespace engine_pool
