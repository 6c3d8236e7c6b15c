"""Checkpoints on the paths a long run takes, where a crash or a rollback finds the bugs:
rollbacks and keep-K, weights written before eval/samples, crafted DCP metadata, the typed
versioned CheckpointMeta, and start-up cost independent of the shards' bytes."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data_prep import shards as S
from lmforge.pipeline.checkpoint import format as ckpt
from lmforge.pipeline.checkpoint.run_dir import RunDir
from lmforge.pipeline.config import JobConfig
from lmforge.pipeline.data.loader import TokenWindows
from lmforge.pipeline.inference import load_for_inference
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.train import Trainer
from tests.harness import losses, metrics, run_config

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def cfg_for(data, out, *extra):
    return run_config(data, out, *extra)


def step_names(run_dir: Path) -> list[str]:
    return [p.name for p in ckpt.list_complete(run_dir / "checkpoints")]


# ---- keep-K after a rollback ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """A finished 2-step run (step_00000002 and final/); tests work on copies."""
    run_dir = tmp_path_factory.mktemp("trained") / "r"
    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "2", "--eval.batch_size", "3"), CPU).fit()
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "copy"))


@pytest.fixture(scope="module")
def rolled_back(tiny_data, tmp_path_factory):
    """Run A saves steps 2 and 4 (and final/ at 4); run B resumes from step 2 with keep 1, to 3."""
    run_dir = tmp_path_factory.mktemp("rollback") / "run"
    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "4", "--checkpoint.every", "2",
                    "--checkpoint.keep", "5"), CPU).fit()
    assert step_names(run_dir) == ["step_00000002", "step_00000004"]
    step2 = run_dir / "checkpoints" / "step_00000002"
    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "3", "--checkpoint.keep", "1",
                    "--checkpoint.resume", str(step2)), CPU).fit()
    return run_dir


def test_rollback_moves_the_abandoned_branch_aside_and_keep_k_spares_the_new_line(rolled_back):
    run_dir = rolled_back
    assert step_names(run_dir) == ["step_00000003"]  # keep 1: the newest of the current line
    (moved,) = RunDir(run_dir).abandoned.iterdir()
    assert sorted(p.name for p in moved.iterdir()) == ["final", "step_00000004"]  # never deleted
    assert ckpt.read_meta(moved / "step_00000004").step == 4
    b3 = ckpt.read_meta(run_dir / "checkpoints" / "step_00000003")
    assert b3.parent_step == 2 and b3.lineage == ckpt.read_meta(moved / "step_00000004").lineage
    assert sorted(losses(run_dir)) == [1, 2, 3]  # metrics of the abandoned steps trimmed


def test_after_a_rollback_resume_eval_sample_export_pick_the_current_line(rolled_back, tiny_data,
                                                                          tmp_path, monkeypatch):
    run_dir = rolled_back
    assert ckpt.find_resume("auto", run_dir).name == "step_00000003"
    assert ckpt.resolve(run_dir).name == "final" and load_for_inference(run_dir).step == 3

    from lmforge.launch import evaluate, export, sample

    out = tmp_path / "eval.json"
    with redirect_stdout(io.StringIO()):
        assert evaluate.main(["--ckpt", str(run_dir), "--data", str(tiny_data), "--max-tokens", "256",
                              "--json", str(out)]) == 0
    assert json.loads(out.read_text())["step"] == 3

    loaded_steps = []
    real = sample.load_for_inference
    monkeypatch.setattr(sample, "load_for_inference",
                        lambda *a, **k: loaded_steps.append(real(*a, **k)) or loaded_steps[-1])
    with redirect_stdout(io.StringIO()):
        sample.main(["--ckpt", str(run_dir), "--prompt", "def ", "--max-new-tokens", "2", "--seed", "0"])
    assert [c.step for c in loaded_steps] == [3]

    hf = export.export(run_dir, tmp_path / "hf")
    assert json.loads((hf / export.EXPORT_MARKER).read_text())["step"] == 3


def test_resume_from_an_export_is_one_clear_error(trained, tiny_data, tmp_path):
    run_dir = trained
    with pytest.raises(ckpt.CheckpointError, match="cannot be resumed"):
        ckpt.find_resume(str(run_dir / "final"), tmp_path / "r2")


# ---- weights before eval and samples -------------------------------------------------------------


def test_failing_sampler_at_the_last_step_keeps_checkpoint_and_export(tiny_data, tmp_path,
                                                                      monkeypatch, caplog):
    run_dir = tmp_path / "r"
    trainer = Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "2", "--checkpoint.every", "0"), CPU)

    def broken():
        raise ValueError("max() arg is an empty sequence")

    monkeypatch.setattr(trainer, "run_samples", broken)
    assert trainer.fit() == 0
    assert step_names(run_dir) == ["step_00000002"] and ckpt.read_meta(run_dir / "final").step == 2
    warned = [r.getMessage() for r in caplog.records if "sampling failed" in r.getMessage()]
    assert len(warned) == 1 and "empty sequence" in warned[0]
    assert metrics(run_dir)[-1]["step"] == 2 and "val_loss" in metrics(run_dir)[-1]


@pytest.mark.parametrize("how", ["last step", "stop"])
def test_weights_are_written_before_eval_and_samples(tiny_data, tmp_path, monkeypatch, how):
    steps = "2" if how == "last step" else "100"
    trainer = Trainer(cfg_for(tiny_data, tmp_path / "r", "--train.max_steps", steps,
                              "--checkpoint.every", "0", "--eval.every", "1", "--sample.every", "1"), CPU)
    events = []
    for name in ("save", "export_final", "run_eval", "run_samples"):
        real = getattr(trainer, name)
        monkeypatch.setattr(trainer, name, lambda real=real, name=name: events.append(name) or real())
    if how == "stop":  # SIGTERM's handler sets this; the ranks agree on it at the end of a step
        trainer.stop_requested = True
        trainer.fit()
        assert events == ["save"] and trainer.step == 1  # nothing between the step and the save
    else:
        trainer.fit()
        assert events[-4:] == ["save", "export_final", "run_eval", "run_samples"]


# ---- DCP metadata is not unpickled blindly -------------------------------------------------------


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "PICKLE CODE RAN"))


def test_crafted_dcp_metadata_is_refused_and_runs_nothing(trained, tiny_data, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    step = run_dir / "checkpoints" / "step_00000002"
    assert load_for_inference(step).step == 2  # a real single-rank DCP checkpoint loads
    marker = tmp_path / "ran.txt"
    (step / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    shutil.rmtree(run_dir / "final")  # --ckpt RUN now resolves to the crafted step checkpoint
    with pytest.raises(ckpt.CheckpointError, match=r"refusing to load .*\.metadata.*pathlib.Path.write_text"):
        load_for_inference(run_dir)
    with pytest.raises(ckpt.CheckpointError, match="refusing to load"):  # and on the resume path
        Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "4", "--checkpoint.resume", "auto"), CPU)
    assert not marker.exists()


# ---- one typed, versioned CheckpointMeta ---------------------------------------------------------


def test_checkpoint_meta_is_typed_versioned_and_round_trips(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    step = run_dir / "checkpoints" / "step_00000002"
    meta = ckpt.read_meta(step)
    assert isinstance(meta, ckpt.CheckpointMeta) and isinstance(meta.config, JobConfig)
    assert meta.config.eval.batch_size == 3 and meta.loader["step"] > 0 and meta.parent_step is None
    assert ckpt.CheckpointMeta.from_json(meta.to_json(), step) == meta
    raw = json.loads((step / "meta.json").read_text())
    assert "parallel" not in raw and raw["version"] == ckpt.VERSION
    assert ckpt.read_meta(run_dir / "final").loader is None
    train = raw["config"]["train"] | {"time_budget_s": 0.0}  # written before the key went
    (step / "meta.json").write_text(json.dumps(raw | {"config": raw["config"] | {"train": train}}))
    assert ckpt.read_meta(step).config == meta.config
    (step / "meta.json").write_text(json.dumps(raw | {"version": 1}))
    with pytest.raises(ckpt.CheckpointError, match="format version 1, this lmforge reads versions 2, 3"):
        ckpt.read_meta(step)
    (step / "meta.json").write_text(json.dumps(raw | {"config": {"train": {"max_step": 3}}}))
    with pytest.raises(ckpt.CheckpointError, match="meta.json is invalid.*max_step"):
        ckpt.read_meta(step)


# ---- start-up reads headers, not bytes -----------------------------------------------------------


def test_loader_start_up_and_reads_hash_nothing(tmp_path, monkeypatch):
    """Opening a split and reading every window costs header reads, never a checksum."""
    vocab, infos = 300, []
    for k in range(20):
        name = S.shard_name("train", k)
        sha = S.write_shard(tmp_path / name, np.arange(k, k + 50) % vocab, vocab)
        infos.append(S.ShardInfo(file=name, split="train", tokens=50, documents=1, sha256=sha))
    S.Manifest(version=S.FORMAT_VERSION, vocab_size=vocab, eot_id=0, tokenizer={}, source="test",
               args={}, shards=infos).save(tmp_path)
    hashed = []
    real_sha256 = S.file_sha256
    monkeypatch.setattr(S, "file_sha256", lambda p: hashed.append(p) or real_sha256(p))
    windows = TokenWindows(tmp_path, "train", 16, vocab)
    windows.windows(range(windows.num_windows))
    assert hashed == []
    # Damage the payload so that an id leaves the vocabulary: caught on read, naming the shard.
    shard = tmp_path / S.shard_name("train", 7)
    raw = bytearray(shard.read_bytes())
    raw[S.HEADER_BYTES + 1] ^= 0xFF  # high byte of the first uint16 token
    shard.write_bytes(bytes(raw))
    with pytest.raises(S.ShardError, match=r"train_000007.bin holds token id \d+ >= vocab size 300"):
        TokenWindows(tmp_path, "train", 16, vocab).windows(range(windows.num_windows))


# ---- resuming another branch at the current line's newest step ----------------------------------


def test_resuming_an_abandoned_branch_at_the_newest_step_moves_the_current_line_aside(tiny_data, tmp_path):
    """Branch A reaches step 4; branch B rolls back to 2 and reaches 4 too; resuming A's step 4
    must move B's step 4 and B's final/ aside (never delete them), so that `--resume auto` and
    `--ckpt RUN` then both follow A."""
    run_dir = tmp_path / "run"
    common = ("--checkpoint.every", "2", "--checkpoint.keep", "5")
    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "4", *common), CPU).fit()
    step2 = run_dir / "checkpoints" / "step_00000002"
    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "4", "--optim.lr", "1e-3",
                    "--checkpoint.resume", str(step2), *common), CPU).fit()
    (a_moved,) = RunDir(run_dir).abandoned.iterdir()
    a_step4 = a_moved / "step_00000004"
    b_weights = load_for_inference(run_dir / "final").model.state_dict()

    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "6", "--checkpoint.resume", str(a_step4),
                    *common), CPU).fit()
    moved = sorted(RunDir(run_dir).abandoned.iterdir())
    assert len(moved) == 2
    b_moved = next(m for m in moved if m != a_moved)
    assert sorted(p.name for p in b_moved.iterdir()) == ["final", "step_00000004"]
    kept = load_for_inference(b_moved / "final").model.state_dict()
    assert all(torch.equal(kept[k], b_weights[k]) for k in b_weights)  # B's export, untouched
    assert step_names(run_dir) == ["step_00000002", "step_00000006"]
    newest = ckpt.find_resume("auto", run_dir)
    final = load_for_inference(run_dir).model.state_dict()
    resumable = load_for_inference(newest).model.state_dict()
    assert newest.name == "step_00000006" and all(torch.equal(final[k], resumable[k]) for k in final)
