// AMX detection, tile-data permission and the tile configuration block.
// Nothing here executes an AMX instruction; this header is safe to compile without -mamx-* flags.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cerrno>
#define KTCORE_AMX_POSSIBLE 1
#else
#define KTCORE_AMX_POSSIBLE 0
#endif

namespace ktamx {

constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

struct CpuFeatures {
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512_bf16 = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false, os_avx512 = false;
};

// Reads CPUID (plain baseline code).
inline CpuFeatures cpu_features() {
  CpuFeatures f;
#if KTCORE_AMX_POSSIBLE
  unsigned a, b, c, d;
  if (!__get_cpuid_count(0, 0, &a, &b, &c, &d) || a < 7) return f;
  __get_cpuid_count(1, 0, &a, &b, &c, &d);
  bool osxsave = (c >> 27) & 1;
  if (osxsave) {
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    f.os_avx512 = (lo & 0xE6) == 0xE6;  // XMM, YMM, opmask, ZMM state enabled
  }
  __get_cpuid_count(7, 0, &a, &b, &c, &d);
  f.avx512f = (b >> 16) & 1;
  f.avx512bw = (b >> 30) & 1;
  f.avx512vl = (b >> 31) & 1;
  f.amx_bf16 = (d >> 22) & 1;
  f.amx_tile = (d >> 24) & 1;
  f.amx_int8 = (d >> 25) & 1;
  __get_cpuid_count(7, 1, &a, &b, &c, &d);
  f.avx512_bf16 = (a >> 5) & 1;
#endif
  return f;
}

// Ask the kernel for AMX tile data permission. Returns "" when granted, else the reason.
inline std::string request_permission() {
#if KTCORE_AMX_POSSIBLE
  CpuFeatures f = cpu_features();
  if (!f.amx_tile || !f.amx_bf16) return "this CPU has no AMX BF16 (CPUID leaf 7: amx_tile/amx_bf16 clear)";
  if (!f.avx512f || !f.avx512_bf16 || !f.os_avx512) return "this CPU or OS lacks AVX-512 / AVX512_BF16";
  long rc = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata);
  if (rc != 0) {
    int err = errno;
    return std::string("the kernel refused AMX tile permission (arch_prctl errno ") + std::to_string(err) + ": " +
           std::strerror(err) + ")";
  }
  unsigned long bitmask = 0;
  rc = syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask);
  if (rc != 0 || !(bitmask & (1UL << kXfeatureXtiledata))) return "AMX tile permission not present after request";
  return "";
#else
  return "AMX needs Linux on x86-64";
#endif
}

// The 64-byte LDTILECFG block (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  // every tile `rows` x `colsb` bytes (the common 16 x 64 setup for BF16/INT8 GEMM)
  static TileConfig uniform(int ntiles = 8, uint8_t r = 16, uint16_t cb = 64) {
    TileConfig c;
    for (int i = 0; i < ntiles && i < 8; ++i) {
      c.rows[i] = r;
      c.colsb[i] = cb;
    }
    return c;
  }
};
static_assert(sizeof(TileConfig) == 64, "tile config must be 64 bytes");

}  // namespace ktamx
