// Checks of ktcore/thread_pool.hpp, built and run by tests/test_thread_pool.py. Prints one line per failed
// check and exits 1 if any failed.
#include <atomic>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "ktcore/thread_pool.hpp"

static int failures = 0;
#define CHECK(cond, ...)                  \
  do {                                    \
    if (!(cond)) {                        \
      std::printf("FAIL: " __VA_ARGS__);  \
      std::printf("\n");                  \
      ++failures;                         \
    }                                     \
  } while (0)

int main() {
  for (int threads : {1, 3, 8}) {
    for (bool caller : {true, false}) {
      ktcore::ThreadPool pool(threads, caller);
      // parallel_for: every item exactly once, uneven tasks and all, over many rounds (wake-ups)
      for (int round = 0; round < 200; ++round) {
        const int64_t n = 1 + round * 7 % 97;
        std::vector<std::atomic<int>> seen(n);
        pool.parallel_for(n, [&](int64_t b, int64_t e, int tid) {
          CHECK(tid >= 0 && tid < threads, "tid %d of %d threads", tid, threads);
          for (int64_t i = b; i < e; ++i) seen[i].fetch_add(1);
        }, 1 + round % 3);
        for (int64_t i = 0; i < n; ++i) CHECK(seen[i].load() == 1, "item %lld ran %d times", (long long)i, seen[i].load());
      }
      // run_each: each thread once; phase 2 of any thread sees phase 1 of all threads (the barrier)
      for (int round = 0; round < 100; ++round) {
        std::vector<std::atomic<int>> ran(threads), phase1(threads);
        std::atomic<int> bad{0};
        ktcore::WorkSplit work(50, threads);
        std::vector<std::atomic<int>> items(50);
        pool.run_each([&](int tid) {
          ran[tid].fetch_add(1);
          work.run(tid, 1, true, [&](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) items[i].fetch_add(1); });
          phase1[tid].store(1);
          pool.barrier();
          for (int t = 0; t < threads; ++t) if (phase1[t].load() != 1) bad.fetch_add(1);
          pool.barrier();
        });
        for (int t = 0; t < threads; ++t) CHECK(ran[t].load() == 1, "run_each ran thread %d %d times", t, ran[t].load());
        for (int i = 0; i < 50; ++i) CHECK(items[i].load() == 1, "split item %d ran %d times", i, items[i].load());
        CHECK(bad.load() == 0, "a thread passed the barrier before all had arrived");
      }
      // a thread that throws before the barrier: no deadlock, the exception reaches the caller, the pool still works
      bool caught = false;
      try {
        pool.run_each([&](int tid) {
          if (tid == threads - 1) throw std::runtime_error("task failed");
          pool.barrier();
        });
      } catch (const std::runtime_error& e) {
        caught = std::string(e.what()) == "task failed";
      }
      CHECK(caught, "run_each did not rethrow the task's exception (%d threads)", threads);
      std::atomic<int> after{0};
      pool.parallel_for(10, [&](int64_t b, int64_t e, int) { after.fetch_add((int)(e - b)); });
      CHECK(after.load() == 10, "pool after a failure ran %d of 10 items", after.load());
    }
  }
  std::printf("%s\n", failures ? "thread pool checks FAILED" : "thread pool checks passed");
  return failures ? 1 : 0;
}
