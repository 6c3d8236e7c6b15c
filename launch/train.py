"""`lmforge train`: the command line of the trainer (pipeline/train.py).

    python -m launch.train --config configs/tiny.toml [--a.b value ...]   one process
    torchrun --standalone --nproc_per_node=N -m launch.train --config ...  N processes, any nodes
    accelerate launch --multi_gpu --num_processes N -m launch.train ...   the same, via accelerate
    lmforge train --nproc N --config ...                                   torchrun, started for you

`--dry-run` prints the resolved config, the derived sizes and the plan (pipeline/plan.py) and
starts nothing. SIGTERM (a scheduler's preemption) makes the trainer checkpoint at the end of the
current step and exit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from dataclasses import replace
from pathlib import Path

from data_prep.errors import DataError
from data_prep.shards import load_manifest
from pipeline.config import ConfigError, JobConfig, derive, describe, load_config, to_toml
from pipeline.distributed import DistInfo, distributed
from pipeline.metrics import get_logger, setup_logging
from pipeline.mixture import describe_mixture, open_sources
from pipeline.plan import meta_model
from pipeline.plan import report as plan_report
from pipeline.train import Trainer, TrainingStopped, model_config_for

log = get_logger()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="python -m launch.train",
        description="Train a GPT. Any config key can be overridden: --train.max_steps 100",
    )
    p.add_argument("--config", help="TOML file in configs/ (defaults when omitted)")
    p.add_argument("--resume", help="none | auto | PATH (shortcut for --checkpoint.resume)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config and derived sizes, then exit")
    plan = p.add_argument_group(
        "--dry-run planning (pipeline/plan.py): memory per GPU, traffic, time")
    plan.add_argument("--nproc", type=int,
                      help="processes (GPUs) per node (default: $WORLD_SIZE or 1)")
    plan.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    plan.add_argument("--gpu", default="H100",
                      help="GPU model for memory and peak FLOP/s (default H100)")
    plan.add_argument("--mfu", type=float, default=0.4,
                      help="assumed model FLOPs utilisation (default 0.4)")
    args, overrides = p.parse_known_args(argv)
    if args.resume:
        overrides += ["--checkpoint.resume", args.resume]
    return args, overrides


def count_params(cfg: JobConfig) -> int:
    """Parameters of the configured model, built on the meta device (no memory, no data read
    beyond the manifest; before `prepare` has run, the embedding is left out of the count)."""
    try:
        model_cfg = model_config_for(cfg.model, load_manifest(cfg.data.first_path).vocab_size)
    except DataError:
        model_cfg = replace(cfg.model, vocab_size=cfg.model.vocab_size or 1)
    return meta_model(model_cfg).num_params(exclude_embeddings=model_cfg.vocab_size == 1)


def dry_run(cfg: JobConfig, args: argparse.Namespace) -> int:
    nproc = args.nproc or int(os.environ.get("WORLD_SIZE", "1"))
    if nproc < 1 or args.nnodes < 1 or not 0 < args.mfu <= 1:
        raise ConfigError(f"--nproc {nproc} --nnodes {args.nnodes} --mfu {args.mfu:g}: expected "
                          "--nproc >= 1, --nnodes >= 1 and 0 < --mfu <= 1 (e.g. 0.4)")
    derived = derive(cfg, nproc * args.nnodes)  # a batch that does not divide: error, no output
    plan = plan_report(cfg, nproc, args.nnodes, args.gpu, args.mfu)
    print(to_toml(cfg))
    print(describe(cfg, derived, count_params(cfg)))
    print(describe_mixture(cfg.data, cfg.train.max_steps, cfg.train.global_batch_tokens))
    print()
    print(plan)
    return 0


def main(argv: list[str] | None = None) -> int:
    """One training process: alone, or one rank of torchrun / accelerate."""
    args, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = load_config(args.config, overrides)
    if args.dry_run:
        return dry_run(cfg, args)
    if (args.nproc or 1) != 1 or args.nnodes != 1:
        raise ConfigError("--nproc/--nnodes plan a --dry-run here; to train on N processes run "
                          "`lmforge train --nproc N` or torchrun")
    with distributed(cfg.train.device) as info:
        setup_logging(info.rank, Path(cfg.log.out_dir) if info.is_main else None)
        return fit(cfg, info)


def fit(cfg: JobConfig, info: DistInfo) -> int:
    """Train; the trainer (and the process group its DDP/FSDP model holds) is freed on return."""
    trainer = Trainer(cfg, info)
    previous = signal.signal(signal.SIGTERM, lambda *_: setattr(trainer, "stop_requested", True))
    try:
        return trainer.fit()
    except TrainingStopped as e:  # every rank stops at the same step: the teardown is collective
        log.error("%s", e)
        return 3
    finally:
        signal.signal(signal.SIGTERM, previous)


def cli_main(argv: list[str]) -> int:
    """`lmforge train [--nproc N] ...`: one process, or torchrun with N processes on this node."""
    p = argparse.ArgumentParser(prog="lmforge train", add_help=False)
    p.add_argument("--nproc", type=int, default=1)
    args, rest = p.parse_known_args(argv)
    if args.nproc <= 1 or "--dry-run" in rest:  # a dry run plans --nproc, it starts nothing
        return main(argv)
    parsed, overrides = parse_args(rest)
    # Config and data mistakes: one line here, not one per rank under a torchrun traceback.
    open_sources(load_config(parsed.config, overrides).data)
    torchrun = shutil.which("torchrun")
    prefix = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd = prefix + ["--standalone", f"--nproc_per_node={args.nproc}", "-m", "launch.train", *rest]
    os.execv(cmd[0], cmd)
    return 0  # unreachable


if __name__ == "__main__":  # the torchrun / accelerate target: -m launch.train
    from launch.cli import run_user_command

    sys.exit(run_user_command(main, sys.argv[1:]))
