"""AdamW with weight decay on matrices only, and the learning-rate schedules.

The schedule is a pure function of the step, so it needs no state of its own in a checkpoint:
resuming at step s gives exactly the learning rate an uninterrupted run had at step s.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pipeline.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    # Decay only matrices (linear weights, embeddings); norms' gains are 1-D and decaying them
    # towards zero only fights the normalisation.
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = device.type == "cuda" if cfg.fused == "auto" else cfg.fused == "on"
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None
    )


def lr_at(step: int, max_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine or WSD.

    cosine: decays from lr to lr*min_lr_ratio over the steps after warmup.
    wsd (warmup-stable-decay): holds lr, then decays linearly to the floor over the last
    `decay_fraction` of the run — a run can be extended from a stable-phase checkpoint.
    """
    floor = cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * max_steps))
        decay_start = max_steps - decay_steps
        if step < decay_start:
            return cfg.lr
        frac = min(1.0, (step - decay_start + 1) / decay_steps)
        return cfg.lr + frac * (floor - cfg.lr)
    span = max(1, max_steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return floor + 0.5 * (1.0 + math.cos(math.pi * frac)) * (cfg.lr - floor)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
