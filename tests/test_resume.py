"""A resume, in one process or through the CLI: exact (the uninterrupted run's loss, lr and grad
norm from the checkpoint on, Muon's momentum saved), with any group's lr retuned, with another
batch (the tokens metric counts what was trained) or optimizer (refused by name), with another
data schedule (refused in one line, nothing written); never blocked by a torn metrics.jsonl tail;
moving no checkpoint aside before every check passed; losing no record to a kill after the last
checkpoint. And the first step from first principles, on the same uninterrupted run: a loss or
gradient scaled twice is off by 2x."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lmforge.data_prep.shards import load_manifest
from lmforge.pipeline import train as train_module
from lmforge.pipeline.checkpoint import format as ckpt
from lmforge.pipeline.checkpoint.run_dir import RunDir
from lmforge.pipeline.config import load_config
from lmforge.pipeline.data.loader import TokenWindows, TrainLoader
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.parallel.materialize import materialize, meta_gpt
from lmforge.pipeline.train import Trainer
from tests.errors import last_error
from tests.harness import ROOT, TINY_ARGS, env, losses, metrics, run, run_args, train, train_cmd
from tests.schedule import lr_at

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))

STEPS, HALF = 8, 4
# 4 sequences x 64 tokens per micro-step, 512 tokens per step: 2 accumulation micro-steps.
ARGS = [*TINY_ARGS, "--train.parallel", "none", "--train.device", "cpu",
        "--train.max_steps", str(STEPS), "--checkpoint.every", str(HALF),
        "--checkpoint.keep", "10", "--eval.every", "0"]


def straight_args(data, out, *extra):
    """The 8-step run's flags (ARGS), its data and run directory, then `extra`."""
    return ["--data.path", str(data), "--log.out_dir", str(out), *ARGS, *extra]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """An uninterrupted 8-step run, and one resumed (--resume auto) from its step-4 checkpoint
    alone, as if it had been stopped there."""
    root = tmp_path_factory.mktemp("resume")
    straight, resumed = root / "straight", root / "resumed"
    train(straight_args(tiny_data, straight))
    name = f"step_{HALF:08d}"
    shutil.copytree(straight / "checkpoints" / name, resumed / "checkpoints" / name)
    train(straight_args(tiny_data, resumed, "--resume", "auto"))
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
    cfg = load_config(None, straight_args(tiny_data, "unused"))
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


def test_the_tokens_metric_counts_what_was_trained_across_a_batch_change(runs, tiny_data, tmp_path):
    straight = per_step(runs[0])
    shutil.copytree(runs[0] / "checkpoints" / f"step_{HALF:08d}",
                    tmp_path / "checkpoints" / f"step_{HALF:08d}")
    train(straight_args(tiny_data, tmp_path, "--resume", "auto", "--train.global_batch_tokens",
                        "1024", "--train.max_steps", str(HALF + 1)))
    step = per_step(tmp_path)[HALF + 1]
    # Step 5 trained one 1024-token batch after four of 512: not 5 x 1024.
    assert straight[HALF]["tokens"] < step["tokens"] <= straight[HALF]["tokens"] + 1024
    assert straight[HALF + 1]["tokens"] - straight[HALF]["tokens"] <= 512


def test_resuming_with_another_optimizer_names_it(runs, tiny_data, tmp_path):
    shutil.copytree(runs[0] / "checkpoints" / f"step_{HALF:08d}",
                    tmp_path / "checkpoints" / f"step_{HALF:08d}")
    theirs = load_config(None, straight_args(tiny_data, tmp_path)).optim.name
    other = "muon" if theirs == "adamw" else "adamw"
    res = run(train_cmd(straight_args(tiny_data, tmp_path, "--resume", "auto", "--optim.name", other)))
    assert res.returncode == 2 and "Traceback" not in res.stdout, res.stdout[-3000:]
    assert f"holds {theirs} optimizer state" in res.stdout and f"--optim.name {theirs}" in res.stdout


# ---- the optimizers' state and each group's lr ---------------------------------------------------


def muon_cfg(data, out, *extra):
    """An 8-step Muon run in this process, checkpointed at step 4."""
    return load_config(None, ["--data.path", str(data), "--log.out_dir", str(out), *TINY_ARGS,
                              "--optim.name", "muon", "--optim.muon_momentum_warmup_steps", "6",
                              "--optim.lr", "0.02", "--optim.embed_lr", "3e-3", "--optim.scalar_lr", "3e-3",
                              "--train.max_steps", "8", "--checkpoint.every", "4", *extra])


