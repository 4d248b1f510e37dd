// AMX BF16 + AVX-512 kernel table. This file alone is compiled with -mamx-tile -mamx-bf16 -mavx512*;
// it uses no standard-library templates so no AVX-512 code can leak into shared inline functions.
// Its functions run only after ktamx::amx_ready() (CPUID + arch_prctl permission) said yes.
#include <immintrin.h>

#include "kernels.hpp"
#include "amx.hpp"

namespace ktamx {
namespace amxk {

#include "elementwise.inc"
#include "ktcore/expert_lora_leaves.inc"
#include "avx512_bf16.inc"

// Loaded at the start of every kernel call: another library (oneDNN inside torch, say) may have changed or
// released this thread's tile configuration in between.
static inline void ensure_tile_config() {
  static const ktamx::TileConfig cfg = ktamx::TileConfig::uniform(8, 16, 64);
  _tile_loadconfig(&cfg);
}

// Software prefetch of one 16-row A tile (or a 1 KiB B block): every line when the rows are scattered,
// every fourth line of a contiguous KiB (the L1 streamer fetches its neighbours).
static inline void prefetch_tile(const uint16_t* p, int64_t row_bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  if (row_bytes == 64) {
    for (int l = 0; l < 1024; l += 256) _mm_prefetch(c + l, _MM_HINT_T0);
  } else {
    for (int r = 0; r < 16; ++r) _mm_prefetch(c + r * row_bytes, _MM_HINT_T0);
  }
}

// Each 32-row group runs the whole K with its 32 x 32 C block held in four tiles (2 A x 2 B tiles per step).
// Tile registers are not renamed, so each operand tile of step k+1 is loaded as soon as the last product of
// step k that reads it has been issued. A tiles are prefetched two steps ahead; B blocks eight steps ahead on
// the first group (from DRAM), two steps ahead on later groups (from L2).
static void gemm_block(const uint16_t* A, ALayout la, int64_t m, const uint16_t* B0, const uint16_t* B1,
                       int64_t kb, float* C, int64_t ldc, int acc) {
  if (m <= 0) return;
  if (m <= 4) {
    switch (m) {
      case 1: gemm_small<1>(A, la, B0, B1, kb, C, ldc, acc); return;
      case 2: gemm_small<2>(A, la, B0, B1, kb, C, ldc, acc); return;
      case 3: gemm_small<3>(A, la, B0, B1, kb, C, ldc, acc); return;
      default: gemm_small<4>(A, la, B0, B1, kb, C, ldc, acc); return;
    }
  }
  ensure_tile_config();
  const int64_t sa = la.row * 2, sc = ldc * 4;
  constexpr int64_t kNear = 2, kFar = 8;
  for (int64_t m0 = 0; m0 < m; m0 += 32) {
    const uint16_t* a0 = A + m0 / 16 * la.group;
    const uint16_t* a1 = a0 + la.group;
    const bool two = m - m0 > 16;
    float* c = C + m0 * ldc;
    if (m0 == 0)
      for (int64_t k = 0; k < kFar && k < kb; ++k) prefetch_blocks(B0, B1, k);
    if (!acc) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    } else {
      _tile_loadd(0, c, sc); _tile_loadd(1, c + 16, sc);
      if (two) { _tile_loadd(2, c + 16 * ldc, sc); _tile_loadd(3, c + 16 * ldc + 16, sc); }
    }
    _tile_loadd(4, a0, sa);
    _tile_loadd(6, B0, 64);
    _tile_loadd(7, B1, 64);
    if (two) _tile_loadd(5, a1, sa);
    for (int64_t k = 0; k < kb; ++k) {
      const bool more = k + 1 < kb;
      const int64_t n = k + 1;
      if (k + kNear < kb) {
        prefetch_tile(a0 + (k + kNear) * la.kblock, sa);
        if (two) prefetch_tile(a1 + (k + kNear) * la.kblock, sa);
        if (m0 > 0) {
          prefetch_tile(B0 + (k + kNear) * kBlockElems, 64);
          prefetch_tile(B1 + (k + kNear) * kBlockElems, 64);
        }
      }
      if (m0 == 0 && k + kFar < kb) prefetch_blocks(B0, B1, k + kFar);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (more) _tile_loadd(4, a0 + n * la.kblock, sa);
      if (two) {
        _tile_dpbf16ps(2, 5, 6);
        if (more) _tile_loadd(6, B0 + n * kBlockElems, 64);
        _tile_dpbf16ps(3, 5, 7);
        if (more) {
          _tile_loadd(7, B1 + n * kBlockElems, 64);
          _tile_loadd(5, a1 + n * la.kblock, sa);
        }
      } else if (more) {
        _tile_loadd(6, B0 + n * kBlockElems, 64);
        _tile_loadd(7, B1 + n * kBlockElems, 64);
      }
    }
    _tile_stored(0, c, sc); _tile_stored(1, c + 16, sc);
    if (two) { _tile_stored(2, c + 16 * ldc, sc); _tile_stored(3, c + 16 * ldc + 16, sc); }
  }
}

// One 32-row group over `steps` W^T block pairs derived from forward blocks as it goes: step k's transposes go
// to one of two 2 KiB slots right before its tile products, so the AMX unit multiplies step k while the vector
// units transpose step k + 1, and C stays in tiles throughout. Few rows: transpose all, then gemm_small.
static void gemm_transposing(const uint16_t* A, ALayout la, int64_t m, const uint16_t* f, int64_t stride,
                             int64_t odd, int64_t steps, float* C, int64_t ldc, int acc, uint16_t* slots,
                             const uint16_t* next) {
  if (m <= 4) {
    transpose_steps(f, stride, odd, steps, slots, next);
    gemm_block(A, la, m, slots, slots + steps * kBlockElems, steps, C, ldc, acc);
    return;
  }
  ensure_tile_config();
  const int64_t sa = la.row * 2, sc = ldc * 4;
  const uint16_t *a0 = A, *a1 = A + la.group;
  const bool two = m > 16;
  if (!acc) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  } else {
    _tile_loadd(0, C, sc); _tile_loadd(1, C + 16, sc);
    if (two) { _tile_loadd(2, C + 16 * ldc, sc); _tile_loadd(3, C + 16 * ldc + 16, sc); }
  }
  for (int64_t k = 0; k < steps; ++k) {
    uint16_t* o = slots + (k & 1) * 2 * kBlockElems;
    prefetch_ahead(f, next, stride, odd, steps, k);
    transpose_pair(f + k * stride, f + k * stride + odd, o, o + kBlockElems);
    _tile_loadd(4, a0 + k * la.kblock, sa);
    _tile_loadd(6, o, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, o + kBlockElems, 64);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a1 + k * la.kblock, sa);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, C, sc); _tile_stored(1, C + 16, sc);
  if (two) { _tile_stored(2, C + 16 * ldc, sc); _tile_stored(3, C + 16 * ldc + 16, sc); }
}

static const KernelTable table = {"amx", gemm_block, transpose_pair, gemm_transposing, KTAMX_ELEMENTWISE,
                                  lora_leaves};

}  // namespace amxk

const KernelTable* amx_kernels() { return &amxk::table; }

}  // namespace ktamx
