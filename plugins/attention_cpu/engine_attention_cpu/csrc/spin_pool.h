// A small thread pool for kernels called many times per decode step: its workers spin (yielding the core to any
// other runnable thread) for a short while after each job, so the next product of the step starts without a wake
// up, then sleep on a condition variable. OpenMP with OMP_WAIT_POLICY=PASSIVE (engine.thread_policy) puts its
// threads to sleep after every parallel region: 30-60 us to wake them, paid by each of a decode step's products.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace engine_pool {

class SpinPool {
 public:
  explicit SpinPool(int threads) : threads_(threads), owner_(getpid()) {
    for (int t = 1; t < threads_; ++t) workers_.emplace_back([this, t] { work(t); });
  }
  ~SpinPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int threads() const { return threads_; }
  pid_t owner() const { return owner_; }

  // job(thread, threads) on every thread of the pool, the caller being thread 0; returns when all are done.
  // false (and nothing run) when another caller holds the pool: that caller runs its job alone instead
  bool run(const std::function<void(int, int)>& job) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    job_ = &job;
    remaining_.store(threads_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);  // a sleeper cannot miss the new generation
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    job(0, threads_);
    while (remaining_.load(std::memory_order_acquire) > 0) _mm_pause();
    return true;
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(2000);

  void work(int thread) {
    uint64_t seen = 0;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      uint64_t current;
      int spins = 0;
      while ((current = generation_.load(std::memory_order_acquire)) == seen) {
        if (++spins % 64 == 0) {
          sched_yield();  // a busy machine gets the core back at once
          if (std::chrono::steady_clock::now() - start > kSpin) break;
        } else {
          _mm_pause();
        }
      }
      if (current == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        sleepers_.fetch_sub(1);
        current = generation_.load();
      }
      seen = current;
      if (stop_) return;
      (*job_)(thread, threads_);
      remaining_.fetch_sub(1, std::memory_order_release);
    }
  }

  const int threads_;
  const pid_t owner_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<int> sleepers_{0};
  const std::function<void(int, int)>* job_ = nullptr;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<bool> stop_{false};
  std::mutex run_mutex_;
};

// The process's pool, sized to torch's thread count (rebuilt when that changes, or in a forked child, which has
// none of its parent's threads).
inline SpinPool& pool() {
  static std::unique_ptr<SpinPool> instance;
  static std::mutex guard;
  std::lock_guard<std::mutex> lock(guard);
  const int threads = std::max(1, at::get_num_threads());
  if (!instance || instance->threads() != threads || instance->owner() != getpid()) {
    if (instance && instance->owner() != getpid()) instance.release();  // its threads do not exist here
    instance = std::make_unique<SpinPool>(threads);
  }
  return *instance;
}

// body(begin, end) over [0, n) split into one contiguous range per thread (inline when n is small).
template <class F>
void parallel_range(int64_t n, int64_t min_per_thread, const F& body, int64_t align = 1) {
  SpinPool& p = pool();
  const int64_t threads = std::min<int64_t>(p.threads(), std::max<int64_t>(1, n / std::max<int64_t>(1, min_per_thread)));
  if (threads <= 1) {
    body(0, n);
    return;
  }
  const std::function<void(int, int)> job = [&](int thread, int) {
    if (thread >= threads) return;
    const int64_t chunk = ((n + threads - 1) / threads + align - 1) / align * align;
    const int64_t begin = std::min<int64_t>(n, thread * chunk), end = std::min<int64_t>(n, begin + chunk);
    if (begin < end) body(begin, end);
  };
  if (!p.run(job)) body(0, n);
}

}  // namespace engine_pool
