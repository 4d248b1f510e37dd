// Which kernel table an engine runs. Baseline-compiled: asking is safe on any x86-64 CPU.
#pragma once

#include <string>

#include "kernels.hpp"

namespace ktint8 {

// "" when AMX INT8 may be used in this process (CPUID + the kernel's tile permission), else why not; asked once.
const std::string& amx_ready();

// "amx", "vnni" or "portable"; "auto": amx where amx_ready(), else vnni where the CPU has it. Throws when the
// table cannot run here or the name is unknown.
const KernelTable* kernels_for(const std::string& which);

// The hardware threads of this machine (at least 1).
int default_threads();

}  // namespace ktint8
