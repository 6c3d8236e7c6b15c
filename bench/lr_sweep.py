"""Learning rates across widths: each lr group on a x2 log grid around a centre, at several
d_model, to find each group's optimum and the width rule under which it moves least.

    nice -n 19 python -m bench.lr_sweep                  # run what is missing, then report
    python -m bench.lr_sweep --report-only               # the table and PNG from finished runs
    nice -n 19 python -m bench.lr_sweep --untied --coords head --rule   # an LM head's lr
    nice -n 19 python -m bench.lr_sweep --widths 128 --batch 4 [--steps 200]   # 4x the batch

configs/tiny.toml's run (4 layers, head_dim 64, KV heads half the heads, seq 256, 8,192 tokens a
step, 200 steps, bf16 where the CPU has it) on builtin:pystdlib with the demo's 4,096-id BPE, at
each --widths d_model. A coordinate sweep: one coordinate (--coords: a group's lr, or groups
joined by '+' moved together) at CENTRE x 2^k, the others at CENTRE. At the narrowest width k runs
over --span; at each wider one over --span moved to the grid point nearest the next narrower
width's optimum (as given), so the dearer widths run the points around their optimum; where
a coordinate's best is at its grid's edge the sweep walks on, one k at a time. --jobs runs at a
time, each `python -m lmforge.launch.train` with one thread; a run's result is its final val loss, kept in
--ledger (committed): a run there is not run again, so an interrupted sweep continues where it
stopped, in any checkout. Seeds 2001.. by default: not the reported runs'.

A run sets optim.lr_ref_width itself (0; --ref-width under --rule), never tiny.toml's: the lr
column is the model's lr either way. The rule: the same runs plotted against the lr at
--ref-width, i.e. the lr divided by pipeline/optim/lrs.py's width_factor. Writes
OUT/lr_sweep.png and OUT/lr_sweep.txt (bench/results/lr_sweep_zen4.* with --out bench/results).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, header, machine
from bench.optimum import means, parabola, vertex
from bench.recipe import finished
from bench.runs import env, kill_group, train_cmd
from bench.speedrun import read_records

KEYS = {"matrix": "optim.lr", "embed": "optim.embed_lr", "head": "optim.head_lr",
        "scalar": "optim.scalar_lr"}
CENTRE = {  # configs/tiny.toml's lrs (Muon) when the sweep began; AdamW's a guess (with matrices
    # at 0.02 and the table at 0.1 a d_model 128 run ends at 5.75 nats, Muon's near 4.3)
    "muon": {"matrix": 0.02, "embed": 0.03, "head": 0.03, "scalar": 0.03},
    "adamw": {"matrix": 0.003, "embed": 0.05, "head": 0.003, "scalar": 0.05},
}
# AdamW's runs decay the matrices too: the AdamW presets' 0.1 (tiny.toml's 0 is Muon's table's)
FIXED = {"muon": [], "adamw": ["--optim.weight_decay", "0.1"]}
STEPS, TOKENS, WARMUP = 200, 8192, 20  # tiny.toml's run (--batch, --steps: a run of other shape)
MAX_K = 4
EXPONENTS = (0, -0.5, -1)  # width rules to compare: none, nanochat's AdamW groups', muP's hidden AdamW


def shape_flags(width: int) -> list[str]:
    heads = width // 64
    return ["--model.d_model", str(width), "--model.n_head", str(heads),
            "--model.n_kv_head", str(max(1, heads // 2))]


def lrs_of(centre: dict[str, float], coord: str, k: int) -> dict[str, float]:
    """Every swept group's lr in the run that moves `coord` by 2^k."""
    lrs = dict(centre)
    for group in coord.split("+"):
        lrs[group] *= 2.0 ** k
    return lrs


def family(optimizer: str, untied: bool, centre: dict[str, float], rule: int = 0, batch: int = 1,
           steps: int = STEPS) -> str:
    """The runs' name prefix: the optimizer, then what differs from its tied runs around CENTRE
    at tiny.toml's batch without the rule, so that no two sweeps' runs share a name (a run
    directory, a ledger line)."""
    moved = "".join(f"-{g}{lr:g}" for g, lr in centre.items() if lr != CENTRE[optimizer][g])
    return (optimizer + ("-untied" if untied else "") + moved + (f"-rule{rule}" if rule else "")
            + (f"-batch{batch}" if batch > 1 else "") + (f"-steps{steps}" if steps * batch != STEPS else ""))


