"""What this CPU can do: feature flags, AMX tile permission, cores and memory.

``KTCORE_CPU_FLAGS`` (comma or space separated, e.g. "avx2,fma") replaces the detected flags, so tests and
users can see what ktcore would do on another CPU. With the override, AMX permission is assumed exactly
when ``amx_tile`` is listed.
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass
from functools import lru_cache

# Linux x86-64: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) asks the kernel to let this process
# use the AMX tile registers. Without it the first tile instruction kills the process.
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

# Flags ktcore cares about, in the order `ktcore doctor` prints them.
KNOWN_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
               "avx512_vnni", "avx512_fp16", "avx_vnni", "avx2", "fma", "f16c")


@dataclass(frozen=True)
class CpuInfo:
    flags: frozenset[str]
    amx_permission: bool
    amx_permission_reason: str
    model_name: str
    logical_cores: int
    overridden: bool = False

    def has(self, *features: str) -> bool:
        return all(f in self.flags for f in features)

    def missing(self, features) -> list[str]:
        return [f for f in features if f not in self.flags]


def _read_cpuinfo() -> tuple[frozenset[str], str]:
    flags: set[str] = set()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = set(value.split())
                elif key == "model name" and value.strip():
                    model = value.strip()
                if flags and key == "model name":
                    break
    except OSError:
        pass
    return frozenset(flags), model


def request_amx_permission() -> tuple[bool, str]:
    """Ask the kernel for AMX tile data permission; (granted, reason when not)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"AMX needs Linux on x86-64, this is {platform.system()} on {platform.machine()}"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except (OSError, AttributeError) as exc:
        return False, f"arch_prctl unavailable: {exc}"
    if rc != 0:
        err = ctypes.get_errno()
        return False, f"the kernel refused AMX tile permission (arch_prctl errno {err}: {os.strerror(err)})"
    return True, ""


def _parse_flags(text: str) -> frozenset[str]:
    return frozenset(f.strip().lower() for f in text.replace(",", " ").split() if f.strip())


@lru_cache(maxsize=None)
def _detect(override: str | None) -> CpuInfo:
    detected, model = _read_cpuinfo()
    cores = os.cpu_count() or 1
    if override is not None:
        flags = _parse_flags(override)
        ok = "amx_tile" in flags
        return CpuInfo(flags, ok, "" if ok else "amx_tile not in KTCORE_CPU_FLAGS", model, cores, overridden=True)
    if "amx_tile" in detected:
        ok, reason = request_amx_permission()
    else:
        ok, reason = False, "this CPU has no AMX (amx_tile flag absent)"
    return CpuInfo(detected, ok, reason, model, cores)


def cpu_info() -> CpuInfo:
    """The CPU's features, honouring ``KTCORE_CPU_FLAGS``."""
    return _detect(os.environ.get("KTCORE_CPU_FLAGS"))


def total_memory_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
