"""Training checkpoints written in the background (checkpoint.async_save), or in the step.

In the background, the DCP write of format.save_training's three phases is DCP's async_save:
the state is staged to host memory in the step and written by a thread while training goes on.
DCP's coordinator (rank 0) completes only after every rank's write did, so once rank 0's is done
the checkpoint is on disk and `poll`, at a step boundary on the main thread, finishes it (meta.json,
the rename). Until then it is a `.tmp` that nothing picks: a crash mid-write leaves the previous
checkpoint the newest. At most one save is in flight; `wait` (last step, SIGTERM) blocks on it.
A failed write removes its `.tmp` and stops the run with one CheckpointError line (for a full
disk: the space free, the space needed, the last complete checkpoint). The background write's
collectives run on a gloo group of their own: they must not interleave with the step's on the
default group, and async_save needs a CPU backend, which an nccl run's default group lacks.
"""

from __future__ import annotations

import os
import shutil
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

from lmforge.data_prep.errors import is_disk_full
from lmforge.pipeline.checkpoint import format as ckpt
from lmforge.pipeline.checkpoint.safe_dcp import SINGLE_PROCESS_WARNING
from lmforge.pipeline.errors import CheckpointError
from lmforge.pipeline.metrics import get_logger
from lmforge.pipeline.parallel.distributed import DistInfo

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
    need: int  # bytes of the state written: what a full disk is told it lacks


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
            try:
                final = ckpt.save_training(run_dir, model, optimizer, meta, tokenizer_dir,
                                           self.info, keep)
            except (OSError, CheckpointException) as e:  # DCP's is a BaseException
                tmp = ckpt.RunDir(run_dir).checkpoints / (ckpt.step_dir_name(meta.step) + ".tmp")
                need = _nbytes(get_state_dict(model, optimizer))  # Optimizers too (Muon)
                raise self._failed(e, tmp, need, "") from None
            log.info("checkpoint %s", final)
            return final
        self.wait()  # at most one in flight
        tmp, final = ckpt.begin_save(run_dir, meta.step, self.info)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        future = dcp.async_save({"model": model_sd, "optim": optim_sd},
                                storage_writer=_Writer(tmp, meta.step), process_group=self.group,
                                no_dist=not self.info.is_distributed)
        self.in_flight = _InFlight(future, tmp, final, meta, tokenizer_dir, keep,
                                   time.perf_counter(), _nbytes(model_sd) + _nbytes(optim_sd))
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
            if self.info.is_main:
                ckpt.finish_save(job.tmp, job.final, job.meta, job.tokenizer_dir, job.keep)
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise self._failed(e, job.tmp, job.need, " in the background") from None
        log.info("checkpoint %s (written in the background in %.1f s)", job.final,
                 time.perf_counter() - job.started)

    def _failed(self, e: BaseException, tmp: Path, need: int, how: str) -> CheckpointError:
        """The one line of a failed save, its incomplete `tmp` removed (by rank 0)."""
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        root = tmp.parent
        done = ckpt.list_complete(root)
        last = f"the last complete checkpoint is {done[-1].name}" if done else \
            "no checkpoint of this run is complete"
        final = root / tmp.name.removesuffix(".tmp")
        if is_disk_full(e):
            free = shutil.disk_usage(root).free if root.is_dir() else 0
            return CheckpointError(
                f"no space left on device writing {final} (free {free / 2**20:,.0f} MB, a "
                f"checkpoint needs ~{need / 2**20:,.0f} MB); {last}; free space, or lower "
                "checkpoint.keep, then --resume auto")
        return CheckpointError(f"writing checkpoint {final.name}{how} failed ({_cause(e)}); the "
                               f"run stops here; {last}, --resume auto continues from it")


def _nbytes(state: object) -> int:
    """Bytes of the tensors in a (nested) state dict, at their global size."""
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_nbytes(v) for v in state)
    return state.numel() * state.element_size() if hasattr(state, "element_size") else 0


def _cause(e: BaseException) -> str:
    """The first failing rank's exception, in one line (DCP wraps each rank's with its trace)."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, (e, _) = next(iter(failures.items()))
        return f"rank {rank}: {type(e).__name__}: {e}".splitlines()[0]
    return f"{type(e).__name__}: {e}".splitlines()[0]