def run_name(family: str, width: int, seed: int, coord: str, k: int) -> str:
    return f"{family}_d{width}_s{seed}_" + ("centre" if k == 0 else f"{coord}{k:+d}")


def grid(args, width: int, coord: str) -> dict[int, float]:
    """k -> mean final val loss over the k that every one of --seeds finished."""
    found = {k: [final_loss(args, args.family, width, s, coord, k) for s in args.seeds]
             for k in range(-MAX_K, MAX_K + 1)}
    return {k: statistics.mean(v) for k, v in found.items() if all(x is not None for x in v)}


def start(args, width: int, coord: str) -> int | None:
    """The k that `coord`'s --span is centred on at `width`: 0 at the narrowest width; at a wider
    one the grid point nearest the next narrower width's optimum (as given: where the rule puts it
    under --rule, else unscaled), so that the dearer widths run the points around it, not the
    centre's. None: not bracketed yet."""
    i = args.widths.index(width)
    if i == 0:
        return 0
    narrower = grid(args, args.widths[i - 1], coord)
    if not settled(args, args.widths[i - 1], coord):
        return None
    points = [(2.0 ** k, loss, []) for k, loss in sorted(narrower.items())]
    return round(math.log2(vertex(points)))


def span(args, width: int, coord: str) -> list[int] | None:
    """The k to run first for `coord` at `width`, the central ones and the higher lr first."""
    if (k0 := start(args, width, coord)) is None:
        return None
    return [k0 + k for k in sorted(args.span, key=lambda k: (abs(k), -k))]


def extension(args, width: int, coord: str) -> int | None:
    """The next k to run where a finished coordinate's best is at its grid's edge (up to
    x2^+-MAX_K): the sweep walks on until its optimum has a worse neighbour on both sides."""
    ks = span(args, width, coord)
    done = grid(args, width, coord)
    if ks is None or not set(ks) <= set(done):
        return None
    best = min(done, key=done.get)
    if best == max(done) and best < MAX_K:
        return best + 1
    if best == min(done) and best > -MAX_K:
        return best - 1
    return None


def settled(args, width: int, coord: str) -> bool:
    """Whether `coord`'s runs at `width` are all finished and its best point has a worse
    neighbour on both sides (or is at x2^+-MAX_K)."""
    ks = span(args, width, coord)
    return ks is not None and set(ks) <= set(grid(args, width, coord)) and extension(args, width, coord) is None


def next_run(args, tried: set) -> tuple[str, int, int, str, int] | None:
    """The first run neither finished nor tried by this process: at each width, seed by seed,
    every coordinate's span (a seed's whole bracket before the next seed's), then the walks."""
    for width in args.widths:
        spans = {coord: span(args, width, coord) or [] for coord in args.coords}
        walks = {coord: [k] if (k := extension(args, width, coord)) is not None else []
                 for coord in args.coords}
        for ks in (spans, walks):
            for seed in args.seeds:
                for coord in args.coords:
                    for k in ks[coord]:
                        key = (args.family, width, seed, coord, k)
                        if key not in tried and final_loss(args, *key) is None:
                            return key
    return None


def held(run_dir: Path) -> bool:
    """Whether a run (this sweep's or another's) holds run_dir's lock."""
    from lmforge.pipeline.checkpoint.lock import check_unlocked
    from lmforge.pipeline.typed_config import ConfigError

    try:
        check_unlocked(run_dir)
    except ConfigError:
        return True
    return False


