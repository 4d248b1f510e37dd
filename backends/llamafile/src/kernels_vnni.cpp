// Compiled with AVX-512 VL/BW + VNNI code generation (CMakeLists.txt); called only after the run-time check
// in module.cpp. Differs from the AVX2 file in madd_u (vpdpbusd instead of vpmaddubsw + vpmaddwd: exact integer
// sums either way) and in the q16 kernels' 16 float lanes (one zmm instead of two ymm: the same operations).
#define KTL_ISA 2
#define KTL_NAME "avx512vnni"
#define KTL_TABLE vnni_kernels
#include "kernels.inc"
