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

const KernelTable* kernels_for(const std::string& which) {
  if (which == "portable") return portable_kernels();
  if (which == "amx") {
    const std::string& why = amx_ready();
    if (!why.empty()) throw std::runtime_error("amx_bf16 kernels unavailable: " + why);
    return amx_kernels();
  }
  throw std::invalid_argument("kernels must be 'amx' or 'portable', not '" + which + "'");
}

int default_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 1;
}

}  // namespace ktamx
