"""What a profiled op is (matmul, attention, softmax, ...), and a step's matmul time from the
profiler: shared by bench/train_bench.py (the non-matmul milliseconds of its table) and
bench/profile_step.py (the full breakdown)."""

from __future__ import annotations

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
