// The measurement loops that need AVX-512 / AMX code generation (compiled with kernels_amx.cpp's flags); run
// only after amx_ready() said yes. Part of the optional _measure extension, never of the backend.
#include <immintrin.h>

#include "amx.hpp"
#include "measure.hpp"

namespace ktamx {

double read_sum_avx512(const void* p, int64_t nbytes) {
  const char* c = static_cast<const char*>(p);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  int64_t n = nbytes / 256;
  for (int64_t i = 0; i < n; ++i) {
    const char* q = c + i * 256;
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(q));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(q + 64));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(q + 128));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(q + 192));
  }
  a0 = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));
  return static_cast<double>(_mm512_reduce_add_epi64(a0) & 0xFF);
}

double tile_loop(int64_t iters) {
  static const TileConfig cfg = TileConfig::uniform(8, 16, 64);
  _tile_loadconfig(&cfg);
  alignas(64) static const uint16_t zeros[512] = {};
  _tile_loadd(4, zeros, 64); _tile_loadd(5, zeros, 64);
  _tile_loadd(6, zeros, 64); _tile_loadd(7, zeros, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float sink[256];
  _tile_stored(0, sink, 64);
  return static_cast<double>(iters) * 4.0 * 2.0 * 16 * 16 * 32;
}

}  // namespace ktamx
