// CPUID features and AMX tile-data permission for the amx_int8 kernels. Nothing here executes an AMX or AVX-512
// instruction: this header is safe to compile and call with baseline x86-64 flags.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cerrno>
#define KTINT8_X86_LINUX 1
#else
#define KTINT8_X86_LINUX 0
#endif

namespace ktint8 {

struct CpuFeatures {
  bool avx512 = false;  // AVX-512 F + BW with the OS saving ZMM state
  bool avx512_vnni = false, amx_tile = false, amx_int8 = false;
};

inline CpuFeatures cpu_features() {
  CpuFeatures f;
#if KTINT8_X86_LINUX
  unsigned a, b, c, d;
  if (!__get_cpuid_count(0, 0, &a, &b, &c, &d) || a < 7) return f;
  __get_cpuid_count(1, 0, &a, &b, &c, &d);
  bool os_zmm = false;
  if ((c >> 27) & 1) {  // OSXSAVE
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    os_zmm = (lo & 0xE6) == 0xE6;  // XMM, YMM, opmask, ZMM state enabled
  }
  __get_cpuid_count(7, 0, &a, &b, &c, &d);
  f.avx512 = os_zmm && ((b >> 16) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1);  // F, BW, VL
  f.avx512_vnni = f.avx512 && ((c >> 11) & 1);
  f.amx_tile = (d >> 24) & 1;
  f.amx_int8 = (d >> 25) & 1;
#endif
  return f;
}

// "" when the VNNI kernels may run here, else why not.
inline std::string vnni_unavailable() {
  return cpu_features().avx512_vnni ? "" : "this CPU or OS lacks AVX-512 F/BW/VL with VNNI";
}

// Asks the kernel for AMX tile-data permission: "" when granted, else why not.
inline std::string request_amx_permission() {
#if KTINT8_X86_LINUX
  const CpuFeatures f = cpu_features();
  if (!f.amx_tile || !f.amx_int8) return "this CPU has no AMX INT8 (CPUID leaf 7: amx_tile/amx_int8 clear)";
  if (!f.avx512_vnni) return "this CPU or OS lacks AVX-512 VNNI (the few-rows path of the amx kernels)";
  constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    const int err = errno;
    return std::string("the kernel refused AMX tile permission (arch_prctl errno ") + std::to_string(err) + ": " +
           std::strerror(err) + ")";
  }
  unsigned long bitmask = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask) != 0 || !(bitmask & (1UL << kXfeatureXtiledata)))
    return "AMX tile permission not present after request";
  return "";
#else
  return "AMX needs Linux on x86-64";
#endif
}

}  // namespace ktint8
