"""Single-process training: the loop, its hooks, checkpoints and the user-facing errors."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from lmforge.pipeline.checkpoint import format as ckpt
from lmforge.pipeline.config import OptimConfig, load_config
from lmforge.pipeline.inference import load_for_inference
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.train import Trainer, TrainingStopped
from tests.harness import TINY_ARGS, losses, metrics, run
from tests.schedule import lr_at

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def cfg_for(data, out, *extra):
    return load_config(None, ["--data.path", str(data), "--log.out_dir", str(out), *TINY_ARGS, *extra])


def test_lr_schedules():
    cos = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(0, 100, cos) == pytest.approx(0.1)
    assert lr_at(9, 100, cos) == pytest.approx(1.0)
    assert lr_at(54, 100, cos) == pytest.approx(0.55, abs=1e-9)  # half-way through the decay
    assert lr_at(99, 100, cos) == pytest.approx(0.1)  # the last step is at the floor
    assert lr_at(100, 100, cos) == pytest.approx(0.1)
    lrs = [lr_at(s, 100, cos) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    wsd = OptimConfig(lr=1.0, min_lr_ratio=0.0, warmup_steps=10, schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, 100, wsd) == 1.0 and lr_at(79, 100, wsd) == 1.0
    assert lr_at(89, 100, wsd) == pytest.approx(0.5) and lr_at(99, 100, wsd) == pytest.approx(0.0)


def test_end_to_end_run_writes_everything(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "10", "--sample.every", "5"), CPU).fit()
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == list(range(1, 11))
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in recs)
    assert {"val_loss", "val_ppl", "val_bpb"} <= set(recs[4]) and "val_loss" in recs[-1]
    assert recs[-1]["val_ppl"] == pytest.approx(math.exp(recs[-1]["val_loss"]))
    assert len(recs[4]["samples"]) == 2 and recs[4]["samples"][0].startswith("def ")
    assert (run_dir / "config.toml").is_file() and (run_dir / "loss.png").is_file()
    assert load_config(str(run_dir / "config.toml"), []).train.max_steps == 10
    loaded = load_for_inference(run_dir)
    assert loaded.step == 10 and loaded.path.name == "final"
    from_dcp = load_for_inference(run_dir / "checkpoints" / "step_00000010")
    for (k, a), (_, b) in zip(loaded.model.state_dict().items(), from_dcp.model.state_dict().items()):
        assert torch.equal(a, b), k


def test_bf16_training_runs_and_learns(tiny_data, tmp_path):
    Trainer(cfg_for(tiny_data, tmp_path / "r", "--train.dtype", "bf16", "--train.max_steps", "16"), CPU).fit()
    curve = losses(tmp_path / "r")
    assert curve[16] < curve[1] - 0.5


def test_non_finite_loss_skips_update_then_stops(tiny_data, tmp_path, monkeypatch):
    trainer = Trainer(cfg_for(tiny_data, tmp_path / "r", "--train.max_bad_steps", "3"), CPU)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    real_forward = trainer.model.forward
    monkeypatch.setattr(trainer.model, "forward", lambda *a, **k: real_forward(*a, **k) * float("nan"))
    trainer.train_step()
    assert trainer.bad_steps == 1
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    with pytest.raises(TrainingStopped, match="consecutive non-finite"):
        trainer.fit()


def test_existing_run_is_never_overwritten(tiny_data, tmp_path):
    run_dir = tmp_path / "r"
    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "4"), CPU).fit()
    before = (run_dir / "metrics.jsonl").read_text()
    res = run([sys.executable, "-m", "lmforge.launch.train", "--data.path", str(tiny_data),
               "--log.out_dir", str(run_dir), *TINY_ARGS, "--train.max_steps", "4"], timeout=120)
    assert res.returncode == 2 and res.stdout.strip().startswith("error: ")
    assert "--resume auto" in res.stdout and "Traceback" not in res.stdout
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_resume_refuses_checkpoint_of_another_model(tiny_data, tmp_path):
    run_dir = tmp_path / "r"
    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "2"), CPU).fit()
    with pytest.raises(ckpt.CheckpointError, match="another model.*d_model"):
        Trainer(cfg_for(tiny_data, run_dir, "--model.d_model", "128", "--checkpoint.resume", "auto",
                        "--train.max_steps", "4"), CPU)


def test_incomplete_checkpoint_is_ignored_by_resume_auto(tiny_data, tmp_path):
    run_dir = tmp_path / "r"
    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "4", "--checkpoint.every", "2"), CPU).fit()
    # A crash mid-save leaves a .tmp directory (and a directory without meta.json): neither counts.
    (run_dir / "checkpoints" / "step_00000006.tmp").mkdir()
    (run_dir / "checkpoints" / "step_00000008").mkdir()
    assert [p.name for p in ckpt.list_complete(run_dir / "checkpoints")][-1] == "step_00000004"


def test_checkpoint_errors_are_clear(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        load_for_inference(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        load_for_inference(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "meta.json").write_text(json.dumps({"format": "lmforge-checkpoint", "version": 99, "step": 1}))
    with pytest.raises(ckpt.CheckpointError, match="version 99"):
        load_for_inference(bad)


def test_dry_run_prints_resolved_config(tmp_path):
    res = run([sys.executable, "-m", "lmforge.launch.train", "--config", "configs/tiny.toml",
               "--dry-run", "--train.max_steps", "7"], timeout=60)
    assert res.returncode == 0, res.stdout
    assert "max_steps = 7" in res.stdout and "accumulation" in res.stdout.lower()


def test_auto_compile_on_cpu_is_off_and_recorded(tiny_data, tmp_path):
    """train.compile = auto on CPU runs eager (pipeline.parallel.parallelize.resolve_compile), as
    the run's config records; compiled training equal to eager is tests/test_compiled_ddp.py's."""
    trainer = Trainer(cfg_for(tiny_data, tmp_path / "auto", "--train.compile", "auto"), CPU)
    assert trainer.cfg.train.compile == "off"
    assert load_config(str(tmp_path / "auto" / "config.toml"), []).train.compile == "off"


def test_corrupted_shard_is_caught_by_the_training_loader(tiny_data, tmp_path):
    import shutil

    from lmforge.data_prep.errors import DataError
    from lmforge.data_prep.shards import HEADER_BYTES

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    trainer = Trainer(cfg_for(data, tmp_path / "r"), CPU)
    # Start-up checks headers and sizes only (no hashing: O(shards), not O(bytes)); a damaged
    # payload is caught when a token it yields leaves the vocabulary, on the read that meets it.
    # (An in-vocabulary change is left to `lmforge prepare --verify`, tested in test_data_prep.)
    first_token = int(trainer.data.loader._order_of("data", 0)[0]) * trainer.cfg.data.seq_len
    shard = data / "train_000000.bin"
    raw = bytearray(shard.read_bytes())
    raw[HEADER_BYTES + 2 * first_token + 1] ^= 0xFF  # high byte of a uint16 id of step 1's first window
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"train_000000.bin holds token id \d+ >= vocab size"):
        trainer.train_step()


def test_step_checkpoint_whose_weights_do_not_fit_is_one_clear_error(tiny_data, tmp_path):
    run_dir = tmp_path / "r"
    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "2"), CPU).fit()
    step = run_dir / "checkpoints" / "step_00000002"
    meta = json.loads((step / "meta.json").read_text())
    meta["model"]["d_model"] = 128
    (step / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match=r"do not fit the model described by its meta.json \(tok_emb.weight"):
        load_for_inference(step)


def test_ddp_or_fsdp_preset_runs_as_one_plain_process(tiny_data, tmp_path):
    for parallel in ("ddp", "fsdp"):
        Trainer(cfg_for(tiny_data, tmp_path / parallel, "--train.parallel", parallel,
                        "--train.max_steps", "2"), CPU).fit()
        assert sorted(losses(tmp_path / parallel)) == [1, 2]
