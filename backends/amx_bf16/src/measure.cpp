// ktcore_amx_bf16._measure: the yardsticks the benchmarks and `ktcore doctor` divide by (DRAM streaming read
// rate, the AMX BF16 tile-only peak) and a gemm_block micro-benchmark. The backend never imports this module.
// Baseline-compiled; the AVX-512 / AMX loops (measure_amx.cpp) run only after amx_ready() said yes.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.hpp"
#include "ktcore/thread_pool.hpp"
#include "measure.hpp"
#include "select.hpp"

namespace py = pybind11;

namespace ktamx {
namespace {

double read_sum_portable(const void* p, int64_t nbytes) {
  const uint64_t* q = static_cast<const uint64_t*>(p);
  uint64_t s = 0;
  for (int64_t i = 0; i < nbytes / 8; ++i) s += q[i];
  return static_cast<double>(s & 0xFF);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Measurements over every thread of one pool, with the kernel table named by `kernels` ("amx" or "portable").
class Meter {
 public:
  Meter(int num_threads, const std::string& kernels)
      : K_(kernels_for(kernels)), pool_(num_threads > 0 ? num_threads : default_threads()),
        read_sum_(std::string(K_->name) == "amx" ? read_sum_avx512 : read_sum_portable) {}

  int num_threads() const { return pool_.num_threads(); }
  std::string kernels() const { return K_->name; }

  // Seconds for every thread to stream-read its share of [addr, addr + nbytes) once (addr 64-byte aligned,
  // nbytes a multiple of 256). The benchmarks read a layer's own weights with it right before and after the
  // layer's call: on a shared VM whose bandwidth moves from minute to minute, a reading next to the call is the
  // closest yardstick it has.
  double read_seconds(uintptr_t addr, int64_t nbytes) {
    if (addr % 64 || nbytes % 256)
      throw std::invalid_argument("read_seconds: addr must be 64-byte aligned and nbytes a multiple of 256");
    const int n = pool_.num_threads();
    const int64_t blocks = nbytes / 256;
    const char* base = reinterpret_cast<const char*>(addr);
    volatile double sink = 0.0;
    auto t0 = std::chrono::steady_clock::now();
    pool_.parallel_for(n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t b0 = blocks * i / n, b1 = blocks * (i + 1) / n;
        sink = sink + read_sum_(base + b0 * 256, (b1 - b0) * 256);
      }
    });
    return seconds_since(t0);
  }

  // GB/s of the best of `repeats` streaming reads of a fresh buffer of about nbytes (at least 1 MiB).
  double read_bandwidth(int64_t nbytes, int repeats) {
    nbytes = std::max<int64_t>(nbytes / 4096 * 4096, 1 << 20);
    void* buf = std::aligned_alloc(4096, nbytes);
    if (!buf) throw std::bad_alloc();
    std::unique_ptr<void, decltype(&std::free)> keep(buf, &std::free);
    char* c = static_cast<char*>(buf);
    const int n = pool_.num_threads();
    pool_.parallel_for(n, [&](int64_t b, int64_t e, int) {  // every page touched: the timed reads fault none
      for (int64_t i = b; i < e; ++i) std::memset(c + nbytes * i / n, 1, nbytes * (i + 1) / n - nbytes * i / n);
    });
    double best = 0.0;
    for (int rep = 0; rep < repeats; ++rep)
      best = std::max(best, nbytes / read_seconds(reinterpret_cast<uintptr_t>(buf), nbytes) / 1e9);
    return best;
  }

