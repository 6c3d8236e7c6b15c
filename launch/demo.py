"""`lmforge demo`: the whole pipeline on the built-in corpus, offline, then where everything is.

    prepare  builtin:pystdlib (Python's standard library) with a BPE of 4096 ids trained on it
    train    configs/tiny.toml (one process, or --nproc N with torchrun; a GPU when there is one)
    eval     perplexity and bits per byte on the whole val split
    sample   a continuation of "def "

Training gets a time budget (`--minutes`, default 5): a probe run of a few steps, with one round
of eval, downstream tasks, samples and export, times this machine, and the run is given the most
steps that fit (`--train.max_steps`, at most the preset's 200), as nanochat fixes its horizon
before it starts; the demo, set-up included, ends within ~10 minutes on any 2-core machine.
Stages that already finished are reused: prepare is a no-op on a prepared directory, and training
is skipped when RUN/final exists (an interrupted run resumes from its newest checkpoint, to the
length in RUN/config.toml).
`--quick` runs every stage on a slice with a smaller model in about a minute: a smoke test whose
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lmforge.data_prep.prepare import PrepareConfig, prepare
from lmforge.data_prep.tokenizer import encode_prompt, load_tokenizer_dir
from lmforge.launch.cli import ArgumentParser
from lmforge.launch.evaluate import evaluate_checkpoint, evaluate_tasks_of, load_tasks, report
from lmforge.launch.prepare import summary
from lmforge.launch.sample import write_sample
from lmforge.model import SamplingParams
from lmforge.pipeline.checkpoint.format import CheckpointError, list_complete, read_meta
from lmforge.pipeline.checkpoint.run_dir import RunDir
from lmforge.pipeline.config import ConfigError, JobConfig, load_config
from lmforge.pipeline.hardware import dtype_name
from lmforge.pipeline.inference import load_for_inference
from lmforge.pipeline.metrics import read_records
from lmforge.pipeline.parallel.distributed import init_distributed
from lmforge.pipeline.parallel.parallelize import Precision

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
PROMPT = "def "
NEXTLINE_EXAMPLES = 400  # questions of the built-in task scored at the end (100 in the loop)
PROBE_STEPS = 4  # the probe's steps: the first pays for warm-up, the others are timed
FULL = {"data": {"tokenizer": "bpe:4096"}, "train": []}
QUICK = {
    "data": {"tokenizer": "bpe:1024", "max_docs": 200, "val_docs": 10},
    "train": ["--model.n_layer", "2", "--model.d_model", "64", "--data.seq_len", "128",
              "--train.global_batch_tokens", "2048", "--train.max_steps", "30",
              "--eval.every", "10", "--eval.tokens", "2048", "--checkpoint.every", "10",
              "--sample.every", "0"],
}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="lmforge demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/demo"),
                   help="where the data and the run go (default: runs/demo)")
    p.add_argument("--nproc", type=int, default=1, help="training processes (torchrun when > 1)")
    p.add_argument("--minutes", type=float, default=5.0,
                   help="training time budget: the run is sized to fit it, at most the preset's "
                        "200 steps (default 5; 0 = the full preset however long it takes)")
    p.add_argument("--quick", action="store_true", help="a one-minute smoke run of every stage")
    return p


def banner(i: int, title: str) -> None:
    print(f"\n=== [{i}/4] {title}", flush=True)


def train_cmd(data: Path, run: Path, nproc: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "lmforge.launch.cli", "train", "--nproc", str(nproc),
            "--config", str(CONFIG), "--data.path", str(data), "--log.out_dir", str(run),
            "--resume", "auto", *overrides]


def hook_steps(cfg: JobConfig, steps: int) -> int:
    """Steps of a `steps`-step run at which eval, tasks, samples or a checkpoint run."""
    every = [e for e in (cfg.eval.every, cfg.eval.tasks_every, cfg.sample.every,
                         cfg.checkpoint.every) if e]
    return len({s for e in every for s in range(e, steps, e)} | {steps})


def fit_steps(data: Path, nproc: int, overrides: list[str], budget_s: float) -> int:
    """The most steps (at most the preset's, at least its warmup + 1) whose run fits what is left
    of `budget_s` once a probe run of PROBE_STEPS has timed this machine: its set-up, its steps
    and one round of every hook (eval, tasks, samples, checkpoint, export) at its last step."""
    cfg, t0 = load_config(str(CONFIG)), time.time()
    with tempfile.TemporaryDirectory(prefix="lmforge-probe-") as probe:
        res = subprocess.run(train_cmd(data, Path(probe), nproc, [
            *overrides, "--train.max_steps", str(PROBE_STEPS), "--log.log_every", "1",
            "--eval.every", "0", "--eval.tasks_every", "0", "--sample.every", "0",
            "--checkpoint.every", "0"]), capture_output=True, text=True)
        if res.returncode != 0:
            sys.stderr.write(res.stdout[-4000:] + res.stderr[-4000:])
            raise CheckpointError(f"the probe run exited with status {res.returncode} (its log "
                                  "is above); fix that, then re-run the demo")
        end, rows = time.time(), list(read_records(RunDir(probe).metrics))
    dts = [cfg.train.global_batch_tokens / r["tokens_per_s"] for r in rows]
    step_s = statistics.median(dts[1:])
    setup_s = rows[0]["time"] - t0 - step_s  # the first step's warm-up included
    round_s = rows[-1]["time"] - rows[-2]["time"] - dts[-1]
    left_s = budget_s - (end - t0) - setup_s - (end - rows[-1]["time"])
    floor = min(cfg.train.max_steps, cfg.optim.warmup_steps + 1)
    steps = next((n for n in range(cfg.train.max_steps, floor, -1)
                  if n * step_s + hook_steps(cfg, n) * round_s <= left_s), floor)
    print(f"probe: {step_s:.2f} s/step, set-up {setup_s:.0f} s, a round of eval, tasks, samples "
          f"and export {round_s:.0f} s, the probe itself {end - t0:.0f} s -> {steps} steps "
          f"(at most {cfg.train.max_steps}) in the {budget_s:g} s budget", flush=True)
    return steps


def run_training(data: Path, run: Path, nproc: int, overrides: list[str],
                 budget_s: float) -> None:
    if (RunDir(run).final / "meta.json").is_file():
        print(f"already trained: {run / 'final'} exists (delete {run} to train again)")
        return
    if saved := list_complete(RunDir(run).checkpoints):  # resumed: to the length it started with
        steps = read_meta(saved[-1]).config.train.max_steps
        overrides = [*overrides, "--train.max_steps", str(steps)]
    elif budget_s:
        overrides = [*overrides, "--train.max_steps", str(fit_steps(data, nproc, overrides,
                                                                     budget_s))]
    cmd = train_cmd(data, run, nproc, overrides)
    print("$ " + " ".join(cmd[1:]), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        raise CheckpointError(f"training exited with status {rc} (its log is above and in "
                              f"{run / 'train.log'}); fix that, then re-run the demo to resume")


def training_summary(cfg: JobConfig, run: Path, step: int, dtype: str) -> str:
    """What the run reached: steps, tokens, measured throughput (median over logged steps, the
    first excluded: it pays for warm-up) and the dtype it computed in."""
    rates = [r["tokens_per_s"] for r in read_records(RunDir(run).metrics)
             if r.get("step", 0) > 1 and "tokens_per_s" in r]
    rate = f"{statistics.median(rates):,.0f} tokens/s" if rates else "throughput not logged"
    return (f"trained     {step} of at most {cfg.train.max_steps} steps, "
            f"{step * cfg.train.global_batch_tokens:,} tokens, {rate}, {dtype}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.minutes < 0:
        raise ConfigError(f"--minutes {args.minutes:g}: expected minutes >= 0 (0 = no budget)")
    plan = QUICK if args.quick else FULL
    data = args.out / ("data_quick" if args.quick else "data")
    run = args.out / ("run_quick" if args.quick else "run")
    t0 = time.perf_counter()

    banner(1, f"prepare builtin:pystdlib -> {data}")
    manifest = prepare(PrepareConfig(out=data, source="builtin:pystdlib", progress=False,
                                     **plan["data"]))
    print(summary(manifest))

    banner(2, f"train {CONFIG.name} -> {run}")
    run_training(data, run, args.nproc, plan["train"],
                 0.0 if args.quick else args.minutes * 60)

    banner(3, "evaluate on the whole val split")
    info = init_distributed("auto")
    ckpt = load_for_inference(run, info.device)
    result, _, _ = evaluate_checkpoint(ckpt, data, info)
    print(report(result))
    # The built-in task: the real next line of a held-out file among 4 (pipeline/tasks/nextline.py).
    tasks, _ = evaluate_tasks_of(ckpt, load_tasks(ckpt, ["nextline"], data, NEXTLINE_EXAMPLES),
                                 info)
    nextline = tasks["nextline"]

    banner(4, f"sample from {ckpt.path}")
    enc = load_tokenizer_dir(ckpt.tokenizer_dir)
    ids = encode_prompt(enc, PROMPT)
    sampling = SamplingParams(seed=0).fit(len(ids), ckpt.config.max_seq_len)
    sys.stdout.write(PROMPT)
    run_cfg = ckpt.meta.config  # as resolved: the length the probe chose
    # The rules training and sampling apply (the same train.dtype, each for its workload).
    trained_in = Precision.resolve(run_cfg.train.dtype, info.device).dtype
    write_sample(ckpt, enc, ids, sampling, sys.stdout,
                 Precision.resolve(run_cfg.train.dtype, info.device, "sample"))

    print(f"""
=== done in {time.perf_counter() - t0:.0f} s
shards      {data}  (manifest.json, tokenizer/)
run         {run}  (config.toml, train.log)
checkpoint  {ckpt.path}  (step {ckpt.step})
{training_summary(run_cfg, run, ckpt.step, dtype_name(trained_in))}
metrics     {RunDir(run).metrics}
loss plot   {RunDir(run).loss_plot}
val perplexity {result.perplexity:.2f} (loss {result.loss:.4f}, {result.bits_per_byte:.3f} bits/byte, {result.tokens:,} tokens)
nextline    acc {nextline.acc:.3f}, acc_norm {nextline.acc_norm:.3f} vs chance 0.250 (the real next line of held-out code among 4, {nextline.n} questions)

next:
  lmforge sample --ckpt {run} --prompt "import " --num-samples 3
  lmforge eval --ckpt {run} --data {data} --json {args.out / 'eval.json'}
  lmforge export --ckpt {run} --hf {args.out / 'hf'}""")
    return 0
