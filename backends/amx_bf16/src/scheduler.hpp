// The task scheduler of the amx_bf16 engine: its thread pools, the per-thread scratch, and run_split, which
// runs one phase of (expert, rows, output units) tasks over every pool at once.
// Baseline-compiled (no AMX or AVX-512 code here).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "kernels.hpp"
#include "ktcore/expert_lora.hpp"
#include "ktcore/pool_group.hpp"

namespace ktamx {

template <class T>
T* P(uintptr_t a) { return reinterpret_cast<T*>(a); }

inline int64_t rup(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

struct Task {
  int32_t e, unit, units;  // output units [unit, unit + units) of expert e (units > 1 only in backward)
  int64_t r0, r1;          // rows [r0, r1) of expert e's rows
  int64_t p0;              // row r0 in the tiled buffers (each expert's rows padded to a multiple of 16)
};

constexpr int64_t kRowChunk = 256;  // rows of one expert computed per inner step (C scratch 32 KB)
constexpr int64_t kCBlock = kRowChunk * 32;

class Scheduler : public ktcore::PoolGroup {
 public:
  using TaskFn = std::function<void(const Task&, int pool, int tid, int64_t k0, int64_t k1)>;

  Scheduler(int num_threads, int num_pools) : PoolGroup(num_threads, num_pools) {
    for (int p = 0; p < this->num_pools(); ++p) scratch_.emplace_back(pool(p).num_threads());
  }

  // Runs tasks (expert, rows, units) over all pools at once. With split_units the units are divided among the
  // pools (each pool its own slice of I, in groups of units_per_split_unit); otherwise every pool runs every
  // unit over its own slice [k0, k1) of ksplit blocks (partial sums, one output part per pool).
  // A task takes up to `group` consecutive units of its pool's units (the last one of a slice may take fewer);
  // fewer where the pool would get under kTasksPerThread tasks per thread. Rows: up to task_rows per task
  // (0: all of an expert's rows). poff (may be null): padded offsets of the tiled buffers, for Task::p0.
  void run_split(const int64_t* off, const int64_t* poff, int64_t E, int64_t nsplit, bool split_units,
                 const TaskFn& fn, int64_t units_per_split_unit = 1, int64_t ksplit = 0, int64_t task_rows = 0,
                 int64_t group = 1) {
    const int npools = num_pools();
    std::vector<Task> rows;  // (expert, row range) pairs, the same in every pool
    for (int64_t e = 0; e < E; ++e) {
      const int64_t m = off[e + 1] - off[e];
      const int64_t step = task_rows > 0 ? task_rows : m;
      for (int64_t r = 0; r < m; r += step)
        rows.push_back({static_cast<int32_t>(e), 0, 0, off[e] + r, off[e] + std::min(m, r + step),
                        (poff ? poff[e] : 0) + r});
    }
    std::vector<std::vector<Task>> tasks(npools);
    std::vector<std::pair<int64_t, int64_t>> kr(npools);
    for (int p = 0; p < npools; ++p) {
      int64_t u0 = 0, u1 = nsplit * (split_units ? units_per_split_unit : 1);
      if (split_units) {
        u0 = nsplit * p / npools * units_per_split_unit;
        u1 = nsplit * (p + 1) / npools * units_per_split_unit;
      } else {
        kr[p] = {ksplit * p / npools, ksplit * (p + 1) / npools};
      }
      tasks[p] = unit_tasks(p, rows, u0, u1, group);
    }
    run_task_lists(tasks, kr, fn);
  }

  // expert LoRA's fp32 scratch of this thread
  ktcore::lora::Scratch& lora_scratch(int pool, int tid) { return scratch_[pool][tid].lora; }

  // room for `count` C blocks of kCBlock floats (kRowChunk rows x 32), 64-byte aligned tile rows
  float* scratch_c(int pool, int tid, int64_t count = 1) {
    auto& c = scratch_[pool][tid].c;
    if (c.size() < static_cast<size_t>(count * kCBlock + 64)) c.resize(count * kCBlock + 64);
    float* base = c.data();
    return base + (16 - (reinterpret_cast<uintptr_t>(base) / 4) % 16) % 16;
  }
  // room for `blocks` 1 KiB blocks, 64-byte aligned; per thread, grows to the largest request and is kept
  uint16_t* scratch_blocks(int pool, int tid, int64_t blocks) {
    auto& s = scratch_[pool][tid].s;
    size_t need = static_cast<size_t>(blocks * kBlockElems + 32);
    if (s.size() < need) s.resize(need);
    uint16_t* base = s.data();
    return base + (32 - (reinterpret_cast<uintptr_t>(base) / 2) % 32) % 32;
  }

 private:
  struct Scratch {
    std::vector<float> c;
    std::vector<uint16_t> s;
    ktcore::lora::Scratch lora;
  };

  std::vector<std::vector<Scratch>> scratch_;
};

}  // namespace ktamx
