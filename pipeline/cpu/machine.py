"""What a CPU can do: its model and ISA flags, and whether it computes bf16 natively (the flag
rule, or LMFORGE_CPU_BF16)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

FORCE_ENV = "LMFORGE_CPU_BF16"
# CPU flags (Linux /proc/cpuinfo) that mean bf16 dot products in hardware: x86 AVX512-BF16 and
# AMX, Arm's BF16 extension. Without them oneDNN emulates bf16 with fp32 conversions, ~400x
# slower than fp32 on the AVX2 kind (bench/results/README.md).
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def _cpuinfo(field: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    import platform

    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    # x86 names them "flags", Arm "Features".
    return set((_cpuinfo("flags") or _cpuinfo("Features") or "").split())


def cpu_capability() -> str:
    """The widest vector ISA torch dispatches to here, plus what bf16 hardware the CPU has."""
    extra = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in cpu_flags()]
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{capability} ({', '.join(extra)})" if extra else capability


def native_bf16() -> tuple[bool, str]:
    """Whether this CPU computes bf16 matmuls natively, and why. LMFORGE_CPU_BF16=native|emulated
    forces the answer (tests, or a user who knows better); a ValueError names a bad value."""
    forced = os.environ.get(FORCE_ENV, "").strip().lower()
    if forced:
        if forced not in ("native", "emulated"):
            raise ValueError(f"{FORCE_ENV}={forced!r}: use native or emulated, or unset it")
        return forced == "native", f"forced by {FORCE_ENV}={forced}"
    found = [f for f in BF16_FLAGS if f in cpu_flags()]
    if found:
        return True, f"this CPU computes bf16 natively ({', '.join(found)})"
    return False, "this CPU has no native bf16 (no avx512_bf16/amx_bf16 flag: bf16 is emulated)"
