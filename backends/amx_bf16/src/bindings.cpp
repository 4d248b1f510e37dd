// ktcore_amx_bf16._ext: the Python binding of the engine (engine.hpp). Baseline-compiled: importing it and
// asking amx_unavailable_reason() is safe on any x86-64 CPU.
#include <pybind11/pybind11.h>

#include "engine.hpp"
#include "ktcore/expert_lora_binding.hpp"
#include "ktcore/phase_clock_binding.hpp"
#include "select.hpp"

namespace py = pybind11;
using ktamx::Engine;

PYBIND11_MODULE(_ext, m) {
  m.doc() = "amx_bf16 expert kernels (AMX BF16 tiles + AVX-512); no libtorch";
  m.def("amx_unavailable_reason", [] { return ktamx::amx_ready(); },
        "'' when this process may use AMX (CPUID + arch_prctl permission), else the reason");
  m.def("avx512_bf16_unavailable_reason", &ktamx::avx512_bf16_ready,
        "'' when the CPU has AVX-512 BF16 (the avx512 kernels), else the reason");

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
      .def("pack", &Engine::pack, G())
      .def("route", &Engine::route, G())
      .def("gather", &Engine::gather, G())
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
