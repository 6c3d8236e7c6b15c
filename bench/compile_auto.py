"""train.compile = auto before and after this machine has measured the run's shape (the compile
ledger, pipeline.compile_policy), on the CPU quickstart: configs/tiny.toml on the built-in corpus.

    python -m bench.compile_auto            # ~10 min on 2 cores
    python -m bench.compile_auto --smoke    # a tiny model, a few steps, run 2 eager: the code
                                            # path without a cold compile (a test)

The runs share one ledger and one inductor cache, both empty at the start:
1. the preset's run with auto and the empty ledger (`lmforge train`, its own process): the
   roofline decides; its first steps file the eager step in the ledger;
2. in this process, compile on: a few training steps, timed into the ledger as a run's are
   (the compiled step, the training graph's cold compile), then two evals (the first compiles
   eval's graph: its excess over the second is eval's cold compile);
3. the preset's run with auto again (its own process), deciding from what 1 and 2 measured.
Prints each auto decision as the run logged it, eval's cold compile against training's (what
pipeline.compile_policy.GRAPHS assumes), and the wall-clock of run 3 against run 1 (the whole
run: compile, evals, samples, export), with each run's steady tok/s and final val loss. Where
run 3 decides as run 1 did, the ratio is the host's noise.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import header
from bench.runs import metrics, train
from pipeline import compile_policy

PRESET = "configs/tiny.toml"
SMOKE = ["--model.n_layer", "2", "--model.d_model", "64", "--model.n_kv_head", "4",
         "--data.seq_len", "64", "--train.global_batch_tokens", "512",
         "--train.micro_batch_size", "4", "--train.max_steps", "12", "--eval.every", "6",
         "--eval.tokens", "512", "--sample.every", "0", "--log.log_every", "1"]
DECISION = re.compile(r"train\.compile = auto -> .*")


def prepare(out: Path, smoke: bool) -> Path:
    from launch.prepare import main as prepare_main

    data = out / "data"
    limits = ["--max-docs", "120", "--val-docs", "12"] if smoke else []
    assert prepare_main(["--source", "builtin:pystdlib", "--tokenizer",
                         "bpe:512" if smoke else "bpe:4096", "--out", str(data), "--workers", "1",
                         *limits]) == 0
    return data


def run(args: list[str], out: Path, env: dict[str, str], timeout: float) -> dict:
    """One `lmforge train` process: its wall-clock, auto's log line, steady tok/s, last val loss."""
    t0 = time.perf_counter()
    res = train([*args, "--log.out_dir", str(out)], timeout=timeout, extra_env=env)
    wall = time.perf_counter() - t0
    found = DECISION.search(res.stdout)
    return {"wall_s": wall, "decision": found.group(0) if found else "(not auto)",
            "tok_s": _steady_tok_s(metrics(out)), "val_loss": _last_val(metrics(out))}


def seed(overrides: list[str], out: Path, compile_on: bool, steps: int) -> dict:
    """Run 2, in this process (os.environ: the bench's ledger and inductor cache): `steps`
    training steps timed into the run's ledger meter as fit() times them, then two evals."""
    from pipeline.config import load_config
    from pipeline.distributed import DistInfo
    from pipeline.train import Trainer

    cfg = load_config(PRESET, [*overrides, "--log.out_dir", str(out), "--train.compile",
                               "on" if compile_on else "off"])
    t0 = time.perf_counter()
    trainer = Trainer(cfg, DistInfo(0, 0, 1, torch.device("cpu")))
    step_s, eval_s = [], []
    for _ in range(steps):
        t = time.perf_counter()
        trainer.train_step()
        step_s.append(time.perf_counter() - t)
        trainer.compile_meter.step_done(step_s[-1])
    trainer.compile_meter.finish()
    for _ in range(2):
        t = time.perf_counter()
        val = trainer.run_eval()
        eval_s.append(time.perf_counter() - t)
    key = compile_policy.run_key(trainer.model_cfg, trainer.cfg.train, cfg.data.seq_len,
                                 trainer.precision.dtype, trainer.info)
    return {"wall_s": time.perf_counter() - t0, "decision": "(compile set, not auto)",
            "tok_s": cfg.train.global_batch_tokens / statistics.median(step_s[1:]),
            "val_loss": val["val_loss"], "eval_cold_s": eval_s[0] - eval_s[1],
            "seen": compile_policy.measured(key)}


def _steady_tok_s(records: list[dict]) -> float:
    tok_s = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # past the first
    return statistics.median(tok_s) if tok_s else float("nan")


def _last_val(records: list[dict]) -> float:
    return next((r["val_loss"] for r in reversed(records) if "val_loss" in r), float("nan"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a tiny model and run, run 2 eager: the "
                   "code path")
    p.add_argument("--seed-steps", type=int, default=16, help="training steps of run 2")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = prepare(tmp, a.smoke)
        # Threads as this process has them (bench.runs pins 1 for the tests' many processes).
        env = {"LMFORGE_CACHE_DIR": str(tmp / "ledger"), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
               "OMP_NUM_THREADS": str(torch.get_num_threads())}
        overrides = ["--data.path", str(data), *(SMOKE if a.smoke else [])]
        timeout = 300 if a.smoke else 1200
        before = run(["--config", PRESET, *overrides, "--train.compile", "auto"], tmp / "before",
                     env, timeout)
        os.environ.update(env)
        seeded = seed(overrides, tmp / "seed", not a.smoke, a.seed_steps)
        after = run(["--config", PRESET, *overrides, "--train.compile", "auto"], tmp / "after",
                    env, timeout)
    print(header())
    print(f"configs/tiny.toml{' (smoke sizes)' if a.smoke else ''} on builtin:pystdlib, "
          f"{torch.get_num_threads()} threads; one ledger and one inductor cache, empty at the start")
    for name, r in (("1. empty ledger", before),
                    (f"2. compile {'off' if a.smoke else 'on'}, seeds", seeded),
                    ("3. ledger filled", after)):
        print(f"  {name:22} wall {r['wall_s']:7.1f} s  steady {r['tok_s']:8,.0f} tok/s  "
              f"val loss {r['val_loss']:.4f}")
        print(f"    {r['decision']}")
    seen = seeded["seen"]
    if seen.cold_compile_s:
        print(f"cold compiles in run 2: training's graph {seen.cold_compile_s:.1f} s, eval's "
              f"{seeded['eval_cold_s']:.1f} s = {seeded['eval_cold_s'] / seen.cold_compile_s:.2f}x "
              f"(compile_policy.GRAPHS counts eval's as {compile_policy.GRAPHS - 1:.2f}x)")
    print(f"run 3 / run 1 wall-clock: {after['wall_s'] / before['wall_s']:.3f}x "
          f"(< 1: the decision from the ledger finished sooner)")


if __name__ == "__main__":
    main()
