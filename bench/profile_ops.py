"""What a profiled op is (matmul, attention, softmax, ...), and a step's matmul time from the
profiler: shared by bench/train_bench.py (the non-matmul milliseconds of its table) and
profiled ops by kind."""

from __future__ import annotations

import statistics
import time

# First matching substring of the op name wins.
CATEGORIES = [
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
                "mkldnn::_linear_pointwise", "mkl_linear", "onednn.qlinear")),
    ("attention", ("scaled_dot_product", "flash_attention")),
    ("softmax / cross-entropy", ("softmax", "logsumexp", "nll_loss", "cross_entropy", "aten::exp",
                                 "aten::gather", "aten::scatter")),
    ("optimizer", ("_foreach", "adam", "Optimizer.step", "clip_grad", "aten::norm",
                   "linalg_vector_norm")),
    ("compiled kernels (fused)", ("CompiledFunction", "Torch-Compiled Region", "cpp_fused",
                                  "graph_")),
    ("embedding", ("embedding",)),
    ("copies / allocation", ("aten::copy_", "aten::empty", "aten::zeros", "aten::zero_",
                             "aten::fill_", "aten::clone", "aten::cat", "aten::contiguous",
                             "aten::to", "aten::_to_copy")),
]


def category(op: str) -> str:
    low = op.lower()
    for cat, keys in CATEGORIES:
        if any(k.lower() in low for k in keys):
            return cat
    return "other elementwise / framework"


def self_time_us(event, device: str) -> float:
    return event.self_device_time_total if device.startswith("cuda") else event.self_cpu_time_total


def profile_steps(one_step, steps: int, device: str):
    """torch.profiler's per-op averages over `steps` calls of one_step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            one_step()
    return prof.key_averages()


def matmul_ms(one_step, steps: int, device: str) -> float:
    """Milliseconds per step the profiler counts in matmul kernels (self time)."""
    events = profile_steps(one_step, steps, device)
    return sum(self_time_us(e, device) for e in events if category(e.key) == "matmul") / steps / 1e3


def paired_matmul_ms(one_step, pairs: int, device: str) -> tuple[float, float]:
    """(matmul ms, non-matmul ms) of a step: the medians over `pairs` of an unprofiled step's
    time and the next, profiled step's matmul time. The profiler slows the framework, not the
    kernels: a step's matmuls as profiled, taken from its unprofiled neighbour's time, leave
    what is not matmul (what compile and fusion can cut), each pair seconds apart, so a shared
    host's drift between the timed steps and the profiled ones stays out of the difference."""
    mm, other = [], []
    for _ in range(pairs):
        t0 = time.perf_counter()
        one_step()
        step_ms = (time.perf_counter() - t0) * 1e3
        mm.append(matmul_ms(one_step, 1, device))
        other.append(step_ms - mm[-1])
    return statistics.median(mm), statistics.median(other)
