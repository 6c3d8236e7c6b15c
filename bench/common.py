"""What every bench shares: where things are, and the header line that puts the date, the
machine's kind and the command beside each figure (the rule for bench/results/)."""

from __future__ import annotations

import argparse
import os
import resource
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT2_VOCAB = ROOT.parent / "shared" / "tokenizers" / "gpt2.tiktoken"
"""The GPT-2 vocabulary beside the checkout (tests and CI have it; tiktoken's download may not)."""
RESULTS = ROOT / "bench" / "results"


def exit_on_sigterm() -> None:
    """A `kill` of a bench raises SystemExit, on which subprocess.run kills the run it waits on:
    by default the bench died alone and its training run went on sharing the cores."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def machine(device: str = "cpu") -> str:
    """The kind of machine a figure comes from: the GPU's name, or the CPU's model and ISA."""
    if device == "cuda":
        import torch

        return f"GPU: {torch.cuda.get_device_name()}"
    from lmforge.pipeline.cpu.machine import cpu_capability, cpu_model

    return f"CPU: {cpu_model()} {cpu_capability()} ({os.cpu_count()} cores)"


def header(device: str = "cpu") -> str:
    """`# bench.NAME, DATE UTC, MACHINE, command: ...`: the first line of every result."""
    name = Path(sys.argv[0]).stem
    return (f"# bench.{name}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{machine(device)}, command: python -m bench.{name} {' '.join(sys.argv[1:])}")


def add_model_args(p: argparse.ArgumentParser, d_model: int, n_layer: int, n_head: int) -> None:
    """The model and batch flags the training benches share, with each bench's default size."""
    p.add_argument("--d-model", type=int, default=d_model)
    p.add_argument("--n-layer", type=int, default=n_layer)
    p.add_argument("--n-head", type=int, default=n_head)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--data", type=Path, help="a prepared dataset of --vocab ids (default: "
                   "prepare one from the built-in corpus)")
    p.add_argument("--out", type=Path, help="also write the table to this file")


def emit(lines: list[str], out: Path | None) -> None:
    """Print a bench's result, and write it to `out` (bench/results/...) when given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        out.write_text(text)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def memory_mb(device: str, peak: bool) -> float:
    """The process's memory now or at its peak: RSS on CPU (Linux), allocated tensors on CUDA
    (torch is imported only then: prepare_bench's child reads its RSS without it)."""
    if device.startswith("cuda"):
        import torch

        fn = torch.cuda.max_memory_allocated if peak else torch.cuda.memory_allocated
        return fn(device) / 2**20
    # Not ru_maxrss: Linux carries it across exec, so a worker would report its parent's peak.
    key = "VmHWM:" if peak else "VmRSS:"
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024


def memory_kind(device: str) -> str:
    """What memory_mb(device, peak=True) reads."""
    return "torch.cuda.max_memory_allocated" if device.startswith("cuda") else "peak RSS"
