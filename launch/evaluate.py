"""`lmforge eval`: loss, perplexity and bits per byte of a checkpoint on a prepared split, and
downstream multiple-choice tasks (pipeline/tasks/).

    lmforge eval --ckpt runs/tiny --data data/pystdlib [--split val] [--max-tokens N] [--json F]
    lmforge eval --ckpt runs/tiny --tasks arc_easy,piqa,mine.jsonl [--max-examples N] [--nproc N]
    torchrun --nproc_per_node=8 -m lmforge.launch.evaluate --ckpt ... --data ...   (ranks split the tokens)

`--tasks` alone skips the perplexity (give --data too for both); `--nproc N` starts torchrun.

The windows are `pipeline.evaluate.eval_batches` (every target token counted once, tail
included) and the arithmetic is `pipeline.evaluate.evaluate`, both shared with training's val
eval: with the run's seq_len, batch size, dtype and `--max-tokens` = its `eval.tokens`, the
perplexity printed here is exp(val_loss) that training logged for the same checkpoint (exactly
on as many processes; under FSDP with bf16 within FSDP_BF16_REL_TOL, see dtype_line).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.safe_files import atomic_write_bytes, check_writable
from lmforge.data_prep.shards import SPLITS, check_dir_path
from lmforge.data_prep.tokenizer import (
    dataset_tokenizer_meta,
    load_tokenizer_dir,
    read_tokenizer_meta,
    token_byte_lengths,
)
from lmforge.launch.cli import ArgumentParser
from lmforge.pipeline import attention
from lmforge.pipeline.config import ConfigError
from lmforge.pipeline.data.windows import TokenWindows
from lmforge.pipeline.evaluate import EvalResult, eval_batches, evaluate
from lmforge.pipeline.hardware import dtype_name
from lmforge.pipeline.inference import LoadedCheckpoint, load_for_inference
from lmforge.pipeline.loss import build_loss, eval_loss_name, resolve_loss
from lmforge.pipeline.parallel.distributed import DistInfo, distributed
from lmforge.pipeline.parallel.parallelize import Precision
from lmforge.pipeline.tasks.evaluate import (
    Task,
    TaskResult,
    check_specs,
    downstream,
    encode_task,
    load_task,
    table,
    timed_evaluate,
)
from lmforge.pipeline.typed_config import number

FSDP_BF16_REL_TOL = 5e-4
"""How far a bf16 FSDP run's logged val loss may lie from this eval's: the norm gains rounded to
bf16 (2**-9 relative at most) move the loss by far less (tests/test_eval_matches_training.py)."""
MAX_BATCH = 1 << 16  # windows per forward (fewer when the split has fewer per rank)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="lmforge eval",
        description="Loss, perplexity and bits per byte of a checkpoint on a prepared split, "
                    "and downstream multiple-choice tasks. Runs under torchrun too (the ranks "
                    "split the tokens and the examples).")
    p.add_argument("--ckpt", required=True,
                   help="run directory (newest checkpoint), checkpoints/step_* or final/")
    p.add_argument("--data", type=Path, default=None,
                   help="dataset prepared by lmforge prepare (perplexity; nextline's val split)")
    p.add_argument("--tasks", default=None, metavar="T1,T2,...",
                   help="downstream tasks: named (arc_easy, hellaswag, ...; NAME@hub online), "
                        "nextline (the data's val documents) or FILE.jsonl")
    p.add_argument("--max-examples", type=number(int, 1), default=None,
                   help="score only the first N examples of each task")
    p.add_argument("--nproc", type=number(int, 1), default=1,
                   help="processes: N > 1 starts torchrun with N on this node")
    p.add_argument("--split", default="val", choices=SPLITS)
    p.add_argument("--max-tokens", type=number(int, 1), default=None,
                   help="evaluate only the first N target tokens (default: the whole split)")
    p.add_argument("--batch-size", type=number(int, 1, MAX_BATCH), default=None,
                   help="windows per forward (default: the run's eval.batch_size)")
    p.add_argument("--seq-len", type=number(int, 1), default=None,
                   help="window length (default: the run's data.seq_len)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="also write the results to FILE as JSON")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["auto", "bf16", "fp32"],
                   help="compute dtype (default: the run's train.dtype, so the loss is the one "
                        "training logged; auto: bf16 where the hardware is fast at it)")
    return p


def check_same_tokenizer(data_dir: Path, tokenizer_dir: Path) -> None:
    """Token ids mean nothing under another vocabulary: refuse before computing a bogus loss.
    The data's tokenizer is its manifest's, as training reads it (dataset_tokenizer_meta)."""
    data_tok = dataset_tokenizer_meta(data_dir)
    ckpt_tok = read_tokenizer_meta(tokenizer_dir)
    if data_tok["sha256"] != ckpt_tok["sha256"]:
        raise DataError(
            f"{data_dir} was tokenized with {data_tok['name']} (sha256 {data_tok['sha256'][:12]}), "
            f"the checkpoint with {ckpt_tok['name']} (sha256 {ckpt_tok['sha256'][:12]}); prepare "
            f"the data with the checkpoint's tokenizer: lmforge prepare --tokenizer {tokenizer_dir} ...")


def run_setting(flag: str, override: int | None, from_run: int) -> int:
    """An eval setting: the command line, else the run's config (so the defaults reproduce
    training's val eval)."""
    value = from_run if override is None else override
    if value < 1:
        raise ConfigError(f"{flag} must be >= 1, got {value}")
    return int(value)


