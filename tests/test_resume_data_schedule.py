"""Mixture weights and run locks that a review found silently wrong (#42 items 4, 5, 7), each
through the CLI with real files: weights whose sum overflows, a resume with another mixture or
phase plan, and a lock file naming a pid no process can have."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.pipeline.checkpoint.run_dir import RunDir
from tests.errors import last_error
from tests.harness import ROOT, TINY_ARGS, env


def lmforge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.launch.cli", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def two_sources(tiny_data, tmp_path) -> tuple[Path, Path]:
    return tuple(Path(shutil.copytree(tiny_data, tmp_path / n)) for n in ("a", "b"))


# ---- 4. weights whose sum overflows -------------------------------------------------------------


def test_huge_weights_still_draw_from_every_source(two_sources):
    a, b = two_sources
    mix = f"{a}:1e308,{b}:1e308"
    proc = lmforge("inspect", str(a), "--rows", "64", "--mix", mix, "--seq-len", "64", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    drawn = [r["source"] for r in json.loads(proc.stdout)["rows"]]
    assert 16 < drawn.count("b") < 48, drawn  # half of 64, not none
    dry = lmforge("train", "--data.mix", mix, "--log.out_dir", str(a.parent / "run"), *TINY_ARGS,
                  "--dry-run")
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert dry.stdout.count("weight 0.5, ") == 2, dry.stdout[-2000:]


# ---- 5. a resume with another data schedule ------------------------------------------------------


def train(run: Path, data_args: list[str], steps: int, *extra: str) -> subprocess.CompletedProcess:
    return lmforge("train", *data_args, "--log.out_dir", str(run), *TINY_ARGS,
                   "--train.max_steps", str(steps), "--checkpoint.every", "2", "--eval.every",
                   "0", *extra)


@pytest.mark.parametrize("change", ["mix", "phases"])
def test_a_resume_with_another_data_schedule_is_refused(two_sources, tmp_path, change):
    a, b = two_sources
    first, second = (tmp_path / f"{n}.toml" for n in ("first", "second"))
    for path, late in ((first, 0.5), (second, 0.99 if change == "phases" else 0.5)):
        path.write_text(f'[[data.sources]]\npath = "{a}"\nweight = 0.5\n'
                        f'[[data.sources]]\npath = "{b}"\nweight = 0.5\n'
                        f'[[data.phases]]\nfrom_step = 0.5\n'
                        f'[[data.phases.sources]]\npath = "{a}"\nweight = {late}\n'
                        f'[[data.phases.sources]]\npath = "{b}"\nweight = {1 - late:.2f}\n')
    run = tmp_path / "run"
    assert train(run, ["--config", str(first)], 2).returncode == 0
    metrics = RunDir(run).metrics.read_bytes()
    if change == "mix":
        resumed = train(run, ["--data.mix", f"{a}:0.99,{b}:0.01"], 4, "--resume", "auto")
        needles = ("a 0.5, b 0.5", "a 0.99, b 0.01")
    else:
        resumed = train(run, ["--config", str(second)], 4, "--resume", "auto")
        needles = ("from 0.5: a 0.5, b 0.5", "from 0.5: a 0.99, b 0.01")
    last_error(resumed, "was trained on the data schedule", *needles)
    assert [p.name for p in RunDir(run).checkpoints.iterdir()] == ["step_00000002"]
    assert RunDir(run).metrics.read_bytes() == metrics  # nothing written
    same = train(run, ["--config", str(first)], 4, "--resume", "auto")  # the same plan resumes
    assert same.returncode == 0, same.stderr[-2000:]


# ---- 7. lock files naming impossible pids --------------------------------------------------------


def test_a_lock_file_naming_an_impossible_pid_neither_crashes_nor_blocks(tiny_data, tmp_path):
    """The lock is the file's flock, which no process holds here: its text is never parsed."""
    run = tmp_path / "run"
    run.mkdir()
    lock = RunDir(run).lock
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": 2**70, "start_ticks": None,
                                "since": "then"}))
    proc = lmforge("train", "--data.path", str(tiny_data), "--log.out_dir", str(run), *TINY_ARGS,
                   "--train.max_steps", "1")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not lock.exists()  # taken, then released at the end