  // GFLOP/s of tile dot products alone on every thread for about `seconds` (amx kernels only).
  double amx_peak(double seconds) {
    if (std::string(K_->name) != "amx") throw std::runtime_error("the AMX peak needs the amx kernels");
    const int n = pool_.num_threads();
    std::vector<double> flops(n, 0.0);
    auto t0 = std::chrono::steady_clock::now();
    pool_.parallel_for(n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) {
        double f = 0.0;
        while (seconds_since(t0) < seconds) f += tile_loop(20000);
        flops[i] = f;
      }
    });
    const double s = seconds_since(t0);
    double total = 0.0;
    for (double f : flops) total += f;
    return total / s / 1e9;
  }

  // GFLOP/s of KernelTable::gemm_block with every thread on its own cache-resident A (m rows) and B (kb blocks),
  // counted at the slowest thread.
  double bench_gemm(int64_t m, int64_t kb, int64_t iters) {
    const int n = pool_.num_threads();
    std::vector<double> secs(n, 0.0);
    pool_.parallel_for(n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) {
        const ALayout la = ALayout::tiles(kb * 32);
        std::vector<uint16_t> Av((m + 31) / 32 * 32 * kb * 32 + 32, 0x3f80), Bv(2 * kb * kBlockElems + 32, 0x3c00);
        std::vector<float> Cv((m + 32) * 32 + 16);
        auto al = [](auto* p, uintptr_t esz) { return p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64 / esz; };
        const uint16_t* A = al(Av.data(), 2);
        const uint16_t* B = al(Bv.data(), 2);
        float* C = al(Cv.data(), 4);
        K_->gemm_block(A, la, m, B, B + kb * kBlockElems, kb, C, 32, 0);
        auto t0 = std::chrono::steady_clock::now();
        for (int64_t it = 0; it < iters; ++it) K_->gemm_block(A, la, m, B, B + kb * kBlockElems, kb, C, 32, 0);
        secs[i] = seconds_since(t0);
      }
    });
    const double worst = *std::max_element(secs.begin(), secs.end());
    return 2.0 * m * 32 * kb * 32 * iters * n / worst / 1e9;
  }

 private:
  const KernelTable* K_;
  ktcore::ThreadPool pool_;
  double (*read_sum_)(const void*, int64_t);
};

// The meter of the module-level functions: every hardware thread, kept between calls.
Meter& shared_meter(const std::string& kernels) {
  static std::mutex mu;
  static std::unique_ptr<Meter> meter;
  std::lock_guard<std::mutex> lk(mu);
  if (!meter || meter->kernels() != kernels) meter.reset(new Meter(default_threads(), kernels));
  return *meter;
}

}  // namespace
}  // namespace ktamx

PYBIND11_MODULE(_measure, m) {
  using ktamx::Meter;
  m.doc() = "amx_bf16 measurement probes (read bandwidth, AMX tile peak, gemm_block micro-benchmark)";
  m.def("measure_amx_peak_gflops", [](double seconds) {
    py::gil_scoped_release nogil;
    return ktamx::shared_meter("amx").amx_peak(seconds);
  }, py::arg("seconds") = 1.0, "AMX BF16 tile-only peak over all hardware threads, GFLOP/s (raises without AMX)");
  m.def("measure_read_bandwidth", [](int64_t nbytes) {
    py::gil_scoped_release nogil;
    return ktamx::shared_meter(ktamx::amx_ready().empty() ? "amx" : "portable").read_bandwidth(nbytes, 5);
  }, py::arg("nbytes") = int64_t(1) << 31, "DRAM streaming read bandwidth over all hardware threads, GB/s (best of 5)");

  using G = py::call_guard<py::gil_scoped_release>;
  py::class_<Meter>(m, "Meter")
      .def(py::init<int, const std::string&>(), py::arg("num_threads") = 0, py::arg("kernels") = "amx")
      .def_property_readonly("num_threads", &Meter::num_threads)
      .def_property_readonly("kernels", &Meter::kernels)
      .def("read_seconds", &Meter::read_seconds, G())
      .def("read_bandwidth", &Meter::read_bandwidth, G())
      .def("amx_peak", &Meter::amx_peak, G())
      .def("bench_gemm", &Meter::bench_gemm, G());
}
