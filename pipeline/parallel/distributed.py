"""Process-group set-up and the few collectives the training loop needs, under plain `python`
(one process, no group), `torchrun` and `accelerate launch` (the same RANK / WORLD_SIZE /
LOCAL_RANK variables). LMFORGE_DIST_TIMEOUT_MIN (default 30) bounds a collective's wait.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lmforge.pipeline.hardware import configure_cuda
from lmforge.pipeline.typed_config import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def stop_with_launcher() -> bool:
    """In a torchrun (or accelerate) worker on Linux: SIGTERM this process when its parent, the
    launcher's agent, dies, as a SIGKILL of the launcher's process group (a scheduler, the OOM
    killer) does not reach the workers' own sessions. Returns whether that is armed."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        return False
    if os.getppid() == 1:  # the launcher died before the call, and this process went to init
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {requested!r} asked for, but torch sees no CUDA device here "
                          f"(torch {torch.__version__}); use cpu or auto")
    return torch.device("cuda", local_rank)


def init_distributed(requested_device: str = "auto") -> DistInfo:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        configure_cuda()
    if world_size > 1 and not dist.is_initialized():
        # A dead or hung rank makes the others fail naming the collective, rather than hold every
        # GPU until the job's limit; generous: a first compile or a save takes minutes.
        timeout = timedelta(minutes=float(os.environ.get("LMFORGE_DIST_TIMEOUT_MIN", "30")))
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timeout,
            # Binds the NCCL communicator to this rank's GPU up front (no guessing in barrier).
            device_id=device if device.type == "cuda" else None,
        )
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


@contextmanager
def distributed(requested_device: str = "auto") -> Iterator[DistInfo]:
    """The process group (none for one process) for the body, destroyed after it while the
    interpreter is fully alive: at exit, gloo's threads freeing tensors, or a rank leaving while a
    peer still works, were seen to abort (SIGABRT) a run that had succeeded. So every rank waits
    for the others and frees what holds the group (the body must not keep the model alive). An
    exception skips this: a barrier while a peer waits in another collective can deadlock
    (torchtitan #1342); this rank exits non-zero and torchrun stops the others."""
    info = init_distributed(requested_device)
    yield info
    if dist.is_initialized():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.is_distributed:
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a tensor across ranks in place (no-op on one process) and return it."""
    if info.is_distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Elementwise maximum of a tensor across ranks in place (no-op on one process)."""
    if info.is_distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def any_rank(flag: bool, info: DistInfo) -> bool:
    """Whether `flag` holds on any rank (a collective: every rank calls it)."""
    t = torch.tensor([float(flag)], device=info.device)
    return bool(all_reduce_max(t, info).item())
