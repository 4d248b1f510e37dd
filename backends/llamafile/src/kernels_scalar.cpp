#define KTL_ISA 0
#define KTL_NAME "scalar"
#define KTL_TABLE scalar_kernels
#include "kernels.inc"
