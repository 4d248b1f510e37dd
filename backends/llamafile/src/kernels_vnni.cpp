// Compiled with AVX-512 VL/BW + VNNI code generation (CMakeLists.txt); called only after the run-time check
// in module.cpp. Differs from the AVX2 file in dot4 (vpdpbusd instead of vpmaddubsw + vpmaddwd) and dot16x2
// (vpdpwssd instead of the second vpmaddwd + vpaddd): exact integer sums either way.
#define KTL_ISA 2
#define KTL_NAME "avx512vnni"
#define KTL_TABLE vnni_kernels
#include "kernels.inc"
