// ktcore shared C++: wall time per named phase of a native backend's calls, added up while switched on (its
// extension's Engine.phase_clock(True), read with Engine.phase_times()). It splits what one Python-level call
// does (the expert-LoRA prologue, the GEMM with its epilogue, the LoRA gradient phases) where only the whole call
// is visible from Python. Off, a span costs one relaxed load.
#pragma once

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace ktcore {

class PhaseClock {
 public:
  // Adds the wall time from its construction to its destruction to the phase `name` (a string literal).
  class Span {
   public:
    Span(PhaseClock* clock, const char* name) : clock_(clock), name_(name) {
      if (clock_) t0_ = std::chrono::steady_clock::now();
    }
    ~Span() {
      if (clock_) clock_->add(name_, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count());
    }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    PhaseClock* clock_;
    const char* name_;
    std::chrono::steady_clock::time_point t0_;
  };

  void set(bool on) { on_.store(on, std::memory_order_relaxed); }
  Span span(const char* name) { return Span(on_.load(std::memory_order_relaxed) ? this : nullptr, name); }

  // (phase, seconds, calls) since the last take, phases in the order first seen; starts over.
  std::vector<std::pair<std::string, std::pair<double, int64_t>>> take() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::pair<std::string, std::pair<double, int64_t>>> out;
    for (const Total& t : totals_) out.push_back({t.name, {t.seconds, t.calls}});
    totals_.clear();
    return out;
  }

 private:
  struct Total {
    const char* name;
    double seconds;
    int64_t calls;
  };

  void add(const char* name, double seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    for (Total& t : totals_)
      if (std::strcmp(t.name, name) == 0) {
        t.seconds += seconds;
        ++t.calls;
        return;
      }
    totals_.push_back({name, seconds, 1});
  }

  std::atomic<bool> on_{false};
  std::mutex mu_;
  std::vector<Total> totals_;
};

}  // namespace ktcore
