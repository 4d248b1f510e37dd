// ktcore shared C++: the Python binding of a native engine's PhaseClock (phase_clock.hpp), for each backend's
// extension: Engine.phase_clock(on) switches it, Engine.phase_times() returns {phase: (seconds, calls)} since the
// last read and starts over.
#pragma once

#include <pybind11/pybind11.h>

namespace ktcore {

template <class Engine, class... Options>
void bind_phase_clock(pybind11::class_<Engine, Options...>& cls) {
  namespace py = pybind11;
  cls.def("phase_clock", [](Engine& e, bool on) { e.phase_clock().set(on); }, py::arg("on"))
      .def("phase_times", [](Engine& e) {
        py::dict out;
        for (const auto& [name, total] : e.phase_clock().take())
          out[py::str(name)] = py::make_tuple(total.first, total.second);
        return out;
      });
}

}  // namespace ktcore
