"""`lmforge demo`: the whole pipeline on the built-in corpus, offline, then where everything is.

    prepare  builtin:pystdlib (Python's standard library) with a BPE of 4096 ids trained on it
    train    configs/tiny.toml (one process, or --nproc N with torchrun; a GPU when there is one)
    eval     perplexity and bits per byte on the whole val split
    sample   a continuation of "def "

Stages that already finished are reused: prepare is a no-op on a prepared directory, and training
is skipped when RUN/final exists (an interrupted run resumes from its newest checkpoint).
`--quick` runs every stage on a slice with a smaller model in about a minute: a smoke test whose
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from data_prep.cli import summary
from data_prep.prepare import PrepareConfig, prepare
from data_prep.tokenizer import load_tokenizer_dir
from launch.evaluate import evaluate_checkpoint, report
from launch.sample import encode_prompt, write_sample
from pipeline.checkpoint import CheckpointError, load_for_inference
from pipeline.distributed import init_distributed

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
PROMPT = "def "
FULL = {"data": {"tokenizer": "bpe:4096"}, "train": []}
QUICK = {
    "data": {"tokenizer": "bpe:1024", "max_docs": 200, "val_docs": 10},
    "train": ["--model.n_layer", "2", "--model.d_model", "64", "--data.seq_len", "128",
              "--train.global_batch_tokens", "2048", "--train.max_steps", "30",
              "--eval.every", "10", "--eval.tokens", "2048", "--checkpoint.every", "10",
              "--sample.every", "0"],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmforge demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/demo"),
                   help="where the data and the run go (default: runs/demo)")
    p.add_argument("--nproc", type=int, default=1, help="training processes (torchrun when > 1)")
    p.add_argument("--quick", action="store_true", help="a one-minute smoke run of every stage")
    return p


def banner(i: int, title: str) -> None:
    print(f"\n=== [{i}/4] {title}", flush=True)


def run_training(data: Path, run: Path, nproc: int, overrides: list[str]) -> None:
    if (run / "final" / "meta.json").is_file():
        print(f"already trained: {run / 'final'} exists (delete {run} to train again)")
        return
    cmd = [sys.executable, "-m", "launch.cli", "train", "--nproc", str(nproc),
           "--config", str(CONFIG), "--data.path", str(data), "--log.out_dir", str(run),
           "--resume", "auto", *overrides]
    print("$ " + " ".join(cmd[1:]), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        raise CheckpointError(f"training exited with status {rc} (its log is above and in "
                              f"{run / 'train.log'}); fix that, then re-run the demo to resume")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = QUICK if args.quick else FULL
    data = args.out / ("data_quick" if args.quick else "data")
    run = args.out / ("run_quick" if args.quick else "run")
    t0 = time.perf_counter()

    banner(1, f"prepare builtin:pystdlib -> {data}")
    manifest = prepare(PrepareConfig(out=data, source="builtin:pystdlib", progress=False,
                                     **plan["data"]))
    print(summary(manifest))

    banner(2, f"train {CONFIG.name} -> {run}")
    run_training(data, run, args.nproc, plan["train"])

    banner(3, "evaluate on the whole val split")
    info = init_distributed("auto")
    ckpt = load_for_inference(run, info.device)
    result, _ = evaluate_checkpoint(ckpt, data, info)
    print(report(result))

    banner(4, f"sample from {ckpt.path}")
    enc = load_tokenizer_dir(ckpt.tokenizer_dir)
    ids = encode_prompt(enc, PROMPT, ckpt.config.max_seq_len)
    sys.stdout.write(PROMPT)
    write_sample(ckpt, enc, ids, min(120, ckpt.config.max_seq_len - len(ids)), sys.stdout,
                 temperature=0.8, top_k=50, top_p=None, seed=0)

    print(f"""
=== done in {time.perf_counter() - t0:.0f} s
shards      {data}  (manifest.json, tokenizer/)
run         {run}  (config.toml, train.log)
checkpoint  {ckpt.path}  (step {ckpt.step})
metrics     {run / 'metrics.jsonl'}
loss plot   {run / 'loss.png'}
val perplexity {result.perplexity:.2f} (loss {result.loss:.4f}, {result.bits_per_byte:.3f} bits/byte, {result.tokens:,} tokens)

next:
  lmforge sample --ckpt {run} --prompt "import " --num-samples 3
  lmforge eval --ckpt {run} --data {data} --json {args.out / 'eval.json'}
  lmforge export --ckpt {run} --hf {args.out / 'hf'}""")
    return 0
