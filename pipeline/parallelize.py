"""Apply activation checkpointing, torch.compile and DDP / FSDP2 to a plain `GPT` from outside.

The model file knows nothing of any of this (torchtitan's pattern). The order is fixed:
activation checkpointing -> compile -> data parallelism, each per transformer block, so that
compiled regions line up with FSDP's all-gather units and a block is recomputed as one piece.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from model import GPT
from pipeline.distributed import DistInfo


def resolve_parallel(requested: str, info: DistInfo) -> str:
    """auto: DDP when there are several processes. A GPU preset (ddp/fsdp) started as one plain
    process has nothing to replicate or shard across, so it runs as none rather than failing."""
    if requested == "auto" or not info.is_distributed:
        return "ddp" if info.is_distributed else "none"
    return requested


def resolve_compile(requested: str, device: torch.device) -> bool:
    # Off by default on CPU: a cold compile costs ~30 s here, more than a demo run gains.
    return device.type == "cuda" if requested == "auto" else requested == "on"


def parallelize(
    model: GPT,
    info: DistInfo,
    *,
    parallel: str,
    bf16: bool,
    compile_model: bool,
    activation_checkpointing: bool,
) -> nn.Module:
    """Return the module to train. `model` must already hold its initial weights on info.device."""
    if activation_checkpointing:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if compile_model:
        # In-place Module.compile keeps parameter names free of an `_orig_mod.` prefix, so
        # checkpoints load the same whether or not the run was compiled.
        for block in model.blocks:
            block.compile()
    if parallel == "fsdp":
        # bf16 parameters for compute, fp32 gradient reduction; the sharded fp32 parameters
        # the optimizer updates are the master weights.
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32
        )
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    if parallel == "ddp":
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    return model


def needs_autocast(parallel: str, bf16: bool) -> bool:
    # FSDP2 casts parameters itself (MixedPrecisionPolicy); DDP and single-process use autocast.
    return bf16 and parallel != "fsdp"


def autocast(device: torch.device, enabled: bool):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def grad_sync(model: nn.Module, parallel: str, sync: bool):
    """Context for one micro-step: gradients are reduced across ranks only when `sync`.

    DDP's no_sync must wrap the forward as well as the backward (field lesson 3), which is why
    this is a context around the whole micro-step, not a flag flipped before backward.
    """
    if parallel == "ddp" and not sync:
        return model.no_sync()
    if parallel == "fsdp":
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
