"""What a CPU can do: its model and ISA flags, whether it computes bf16 natively (the flag rule,
or LMFORGE_CPU_BF16), and its measured matmul peak (what MFU on a CPU is relative to)."""

from __future__ import annotations

import functools
import os
import time
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


def _matmul_rate(n: int, dtype: torch.dtype, budget_s: float, min_reps: int = 2) -> float:
    """Best FLOP/s of an n x n x n matmul after one warm-up, over `min_reps` or `budget_s`."""
    a_NN, b_NN = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a_NN @ b_NN  # warm-up: first call pays for allocation and kernel selection
    best, reps, deadline = 0.0, 0, time.perf_counter() + budget_s
    while reps < min_reps or time.perf_counter() < deadline:
        t = time.perf_counter()
        a_NN @ b_NN
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
        reps += 1
    return best


# Largest square matmul tried: 4096^3 fp32 is past where a CPU's matmul reaches its peak; sizes
# grow until one product takes longer than _STEP_S, so the measurement stays short even where
# bf16 is emulated (there the small sizes already pass it).
_SIZES = (256, 512, 1024, 2048, 4096)
_STEP_S = 0.25


@functools.cache
def cpu_peak(dtype: torch.dtype) -> tuple[float, str]:
    """This CPU's measured matmul peak in `dtype` (FLOP/s), and the line that says so."""
    best, biggest = 0.0, _SIZES[0]
    for n in _SIZES:
        rate = _matmul_rate(n, dtype, budget_s=0.2)
        best, biggest = max(best, rate), n
        if 2 * n**3 / rate > _STEP_S:
            break
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    return best, (f"MFU relative to this CPU's measured {name} matmul peak, {best / 1e9:.0f} "
                  f"GFLOP/s (best up to {biggest}^3, {torch.get_num_threads()} threads)")
