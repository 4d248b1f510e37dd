// ktcore shared C++: the routing of a native backend's layer call, the same for every backend.
//
// A stable counting sort of the (token, slot) pairs by expert. ids int64 [T*K] (outside [0, E): no expert), w fp32
// [T*K]. Outputs: off [E+1] (expert e's rows are off[e]..off[e+1]) and poff [E+1] (the same with each expert's
// rows padded to a multiple of 16: where its rows start in the tiled buffers); for each row r (expert-major, then
// slot order) row_tok[r] (its token), order[r] (its flat slot) and w_row[r]; row_of[slot] = its row or -1.
// Returns R, the rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace ktcore {

inline int64_t route_rows(const int64_t* ids, int64_t T, int64_t Kk, int64_t E, const float* w, int64_t* off,
                          int64_t* poff, int32_t* row_tok, int32_t* row_of, int64_t* order, float* w_row) {
  const int64_t n = T * Kk;
  std::fill(off, off + E + 1, 0);
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] >= 0 && ids[i] < E) ++off[ids[i] + 1];
  poff[0] = 0;
  for (int64_t e = 0; e < E; ++e) poff[e + 1] = poff[e] + (off[e + 1] + 15) / 16 * 16;
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  std::vector<int64_t> next(off, off + E);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = ids[i];
    if (e < 0 || e >= E) {
      row_of[i] = -1;
      continue;
    }
    const int64_t r = next[e]++;
    row_of[i] = static_cast<int32_t>(r);
    row_tok[r] = static_cast<int32_t>(i / Kk);
    order[r] = i;
    w_row[r] = w[i];
  }
  return off[E];
}

}  // namespace ktcore
