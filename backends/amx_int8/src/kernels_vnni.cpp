// AVX-512 VNNI kernel table: every call through VPDPBUSD. This file alone (with kernels_amx.cpp) is compiled with
// AVX-512 flags; it runs only after kernels_for() found VNNI in CPUID.
#include <immintrin.h>

#include "kernels.hpp"

namespace ktint8 {
namespace vnnik {

#include "elementwise.inc"
#include "ktcore/expert_lora_leaves.inc"
#include "vnni.inc"

static const KernelTable table = {"vnni", vnni_gemm, avx512_transpose_block, avx512_quantize_row,
                                   KTINT8_ELEMENTWISE_AFTER_QUANTIZE, lora_leaves};

}  // namespace vnnik

const KernelTable* vnni_kernels() { return &vnnik::table; }

}  // namespace ktint8
