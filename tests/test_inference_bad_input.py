"""`lmforge eval | sample | export` given a damaged, crafted or mismatched checkpoint, or a bad
output path: one `error:` line and exit 2, before any weight is read or memory allocated for it,
and nothing of the user's removed (each case once ended in a traceback, a huge allocation, or a
deleted directory). A model no Hugging Face model holds: tests/test_hf_export.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.launch.cli import main as lmforge
from tests.errors import cli_error
from tests.test_eval_sample_export import make_checkpoint


@pytest.fixture
def ckpt(tiny_data, tmp_path) -> Path:
    return make_checkpoint(tmp_path / "final", tiny_data)


def edit_meta(ckpt: Path, **model) -> None:
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["model"].update(model)
    (ckpt / "meta.json").write_text(json.dumps(meta))


def test_export_leaves_a_directory_of_the_users_beside_out_alone(ckpt, tmp_path, capsys):
    mine = tmp_path / "hf.tmp"  # the name an export used to write through, and delete
    mine.mkdir()
    (mine / "important.txt").write_text("mine")
    assert lmforge(["export", "--ckpt", str(ckpt), "--hf", str(tmp_path / "hf")]) == 0
    assert (mine / "important.txt").read_text() == "mine"
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "hf", "hf.tmp"]  # no leftovers


def test_export_refuses_a_link_and_the_working_directory(ckpt, tmp_path, capsys, monkeypatch):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    cli_error(capsys, ["export", "--ckpt", str(ckpt), "--hf", str(tmp_path / "link")],
              "symbolic link")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    cli_error(capsys, ["export", "--ckpt", str(ckpt), "--hf", "."], "working directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "here", "link", "target"]
    assert not any((tmp_path / "here").iterdir()) and not any((tmp_path / "target").iterdir())


@pytest.mark.parametrize("damage", ["truncated", "empty", "a pickle"])
@pytest.mark.parametrize("command", ["eval", "sample", "export"])
def test_a_damaged_weights_file_is_one_error(ckpt, tiny_data, tmp_path, capsys, damage, command):
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    if damage == "a pickle":
        torch.save({"w": torch.zeros(2)}, weights)
    else:
        weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"")
    extra = {"eval": ["--data", str(tiny_data)], "sample": ["--prompt", "x"],
             "export": ["--hf", str(tmp_path / "hf")]}[command]
    cli_error(capsys, [command, "--ckpt", str(ckpt), *extra], "model.safetensors",
              "not a readable safetensors file")
    assert not (tmp_path / "hf").exists()


def test_a_meta_json_far_larger_than_its_weights_is_refused_unallocated(ckpt, capsys):
    edit_meta(ckpt, d_model=2**20, n_layer=1000)  # ~10^16 bytes if it were built
    cli_error(capsys, ["sample", "--ckpt", str(ckpt), "--prompt", "x"], "do not fit")
    edit_meta(ckpt, d_model=64, n_layer=2, max_seq_len=10**12)  # the RoPE tables alone
    cli_error(capsys, ["sample", "--ckpt", str(ckpt), "--prompt", "x"], "max_seq_len")


def test_a_tokenizer_that_is_not_the_models_is_refused(ckpt, tmp_path, capsys):
    from lmforge.data_prep.tokenizer import save_tokenizer_dir, train_bpe

    shutil.rmtree(ckpt / "tokenizer")
    save_tokenizer_dir(train_bpe(["some other text " * 50], 300), ckpt / "tokenizer", "bpe", "x")
    for command in (["sample", "--prompt", "x"], ["export", "--hf", str(tmp_path / "hf")]):
        cli_error(capsys, [command[0], "--ckpt", str(ckpt), *command[1:]],
                  "the tokenizer is not the one the model was trained with")
    assert not (tmp_path / "hf").exists()


def test_weights_that_give_nan_cannot_be_sampled(ckpt, capsys):
    weights = ckpt / "model.safetensors"
    save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(weights).items()}, weights)
    rc = lmforge(["sample", "--ckpt", str(ckpt), "--prompt", "x", "--seed", "0"])
    err = capsys.readouterr().err.strip().splitlines()  # notes on what it computes in come first
    assert rc == 2 and [ln for ln in err if ln.startswith("error: ")] == err[-1:], err
    assert "NaN or inf" in err[-1] and "sample an earlier checkpoint" in err[-1], err


def test_eval_checks_its_json_path_and_device_before_evaluating(ckpt, tiny_data, tmp_path, capsys):
    base = ["eval", "--ckpt", str(ckpt), "--data", str(tiny_data)]
    cli_error(capsys, [*base, "--json", str(tmp_path)], "is a directory")
    (tmp_path / "afile").write_text("keep")
    cli_error(capsys, [*base, "--json", str(tmp_path / "afile" / "x.json")], "afile is a file")
    if not torch.cuda.is_available():
        for command in (base, ["sample", "--ckpt", str(ckpt), "--prompt", "x"]):
            cli_error(capsys, [*command, "--device", "cuda"], "no CUDA device")
    assert (tmp_path / "afile").read_text() == "keep" and os.listdir(ckpt)


@pytest.mark.parametrize("layout", ["final", "dcp"])
def test_a_meta_json_of_many_layers_is_refused_before_a_model_is_built(ckpt, tmp_path, capsys,
                                                                       monkeypatch, layout):
    """25,000 layers in meta.json beside a 2-layer checkpoint built a 25,000-layer meta-device GPT
    before comparing (+700 MiB, 30 s; 10^6 layers ~28 GB): now no GPT of more than the one block
    model.model.state_shapes reads its shapes off is built before the refusal."""
    import torch.distributed.checkpoint as dcp

    from lmforge.model.model import GPT

    if layout == "dcp":  # the same weights as a step checkpoint (DCP) of one process
        step = tmp_path / "step"
        dcp.save({"model": load_file(ckpt / "model.safetensors")}, checkpoint_id=str(step), no_dist=True)
        shutil.copy(ckpt / "meta.json", step)
        shutil.copytree(ckpt / "tokenizer", step / "tokenizer")
        ckpt = step
    edit_meta(ckpt, n_layer=25_000)
    built, init = [], GPT.__init__
    monkeypatch.setattr(GPT, "__init__", lambda self, cfg: built.append(cfg.n_layer) or init(self, cfg))
    cli_error(capsys, ["sample", "--ckpt", str(ckpt), "--prompt", "x"], "do not fit",
              "it describes more tensors, or larger ones, than the")
    assert max(built, default=1) == 1, built
