// AMX INT8 kernel table: TDPBSSD tiles for calls with more than kVnniRows rows, the VNNI routine below that (one
// 16-row tile would be mostly padding). Compiled with AMX and AVX-512 flags; runs only after amx_ready() said yes.
#include <immintrin.h>

#include "kernels.hpp"

namespace ktint8 {
namespace amxk {

#include "elementwise.inc"
#include "ktcore/expert_lora_leaves.inc"
#include "vnni.inc"

constexpr int64_t kVnniRows = 4;

// The 64-byte LDTILECFG block, palette 1: every tile 16 rows of 64 bytes (A: 16 rows x 64 int8, B: 16 x 16 x 4
// int8, C: 16 x 16 int32).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Loaded at the start of every call: another library (oneDNN inside torch, say) may have changed or released this
// thread's tile configuration in between.
static inline void ensure_tile_config() {
  static const TileConfig cfg;
  _tile_loadconfig(&cfg);
}

// All 16 lines of block k of both weight streams.
static inline void prefetch_blocks(const int8_t* B0, const int8_t* B1, int64_t k) {
  const char* p0 = reinterpret_cast<const char*>(B0 + k * kBlockBytes);
  const char* p1 = reinterpret_cast<const char*>(B1 + k * kBlockBytes);
  for (int l = 0; l < 1024; l += 64) {
    _mm_prefetch(p0 + l, _MM_HINT_T0);
    _mm_prefetch(p1 + l, _MM_HINT_T0);
  }
}

// The 16 rows of one A tile (64 bytes each, lda apart).
static inline void prefetch_rows(const int8_t* a, int64_t lda) {
  for (int r = 0; r < 16; ++r) _mm_prefetch(reinterpret_cast<const char*>(a + r * lda), _MM_HINT_T0);
}

// Each 32-row group runs the whole K with its 32 x 32 int32 C block in four tiles (2 A x 2 B tiles per step).
// Tile registers are not renamed, so each operand tile of step k + 1 is loaded as soon as the last product of step
// k that reads it has been issued. The first group streams the weights from DRAM: their blocks are prefetched kFar
// steps ahead; later groups find them in L2. The rows' tiles are prefetched kNear steps ahead.
static void gemm_block(const int8_t* A, int64_t lda, int64_t m, const int8_t* B0, const int8_t* B1, int64_t kb,
                       int32_t* C, int64_t ldc) {
  if (m <= kVnniRows) return vnni_gemm(A, lda, m, B0, B1, kb, C, ldc);
  ensure_tile_config();
  constexpr int64_t kFar = 6, kNear = 2;
  const int64_t sc = ldc * 4;
  for (int64_t m0 = 0; m0 < m; m0 += 32) {
    const int8_t* a0 = A + m0 * lda;
    const int8_t* a1 = a0 + 16 * lda;
    const bool two = m - m0 > 16;
    if (m0 == 0)
      for (int64_t k = 0; k < kFar && k < kb; ++k) prefetch_blocks(B0, B1, k);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, a0, lda);
    _tile_loadd(6, B0, 64);
    _tile_loadd(7, B1, 64);
    if (two) _tile_loadd(5, a1, lda);
    for (int64_t k = 0; k < kb; ++k) {
      const bool more = k + 1 < kb;
      const int64_t n = k + 1;
      if (m0 == 0 && k + kFar < kb) prefetch_blocks(B0, B1, k + kFar);
      if (k + kNear < kb) {  // the rows' next tiles (16 scattered lines each), from L2
        prefetch_rows(a0 + (k + kNear) * kBlockK, lda);
        if (two) prefetch_rows(a1 + (k + kNear) * kBlockK, lda);
      }
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      if (more) _tile_loadd(4, a0 + n * kBlockK, lda);
      if (two) {
        _tile_dpbssd(2, 5, 6);
        if (more) _tile_loadd(6, B0 + n * kBlockBytes, 64);
        _tile_dpbssd(3, 5, 7);
        if (more) {
          _tile_loadd(7, B1 + n * kBlockBytes, 64);
          _tile_loadd(5, a1 + n * kBlockK, lda);
        }
      } else if (more) {
        _tile_loadd(6, B0 + n * kBlockBytes, 64);
        _tile_loadd(7, B1 + n * kBlockBytes, 64);
      }
    }
    int32_t* c = C + m0 * ldc;
    _tile_stored(0, c, sc); _tile_stored(1, c + 16, sc);
    if (two) { _tile_stored(2, c + 16 * ldc, sc); _tile_stored(3, c + 16 * ldc + 16, sc); }
  }
}

static const KernelTable table = {"amx", gemm_block, avx512_transpose_block, avx512_quantize_row,
                                   KTINT8_ELEMENTWISE_AFTER_QUANTIZE, lora_leaves};

// Tile products only, iters rounds on this thread (doctor's AMX INT8 peak); returns the integer operations done.
double tile_loop(int64_t iters) {
  ensure_tile_config();
  alignas(64) static const int8_t zeros[1024] = {};
  _tile_loadd(4, zeros, 64); _tile_loadd(5, zeros, 64);
  _tile_loadd(6, zeros, 64); _tile_loadd(7, zeros, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  alignas(64) int32_t sink[256];
  _tile_stored(0, sink, 64);
  return static_cast<double>(iters) * 4.0 * 2.0 * 16 * 16 * 64;
}

}  // namespace amxk

const KernelTable* amx_kernels() { return &amxk::table; }
double amx_tile_loop(int64_t iters) { return amxk::tile_loop(iters); }

}  // namespace ktint8
