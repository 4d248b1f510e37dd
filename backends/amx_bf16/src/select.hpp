// Which kernel table an engine runs: "amx" (only where this process may use AMX), "avx512" (only where the CPU
// has AVX512_BF16) or "portable".
// Baseline-compiled: asking is safe on any x86-64 CPU.
#pragma once

#include <string>

#include "kernels.hpp"

namespace ktamx {

// "" when AMX may be used in this process (CPUID says so and the kernel granted tile permission), else why not.
// Asked once per process.
const std::string& amx_ready();

// "" when the CPU has AVX-512 F, BW, VL and BF16 (the avx512 table's instructions), else why not.
std::string avx512_bf16_ready();

// The table named "amx", "avx512" or "portable"; "auto": amx where AMX may be used, else avx512 where the CPU
// has it. Throws when the name is unknown or the table cannot run here.
const KernelTable* kernels_for(const std::string& which);

// The hardware threads of this machine (at least 1).
int default_threads();

}  // namespace ktamx
