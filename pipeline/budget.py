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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pipeline.checkpoint.run_dir import RunDir
from pipeline.config import CALIBRATION_STEPS, JobConfig, save_resolved
from pipeline.metrics import get_logger
from pipeline.parallel.distributed import DistInfo, all_reduce_max

log = get_logger()

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


def apply(cfg: JobConfig, p: BudgetPlan) -> JobConfig:
    """`cfg` with the run's length fixed by `p` and the budget turned off, so the resolved config
    reproduces the run; the trainer rebinds to it once."""
    return replace(
        cfg, train=replace(cfg.train, max_steps=p.max_steps, time_budget_s=0.0),
        eval=replace(cfg.eval, every=p.eval_every), sample=replace(cfg.sample, every=p.sample_every),
        checkpoint=replace(cfg.checkpoint, every=p.checkpoint_every),
        log=replace(cfg.log, log_every=p.log_every))


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


class RunLength:
    """train.time_budget_s: times the first steps, then fixes the run's length once: `cfg` is
    then the config with that length (the trainer rebinds to it) and the run's config.toml says
    so. Idle without a budget and after."""

    def __init__(self, cfg: JobConfig, info: DistInfo, run_dir: Path):
        self.cfg, self.info, self.run_dir = cfg, info, run_dir
        self.clock = TimeBudget(cfg.train.time_budget_s) if cfg.train.time_budget_s else None

    def settle(self, cfg: JobConfig) -> None:
        """The config with what the trainer resolved since (train.attention): the one a fixed
        length is applied to."""
        self.cfg = cfg

    def keep_fixed(self, saved: JobConfig) -> None:
        """Resuming a run whose length is already fixed (budget measured, or none): keep that
        length. The budget sizes a run once; measuring again would change its lr schedule."""
        if self.clock is None or saved.train.time_budget_s:
            return  # no budget, or a checkpoint from before the measurement: it happens again
        self.cfg = apply(self.cfg, plan_of(saved))
        self.clock = None
        log.info("time budget: this run's length was fixed when it started: %d steps (not "
                 "measured again)", self.cfg.train.max_steps)

    def step_done(self, step: int, step_s: float,
                  hook_costs: Callable[[], HookCosts]) -> BudgetPlan | None:
        """After each step (`step_s`: its own duration); at the end of calibration, fixes the
        length and returns its plan."""
        tb = self.clock
        if tb is None:
            return None
        tb.step_done(step_s)
        if not tb.ready(step, self.cfg.optim.warmup_steps):
            return None
        costs = hook_costs()
        # Every rank must choose the same length, and every hook lasts as long as its slowest
        # rank (rank 0 alone writes the samples): plan from the ranks' largest measurements.
        measured = torch.tensor([tb.step_seconds(), costs.eval_s, costs.sample_s, tb.elapsed()],
                                dtype=torch.float64, device=self.info.device)
        step_s, eval_s, sample_s, elapsed = all_reduce_max(measured, self.info).tolist()
        costs = replace(costs, eval_s=eval_s, sample_s=sample_s)
        cap = self.cfg.train.max_steps
        p = plan(self.cfg, elapsed, step, step_s, costs, tb.budget_s)
        self.cfg = apply(self.cfg, p)
        self.clock = None
        if self.info.is_main:
            save_resolved(self.cfg, self.run_dir)
        self._report(p, costs, step_s, step, cap, tb.budget_s)
        return p

    def _report(self, p: BudgetPlan, costs: HookCosts, step_s: float, step: int,
                cap: int, budget_s: float) -> None:
        tok_s = self.cfg.train.global_batch_tokens / step_s
        log.info("time budget %g s: %.2f s/step (%s tokens/s, steps timed to step %d), eval %.1f s, "
                 "samples %.1f s, checkpoint ~%.1f s -> max_steps %d (at most %d), ~%.0f s in all; "
                 "eval every %d, samples every %d, checkpoints every %d (in %s)",
                 budget_s, step_s, f"{tok_s:,.0f}", step, costs.eval_s, costs.sample_s,
                 costs.checkpoint_s, p.max_steps, cap, p.estimated_s, p.eval_every,
                 p.sample_every, p.checkpoint_every, RunDir(self.run_dir).config)
        if not p.fits:
            log.warning("time budget %g s: even %d steps (warmup + 1) need ~%.0f s; raise "
                        "train.time_budget_s or lower optim.warmup_steps", budget_s,
                        p.max_steps, p.estimated_s)
