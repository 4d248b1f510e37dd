// ktcore shared C++: a fork-join thread pool with work stealing (header only, no dependencies).
//
// parallel_for(n, fn) splits [0, n) into one contiguous chunk per thread (a WorkSplit). Each thread claims
// items of its own chunk from the front (atomic counter); when its chunk is used up it steals items from the
// other threads' chunks, so uneven tasks (experts with many or few tokens) still keep every core busy.
// run_each(body) runs body(tid) once on every thread at the same time: work in phases that meet at barrier()
// (each phase a WorkSplit of its own) pays one wake-up of the pool instead of one per phase.
// The calling thread takes part as thread 0 when the pool is built with caller_participates = true;
// otherwise all work runs on the pool's own threads (used when several pools run side by side).
#pragma once

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ktcore {

// [0, n) as one contiguous chunk per thread. run(tid, grain, fn) calls fn(begin, end) on items of tid's own
// chunk first, then on items stolen from the others' chunks (starting with the neighbour's), until none is left.
class WorkSplit {
 public:
  WorkSplit() = default;
  WorkSplit(int64_t n, int nthreads) { reset(n, nthreads); }

  void reset(int64_t n, int nthreads) {
    if ((int)slots_.size() != nthreads) slots_ = std::vector<Slot>(nthreads);
    const int64_t chunk = (n + nthreads - 1) / nthreads;
    for (int t = 0; t < nthreads; ++t) {
      const int64_t b = std::min<int64_t>(n, t * chunk);
      slots_[t].next.store(b, std::memory_order_relaxed);
      slots_[t].end = std::min<int64_t>(n, b + chunk);
    }
  }

  template <class F>
  void run(int tid, int64_t grain, bool steal, const F& fn) {
    const int n = steal ? (int)slots_.size() : 1;
    for (int v = 0; v < n; ++v) {
      Slot& s = slots_[(tid + v) % slots_.size()];
      for (;;) {
        const int64_t b = s.next.fetch_add(grain, std::memory_order_relaxed);
        if (b >= s.end) break;
        fn(b, std::min(b + grain, s.end));
      }
    }
  }

  // no item is handed out any more (after a failure)
  void cancel() {
    for (auto& s : slots_) s.next.store(s.end, std::memory_order_relaxed);
  }

 private:
  struct alignas(64) Slot {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  std::vector<Slot> slots_;
};

class ThreadPool {
 public:
  // fn(begin, end, thread_id): process items [begin, end)
  using Fn = std::function<void(int64_t, int64_t, int)>;

  explicit ThreadPool(int num_threads, bool caller_participates = true)
      : nthreads_(num_threads < 1 ? 1 : num_threads), caller_(caller_participates) {
    int first = caller_ ? 1 : 0;
    for (int t = first; t < nthreads_; ++t) workers_.emplace_back([this, t] { worker_loop(t); });
  }

  ~ThreadPool() {
    stop_.store(true, std::memory_order_relaxed);
    wake_workers();
    for (auto& w : workers_) w.join();
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return nthreads_; }

  // Run fn over [0, n) and wait. Exceptions from tasks are rethrown here (the first one).
  void parallel_for(int64_t n, const Fn& fn, int64_t grain = 1) {
    start(n, fn, grain);
    join();
  }

  // Run body(tid) once on each thread, tid < num_threads(), and wait; exceptions as in parallel_for. Inside,
  // every thread must make the same sequence of barrier() calls.
  void run_each(const std::function<void(int)>& body) {
    const Fn each = [&body](int64_t b, int64_t, int) { body((int)b); };
    start(nthreads_, each, 1, /*steal=*/false);
    join();
  }

  // Inside run_each: wait until every thread has arrived here. The threads are all running, so it spins
  // rather than sleeps. Once a thread has failed, it no longer waits (the call's results are discarded).
  void barrier() {
    const uint64_t gen = barrier_gen_.load(std::memory_order_acquire);
    if (barrier_arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == nthreads_) {
      barrier_arrived_.store(0, std::memory_order_relaxed);
      barrier_gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int i = 0; barrier_gen_.load(std::memory_order_acquire) == gen && !failed_.load(std::memory_order_acquire); ++i)
      if (i < 4096) cpu_relax(); else std::this_thread::yield();
  }

  // Start without waiting (the caller must call join()). With caller_participates the caller works here too.
  // steal = false: each thread runs only the items of its own chunk.
  void start(int64_t n, const Fn& fn, int64_t grain = 1, bool steal = true) {
    fn_ = &fn;
    grain_ = std::max<int64_t>(1, grain);
    steal_ = steal;
    error_ = nullptr;
    failed_.store(false, std::memory_order_relaxed);
    barrier_arrived_.store(0, std::memory_order_relaxed);
    split_.reset(n, nthreads_);
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_release);
    wake_workers();
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
  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  void run_worker(int tid) {
    try {
      split_.run(tid, grain_, steal_, [&](int64_t b, int64_t e) { (*fn_)(b, e, tid); });
    } catch (...) {
      std::lock_guard<std::mutex> lk(err_mu_);
      if (!error_) error_ = std::current_exception();
      split_.cancel();
      failed_.store(true, std::memory_order_release);
    }
  }

  // The workers sleep until generation_ moves on. On Linux generation_ is a futex word and one system call
  // wakes them all at once; with a condition variable they would wake and then take its mutex one by one,
  // each handing it to the next (a chain of wake-ups, slow on virtual machines).
  void wake_workers() {
#if defined(__linux__)
    generation_.fetch_add(1, std::memory_order_acq_rel);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#else
    {
      std::lock_guard<std::mutex> lk(mu_);
      generation_.fetch_add(1, std::memory_order_acq_rel);
    }
    cv_.notify_all();
#endif
  }

  uint32_t wait_for_work(uint32_t seen) {
#if defined(__linux__)
    while (generation_.load(std::memory_order_acquire) == seen)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
#else
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
#endif
    return generation_.load(std::memory_order_acquire);
  }

  void worker_loop(int tid) {
    uint32_t seen = 0;
    for (;;) {
      seen = wait_for_work(seen);
      if (stop_.load(std::memory_order_relaxed)) return;
      run_worker(tid);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lk(done_mu_);
        done_cv_.notify_all();
      }
    }
  }

  int nthreads_;
  bool caller_;
  WorkSplit split_;
  std::vector<std::thread> workers_;
  const Fn* fn_ = nullptr;
  int64_t grain_ = 1;
  bool steal_ = true;
  std::exception_ptr error_;
  std::mutex err_mu_;
  std::atomic<bool> failed_{false};
  std::atomic<int> barrier_arrived_{0};
  std::atomic<uint64_t> barrier_gen_{0};
  std::atomic<uint32_t> generation_{0};
  std::atomic<bool> stop_{false};
#if !defined(__linux__)
  std::mutex mu_;
  std::condition_variable cv_;
#endif
  std::atomic<int> pending_{0};
  std::mutex done_mu_;
  std::condition_variable done_cv_;
};

}  // namespace ktcore
