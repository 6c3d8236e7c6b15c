"""`lmforge demo --minutes M`: the run's length is fixed before it starts, from a probe run that
times this machine; the trainer is given `--train.max_steps` and nothing changes it mid-run."""

from __future__ import annotations

from lmforge.launch import demo
from lmforge.pipeline.config import load_config

# The quick demo's model (launch/demo.py QUICK): the probe's steps take a second or so.
SMALL = demo.QUICK["train"]


def test_the_probe_sizes_the_run_between_the_warmup_and_the_preset(tiny_data, capsys):
    preset = load_config(str(demo.CONFIG))
    assert demo.fit_steps(tiny_data, 1, SMALL, budget_s=1e6) == preset.train.max_steps
    assert demo.fit_steps(tiny_data, 1, SMALL, budget_s=1.0) == preset.optim.warmup_steps + 1
    out = capsys.readouterr().out
    assert out.count("probe: ") == 2 and "s/step" in out and "a round of eval" in out


def test_each_step_with_a_hook_counts_once():
    cfg = load_config(str(demo.CONFIG))  # eval and tasks every 50, samples and checkpoints 100
    assert demo.hook_steps(cfg, 200) == 4
    assert demo.hook_steps(cfg, 120) == 3  # 50, 100 and the last
    assert demo.hook_steps(cfg, 21) == 1
