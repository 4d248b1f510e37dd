// Leaf loops of the measurement extension (measure.cpp); the AVX-512 / AMX ones live in measure_amx.cpp.
#pragma once

#include <cstdint>

namespace ktamx {

// A streaming read of [p, p + nbytes) (p 64-byte aligned, nbytes a multiple of 256); returns a checksum that
// keeps the reads alive.
double read_sum_avx512(const void* p, int64_t nbytes);
// Tile dot products only, iters rounds on this thread; returns the FLOPs done.
double tile_loop(int64_t iters);

}  // namespace ktamx
