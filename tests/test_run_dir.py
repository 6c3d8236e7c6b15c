"""The run directory's paths (pipeline/checkpoint/run_dir.py): what each must be before a run
writes there. Most cases live in tests/test_run_dir_trust.py; this file holds wandb's."""

from __future__ import annotations

import pytest

from lmforge.pipeline.checkpoint.run_dir import RunDir
from tests import test_run_dir_trust as trust
from tests.errors import last_error_line as refused
from tests.test_run_dir_trust import files_of, resume

trained, run = trust.trained, trust.copied_run  # its fixtures: a finished 2-step run, a copy of it


@pytest.mark.parametrize("kind", ["link", "file"])
def test_a_wandb_entry_that_is_no_directory_is_refused_before_wandb_writes(kind, run, tiny_data,
                                                                           tmp_path, capsys,
                                                                           monkeypatch):
    """wandb writes RUN/wandb/... itself, through a `wandb` link in a copied run
    directory (its config, console log and .wandb file outside). Refused with one line, like
    every run file, before wandb starts; the link's target keeps its bytes."""
    monkeypatch.setenv("WANDB_MODE", "offline")  # wandb offline writes without network
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text("precious\n")
    if kind == "link":
        RunDir(run).wandb.symlink_to(outside, target_is_directory=True)
    else:
        RunDir(run).wandb.write_text("not a directory\n")
    before = files_of(run)
    rc, err = resume(capsys, tiny_data, run, "--log.wandb", "offline")
    refused(rc, err, "wandb directory", "symbolic link" if kind == "link" else "regular file")
    assert files_of(outside) == {"sentinel": b"precious\n"} and files_of(run) == before
    RunDir(run).wandb.unlink()
    RunDir(run).wandb.mkdir()  # a directory of its own is where wandb writes
    rc, err = resume(capsys, tiny_data, run, "--log.wandb", "offline")
    assert rc == 0, err[-3000:]
    assert files_of(outside) == {"sentinel": b"precious\n"}
    assert any(p.suffix == ".wandb" for p in RunDir(run).wandb.rglob("*"))
