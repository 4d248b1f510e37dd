// ktcore shared C++: a fork-join thread pool with work stealing (header only, no dependencies).
//
// parallel_for(n, fn) splits [0, n) into one contiguous chunk per thread. Each thread claims items of its
// own chunk from the front (atomic counter); when its chunk is used up it steals items from the other
// threads' chunks, so uneven tasks (experts with many or few tokens) still keep every core busy.
// The calling thread takes part as thread 0 when the pool is built with caller_participates = true;
// otherwise all work runs on the pool's own threads (used when several pools run side by side).
//
// Idle workers spin for spin_us microseconds (KTCORE_POOL_SPIN_US, default 100) before they sleep on the
// condition variable: the phases of one MoE layer follow each other within microseconds, and waking a sleeping
// thread costs a futex call and a reschedule per worker (tens of microseconds in a VM, on the critical path
// because a call waits for every worker).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ktcore {

class ThreadPool {
 public:
  // fn(begin, end, thread_id): process items [begin, end)
  using Fn = std::function<void(int64_t, int64_t, int)>;

  explicit ThreadPool(int num_threads, bool caller_participates = true, int spin_us = default_spin_us())
      : nthreads_(num_threads < 1 ? 1 : num_threads), caller_(caller_participates), spin_(spin_us), slots_(nthreads_) {
    int first = caller_ ? 1 : 0;
    for (int t = first; t < nthreads_; ++t) workers_.emplace_back([this, t] { worker_loop(t); });
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_.store(true, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return nthreads_; }

  static int default_spin_us() {
    const char* v = std::getenv("KTCORE_POOL_SPIN_US");
    return v && *v ? std::max(0, std::atoi(v)) : 100;
  }

  // Run fn over [0, n) and wait. Exceptions from tasks are rethrown here (the first one).
  void parallel_for(int64_t n, const Fn& fn, int64_t grain = 1) {
    start(n, fn, grain);
    join();
  }

  // Start without waiting (the caller must call join()). With caller_participates the caller works here too.
  void start(int64_t n, const Fn& fn, int64_t grain = 1) {
    if (grain < 1) grain = 1;
    fn_ = &fn;
    grain_ = grain;
    error_ = nullptr;
    int64_t chunk = (n + nthreads_ - 1) / nthreads_;
    for (int t = 0; t < nthreads_; ++t) {
      int64_t b = std::min<int64_t>(n, t * chunk), e = std::min<int64_t>(n, b + chunk);
      slots_[t].next.store(b, std::memory_order_relaxed);
      slots_[t].end = e;
    }
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_release);
    {
      std::lock_guard<std::mutex> lk(mu_);
      generation_.fetch_add(1, std::memory_order_release);  // publishes fn_, grain_ and the slots
    }
    cv_.notify_all();
    if (caller_) run_worker(0);
  }

  void join() {
    // short spin, then sleep until all workers report done
    for (int i = 0; i < 20000 && pending_.load(std::memory_order_acquire) > 0; ++i) std::this_thread::yield();
    if (pending_.load(std::memory_order_acquire) > 0) {
      std::unique_lock<std::mutex> lk(done_mu_);
      done_cv_.wait(lk, [this] { return pending_.load(std::memory_order_acquire) == 0; });
    }
    fn_ = nullptr;
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

 private:
  struct alignas(64) Slot {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };

  void run_worker(int tid) {
    try {
      // own chunk first, then steal from the others, starting with the neighbour
      for (int v = 0; v < nthreads_; ++v) {
        Slot& s = slots_[(tid + v) % nthreads_];
        for (;;) {
          int64_t b = s.next.fetch_add(grain_, std::memory_order_relaxed);
          if (b >= s.end) break;
          (*fn_)(b, std::min(b + grain_, s.end), tid);
        }
      }
    } catch (...) {
      std::lock_guard<std::mutex> lk(err_mu_);
      if (!error_) error_ = std::current_exception();
      for (auto& s : slots_) s.next.store(s.end, std::memory_order_relaxed);  // cancel the rest
    }
  }

  // true when a new generation started within the spin time
  bool spin_for_work(uint64_t seen) const {
    if (spin_ <= 0) return false;
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_);
    for (int i = 1;; ++i) {
      if (generation_.load(std::memory_order_acquire) != seen) return true;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      if (i % 64 == 0 && std::chrono::steady_clock::now() > until) return false;
    }
  }

  void worker_loop(int tid) {
    uint64_t seen = 0;
    for (;;) {
      if (!spin_for_work(seen)) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_relaxed)) return;  // written before the generation it ends
      run_worker(tid);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lk(done_mu_);
        done_cv_.notify_all();
      }
    }
  }

  int nthreads_;
  bool caller_;
  int spin_;  // microseconds
  std::vector<Slot> slots_;
  std::vector<std::thread> workers_;
  const Fn* fn_ = nullptr;
  int64_t grain_ = 1;
  std::exception_ptr error_;
  std::mutex err_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> pending_{0};
  std::mutex done_mu_;
  std::condition_variable done_cv_;
};

}  // namespace ktcore
