"""Continued-pretraining lrs, measured (README "Continue pretraining a released model").

    lmforge demo                       # the base: runs/demo/run, its shards runs/demo/data
    lmforge prepare --source runs/quality/fortunes.jsonl --tokenizer runs/demo/data/tokenizer \
        --val-fraction 0.04 --out data/fortunes    # bench.quality writes the jsonl (prose)
    python -m bench.cpt_lrs --base runs/demo/run --domain data/fortunes --replay runs/demo/data

A model pretrained with lmforge (--base: a finished run, e.g. `lmforge demo`'s configs/tiny.toml
run on builtin:pystdlib) is exported to Hugging Face's layout and continued from it with
`--checkpoint.init_from`, as the README's example continues a released model: on another domain
(--domain: shards prepared with the base's tokenizer) mixed with replay of its own data (--replay,
--replay-share). Under each optimizer a group's lr is its pretraining lr at this shape times each
of --factors: every group's (--move all), or one group's (--move optim.lr, the matrices; or
optim.embed_lr, the table) with the others at --centre times theirs. A run's result is its val loss on the domain (what it learnt) and on the replay
data (what it forgot), beside the base's; runs in --ledger are not run again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, exit_on_sigterm, header, machine

# Each optimizer's from-scratch optimum at d_model 256: configs/tiny.toml's (Muon); AdamW's from
# its sweep at d_model 128 and 512 (bench/results/lr_sweep_adamw_zen4.txt: matrices 0.0023 at 128
# under muP's 1/width; lr_sweep_adamw_table_zen4.txt: table and gains 0.085 / 0.061).
PRETRAIN = {
    "muon": {"optim.lr": 0.03, "optim.embed_lr": 0.17, "optim.scalar_lr": 0.17},
    "adamw": {"optim.lr": 0.0012, "optim.embed_lr": 0.07, "optim.scalar_lr": 0.07},
}
FIXED = {"muon": [], "adamw": ["--optim.weight_decay", "0.1"]}  # as the AdamW sweep trained
CLI = [sys.executable, "-m", "lmforge.launch.cli"]


def lmforge(*args: str, timeout: float) -> None:
    subprocess.run([*CLI, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   timeout=timeout)


def val_loss(ckpt: Path, data: Path, a, name: str) -> float:
    out = a.work / f"{name}.{data.name}.json"
    if not out.is_file():
        lmforge("eval", "--ckpt", str(ckpt), "--data", str(data), "--max-tokens",
                str(a.val_tokens), "--json", str(out), timeout=a.timeout)
    return json.loads(out.read_text())["loss"]


def train(a, hf: Path, optimizer: str, factor: float, seed: int, out: Path) -> None:
    lrs = [f for key, lr in PRETRAIN[optimizer].items()
           for f in (f"--{key}", repr(lr * (factor if a.move in ("all", key) else a.centre)))]
    lmforge("train", "--config", str(ROOT / "configs" / "tiny.toml"), "--checkpoint.init_from",
            str(hf), "--data.mix", f"{a.domain}:{1 - a.replay_share},{a.replay}:{a.replay_share}",
            "--log.out_dir", str(out), "--optim.name", optimizer, *lrs, "--optim.lr_ref_width",
            "0", *FIXED[optimizer], "--train.max_steps", str(a.steps), "--train.seed", str(seed),
            "--optim.warmup_steps", str(max(1, a.steps // 10)), "--eval.every", "0",
            "--eval.tasks_every", "0", "--sample.every", "0", "--checkpoint.every", "0",
            "--log.log_every", "50", timeout=a.timeout)


def family(a) -> str:
    """What a run's name says beyond its optimizer and factor: the group moved, the rest's lrs."""
    return "" if a.move == "all" else f"{a.move.split('.')[-1]}@x{a.centre:g}_"


def run_all(a) -> dict[str, dict]:
    a.work.mkdir(parents=True, exist_ok=True)
    hf = a.work / "base_hf"
    if not (hf / "config.json").is_file():
        lmforge("export", "--ckpt", str(a.base), "--hf", str(hf), timeout=a.timeout)
    done = {r["run"]: r for r in map(json.loads, a.ledger.read_text().splitlines())} \
        if a.ledger.is_file() else {}
    if "base" not in done:
        done["base"] = {"run": "base", "domain": val_loss(a.base, a.domain, a, "base"),
                        "replay": val_loss(a.base, a.replay, a, "base")}
        with a.ledger.open("a") as f:
            f.write(json.dumps(done["base"]) + "\n")
    for optimizer in a.optimizers:
        for factor in a.factors:
            for seed in a.seeds:
                name = f"{optimizer}_{family(a)}x{factor:g}_s{seed}"
                if name in done:
                    continue
                out = a.work / name
                train(a, hf, optimizer, factor, seed, out)
                done[name] = {"run": name, "optimizer": optimizer, "factor": factor,
                              "move": a.move, "centre": a.centre,
                              "seed": seed, "steps": a.steps, "replay_share": a.replay_share,
                              "domain": val_loss(out, a.domain, a, name),
                              "replay": val_loss(out, a.replay, a, name), "machine": machine(),
                              "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
                with a.ledger.open("a") as f:
                    f.write(json.dumps(done[name]) + "\n")
    return done


def report(a, done: dict[str, dict]) -> str:
    base = done["base"]
    lines = [header(), f"# base {a.base}: val loss domain {base['domain']:.4f}, replay "
             f"{base['replay']:.4f} ({a.val_tokens:,} val tokens each); {a.steps} steps of 8,192 "
             f"tokens, {1 - a.replay_share:.0%} {a.domain.name} + {a.replay_share:.0%} replay",
             f"# factor: of {'every group' if a.move == 'all' else a.move}'s pretraining lr"
             + ("" if a.move == "all" else f", the others at x{a.centre:g}"),
             "optimizer  factor  domain   (vs base)  replay   (vs base)  seeds"]
    for optimizer in a.optimizers:
        for factor in a.factors:
            rows = [r for r in done.values() if r.get("optimizer") == optimizer
                    and r.get("factor") == factor and r.get("steps") == a.steps
                    and r.get("move", "all") == a.move and (a.move == "all" or r["centre"] == a.centre)]
            if not rows:
                continue
            dom = sum(r["domain"] for r in rows) / len(rows)
            rep = sum(r["replay"] for r in rows) / len(rows)
            lines.append(f"{optimizer:9}  {factor:<6g}  {dom:.4f}  {dom - base['domain']:+.4f}"
                         f"    {rep:.4f}  {rep - base['replay']:+.4f}    {len(rows)}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="a finished lmforge run (its final/)")
    p.add_argument("--domain", type=Path, required=True, help="the new domain's prepared shards")
    p.add_argument("--replay", type=Path, required=True, help="the base's own prepared shards")
    p.add_argument("--replay-share", type=float, default=0.2)
    p.add_argument("--optimizers", type=lambda s: s.split(","), default=["muon", "adamw"])
    p.add_argument("--factors", type=lambda s: [float(x) for x in s.split(",")],
                   default=[1, 0.3, 0.1, 0.03, 0.01])
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    p.add_argument("--move", choices=["all", *PRETRAIN["muon"]], default="all")
    p.add_argument("--centre", type=float, default=0.1, help="the other groups' factor")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--val-tokens", type=int, default=32768)
    p.add_argument("--work", type=Path, default=Path("runs/cpt_lrs"))
    p.add_argument("--ledger", type=Path, default=Path("runs/cpt_lrs/ledger.jsonl"))
    p.add_argument("--out", type=Path, help="also write the table to this file")
    p.add_argument("--timeout", type=float, default=3600)
    a = p.parse_args()
    exit_on_sigterm()
    text = report(a, run_all(a))
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
