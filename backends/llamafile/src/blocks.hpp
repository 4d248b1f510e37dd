// GGUF (ggml) block types: byte layouts, exact dequantisation, reference quantisers, and the "unpacked chunk"
// form the dot kernels consume. Plain C++ (no intrinsics): compiled into every ISA's kernel file.
//
// Layouts (little endian, fp16 = IEEE half, QK_K = 256):
//   Q4_0  18 B / 32: fp16 d; u8 qs[16]            x = d * (nib - 8); low nibbles are elements 0..15
//   Q4_1  20 B / 32: fp16 d, fp16 m; u8 qs[16]            x = d * nib + m
//   Q8_0  34 B / 32: fp16 d; i8 qs[32]                    x = d * q
//   Q4_K 144 B / 256: fp16 d, dmin; u8 scales[12]; qs[128]   8 sub-blocks of 32 with 6-bit scale/min:
//         x = (d*sc_j) * nib - (dmin*m_j); bytes 32g..32g+31 hold sub-block 2g (low) and 2g+1 (high nibbles)
//   Q5_K 176 B / 256: as Q4_K plus qh[32] before qs: bit j of qh[l] is the 5th bit of element l of sub-block j
//   Q6_K 210 B / 256: ql[128], qh[64], i8 scales[16], fp16 d; 16 sub-blocks of 16: x = (d*sc) * (q6 - 32)
//   F32 / F16 / BF16: plain rows (padded to 32 elements here)
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace ktl {

// ggml's GGMLQuantizationType numbers
enum QType : int { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };

struct TypeInfo {
  int block_elems;  // elements per block
  int block_bytes;
  bool quantised;   // true: dot against quantised activations
  bool has_min;     // true: x = d*q + m (a per-chunk offset)
};

inline TypeInfo type_info(int t) {
  switch (t) {
    case F32: return {32, 128, false, false};  // "block" = 32 elements of padding granularity
    case F16: return {32, 64, false, false};
    case BF16: return {32, 64, false, false};
    case Q4_0: return {32, 18, true, false};
    case Q4_1: return {32, 20, true, true};
    case Q8_0: return {32, 34, true, false};
    case Q4_K: return {256, 144, true, true};
    case Q5_K: return {256, 176, true, true};
    case Q6_K: return {256, 210, true, false};
    default: throw std::invalid_argument("unsupported block type " + std::to_string(t));
  }
}

// ---- half / bfloat16 -------------------------------------------------------------------------------------
inline float fp16_to_fp32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) bits = sign;
    else {  // subnormal: normalise
      int e = -1;
      do { man <<= 1; ++e; } while (!(man & 0x400));
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) bits = sign | 0x7f800000u | man << 13;
  else bits = sign | (exp + 127 - 15) << 23 | man << 13;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// round to nearest even, as F16C / numpy
inline uint16_t fp32_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7fffffff;
  if (ax > 0x7f800000) return (uint16_t)(sign | 0x7e00);  // NaN
  if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  // rounds to inf
  if (ax < 0x38800000) {  // subnormal half (or zero): value = m * 2^-24
    if (ax < 0x33000000) return (uint16_t)sign;  // < 2^-25: rounds to 0 (2^-25 exactly ties to even 0)
    uint32_t e = ax >> 23, m = (ax & 0x7fffff) | 0x800000;
    int shift = 126 - (int)e;  // m * 2^(e-150) / 2^-24 = m >> (126 - e)
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;
    return (uint16_t)(sign | q);
  }
  uint32_t r = ax + 0xc8000fff + ((ax >> 13) & 1);  // rebias (-112 << 23) and round
  return (uint16_t)(sign | (r >> 13));
}

inline float bf16_to_fp32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t rd16(const uint8_t* p) { return (uint16_t)(p[0] | p[1] << 8); }
inline void wr16(uint8_t* p, uint16_t v) { p[0] = v & 0xff; p[1] = v >> 8; }

