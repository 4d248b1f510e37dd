// ktcore shared C++: a non-owning view of a strided tensor that crossed the Python boundary as
// (data pointer, dtype, shape, strides in elements). No torch headers, no libtorch.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace ktcore {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2, I32 = 3, I64 = 4, U8 = 5, I8 = 6 };

inline int dtype_size(DType d) {
  switch (d) {
    case DType::F32: case DType::I32: return 4;
    case DType::BF16: case DType::F16: return 2;
    case DType::I64: return 8;
    default: return 1;
  }
}

inline DType dtype_from_name(const std::string& s) {
  if (s == "float32" || s == "fp32") return DType::F32;
  if (s == "bfloat16" || s == "bf16") return DType::BF16;
  if (s == "float16" || s == "fp16") return DType::F16;
  if (s == "int32") return DType::I32;
  if (s == "int64") return DType::I64;
  if (s == "uint8") return DType::U8;
  if (s == "int8") return DType::I8;
  throw std::invalid_argument("unsupported dtype " + s);
}

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements

  TensorView() = default;
  TensorView(uintptr_t ptr, DType dt, std::vector<int64_t> shp, std::vector<int64_t> str = {})
      : data(reinterpret_cast<void*>(ptr)), dtype(dt), shape(std::move(shp)), strides(std::move(str)) {
    if (strides.empty()) {  // contiguous
      strides.assign(shape.size(), 1);
      for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * shape[i + 1];
    }
  }

  int dim() const { return static_cast<int>(shape.size()); }
  int64_t numel() const {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
  bool is_contiguous() const {
    int64_t expect = 1;
    for (int i = dim() - 1; i >= 0; --i) {
      if (shape[i] != 1 && strides[i] != expect) return false;
      expect *= shape[i];
    }
    return true;
  }
  template <class T>
  T* ptr() const { return static_cast<T*>(data); }
  void require(DType dt, int ndim, const char* what) const {
    if (dtype != dt || dim() != ndim)
      throw std::invalid_argument(std::string(what) + ": unexpected dtype or rank");
  }
};

}  // namespace ktcore