@pytest.mark.parametrize("own_lrs", [[], ["--model.tie_embeddings", "false", "--optim.embed_lr", "0.1",
                                         "--optim.head_lr", "0.01"]], ids=["tied", "own-lrs"])
def test_muon_resume_is_exact_and_saves_momentum(tiny_data, tmp_path, own_lrs):
    Trainer(muon_cfg(tiny_data, tmp_path / "straight", *own_lrs), CPU).fit()
    straight = losses(tmp_path / "straight")
    assert straight[8] < straight[1] - 0.3 and all(math.isfinite(v) for v in straight.values())
    step4 = tmp_path / "resumed" / "checkpoints" / "step_00000004"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / step4.name, step4)
    resumed = Trainer(muon_cfg(tiny_data, tmp_path / "resumed", "--checkpoint.resume", "auto", *own_lrs), CPU)
    assert resumed.step == 4
    muon = list(resumed.optimizer)[1]
    assert all(muon.state[p]["momentum_buffer"].abs().sum() > 0
               for p in muon.param_groups[0]["params"])
    resumed.fit()
    after = losses(tmp_path / "resumed")
    assert {s: after[s] for s in range(5, 9)} == {s: straight[s] for s in range(5, 9)}


@pytest.mark.parametrize("retune", [
    ["--optim.embed_lr", "0.2", "--optim.head_lr", "0.01", "--optim.lr", "0.04"],
    # The matrices' lr set to the table's own: the two groups stay two groups.
    ["--optim.embed_lr", "0.1", "--optim.lr", "0.1"],
], ids=["every-group", "lr-equal-to-embed-lr"])
def test_a_resume_retunes_any_groups_lr(tiny_data, tmp_path, retune):
    untied = ["--model.tie_embeddings", "false"]
    Trainer(muon_cfg(tiny_data, tmp_path / "straight", *untied, "--optim.embed_lr", "0.1"), CPU).fit()
    step4 = "checkpoints/step_00000004"
    shutil.copytree(tmp_path / "straight" / step4, tmp_path / "retuned" / step4)
    resumed = Trainer(muon_cfg(tiny_data, tmp_path / "retuned", "--checkpoint.resume", "auto", *untied,
                                *retune), CPU)
    assert resumed.step == 4
    adamw = list(resumed.optimizer)[0]
    for kind in ("embed", "head", "scalar"):
        group = next(g for g in adamw.param_groups if g["kind"] == kind)
        assert adamw.state[group["params"][0]]["step"] == 4, kind
    resumed.fit()
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (tmp_path / "retuned" / "metrics.jsonl").open())
           if "lr" in r}
    assert resumed.cfg.optim.lr == float(retune[-1]) and lrs[8] == pytest.approx(lr_at(7, 8, resumed.cfg.optim))


# ---- what a resume checks, and what it leaves ----------------------------------------------------


def args_for(data, out, *extra):
    """A 4-step run checkpointed every 2 steps (TINY_ARGS, then `extra`)."""
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


@pytest.fixture
def two_sources(tiny_data, tmp_path) -> tuple[Path, Path]:
    return tuple(Path(shutil.copytree(tiny_data, tmp_path / n)) for n in ("a", "b"))


def train_on(run: Path, data_args: list[str], steps: int, *extra: str) -> subprocess.CompletedProcess:
    """`lmforge train` of TINY_ARGS on `data_args` in a subprocess, checkpointed every 2 steps."""
    return subprocess.run([sys.executable, "-m", "lmforge.launch.cli", "train", *data_args,
                           "--log.out_dir", str(run), *TINY_ARGS, "--train.max_steps", str(steps),
                           "--checkpoint.every", "2", "--eval.every", "0", *extra],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


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
    run_dir = tmp_path / "run"
    assert train_on(run_dir, ["--config", str(first)], 2).returncode == 0
    logged = RunDir(run_dir).metrics.read_bytes()
    if change == "mix":
        resumed = train_on(run_dir, ["--data.mix", f"{a}:0.99,{b}:0.01"], 4, "--resume", "auto")
        needles = ("a 0.5, b 0.5", "a 0.99, b 0.01")
    else:
        resumed = train_on(run_dir, ["--config", str(second)], 4, "--resume", "auto")
        needles = ("from 0.5: a 0.5, b 0.5", "from 0.5: a 0.99, b 0.01")
    last_error(resumed, "was trained on the data schedule", *needles)
    assert [p.name for p in RunDir(run_dir).checkpoints.iterdir()] == ["step_00000002"]
    assert RunDir(run_dir).metrics.read_bytes() == logged  # nothing written
    same = train_on(run_dir, ["--config", str(first)], 4, "--resume", "auto")  # the same plan resumes
    assert same.returncode == 0, same.stderr[-2000:]