// 6-bit scale j and min j of a Q4_K/Q5_K block's 12 scale bytes
inline void k4_scale_min(int j, const uint8_t* s, int& sc, int& mn) {
  if (j < 4) { sc = s[j] & 63; mn = s[j + 4] & 63; }
  else { sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4); mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

// ---- exact dequantisation of one block (same float operations as gguf.quants / ggml) ----------------------
inline void dequant_block(int t, const uint8_t* b, float* y) {
  switch (t) {
    case F32: std::memcpy(y, b, 128); return;
    case F16: for (int i = 0; i < 32; ++i) y[i] = fp16_to_fp32(rd16(b + 2 * i)); return;
    case BF16: for (int i = 0; i < 32; ++i) y[i] = bf16_to_fp32(rd16(b + 2 * i)); return;
    case Q4_0: {
      float d = fp16_to_fp32(rd16(b));
      for (int i = 0; i < 16; ++i) {
        y[i] = d * (float)((b[2 + i] & 0xf) - 8);
        y[i + 16] = d * (float)((b[2 + i] >> 4) - 8);
      }
      return;
    }
    case Q4_1: {
      float d = fp16_to_fp32(rd16(b)), m = fp16_to_fp32(rd16(b + 2));
      for (int i = 0; i < 16; ++i) {
        y[i] = d * (float)(b[4 + i] & 0xf) + m;
        y[i + 16] = d * (float)(b[4 + i] >> 4) + m;
      }
      return;
    }
    case Q8_0: {
      float d = fp16_to_fp32(rd16(b));
      for (int i = 0; i < 32; ++i) y[i] = (float)(int8_t)b[2 + i] * d;
      return;
    }
    case Q4_K: case Q5_K: {
      float d = fp16_to_fp32(rd16(b)), dmin = fp16_to_fp32(rd16(b + 2));
      const uint8_t* sc = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = t == Q4_K ? b + 16 : b + 48;
      for (int j = 0; j < 8; ++j) {
        int s, m;
        k4_scale_min(j, sc, s, m);
        float dj = d * (float)s, mj = dmin * (float)m;
        const uint8_t* q = qs + 32 * (j / 2);
        for (int l = 0; l < 32; ++l) {
          int v = (j & 1) ? q[l] >> 4 : q[l] & 0xf;
          if (t == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
          y[32 * j + l] = dj * (float)v - mj;
        }
      }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = (const int8_t*)(b + 192);
      float d = fp16_to_fp32(rd16(b + 208));
      for (int c = 0; c < 8; ++c) {  // chunk c of 32: half h = c/4, nibble (c/2)%2, part c%2
        int h = c / 4, nib = (c / 2) % 2, part = c % 2, s = c % 4;
        for (int l = 0; l < 32; ++l) {
          int lo = (ql[h * 64 + part * 32 + l] >> (4 * nib)) & 0xf;
          int hi = (qh[h * 32 + l] >> (2 * s)) & 3;
          int e = 32 * c + l;
          y[e] = (d * (float)sc[e / 16]) * (float)((lo | hi << 4) - 32);
        }
      }
      return;
    }
    default: throw std::invalid_argument("dequant: unsupported type");
  }
}

// ---- the unpacked form: per 32-element chunk, int8 q[32] and x = dlo/dhi * q + mn -----------------------
// dlo applies to elements 0..15 of the chunk and dhi to 16..31 (they differ only for Q6_K).
struct Unpacked {
  int8_t* q;    // [nchunks * 32]
  float* dlo;   // [nchunks]
  float* dhi;   // [nchunks]
  float* mn;    // [nchunks] (types with a min only)
};

// Unpack one row of nblocks blocks of a quantised type.
inline void unpack_row(int t, const uint8_t* row, int nblocks, const Unpacked& u) {
  const TypeInfo ti = type_info(t);
  for (int ib = 0; ib < nblocks; ++ib) {
    const uint8_t* b = row + (size_t)ib * ti.block_bytes;
    const int c0 = ib * (ti.block_elems / 32);
    int8_t* q = u.q + (size_t)c0 * 32;
    switch (t) {
      case Q4_0: case Q4_1: {
        const uint8_t* qs = b + (t == Q4_0 ? 2 : 4);
        const int off = t == Q4_0 ? 8 : 0;
        for (int i = 0; i < 16; ++i) { q[i] = (int8_t)((qs[i] & 0xf) - off); q[i + 16] = (int8_t)((qs[i] >> 4) - off); }
        u.dlo[c0] = u.dhi[c0] = fp16_to_fp32(rd16(b));
        if (t == Q4_1) u.mn[c0] = fp16_to_fp32(rd16(b + 2));
        break;
      }
      case Q8_0:
        std::memcpy(q, b + 2, 32);
        u.dlo[c0] = u.dhi[c0] = fp16_to_fp32(rd16(b));
        break;
      case Q4_K: case Q5_K: {
        float d = fp16_to_fp32(rd16(b)), dmin = fp16_to_fp32(rd16(b + 2));
        const uint8_t* qh = b + 16;
        const uint8_t* qs = t == Q4_K ? b + 16 : b + 48;
        for (int g = 0; g < 4; ++g) {
          const uint8_t* src = qs + 32 * g;
          int8_t* lo = q + 64 * g;
          int8_t* hi = lo + 32;
          for (int l = 0; l < 32; ++l) { lo[l] = (int8_t)(src[l] & 0xf); hi[l] = (int8_t)(src[l] >> 4); }
          if (t == Q5_K)
            for (int l = 0; l < 32; ++l) {
              lo[l] = (int8_t)(lo[l] | ((qh[l] >> (2 * g)) & 1) << 4);
              hi[l] = (int8_t)(hi[l] | ((qh[l] >> (2 * g + 1)) & 1) << 4);
            }
        }
        for (int j = 0; j < 8; ++j) {
          int s, m;
          k4_scale_min(j, b + 4, s, m);
          u.dlo[c0 + j] = u.dhi[c0 + j] = d * (float)s;
          u.mn[c0 + j] = -(dmin * (float)m);
        }
        break;
      }
      case Q6_K: {
        const uint8_t* ql = b;
        const uint8_t* qh = b + 128;
        const int8_t* sc = (const int8_t*)(b + 192);
        float d = fp16_to_fp32(rd16(b + 208));
        for (int c = 0; c < 8; ++c) {
          int h = c / 4, nib = (c / 2) % 2, part = c % 2, s = c % 4;
          const uint8_t* l4 = ql + h * 64 + part * 32;
          const uint8_t* h2 = qh + h * 32;
          int8_t* dst = q + 32 * c;
          for (int l = 0; l < 32; ++l)
            dst[l] = (int8_t)((((l4[l] >> (4 * nib)) & 0xf) | (((h2[l] >> (2 * s)) & 3) << 4)) - 32);
          u.dlo[c0 + c] = d * (float)sc[2 * c];
          u.dhi[c0 + c] = d * (float)sc[2 * c + 1];
        }
        break;
      }
      default: throw std::invalid_argument("unpack: not a quantised type");
    }
  }
}

// Float rows (F32/F16/BF16) to fp32.
inline void float_row(int t, const uint8_t* row, int n, float* y) {
  if (t == F32) std::memcpy(y, row, (size_t)n * 4);
  else if (t == F16) for (int i = 0; i < n; ++i) y[i] = fp16_to_fp32(rd16(row + 2 * i));
  else for (int i = 0; i < n; ++i) y[i] = bf16_to_fp32(rd16(row + 2 * i));
}

// ---- reference quantisers (ggml's reference rounding) ----------------------------------------------------
// nearest integer, ties to even (ggml's nearest_int: the 1.5*2^23 trick)
inline int nearest_int(float f) {
  float v = f + 12582912.f;
  int i;
  std::memcpy(&i, &v, 4);
  return (i & 0x007fffff) - 0x00400000;
}

void quantize_row(int t, const float* x, int64_t n, uint8_t* dst);  // n a multiple of the block size

}  // namespace ktl
