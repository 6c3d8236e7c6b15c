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

from pipeline.config import OptimConfig, own_lr_groups, table_lrs, wsd_decay_steps
from pipeline.optim.muon import Muon


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device,
                    ns_dtype: torch.dtype = torch.float32):
    """AdamW, or (optim.name = "muon") Muon + AdamW as one `Optimizers`. ns_dtype: Muon's
    Newton–Schulz precision (the trainer passes its compute dtype)."""
    if cfg.name == "adamw":
        return _keeping_memory(_adamw(model.named_parameters(), cfg, device), model, device)
    matrices = [p for name, p in model.named_parameters() if is_muon_matrix(name, p)]
    chosen = {id(p) for p in matrices}
    others = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in chosen]
    muon = Muon(
        [{"params": matrices, "kind": "muon"}], lr=cfg.muon_lr, momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov, weight_decay=cfg.muon_weight_decay, ns_dtype=ns_dtype,
    )
    return _keeping_memory(Optimizers(_adamw(others, cfg, device), muon), model, device)


def _keeping_memory(optimizer, model: nn.Module, device: torch.device):
    """On CPU, a whole replica's steps reuse their freed buffers from the first step's end on
    (pipeline.cpu.allocator); FSDP2's shards give theirs back (pipeline.parallel.parallelize)."""
    if torch.device(device).type == "cpu" and not isinstance(model, FSDPModule):
        from pipeline.cpu.allocator import keep_freed_blocks_after_first_step  # the CPU room

        last = optimizer.optimizers[-1] if isinstance(optimizer, Optimizers) else optimizer
        keep_freed_blocks_after_first_step(last)
    return optimizer


def is_muon_matrix(name: str, param: nn.Parameter) -> bool:
    """Whether optim.name = "muon" gives `param` to Muon: the transformer blocks' 2-D matrices."""
    return param.requires_grad and ".blocks." in f".{name}" and param.ndim == 2


def role(name: str) -> str:
    """The lr group of a parameter outside Muon: "embed" (the token and value embedding tables),
    "head" (an untied LM head; a tied one is the token table) or "" (optim.lr)."""
    parts = name.split(".")
    return "embed" if "tok_emb" in parts or "value_embeds" in parts else "head" if "lm_head" in parts else ""


def peak_lr(kind: str, cfg: OptimConfig) -> float:
    """A group's peak lr: optim.muon_lr, optim.embed_lr / head_lr where set, else optim.lr."""
    return {"muon": cfg.muon_lr, **table_lrs(cfg)}.get(kind) or cfg.lr


def _adamw(named_params, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    # Decay only matrices (linear weights, embeddings); norms' gains are 1-D and decaying them
    # towards zero only fights the normalisation. A table or head gets a group of its own only
    # where its lr is set, so that runs without it keep their checkpoints' group layout.
    own = own_lr_groups(cfg)
    decay, no_decay, by_role = [], [], {kind: [] for kind in own}
    for name, p in named_params:
        if p.requires_grad:
            kind = role(name)
            (by_role[kind] if kind in own else decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
        *({"params": ps, "weight_decay": cfg.weight_decay, "kind": kind} for kind, ps in by_role.items()),
    ]
    groups = [g for g in groups if g["params"]]  # DCP refuses empty groups beside another optimizer
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


def lr_at(step: int, max_steps: int, cfg: OptimConfig) -> float:
    """AdamW's learning rate (optim.lr times the schedule) at `step`: the logged lr."""
    return cfg.lr * lr_multiplier(step, max_steps, cfg)


def muon_momentum_at(step: int, cfg: OptimConfig) -> float:
    """Muon's momentum, linear from muon_momentum_start over the warmup: 0.95 from the start
    averages the large, fast-changing first gradients too long (modded-nanogpt, nanochat)."""
    if step >= cfg.muon_momentum_warmup_steps:
        return cfg.muon_momentum
    frac = step / cfg.muon_momentum_warmup_steps
    return cfg.muon_momentum_start + frac * (cfg.muon_momentum - cfg.muon_momentum_start)


def apply_schedule(optimizer, step: int, max_steps: int, cfg: OptimConfig) -> float:
    """Set every group's lr (its own peak, `peak_lr`, x the schedule) and Muon's momentum for
    `step`; returns AdamW's lr. The peaks come from the config, never from a loaded optimizer
    state, so a resumed run follows the config it was resumed with."""
    multiplier = lr_multiplier(step, max_steps, cfg)
    for group in optimizer.param_groups:
        group["lr"] = peak_lr(group.get("kind", ""), cfg) * multiplier
        if group.get("kind") == "muon":
            group["momentum"] = muon_momentum_at(step, cfg)
    return cfg.lr * multiplier
