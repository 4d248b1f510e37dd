// The task scheduler of the amx_int8 engine: its thread pools, the per-thread scratch, and run_split, which runs
// one phase of (expert, rows, output unit) tasks over every pool at once. Baseline-compiled.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "kernels.hpp"
#include "ktcore/expert_lora.hpp"
#include "ktcore/pool_group.hpp"

namespace ktint8 {

template <class T>
T* P(uintptr_t a) { return reinterpret_cast<T*>(a); }

inline int64_t rup(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

struct Task {
  int32_t e, unit, units;  // output units [unit, unit + units) of expert e (units > 1 only in backward)
  int64_t r0, r1;          // rows [r0, r1) of expert e's rows
  int64_t p0;              // row r0 in the quantised buffers (each expert's rows padded to a multiple of 16)
};

constexpr int64_t kRowChunk = 256;  // rows of one expert per inner step (C scratch 32 KB)

class Scheduler : public ktcore::PoolGroup {
 public:
  using TaskFn = std::function<void(const Task&, int pool, int tid, int64_t k0, int64_t k1)>;

  Scheduler(int num_threads, int num_pools) : PoolGroup(num_threads, num_pools) {
    for (int p = 0; p < this->num_pools(); ++p) scratch_.emplace_back(pool(p).num_threads());
  }

  // Runs the tasks (expert, up to task_rows rows, units) over all pools at once. split_units: the units [0, units)
  // are divided among the pools; otherwise every pool runs every unit over its own slice [k0, k1) of ksplit
  // K-blocks (partial sums, one output part per pool). A task takes up to `group` consecutive units of its pool's
  // (unit_tasks).
  void run_split(const int64_t* off, const int64_t* poff, int64_t E, int64_t units, bool split_units, int64_t ksplit,
                 int64_t task_rows, const TaskFn& fn, int64_t group = 1) {
    const int npools = num_pools();
    std::vector<Task> rows;  // (expert, row range) pairs, the same in every pool
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = off[e]; r < off[e + 1]; r += task_rows)
        rows.push_back({static_cast<int32_t>(e), 0, 0, r, std::min(off[e + 1], r + task_rows), poff[e] + r - off[e]});
    std::vector<std::vector<Task>> tasks(npools);
    std::vector<std::pair<int64_t, int64_t>> kr(npools);
    for (int p = 0; p < npools; ++p) {
      const int64_t u0 = split_units ? units * p / npools : 0, u1 = split_units ? units * (p + 1) / npools : units;
      kr[p] = split_units ? std::make_pair<int64_t, int64_t>(0, 0)
                          : std::make_pair(ksplit * p / npools, ksplit * (p + 1) / npools);
      tasks[p] = unit_tasks(p, rows, u0, u1, group);
    }
    run_task_lists(tasks, kr, fn);
  }

  // This thread's scratch: int32 and fp32 C blocks (kRowChunk rows x 32, 64-byte aligned), transposed weight
  // blocks, a row of floats, and expert LoRA's.
  int32_t* scratch_ci(int pool, int tid) { return aligned(scratch_[pool][tid].ci, kRowChunk * 32); }
  float* scratch_cf(int pool, int tid) { return aligned(scratch_[pool][tid].cf, kRowChunk * 32); }
  int8_t* scratch_blocks(int pool, int tid, int64_t blocks) {
    return aligned(scratch_[pool][tid].blocks, blocks * kBlockBytes);
  }
  float* scratch_row(int pool, int tid, int64_t n) { return aligned(scratch_[pool][tid].row, n); }
  ktcore::lora::Scratch& lora_scratch(int pool, int tid) { return scratch_[pool][tid].lora; }

 private:
  struct Scratch {
    std::vector<int32_t> ci;
    std::vector<float> cf, row;
    std::vector<int8_t> blocks;
    ktcore::lora::Scratch lora;
  };

  // n elements starting at a 64-byte boundary of v (grown to fit, kept)
  template <class T>
  static T* aligned(std::vector<T>& v, int64_t n) {
    const size_t need = static_cast<size_t>(n) + 64 / sizeof(T);
    if (v.size() < need) v.resize(need);
    const uintptr_t a = reinterpret_cast<uintptr_t>(v.data());
    return reinterpret_cast<T*>((a + 63) / 64 * 64);
  }

  std::vector<std::vector<Scratch>> scratch_;
};

}  // namespace ktint8
