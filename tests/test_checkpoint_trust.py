"""A checkpoint is untrusted input: no file in it can run code or make lmforge read outside it.
Each attack is a real file on disk, run through the CLI: one `error:` line, exit 2, no marker."""

from __future__ import annotations

import io
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.train import Trainer
from tests.errors import cli_error, last_error
from tests.harness import ROOT, TINY_ARGS, env
from tests.test_checkpoint_lineage import cfg_for

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "PICKLE CODE RAN"))


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """A finished 2-step run: checkpoints/step_00000002 (DCP, with optimizer) and final/."""
    run_dir = tmp_path_factory.mktemp("trust") / "r"
    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "2"), CPU).fit()
    return run_dir


@pytest.fixture
def step(trained, tmp_path) -> Path:
    """A copy of the step checkpoint alone in a run directory (so --ckpt RUN resolves to it)."""
    run = tmp_path / "run"
    src = trained / "checkpoints" / "step_00000002"
    return Path(shutil.copytree(src, run / "checkpoints" / src.name))


def read_metadata(step: Path):
    with open(step / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own, genuine file


def write_metadata(step: Path, md) -> None:
    (step / ".metadata").write_bytes(pickle.dumps(md))


def storage_of(md, key: str) -> tuple[MetadataIndex, _StorageInfo]:
    return next((i, s) for i, s in md.storage_data.items() if i.fqn == key)


def inference_commands(ckpt_path: Path, data: Path, out: Path) -> list[list[str]]:
    return [["eval", "--ckpt", str(ckpt_path), "--data", str(data), "--max-tokens", "128"],
            ["sample", "--ckpt", str(ckpt_path), "--prompt", "x", "--max-new-tokens", "2"],
            ["export", "--ckpt", str(ckpt_path), "--hf", str(out)]]


def resume_through_cli(run_dir: Path, data: Path) -> subprocess.CompletedProcess:
    args = ["--data.path", str(data), "--log.out_dir", str(run_dir), *TINY_ARGS,
            "--train.max_steps", "4", "--checkpoint.resume", "auto"]
    return subprocess.run([sys.executable, "-m", "lmforge.launch.cli", "train", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)


# ---- 1. no entry is unpickled without weights_only -------------------------------------------------


def test_a_tensor_declared_as_bytes_pointing_at_a_pickle_runs_nothing(step, tiny_data, tmp_path, capsys):
    marker = tmp_path / "ran.txt"
    payload = pickle.dumps(_RunsCode(marker))
    (step / "__9_0.distcp").write_bytes(payload)
    md = read_metadata(step)
    md.state_dict_metadata["model.norm_f.weight"] = BytesStorageMetadata()
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != "model.norm_f.weight"}
    md.storage_data[MetadataIndex("model.norm_f.weight")] = _StorageInfo("__9_0.distcp", 0, len(payload))
    write_metadata(step, md)
    for argv in inference_commands(step.parents[1], tiny_data, tmp_path / "hf"):
        err = cli_error(capsys, argv)
        assert "refusing to load" in err and "'model.norm_f.weight' as pickled bytes" in err
    last_error(resume_through_cli(step.parents[1], tiny_data), "refusing to load")
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_a_pickle_patched_into_a_genuine_bytes_entry_runs_nothing_on_resume(step, tiny_data, tmp_path):
    marker = tmp_path / "ran.txt"
    genuine = (step / ".metadata").read_bytes()
    _, info = storage_of(read_metadata(step), "optim.param_groups.0.lr")
    payload = pickle.dumps(_RunsCode(marker))
    assert len(payload) <= info.length
    data = bytearray((step / "__0_0.distcp").read_bytes())
    data[info.offset:info.offset + len(payload)] = payload
    (step / "__0_0.distcp").write_bytes(bytes(data))
    assert (step / ".metadata").read_bytes() == genuine
    last_error(resume_through_cli(step.parents[1], tiny_data), "refusing to load",
                     "weights_only")  # torch's own refusal, named in the one line
    assert not marker.exists()


def test_a_bytes_entry_lmforge_never_writes_is_refused(step, tiny_data, capsys):
    md = read_metadata(step)
    index, info = storage_of(md, "optim.param_groups.0.lr")
    md.state_dict_metadata["model.extra"] = BytesStorageMetadata()
    md.storage_data[MetadataIndex("model.extra")] = info
    write_metadata(step, md)
    err = cli_error(capsys, ["sample", "--ckpt", str(step), "--prompt", "x"])
    assert "'model.extra' as pickled bytes" in err


# ---- 2. storage stays inside the checkpoint directory ----------------------------------------------


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_storage_outside_the_checkpoint_is_never_read(step, tiny_data, tmp_path, capsys, how):
    outside = tmp_path / "outside"
    outside.mkdir()
    buf = io.BytesIO()
    torch.save(torch.full((64,), 7.0), buf)
    (outside / "secret.pt").write_bytes(buf.getvalue())
    md = read_metadata(step)
    index, _ = storage_of(md, "model.norm_f.weight")
    if how == "symlink":
        name = "__5_0.distcp"
        (step / name).symlink_to(outside / "secret.pt")
    else:
        name = "../../../outside/secret.pt" if how == "relative" else str(outside / "secret.pt")
    md.storage_data[index] = _StorageInfo(name, 0, len(buf.getvalue()))
    write_metadata(step, md)
    err = cli_error(capsys, ["eval", "--ckpt", str(step), "--data", str(tiny_data), "--max-tokens", "128"])
    if how == "symlink":  # the checkpoint's files are checked before any is read
        assert f"{step / name} is a symbolic link" in err
    else:
        assert "refusing to load" in err and "__R_N.distcp" in err


def test_a_crafted_rng_state_is_one_error(step, tiny_data, tmp_path):
    marker = tmp_path / "ran.txt"
    (step / "rng_rank00000.pt").write_bytes(pickle.dumps(_RunsCode(marker)))
    last_error(resume_through_cli(step.parents[1], tiny_data), "rng_rank00000.pt")
    assert not marker.exists()


# ---- 3. symlinks are never followed when a directory is copied --------------------------------------


def test_a_symlink_in_a_checkpoints_tokenizer_is_refused_not_copied(trained, tiny_data, tmp_path, capsys):
    final = Path(shutil.copytree(trained / "final", tmp_path / "final"))
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's private file")
    (final / "tokenizer" / "README").symlink_to(secret)
    for argv in inference_commands(final, tiny_data, tmp_path / "hf"):
        assert "tokenizer/README is a symbolic link" in cli_error(capsys, argv)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


def test_a_symlink_in_the_datas_tokenizer_stops_training_before_it_starts(tiny_data, tmp_path):
    data = Path(shutil.copytree(tiny_data, tmp_path / "data"))
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's private file")
    (data / "tokenizer" / "notes").symlink_to(secret)
    proc = subprocess.run([sys.executable, "-m", "lmforge.launch.cli", "train", "--data.path", str(data),
                           "--log.out_dir", str(tmp_path / "run"), *TINY_ARGS, "--train.max_steps", "2"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    last_error(proc, "tokenizer/notes is a symbolic link")
    assert not list((tmp_path / "run").glob("checkpoints/*"))


# ---- 4. the vocabulary decoded is the vocabulary verified -------------------------------------------


def test_a_tiktoken_cache_never_replaces_the_verified_vocabulary(tmp_path, monkeypatch):
    """Two datasets prepared at the same relative path in two working directories: tiktoken's
    cache is keyed on the path string, so reading through it decoded the second with the first."""
    from lmforge.data_prep.tokenizer import (
        load_tokenizer_dir,
        mergeable_ranks,
        save_tokenizer_dir,
        train_bpe,
    )

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    saved = {}
    for name, text in (("a", "alpha beta gamma delta "), ("b", "zeta eta theta iota ")):
        saved[name] = mergeable_ranks(train_bpe([text * 40], 300, name))
        save_tokenizer_dir(train_bpe([text * 40], 300, name), tmp_path / name / "data" / "x", "bpe", name)
    assert saved["a"] != saved["b"]
    for name in ("a", "b"):
        monkeypatch.chdir(tmp_path / name)
        assert mergeable_ranks(load_tokenizer_dir("data/x")) == saved[name]
