"""What the tests expect the logged lr to be at a step: optim.lr (the matrices' peak, no width
rule set) times the schedule's multiplier."""

from __future__ import annotations

from lmforge.pipeline.config import OptimConfig
from lmforge.pipeline.optim.optimizers import lr_multiplier


def lr_at(step: int, max_steps: int, cfg: OptimConfig) -> float:
    return cfg.lr * lr_multiplier(step, max_steps, cfg)
