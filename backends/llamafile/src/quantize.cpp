// Reference quantisers for Q8_0, Q4_0, Q4_1 and Q4_K, following ggml's reference rounding rules
// (written from the format spec and gguf-py's reference behaviour; see blocks.hpp for the layouts).
#include <algorithm>
#include <cmath>

#include "blocks.hpp"

namespace ktl {
namespace {

void q8_0_block(const float* x, uint8_t* b) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  wr16(b, fp32_to_fp16(d));
  for (int i = 0; i < 32; ++i) b[2 + i] = (uint8_t)(int8_t)std::round(x[i] * id);  // roundf: half away from 0
}

void q4_0_block(const float* x, uint8_t* b) {
  float amax = 0.f, vmax = 0.f;  // the signed value of largest magnitude (first one on ties)
  for (int i = 0; i < 32; ++i)
    if (std::fabs(x[i]) > amax) { amax = std::fabs(x[i]); vmax = x[i]; }
  const float d = vmax / -8.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  wr16(b, fp32_to_fp16(d));
  for (int i = 0; i < 16; ++i) {
    int a = std::min(15, (int)(int8_t)(x[i] * id + 8.5f));
    int c = std::min(15, (int)(int8_t)(x[i + 16] * id + 8.5f));
    b[2 + i] = (uint8_t)(a | c << 4);
  }
}

void q4_1_block(const float* x, uint8_t* b) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < 32; ++i) { lo = std::min(lo, x[i]); hi = std::max(hi, x[i]); }
  const float d = (hi - lo) / 15.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  wr16(b, fp32_to_fp16(d));
  wr16(b + 2, fp32_to_fp16(lo));
  for (int i = 0; i < 16; ++i) {
    int a = std::min(15, (int)(uint8_t)((x[i] - lo) * id + 0.5f));
    int c = std::min(15, (int)(uint8_t)((x[i + 16] - lo) * id + 0.5f));
    b[4 + i] = (uint8_t)(a | c << 4);
  }
}

// Weighted least-squares fit of x ~ scale * L + min (L in [0, nmax], min <= 0), searching nstep+1 trial
// inverse scales around nmax / (max - min). Returns the scale and sets *neg_min = -min.
float fit_scale_min(int n, int nmax, const float* x, const float* w, uint8_t* L, float* neg_min, float rmin,
                    float rdelta, int nstep) {
  float mn = x[0], mx = x[0], sum_w = w[0], sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    mn = std::min(mn, x[i]);
    mx = std::max(mx, x[i]);
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (mn > 0) mn = 0;
  if (mx == mn) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *neg_min = -mn;
    return 0.f;
  }
  float iscale = nmax / (mx - mn);
  float scale = 1 / iscale;
  float best = 0;
  for (int i = 0; i < n; ++i) {
    int l = std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - mn))));
    L[i] = (uint8_t)l;
    float diff = scale * L[i] + mn - x[i];
    best += w[i] * (diff * diff);
  }
  uint8_t Laux[32];
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (mx - mn);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - mn))));
      Laux[i] = (uint8_t)l;
      sum_l += w[i] * l;
      sum_l2 += w[i] * l * l;
      sum_xl += w[i] * l * x[i];
    }
    float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float s = (sum_w * sum_xl - sum_x * sum_l) / D;
      float m = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (m > 0) { m = 0; s = sum_xl / sum_l2; }
      float err = 0;
      for (int i = 0; i < n; ++i) {
        float diff = s * Laux[i] + m - x[i];
        err += w[i] * (diff * diff);
      }
      if (err < best) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best = err;
        scale = s;
        mn = m;
      }
    }
  }
  *neg_min = -mn;
  return scale;
}

void q4_k_block(const float* x, uint8_t* b) {
  uint8_t L[256];
  float w[32], scales[8], mins[8];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    const float* xj = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += xj[l] * xj[l];
    float av = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) w[l] = av + std::fabs(xj[l]);
    scales[j] = fit_scale_min(32, 15, xj, w, L + 32 * j, &mins[j], -1.f, 0.1f, 20);
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  uint8_t* sc = b + 4;
  std::memset(sc, 0, 12);
  for (int j = 0; j < 8; ++j) {
    uint8_t ls = (uint8_t)std::min(63, nearest_int(inv_scale * scales[j]));
    uint8_t lm = (uint8_t)std::min(63, nearest_int(inv_min * mins[j]));
    if (j < 4) {
      sc[j] = ls;
      sc[j + 4] = lm;
    } else {
      sc[j + 4] = (uint8_t)((ls & 0xf) | (lm & 0xf) << 4);
      sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
      sc[j] |= (uint8_t)((lm >> 4) << 6);
    }
  }
  wr16(b, fp32_to_fp16(max_scale / 63.f));
  wr16(b + 2, fp32_to_fp16(max_min / 63.f));
  const float d = fp16_to_fp32(rd16(b)), dmin = fp16_to_fp32(rd16(b + 2));
  for (int j = 0; j < 8; ++j) {  // requantise with the rounded scales
    int s, m;
    k4_scale_min(j, sc, s, m);
    const float dj = d * s;
    if (dj == 0.f) continue;
    const float mj = dmin * m;
    for (int l = 0; l < 32; ++l)
      L[32 * j + l] = (uint8_t)std::max(0, std::min(15, nearest_int((x[32 * j + l] + mj) / dj)));
  }
  uint8_t* qs = b + 16;
  for (int g = 0; g < 4; ++g)
    for (int l = 0; l < 32; ++l) qs[32 * g + l] = (uint8_t)(L[64 * g + l] | L[64 * g + 32 + l] << 4);
}

}  // namespace

void quantize_row(int t, const float* x, int64_t n, uint8_t* dst) {
  const TypeInfo ti = type_info(t);
  if (n % ti.block_elems) throw std::invalid_argument("quantize_row: length is not a multiple of the block");
  for (int64_t i = 0; i < n / ti.block_elems; ++i) {
    const float* xb = x + i * ti.block_elems;
    uint8_t* b = dst + i * ti.block_bytes;
    switch (t) {
      case Q8_0: q8_0_block(xb, b); break;
      case Q4_0: q4_0_block(xb, b); break;
      case Q4_1: q4_1_block(xb, b); break;
      case Q4_K: q4_k_block(xb, b); break;
      case F32: std::memcpy(b, xb, 128); break;
      case F16: for (int k = 0; k < 32; ++k) wr16(b + 2 * k, fp32_to_fp16(xb[k])); break;
      case BF16:
        for (int k = 0; k < 32; ++k) {
          uint32_t u;
          std::memcpy(&u, xb + k, 4);
          if ((u & 0x7fffffff) > 0x7f800000) u = (u & 0xffff0000u) | (64u << 16);
          else u = u + (0x7fffu + ((u >> 16) & 1));
          wr16(b + 2 * k, (uint16_t)(u >> 16));
        }
        break;
      default: throw std::invalid_argument("quantize_row: no quantiser for type " + std::to_string(t));
    }
  }
}

}  // namespace ktl
