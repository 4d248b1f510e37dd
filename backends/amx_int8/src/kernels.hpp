// Kernel table: the leaf routines of the amx_int8 backend. Three tables exist: "amx" (AMX INT8 tiles, TDPBSSD, for
// calls with many rows per expert, and the VNNI routine for few), "vnni" (AVX-512 VNNI, VPDPBUSD, every call) and
// "portable" (plain C++, any x86-64, the tests' reference for the orchestration). The integer products are exact,
// so every table gives the same int32 sums; the float routines are compiled with -ffp-contract=off from one source
// (elementwise.inc), so the tables agree to the bit.
//
// Packed weight layout (one matrix W [N, K] of int8 codes, row n = output channel n): blocks of 16 outputs x 64
// inputs, block (nb, kb) at ((nb * KB) + kb) * 1024 bytes; inside a block element (n, k) sits at
// (k / 4) * 64 + n * 4 + (k % 4) -- the AMX INT8 B-tile layout (16 rows of 64 bytes, four inputs per output).
// A "stream" is the KB consecutive blocks of one nb. Activations (the A operand) are int8 rows, lda bytes apart.
#pragma once
#include <cstdint>

#include "ktcore/expert_lora_leaves.hpp"

namespace ktint8 {

constexpr int64_t kBlockBytes = 1024;  // 16 outputs x 64 inputs
constexpr int64_t kBlockK = 64;

// Where element (n, k) of W sits inside its block.
inline int64_t block_offset(int64_t n, int64_t k) { return (k % kBlockK) / 4 * 64 + (n % 16) * 4 + k % 4; }

struct KernelTable {
  const char* name;
  // C[r, 0:16] = A[r, 0:64kb] . stream0, C[r, 16:32] = A[r] . stream1 (int32), r < m. A rows up to roundup(m, 16)
  // must be readable (tiles load whole 16-row groups); C has ldc int32 per row and roundup(m, 16) rows.
  void (*gemm_block)(const int8_t* A, int64_t lda, int64_t m, const int8_t* B0, const int8_t* B1, int64_t kb,
                     int32_t* C, int64_t ldc);
  // Block kt of the W^T stream for W's input columns c0..c0+15 (c0 a multiple of 16): its element (n' = c - c0,
  // k' = j) is W[64 kt + j, c]. W: one expert's packed matrix, KB blocks per stream. The backward multiplies by
  // these blocks, derived from the forward's own codes per task: nothing transposed stays resident, and no second
  // rounding of the weights enters.
  void (*transpose_block)(const int8_t* W, int64_t KB, int64_t c0, int64_t kt, int8_t* out);
  // Dynamic symmetric quantisation of one row: v[i] = src[i] * (mul ? mul[i] : 1) for i < n (src fp32, or bf16 when
  // src_bf16); scale = max|v| / 127; dst[i] = round_half_even(v[i] / scale) (0 where scale is 0), dst[n:npad] = 0.
  // Returns scale.
  float (*quantize_row)(const void* src, int src_bf16, const float* mul, int64_t n, int64_t npad, int8_t* dst);
  // out[r * ldo + j] = float(C[r * ldc + j]) * (row_scale[r] * (col_scale ? col_scale[j] : 1)), r < m, j < n
  void (*dequant)(const int32_t* C, int64_t ldc, int64_t m, int64_t n, const float* row_scale, const float* col_scale,
                  float* out, int64_t ldo);
  // h[0:n] = silu(g) * u, rounded to bf16 (what the down projection quantises and backward reads back)
  void (*silu_mul)(const float* g, const float* u, int64_t n, uint16_t* h);
  // backward of h = silu(g) * u for one row: gg = d/dg, gu = d/du of w * gh_raw . h; returns dot(gh_raw, h).
  float (*silu_mul_bwd)(const float* gh_raw, const uint16_t* h, const float* g, const float* u, int64_t n, float w,
                        float* gg, float* gu);
  // acc[0:n] (+)= a * x  (init: overwrite)
  void (*axpy)(float a, const float* x, float* acc, int64_t n, int init);
  // dst[0:n] = acc (fp32 or bf16)
  void (*store_row)(const float* acc, int64_t n, void* dst, int dst_bf16);
  // expert LoRA's fp32 leaf routines (ktcore/expert_lora_leaves.inc)
  ktcore::lora::Leaves lora;
};

const KernelTable* amx_kernels();
const KernelTable* vnni_kernels();
const KernelTable* portable_kernels();

// AMX INT8 tile products only, iters rounds on this thread; returns the integer operations done (doctor's peak).
// Only after amx_ready() said yes.
double amx_tile_loop(int64_t iters);

}  // namespace ktint8
