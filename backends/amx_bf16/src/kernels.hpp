// Kernel table: the leaf routines of the amx_bf16 backend. Three tables exist: "amx" (AMX tiles + AVX-512,
// compiled with AMX flags in kernels_amx.cpp, used only after the AMX permission check succeeded), "avx512"
// (AVX-512 BF16 dot products on the same packed blocks, kernels_avx512.cpp, for CPUs with AVX512_BF16 but no AMX)
// and "portable" (plain C++, any x86-64, used to test the orchestration anywhere).
//
// Packed weight layout (one matrix W [N, K], row n = output n): blocks of 16 outputs x 32 inputs,
// block (nb, kb) at ((nb * KB) + kb) * 512 uint16; inside a block element (n, k) sits at
// (k / 2) * 32 + n * 2 + (k % 2)  -- the AMX B-tile / VNNI pair layout (16 rows of 64 bytes).
// A "stream" is the KB consecutive blocks of one nb.
#pragma once
#include <cstdint>

#include "ktcore/expert_lora_leaves.hpp"

namespace ktamx {

constexpr int kBlockElems = 512;  // 16 x 32 bf16

// Where the bf16 activations (the A operand) live: element (r, c) at
//   A[(r / 16) * group + (r % 16) * row + (c / 32) * kblock + c % 32].
// "rows" is plain row-major; "tiles" stores every 16 x 32 tile as one contiguous KiB, so a tile load reads
// 16 consecutive cache lines (one stream for the prefetchers, no L1 set conflicts, no TLB spread). A tiled
// buffer starts a 16-row group wherever a GEMM starts, so each expert's rows are padded to a multiple of 16.
struct ALayout {
  int64_t row, kblock, group;
  static ALayout rows(int64_t lda) { return {lda, 32, 16 * lda}; }
  static ALayout tiles(int64_t cols) { return {32, kBlockElems, (cols + 31) / 32 * kBlockElems}; }
  int64_t at(int64_t r, int64_t c) const { return r / 16 * group + r % 16 * row + c / 32 * kblock + c % 32; }
};

struct KernelTable {
  const char* name;
  // C[m, 0:16] (+)= A[m, 0:32kb] @ stream0^T ; C[m, 16:32] (+)= A @ stream1^T.
  // A (bf16, layout la, row 0 at the start of a 16-row group) must have readable rows up to roundup(m, 16).
  // C (fp32, ldc floats per row) must have roundup(m, 32) rows. acc: add to C instead of overwriting.
  void (*gemm_block)(const uint16_t* A, ALayout la, int64_t m, const uint16_t* B0, const uint16_t* B1,
                     int64_t kb, float* C, int64_t ldc, int acc);
  // From forward blocks fa = (2q, p) and fb = (2q+1, p) of W, build the two blocks of W^T covering
  // W^T rows (= W columns) 32p..32p+15 (out0) and 32p+16..32p+31 (out1) and W^T columns 32q..32q+31.
  void (*transpose_pair)(const uint16_t* fa, const uint16_t* fb, uint16_t* out0, uint16_t* out1);
  // gemm_block with W^T blocks derived step by step: step k's B0, B1 are transpose_pair(f + k * stride,
  // f + k * stride + odd), written to `slots` (2 * steps blocks) just before their products. m <= 32.
  // next (may be null): the f of the call that follows (same stride, odd), whose first blocks this one prefetches.
  void (*gemm_transposing)(const uint16_t* A, ALayout la, int64_t m, const uint16_t* f, int64_t stride, int64_t odd,
                           int64_t steps, float* C, int64_t ldc, int acc, uint16_t* slots, const uint16_t* next);
  // h[0:n] = bf16(silu(g) * u)
  void (*silu_mul)(const float* g, const float* u, int64_t n, uint16_t* h);
  // backward of h = silu(g) * u for one row: gh = w * gh_raw; returns dot(gh_raw, h).
  float (*silu_mul_bwd)(const float* gh_raw, const uint16_t* h, const float* g, const float* u, int64_t n, float w,
                        uint16_t* gg, uint16_t* gu);
  // dst[0:n] = bf16(src), dst[n:npad] = 0; src fp32 (src_bf16 = 0) or bf16
  void (*row_to_bf16)(const void* src, int src_bf16, int64_t n, int64_t npad, uint16_t* dst);
  // acc[0:n] (+)= a * x  (init: overwrite)
  void (*axpy)(float a, const float* x, float* acc, int64_t n, int init);
  // dst[0:n] = acc (fp32 or bf16)
  void (*store_row)(const float* acc, int64_t n, void* dst, int dst_bf16);
  // expert LoRA's fp32 leaf routines (ktcore/expert_lora_leaves.inc)
  ktcore::lora::Leaves lora;
};

const KernelTable* amx_kernels();
const KernelTable* avx512_kernels();
const KernelTable* portable_kernels();

}  // namespace ktamx