def evaluate_checkpoint(
    ckpt: LoadedCheckpoint, data_dir: Path, info: DistInfo, *, split: str = "val",
    max_tokens: int | None = None, batch_size: int | None = None, seq_len: int | None = None,
    dtype: str | None = None,
) -> tuple[EvalResult, int, torch.dtype]:
    """(result, seq_len and dtype used): collective under torchrun, every rank calls it."""
    check_same_tokenizer(data_dir, ckpt.tokenizer_dir)
    run_cfg = ckpt.meta.config
    seq_len = run_setting("--seq-len", seq_len, run_cfg.data.seq_len)
    batch_size = run_setting("--batch-size", batch_size, run_cfg.eval.batch_size)
    if seq_len > ckpt.config.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's context of "
                          f"{ckpt.config.max_seq_len} tokens; pass --seq-len {ckpt.config.max_seq_len} or less")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {max_tokens}")
    windows = TokenWindows(data_dir, split, seq_len, ckpt.config.vocab_size)
    batches = eval_batches(windows, batch_size, info.rank, info.world_size, max_tokens)
    token_bytes = torch.from_numpy(token_byte_lengths(load_tokenizer_dir(ckpt.tokenizer_dir))).long()
    precision = Precision.resolve(run_cfg.train.dtype if dtype is None else dtype, info.device, "eval")
    # The loss and attention training's eval computed with (its config's resolved choices).
    V, tokens = ckpt.config.padded_vocab_size, batch_size * seq_len
    loss = eval_loss_name(resolve_loss(run_cfg.train.loss, info.device, V, tokens), V, tokens)
    result = evaluate(ckpt.model, batches, token_bytes, info, precision=precision,
                      loss_fn=build_loss(loss, info.device),
                      attend=attention.kernel(run_cfg.train.attention))
    return result, seq_len, precision.dtype


def dtype_line(ckpt: LoadedCheckpoint, dtype: torch.dtype, requested: str | None) -> str:
    """Which dtype this eval computed in and why; under FSDP with bf16, why training's logged
    val loss is not reproduced exactly."""
    run = ckpt.meta.config.train
    line = f"dtype          {dtype_name(dtype)} ("
    line += f"--dtype {requested})" if requested else f"the run's train.dtype = {run.dtype})"
    if dtype == torch.bfloat16 and run.parallel == "fsdp" and ckpt.meta.world_size > 1:
        # FSDP's MixedPrecisionPolicy hands the forward bf16 copies of every parameter (the
        # norm gains too); autocast, used here, keeps the gains fp32.
        line += ("; the run evaluated under FSDP with bf16 parameters: its logged val loss "
                 f"agrees with this to {FSDP_BF16_REL_TOL:g} relative, not exactly")
    return line


def report(result: EvalResult) -> str:
    return "\n".join([
        f"loss           {result.loss:.6f}",
        f"perplexity     {result.perplexity:.4f}",
        f"bits per byte  {result.bits_per_byte:.6f}",
        f"tokens         {result.tokens:,} ({result.bytes:,} bytes)",
    ])


