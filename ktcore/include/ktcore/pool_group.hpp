// ktcore shared C++: a native backend's threads as one or more ThreadPools (kt_threadpool_count), run together.
//
// A phase's work is either one task list per pool (each pool its own experts' units, or its own slice of K) or n
// indices shared among the pools in proportion to their threads; either way every pool starts at once, pool 0
// (whose calling thread works too) last, and the phase ends when all have joined. The amx_bf16 and amx_int8
// schedulers build their task lists on top of this.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "ktcore/phase_clock.hpp"
#include "ktcore/thread_pool.hpp"

namespace ktcore {

// A task covers fewer units where its pool would otherwise get under this many tasks per thread (unit_tasks).
constexpr int64_t kTasksPerThread = 4;

class PoolGroup {
 public:
  // num_threads split as evenly as possible over num_pools pools (at least 1, at most num_threads); the calling
  // thread works in pool 0 only.
  PoolGroup(int num_threads, int num_pools) {
    num_pools = std::max(1, std::min(num_pools, num_threads));
    for (int p = 0; p < num_pools; ++p) {
      const int n = num_threads / num_pools + (p < num_threads % num_pools ? 1 : 0);
      pools_.emplace_back(new ThreadPool(n, p == 0));
    }
  }

  int num_threads() const {
    int n = 0;
    for (auto& p : pools_) n += p->num_threads();
    return n;
  }
  int num_pools() const { return static_cast<int>(pools_.size()); }
  ThreadPool& pool(int p) { return *pools_[p]; }
  // pool 0, for work that is not split by expert (routing, gathers, the combine)
  ThreadPool& first_pool() { return *pools_[0]; }
  // the wall time of the engine's phases, while switched on
  PhaseClock& phase_clock() { return clock_; }

  // Pool p's tasks: each of `rows` (one Task per row range of an expert) over the units [u0, u1), up to `group`
  // consecutive units a task (Task::unit, Task::units; the last of the range may take fewer), fewer where the pool
  // would get under kTasksPerThread tasks per thread.
  template <class Task>
  std::vector<Task> unit_tasks(int p, const std::vector<Task>& rows, int64_t u0, int64_t u1, int64_t group) {
    int64_t g = std::max<int64_t>(1, group);
    const int64_t want = kTasksPerThread * pool(p).num_threads();
    while (g > 1 && static_cast<int64_t>(rows.size()) * ((u1 - u0 + g - 1) / g) < want) --g;
    std::vector<Task> tasks;
    for (const Task& rt : rows)
      for (int64_t u = u0; u < u1; u += g) {
        Task t = rt;
        t.unit = static_cast<int32_t>(u);
        t.units = static_cast<int32_t>(std::min(g, u1 - u));
        tasks.push_back(t);
      }
    return tasks;
  }

  // Runs fn(tasks[p][i], p, tid, kr[p].first, kr[p].second) for every task of every pool p, all pools at once.
  template <class Task, class F>
  void run_task_lists(const std::vector<std::vector<Task>>& tasks, const std::vector<std::pair<int64_t, int64_t>>& kr,
                      const F& fn) {
    const int npools = num_pools();
    std::vector<int64_t> counts(npools);
    std::vector<ThreadPool::Fn> fns(npools);
    for (int p = 0; p < npools; ++p) {
      counts[p] = static_cast<int64_t>(tasks[p].size());
      fns[p] = [&, p](int64_t b, int64_t e, int tid) {
        for (int64_t i = b; i < e; ++i) fn(tasks[p][i], p, tid, kr[p].first, kr[p].second);
      };
    }
    dispatch(counts, fns);
  }

  // Runs fn(i, pool, tid) for every i in [0, n) over all pools at once, each pool a contiguous share of the
  // indices in proportion to its threads.
  void run_tasks(int64_t n, const std::function<void(int64_t, int pool, int tid)>& fn) {
    const int npools = num_pools(), total = num_threads();
    std::vector<int64_t> start(npools + 1, 0), counts(npools);
    std::vector<ThreadPool::Fn> fns(npools);
    int before = 0;
    for (int p = 0; p < npools; ++p) {
      before += pools_[p]->num_threads();
      start[p + 1] = n * before / total;
      counts[p] = start[p + 1] - start[p];
      fns[p] = [&, p](int64_t b, int64_t e, int tid) {
        for (int64_t i = b; i < e; ++i) fn(start[p] + i, p, tid);
      };
    }
    dispatch(counts, fns);
  }

 private:
  // Starts counts[p] items of fns[p] on every pool p (pool 0, whose caller works too, last) and waits for all;
  // rethrows the first failure.
  void dispatch(const std::vector<int64_t>& counts, const std::vector<ThreadPool::Fn>& fns) {
    const int npools = num_pools();
    for (int p = npools - 1; p >= 0; --p) pools_[p]->start(counts[p], fns[p]);
    std::exception_ptr err;
    for (int p = 0; p < npools; ++p) {
      try {
        pools_[p]->join();
      } catch (...) {
        if (!err) err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
  }

  std::vector<std::unique_ptr<ThreadPool>> pools_;
  PhaseClock clock_;
};

}  // namespace ktcore
