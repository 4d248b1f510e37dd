// ktcore shared C++: the combine phase of a native backend, token by token on one pool.
//
//     out[t] = sum over k (in order) of w[t, k] * sum over parts p (in order) of parts[p, row_of[t, k]]
//
// parts holds the per-row results [nparts, R, H] (one part per pool that summed a slice of K), row_of maps a
// token's slot to its routed row (-1: no expert), w may be null (weight 1; backward's grad_x). The arithmetic is
// the kernel table's (axpy, store_row), so every table gives its own bits; a token with no expert gets zeros.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ktcore/thread_pool.hpp"

namespace ktcore {

template <class Kernels>
void combine_rows(ThreadPool& pool, const Kernels& K, const float* parts, int64_t nparts, int64_t R, int64_t H,
                  const int32_t* row_of, const float* w, int64_t T, int64_t Kk, char* out, bool out_bf16) {
  const int64_t es = out_bf16 ? 2 : 4;
  pool.parallel_for(T, [&](int64_t b, int64_t e, int) {
    std::vector<float> acc(H);
    for (int64_t t = b; t < e; ++t) {
      bool first = true;
      for (int64_t k = 0; k < Kk; ++k) {
        const int32_t r = row_of[t * Kk + k];
        if (r < 0) continue;
        const float wk = w ? w[t * Kk + k] : 1.0f;
        for (int64_t p = 0; p < nparts; ++p) {
          K.axpy(wk, parts + (p * R + r) * H, acc.data(), H, first);
          first = false;
        }
      }
      if (first) std::fill(acc.begin(), acc.end(), 0.0f);
      K.store_row(acc.data(), H, out + t * H * es, out_bf16);
    }
  }, 4);
}

}  // namespace ktcore
