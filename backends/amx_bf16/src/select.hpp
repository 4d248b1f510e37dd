// Which kernel table an engine runs: "amx" (only where this process may use AMX) or "portable".
// Baseline-compiled: asking is safe on any x86-64 CPU.
#pragma once

#include <string>

#include "kernels.hpp"

namespace ktamx {

// "" when AMX may be used in this process (CPUID says so and the kernel granted tile permission), else why not.
// Asked once per process.
const std::string& amx_ready();

// The table named "amx" or "portable"; throws when the name is unknown or AMX is unavailable.
const KernelTable* kernels_for(const std::string& which);

// The hardware threads of this machine (at least 1).
int default_threads();

}  // namespace ktamx
