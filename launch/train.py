"""`lmforge train`: the command line of the trainer (pipeline/train.py).

    python -m lmforge.launch.train --config configs/tiny.toml [--a.b value ...]   one process
    torchrun --standalone --nproc_per_node=N -m lmforge.launch.train --config ...  N processes, any nodes
    accelerate launch --multi_gpu --num_processes N -m lmforge.launch.train ...   the same, via accelerate
    lmforge train --nproc N --config ...                                   torchrun, started for you

`--dry-run` prints the resolved config, the derived sizes and the plan (pipeline/parallel/plan.py) and
starts nothing. SIGTERM (a scheduler's preemption) makes the trainer checkpoint at the end of the
current step and exit; so does the death of torchrun, a worker's parent. One run at a time
writes a run directory (pipeline/checkpoint/lock.py): another one is refused.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from lmforge.data_prep.errors import DataError, output_error
from lmforge.data_prep.shards import load_manifest
from lmforge.launch.cli import ERROR_DIR, ArgumentParser, user_errors
from lmforge.pipeline.checkpoint.lock import check_unlocked, run_lock
from lmforge.pipeline.config import ConfigError, JobConfig, derive, describe, load_config, to_toml
from lmforge.pipeline.data.mixture import describe_mixture, open_sources
from lmforge.pipeline.metrics import get_logger, setup_logging
from lmforge.pipeline.parallel.distributed import (
    DistInfo,
    any_rank,
    distributed,
    stop_with_launcher,
)
from lmforge.pipeline.parallel.materialize import meta_gpt
from lmforge.pipeline.parallel.plan import report as plan_report
from lmforge.pipeline.train import Trainer, TrainingStopped, model_config_for
from lmforge.pipeline.typed_config import keys_help, number

log = get_logger()


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="lmforge train",
        description="Train a GPT. Every config key below can be set in a --config TOML file "
                    "or overridden on the command line: --train.max_steps 100",
        epilog="config keys (type = default):\n" + keys_help(JobConfig),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="TOML file in configs/ (defaults when omitted)")
    p.add_argument("--resume", help="none | auto | PATH (shortcut for --checkpoint.resume)")
    p.add_argument("--nproc", type=number(int, 1), default=None,
                   help="processes per node: `lmforge train` starts torchrun with N; with "
                        "--dry-run, the plan is for N (default: $WORLD_SIZE or 1)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config, derived sizes and plan, then exit")
    plan = p.add_argument_group("--dry-run planning (pipeline/parallel/plan.py): memory per GPU, traffic, time")
    plan.add_argument("--nnodes", type=number(int, 1), default=1, help="nodes (default 1)")
    plan.add_argument("--gpu", default="H100",
                      help="GPU model for memory and peak FLOP/s (default H100)")
    plan.add_argument("--mfu", type=number(float, 1e-3, 1.0), default=0.4,
                      help="assumed model FLOPs utilisation (default 0.4)")
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    args, overrides = build_parser().parse_known_args(argv)
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
    return meta_gpt(model_cfg).num_params(exclude_embeddings=model_cfg.vocab_size == 1)


def dry_run(cfg: JobConfig, args: argparse.Namespace) -> int:
    nproc = args.nproc or int(os.environ.get("WORLD_SIZE", "1"))
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
    stop_with_launcher()  # a killed torchrun must not leave its workers training
    out_dir = Path(cfg.log.out_dir)
    with distributed(cfg.train.device) as info, \
            run_lock(out_dir, take=info.is_main, any_failed=lambda failed: any_rank(failed, info)):
        try:
            setup_logging(info.rank, out_dir if info.is_main else None)
            return fit(cfg, info)
        except user_errors():
            raise
        except Exception as e:  # a full or read-only disk mid-run: one line, not a traceback
            error = output_error(e, out_dir, "free space on its disk or make --log.out_dir "
                                             "writable, then --resume auto continues from the "
                                             "last checkpoint")
            if error is None:
                raise
            raise error from None


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
    parsed, overrides = parse_args(argv)
    if (parsed.nproc or 1) <= 1 or parsed.dry_run:  # a dry run plans --nproc, it starts nothing
        return main(argv)
    # Config and data mistakes and a run directory in use: one line here, not one per rank
    # under a torchrun traceback.
    cfg = load_config(parsed.config, overrides)
    open_sources(cfg.data)
    check_unlocked(Path(cfg.log.out_dir))
    return torchrun(["--standalone", f"--nproc_per_node={parsed.nproc}", "-m", "lmforge.launch.train",
                     *without_nproc(argv)])


def torchrun(args: list[str]) -> int:
    """torchrun's agent in this process, as its own command would run it. A user error in the
    ranks is one `error:` line and exit 2 (the lowest rank's line: every rank of a config or
    data mistake has the same), not each rank's line under torchrun's ChildFailedError
    traceback; any other failure is torchrun's report, unchanged."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_args
    from torch.distributed.run import run

    with tempfile.TemporaryDirectory(prefix="lmforge-errors-") as errors:
        os.environ[ERROR_DIR] = errors
        try:
            run(torchrun_args(args))
        except ChildFailedError as e:
            lines = [p.read_text() for p in sorted(Path(errors).iterdir())]
            codes = {f.exitcode for f in e.failures.values()}  # < 0: stopped by torchrun's signal
            if not lines or 2 not in codes or any(c > 0 and c != 2 for c in codes):
                raise
            print(lines[0], file=sys.stderr)
            return 2
        finally:
            del os.environ[ERROR_DIR]
    return 0


def without_nproc(argv: list[str]) -> list[str]:
    """argv less `--nproc N` / `--nproc=N`: torchrun's workers are each one of the N."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


if __name__ == "__main__":  # the torchrun / accelerate target: -m lmforge.launch.train
    import logging

    import torch.distributed as dist

    from lmforge.launch.cli import run_user_command

    rc = run_user_command(main, sys.argv[1:])
    if rc and dist.is_initialized():
        # A failed rank leaves its process group alive (pipeline.parallel.distributed: a
        # teardown could deadlock); the interpreter's exit would then destroy gloo's running
        # threads, std::terminate turning this rank's code into SIGABRT (-6) in about 1 run of
        # 6, and the launcher's one error line into torchrun's traceback. Leave without it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
