#include "select.hpp"

#include <mutex>
#include <stdexcept>
#include <thread>

#include "amx.hpp"

namespace ktamx {

const std::string& amx_ready() {
  static std::once_flag once;
  static std::string reason = "not checked";
  std::call_once(once, [] { reason = request_permission(); });
  return reason;
}

std::string avx512_bf16_ready() {
  __builtin_cpu_init();
  std::string missing;
  auto need = [&](bool has, const char* name) {
    if (!has) missing += (missing.empty() ? "" : ", ") + std::string(name);
  };
  need(__builtin_cpu_supports("avx512f"), "avx512f");  // the builtin takes string literals only
  need(__builtin_cpu_supports("avx512bw"), "avx512bw");
  need(__builtin_cpu_supports("avx512vl"), "avx512vl");
  need(__builtin_cpu_supports("avx512bf16"), "avx512_bf16");
  return missing.empty() ? "" : "CPU lacks " + missing;
}

const KernelTable* kernels_for(const std::string& which) {
  if (which == "portable") return portable_kernels();
  if (which == "auto") return kernels_for(amx_ready().empty() ? "amx" : "avx512");
  if (which == "amx") {
    const std::string& why = amx_ready();
    if (!why.empty()) throw std::runtime_error("amx_bf16 kernels unavailable: " + why);
    return amx_kernels();
  }
  if (which == "avx512") {
    const std::string why = avx512_bf16_ready();
    if (!why.empty()) throw std::runtime_error("amx_bf16's avx512 kernels unavailable: " + why);
    return avx512_kernels();
  }
  throw std::invalid_argument("kernels must be 'auto', 'amx', 'avx512' or 'portable', not '" + which + "'");
}

int default_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 1;
}

}  // namespace ktamx
