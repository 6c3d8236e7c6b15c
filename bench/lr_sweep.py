"""Learning rates across widths: each lr group on a x2 log grid around a centre, at several
d_model, for each group's optimum and the width rule under which it moves least.

    nice -n 19 python -m bench.lr_sweep                  # run what the ledger lacks, then report
    python -m bench.lr_sweep --report-only               # the table from the ledger
    nice -n 19 python -m bench.lr_sweep --untied --coords head --rule   # an LM head's lr
    nice -n 19 python -m bench.lr_sweep --widths 128 --batch 4 [--steps 200]   # 4x the batch

configs/tiny.toml's run (4 layers, head_dim 64, KV heads half the heads, seq 256, 8,192 tokens a
step, 200 steps) on builtin:pystdlib with the demo's 4,096-id BPE, at each --widths d_model. A
coordinate grid: one coordinate (--coords: a group's lr, or groups joined by '+' moved together)
at CENTRE x 2^k for each k of --ks, the others at CENTRE; one run at a time. A run's result is its
final val loss, kept in --ledger (committed, bench/results/lr_sweep_zen4_runs.jsonl): a run there
is not run again. The answered question's figures: bench/results/lr_sweep_*zen4.txt (the
adaptive scheduler that ran them, with its bracket walks and job pool, is in git history).
A run sets optim.lr_ref_width itself (0, or --ref-width under --rule), never tiny.toml's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, exit_on_sigterm, header, machine
from bench.optimum import vertex
from lmforge.pipeline.checkpoint.run_dir import RunDir
from lmforge.pipeline.metrics import read_records

KEYS = {"matrix": "optim.lr", "embed": "optim.embed_lr", "head": "optim.head_lr",
        "scalar": "optim.scalar_lr"}
CENTRE = {  # configs/tiny.toml's lrs (Muon) when the sweep began; AdamW's a guess
    "muon": {"matrix": 0.02, "embed": 0.03, "head": 0.03, "scalar": 0.03},
    "adamw": {"matrix": 0.003, "embed": 0.05, "head": 0.003, "scalar": 0.05},
}
FIXED = {"muon": [], "adamw": ["--optim.weight_decay", "0.1"]}  # AdamW decays the matrices too
STEPS, TOKENS, WARMUP = 200, 8192, 20  # tiny.toml's run (--batch, --steps: a run of other shape)
MAX_K = 4  # the grid's reach: x2^-4 .. x2^4 around the centre
EXPONENTS = (0, -0.5, -1)  # width rules compared: none, nanochat's AdamW groups', muP's hidden


def lrs_of(centre: dict[str, float], coord: str, k: int) -> dict[str, float]:
    """Every group's lr in the run that moves `coord` by 2^k."""
    return {g: lr * (2.0 ** k if g in coord.split("+") else 1) for g, lr in centre.items()}


def family(a) -> str:
    """The runs' name prefix: the optimizer, then what differs from its tied runs around CENTRE
    at tiny.toml's batch without the rule (the ledger's names)."""
    moved = "".join(f"-{g}{lr:g}" for g, lr in a.centre.items() if lr != CENTRE[a.optimizer][g])
    return (a.optimizer + ("-untied" if a.untied else "") + moved + (f"-rule{a.rule}" if a.rule else "")
            + (f"-batch{a.batch}" if a.batch > 1 else "")
            + (f"-steps{a.steps}" if a.steps * a.batch != STEPS else ""))


def run_name(a, width: int, seed: int, coord: str, k: int) -> str:
    return f"{family(a)}_d{width}_s{seed}_" + ("centre" if k == 0 else f"{coord}{k:+d}")


