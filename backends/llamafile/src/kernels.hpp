// The per-ISA kernel table: one instance per instruction set (scalar, AVX2, AVX-512 VNNI), chosen once at
// run time in module.cpp (select_kernels). All three produce bit-identical results: the vector paths and the
// scalar path do the same integer sums in the same 8 lanes and the same float operations in the same order.
#pragma once

#include <cstdint>

namespace ktl {

struct Kernels {
  const char* name;
  // out[t * ldo] = sum over chunks c of the unpacked weight row (q, dlo, dhi, mn) against the quantised
  // activations of tokens t < nt (rows of xq: ldq bytes, xd/xm: nc floats each); has_min adds mn * xm.
  void (*dot_q)(const int8_t* q, const float* dlo, const float* dhi, const float* mn, bool has_min, int nc, int nt,
                const int8_t* xq, const float* xd, const float* xm, int64_t ldq, float* out, int64_t ldo);
  // The same result as unpack_row + dot_q, bit for bit, straight from one row of nblocks GGUF blocks (no scratch
  // row): nibbles and scales are unpacked in registers. Null, or false returned, where this table has no in-place
  // kernel for the type; the caller then unpacks.
  bool (*dot_row)(int qtype, const uint8_t* row, int nblocks, int nt, const int8_t* xq, const float* xd,
                  const float* xm, int64_t ldq, float* out, int64_t ldo);
  // out[t * ldo] = dot(w[0:k], x[t * ldx : + k]) for t < nt, k a multiple of 8
  void (*dot_f)(const float* w, int k, int nt, const float* x, int64_t ldx, float* out, int64_t ldo);
  // y[i] = fma(a, x[i], y[i])
  void (*axpy)(float a, const float* x, float* y, int n);
};

const Kernels& scalar_kernels();
const Kernels& avx2_kernels();
const Kernels& vnni_kernels();

}  // namespace ktl
