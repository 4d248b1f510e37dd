// ktcore shared C++: a fork-join thread pool with work stealing (header only, no dependencies).
//
// parallel_for(n, fn) splits [0, n) into one contiguous chunk per thread. Each thread claims items of its
// own chunk from the front (atomic counter); when its chunk is used up it steals items from the other
// threads' chunks, so uneven tasks (experts with many or few tokens) still keep every core busy.
// The calling thread takes part as thread 0 when the pool is built with caller_participates = true;
// otherwise all work runs on the pool's own threads (used when several pools run side by side).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
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

  explicit ThreadPool(int num_threads, bool caller_participates = true)
      : nthreads_(num_threads < 1 ? 1 : num_threads), caller_(caller_participates), slots_(nthreads_) {
    int first = caller_ ? 1 : 0;
    for (int t = first; t < nthreads_; ++t) workers_.emplace_back([this, t] { worker_loop(t); });
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
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
      ++generation_;
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

  void worker_loop(int tid) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
      }
      run_worker(tid);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lk(done_mu_);
        done_cv_.notify_all();
      }
    }
  }

  int nthreads_;
  bool caller_;
  std::vector<Slot> slots_;
  std::vector<std::thread> workers_;
  const Fn* fn_ = nullptr;
  int64_t grain_ = 1;
  std::exception_ptr error_;
  std::mutex err_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::atomic<int> pending_{0};
  std::mutex done_mu_;
  std::condition_variable done_cv_;
};

}  // namespace ktcore