def run_cmd(a, out: Path, width: int, seed: int, coord: str, k: int) -> list[str]:
    heads = width // 64
    lrs = [f for g, lr in lrs_of(a.centre, coord, k).items() if g != "head" or a.untied
           for f in (f"--{KEYS[g]}", repr(lr))]
    return [sys.executable, "-m", "lmforge.launch.train",
            "--config", str(ROOT / "configs" / "tiny.toml"), "--data.path", str(a.data),
            "--log.out_dir", str(out), "--optim.name", a.optimizer,
            "--model.d_model", str(width), "--model.n_head", str(heads),
            "--model.n_kv_head", str(max(1, heads // 2)),
            "--model.tie_embeddings", "false" if a.untied else "true",
            "--train.seed", str(seed), "--train.max_steps", str(a.steps),
            "--train.global_batch_tokens", str(TOKENS * a.batch),
            "--optim.warmup_steps", str(WARMUP * a.steps // STEPS),
            "--sample.every", "0", "--eval.every", "0", "--eval.tasks_every", "0",
            "--checkpoint.every", "0", "--log.log_every", "50", *FIXED[a.optimizer],
            *lrs, "--optim.lr_ref_width", str(a.rule)]


def model_lrs(a, width: int, lrs: dict[str, float]) -> dict[str, float]:
    """The lrs a run at `width` trains with: pipeline/optim/lrs.py's rule (off where a.rule = 0)."""
    from lmforge.pipeline.config import OptimConfig
    from lmforge.pipeline.optim.lrs import width_factor

    rule = OptimConfig(name=a.optimizer, lr_ref_width=a.rule)
    return {g: lr * width_factor(rule, g, width) for g, lr in lrs.items()}


def ledger(a) -> dict[str, dict]:
    if not a.ledger.is_file():
        return {}
    return {(r := json.loads(ln))["run"]: r for ln in a.ledger.read_text().splitlines() if ln}


def run_one(a, width: int, seed: int, coord: str, k: int) -> None:
    name, lrs = run_name(a, width, seed, coord, k), lrs_of(a.centre, coord, k)
    out = a.runs / name
    subprocess.run(run_cmd(a, out, width, seed, coord, k), cwd=ROOT, check=True,
                   env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, timeout=a.timeout)
    loss = next(r["val_loss"] for r in read_records(RunDir(out).metrics) if r.get("step") == a.steps and "val_loss" in r)
    record = {"run": name, "val_loss": loss, "optimizer": a.optimizer, "untied": a.untied,
              "d_model": width, "seed": seed, "coord": coord, "k": k, "lrs": lrs,
              "lr_ref_width": a.rule, "model_lrs": model_lrs(a, width, lrs), "steps": a.steps,
              "machine": machine(), "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with a.ledger.open("a") as f:
        f.write(json.dumps(record) + "\n")


def report(a) -> list[str]:
    """Each (coord, width)'s grid (mean final val loss over the seeds every one finished) and its
    optimum: the vertex of the parabola in log2(lr) through the best point and its neighbours;
    moved = log2 of its ratio to the narrowest width's, less what each exponent predicts."""
    done, best = ledger(a), {}
    lines = [header(), f"# {family(a)}: {', '.join(a.coords)} around {a.centre}, x2^k, seeds "
             f"{a.seeds}; final val loss, mean over the seeds",
             "coord          width   model lr  mean"]
    for coord in a.coords:
        for width in a.widths:
            points = []
            for k in range(-MAX_K, MAX_K + 1):  # every grid point the ledger holds
                runs = [done.get(run_name(a, width, s, coord, k)) for s in a.seeds]
                if all(runs):
                    lr = runs[0]["model_lrs"][coord.split("+")[0]]
                    points.append((lr, statistics.mean(r["val_loss"] for r in runs), []))
                    lines.append(f"{coord:<14} {width:>5}   {lr:<9.4g} {points[-1][1]:.4f}")
            if len(points) >= 3:
                best[coord, width] = vertex(points)
        widths = [w for w in a.widths if (coord, w) in best]
        for w in widths:
            raw = math.log2(best[coord, w] / best[coord, widths[0]])
            rules = " ".join(f"{e:g}: {raw - e * math.log2(w / widths[0]):+.2f}" for e in EXPONENTS)
            lines.append(f"{coord:<14} d{w}: best lr {best[coord, w]:.4g}, moved {raw:+.2f} x2-steps; "
                         f"under exponent {rules}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=ROOT / "data" / "pystdlib",
                   help="builtin:pystdlib prepared with --tokenizer bpe:4096 (lmforge prepare)")
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "lr_sweep")
    p.add_argument("--ledger", type=Path, default=ROOT / "bench" / "results" / "lr_sweep_zen4_runs.jsonl")
    p.add_argument("--optimizer", default="muon", choices=sorted(CENTRE))
    p.add_argument("--untied", action="store_true", help="an untied head (then 'head' is a group)")
    p.add_argument("--centre", default="", help="the grid's centre where not CENTRE's: head=0.005,...")
    p.add_argument("--coords", default="matrix,embed+scalar", help="groups of " + ", ".join(KEYS))
    p.add_argument("--widths", default="128,256,512")
    p.add_argument("--seeds", default="2001,2002")
    p.add_argument("--ks", default="-1,0,1", help="the k of the x2^k grid")
    p.add_argument("--ref-width", type=int, default=256)
    p.add_argument("--rule", action="store_true", help="the lrs as given at --ref-width")
    p.add_argument("--batch", type=int, default=1, help="B x tiny.toml's tokens a step")
    p.add_argument("--steps", type=int, default=0, help="0: 200 / --batch (the same tokens)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds a run may take")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args()
    exit_on_sigterm()
    a.coords = a.coords.split(",")
    a.widths, a.seeds, a.ks = ([int(v) for v in s.split(",")] for s in (a.widths, a.seeds, a.ks))
    a.centre = CENTRE[a.optimizer] | {g: float(v) for g, v in
                                      (item.split("=") for item in a.centre.split(",") if item)}
    a.rule, a.steps = a.ref_width if a.rule else 0, a.steps or STEPS // a.batch
    done = ledger(a)
    for width in [] if a.report_only else a.widths:
        for seed in a.seeds:
            for coord in a.coords:
                for k in a.ks:
                    if run_name(a, width, seed, coord, k) not in done:
                        run_one(a, width, seed, coord, k)
    print("\n".join(report(a)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
