"""Size a run to a wall-clock budget (`train.time_budget_s`): how `lmforge demo` fits any machine.

The trainer times its first config.CALIBRATION_STEPS steps, each on its own (never the set-up
before it, nor the hooks after it; a process's first step is excluded where another follows it
in time: it pays for allocation, warm-up and compilation), measures what one eval batch and one
round of samples cost (on several ranks: the slowest rank's), and then fixes, once, the largest
number of steps (at most train.max_steps) whose steps, periodic evals, samples and checkpoints
and the final export fit the budget. The eval/sample/checkpoint/log
intervals shrink in proportion, so a shortened run still evaluates as often as its preset.

This happens inside the LR warmup, where the schedule does not depend on max_steps yet: the run is
exactly the run its resolved config describes. That config (config.toml, and every checkpoint's)
records the chosen max_steps and intervals with the budget turned off, so `--resume auto` of an
interrupted budgeted run continues to the same step count instead of measuring again.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from pipeline.config import CALIBRATION_STEPS, JobConfig

SAFETY = 0.9
"""Fraction of the remaining time planned for: step times drift (thermal, a shared machine)."""
DISK_BYTES_PER_S = 200e6
"""Assumed checkpoint write rate (a conservative local disk) for the checkpoint estimate."""
PLOT_S = 3.0
"""The loss plot at the end (matplotlib's import dominates)."""


def now() -> float:
    """The budget's clock (tests replace it)."""
    return time.perf_counter()


@dataclass(frozen=True)
class HookCosts:
    """Seconds per call of each end-of-step hook, measured or estimated at calibration."""

    eval_s: float
    sample_s: float
    checkpoint_s: float
    final_s: float  # once: the consolidated export and the loss plot

    @classmethod
    def estimate(cls, eval_s: float, sample_s: float, n_params: int) -> HookCosts:
        """Measured eval and sample costs; checkpoint and export costs from their size (fp32
        weights and AdamW's two moments; the export holds the weights only)."""
        weights_s = 4 * n_params / DISK_BYTES_PER_S
        return cls(eval_s, sample_s, checkpoint_s=3 * weights_s, final_s=weights_s + PLOT_S)


@dataclass(frozen=True)
class BudgetPlan:
    max_steps: int
    eval_every: int
    sample_every: int
    checkpoint_every: int
    log_every: int
    estimated_s: float  # the whole run, from the trainer's start, as planned
    fits: bool  # False: even the shortest allowed run (warmup + 1 step) overruns the budget


def apply(cfg: JobConfig, p: BudgetPlan) -> None:
    """Fix the run's length in `cfg`, in place (the training loop holds this object); the
    budget is turned off, so the resolved config reproduces the run."""
    cfg.train.max_steps, cfg.train.time_budget_s = p.max_steps, 0.0
    cfg.eval.every, cfg.sample.every = p.eval_every, p.sample_every
    cfg.checkpoint.every, cfg.log.log_every = p.checkpoint_every, p.log_every


def plan_of(cfg: JobConfig) -> BudgetPlan:
    """The length a config (a checkpoint's, already fixed) describes."""
    return BudgetPlan(cfg.train.max_steps, cfg.eval.every, cfg.sample.every, cfg.checkpoint.every,
                      cfg.log.log_every, estimated_s=math.nan, fits=True)


def scale_every(every: int, steps: int, max_steps: int) -> int:
    """An interval shrunk with the run (0 stays 'only at the end')."""
    return every if every == 0 else max(1, round(every * steps / max_steps))


def count_due(done: int, end: int, every: int) -> int:
    """Steps in (done, end] on which a hook with this interval runs (the last step always)."""
    if every == 0:
        return 1
    return end // every - done // every + (end % every != 0)


def plan(cfg: JobConfig, elapsed_s: float, done: int, step_s: float, costs: HookCosts,
         budget_s: float) -> BudgetPlan:
    """The longest run (done < steps <= train.max_steps, above the warmup) that fits `budget_s`,
    `elapsed_s` having passed and `done` steps being finished, at `step_s` per step."""
    cap, floor = cfg.train.max_steps, cfg.optim.warmup_steps + 1

    def candidate(steps: int) -> BudgetPlan:
        ev, sa, ck, lg = (scale_every(every, steps, cap) for every in (
            cfg.eval.every, cfg.sample.every, cfg.checkpoint.every, cfg.log.log_every))
        hooks = (count_due(done, steps, ev) * costs.eval_s
                 + count_due(done, steps, sa) * costs.sample_s
                 + count_due(done, steps, ck) * costs.checkpoint_s + costs.final_s)
        total = elapsed_s + ((steps - done) * step_s + hooks) / SAFETY
        return BudgetPlan(steps, ev, sa, ck, lg, total, total <= budget_s)

    # Intervals are rescaled per candidate, so the cost is not exactly monotonic: scan from the top.
    for steps in range(cap, floor - 1, -1):
        if (p := candidate(steps)).fits:
            return p
    return candidate(floor)


class TimeBudget:
    """The time since the trainer started and the durations of the steps this process ran."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.start = now()
        self.durations: list[float] = []

    def step_done(self, seconds: float) -> None:
        """One step's own duration, timed around the step alone."""
        self.durations.append(seconds)

    def ready(self, step: int, warmup_steps: int) -> bool:
        """Whether to plan after `step`: once CALIBRATION_STEPS are done and this process has
        timed a step after its first (a resumed run may have run one only), and at the latest
        at the warmup's last step, the last one whose lr does not depend on max_steps."""
        return step >= CALIBRATION_STEPS and (len(self.durations) > 1 or step >= warmup_steps)

    def elapsed(self) -> float:
        return now() - self.start

    def step_seconds(self) -> float:
        """Median duration of this process's steps after its first, or of its first alone when
        it is the only one."""
        durations = sorted(self.durations[1:] or self.durations)
        return durations[len(durations) // 2]
