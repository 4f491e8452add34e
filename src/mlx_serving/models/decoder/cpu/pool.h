// A thread pool kept alive across a decode step (and across steps): the caller and N - 1 workers
// run the tasks of one parallel region, each thread its own contiguous share first.
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
// - Claiming: a region's tasks are split into one contiguous segment per thread (the caller's
//   first, then each worker's); a thread runs its own segment front to back, then takes the
//   others' tasks from their backs. So on a quiet machine each thread walks one contiguous range
//   (one stream of weight columns for the hardware prefetcher; its claim word's cache line stays
//   in its core: claimed in turn from one shared counter, two threads' neighbouring tasks
//   interleaved and each claim moved that line between the cores, and a 1-row step's products
//   took ~1.4x the time of two contiguous halves, issue 39), while a descheduled thread holds at
//   most the one task it claimed: the others take the rest of its segment. A segment's word
//   holds the region's generation, its next task and its end, claimed with a compare-and-swap,
//   so a worker that wakes late can never claim a task of a later region with the previous
//   region's function. Each thread adds its count of tasks run to the done count once per region.
// - The caller spins on the completion count briefly (kPauses checks), then yields its core
//   between checks (sched_yield).
#pragma once

#include <algorithm>
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
  explicit Pool(int threads) : threads_(threads < 1 ? 1 : threads), segments_(threads_) {
    // Each worker starts from the wake count of its construction, not of its first run: a pool
    // destroyed before a worker got scheduled must still wake (and stop) it.
    const uint32_t seen = wake_.load(std::memory_order_acquire);
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, i, seen] { work(i, seen); });
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
    for (int64_t base = 0; base < count; base += kMaxTasks) {  // a word counts at most kMaxTasks
      const int64_t n = std::min(kMaxTasks, count - base);
      if (base == 0 && n == count) {
        region(n, fn);
      } else {
        const std::function<void(int64_t)> part = [&fn, base](int64_t i) { fn(base + i); };
        region(n, part);
      }
    }
  }

 private:
  // A segment's claim word: generation (24 bits) | next task (20) | end (20).
  static constexpr int kTaskBits = 20;
  static constexpr int64_t kMaxTasks = int64_t{1} << kTaskBits;
  static constexpr uint64_t kTaskMask = kMaxTasks - 1;
  static uint64_t word_of(uint64_t gen, int64_t next, int64_t end) {
    return (gen << (2 * kTaskBits)) | (static_cast<uint64_t>(next) << kTaskBits) | static_cast<uint64_t>(end);
  }
  static uint64_t gen_of(uint64_t w) { return w >> (2 * kTaskBits); }
  static int64_t next_of(uint64_t w) { return static_cast<int64_t>((w >> kTaskBits) & kTaskMask); }
  static int64_t end_of(uint64_t w) { return static_cast<int64_t>(w & kTaskMask); }

  struct alignas(64) Segment {
    std::atomic<uint64_t> word{0};
  };

  void region(int64_t count, const std::function<void(int64_t)>& fn) {
    fn_.store(&fn, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (gen_.load(std::memory_order_relaxed) + 1) & ((uint64_t{1} << (64 - 2 * kTaskBits)) - 1);
    for (int s = 0; s < threads_; ++s)
      segments_[s].word.store(word_of(gen, count * s / threads_, count * (s + 1) / threads_),
                              std::memory_order_relaxed);
    gen_.store(gen, std::memory_order_release);  // publishes fn_ and the segments
    wake();
    drain(0, gen);
    for (int spins = 0; done_.load(std::memory_order_acquire) < count; ++spins) pause_or_yield(spins);
  }

  // Run tasks of generation ``gen``: thread ``self``'s segment from its front, then the others'
  // from their backs, until none is left; then count them done.
  void drain(int self, uint64_t gen) {
    int64_t ran = 0;
    for (int j = 0; j < threads_; ++j) {
      std::atomic<uint64_t>& word = segments_[(self + j) % threads_].word;
      const bool own = j == 0;
      uint64_t w = word.load(std::memory_order_acquire);
      while (gen_of(w) == gen && next_of(w) < end_of(w)) {
        const uint64_t claimed = own ? w + (uint64_t{1} << kTaskBits) : w - 1;
        if (word.compare_exchange_weak(w, claimed, std::memory_order_acq_rel, std::memory_order_acquire)) {
          (*fn_.load(std::memory_order_relaxed))(own ? next_of(w) : end_of(w) - 1);
          ++ran;
          w = word.load(std::memory_order_acquire);
        }
      }
    }
    if (ran > 0) done_.fetch_add(ran, std::memory_order_release);
  }

  // A new region (or the end): the wake count changes, then sleepers are woken. The count
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

  void work(int self, uint32_t seen) {
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
      drain(self, gen_.load(std::memory_order_acquire));
    }
  }

  static constexpr int kPauses = 256;    // checks with a pause between (a few microseconds), then yield
  static constexpr int kChecks = 4096;   // checks in all before sleeping (~1 ms on an idle core)
  const int threads_;
  std::vector<Segment> segments_;
  std::vector<std::thread> workers_;
  alignas(64) std::atomic<uint64_t> gen_{0};
  std::atomic<const std::function<void(int64_t)>*> fn_{nullptr};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<uint32_t> wake_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::condition_variable asleep_;
};

}  // namespace mlx_serving
