"""Process-group set-up and the few collectives the training loop needs.

Works unchanged under plain `python` (one process, no process group), `torchrun` (one node or
several) and `accelerate launch` (which starts the workers through torchrun's machinery and sets
the same RANK / WORLD_SIZE / LOCAL_RANK variables).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def init_distributed(requested_device: str = "auto") -> DistInfo:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.is_distributed:
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a tensor across ranks in place (no-op on one process) and return it."""
    if info.is_distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
