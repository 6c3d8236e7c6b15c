"""One training configuration of bench/train_bench.py run from two checkouts, interleaved round
after round, and the paired ratio: what a change did to lmforge's step on this machine.

    python -m bench.ab --base /path/to/other/checkout              # eager, shapes A and B
    python -m bench.ab --base ../old --shapes A --compiled --rounds 5

Each round runs this checkout and the base, in alternating order, each a fresh train_bench worker
(its own process, its own PYTHONPATH); the ratio is this checkout's tok/s over the base's in the
same round, and the median over rounds is the figure (on a shared host a round's load hits both).
The worker's JSON takes only the fields both checkouts know (train_bench.Run's shape fields).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT, machine
from bench.train_bench import FULL, SHAPES


def run_worker(checkout: Path, run: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    res = subprocess.run([sys.executable, "-m", "bench.train_bench", "--worker", json.dumps(run)],
                         capture_output=True, text=True, env=env, cwd=checkout)
    if res.returncode != 0:
        raise SystemExit(f"error: the worker in {checkout} exited {res.returncode}:\n"
                         f"{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the other checkout (the reference)")
    p.add_argument("--shapes", nargs="+", default=["A", "B"], choices=sorted(SHAPES))
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="auto: what train.dtype = auto picks on this CPU")
    a = p.parse_args()
    import torch

    from lmforge.pipeline import attention
    from lmforge.pipeline.hardware import dtype_name, resolve_dtype

    dtype = resolve_dtype(a.dtype, torch.device("cpu"))
    # Both checkouts run the kernel this one's train.attention = auto picks (a base that chose by
    # timing would otherwise time its own choice).
    kernel = attention.resolve("auto", torch.device("cpu"), dtype, FULL["seq_len"])
    a.dtype = dtype_name(dtype)
    print(f"{machine('cpu')}; this checkout {ROOT} vs base {a.base}; lmforge "
          f"{'compiled' if a.compiled else 'eager'}, {a.dtype}, attention {kernel}, {a.rounds} rounds")
    for shape in a.shapes:
        run = dict(impl="lmforge", vocab=SHAPES[shape], compiled=a.compiled, device="cpu",
                   dtype=a.dtype, profile=False, attention=kernel, **FULL)
        ratios, seen = [], {"new": [], "base": []}
        for i in range(a.rounds):
            order = [("new", ROOT), ("base", a.base)][:: 1 if i % 2 == 0 else -1]
            got = {who: run_worker(where, run) for who, where in order}
            for who in seen:
                seen[who].append(got[who])
            ratios.append(got["new"]["tok_s"] / got["base"]["tok_s"])
            print(f"  [{shape} round {i}: new {got['new']['tok_s']:.0f}, base "
                  f"{got['base']['tok_s']:.0f} tok/s]", file=sys.stderr, flush=True)
        peak = {who: statistics.median(r["peak_mb"] for r in rs) for who, rs in seen.items()}
        print(f"{shape}: new / base tok/s = {statistics.median(ratios):.3f}x (median of "
              f"{len(ratios)} paired rounds: {' / '.join(f'{x:.2f}' for x in ratios)}); peak "
              f"RSS {peak['new']:.0f} vs {peak['base']:.0f} MB")


if __name__ == "__main__":
    main()
