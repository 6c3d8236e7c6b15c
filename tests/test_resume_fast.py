"""Single-process checks of the training step that fail on the bugs a planted-mutation review
found unguarded: a resume that is not exact (loader state not restored, optimizer or schedule state
lost), a loss or gradient scaled twice, weight decay on the norm gains. One process, a tiny
model, 8 steps: seconds, not the minutes of the distributed tests."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from lmforge.data_prep.shards import load_manifest
from lmforge.model import GPT, ModelConfig
from lmforge.pipeline.config import OptimConfig, load_config
from lmforge.pipeline.data.loader import TokenWindows, TrainLoader
from lmforge.pipeline.optim.optimizers import build_optimizer
from lmforge.pipeline.parallel.materialize import materialize, meta_gpt
from tests.harness import TINY_ARGS, metrics, run, train, train_cmd

STEPS, HALF = 8, 4
# 4 sequences x 64 tokens per micro-step, 512 tokens per step: 2 accumulation micro-steps.
ARGS = [*TINY_ARGS, "--train.parallel", "none", "--train.device", "cpu",
        "--train.max_steps", str(STEPS), "--checkpoint.every", str(HALF),
        "--checkpoint.keep", "10", "--eval.every", "0"]


def run_args(data, out, *extra):
    return ["--data.path", str(data), "--log.out_dir", str(out), *ARGS, *extra]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """An uninterrupted 8-step run, and one resumed (--resume auto) from its step-4 checkpoint
    alone, as if it had been stopped there."""
    root = tmp_path_factory.mktemp("resume")
    straight, resumed = root / "straight", root / "resumed"
    train(run_args(tiny_data, straight))
    name = f"step_{HALF:08d}"
    shutil.copytree(straight / "checkpoints" / name, resumed / "checkpoints" / name)
    train(run_args(tiny_data, resumed, "--resume", "auto"))
    return straight, resumed


def per_step(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in metrics(run_dir) if "loss" in r}


def test_resume_reproduces_loss_lr_and_grad_norm_exactly(runs):
    straight, resumed = (per_step(d) for d in runs)
    assert sorted(straight) == list(range(1, STEPS + 1))
    assert sorted(resumed) == list(range(HALF + 1, STEPS + 1))
    for step in resumed:
        for key in ("loss", "lr", "grad_norm"):
            assert resumed[step][key] == straight[step][key], (step, key, resumed[step], straight[step])


def test_first_step_loss_and_grad_norm_match_a_direct_computation(runs, tiny_data):
    """Step 1 from first principles: the same initial weights (the seed), the same two
    micro-batches, one mean cross-entropy over all 512 tokens of the step. A loss or gradient
    divided twice (by the accumulation steps, say) is off by 2x here."""
    cfg = load_config(None, run_args(tiny_data, "unused"))
    model_cfg = replace(cfg.model, vocab_size=load_manifest(tiny_data).vocab_size)
    windows = TokenWindows(tiny_data, "train", cfg.data.seq_len, model_cfg.vocab_size)
    loader = TrainLoader(windows, cfg.train.micro_batch_size, 2, 0, 1, cfg.train.seed)
    micro_batches = loader.next_micro_batches()
    assert len(micro_batches) == 2
    first = per_step(runs[0])[1]
    model = meta_gpt(model_cfg)  # what every rank builds, then allocates after parallelizing
    materialize(model, torch.device("cpu"), cfg.train.seed)
    total = sum(model(x, y, reduction="sum") for x, y in micro_batches)
    loss = total / cfg.train.global_batch_tokens
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert first["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-5)


def test_weight_decay_on_matrices_only():
    """One AdamW step with zero gradients moves a parameter by its decoupled weight decay only:
    every matrix shrinks by (1 - lr * weight_decay), the norm gains stay exactly 1."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=100, n_layer=2, n_head=4, n_kv_head=2, d_model=64))
    cfg = OptimConfig(lr=0.1, weight_decay=0.5)
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    gains = [n for n, p in model.named_parameters() if p.ndim == 1]
    assert len(gains) == 2 * 2 + 1  # two norms per block, the final norm
    for name, p in model.named_parameters():
        expected = before[name] * (1 - cfg.lr * cfg.weight_decay) if p.ndim >= 2 else before[name]
        assert torch.allclose(p.detach(), expected, rtol=1e-6, atol=0), name


def test_the_tokens_metric_counts_what_was_trained_across_a_batch_change(runs, tiny_data, tmp_path):
    straight = per_step(runs[0])
    shutil.copytree(runs[0] / "checkpoints" / f"step_{HALF:08d}",
                    tmp_path / "checkpoints" / f"step_{HALF:08d}")
    train(run_args(tiny_data, tmp_path, "--resume", "auto", "--train.global_batch_tokens", "1024",
                   "--train.max_steps", str(HALF + 1)))
    step = per_step(tmp_path)[HALF + 1]
    # Step 5 trained one 1024-token batch after four of 512: not 5 x 1024.
    assert straight[HALF]["tokens"] < step["tokens"] <= straight[HALF]["tokens"] + 1024
    assert straight[HALF + 1]["tokens"] - straight[HALF]["tokens"] <= 512


def test_resuming_with_another_optimizer_names_it(runs, tiny_data, tmp_path):
    shutil.copytree(runs[0] / "checkpoints" / f"step_{HALF:08d}",
                    tmp_path / "checkpoints" / f"step_{HALF:08d}")
    theirs = load_config(None, run_args(tiny_data, tmp_path)).optim.name
    other = "muon" if theirs == "adamw" else "adamw"
    res = run(train_cmd(run_args(tiny_data, tmp_path, "--resume", "auto", "--optim.name", other)))
    assert res.returncode == 2 and "Traceback" not in res.stdout, res.stdout[-3000:]
    assert f"holds {theirs} optimizer state" in res.stdout and f"--optim.name {theirs}" in res.stdout
