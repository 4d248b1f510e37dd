// Portable kernel table: plain C++ over the same packed layout. Slow; it exists so the orchestration,
// packing and transposition logic can be tested on CPUs without AMX (it is never chosen automatically).
#include "kernels.hpp"

namespace ktamx {
namespace portable {

#include "elementwise.inc"
#include "ktcore/expert_lora_leaves.inc"

static void gemm_block(const uint16_t* A, ALayout la, int64_t m, const uint16_t* B0, const uint16_t* B1,
                       int64_t kb, float* C, int64_t ldc, int acc) {
  for (int64_t r = 0; r < m; ++r) {
    float out[32];
    for (int i = 0; i < 32; ++i) out[i] = acc ? C[r * ldc + i] : 0.0f;
    for (int64_t k = 0; k < kb; ++k) {
      const uint16_t* a = A + la.at(r, 32 * k);
      const uint16_t* b0 = B0 + k * kBlockElems;
      const uint16_t* b1 = B1 + k * kBlockElems;
      for (int kp = 0; kp < 16; ++kp) {
        float x0 = bf16_to_f32(a[2 * kp]), x1 = bf16_to_f32(a[2 * kp + 1]);
        for (int n = 0; n < 16; ++n) {
          out[n] += x0 * bf16_to_f32(b0[kp * 32 + n * 2]) + x1 * bf16_to_f32(b0[kp * 32 + n * 2 + 1]);
          out[16 + n] += x0 * bf16_to_f32(b1[kp * 32 + n * 2]) + x1 * bf16_to_f32(b1[kp * 32 + n * 2 + 1]);
        }
      }
    }
    for (int i = 0; i < 32; ++i) C[r * ldc + i] = out[i];
  }
}

// element (n, k) of a forward block
static inline uint16_t fwd_at(const uint16_t* blk, int n, int k) { return blk[(k / 2) * 32 + n * 2 + (k % 2)]; }

static void transpose_pair(const uint16_t* fa, const uint16_t* fb, uint16_t* out0, uint16_t* out1) {
  // W^T block: rows n' = k of W (16 of them), inputs k' = n of W (32: fa gives 0..15, fb 16..31)
  for (int half = 0; half < 2; ++half) {
    uint16_t* out = half ? out1 : out0;
    for (int np = 0; np < 16; ++np)          // output row r = k' / 2 pair index
      for (int kk = 0; kk < 16; ++kk)        // output column (n' within block)
        for (int j = 0; j < 2; ++j) {
          int wn = 2 * np + j;               // W row
          int wk = 16 * half + kk;           // W column
          out[np * 32 + kk * 2 + j] = wn < 16 ? fwd_at(fa, wn, wk) : fwd_at(fb, wn - 16, wk);
        }
  }
}

static void gemm_transposing(const uint16_t* A, ALayout la, int64_t m, const uint16_t* f, int64_t stride,
                             int64_t odd, int64_t steps, float* C, int64_t ldc, int acc, uint16_t* slots,
                             const uint16_t*) {
  for (int64_t k = 0; k < steps; ++k)
    transpose_pair(f + k * stride, f + k * stride + odd, slots + k * kBlockElems, slots + (steps + k) * kBlockElems);
  gemm_block(A, la, m, slots, slots + steps * kBlockElems, steps, C, ldc, acc);
}

static const KernelTable table = {"portable", gemm_block, transpose_pair, gemm_transposing, KTAMX_ELEMENTWISE,
                                  lora_leaves};

}  // namespace portable

const KernelTable* portable_kernels() { return &portable::table; }

}  // namespace ktamx
