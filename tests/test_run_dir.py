"""A run directory is lmforge's own, and nothing in it reaches outside: every file `train` opens
there goes through data_prep/safe_files.py (a regular file, never followed through a link, a
FIFO, a device or a directory: tests/test_safe_files.py holds the rule itself), and what a resume
reads (meta.json, the RNG state, the dtype, the mixture order, the step, each DCP chunk) is held
to the run; `wandb` is a directory before wandb writes there. Each case runs `lmforge` on real files: one `error:` line, exit 2, nothing outside
read or written. The run's lock: tests/test_run_lock.py; a full or read-only disk:
tests/test_disk_full.py."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from lmforge.launch.cli import main as cli
from lmforge.pipeline.checkpoint.run_dir import RunDir
from lmforge.pipeline.metrics import get_logger
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.train import Trainer
from tests.errors import cli_error, last_error_line
from tests.file_kinds import plant
from tests.harness import ROOT, env, metrics, run_args
from tests.test_checkpoint_lineage import cfg_for
from tests.test_checkpoint_trust import read_metadata, write_metadata

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
STEP = "checkpoints/step_00000002"


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> Path:
    """A finished 2-step run (AdamW, fp32): checkpoints/step_00000002, final/, metrics.jsonl."""
    run_dir = tmp_path_factory.mktemp("trust_run") / "r"
    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "2"), CPU).fit()
    return run_dir


@pytest.fixture(name="run")
def copied_run(trained, tmp_path) -> Path:
    """A copy of `trained` for a test to change."""
    return Path(shutil.copytree(trained, tmp_path / "run", symlinks=True))


def train(capsys, *args) -> tuple[int, str]:
    """`lmforge train ARGS` in this process: (exit status, stderr)."""
    try:
        rc = cli(["train", *map(str, args)])
    finally:  # the run's train.log stays open in the logger until the next run: close it
        for handler in [h for h in get_logger().handlers if isinstance(h, logging.FileHandler)]:
            get_logger().removeHandler(handler)
            handler.close()
    return rc, capsys.readouterr().err


def resume(capsys, data, run_dir, *extra) -> tuple[int, str]:
    return train(capsys, *run_args(data, run_dir, "--resume", "auto", "--train.max_steps", "3",
                                   "--eval.every", "0", *extra))


def snapshot(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), os.stat(path).st_mtime_ns


def files_of(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---- each element of a DCP tensor is stored exactly once --------------------------------------


@pytest.mark.parametrize("how", ["listed_twice", "overlapping"])
def test_a_checkpoint_whose_chunks_count_rows_twice_is_refused(how, run, tiny_data, capsys):
    """Half of the embedding's rows, listed twice (or a second chunk over rows already stored):
    the chunks add up to the tensor, yet rows are unstored and would keep their random init."""
    step = run / STEP
    md = read_metadata(step)
    key = "model.tok_emb.weight"
    rows, cols = md.state_dict_metadata[key].size
    half = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([rows // 2, cols]))
    if how == "listed_twice":
        md.state_dict_metadata[key].chunks = [half, half]
    else:  # the whole tensor, then its second half again, stored after the file's end
        second = ChunkStorageMetadata(torch.Size([rows // 2, 0]), torch.Size([rows // 2, cols]))
        md.state_dict_metadata[key].chunks.append(second)
        storage, payload = step / "__0_0.distcp", io.BytesIO()
        torch.save(torch.zeros(rows // 2, cols), payload)
        end = storage.stat().st_size
        with open(storage, "ab") as f:
            f.write(payload.getvalue())
        md.storage_data[MetadataIndex(key, second.offsets)] = _StorageInfo(
            "__0_0.distcp", end, len(payload.getvalue()))
    write_metadata(step, md)
    for argv in (["eval", "--ckpt", str(step), "--data", str(tiny_data), "--max-tokens", "128"],
                 ["sample", "--ckpt", str(step), "--prompt", "x", "--max-new-tokens", "2"]):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        last_error_line(2, err, "refusing to load", key, "twice")
    rc, err = resume(capsys, tiny_data, run)
    last_error_line(rc, err, key, "twice")


def test_a_checkpoint_whose_chunks_leave_elements_unstored_is_refused(run, capsys):
    step = run / STEP
    md = read_metadata(step)
    md.state_dict_metadata["model.norm_f.weight"].chunks = [ChunkStorageMetadata((0,), (1,))]
    write_metadata(step, md)
    cli_error(capsys, ["sample", "--ckpt", str(step), "--prompt", "x"], "model.norm_f.weight",
              "cover 1 of its 64")


# ---- dtype auto is saved resolved and kept by a resume -----------------------------------------


def lmforge(*args, cpu_bf16: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.launch.cli", *map(str, args)], cwd=ROOT,
                          env={**env(), "LMFORGE_CPU_BF16": cpu_bf16}, capture_output=True,
                          text=True, timeout=300)


def test_dtype_auto_is_saved_resolved_and_a_resume_and_eval_keep_it(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    args = run_args(tiny_data, run_dir, "--train.dtype", "auto", "--eval.every", "0")
    first = lmforge("train", *args, "--train.max_steps", "2", cpu_bf16="native")
    assert first.returncode == 0, first.stderr[-3000:]
    assert 'dtype = "bf16"' in RunDir(run_dir).config.read_text()
    # On a machine where auto means fp32, the bf16 run goes on in bf16, and eval computes in it.
    again = lmforge("train", *args, "--train.max_steps", "3", "--resume", "auto",
                    cpu_bf16="emulated")
    assert again.returncode == 0, again.stderr[-3000:]
    assert 'dtype = "bf16"' in RunDir(run_dir).config.read_text()
    assert "dtype=bf16" in again.stderr
    ev = lmforge("eval", "--ckpt", run_dir, "--data", tiny_data, "--max-tokens", "128",
                 cpu_bf16="emulated")
    assert ev.returncode == 0 and "dtype          bf16 (the run's train.dtype = bf16)" in ev.stdout, \
        ev.stdout + ev.stderr[-2000:]


# ---- a resume keeps the order of the mixture's sources -----------------------------------------


def test_a_resume_with_the_sources_in_another_order_is_refused(tiny_data, tmp_path, capsys):
    a, b = (Path(shutil.copytree(tiny_data, tmp_path / n)) for n in ("a", "b"))
    run_dir = tmp_path / "run"
    args = run_args(tiny_data, run_dir, "--eval.every", "0")[2:]  # no data.path
    rc, err = train(capsys, *args, "--data.mix", f"{a}:0.7,{b}:0.3", "--train.max_steps", "2")
    assert rc == 0, err[-3000:]
    rc, err = train(capsys, *args, "--data.mix", f"{b}:0.3,{a}:0.7", "--train.max_steps", "3",
                    "--resume", "auto")
    last_error_line(rc, err, "data schedule", "order")


# ---- a fresh start never drops an earlier start's records -------------------------------------


@pytest.mark.parametrize("resume_flag", ["none", "auto"])
def test_a_fresh_start_keeps_the_records_of_a_start_killed_before_its_first_checkpoint(
        resume_flag, trained, tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = (trained / "metrics.jsonl").read_bytes()  # as if killed after step 2, unsaved
    (run_dir / "metrics.jsonl").write_bytes(earlier)
    rc, err = train(capsys, *run_args(tiny_data, run_dir, "--train.max_steps", "1",
                                      "--eval.every", "0", "--resume", resume_flag))
    assert rc == 0, err[-3000:]
    kept = [p for p in RunDir(run_dir).root.rglob("metrics.jsonl") if p.read_bytes() == earlier]
    assert kept, "the earlier start's metrics.jsonl records were dropped"
    assert "moved" in err and str(kept[0].parent) in err
    assert [r["step"] for r in metrics(run_dir)] == [1]


# ---- a resume past its max_steps --------------------------------------------------------------


def test_a_resume_with_max_steps_below_the_checkpoint_is_one_line(run, tiny_data, capsys):
    before = files_of(run)
    rc, err = resume(capsys, tiny_data, run, "--train.max_steps", "1")
    last_error_line(rc, err, "step 2", "train.max_steps")
    after = files_of(run)
    after.pop("train.log")  # the refused start's log, appended
    assert after == before  # config.toml, metrics.jsonl, checkpoints untouched


# ---- meta.json records are typed --------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("record", {"step": 5, "loss": 1.0}), ("record", "loss"), ("record", {"loss": [1, {}]}),
    ("loader", 7), ("parent_step", "2"), ("lineage", {"a": 1}), ("step", True)])
def test_a_meta_json_with_a_wrong_type_or_key_is_one_line(field, value, run, tiny_data, capsys):
    meta_path = run / STEP / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta[field] = value
    meta_path.write_text(json.dumps(meta))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text(lines[0] + "\n")  # killed before step 2's record
    rc, err = resume(capsys, tiny_data, run)
    last_error_line(rc, err, "meta.json")


def test_a_checkpoint_missing_a_writers_rng_state_is_refused(run, tiny_data, capsys):
    (run / STEP / "rng_rank00000.pt").unlink()
    rc, err = resume(capsys, tiny_data, run)
    last_error_line(rc, err, "rng_rank00000.pt", "missing")


def test_an_rng_state_past_its_16_mib_limit_is_refused_unread(run, tiny_data, capsys):
    """The README's limit for a rank's RNG state (the other formats' limits are
    tests/test_safe_files.py's); a sparse file, as a crafted one need not fill a disk."""
    os.truncate(run / STEP / "rng_rank00000.pt", (16 << 20) + 1)
    rc, err = resume(capsys, tiny_data, run)
    last_error_line(rc, err, "rng_rank00000.pt", "16,777,216 its format allows")


# ---- the seed's range -------------------------------------------------------------------------


def test_a_seed_past_the_generators_range_is_refused_at_validation(tiny_data, tmp_path, capsys):
    rc, err = train(capsys, *run_args(tiny_data, tmp_path / "run", "--train.seed", str(2**64)))
    last_error_line(rc, err, "train.seed")
    assert not (tmp_path / "run").exists()


# ---- every file kind, for every file of a run directory and a checkpoint ---------------------------

WRITTEN = ["lock", "config.toml", "train.log", "metrics.jsonl", "loss.png"]
READ = [f"{STEP}/meta.json", f"{STEP}/.metadata", f"{STEP}/__0_0.distcp",
        f"{STEP}/rng_rank00000.pt", "final/meta.json"]
KINDS = ["link_to_file", "link_to_dir", "link_to_dev_zero", "fifo", "dir", "char_device",
         "hard_link"]  # tests/file_kinds.py's, but a socket: refused as a FIFO is


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", WRITTEN + READ)
def test_every_file_kind_in_a_run_directory_is_refused_in_one_line(name, kind, run, tiny_data,
                                                                   tmp_path, capsys):
    outside = tmp_path / "outside"
    plant(run / name, kind, outside)
    before = {p: snapshot(p) for p in outside.rglob("*") if p.is_file()}
    rc, err = resume(capsys, tiny_data, run)
    if kind == "hard_link" and name in READ:
        # Read, never written in place (checkpoints are renamed into place, keep-K unlinks): a
        # hard-linked copy of a checkpoint (cp -al, rsync --link-dest) resumes.
        assert rc == 0, err[-3000:]
    else:
        last_error_line(rc, err, str(run / name))
    assert {p: snapshot(p) for p in outside.rglob("*") if p.is_file()} == before


DIRS = ["checkpoints", STEP, f"{STEP}/tokenizer", "checkpoints/abandoned", "final",
        "final/tokenizer", "final.tmp"]


@pytest.mark.parametrize("kind", ["link_to_dir", "file"])
@pytest.mark.parametrize("name", DIRS)
def test_every_directory_of_a_run_that_is_a_link_or_a_file_is_refused(name, kind, run, tiny_data,
                                                                      tmp_path, capsys):
    """A link to a genuine copy (followed, it would resume) or a file where a directory belongs."""
    path, outside = run / name, tmp_path / "outside"
    if path.exists():
        shutil.move(path, outside)
    else:
        outside.mkdir()
    (outside / "mine").write_text("precious\n")
    if kind == "link_to_dir":
        path.symlink_to(outside)
    else:
        path.write_text("x")
    before = files_of(outside)
    rc, err = resume(capsys, tiny_data, run)
    if kind == "file" and name.endswith("tokenizer"):  # a resume reads the data's, and final/
        assert rc == 0, err[-3000:]  # is replaced whole: nothing is read or written there
    else:
        last_error_line(rc, err, str(path))
    assert files_of(outside) == before


@pytest.mark.parametrize("name", [".config.toml.tmp", ".metrics.jsonl.tmp"])
def test_a_link_left_at_a_temporary_name_is_refused(name, run, tiny_data, tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("precious\n")
    before = snapshot(secret)
    (run / name).symlink_to(secret)
    rc, err = resume(capsys, tiny_data, run)
    last_error_line(rc, err, name, "symbolic link")
    assert snapshot(secret) == before and (run / name).is_symlink()


def test_the_path_a_user_names_may_be_a_link_nothing_inside_it_is_followed(run, tiny_data,
                                                                         tmp_path, capsys):
    link = tmp_path / "latest"
    link.symlink_to(run / STEP)
    assert cli(["eval", "--ckpt", str(link), "--data", str(tiny_data), "--max-tokens", "128"]) == 0
    run_link = tmp_path / "run_link"
    run_link.symlink_to(run)
    rc, err = resume(capsys, tiny_data, run_link)
    assert rc == 0, err[-3000:]


def test_the_largest_seed_trains(tiny_data, tmp_path, capsys):
    rc, err = train(capsys, *run_args(tiny_data, tmp_path / "run", "--train.seed", str(2**64 - 1),
                                      "--train.max_steps", "1", "--eval.every", "0"))
    assert rc == 0, err[-3000:]


@pytest.mark.parametrize("command", ["eval", "sample", "export"])
def test_a_fifo_in_a_checkpoint_is_refused_not_waited_on(command, run, tiny_data, tmp_path,
                                                         capsys):
    os.mkfifo(run / "final" / "tokenizer" / "notes")  # copying it into an export would hang
    argv = {"eval": ["--data", str(tiny_data), "--max-tokens", "128"],
            "sample": ["--prompt", "x", "--max-new-tokens", "2"],
            "export": ["--hf", str(tmp_path / "hf")]}[command]
    rc = cli([command, "--ckpt", str(run / "final"), *argv])
    last_error_line(rc, capsys.readouterr().err, "tokenizer/notes is a FIFO")
    assert not (tmp_path / "hf").exists()


# ---- wandb's directory --------------------------------------------------------------------------


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
    last_error_line(rc, err, "wandb directory", "symbolic link" if kind == "link" else "regular file")
    assert files_of(outside) == {"sentinel": b"precious\n"} and files_of(run) == before
    RunDir(run).wandb.unlink()
    RunDir(run).wandb.mkdir()  # a directory of its own is where wandb writes
    rc, err = resume(capsys, tiny_data, run, "--log.wandb", "offline")
    assert rc == 0, err[-3000:]
    assert files_of(outside) == {"sentinel": b"precious\n"}
    assert any(p.suffix == ".wandb" for p in RunDir(run).wandb.rglob("*"))
