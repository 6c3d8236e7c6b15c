"""Where a training step's time goes: torch.profiler over steady-state steps of one configuration
of bench/train_bench.py (same model, batch and step), grouped into what compile can and cannot
change, plus the page faults a step takes (a CPU allocator returning big tensors to the OS costs
a fault per 4 KiB page the next time they are allocated).

    python -m bench.profile_step lmforge --shape A            # eager
    python -m bench.profile_step hf --shape A --compile
    python -m bench.profile_step lmforge --shape A --compile --kernels   # each fused kernel
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from bench import train_bench as tb
from bench.common import minor_faults
from bench.profile_ops import category, profile_steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("impl", choices=["lmforge", "gpt2", "hf"])
    p.add_argument("--shape", choices=list(tb.SHAPES), default="A")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--smoke", action="store_true", help="train_bench's tiny shapes: the code path")
    p.add_argument("--kernels", action="store_true", help="with --compile: time each kernel "
                   "inductor writes (its kernel profile) instead of one call per compiled graph, "
                   "whose self time is then its Python wrapper's alone")
    a = p.parse_args()

    import torch

    if a.kernels:
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True

    from pipeline.hardware import auto_dtype, dtype_name

    shapes, dims = (tb.SMOKE_SHAPES, tb.SMOKE) if a.smoke else (tb.SHAPES, tb.FULL)
    vocab = shapes[a.shape]
    device = torch.device("cpu")
    dtype = dtype_name(auto_dtype(device)[0]) if a.dtype == "auto" else a.dtype
    run = tb.Run(a.impl, vocab, a.compile, str(device), dtype, **dims)
    one_step = tb.training_step(run)
    for _ in range(2):
        one_step()
    faults0, t0 = minor_faults(), time.perf_counter()
    for _ in range(a.steps):
        one_step()
    wall = (time.perf_counter() - t0) / a.steps
    faults = (minor_faults() - faults0) / a.steps
    events = profile_steps(one_step, a.steps, str(device))
    total = sum(e.self_cpu_time_total for e in events) / a.steps
    by_cat = defaultdict(float)
    for e in events:
        by_cat[category(e.key)] += e.self_cpu_time_total / a.steps
    print(f"{a.impl} {'compiled' if a.compile else 'eager'} shape {a.shape} (V {vocab}, "
          f"{run.dtype}): {wall * 1e3:.0f} ms/step unprofiled, {run.batch * run.seq_len / wall:.0f} tok/s, "
          f"{faults:.0f} minor page faults/step ({faults * 4 / 1024:.0f} MiB faulted in)")
    print(f"self CPU time per step by category (profiled, {total / 1e3:.0f} ms):")
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:32} {us / 1e3:8.1f} ms  {us / total:6.1%}")
    print(f"top {a.top} ops by self CPU time per step:")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: a.top]:
        print(f"  {e.key[:60]:60} {e.self_cpu_time_total / a.steps / 1e3:8.1f} ms "
              f"x{e.count // a.steps:<5} [{category(e.key)}]")


if __name__ == "__main__":
    main()
