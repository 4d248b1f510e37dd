// ktcore shared C++: the leaf routines of expert LoRA inside the native backends, as a table of functions each
// backend's kernel table carries (compiled per instruction set from expert_lora_leaves.inc). expert_lora.hpp runs
// the math on them. No standard-library code here: kernel files compiled with ISA flags include this header.
#pragma once

#include <cstdint>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>  // the .inc's explicit fused multiply-adds
#endif

namespace ktcore {
namespace lora {

// Rows per pass of outer(): their weighted u is transposed once per pass, onto the stack.
constexpr int64_t kOuterRows = 64;

struct Leaves {
  // blk[k * ldb + j] = element (k, j) at p + k * s_rank + j * s_col (fp32 or bf16 elements), k < rank, j < nc
  void (*block)(const void* p, int bf16, int64_t s_rank, int64_t s_col, int rank, int64_t nc, float* blk,
                int64_t ldb);
  // q[i * rank + k] (+)= sum over c < n of f[k * ldf + c] * x_i[c], i < m, k < rank (16 partial sums, added up in a
  // fixed order); x_i is row rows[i] (rows null: i) of x (ldx elements apart, fp32 or bf16)
  void (*rank_dot)(const float* f, int64_t ldf, int rank, const void* x, int x_bf16, int64_t ldx, const int32_t* rows,
                   int64_t m, int64_t n, float* q, int accumulate);
  // out[i * ldo + j] += scale * sum over k of q[i * ldq + k] * blk[k * ldb + j], i < m, j < nc
  void (*expand)(const float* blk, int64_t ldb, int rank, int64_t nc, const float* q, int64_t ldq, int64_t m,
                 float scale, float* out, int64_t ldo);
  // acc[k * ldacc + j] += wt[i] * u[i * ldu + k] * v_i[j] for the rows i < m in order, j < nc; v_i is row
  // rows[i] (rows null: i) of v (ldv elements apart, fp32 or bf16); wt null: weight 1
  void (*outer)(const float* u, int64_t ldu, const float* wt, int rank, const void* v, int v_bf16, int64_t ldv,
                const int32_t* rows, int64_t m, int64_t nc, float* acc, int64_t ldacc);
  // element (k, j) at p + k * s_rank + j * s_col = scale * blk[k * ldb + j] (fp32, or bf16 rounded to nearest even)
  void (*store)(const float* blk, int64_t ldb, float scale, int rank, int64_t nc, void* p, int bf16, int64_t s_rank,
                int64_t s_col);
};

}  // namespace lora
}  // namespace ktcore