def launch(args, family: str, width: int, seed: int, coord: str, k: int) -> subprocess.Popen | None:
    """Start one run in the background, one thread, its output in --runs/NAME.log; None where
    another sweep's run holds its run directory."""
    out = args.out_runs / run_name(family, width, seed, coord, k)
    if held(out):
        return None
    shutil.rmtree(out, ignore_errors=True)  # an interrupted run starts again
    with (args.out_runs / f"{out.name}.log").open("w") as log:
        return subprocess.Popen(run_cmd(args, out, width, seed, coord, k), cwd=ROOT, env=env(),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_cmd(args, out: Path, width: int, seed: int, coord: str, k: int) -> list[str]:
    lr_flags = [f for g, lr in lrs_of(args.centre, coord, k).items()
                if g != "head" or args.untied for f in (f"--{KEYS[g]}", repr(lr))]
    return train_cmd(["--config", str(ROOT / "configs" / "tiny.toml"), "--data.path", str(args.data),
                      "--log.out_dir", str(out), "--optim.name", args.optimizer, *shape_flags(width),
                      "--model.tie_embeddings", "false" if args.untied else "true",
                      "--train.seed", str(seed), "--train.max_steps", str(args.steps),
                      "--train.global_batch_tokens", str(TOKENS * args.batch),
                      "--optim.warmup_steps", str(WARMUP * args.steps // STEPS),
                      "--sample.every", "0", "--eval.every", "0", "--eval.tasks_every", "0",
                      "--checkpoint.every", "0", "--log.log_every", "50", *FIXED[args.optimizer],
                      *lr_flags, "--optim.lr_ref_width", str(args.rule)])


def sweep(args) -> None:
    """Keep --jobs runs going, counting other sweeps' runs in --runs, until next_run has none
    left; a run past --timeout is killed."""
    tried, running = set(), {}
    while True:
        mine = {run_name(*key) for key in running}
        others = [d.name for d in args.out_runs.iterdir() if d.is_dir() and d.name not in mine and held(d)]
        while len(running) + len(others) < args.jobs and (key := next_run(args, tried)) is not None:
            tried.add(key)
            if proc := launch(args, *key):
                running[key] = proc, time.time()
        # (another sweep's runs of this family may yet move an optimum: wait for those alone)
        if not running and next_run(args, tried) is None and not any(
                n.startswith(f"{args.family}_d") for n in others):
            return
        time.sleep(5)
        for key, (proc, t0) in list(running.items()):
            if proc.poll() is None and time.time() - t0 < args.timeout:
                continue
            if proc.returncode is None:
                kill_group(proc)
                proc.wait()
            print(f"{run_name(*key)}: exit {proc.returncode} in {time.time() - t0:.0f} s", flush=True)
            del running[key]
            final_loss(args, *key)  # into the ledger


def ledger(args) -> dict[str, dict]:
    """The finished runs, by name: --ledger (committed, so that a sweep continues in another
    checkout), one JSON line each, appended as each run ends."""
    if not args.ledger.is_file():
        return {}
    return {(r := json.loads(ln))["run"]: r for ln in args.ledger.read_text().splitlines() if ln}


def final_loss(args, *key) -> float | None:
    name = run_name(*key)
    _, width, seed, coord, k = key
    lrs = lrs_of(args.centre, coord, k)
    if (done := ledger(args).get(name)) is not None and done["lrs"] == lrs:
        return done["val_loss"]  # (a run of another CENTRE is not this one)
    out = args.out_runs / name
    if not finished(out, args.steps):
        return None
    loss = next(r["val_loss"] for r in read_records(out) if r.get("step") == args.steps and "val_loss" in r)
    record = {"run": name, "val_loss": loss, "optimizer": args.optimizer, "untied": args.untied,
              "d_model": width, "seed": seed, "coord": coord, "k": k, "lrs": lrs,
              "lr_ref_width": args.rule, "model_lrs": model_lrs(args, width, lrs), "steps": args.steps,
              "machine": machine(), "finished": time.strftime("%Y-%m-%d %H:%M UTC",
                                                              time.gmtime(out.stat().st_mtime))}
    with args.ledger.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return loss


def model_lrs(args, width: int, lrs: dict[str, float]) -> dict[str, float]:
    """The lrs a run at `width` trains with, given `lrs`: lrs.py's rule (off where args.rule is 0)."""
    return {g: lr * factor(args, g, width, ref=args.rule) for g, lr in lrs.items()}


def curves(args) -> dict[tuple[str, int], list[tuple[float, float | None, list[float | None]]]]:
    """(coord, width) -> [(the model's lr of the coord's first group, as the ledger has it: the
    rule as it stood when the run ended; mean final val loss over --seeds or None where a seed has
    not run it, per seed)] over the grid points any seed finished."""
    result = {}
    for coord in args.coords:
        for width in args.widths:
            found = {k: [final_loss(args, args.family, width, s, coord, k) for s in args.seeds]
                     for k in range(-MAX_K, MAX_K + 1)}
            done = ledger(args)  # (final_loss has recorded every finished run)
            result[coord, width] = [
                (next(done[n]["model_lrs"][coord.split("+")[0]] for s in args.seeds
                      if (n := run_name(args.family, width, s, coord, k)) in done),
                 None if None in losses else statistics.mean(losses), losses)
                for k, losses in found.items() if any(v is not None for v in losses)]
    return result


def factor(args, coord: str, width: int, ref: int | None = None) -> float:
    from lmforge.pipeline.config import OptimConfig
    from lmforge.pipeline.optim.lrs import width_factor

    rule = OptimConfig(name=args.optimizer, lr_ref_width=args.ref_width if ref is None else ref)
    return width_factor(rule, coord.split("+")[0], width)


def report(args) -> list[str]:
    found = curves(args)
    lines = [header(), f"# {args.optimizer}, {'untied' if args.untied else 'tied'}, coordinates "
             f"{', '.join(args.coords)} around {args.centre}, grid x2^k, --span {sorted(args.span)} around each "
             f"width's start, seeds {args.seeds}, {shape(args)} "
             f"{' '.join(FIXED[args.optimizer])}; final val loss (16,384 val tokens); mean over the seeds "
             "(- = a seed's run not finished: not in the mean)",
             "# lr: the model's (the rule applied where a run took it)",
             "coord          width   lr        lr@ref    mean     per seed"]
    best = {}
    for (coord, width), points in found.items():
        for lr, mean, losses in points:
            seeds = " ".join("-" if v is None else f"{v:.4f}" for v in losses)
            lines.append(f"{coord:<14} {width:>5}   {lr:<9.4g} {lr / factor(args, coord, width):<9.4g} "
                         f"{'-' if mean is None else f'{mean:.4f}':<6}   {seeds}")
        if (points := means(points)) and min(points, key=lambda p: p[1]) in (points[0], points[-1]):
            lines.append(f"# {coord} d{width}: the best is at the grid's edge, no optimum yet")
        elif points:
            best[coord, width] = vertex(points)
    lines.append("# optimum per coordinate and width: the vertex of the parabola in log2(lr) through "
                 "the best point and its neighbours; moved = log2 of its ratio to the narrowest width's "
                 "bracketed one (grid steps of x2)")
    for coord in args.coords:
        widths = [w for w in args.widths if (coord, w) in best]
        w0 = widths[0] if widths else 0
        for w in widths:
            raw = math.log2(best[coord, w] / best[coord, w0])
            ruled = raw - math.log2(factor(args, coord, w) / factor(args, coord, w0))
            candidates = " ".join(f"{e:g}: {raw - e * math.log2(w / w0):+.2f}" for e in EXPONENTS)
            lines.append(f"{coord:<14} d{w}: best lr {best[coord, w]:.4g}, moved {raw:+.2f} steps "
                         f"raw, {ruled:+.2f} under the rule; under exponent {candidates}")
        if (coord, args.ref_width) in best:
            lines.append(f"{coord:<14} cost of each exponent: " + rule_costs(args, found, best, coord))
    return lines


def rule_costs(args, found, best: dict, coord: str) -> str:
    """Where the optimum is flat 'moved' overstates a rule's harm: what the rule's lr loses, the
    loss at --ref-width's optimum carried to each width by (w/ref)^e less that at the width's own,
    both off the parabola the optimum is the vertex of (beyond its three points at most the worse
    grid point around it, '<=', the curve being convex); the worst width's, 'off' past the grid."""
    out = []
    for e in EXPONENTS:
        worst, bound = 0.0, False
        for w in (w for w in args.widths if (coord, w) in best):
            points = [(math.log2(p[0]), p[1]) for p in means(found[coord, w])]
            i = min(range(len(points)), key=lambda j: points[j][1])
            fit = points[i - 1:i + 2]
            x, low = math.log2(best[coord, args.ref_width] * (w / args.ref_width) ** e), \
                parabola(fit, math.log2(best[coord, w]))
            around = [(a, b) for a, b in zip(points, points[1:]) if a[0] <= x <= b[0]]
            if not around:
                worst = math.inf
                break
            if fit[0][0] <= x <= fit[-1][0]:
                worst = max(worst, parabola(fit, x) - low)
            else:
                worst, bound = max(worst, max(around[0][0][1], around[0][1][1]) - low), True
        out.append(f"{e:g}: " + ("off the grid" if worst == math.inf
                                 else f"{'<=' if bound else ''}+{worst:.3f} nats"))
    return ", ".join(out) + f" (the worst width's, from d{args.ref_width}'s optimum)"


def plot(args, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = curves(args)
    fig, axes = plt.subplots(2, len(args.coords), figsize=(5 * len(args.coords), 8), squeeze=False)
    for j, coord in enumerate(args.coords):
        for width in args.widths:
            if points := means(found[coord, width]):
                lrs, losses = [p[0] for p in points], [p[1] for p in points]
                axes[0, j].plot(lrs, losses, "o-", label=f"d_model {width}")
                axes[1, j].plot([lr / factor(args, coord, width) for lr in lrs], losses, "o-",
                                label=f"d_model {width}")
        for i, what in enumerate(("lr", f"lr at reference width {args.ref_width} (the rule)")):
            ax = axes[i, j]
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"{coord}: {what}")
            ax.set_ylabel("final val loss (nats/token)")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle(f"lr sweep, {args.family},\n4 layers, {shape(args)} "
                 f"(mean over seeds {args.seeds})", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def shape(args) -> str:
    return f"{args.steps} steps of {TOKENS * args.batch:,} tokens"


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def lrs_arg(text: str) -> dict[str, float]:
    """'head=0.005,embed=0.2' -> {'head': 0.005, 'embed': 0.2}."""
    try:
        return {g.strip(): float(v) for g, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give group=lr pairs, e.g. head=0.005,embed=0.2") from None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=ROOT / "data" / "pystdlib",
                   help="builtin:pystdlib prepared with --tokenizer bpe:4096 (lmforge prepare)")
    p.add_argument("--runs", dest="out_runs", type=Path, default=ROOT / "runs" / "lr_sweep")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "lr_sweep", help="table and PNG")
    p.add_argument("--name", default="lr_sweep", help="the table's and PNG's file name")
    p.add_argument("--ledger", type=Path, default=ROOT / "bench" / "results" / "lr_sweep_zen4_runs.jsonl",
                   help="the finished runs' final val losses (a run there is not run again)")
    p.add_argument("--optimizer", default="muon", choices=sorted(CENTRE))
    p.add_argument("--untied", action="store_true", help="an untied head (then 'head' is a group)")
    p.add_argument("--centre", type=lrs_arg, default={},
                   help="the grid's centre where not CENTRE's, e.g. head=0.005,embed=0.2")
    p.add_argument("--coords", default="matrix,embed+scalar",
                   help="comma-separated: a group of " + ", ".join(KEYS) + ", or groups joined by +")
    p.add_argument("--widths", type=ints, default=[128, 256, 512])
    p.add_argument("--seeds", type=ints, default=[2001, 2002])
    p.add_argument("--span", type=ints, default=[-1, 0, 1], help="the k of the x2^k grid")
    p.add_argument("--ref-width", type=int, default=256)
    p.add_argument("--timeout", type=float, default=3600, help="seconds a run may take")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    p.add_argument("--rule", action="store_true", help="runs take the lrs as given at --ref-width: "
                   "a wider width's grid starts where the rule puts the narrower one's optimum")
    p.add_argument("--batch", type=int, default=1, help="B x tiny.toml's tokens a step: where the "
                   "optimum moves with the batch")
    p.add_argument("--steps", type=int, default=0, help="a run's steps, its warmup 10 %% of them "
                   "(0: tiny.toml's 200 / --batch, the same tokens)")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    args.coords = args.coords.split(",")
    if any("head" in c.split("+") for c in args.coords) and not args.untied:
        p.error("a tied head is the table: sweep 'head' with --untied, or 'embed'")
    if unknown := set(args.centre) - set(KEYS):
        p.error(f"--centre: no group {', '.join(sorted(unknown))}; the groups are {', '.join(KEYS)}")
    args.centre = CENTRE[args.optimizer] | args.centre
    args.rule = args.ref_width if args.rule else 0
    args.steps = args.steps or STEPS // args.batch
    if args.steps * WARMUP % STEPS:
        p.error("--steps (200 / --batch where not given) must be a multiple of 10 (the warmup is "
                "10 %): e.g. --batch 2, 4 or 5, or --steps 200")
    args.family = family(args.optimizer, args.untied, args.centre, args.rule, args.batch, args.steps)
    if not args.report_only:
        if not (args.data / "manifest.json").is_file():
            sys.exit(f"error: no prepared data at {args.data}; run lmforge prepare --source "
                     f"builtin:pystdlib --tokenizer bpe:4096 --out {args.data}")
        sweep(args)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = report(args)
    (args.out / f"{args.name}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(args, args.out / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
