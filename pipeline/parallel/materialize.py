"""The model is built on the meta device, sharded, and only then allocated and initialised
(`meta_gpt`, then `materialize`), so under FSDP2 no rank ever holds the whole model.

The initial weights do not depend on the world size: each tensor is drawn whole from torch's CPU
generator in GPT.init_weights' order, as one process would, and this rank keeps its part; it holds
at most one whole parameter beside its shards.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from lmforge.model import GPT, ModelConfig

# The in-place random fills nn.init is built on (normal_, and uniform_ under kaiming/xavier), and
# nn.init's own entry points, which hand a tensor to the mode before calling them.
_RANDOM_FILLS = {torch.Tensor.normal_, torch.Tensor.uniform_, nn.init.normal_, nn.init.uniform_}


def meta_gpt(cfg: ModelConfig) -> GPT:
    """A GPT with the shapes of `cfg` and no storage (its init_weights has not run)."""
    with torch.device("meta"):
        return GPT(cfg)


def materialize(model: GPT, device: torch.device, seed: int) -> None:
    """Allocate `model` on `device` (under FSDP2: this rank's shards), initialised from `seed`."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with _DrawWholeOnCpu():
        model.init_weights()


class _DrawWholeOnCpu(TorchFunctionMode):
    """Random fills of shards and of device tensors draw the whole tensor from the CPU generator
    (as a whole CPU tensor would be filled), then copy in this rank's part of it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # nn.init passes its tensor by keyword ("tensor"), Tensor methods positionally.
        target = args[0] if args else kwargs.get("tensor")
        if func not in _RANDOM_FILLS or not isinstance(target, torch.Tensor) or (
                target.device.type == "cpu" and not isinstance(target, DTensor)):
            return func(*args, **kwargs)
        whole = torch.empty(target.shape, dtype=target.dtype, device="cpu")
        if args:
            func(whole, *args[1:], **kwargs)
        else:
            func(**{**kwargs, "tensor": whole})
        return copy_whole(target, whole)


def copy_whole(target: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """Copy a whole tensor into `target`: a plain tensor, or this rank's part of a DTensor."""
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank holds the same whole tensor and keeps its own part,
        # no communication.
        part = distribute_tensor(whole, target.device_mesh, target.placements,
                                 src_data_rank=None).to_local()
        target.to_local().copy_(part)
    else:
        target.copy_(whole)
    return target