def load_tasks(ckpt: LoadedCheckpoint, specs: list[str], data: Path | None,
               max_examples: int | None = None) -> list[Task]:
    """The tasks named, encoded for the checkpoint's model (on every rank: an example it cannot
    score is every rank's error, before any collective); `nextline` reads `data`, else the run's
    own dataset."""
    data = data if data is not None else Path(ckpt.meta.config.data.first_path)
    enc = load_tokenizer_dir(ckpt.tokenizer_dir)
    return [encode_task(load_task(spec, data, max_examples), enc, ckpt.config.max_seq_len)
            for spec in specs]


def evaluate_tasks_of(ckpt: LoadedCheckpoint, tasks: list[Task], info: DistInfo,
                      dtype: str | None = None) -> tuple[dict[str, TaskResult], float]:
    """The tasks' figures and examples/s (collective under torchrun), in --dtype or the run's."""
    precision = Precision.resolve(ckpt.meta.config.train.dtype if dtype is None else dtype,
                                  info.device, "eval")
    return timed_evaluate(ckpt.model, tasks, info, precision, progress=info.is_main)


def task_record(results: dict[str, TaskResult]) -> dict:
    """The JSON of a task run: {"tasks": {NAME: {acc, acc_norm, centered, n}}, "downstream"}."""
    return {"tasks": {name: asdict(r) for name, r in results.items()},
            "downstream": downstream(results)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.data is None and args.tasks is None:
        raise ConfigError("nothing to evaluate: give --data DIR (perplexity), --tasks T1,T2 "
                          "(downstream tasks), or both")
    specs = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else []
    check_specs(specs)
    if args.json:  # before the evaluation, not after it
        check_dir_path(args.json.parent, "--json")
        if args.json.is_dir():
            raise ConfigError(f"--json {args.json} is a directory; give a file path")
        check_writable(args.json.parent, what="--json")
    if args.nproc > 1:
        from lmforge.launch.train import torchrun, without_nproc

        return torchrun(["--standalone", f"--nproc_per_node={args.nproc}", "-m",
                         "lmforge.launch.evaluate", *without_nproc(argv)])
    record: dict = {}
    with distributed(args.device) as info:
        ckpt = load_for_inference(args.ckpt, info.device)
        tasks = load_tasks(ckpt, specs, args.data, args.max_examples)  # bad input: before work
        if info.is_main:
            print(f"checkpoint     {ckpt.path} (step {ckpt.step})")
        if args.data is not None:
            result, seq_len, dtype = evaluate_checkpoint(
                ckpt, args.data, info, split=args.split, max_tokens=args.max_tokens,
                batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype)
            record = asdict(result) | {"data": str(args.data), "split": args.split,
                                       "seq_len": seq_len, "dtype": dtype_name(dtype)}
            if info.is_main:
                print(f"data           {args.data} [{args.split}], windows of {seq_len} tokens")
                print(dtype_line(ckpt, dtype, args.dtype))
                print(report(result))
        if tasks:
            results, rate = evaluate_tasks_of(ckpt, tasks, info, args.dtype)
            record |= task_record(results)
            if info.is_main:
                print(table(results))
                print(f"{sum(r.n for r in results.values()):,} examples at {rate:,.1f} "
                      f"examples/s ({info.world_size} process{'es' * (info.world_size > 1)})")
    if info.is_main and args.json:
        record |= {"checkpoint": str(ckpt.path), "step": ckpt.step}
        write_json(args.json, record)
    return 0


def write_json(path: Path, record: dict) -> None:
    """`record` to `path` whole or not at all (a temp file renamed over it: a link or hard link
    at `path` is replaced, never written through)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, [(json.dumps(record, indent=2) + "\n").encode()], what="--json")
    except OSError as e:
        raise DataError(f"cannot write --json {path} ({e.strerror}); the results are printed "
                        "above: give a writable path to keep them as JSON") from None


if __name__ == "__main__":  # torchrun -m lmforge.launch.evaluate ...
    from lmforge.launch.cli import run_user_command

    sys.exit(run_user_command(main, sys.argv[1:]))
