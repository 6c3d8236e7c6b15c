"""A disk that fills during a checkpoint: one `error:` line naming the free space, the space a
checkpoint needs and the last complete checkpoint, exit 2, and no `.tmp` left behind, whether the
write is synchronous or in the background. On a real full filesystem: a small tmpfs (root only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.runs import ROOT, TINY_ARGS, env
from tests.errors import last_error


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs: one tiny checkpoint (1.8 MB) fits, a second does not."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("background", ["false", "true"])
def test_a_full_disk_during_a_checkpoint_is_one_line(small_disk, tiny_data, background):
    run = small_disk / "run"
    args = ["--data.path", str(tiny_data), "--log.out_dir", str(run), *TINY_ARGS,
            "--train.max_steps", "3", "--checkpoint.every", "1", "--checkpoint.keep", "5",
            "--eval.every", "0", "--checkpoint.async_save", background]
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "train", *args], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=300)
    last_error(proc, f"no space left on device writing {run}/checkpoints/step_00000002 (free ",
               "MB, a checkpoint needs ~", "the last complete checkpoint is step_00000001")
    assert sorted(p.name for p in Path(run, "checkpoints").iterdir()) == ["step_00000001"]
