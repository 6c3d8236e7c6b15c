"""Fault injection: a 2-process run SIGKILLed at random moments, and a checkpoint write killed
mid-way, both continue with --resume auto to exactly the losses of an uninterrupted run."""

from __future__ import annotations

import random
import signal
import sys
import time

import pytest

from lmforge.pipeline.checkpoint import format as ckpt
from lmforge.pipeline.inference import load_for_inference
from tests.harness import (
    kill_group,
    losses,
    run_args,
    start,
    train,
    train_cmd,
    wait_for_step,
    wait_until,
)

pytestmark = pytest.mark.dist

STEPS = 12
KILLS = 3


def args_for(data, out, *extra):
    # Evaluating every step slows each step to a few tenths of a second, so a kill lands inside a
    # run; evaluation reads no training state, so the losses stay those of the reference.
    return run_args(data, out, "--train.max_steps", str(STEPS), "--checkpoint.every", "2",
                    "--checkpoint.keep", "2", "--eval.every", "1", "--eval.tokens", "8192", *extra)


def kill_at_random_moment(cmd, run_dir, rng: random.Random) -> bool:
    """Start `cmd`, let it pass the furthest step any attempt reached, SIGKILL it after a random
    delay. False if the run finished first."""
    reached = max(losses(run_dir), default=0)
    proc = start(cmd)
    try:
        wait_for_step(proc, run_dir, min(reached + 1, STEPS - 3))
        time.sleep(rng.uniform(0.0, 0.6))
    finally:
        kill_group(proc, signal.SIGKILL)
        proc.communicate()
    return not (run_dir / "final").exists()


def test_sigkill_at_random_moments_then_resume_equals_uninterrupted(tiny_data, tmp_path):
    seed = time.time_ns() % 2**32
    print(f"fault injection seed {seed} (rerun a failure with this seed)")
    rng = random.Random(seed)
    ddp = ["--train.parallel", "ddp"]
    train(args_for(tiny_data, tmp_path / "reference", *ddp), nproc=2)
    run_dir = tmp_path / "killed"
    cmd = train_cmd(args_for(tiny_data, run_dir, *ddp, "--resume", "auto"), nproc=2)
    kills = sum(kill_at_random_moment(cmd, run_dir, rng) for _ in range(KILLS))
    train(args_for(tiny_data, run_dir, *ddp, "--resume", "auto"), nproc=2)
    resumed, reference = losses(run_dir), losses(tmp_path / "reference")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    mismatched = [(s, resumed[s], reference[s]) for s in reference if resumed[s] != reference[s]]
    assert not mismatched, f"seed {seed}: {mismatched}"
    assert kills >= 1, f"seed {seed}: every run finished before its kill"
    print(f"{kills} SIGKILLs survived; losses of steps 1-{STEPS} identical to the uninterrupted run")
    # The 2-rank DDP checkpoint loads in one process through the restricted metadata reader.
    assert load_for_inference(run_dir / "checkpoints" / ckpt.step_dir_name(STEPS)).step == STEPS


# Stalls the step-4 save after DCP has written its shards, before the RNG files and meta.json:
# the test SIGKILLs the process there, with step_00000004.tmp half written.
STALL_SAVE = """
import sys, time
import torch.distributed.checkpoint as dcp
real_save = dcp.save
def stalled_save(state, checkpoint_id, **kw):
    real_save(state, checkpoint_id=checkpoint_id, **kw)
    if checkpoint_id.endswith("step_00000004.tmp"):
        time.sleep(600)
dcp.save = stalled_save
from lmforge.launch.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_checkpoint_write_killed_midway_leaves_the_previous_one_current(tiny_data, tmp_path):
    run_dir = tmp_path / "r"
    # Synchronous saves: the stall hooks dcp.save (tests/test_async_checkpoint.py kills a
    # background write).
    args = run_args(tiny_data, run_dir, "--train.max_steps", "6", "--checkpoint.every", "2",
                    "--checkpoint.keep", "1", "--checkpoint.async_save", "false")
    proc = start([sys.executable, "-c", STALL_SAVE, *args])
    half_written = run_dir / "checkpoints" / "step_00000004.tmp"
    try:
        wait_until((half_written / ".metadata").is_file, proc, "the step-4 save")
    finally:
        kill_group(proc, signal.SIGKILL)
        proc.communicate()
    assert half_written.is_dir()
    names = [p.name for p in ckpt.list_complete(run_dir / "checkpoints")]
    assert names == ["step_00000002"]  # keep 1 deleted nothing: the new one never completed
    res = train([*args, "--resume", "auto"])
    assert "resumed from" in res.stdout and "step_00000002 at step 2" in res.stdout, res.stdout[-2000:]
    assert sorted(losses(run_dir)) == list(range(1, 7))
    assert [p.name for p in ckpt.list_complete(run_dir / "checkpoints")] == ["step_00000006"]
    assert not half_written.exists() and load_for_inference(run_dir).step == 6
