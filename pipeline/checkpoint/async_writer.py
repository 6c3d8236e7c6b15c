"""Training checkpoints written in the background (checkpoint.async_save), or in the step.

`Checkpointer.save` runs checkpoint.save_training's phases: begin_save (NAME.tmp, each rank's RNG
states), the DCP write, and rank 0's finish_save (tokenizer, meta.json last, the rename, keep-K).
Asynchronously, the write is torch.distributed.checkpoint.async_save: the state is staged (copied
to host memory) in the step, then written by a background thread while training goes on. Every
rank's RNG file is in place before its write starts, and DCP's coordinator (rank 0) completes
only after every rank's write did, so when rank 0's write is done the whole checkpoint is on disk:
`poll`, at each step boundary on the main thread, then finishes it. Until then it is a `.tmp`
directory, which nothing picks: a crash or SIGKILL mid-write leaves the previous checkpoint the
newest complete one.

At most one save is in flight: the next waits for it. `wait` (the last step, SIGTERM) blocks until
it is complete. A failed background write raises CheckpointError: one error line, the run stops.
The background write's collectives run on a gloo group of their own, so that they never
interleave with the training step's collectives on the default group (and async_save needs a CPU
backend, which an nccl run's default group lacks).
"""

from __future__ import annotations

import os
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from pipeline.checkpoint import format as ckpt
from pipeline.checkpoint.safe_dcp import SINGLE_PROCESS_WARNING
from pipeline.metrics import get_logger
from pipeline.parallel.distributed import DistInfo

log = get_logger()

# Test-only hook (tests/test_async_checkpoint.py): STEP:SECONDS makes the background write of
# step STEP's checkpoint sleep first, so that a test can kill a run while it is in flight;
# STEP:fail makes it raise. Unset (always, outside tests) it costs one lookup per save.
WRITE_HOOK_ENV = "LMFORGE_TEST_CHECKPOINT_WRITE"


class _Writer(dcp.FileSystemWriter):
    def __init__(self, tmp: Path, step: int):
        super().__init__(tmp)
        self.step = step

    def write_data(self, plan, planner):
        hook_step, _, action = os.environ.get(WRITE_HOOK_ENV, "").partition(":")
        if hook_step == str(self.step):
            if action == "fail":
                raise OSError(f"{WRITE_HOOK_ENV}={hook_step}:fail (test hook)")
            time.sleep(float(action))
        return super().write_data(plan, planner)


@dataclass
class _InFlight:
    future: Future
    tmp: Path
    final: Path
    meta: ckpt.CheckpointMeta
    tokenizer_dir: Path
    keep: int
    started: float


class Checkpointer:
    """Saves the run's training checkpoints, in the background when `background`."""

    def __init__(self, info: DistInfo, background: bool):
        self.info, self.background = info, background
        self.in_flight: _InFlight | None = None
        # Created by every rank, in the same order: new_group is itself a collective.
        self.group = (dist.new_group(backend="gloo")
                      if background and info.is_distributed else None)
        if background and not info.is_distributed:
            # The background write warns that it runs in one process (single_process_ok
            # cannot reach into its thread); for us that is intended.
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)

    def save(self, run_dir: Path, model: nn.Module, optimizer, meta: ckpt.CheckpointMeta,
             tokenizer_dir: Path, keep: int) -> Path:
        """Collective: checkpoint of meta.step (synchronous: complete on return; else `wait`)."""
        if not self.background:
            final = ckpt.save_training(run_dir, model, optimizer, meta, tokenizer_dir, self.info,
                                       keep)
            log.info("checkpoint %s", final)
            return final
        self.wait()  # at most one in flight
        tmp, final = ckpt.begin_save(run_dir, meta.step, self.info)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        future = dcp.async_save({"model": model_sd, "optim": optim_sd},
                                storage_writer=_Writer(tmp, meta.step), process_group=self.group,
                                no_dist=not self.info.is_distributed)
        self.in_flight = _InFlight(future, tmp, final, meta, tokenizer_dir, keep, time.perf_counter())
        return final

    def poll(self) -> None:
        """At a step boundary: finish the save in flight if its write is done (never blocks)."""
        if self.in_flight is not None and self.in_flight.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written, then finish it."""
        job, self.in_flight = self.in_flight, None
        if job is None:
            return
        try:
            job.future.result()
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise ckpt.CheckpointError(
                f"writing checkpoint {job.final.name} in the background failed ({_cause(e)}); "
                f"the run stops here, {job.tmp.name} is incomplete; --resume auto continues "
                "from the newest complete checkpoint") from None
        if self.info.is_main:
            ckpt.finish_save(job.tmp, job.final, job.meta, job.tokenizer_dir, job.keep)
        log.info("checkpoint %s (written in the background in %.1f s)", job.final,
                 time.perf_counter() - job.started)


def _cause(e: BaseException) -> str:
    """The first failing rank's exception, in one line (DCP wraps each rank's with its trace)."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, (e, _) = next(iter(failures.items()))
        return f"rank {rank}: {type(e).__name__}: {e}".splitlines()[0]
    return f"{type(e).__name__}: {e}".splitlines()[0]
