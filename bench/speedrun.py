"""Speedrun: steps, tokens and wall-clock for Muon to reach AdamW's final validation loss.

    python -m bench.speedrun                       # 3 seeds x (adamw, muon), ~32 min on 2 cores
    python -m bench.speedrun --seeds 5 --steps 200 --muon "--optim.lr 0.03"
    python -m bench.speedrun --report-only         # the table again, from the runs in --out

The demo's data (builtin:pystdlib, BPE 4096, prepared once into --data) and model
(configs/tiny.toml: Muon at its lrs; AdamW at 3e-3), in fp32, trained by the pipeline itself (pipeline.train.Trainer, one process).
Both optimizers see the same seed, the same batches in the same order and the same token budget,
and are evaluated on the same val tokens every --eval-every steps. For each seed the target is
AdamW's final val loss; a run reaches it at the first evaluation at or below it. Wall-clock is the
sum of the training steps' times (evaluation excluded), and the steps times the run's median step
time, which a burst of load from another process cannot move; the two optimizers interleaved
seed after seed: only ratios mean anything on a shared machine.

The preset's batch (8,192 tokens) for half its steps (--steps 100, ~2.8 s per step when the 2
cores are free), warmup scaled to 10 steps, 8192 eval tokens every 5 steps.
Prints a table (mean and spread over seeds) and writes OUT/speedrun.png and OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench.common import ROOT

os.environ.setdefault("WANDB_MODE", "disabled")


def prepare_data(data: Path) -> Path:
    from lmforge.launch.prepare import main as prepare

    if not (data / "manifest.json").is_file():
        rc = prepare(["--source", "builtin:pystdlib", "--tokenizer", "bpe:4096", "--out", str(data),
                      "--quiet"])
        if rc != 0:
            sys.exit(f"error: preparing {data} failed (exit {rc})")
    return data


def train_one(data: Path, out: Path, seed: int, args, extra: list[str]) -> None:
    """One run through the pipeline's own Trainer; its metrics land in OUT/metrics.jsonl."""
    import torch

    from lmforge.pipeline.config import load_config
    from lmforge.pipeline.parallel.distributed import DistInfo
    from lmforge.pipeline.train import Trainer

    overrides = [
        "--data.path", str(data), "--log.out_dir", str(out), "--train.seed", str(seed),
        "--train.max_steps", str(args.steps), "--train.global_batch_tokens", str(args.batch_tokens),
        "--train.dtype", "fp32", "--optim.warmup_steps", str(max(1, args.steps // 10)),
        "--eval.every", str(args.eval_every), "--eval.tokens", str(args.eval_tokens),
        "--sample.every", "0", "--sample.max_new_tokens", "1", "--checkpoint.every", "0",
        "--log.log_every", "1", *extra,
    ]
    cfg = load_config(ROOT / "configs" / "tiny.toml", overrides)
    Trainer(cfg, DistInfo(0, 0, 1, torch.device("cpu"))).fit()


def read_records(out: Path) -> list[dict]:
    from lmforge.pipeline.checkpoint.run_dir import RunDir

    return [json.loads(ln) for ln in RunDir(out).metrics.read_text().splitlines()]


def step_seconds(r: dict) -> float:
    return r["tokens"] / r["step"] / r["tokens_per_s"]  # this step's time: batch / rate


def reach(records: list[dict], target: float) -> dict | None:
    """Step, tokens and training seconds at the first evaluation with val loss <= target.

    seconds: the steps' measured times summed; typical_seconds: steps x the run's median step
    time, which a burst of load from another process on a shared machine does not move."""
    seconds = 0.0
    median_step = statistics.median(step_seconds(r) for r in records if "tokens_per_s" in r)
    for r in records:
        seconds += step_seconds(r)
        if r.get("val_loss", float("inf")) <= target:
            return {"step": r["step"], "tokens": r["tokens"], "seconds": seconds,
                    "typical_seconds": r["step"] * median_step, "median_step_s": median_step}
    return None


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.3f} ± {sd:.3f}"


def plot(curves: dict[str, list[list[tuple[int, float]]]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for (name, runs), color in zip(curves.items(), ("tab:blue", "tab:red"), strict=False):
        for i, points in enumerate(runs):
            steps, losses = zip(*points, strict=True)
            ax.plot(steps, losses, "o-", color=color, markersize=3, alpha=0.7,
                    label=name if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("val loss (nats/token), same val tokens")
    ax.set_title("speedrun: AdamW vs Muon (one line per seed)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def print_table(rows: list[dict], args, variants: dict, t0: float) -> None:
    """One line per seed (the steps and seconds each optimizer took to AdamW's final val loss)
    and the ratios' mean and spread."""
    print(f"\nspeedrun: configs/tiny.toml model, {args.steps} steps x {args.batch_tokens} tokens, "
          f"fp32, eval {args.eval_tokens} val tokens every {args.eval_every} steps; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          + ("reported from the runs in OUT" if args.report_only else
             f"load {os.getloadavg()[0]:.1f}; total {time.perf_counter() - t0:.0f} s"))
    print(f"muon overrides: {variants['muon']}")
    print(f"{'seed':>6} {'target':>8} {'adamw step':>10} {'muon step':>9} {'muon final':>10} "
          f"{'step ratio':>10} {'time ratio':>10} {'at median':>10}")
    step_ratios, time_ratios, typical_ratios = [], [], []
    for r in rows:
        if r["muon"] is None:
            print(f"{r['seed']:>6} {r['target']:>8.4f} {r['adamw']['step']:>10} {'never':>9} "
                  f"{r['muon_final']:>10.4f}")
            continue
        step_ratios.append(r["muon"]["step"] / r["adamw"]["step"])
        time_ratios.append(r["muon"]["seconds"] / r["adamw"]["seconds"])
        typical_ratios.append(r["muon"]["typical_seconds"] / r["adamw"]["typical_seconds"])
        print(f"{r['seed']:>6} {r['target']:>8.4f} {r['adamw']['step']:>10} {r['muon']['step']:>9} "
              f"{r['muon_final']:>10.4f} {step_ratios[-1]:>10.3f} {time_ratios[-1]:>10.3f} "
              f"{typical_ratios[-1]:>10.3f}  (median step {r['adamw']['median_step_s']:.2f} s "
              f"adamw, {r['muon']['median_step_s']:.2f} s muon)")
    if len(step_ratios) == len(rows):
        print(f"muon / adamw to reach adamw's final val loss: steps (= tokens) {spread(step_ratios)}"
              f", wall-clock {spread(time_ratios)} summed, {spread(typical_ratios)} at the median "
              f"step time  (mean ± sd over {len(rows)} seeds; targets <= 0.7 and <= 0.8)")
    else:
        print(f"muon did not reach adamw's final val loss in {len(rows) - len(step_ratios)} of "
              f"{len(rows)} seeds")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=ROOT / "runs" / "speedrun" / "data",
                   help="prepared builtin:pystdlib (BPE 4096), created when missing")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "speedrun")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--adamw", default="", help="extra overrides for the AdamW runs")
    p.add_argument("--muon", default="", help="extra overrides for the Muon runs")
    p.add_argument("--report-only", action="store_true",
                   help="report the runs already in OUT/runs (same arguments) without training")
    args = p.parse_args()

    data = None if args.report_only else prepare_data(args.data)
    # AdamW at 3e-3 for every group (0 = optim.lr), configs/tiny.toml's before it took Muon.
    variants = {"adamw": ["--optim.name", "adamw", "--optim.lr", "3e-3", "--optim.embed_lr", "0",
                          "--optim.scalar_lr", "0", *shlex.split(args.adamw)],
                "muon": ["--optim.name", "muon", *shlex.split(args.muon)]}
    t0 = time.perf_counter()
    records: dict[str, list[list[dict]]] = {name: [] for name in variants}
    for i in range(args.seeds):
        order = list(variants) if i % 2 == 0 else list(variants)[::-1]  # interleave the load
        for name in order:
            out = args.out / "runs" / f"{name}_seed{i}"
            if args.report_only:
                records[name].append(read_records(out))
                continue
            shutil.rmtree(out, ignore_errors=True)
            train_one(data, out, 1337 + i, args, variants[name])
            records[name].append(read_records(out))

    rows = []
    for i in range(args.seeds):
        final = [r for r in records["adamw"][i] if "val_loss" in r][-1]
        target = final["val_loss"]
        ref = reach(records["adamw"][i], target)
        got = reach(records["muon"][i], target)
        rows.append({"seed": 1337 + i, "target": target, "adamw": ref, "muon": got,
                     "muon_final": [r for r in records["muon"][i] if "val_loss" in r][-1]["val_loss"]})

    print_table(rows, args, variants, t0)
    curves = {name: [[(r["step"], r["val_loss"]) for r in recs if "val_loss" in r] for recs in runs]
              for name, runs in records.items()}
    plot(curves, args.out / "speedrun.png")
    (args.out / "results.json").write_text(json.dumps({"rows": rows, "curves": curves}, indent=1))
    print(f"wrote {args.out / 'speedrun.png'} and {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
