"""A pytest plugin that fails a run whose skips are not all for the machine's hardware.

The README promises that ``bash scripts/test.sh`` runs the whole suite: on a plain clone the only skips are for
hardware this machine lacks (a CUDA GPU, AMX, AVX-512 VNNI, transparent huge pages), or Node.js for the optional
llama.cpp tests. A skip for anything else means a test quietly stopped running: a package ``scripts/setup.sh`` no
longer installs (an ``importorskip``), the LLaMA-Factory environment not built, data that only exists beside CI. ``scripts/test.sh`` sets
``KTCORE_HARDWARE_SKIPS_ONLY=1``; then every other skip fails the run, listed one line each (test, reason).
With ``KTCORE_LLAMAFACTORY=0`` (the documented opt-out of building ``.venv-llamafactory``) the skips naming that
environment are allowed too.

Both conftests (tests/ and frontends/llamafactory/tests/) import its two hooks.
"""

from __future__ import annotations

import os
import re

import pytest

ENV = "KTCORE_HARDWARE_SKIPS_ONLY"

# What a machine may lack without anything being wrong with the checkout or its setup. Matched against the skip's
# reason, so every hardware skip must say what it needs (they do: "needs a CUDA GPU", "cannot use AMX", ...).
HARDWARE = re.compile(r"\bCUDA\b|\bGPU\b|\bAMX\b|AVX-?512|\bVNNI\b|transparent huge pages|amx_tile|amx_int8 "
                      r"cannot|amx_bf16 cannot", re.IGNORECASE)
# Node.js is the one machine-level tool a test needs that no Python setup can bring (the optional llama.cpp tests,
# tests/llamacpp); once node is there, node-llama-cpp missing is setup's fault and not allowed.
NO_NODE = re.compile(r"^node is not installed")
LLAMAFACTORY_ENV = re.compile(r"\.venv-llamafactory|llamafactory is not importable")

_offenders_key = pytest.StashKey[list]()


def allowed(reason: str, llamafactory_opted_out: bool = False) -> bool:
    """Whether a skip with this reason is one the README allows on a plain clone."""
    return bool(HARDWARE.search(reason) or NO_NODE.search(reason) or
                (llamafactory_opted_out and LLAMAFACTORY_ENV.search(reason)))


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def offenders(reports, llamafactory_opted_out: bool = False) -> list[str]:
    """One line per skip report whose reason is not allowed: ``test id: reason``."""
    lines = []
    for report in reports:
        reason = _reason(report)
        if not allowed(reason, llamafactory_opted_out):
            lines.append(f"{report.nodeid or report.fspath}: {reason}")
    return sorted(set(lines))


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get(ENV) != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    reports = reporter.stats.get("skipped", []) if reporter is not None else []
    bad = offenders(reports, os.environ.get("KTCORE_LLAMAFACTORY") == "0")
    session.config.stash[_offenders_key] = bad
    if bad and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    bad = config.stash.get(_offenders_key, [])
    if bad:
        terminalreporter.section(f"{ENV}=1: {len(bad)} skip(s) not for hardware", sep="=", red=True)
        for line in bad:
            terminalreporter.write_line(line)
        terminalreporter.write_line("Make them run here (install what they need in scripts/setup.sh, generate "
                                    "their data), or, for hardware, say what they need in the skip's reason.")
