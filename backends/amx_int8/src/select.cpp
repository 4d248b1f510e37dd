#include "select.hpp"

#include <mutex>
#include <stdexcept>
#include <thread>

#include "cpu.hpp"

namespace ktint8 {

const std::string& amx_ready() {
  static std::once_flag once;
  static std::string reason = "not checked";
  std::call_once(once, [] { reason = request_amx_permission(); });
  return reason;
}

const KernelTable* kernels_for(const std::string& which) {
  if (which == "portable") return portable_kernels();
  if (which == "auto") return kernels_for(amx_ready().empty() ? "amx" : "vnni");
  if (which == "amx") {
    if (!amx_ready().empty()) throw std::runtime_error("amx_int8 'amx' kernels unavailable: " + amx_ready());
    return amx_kernels();
  }
  if (which == "vnni") {
    const std::string why = vnni_unavailable();
    if (!why.empty()) throw std::runtime_error("amx_int8 'vnni' kernels unavailable: " + why);
    return vnni_kernels();
  }
  throw std::invalid_argument("kernels must be 'auto', 'amx', 'vnni' or 'portable', not '" + which + "'");
}

int default_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 1;
}

}  // namespace ktint8
