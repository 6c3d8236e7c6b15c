"""A resume is never blocked by a torn metrics.jsonl tail, and it moves no checkpoint aside
before it has passed every check (a resume that fails leaves the run as it found it)."""

from __future__ import annotations

import sys

import pytest
import torch

from lmforge.pipeline import train as train_module
from lmforge.pipeline.checkpoint import format as ckpt
from lmforge.pipeline.config import load_config
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.train import Trainer
from tests.harness import losses, run, run_args, train

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def args_for(data, out, *extra):
    return run_args(data, out, "--train.max_steps", "4", "--checkpoint.every", "2", "--checkpoint.keep", "5", *extra)


def test_a_torn_last_metrics_line_is_dropped_and_logged(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    train(args_for(tiny_data, run_dir))
    # A crash mid-write: half a record, cut inside a multi-byte character, no newline.
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write('{"step": 5, "loss": 3.1, "samples": ["caf\u00e9'.encode()[:-1])
    res = run([sys.executable, "-m", "lmforge.launch.cli", "train",
               *args_for(tiny_data, run_dir, "--train.max_steps", "6", "--resume", "auto")])
    assert res.returncode == 0, res.stdout[-3000:]
    assert "dropped 1 torn line(s) (line " in res.stdout
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 5, 6]  # every other line parses


def test_a_failed_resume_moves_no_checkpoint(tiny_data, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    train(args_for(tiny_data, run_dir))
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    rollback = run_dir / "checkpoints" / ckpt.step_dir_name(2)

    def fails(*_):
        raise OSError("disk full")

    # Any failure after the checkpoint loaded (here: rewriting metrics.jsonl) ends the resume...
    monkeypatch.setattr(train_module, "trim_metrics", fails)
    with pytest.raises(OSError, match="disk full"):
        Trainer(load_config(None, args_for(tiny_data, run_dir, "--checkpoint.resume", str(rollback))), CPU)
    # ...with the newer checkpoint and final/ where they were.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert (run_dir / "final" / "meta.json").is_file()
    monkeypatch.undo()
    trainer = Trainer(load_config(None, args_for(tiny_data, run_dir, "--checkpoint.resume", str(rollback))), CPU)
    assert trainer.step == 2 and [c.name for c in ckpt.list_complete(run_dir / "checkpoints")] == [
        ckpt.step_dir_name(2)]


def test_a_kill_between_the_last_checkpoint_and_its_record_loses_no_record(tiny_data, tmp_path,
                                                                           monkeypatch):
    """The last step's checkpoint is written before its metrics record (weights first); a kill
    in between left metrics.jsonl one step short for good. The checkpoint carries the record."""
    reference = tmp_path / "reference"
    Trainer(load_config(None, args_for(tiny_data, reference)), CPU).fit()
    run_dir = tmp_path / "run"
    killed = Trainer(load_config(None, args_for(tiny_data, run_dir)), CPU)

    def dies(*_):  # the process ends right after the step-4 checkpoint is complete
        raise SystemExit(137)

    monkeypatch.setattr(killed, "export_final", dies)
    with pytest.raises(SystemExit):
        killed.fit()
    killed.metrics.close()
    assert sorted(losses(run_dir)) == [1, 2, 3]
    assert ckpt.read_meta(run_dir / "checkpoints" / ckpt.step_dir_name(4)).record["loss"] > 0
    monkeypatch.undo()
    Trainer(load_config(None, args_for(tiny_data, run_dir, "--checkpoint.resume", "auto")), CPU).fit()
    assert losses(run_dir) == losses(reference)
