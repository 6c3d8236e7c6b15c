"""train.time_budget_s: the run's length chosen from measured step times (pipeline/budget.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from bench.runs import TINY_ARGS, losses, metrics, train
from lmforge.pipeline import budget
from lmforge.pipeline.config import ConfigError, load_config
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.train import Trainer
from tests.schedule import lr_at
from tests.test_mixture import small_source

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def cfg_for(data, out, *extra):
    return load_config(None, ["--data.path", str(data), "--log.out_dir", str(out), *TINY_ARGS,
                              "--optim.warmup_steps", "6", "--train.max_steps", "40",
                              "--checkpoint.every", "4", "--checkpoint.keep", "20", *extra])


def fake_clock(monkeypatch, seconds_per_call: float) -> None:
    """budget.now() advances by a fixed amount per call: every step, eval batch and sampling
    round then 'takes' exactly that long, whatever the machine."""
    ticks = itertools.count()
    monkeypatch.setattr(budget, "now", lambda: next(ticks) * seconds_per_call)


def test_plan_picks_the_longest_run_that_fits():
    cfg = load_config(None, ["--train.max_steps", "200", "--optim.warmup_steps", "20",
                             "--eval.every", "50", "--sample.every", "100",
                             "--checkpoint.every", "100", "--log.log_every", "10"])
    costs = budget.HookCosts(eval_s=2.0, sample_s=1.0, checkpoint_s=0.5, final_s=3.0)
    # By hand, 72 steps: 67 more steps at 1 s + 4 evals (every 18) + 2 samples and 2
    # checkpoints (every 36) + the end = 81 s, planned at 90 %: 10 + 81 / 0.9 = 100 s. 73 steps
    # add a step and a fifth eval / third sample / third checkpoint: 105 s.
    p = budget.plan(cfg, elapsed_s=10.0, done=5, step_s=1.0, costs=costs, budget_s=100.5)
    assert (p.max_steps, p.eval_every, p.sample_every, p.checkpoint_every, p.log_every) == (
        72, 18, 36, 36, 4)
    assert p.fits and p.estimated_s == pytest.approx(100.0)
    # A generous budget never raises the preset's length or changes its intervals.
    p = budget.plan(cfg, 10.0, 5, 1.0, costs, budget_s=1e6)
    assert (p.max_steps, p.eval_every, p.sample_every, p.checkpoint_every) == (200, 50, 100, 100)
    # Too small for the warmup: warmup + 1 steps, flagged as over budget.
    p = budget.plan(cfg, 10.0, 5, 1.0, costs, budget_s=20.0)
    assert p.max_steps == 21 and not p.fits and p.estimated_s > 20


def test_hook_counts_include_the_last_step():
    assert budget.count_due(0, 200, 50) == 4
    assert budget.count_due(0, 70, 50) == 2  # 50 and the last
    assert budget.count_due(5, 72, 18) == 4  # 18, 36, 54, 72
    assert budget.count_due(5, 40, 0) == 1  # only the end


def test_budget_chooses_max_steps_and_records_it(tiny_data, tmp_path, monkeypatch):
    fake_clock(monkeypatch, 1.0)
    run_dir = tmp_path / "run"
    cfg = cfg_for(tiny_data, run_dir, "--train.time_budget_s", "30")
    trainer = Trainer(cfg, CPU)
    trainer.fit()
    # Clock calls: start 0, step s from 2s - 1 to 2s (1 s/step), eval batch 11->12 (x2
    # batches), samples 13->14, elapsed read at 15.
    expected = budget.plan(
        cfg_for(tiny_data, run_dir), elapsed_s=15.0, done=5, step_s=1.0,
        costs=budget.HookCosts.estimate(2.0, 1.0, trainer.model.num_params()), budget_s=30.0)
    assert 6 < expected.max_steps < 40  # the budget really shortened the run
    saved = load_config(str(run_dir / "config.toml"))
    assert saved.train.max_steps == expected.max_steps and saved.train.time_budget_s == 0
    assert saved.checkpoint.every == expected.checkpoint_every
    recs = metrics(run_dir)
    assert max(r["step"] for r in recs) == expected.max_steps
    # The lr schedule is the one of the chosen length from step 1 on, warmup included.
    for r in recs:
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, expected.max_steps, saved.optim))
    assert ckpt_steps(run_dir)[-1] == expected.max_steps

    # The resolved config alone reproduces the run exactly: same length, schedule and losses.
    again = tmp_path / "again"
    Trainer(load_config(str(run_dir / "config.toml"), ["--log.out_dir", str(again)]), CPU).fit()
    assert losses(again) == losses(run_dir)


def ckpt_steps(run_dir):
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def test_resume_keeps_the_chosen_length(tiny_data, tmp_path, monkeypatch):
    fake_clock(monkeypatch, 1.0)
    run_dir = tmp_path / "run"
    Trainer(cfg_for(tiny_data, run_dir, "--train.time_budget_s", "30"), CPU).fit()
    first = losses(run_dir)
    chosen = max(first)
    middle = next(s for s in ckpt_steps(run_dir) if 5 < s < chosen)
    # Resumed on a machine 10x slower: measuring again would choose another length.
    fake_clock(monkeypatch, 10.0)
    resumed = Trainer(cfg_for(tiny_data, run_dir, "--train.time_budget_s", "30", "--checkpoint.resume",
                              str(run_dir / "checkpoints" / f"step_{middle:08d}")), CPU)
    assert resumed.step == middle and resumed.cfg.train.max_steps == chosen
    resumed.fit()
    assert losses(run_dir) == first
    assert load_config(str(run_dir / "config.toml")).train.max_steps == chosen


def test_bad_budget_settings_are_one_clear_error():
    with pytest.raises(ConfigError, match="optim.warmup_steps.*time_budget_s"):
        load_config(None, ["--train.time_budget_s", "60", "--optim.warmup_steps", "2"])
    with pytest.raises(ConfigError, match="train.time_budget_s"):
        load_config(None, ["--train.time_budget_s", "-1"])
    with pytest.raises(ConfigError, match="train.time_budget_s"):
        load_config(None, ["--train.time_budget_s", "inf"])
    assert math.isclose(load_config(None, ["--train.time_budget_s", "90"]).train.time_budget_s, 90)


def test_a_budget_keeps_a_fractional_phase_out_of_the_steps_already_run(tiny_data, tmp_path):
    """data.phases from_step = 0.5 follows the max_steps the budget chooses, but never back into
    the 5 calibration steps (drawn with max_steps 1000's phases): the budget picks a length that
    starts the phase after them, says so, and its config.toml replays the run row for row."""
    small = small_source(tiny_data, tmp_path / "small")
    run_dir, again = tmp_path / "run", tmp_path / "again"
    args = [*TINY_ARGS, "--data.mix", f"{tiny_data}:1", "--optim.warmup_steps", "6",
            "--data.phases", f'[{{from_step = 0.5, sources = [{{path = "{small}", weight = 1}}]}}]',
            "--eval.every", "0", "--sample.every", "0", "--checkpoint.every", "0"]
    # A budget nothing fits: the shortest allowed run, whatever the machine's speed.
    log = train([*args, "--log.out_dir", str(run_dir), "--train.max_steps", "1000",
                 "--train.time_budget_s", "0.001"]).stdout
    train(["--config", str(run_dir / "config.toml"), "--log.out_dir", str(again)])

    def drawn(run):
        return [(r["step"], r["tokens/pystdlib"], r["tokens/small"]) for r in metrics(run)
                if "tokens/small" in r]

    assert drawn(run_dir) == drawn(again) and losses(again) == losses(run_dir)
    saved = load_config(str(run_dir / "config.toml"))
    # warmup + 1 = 7 steps would start the phase after step round(3.5) = 4, inside steps 1-5.
    assert saved.train.max_steps == 10 and saved.train.time_budget_s == 0
    assert drawn(run_dir)[4][2] == 0 < drawn(run_dir)[5][2]
    assert "data phases 1..1 (from_step 0.5) start at steps 6 of 10" in log
    assert "step 6: data phase 1 starts" in log


def test_plan_counts_the_downstream_evals():
    """eval.tasks' rounds are a hook like the others: their cost shortens the run, and their
    interval shrinks with it."""
    cfg = load_config(None, ["--train.max_steps", "200", "--optim.warmup_steps", "20",
                             "--eval.every", "50", "--sample.every", "100",
                             "--checkpoint.every", "100", "--log.log_every", "10",
                             "--eval.tasks_every", "100"])
    free = budget.HookCosts(eval_s=2.0, sample_s=1.0, checkpoint_s=0.5, final_s=3.0)
    costly = budget.HookCosts(eval_s=2.0, sample_s=1.0, checkpoint_s=0.5, final_s=3.0,
                              tasks_s=5.0)
    p = budget.plan(cfg, elapsed_s=10.0, done=5, step_s=1.0, costs=free, budget_s=100.5)
    q = budget.plan(cfg, elapsed_s=10.0, done=5, step_s=1.0, costs=costly, budget_s=100.5)
    assert p.max_steps == 72 and q.max_steps < p.max_steps
    # q's rounds (every tasks_every, the last step included) fit in what q saved.
    rounds = budget.count_due(5, q.max_steps, q.tasks_every)
    assert q.tasks_every == round(100 * q.max_steps / 200) and rounds >= 1
    assert q.fits and q.estimated_s <= 100.5
    assert budget.apply(cfg, q).eval.tasks_every == q.tasks_every
