// AVX-512 BF16 kernel table, for CPUs with AVX512_BF16 but no AMX (AMD Zen 4 and 5, Intel Cooper Lake): the same
// packed layout and orchestration as the amx table, every product a VDPBF16PS on the packed VNNI blocks. This
// file alone is compiled with AVX-512 BF16 flags (no AMX); it runs only after avx512_bf16_ready() said yes.
#include <immintrin.h>

#include "kernels.hpp"

namespace ktamx {
namespace avx512k {

#include "elementwise.inc"
#include "ktcore/expert_lora_leaves.inc"
#include "avx512_bf16.inc"

template <int M>
static inline void rows_at(const uint16_t* A, ALayout la, int64_t r0, const uint16_t* B0, const uint16_t* B1,
                           int64_t kb, float* C, int64_t ldc, int acc) {
  gemm_small<M>(A + la.at(r0, 0), la, B0, B1, kb, C + r0 * ldc, ldc, acc);
}

// Eight rows at a time (two passes per 16-row group: B's blocks, 2 KiB per step, come from L1/L2 the second
// time), then the remainder.
static void gemm_block(const uint16_t* A, ALayout la, int64_t m, const uint16_t* B0, const uint16_t* B1,
                       int64_t kb, float* C, int64_t ldc, int acc) {
  int64_t r0 = 0;
  for (; r0 + 8 <= m; r0 += 8) rows_at<8>(A, la, r0, B0, B1, kb, C, ldc, acc);
  switch (m - r0) {
    case 0: return;
    case 1: return rows_at<1>(A, la, r0, B0, B1, kb, C, ldc, acc);
    case 2: return rows_at<2>(A, la, r0, B0, B1, kb, C, ldc, acc);
    case 3: return rows_at<3>(A, la, r0, B0, B1, kb, C, ldc, acc);
    case 4: return rows_at<4>(A, la, r0, B0, B1, kb, C, ldc, acc);
    case 5: return rows_at<5>(A, la, r0, B0, B1, kb, C, ldc, acc);
    case 6: return rows_at<6>(A, la, r0, B0, B1, kb, C, ldc, acc);
    default: return rows_at<7>(A, la, r0, B0, B1, kb, C, ldc, acc);
  }
}

// Every step's W^T blocks first, then the products.
static void gemm_transposing(const uint16_t* A, ALayout la, int64_t m, const uint16_t* f, int64_t stride,
                             int64_t odd, int64_t steps, float* C, int64_t ldc, int acc, uint16_t* slots,
                             const uint16_t* next) {
  transpose_steps(f, stride, odd, steps, slots, next);
  gemm_block(A, la, m, slots, slots + steps * kBlockElems, steps, C, ldc, acc);
}

static const KernelTable table = {"avx512", gemm_block, transpose_pair, gemm_transposing, KTAMX_ELEMENTWISE,
                                  lora_leaves};

}  // namespace avx512k

const KernelTable* avx512_kernels() { return &avx512k::table; }

}  // namespace ktamx
