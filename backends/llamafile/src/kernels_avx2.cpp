// Compiled with -mavx2 -mfma -mf16c (CMakeLists.txt); called only after the run-time check in module.cpp.
#define KTL_ISA 1
#define KTL_NAME "avx2"
#define KTL_TABLE avx2_kernels
#include "kernels.inc"
