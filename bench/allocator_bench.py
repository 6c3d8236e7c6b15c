"""Does the CPU allocator policy of training pay, and does the RSS stay flat over a long run?

lmforge's training step at bench/train_bench.py's shapes, each run a fresh process, two ways in
interleaved rounds: as the pipeline runs (pipeline.hardware.set_cpu_allocator "keep", switched
on after the optimizer's first step) and with glibc's defaults (the policy not applied: setting
any MALLOC_*_ variable would also stop glibc adjusting its mmap threshold). Per way: median
tok/s, page faults per step, the RSS after the warm-up steps and after the last, and the peak
RSS; then the ratio kept / default of each, measured in the same run.

    python -m bench.allocator_bench                       # A and B, eager and compiled, 3 rounds
    python -m bench.allocator_bench --shapes B --eager --steps 300 --rounds 1   # the RSS over time
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace

from bench import train_bench as tb
from bench.common import ROOT, header, memory_mb, minor_faults

WARMUP = 3


def worker(r: tb.Run, glibc_default: bool) -> dict:
    if glibc_default:
        from pipeline import hardware

        hardware.set_cpu_allocator = lambda mode: False
    one_step = tb.training_step(r)
    times, faults, rss = [], [], []
    for _ in range(r.steps):
        f0, t0 = minor_faults(), time.perf_counter()
        one_step()
        times.append(time.perf_counter() - t0)
        faults.append(minor_faults() - f0)
        rss.append(memory_mb(r.device, peak=False))
    return {"tok_s": r.batch * r.seq_len / statistics.median(times[WARMUP:]),
            "faults": statistics.median(faults[WARMUP:]), "rss_warm": rss[WARMUP - 1],
            "rss_last": rss[-1], "peak": memory_mb(r.device, peak=True)}


def measure(r: tb.Run, glibc_default: bool) -> dict:
    cmd = [sys.executable, "-m", "bench.allocator_bench", "--worker", json.dumps(asdict(r))]
    out = subprocess.run(cmd + ["--glibc-default"] * glibc_default, capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="AB")
    p.add_argument("--eager", action="store_true", help="eager runs only")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="steps per run, the first 3 warm-up")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--glibc-default", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(tb.Run(**json.loads(a.worker)), a.glibc_default)))
        return

    import torch

    from pipeline import attention
    from pipeline.hardware import DTYPES, auto_dtype, dtype_name

    cpu = torch.device("cpu")
    dtype = auto_dtype(cpu)[0] if a.dtype == "auto" else DTYPES[a.dtype]
    base = tb.Run("lmforge", 0, False, "cpu", dtype_name(dtype), a.steps, profile=False, **tb.FULL)
    base = replace(base, attention=attention.choose(base.model_config(), base.batch,
                                                    base.seq_len, dtype, cpu)[0])
    print(header())
    print(f"lmforge, {dtype_name(dtype)}, train.attention {base.attention}, batch {base.batch}, "
          f"T {base.seq_len}; {a.rounds} interleaved rounds of {a.steps} steps ({WARMUP} warm-up)")
    ways = {"kept": False, "default": True}  # way -> glibc_default
    configs = [(s, c) for s in a.shapes.upper() for c in ((False,) if a.eager else (False, True))]
    res = {(s, c, w): [] for s, c in configs for w in ways}
    for _ in range(a.rounds):
        for s, c in configs:
            for w, glibc_default in ways.items():
                res[s, c, w].append(measure(replace(base, vocab=tb.SHAPES[s], compiled=c),
                                            glibc_default))
    keys = ("tok_s", "faults", "rss_warm", "rss_last", "peak")
    print(f"{'shape':5} {'config':9} {'malloc':8} " + " ".join(f"{k:>9}" for k in keys))
    for s, c in configs:
        med = {w: {k: statistics.median(r[k] for r in res[s, c, w]) for k in keys} for w in ways}
        for w in ways:
            print(f"{s:5} {'compiled' if c else 'eager':9} {w:8} "
                  + " ".join(f"{med[w][k]:9.0f}" for k in keys))
        ratio = {k: med["kept"][k] / med["default"][k] for k in ("tok_s", "peak")}
        print(f"{s:5} {'compiled' if c else 'eager':9} kept / default: "
              f"tok/s {ratio['tok_s']:.2f}x, peak RSS {ratio['peak']:.2f}x; RSS from step {WARMUP} to {a.steps}: "
              f"{med['kept']['rss_last'] - med['kept']['rss_warm']:+.0f} MB kept, "
              f"{med['default']['rss_last'] - med['default']['rss_warm']:+.0f} MB default")


if __name__ == "__main__":
    main()
