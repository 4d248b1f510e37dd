// ktcore shared C++: the Python binding of ktcore::lora::Projection, for each native backend's extension.
#pragma once

#include <pybind11/pybind11.h>

#include "ktcore/expert_lora.hpp"

namespace ktcore {
namespace lora {

// LoraProjection(rank, scale, a, b, grad_a=None, grad_b=None): each factor a tuple (address, bf16, expert stride,
// rank stride, column stride), strides in elements (ktcore.experts.native_lora builds them). module_local: every backend's
// extension has its own class.
inline void bind_projection(pybind11::module_& m) {
  namespace py = pybind11;
  auto factor = [](const py::object& t) {
    Factor f;
    if (t.is_none()) return f;
    const py::tuple v = t.cast<py::tuple>();
    if (v.size() != 5)
      throw py::value_error("a LoRA factor is (address, bf16, expert stride, rank stride, column stride)");
    f.p = v[0].cast<uintptr_t>();
    f.bf16 = v[1].cast<bool>();
    f.s_expert = v[2].cast<int64_t>();
    f.s_rank = v[3].cast<int64_t>();
    f.s_col = v[4].cast<int64_t>();
    return f;
  };
  py::class_<Projection>(m, "LoraProjection", py::module_local())
      .def(py::init([factor](int rank, float scale, const py::object& a, const py::object& b, const py::object& grad_a,
                             const py::object& grad_b) {
             if (rank <= 0) throw py::value_error("LoRA rank must be positive");
             Projection p;
             p.rank = rank;
             p.scale = scale;
             p.a = factor(a);
             p.b = factor(b);
             p.grad_a = factor(grad_a);
             p.grad_b = factor(grad_b);
             if (!p.a.p || !p.b.p) throw py::value_error("a LoRA projection needs both factors");
             return p;
           }),
           py::arg("rank"), py::arg("scale"), py::arg("a"), py::arg("b"), py::arg("grad_a") = py::none(),
           py::arg("grad_b") = py::none())
      .def_readonly("rank", &Projection::rank)
      .def_readonly("scale", &Projection::scale);
}

}  // namespace lora
}  // namespace ktcore
