"""Size a run to a wall-clock budget (`train.time_budget_s`): how `lmforge demo` fits any machine.

The trainer times its first CALIBRATION_STEPS steps, each on its own (a process's first is
dropped where another follows: it pays for warm-up and compilation), and what one eval batch and
one round of samples cost (the slowest rank's), then fixes once the most steps (at most
train.max_steps) whose steps, evals, samples, checkpoints and export fit; the hooks' intervals
shrink in proportion. This happens inside the LR warmup, where the schedule does not depend on
max_steps yet, and the resolved config records the length with the budget off: the run is the one
it describes, and `--resume auto` continues to the same step count instead of measuring again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lmforge.pipeline.checkpoint.run_dir import RunDir
from lmforge.pipeline.config import CALIBRATION_STEPS, JobConfig, save_resolved
from lmforge.pipeline.data.config import DataConfig, phase_start
from lmforge.pipeline.metrics import get_logger
from lmforge.pipeline.parallel.distributed import DistInfo, all_reduce_max

log = get_logger()

SAFETY = 0.9  # of the remaining time planned for: step times drift (thermal, a shared machine)
DISK_BYTES_PER_S = 200e6  # a conservative local disk, for the checkpoint and export estimates
PLOT_S = 3.0  # the loss plot at the end (matplotlib's import dominates)


def now() -> float:  # the budget's clock, which tests replace
    return time.perf_counter()


@dataclass(frozen=True)
class HookCosts:
    """Seconds per call of each end-of-step hook, measured or estimated at calibration."""

    eval_s: float
    sample_s: float
    checkpoint_s: float
    final_s: float  # once: the consolidated export and the loss plot
    tasks_s: float = 0.0  # the downstream evals (eval.tasks)

    @classmethod
    def estimate(cls, eval_s: float, sample_s: float, n_params: int,
                 tasks_s: float = 0.0) -> HookCosts:
        """Measured eval, sample and downstream costs; checkpoint and export costs from their
        size (fp32 weights and AdamW's two moments; the export holds the weights only)."""
        weights_s = 4 * n_params / DISK_BYTES_PER_S
        return cls(eval_s, sample_s, checkpoint_s=3 * weights_s, final_s=weights_s + PLOT_S,
                   tasks_s=tasks_s)


@dataclass(frozen=True)
class BudgetPlan:
    max_steps: int
    eval_every: int
    sample_every: int
    checkpoint_every: int
    log_every: int
    estimated_s: float  # the whole run, from the trainer's start, as planned
    fits: bool  # False: even the shortest allowed run (warmup + 1 step) overruns the budget
    tasks_every: int = 0


def apply(cfg: JobConfig, p: BudgetPlan) -> JobConfig:
    """`cfg` with the run's length fixed by `p` and the budget off: the resolved config then
    reproduces the run."""
    return replace(
        cfg, train=replace(cfg.train, max_steps=p.max_steps, time_budget_s=0.0),
        eval=replace(cfg.eval, every=p.eval_every, tasks_every=p.tasks_every), sample=replace(cfg.sample, every=p.sample_every),
        checkpoint=replace(cfg.checkpoint, every=p.checkpoint_every),
        log=replace(cfg.log, log_every=p.log_every))


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
        # Intervals shrink with the run; 0 stays "only at the end".
        ev, sa, ck, lg, ta = (every and max(1, round(every * steps / cap)) for every in (
            cfg.eval.every, cfg.sample.every, cfg.checkpoint.every, cfg.log.log_every,
            cfg.eval.tasks_every))
        hooks = (count_due(done, steps, ev) * costs.eval_s
                 + count_due(done, steps, sa) * costs.sample_s
                 + count_due(done, steps, ta) * costs.tasks_s
                 + count_due(done, steps, ck) * costs.checkpoint_s + costs.final_s)
        total = elapsed_s + ((steps - done) * step_s + hooks) / SAFETY
        return BudgetPlan(steps, ev, sa, ck, lg, total, total <= budget_s, ta)

    # A length that would move a phase given as a fraction into the steps already run is no
    # candidate: those steps drew their rows by the phases of `cap`.
    lengths = [s for s in range(cap, floor - 1, -1) if keeps_phases(cfg.data, cap, done, s)]
    # Intervals are rescaled per candidate, so the cost is not exactly monotonic: scan from the top.
    for steps in lengths:
        if (p := candidate(steps)).fits:
            return p
    return candidate(lengths[-1] if lengths else floor)


def keeps_phases(d: DataConfig, cap: int, done: int, steps: int) -> bool:
    """Whether max_steps = `steps` instead of `cap` keeps the data phases of the `done` steps
    already run -- each phase starts where it did or, as it did, after them -- and their order."""
    before = [phase_start(p.from_step, cap) for p in d.phases]
    after = [phase_start(p.from_step, steps) for p in d.phases]
    ordered = all(a < b for a, b in zip([0, *after], after, strict=False))
    return ordered and all(a == b or min(a, b) >= done for a, b in zip(before, after, strict=True))


class RunLength:
    """train.time_budget_s: times this process's steps, each on its own, then fixes the run's
    length once; `cfg` is then the config with that length (the trainer rebinds to it). Idle
    without a budget and after."""

    def __init__(self, cfg: JobConfig, info: DistInfo, run_dir: Path):
        self.cfg, self.info, self.run_dir = cfg, info, run_dir
        self.budget_s = cfg.train.time_budget_s  # 0: no budget, or the length is fixed
        self.start, self.durations = now(), []

    def keep_fixed(self, saved: JobConfig) -> None:
        """Resuming a run whose length is already fixed: keep it (measuring again would change
        its lr schedule). A checkpoint from before the measurement measures again."""
        if not self.budget_s or saved.train.time_budget_s:
            return
        self.cfg = apply(self.cfg, BudgetPlan(
            saved.train.max_steps, saved.eval.every, saved.sample.every, saved.checkpoint.every,
            saved.log.log_every, estimated_s=math.nan, fits=True,
            tasks_every=saved.eval.tasks_every))
        self.budget_s = 0.0
        log.info("time budget: this run's length was fixed when it started: %d steps (not "
                 "measured again)", self.cfg.train.max_steps)

    def step_done(self, step: int, step_s: float,
                  hook_costs: Callable[[], HookCosts]) -> BudgetPlan | None:
        """After each step (`step_s`: its own duration): once CALIBRATION_STEPS are done and a
        step after this process's first is timed (a resume may run one only), at the latest at
        the warmup's last step (the last whose lr ignores max_steps), fixes the length."""
        if not self.budget_s:
            return None
        self.durations.append(step_s)
        if step < CALIBRATION_STEPS or (len(self.durations) < 2
                                        and step < self.cfg.optim.warmup_steps):
            return None
        costs = hook_costs()
        timed = sorted(self.durations[1:] or self.durations)  # the first pays for warm-up
        # Every rank must choose the same length, and every hook lasts as long as its slowest
        # rank (rank 0 alone writes the samples): plan from the ranks' largest measurements.
        measured = torch.tensor([timed[len(timed) // 2], costs.eval_s, costs.sample_s,
                                 costs.tasks_s, now() - self.start], dtype=torch.float64,
                                device=self.info.device)
        step_s, eval_s, sample_s, tasks_s, elapsed = all_reduce_max(measured, self.info).tolist()
        costs = replace(costs, eval_s=eval_s, sample_s=sample_s, tasks_s=tasks_s)
        cap, budget_s = self.cfg.train.max_steps, self.budget_s
        p = plan(self.cfg, elapsed, step, step_s, costs, budget_s)
        self.cfg, self.budget_s = apply(self.cfg, p), 0.0
        if self.info.is_main:
            save_resolved(self.cfg, self.run_dir)
        self._report(p, costs, step_s, step, cap, budget_s)
        return p

    def _report(self, p: BudgetPlan, costs: HookCosts, step_s: float, step: int,
                cap: int, budget_s: float) -> None:
        tok_s = self.cfg.train.global_batch_tokens / step_s
        log.info("time budget %g s: %.2f s/step (%s tokens/s, steps timed to step %d), eval %.1f s, "
                 "samples %.1f s, downstream %.1f s, checkpoint ~%.1f s -> max_steps %d (at most %d), ~%.0f s in all; "
                 "eval every %d, samples every %d, checkpoints every %d (in %s)",
                 budget_s, step_s, f"{tok_s:,.0f}", step, costs.eval_s, costs.sample_s,
                 costs.tasks_s, costs.checkpoint_s, p.max_steps, cap, p.estimated_s, p.eval_every,
                 p.sample_every, p.checkpoint_every, RunDir(self.run_dir).config)
        if phases := self.cfg.data.phases:
            first = [phase_start(ph.from_step, p.max_steps) + 1 for ph in phases]
            log.info("time budget: data phases 1..%d (from_step %s) start at steps %s of %d "
                     "(the %d steps already run keep their phase)", len(phases),
                     ", ".join(f"{ph.from_step:g}" for ph in phases),
                     ", ".join(map(str, first)), p.max_steps, step)
        if not p.fits:
            log.warning("time budget %g s: even %d steps (warmup + 1, data phases after the "
                        "steps run) need ~%.0f s; raise train.time_budget_s or lower "
                        "optim.warmup_steps", budget_s, p.max_steps, p.estimated_s)
