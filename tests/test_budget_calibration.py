"""train.time_budget_s plans from what steps and hooks really cost: each step timed on its own
(a resume before the calibration does not count the model build and checkpoint load as a step),
and under several ranks each hook at its slowest rank's cost. This file is also the torchrun
worker of the last test (`python -m tests.test_budget_calibration OUT_DIR`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.runs import run
from lmforge.pipeline import budget
from lmforge.pipeline.checkpoint import format as ckpt
from lmforge.pipeline.train import Trainer
from tests.test_time_budget import CPU, cfg_for


class FakeClock:
    """budget.now(): one second per call, plus whatever `advance` adds (a slow set-up)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def record_plans(monkeypatch) -> list[dict]:
    plans, real_plan = [], budget.plan

    def recording_plan(cfg, elapsed_s, done, step_s, costs, budget_s):
        plans.append({"elapsed_s": elapsed_s, "done": done, "step_s": step_s,
                      "eval_s": costs.eval_s, "sample_s": costs.sample_s})
        return real_plan(cfg, elapsed_s, done, step_s, costs, budget_s)

    monkeypatch.setattr(budget, "plan", recording_plan)
    return plans


def test_a_resume_before_the_calibration_times_only_steps(tiny_data, tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(budget, "now", clock)
    run_dir = tmp_path / "run"
    Trainer(cfg_for(tiny_data, run_dir, "--train.time_budget_s", "30"), CPU).fit()
    step_4 = run_dir / "checkpoints" / ckpt.step_dir_name(4)  # written before the plan (step 5)
    assert ckpt.read_meta(step_4).config.train.time_budget_s == 30

    real_load = ckpt.load_training

    def slow_load(*args, **kwargs):  # building and loading take 100 s (of the fake clock)
        clock.advance(100.0)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(ckpt, "load_training", slow_load)
    plans = record_plans(monkeypatch)
    resumed = Trainer(cfg_for(tiny_data, run_dir, "--train.time_budget_s", "300",
                              "--checkpoint.resume", str(step_4)), CPU)
    resumed.fit()
    # Step 5 is this process's first; step 6 (the warmup's last, optim.warmup_steps = 6) is
    # timed too, and the plan uses its 1 s, not the 100 s set-up before step 5.
    (p,) = plans
    assert p["done"] == 6 and p["step_s"] == 1.0 and p["elapsed_s"] > 100
    assert resumed.cfg.train.max_steps == 40  # 300 s leave room for all 40 steps at 1 s


def worker(out_dir: Path) -> int:
    """One rank: five 1 s steps, then hook costs that differ by rank; writes the plan's inputs."""
    from lmforge.pipeline.budget import RunLength
    from lmforge.pipeline.config import CALIBRATION_STEPS, load_config
    from lmforge.pipeline.parallel.distributed import distributed

    cfg = load_config(None, ["--log.out_dir", str(out_dir), "--optim.warmup_steps", "6",
                             "--train.max_steps", "40", "--train.time_budget_s", "100"])
    with pytest.MonkeyPatch.context() as mp, distributed("cpu") as info:
        plans = record_plans(mp)
        length = RunLength(cfg, info, out_dir)
        # Rank 0 alone writes samples; rank 1's eval is the slower one.
        costs = budget.HookCosts(eval_s=1.0 + 2.0 * info.rank, sample_s=2.0 * (info.rank == 0),
                                 checkpoint_s=0.0, final_s=0.0)
        for step in range(1, CALIBRATION_STEPS + 1):
            length.step_done(step, 0.5 + 0.5 * info.rank, lambda: costs)
        (out_dir / f"rank{info.rank}.json").write_text(json.dumps(plans))
    return 0


@pytest.mark.dist
def test_each_measurement_is_the_slowest_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tests.test_budget_calibration", str(tmp_path)]
    res = run(cmd, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:]
    for rank in (0, 1):
        (p,) = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (p["step_s"], p["eval_s"], p["sample_s"]) == (1.0, 3.0, 2.0), (rank, p)


if __name__ == "__main__":
    sys.exit(worker(Path(sys.argv[1])))
