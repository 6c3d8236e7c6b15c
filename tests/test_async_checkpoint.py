"""checkpoint.async_save: the write runs in the background (a test hook slows or fails it).
A SIGKILL while step 8's write is in flight leaves step 4 the newest complete checkpoint, and
--resume auto from it reproduces the uninterrupted run exactly (FSDP2, 2 gloo ranks); the last
step's checkpoint is complete when the process exits, though its write was slowed; a failed
write stops the run with one error line."""

from __future__ import annotations

import signal

import pytest

from lmforge.pipeline.checkpoint import format as ckpt
from tests.harness import (
    kill_group,
    losses,
    run,
    run_args,
    start,
    train,
    train_cmd,
    wait_for_step,
)

pytestmark = pytest.mark.dist

STEPS = 12
HOOK = "LMFORGE_TEST_CHECKPOINT_WRITE"


def args_for(data, out, *extra):
    # Evaluating every step slows a step to a few tenths of a second (the kill lands mid-run);
    # evaluation reads no training state, so the losses stay those of the reference.
    return run_args(data, out, "--train.max_steps", str(STEPS), "--checkpoint.every", "4",
                    "--checkpoint.keep", "10", "--checkpoint.async_save", "true", "--eval.every", "1", "--eval.tokens", "4096",
            "--train.parallel", "fsdp", *extra)


def test_sigkill_during_background_write_then_resume_is_exact(tiny_data, tmp_path, monkeypatch):
    reference = tmp_path / "reference"
    monkeypatch.setenv(HOOK, f"{STEPS}:3")  # the last save is slow: exit must still wait for it
    train(args_for(tiny_data, reference), nproc=2)
    assert [c.name for c in ckpt.list_complete(reference / "checkpoints")][-1] == "step_00000012"

    killed = tmp_path / "killed"
    monkeypatch.setenv(HOOK, "8:120")
    proc = start(train_cmd(args_for(tiny_data, killed), nproc=2))
    try:
        wait_for_step(proc, killed, 10)  # two steps past the save of step 8, still writing
        in_flight = (killed / "checkpoints" / "step_00000008.tmp").is_dir()
    finally:
        kill_group(proc, signal.SIGKILL)
        proc.communicate()
    assert in_flight
    complete = [c.name for c in ckpt.list_complete(killed / "checkpoints")]
    assert complete == ["step_00000004"], complete

    monkeypatch.delenv(HOOK)
    train(args_for(tiny_data, killed, "--resume", "auto"), nproc=2)
    resumed, uninterrupted = losses(killed), losses(reference)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    mismatched = [(s, resumed[s], uninterrupted[s]) for s in uninterrupted
                  if resumed[s] != uninterrupted[s]]
    assert not mismatched, mismatched


def test_failed_background_write_stops_the_run_with_one_error_line(tiny_data, tmp_path,
                                                                   monkeypatch):
    out = tmp_path / "fail"
    monkeypatch.setenv(HOOK, "4:fail")
    res = run(train_cmd(args_for(tiny_data, out, "--train.parallel", "none")), timeout=180)
    assert res.returncode == 2, res.stdout[-3000:]
    errors = [ln for ln in res.stdout.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "step_00000004" in errors[0], res.stdout[-3000:]
    assert res.stdout.strip().splitlines()[-1] == errors[0]
    assert max(losses(out)) < STEPS  # it stopped
    assert not ckpt.list_complete(out / "checkpoints")
    assert "no checkpoint of this run is complete" in errors[0], errors[0]
    assert not (out / "checkpoints" / "step_00000004.tmp").exists()  # removed, not left behind
