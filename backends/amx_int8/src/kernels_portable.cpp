// Portable kernel table: plain C++ over the same packed layout. Slow; it exists so the orchestration, packing,
// quantisation and transposition can be tested on any CPU (it is never chosen automatically).
#include "kernels.hpp"

namespace ktint8 {
namespace portable {

#include "elementwise.inc"
#include "ktcore/expert_lora_leaves.inc"

static void gemm_block(const int8_t* A, int64_t lda, int64_t m, const int8_t* B0, const int8_t* B1, int64_t kb,
                       int32_t* C, int64_t ldc) {
  for (int64_t r = 0; r < m; ++r)
    for (int half = 0; half < 2; ++half)
      for (int n = 0; n < 16; ++n) {
        const int8_t* b = half ? B1 : B0;
        int32_t acc = 0;
        for (int64_t k = 0; k < kb * kBlockK; ++k)
          acc += static_cast<int32_t>(A[r * lda + k]) * b[k / kBlockK * kBlockBytes + block_offset(n, k)];
        C[r * ldc + half * 16 + n] = acc;
      }
}

static void transpose_block(const int8_t* W, int64_t KB, int64_t c0, int64_t kt, int8_t* out) {
  for (int64_t j = 0; j < kBlockK; ++j) {
    const int64_t n = kBlockK * kt + j;
    const int8_t* block = W + (n / 16 * KB + c0 / kBlockK) * kBlockBytes;
    for (int nn = 0; nn < 16; ++nn) out[block_offset(nn, j)] = block[block_offset(n, c0 + nn)];
  }
}

static const KernelTable table = {"portable", gemm_block, transpose_block, KTINT8_ELEMENTWISE, lora_leaves};

}  // namespace portable

const KernelTable* portable_kernels() { return &portable::table; }

}  // namespace ktint8
