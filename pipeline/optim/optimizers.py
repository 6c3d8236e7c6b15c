"""The optimizers (AdamW, or Muon + AdamW) and the learning-rate schedules.

Muon orthogonalises only the blocks' 2-D matrices: the embedding (a lookup, not a linear map of
the residual stream) and the 1-D gains keep AdamW. The schedule is a pure function of the step, so
a checkpoint needs no state of it: a resumed run gets exactly an uninterrupted run's lrs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lmforge.pipeline.config import OptimConfig, wsd_decay_steps
from lmforge.pipeline.optim.lrs import GROUPS, group_of, peak_lrs
from lmforge.pipeline.optim.muon import Muon


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device,
                    ns_dtype: torch.dtype = torch.float32):
    """AdamW, or (optim.name = "muon") Muon for the matrices + AdamW as one `Optimizers`; one
    param group per lr group (pipeline/optim/lrs.py), tagged with its "kind". ns_dtype: Muon's
    Newton–Schulz precision (the trainer passes its compute dtype)."""
    by_group = {g: [] for g in GROUPS}
    for name, p in model.named_parameters():
        if p.requires_grad:
            by_group[group_of(name, p.ndim)].append(p)
    if cfg.name == "adamw":
        return _keeping_memory(_adamw(by_group, cfg, device), model, device)
    muon = Muon(
        [{"params": by_group.pop("matrix"), "kind": "matrix"}], lr=cfg.lr,
        momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
        weight_decay=cfg.muon_weight_decay, ns_dtype=ns_dtype,
    )
    return _keeping_memory(Optimizers(_adamw(by_group, cfg, device), muon), model, device)


def _keeping_memory(optimizer, model: nn.Module, device: torch.device):
    """On CPU, a whole replica's steps reuse their freed buffers from the first step's end on
    (pipeline.cpu.allocator); FSDP2's shards give theirs back (pipeline.parallel.parallelize)."""
    if torch.device(device).type == "cpu" and not isinstance(model, FSDPModule):
        from lmforge.pipeline.cpu.allocator import (
            keep_freed_blocks_after_first_step,  # the CPU room
        )

        last = optimizer.optimizers[-1] if isinstance(optimizer, Optimizers) else optimizer
        keep_freed_blocks_after_first_step(last)
    return optimizer


def is_muon_matrix(name: str, param: nn.Parameter) -> bool:
    """Whether optim.name = "muon" gives `param` to Muon: the weight matrices' group."""
    return param.requires_grad and group_of(name, param.ndim) == "matrix"


def _adamw(by_group: dict[str, list], cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    # Decay only matrices and tables; norms' gains are 1-D and decaying them towards zero only
    # fights the normalisation. An empty group is left out: DCP refuses one beside another
    # optimizer, and which groups have parameters follows from the model alone.
    groups = [{"params": ps, "kind": kind, "weight_decay": 0.0 if kind == "scalar" else cfg.weight_decay}
              for kind, ps in by_group.items() if ps]
    # The fused kernel updates each parameter in one pass; foreach makes ~8 passes over the
    # parameters and both moments, which is most of an optimizer step where matmuls are cheap
    # (bench/results/adamw_step_*.txt). torch has it for CUDA and CPU tensors, DTensor included.
    fused = device.type in ("cuda", "cpu") if cfg.fused == "auto" else cfg.fused == "on"
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None
    )


class Optimizers:
    """Several optimizers stepped as one; iterable, as DCP's get_/set_state_dict take them."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


# ----------------------------------------------------------------------------- schedules

def lr_multiplier(step: int, max_steps: int, cfg: OptimConfig) -> float:
    """Fraction of the peak lr at step `step` (0-based): linear warmup reaching the peak at its
    last step, then cosine (from the peak, held one step) or WSD (the peak, then linear over the
    last decay_fraction: a stable-phase checkpoint can be extended) to min_lr_ratio at the end."""
    floor = cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        decay_steps = wsd_decay_steps(max_steps, cfg)
        decay_start = max_steps - decay_steps
        if step < decay_start:
            return 1.0
        frac = min(1.0, (step - decay_start + 1) / max(1, decay_steps))
        return 1.0 + frac * (floor - 1.0)
    peak_step = max(cfg.warmup_steps - 1, 0)  # the last warmup step is the peak (step 0 without)
    frac = min(1.0, (step - peak_step) / max(1, max_steps - 1 - peak_step))
    return floor + 0.5 * (1.0 + math.cos(math.pi * frac)) * (1.0 - floor)


def muon_momentum_at(step: int, cfg: OptimConfig) -> float:
    """Muon's momentum, linear from muon_momentum_start over the warmup: 0.95 from the start
    averages the large, fast-changing first gradients too long (modded-nanogpt, nanochat)."""
    if step >= cfg.muon_momentum_warmup_steps:
        return cfg.muon_momentum
    frac = step / cfg.muon_momentum_warmup_steps
    return cfg.muon_momentum_start + frac * (cfg.muon_momentum - cfg.muon_momentum_start)


def apply_schedule(optimizer, step: int, max_steps: int, cfg: OptimConfig, d_model: int) -> float:
    """Set every group's lr (its own peak, `peak_lrs` at the model's width, x the schedule) and
    Muon's momentum for `step`; returns the matrices' lr (the logged one). The peaks come from
    the config, never from a loaded optimizer state: a resumed run follows the config it was
    resumed with."""
    multiplier = lr_multiplier(step, max_steps, cfg)
    peaks = peak_lrs(cfg, d_model)
    for group in optimizer.param_groups:
        group["lr"] = peaks[group["kind"]] * multiplier
        if "momentum" in group:  # Muon's (AdamW's momentum is its betas)
            group["momentum"] = muon_momentum_at(step, cfg)
    return peaks["matrix"] * multiplier
