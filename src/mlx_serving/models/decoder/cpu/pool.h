// A thread pool kept alive across a decode step (and across steps): the caller and N - 1 workers
// run the tasks of one parallel region, claimed one at a time from a shared counter.
//
// - No fork/join per region: workers stay alive; between regions they spin briefly (the next region
//   of a decode step follows within microseconds), then keep checking while yielding their core,
//   then sleep on a condition variable, so an idle or oversubscribed machine is not burned by
//   spinning threads (OpenMP's active waiting collapsed decode under load: issue 39). Yielding
//   matters with more runnable threads than cores (the serving's own Python thread beside the
//   pool on 2 cores, or other processes): a thread spinning on a core that a descheduled pool
//   thread holding the region's work needs would stall the step for a whole time slice
//   (measured on 2 busy cores: the worker spent ~35% of the process's time spinning and ran ~10%
//   of the products).
// - Dynamic claiming: a task is claimed with a compare-and-swap on one 64-bit word (the region's
//   generation in the high half, the next task in the low half), so a descheduled worker holds at
//   most the one task it claimed, the others take the rest, and a worker that wakes late can never
//   claim a task of a later region with the previous region's function.
// - The caller spins on the completion count briefly (kPauses checks), then yields its core
//   between checks (sched_yield).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <sched.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define POOL_PAUSE() _mm_pause()
#else
#define POOL_PAUSE() ((void)0)
#endif

namespace mlx_serving {

class Pool {
 public:
  // ``threads``: the caller plus threads - 1 workers (at least 1).
  explicit Pool(int threads) : threads_(threads < 1 ? 1 : threads) {
    // Each worker starts from the wake count of its construction, not of its first run: a pool
    // destroyed before a worker got scheduled must still wake (and stop) it.
    const uint32_t seen = wake_.load(std::memory_order_acquire);
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, seen] { work(seen); });
  }
  ~Pool() {
    stop_.store(true);
    wake();
    for (auto& t : workers_) t.join();
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int threads() const { return threads_; }

  // Run fn(0), ..., fn(count - 1) over the pool (the caller included); returns when all have run.
  // One region at a time (the caller holds the decoder's lock).
  void run(int64_t count, const std::function<void(int64_t)>& fn) {
    if (count <= 0) return;
    if (threads_ == 1 || count == 1) {
      for (int64_t i = 0; i < count; ++i) fn(i);
      return;
    }
    fn_.store(&fn, std::memory_order_relaxed);
    count_.store(count, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (claim_.load(std::memory_order_relaxed) >> 32) + 1;
    claim_.store(gen << 32, std::memory_order_release);  // publishes fn_ and count_
    wake();
    drain(gen);
    for (int spins = 0; done_.load(std::memory_order_acquire) < count; ++spins) pause_or_yield(spins);
  }

 private:
  // Claim and run tasks of generation ``gen`` until none is left.
  void drain(uint64_t gen) {
    uint64_t word = claim_.load(std::memory_order_acquire);
    while (true) {
      if ((word >> 32) != gen) return;
      const int64_t i = static_cast<int64_t>(word & 0xffffffffu);
      if (i >= count_.load(std::memory_order_relaxed)) return;
      if (claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        (*fn_.load(std::memory_order_relaxed))(i);
        done_.fetch_add(1, std::memory_order_release);
        word = claim_.load(std::memory_order_acquire);
      }
    }
  }

  // A new region (or the end): the generation count changes, then sleepers are woken. The count
  // is changed before the (empty) critical section, so a worker testing it under the lock either
  // sees the new value or is already waiting when notify_all runs: no lost wake-up.
  void wake() {
    wake_.fetch_add(1, std::memory_order_release);
    { std::lock_guard<std::mutex> lock(mutex_); }
    asleep_.notify_all();
  }

  // One wait between checks: a pause for the first kPauses, then the core yielded (a descheduled
  // thread of the region, or another runnable thread, gets it; on an idle core it returns at once).
  static void pause_or_yield(int spins) {
    if (spins < kPauses) POOL_PAUSE();
    else sched_yield();
  }

  void work(uint32_t seen) {
    while (true) {
      uint32_t now = wake_.load(std::memory_order_acquire);
      for (int spins = 0; now == seen && spins < kChecks; ++spins) {
        pause_or_yield(spins);
        now = wake_.load(std::memory_order_acquire);
      }
      if (now == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        asleep_.wait(lock, [&] { return stop_.load() || wake_.load(std::memory_order_acquire) != seen; });
        now = wake_.load(std::memory_order_acquire);
      }
      seen = now;
      if (stop_.load()) return;
      drain(claim_.load(std::memory_order_acquire) >> 32);
    }
  }

  static constexpr int kPauses = 256;    // checks with a pause between (a few microseconds), then yield
  static constexpr int kChecks = 4096;   // checks in all before sleeping (~1 ms on an idle core)
  const int threads_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> claim_{0};
  std::atomic<uint32_t> wake_{0};
  std::mutex mutex_;
  std::condition_variable asleep_;
  std::atomic<int64_t> done_{0};
  std::atomic<bool> stop_{false};
  std::atomic<const std::function<void(int64_t)>*> fn_{nullptr};
  std::atomic<int64_t> count_{0};
};

}  // namespace mlx_serving
