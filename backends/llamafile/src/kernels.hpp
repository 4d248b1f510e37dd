// The per-ISA kernel table: one instance per instruction set (scalar, AVX2, AVX-512 VNNI), chosen once at
// run time in module.cpp (select_kernels). All three produce bit-identical results: the vector paths and the
// scalar path do the same integer sums in the same lanes and the same float operations in the same order.
#pragma once

#include <cstdint>

#include "ktcore/expert_lora_leaves.hpp"

namespace ktl {

// One weight row expanded for the int16 kernels: w int16 [kp] in element order; per 32-element chunk c the
// row's value is dlo[c] * w (elements 0..15 of the chunk), dhi[c] * w (16..31) plus mn[c]. dlo == dhi except
// for Q6_K (16-element sub-blocks). mn is 0 where the type has no min; dlo/dhi/mn are zero-padded to nc8 chunks
// (a multiple of 8).
struct Row16 {
  int16_t* w;
  float* dlo;
  float* dhi;
  float* mn;
};

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
  // ---- int16 activations (activations="q16") ----
  // One fp32 row x[0:k] -> q int16 [kp] (columns >= k are 0) and per chunk c < nc8: d[c] = amax / 32767,
  // q = round-half-even(x / d), m[c] = d * sum(q) (d = m = 0 for the padding chunks nc..nc8).
  void (*quant16)(const float* x, int k, int kp, int nc8, int16_t* q, float* d, float* m);
  // One row of nb GGUF blocks of qtype -> Row16 (nc8 chunks). tmp: int8 scratch of kp bytes (generic unpack).
  void (*expand16)(int qtype, const uint8_t* row, int nb, int nc8, const Row16& out, int8_t* tmp);
  // out[r * ldo_r + t * ldo_t] = dot of expanded row r < nr (nr <= 4) with int16 activation row t < nt
  // (xq rows of ldq elements; xd, xm rows of lds floats, zero-padded to nc8 chunks). split: dlo != dhi.
  // Per (r, t) 16 float lanes, with the same float operations in the same order on every ISA: lane j of a
  // chunk holds the exact int32 p = w[2j] x[2j] + w[2j+1] x[2j+1], and per chunk acc = fma(float(p), s, acc)
  // with s = dlo * xd on lanes 0..7 and dhi * xd on lanes 8..15; after each 8th chunk (and the last) lanes
  // 0..7 take acc = fma(mn, xm, acc) of those 8 chunks when has_min; out = hsum of lanes j + (j + 8), j < 8.
  void (*dot16)(const Row16* rows, int nr, bool split, bool has_min, int nc, int nt, const int16_t* xq,
                int64_t ldq, const float* xd, const float* xm, int64_t lds, float* out, int64_t ldo_t,
                int64_t ldo_r);
  // dot16 of nr rows (row_bytes apart) straight from their nb GGUF blocks (no expanded copy; for a few tokens,
  // where expanding costs more than the dot): out[r + t * ldo_t], bit for bit expand16 + dot16. Null, or false
  // returned, where this table has no in-place kernel for the type or nt > 3: the caller then expands.
  bool (*row16)(int qtype, const uint8_t* row, int64_t row_bytes, int nr, int nb, int nt, const int16_t* xq,
                int64_t ldq, const float* xd, const float* xm, int64_t lds, float* out, int64_t ldo_t);
  // y[i] = fma(a, x[i], y[i])
  void (*axpy)(float a, const float* x, float* y, int n);
  // expert LoRA's fp32 leaf routines (ktcore/expert_lora_leaves.inc): the same bits on every ISA
  ktcore::lora::Leaves lora;
};

const Kernels& scalar_kernels();
const Kernels& avx2_kernels();
const Kernels& vnni_kernels();

}  // namespace ktl
