// ktcore_amx_int8._ext: the Python binding of the engine (engine.hpp). Baseline-compiled: importing it and asking
// amx_unavailable_reason() / vnni_unavailable_reason() is safe on any x86-64 CPU.
#include <pybind11/pybind11.h>

#include <chrono>
#include <stdexcept>
#include <vector>

#include "cpu.hpp"
#include "engine.hpp"
#include "ktcore/expert_lora_binding.hpp"
#include "ktcore/phase_clock_binding.hpp"
#include "ktcore/thread_pool.hpp"
#include "select.hpp"

namespace py = pybind11;
using ktint8::Engine;

namespace {

// Integer GOP/s of AMX INT8 tile products alone on every hardware thread, for about `seconds` (doctor's yardstick).
double amx_int8_peak_gops(double seconds) {
  if (!ktint8::amx_ready().empty()) throw std::runtime_error("AMX INT8 unavailable: " + ktint8::amx_ready());
  ktcore::ThreadPool pool(ktint8::default_threads());
  const int n = pool.num_threads();
  const int64_t iters = 1 << 16;
  std::vector<double> ops(n, 0.0);  // per thread slot
  auto t0 = std::chrono::steady_clock::now();
  double elapsed = 0.0;
  while (elapsed < seconds) {
    pool.parallel_for(n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) ops[i] += ktint8::amx_tile_loop(iters);
    });
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  double total = 0.0;
  for (double o : ops) total += o;
  return total / elapsed / 1e9;
}

}  // namespace

PYBIND11_MODULE(_ext, m) {
  m.doc() = "amx_int8 expert kernels (AMX INT8 tiles, AVX-512 VNNI); no libtorch";
  m.def("amx_unavailable_reason", [] { return ktint8::amx_ready(); },
        "'' when this process may use AMX INT8 (CPUID + arch_prctl permission), else the reason");
  m.def("vnni_unavailable_reason", [] { return ktint8::vnni_unavailable(); },
        "'' when this CPU runs the AVX-512 VNNI kernels, else the reason");
  m.def("amx_int8_peak_gops", &amx_int8_peak_gops, py::arg("seconds") = 1.0,
        py::call_guard<py::gil_scoped_release>());

  ktcore::lora::bind_projection(m);

  using G = py::call_guard<py::gil_scoped_release>;
  py::class_<Engine> engine(m, "Engine");
  ktcore::bind_phase_clock(engine);
  engine
      .def(py::init<int, int, const std::string&>(), py::arg("num_threads") = 0, py::arg("num_pools") = 1,
           py::arg("kernels") = "auto")
      .def_property_readonly("num_threads", &Engine::num_threads)
      .def_property_readonly("num_pools", &Engine::num_pools)
      .def_property_readonly("kernels", &Engine::kernels)
      .def("quantize_weights", &Engine::quantize_weights, G())
      .def("pack_codes", &Engine::pack_codes, G())
      .def("route", &Engine::route, G())
      .def("quantize_rows", &Engine::quantize_rows, G())
      .def("combine", &Engine::combine, G())
      .def("gate_up", &Engine::gate_up, G())
      .def("down", &Engine::down, G())
      .def("bwd_down", &Engine::bwd_down, G())
      .def("bwd_act", &Engine::bwd_act, G())
      .def("bwd_gate_up", &Engine::bwd_gate_up, G())
      .def("bwd_down_lora_grads", &Engine::bwd_down_lora_grads, G())
      .def("bwd_gate_up_lora_grads", &Engine::bwd_gate_up_lora_grads, G())
      .def("memzero", &Engine::memzero, G());
}
