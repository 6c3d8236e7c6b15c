"""Muon under torchrun (CPU/gloo, 2 processes): DDP reduces the gradients before the
orthogonalisation, so 2 ranks x 2 accumulation steps == 1 rank x 4; a checkpoint written by 2
ranks resumes exactly on 1 (optimizer state included); FSDP stops with one line before training.
"""

from __future__ import annotations

import shutil
import sys

import pytest

from tests.launch_utils import TINY_ARGS, losses, run, train

pytestmark = pytest.mark.dist

STEPS = 12


def args_for(data, out, *extra):
    # 1024 tokens per step: 4 micro-steps of 4 x 64 on 1 rank, 2 per rank on 2 ranks.
    return ["--data.path", str(data), "--log.out_dir", str(out), *TINY_ARGS,
            "--train.global_batch_tokens", "1024", "--train.max_steps", str(STEPS),
            "--optim.name", "muon", "--optim.muon_momentum_warmup_steps", "8",
            "--checkpoint.every", "6", "--eval.every", "0", *extra]


def max_diff(a: dict[int, float], b: dict[int, float], steps) -> float:
    assert all(s in a and s in b for s in steps), (sorted(a), sorted(b))
    return max(abs(a[s] - b[s]) for s in steps)


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("muon")
    out = {"single": root / "single", "ddp": root / "ddp", "adamw": root / "adamw"}
    train(args_for(tiny_data, out["single"], "--train.parallel", "none"))
    train(args_for(tiny_data, out["ddp"], "--train.parallel", "ddp"), nproc=2)
    train(args_for(tiny_data, out["adamw"], "--train.parallel", "none", "--optim.name", "adamw"))
    return out


def test_ddp_two_ranks_equals_one_rank_with_accumulation(runs):
    single, ddp = losses(runs["single"]), losses(runs["ddp"])
    steps = list(range(1, STEPS + 1))
    assert max_diff(ddp, single, steps) <= 1e-5
    # Muon really ran: the curve is not AdamW's.
    assert max_diff(single, losses(runs["adamw"]), steps[2:]) > 1e-2
    assert single[STEPS] < single[1] - 0.5


def test_checkpoint_from_two_ranks_resumes_exactly_on_one(runs, tiny_data, tmp_path):
    name = "step_00000006"
    shutil.copytree(runs["ddp"] / "checkpoints" / name, tmp_path / "r" / "checkpoints" / name)
    train(args_for(tiny_data, tmp_path / "r", "--train.parallel", "none", "--resume", "auto"))
    after = losses(tmp_path / "r")
    assert max_diff(after, losses(runs["ddp"]), range(7, STEPS + 1)) <= 1e-5


def test_fsdp_is_refused_in_one_line_before_training(tiny_data, tmp_path):
    cmd = [sys.executable, "-m", "launch.cli", "train", "--nproc", "2",
           *args_for(tiny_data, tmp_path / "f", "--train.parallel", "fsdp")]
    res = run(cmd, timeout=120)
    assert res.returncode == 2, res.stdout[-3000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stdout[-3000:]
    assert "optim.name" in lines[0] and "fsdp" in lines[0]
    assert not (tmp_path / "f").exists()
