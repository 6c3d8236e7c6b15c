"""Recipe ablation: which of the model options (model.qk_norm, mlp = "relu2", logit_softcap,
zero_init, value_embeds, an untied head, with or without lrs of its own) reach the Muon
baseline's final val loss in fewer steps.

    python -m bench.recipe                                   # every variant, 3 seeds
    python -m bench.recipe --variants baseline,qk_norm       # some of them
    python -m bench.recipe --preset qk_norm,relu2 --report-only

The built-in corpus (builtin:pystdlib) with a trained 2,048-id BPE, prepared once into --data;
configs/tiny.toml's run (Muon, cosine) at a --shape of SHAPES (default the issue's: d_model 256,
4 layers, seq 256, 1,024 tokens a step, 300 steps), fp32, eager, --threads torch threads, trained
by the pipeline's own Trainer in this process. Every
variant sees the same seeds, hence the same initial draws and batches; all are evaluated on the
same val tokens every --eval-every steps. A finished run (its final step in metrics.jsonl) is
not run again, so adding a variant costs only its own runs.

The loss: every variant trains on `train.loss = full` (model.model.cross_entropy, the whole
logits), one loss for all so the comparison and the step times are like for like. (The runs in
bench/results/recipe_avx2.* were trained before the pipeline had train.loss, by swapping that
same function in as the run's head loss.)

Wall-clock to the target = steps to it x the variant's step time, the step times measured by an
interleaved pass (`step_times`): every variant's model and optimizer built once, then rounds in
which each variant runs a few training steps in turn on one fixed batch, medians over rounds, so
load from other processes hits them alike. An option joins the preset when its gain in final
val loss over the baseline, seed by seed, is on average more than 2 sd of those gains (`pays`).
Writes OUT/recipe.png and OUT/results.json and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, header
from bench.speedrun import reach, read_records

os.environ.setdefault("WANDB_MODE", "disabled")

SHAPES = {  # name: (d_model, n_layer, n_head, n_kv_head, seq_len, micro-batch rows)
    "small": (128, 4, 4, 2, 128, 8),  # the first ablation's, 1,024 tokens a step
    "issue": (256, 4, 4, 2, 256, 4),  # the (d_model 256, 4 layers, seq 256), 1,024 tokens a step
}


def shape_flags(shape: str) -> list[str]:
    d, n_layer, n_head, n_kv, seq, rows = SHAPES[shape]
    return [
        "--model.d_model", str(d), "--model.n_layer", str(n_layer), "--model.n_head", str(n_head),
        "--model.n_kv_head", str(n_kv), "--model.max_seq_len", str(seq), "--data.seq_len", str(seq),
        "--train.global_batch_tokens", str(seq * rows), "--train.micro_batch_size", str(rows),
        "--train.dtype", "fp32", "--train.compile", "off", "--optim.name", "muon", "--train.loss", "full",
    ]


OPTIONS = {
    "qk_norm": ["--model.qk_norm", "true"],
    "relu2": ["--model.mlp", "relu2"],
    "softcap": ["--model.logit_softcap", "15"],
    "zero_init": ["--model.zero_init", "true"],
    "untied": ["--model.tie_embeddings", "false"],
    # The untied head, the tables and the head at lrs of their own (nanochat's split; picked by
    # a sweep on seed 2000, not one of the seeds reported: bench/results/recipe_lr_sweep_zen4.txt).
    "untied_lrs": ["--model.tie_embeddings", "false", "--optim.embed_lr", "0.05", "--optim.head_lr", "0.005"],
    "value_embeds": ["--model.value_embeds", "true"],
}
# The quick patch (QK-norm, ReLU², zero-init, untied head): a fixed combination to compare.
COMBOS = {"patch4": ["qk_norm", "relu2", "zero_init", "untied"]}
VARIANTS = ["baseline", *OPTIONS, *COMBOS]


def overrides(variant: str, preset: list[str]) -> list[str]:
    names = {"preset": preset, "baseline": [], **COMBOS}.get(variant, [variant])
    return [flag for name in names for flag in OPTIONS[name]]


def job_config(data: Path, out: Path, seed: int, args, extra: list[str]):
    from lmforge.pipeline.config import load_config

    flags = [
        "--data.path", str(data), "--log.out_dir", str(out), "--train.seed", str(seed),
        *shape_flags(args.shape),
        "--train.max_steps", str(args.steps), "--optim.warmup_steps", str(max(1, args.steps // 10)),
        "--eval.every", str(args.eval_every), "--eval.tokens", str(args.eval_tokens),
        "--sample.every", "0", "--sample.max_new_tokens", "1", "--checkpoint.every", "0",
        "--log.log_every", "1", *extra,
    ]
    return load_config(ROOT / "configs" / "tiny.toml", flags)


def train_one(data: Path, out: Path, seed: int, args, extra: list[str]) -> None:
    import torch

    from lmforge.pipeline.parallel.distributed import DistInfo
    from lmforge.pipeline.train import Trainer

    Trainer(job_config(data, out, seed, args, extra), DistInfo(0, 0, 1, torch.device("cpu"))).fit()


def claim(root: Path, run: str) -> bool:
    """Whether this process takes `run`: the first to create its claim does, so several
    processes given the same variants share them out (delete OUT/claims to retrain)."""
    (root / "claims").mkdir(parents=True, exist_ok=True)
    try:
        (root / "claims" / run).mkdir()
    except FileExistsError:
        return False
    return True


def finished(out: Path, steps: int) -> bool:
    try:
        return any(r.get("step") == steps and "val_loss" in r for r in read_records(out))
    except (OSError, ValueError):
        return False


def step_times(data: Path, names: list[str], preset: list[str], args) -> dict[str, float]:
    """Median seconds of one training step (forward, backward, optimizer) per variant, the
    variants taking turns round after round."""
    import torch

    from lmforge.model.model import GPT
    from lmforge.pipeline.optim.optimizers import build_optimizer

    torch.manual_seed(0)
    setups = {}
    for name in names:
        cfg = job_config(data, args.out / "timing", 0, args, overrides(name, preset) + args.set)
        model = GPT(dataclasses.replace(cfg.model, vocab_size=2048))
        step_model = torch.compile(model) if args.compiled else model  # compiled in the warm-up
        setups[name] = (step_model, build_optimizer(model, cfg.optim, torch.device("cpu")))
    _, _, _, _, seq, rows = SHAPES[args.shape]
    idx_BT = torch.randint(0, 2048, (rows, seq + 1))
    samples: dict[str, list[float]] = {name: [] for name in names}
    # Round 0 warms up (first-step allocations, optimizer state) and is not counted.
    for rnd in range(args.timing_rounds + 1 if args.timing_rounds else 0):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            model, opt = setups[name]
            for _ in range(args.timing_steps):
                t0 = time.perf_counter()
                model(idx_BT[:, :-1], idx_BT[:, 1:]).backward()
                opt.step()
                opt.zero_grad()
                if rnd:
                    samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items() if s}


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def gains(base: list[float], other: list[float]) -> list[float]:
    """Per seed, the baseline's final val loss minus the variant's. Paired: a seed gives both
    the same initial draws and batches, whose effect (the seeds' spread) cancels."""
    return [b - o for b, o in zip(base, other, strict=True)]


def pays(base: list[float], other: list[float]) -> bool:
    """Gain beyond 2 sd of the seed noise: mean(gains) > 2·sd(gains)."""
    mean, sd = mean_sd(gains(base, other))
    return mean > 2 * sd


def summarise(records: dict[str, list[list[dict]]], times: dict[str, float]) -> list[dict]:
    """Per variant: final val loss per seed, steps to the baseline's final loss (per seed: that
    seed's baseline) and the wall-clock ratio at the interleaved step times."""
    finals = {name: [[r for r in recs if "val_loss" in r][-1]["val_loss"] for recs in runs]
              for name, runs in records.items()}
    rows = []
    for name, runs in records.items():
        steps = []
        for seed, recs in enumerate(runs):
            got = reach(recs, finals["baseline"][seed])
            steps.append(got["step"] if got else None)
        base_steps = [reach(recs, finals["baseline"][s])["step"] for s, recs in enumerate(records["baseline"])]
        ratios = [s / b for s, b in zip(steps, base_steps, strict=True) if s is not None]
        rows.append({
            "variant": name, "finals": finals[name], "steps_to_target": steps,
            "step_ratio": ratios if len(ratios) == len(runs) else None,
            "step_s": times.get(name), "gains": gains(finals["baseline"], finals[name]),
            "pays": name != "baseline" and pays(finals["baseline"], finals[name]),
        })
    for row in rows:
        if row["step_ratio"] and row["step_s"] and times.get("baseline"):
            row["time_ratio"] = statistics.fmean(row["step_ratio"]) * row["step_s"] / times["baseline"]
    return rows


def table(rows: list[dict], preset: list[str]) -> str:
    lines = [f"{'variant':<14} {'final val loss':>16} {'gain (paired)':>16} {'steps to base':>16} "
             f"{'step ratio':>14} {'step ms':>8} {'cost':>7} {'time ratio':>10}  pays (>2 sd)"]
    base_s = next(r["step_s"] for r in rows if r["variant"] == "baseline")  # None: not timed
    for r in rows:
        m, s = mean_sd(r["finals"])
        ratio = "never (some seed)" if r["step_ratio"] is None else "{:.3f} ± {:.3f}".format(*mean_sd(r["step_ratio"]))
        cost = f"{(r['step_s'] / base_s - 1) * 100:+.1f}%" if r["step_s"] and base_s else "-"
        step_ms = f"{r['step_s'] * 1e3:.1f}" if r["step_s"] else "-"
        gain = "{:.4f} ± {:.4f}".format(*mean_sd(r["gains"]))
        lines.append(f"{r['variant']:<14} {m:>9.4f} ± {s:.4f} {gain:>16} {str(r['steps_to_target']):>16} "
                     f"{ratio:>14} {step_ms:>8} {cost:>7} {r.get('time_ratio', float('nan')):>10.3f}"
                     f"  {'yes' if r['pays'] else 'no'}")
    lines.append(f"preset = {', '.join(preset) or '(none)'}; options that pay: "
                 f"{', '.join(r['variant'] for r in rows if r['pays'] and r['variant'] != 'preset') or 'none'}")
    return "\n".join(lines)


def plot(records: dict[str, list[list[dict]]], png: Path, shape: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    colors = plt.get_cmap("tab10")
    for k, (name, runs) in enumerate(records.items()):
        for i, recs in enumerate(runs):
            points = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
            steps, losses = zip(*points, strict=True)
            ax.plot(steps, losses, "-", color=colors(k), lw=2.2 if name == "preset" else 1, alpha=0.7,
                    label=name if i == 0 else None)
    d, n_layer, _, _, seq, rows = SHAPES[shape]
    ax.set_xlabel(f"step ({seq * rows:,} tokens each)")
    ax.set_ylabel("val loss (nats/token), same val tokens")
    ax.set_ylim(top=min(7.5, ax.get_ylim()[1]))
    ax.set_title(f"recipe ablation, Muon, d{d} L{n_layer} seq{seq} (one line per seed)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def run_all(args, names: list[str], preset: list[str]) -> dict[str, list[list[dict]]]:
    data = args.data if args.report_only else prepare_data(args.data)
    records: dict[str, list[list[dict]]] = {name: [] for name in names}
    for seed in range(args.seeds):
        order = names if seed % 2 == 0 else names[::-1]  # interleave the load
        for name in order:
            out = args.out / "runs" / f"{name}_seed{seed}"
            if not args.report_only and not finished(out, args.steps) and claim(args.out, out.name):
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.perf_counter()
                train_one(data, out, args.seed_base + seed, args, overrides(name, preset) + args.set)
                print(f"{name} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.train_only:
        return records
    for name in names:
        records[name] = [read_records(args.out / "runs" / f"{name}_seed{s}") for s in range(args.seeds)]
    return records


def prepare_data(data: Path) -> Path:
    """The corpus with a 2,048-id BPE, prepared once."""
    from lmforge.launch.prepare import main as prepare

    if not (data / "manifest.json").is_file():
        rc = prepare(["--source", "builtin:pystdlib", "--tokenizer", "bpe:2048", "--out", str(data), "--quiet"])
        if rc != 0:
            sys.exit(f"error: preparing {data} failed (exit {rc})")
    return data


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=ROOT / "runs" / "recipe" / "data")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "recipe")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ",".join(VARIANTS))
    p.add_argument("--preset", default="", help="options the 'preset' variant combines (comma-separated)")
    p.add_argument("--shape", default="issue", choices=sorted(SHAPES),
                   help="model and batch shape (SHAPES); 'small' is the first ablation's")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed-base", type=int, default=1337,
                   help="seed of the first run (tune on other seeds than those reported)")
    p.add_argument("--set", nargs=2, action="extend", default=[], metavar=("KEY", "VALUE"),
                   help="a config override for every run, e.g. --set optim.embed_lr 0.1")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads: on a busy shared host one thread is not stalled waiting "
                        "for a team's slowest member")
    p.add_argument("--timing-rounds", type=int, default=6)
    p.add_argument("--timing-steps", type=int, default=5)
    p.add_argument("--report-only", action="store_true", help="table and plot from the runs in --out")
    p.add_argument("--compiled", action="store_true", help="time torch.compile'd steps (the runs stay eager)")
    p.add_argument("--train-only", action="store_true",
                   help="only train the runs (several such processes share them out)")
    args = p.parse_args()
    args.set = [f"--{v}" if i % 2 == 0 else v for i, v in enumerate(args.set)]
    preset = [n for n in args.preset.split(",") if n]
    names = [n for n in args.variants.split(",") if n] + (["preset"] if preset else [])
    unknown = [n for n in names + preset if n not in [*VARIANTS, "preset"] or n in preset and n not in OPTIONS]
    if unknown or "baseline" not in names and not args.train_only:
        sys.exit(f"error: unknown variants {unknown} or no baseline; choose from {VARIANTS}")
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    records = run_all(args, names, preset)
    if args.train_only:
        return 0
    train_s = time.perf_counter() - t0
    times = step_times(args.data, names, preset, args)
    rows = summarise(records, times)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    text = (f"{header()}\ncommit {commit}; {args.seeds} seeds x {args.steps} steps, eval "
            f"{args.eval_tokens} val tokens every {args.eval_every} steps; training {train_s:.0f} s; "
            f"step times: {args.timing_rounds} interleaved rounds x {args.timing_steps} steps, "
            f"{'compiled' if args.compiled else 'eager'}, shape {args.shape} {SHAPES[args.shape]}, "
            f"fp32, {args.threads} thread(s), load {os.getloadavg()[0]:.1f}\n{table(rows, preset)}\n")
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recipe.txt").write_text(text)
    plot(records, args.out / "recipe.png", args.shape)
    curves = {n: [[(r["step"], r["val_loss"]) for r in recs if "val_loss" in r] for recs in runs]
              for n, runs in records.items()}
    (args.out / "results.json").write_text(json.dumps({"rows": rows, "curves": curves}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
