"""A CPU's measured matmul peak, what train_bench reads its CPU MFU against (a CPU has no
datasheet peak, so training reports no MFU there)."""

from __future__ import annotations

import functools
import time

import torch

# Largest square matmul tried: 4096^3 fp32 is past where a CPU's matmul reaches its peak; sizes
# grow until one product takes longer than _STEP_S, so the measurement stays short even where
# bf16 is emulated (there the small sizes already pass it).
_SIZES = (256, 512, 1024, 2048, 4096)
_STEP_S = 0.25


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


@functools.cache
def cpu_peak(dtype: torch.dtype) -> float:
    """This CPU's measured matmul FLOP/s in `dtype` (cached: cache_clear() measures again)."""
    best = 0.0
    for n in _SIZES:
        rate = _matmul_rate(n, dtype, budget_s=0.2)
        best = max(best, rate)
        if 2 * n**3 / rate > _STEP_S:
            break
    return best
