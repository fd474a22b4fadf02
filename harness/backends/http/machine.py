"""This machine's CPU instruction-set flags, which decide the attention backend an engine picks
(harness/specs/attention_backends.py): read from /proc/cpuinfo, or from $HARNESS_CPU_FLAGS (a comma-separated list)
to plan the cells of another machine (a CI box with AMX) from this one."""

from __future__ import annotations

import os
from pathlib import Path

from harness.core.errors import ConfigError

CPU_FLAGS_ENV = "HARNESS_CPU_FLAGS"
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The flags of the first processor in `cpuinfo` ($HARNESS_CPU_FLAGS wins); empty where there is no such file
    (another platform: no rule that needs a flag applies)."""
    override = os.environ.get(CPU_FLAGS_ENV)
    if override is not None:
        flags = [f.strip() for f in override.split(",") if f.strip()]
        bad = [f for f in flags if not f.replace("_", "").isalnum()]
        if bad:
            raise ConfigError(f"{CPU_FLAGS_ENV}={override!r}: {bad[0]!r} is not a CPU flag name; give a "
                              f"comma-separated list such as amx_bf16,amx_tile,avx512f")
        return frozenset(flags)
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86-64, AArch64
            return frozenset(value.split())
    return frozenset()
