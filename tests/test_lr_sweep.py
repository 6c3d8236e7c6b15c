"""bench/lr_sweep.py: its committed ledger still gives the optima bench/results reports, and the
lr a run's command trains with is the one the ledger records for it."""

from __future__ import annotations

import argparse
import re

import pytest

from bench import lr_sweep


def sweep_args(**kw) -> argparse.Namespace:
    a = argparse.Namespace(optimizer="muon", untied=False, coords=["matrix", "embed+scalar"],
                           widths=[128, 256, 512], seeds=[2001, 2002], rule=0, batch=1,
                           steps=lr_sweep.STEPS, data="data/pystdlib",
                           ledger=lr_sweep.ROOT / "bench" / "results" / "lr_sweep_zen4_runs.jsonl")
    a.__dict__.update(kw)
    a.centre = lr_sweep.CENTRE[a.optimizer]
    return a


def test_the_ledger_gives_the_reported_optima():
    reported = (lr_sweep.ROOT / "bench" / "results" / "lr_sweep_zen4.txt").read_text()
    want = re.findall(r"^(\S+)\s+d(\d+): best lr (\S+),", reported, re.M)
    got = re.findall(r"^(\S+)\s+d(\d+): best lr (\S+),", "\n".join(lr_sweep.report(sweep_args())),
                     re.M)
    assert len(want) == 6 and got == want


@pytest.mark.parametrize("rule", [0, 256])
def test_a_runs_command_trains_with_the_lrs_the_ledger_records(tmp_path, rule):
    from lmforge.pipeline.config import load_config
    from lmforge.pipeline.optim.lrs import peak_lrs

    a = sweep_args(untied=True, coords=["head"], rule=rule)
    for width in (128, 512):
        cmd = lr_sweep.run_cmd(a, tmp_path / "run", width, 2001, "head", 1)
        cfg = load_config(lr_sweep.ROOT / "configs" / "tiny.toml", cmd[cmd.index("--config") + 2:])
        recorded = lr_sweep.model_lrs(a, width, lr_sweep.lrs_of(a.centre, "head", 1))
        assert peak_lrs(cfg.optim, width) == pytest.approx(recorded)
        assert cfg.train.max_steps == lr_sweep.STEPS and not cfg.model.tie_embeddings
