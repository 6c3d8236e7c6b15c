"""A full or read-only disk under any output (a checkpoint, an export, a prepare, `eval --json`):
one `error:` line, exit 2, and no `.tmp` left behind. A checkpoint's line names the free space,
the space a checkpoint needs and the last complete checkpoint, whether the write is synchronous or
in the background; a path that cannot be written is said before any work. On a real full
filesystem: a small tmpfs (root only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.pipeline.checkpoint.run_dir import RunDir
from tests.errors import last_error, proc_error
from tests.file_kinds import full_disk, tmpfs
from tests.harness import ROOT, TINY_ARGS, env, run_args
from tests.test_eval_sample_export import make_checkpoint
from tests.test_prepare_bad_input import docs_dir, prepare


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs: one tiny checkpoint (1.8 MB) fits, a second does not."""
    with tmpfs(tmp_path / "mnt", 3 * 2**20) as mnt:
        yield mnt


@pytest.mark.parametrize("background", ["false", "true"])
def test_a_full_disk_during_a_checkpoint_is_one_line(small_disk, tiny_data, background):
    run = small_disk / "run"
    args = ["--data.path", str(tiny_data), "--log.out_dir", str(run), *TINY_ARGS,
            "--train.max_steps", "3", "--checkpoint.every", "1", "--checkpoint.keep", "5",
            "--eval.every", "0", "--checkpoint.async_save", background]
    proc = subprocess.run([sys.executable, "-m", "lmforge.launch.cli", "train", *args], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=300)
    last_error(proc, f"no space left on device writing {run}/checkpoints/step_00000002 (free ",
               "MB, a checkpoint needs ~", "the last complete checkpoint is step_00000001")
    assert sorted(p.name for p in Path(run, "checkpoints").iterdir()) == ["step_00000001"]


def lmforge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.launch.cli", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)


def files_of(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_full_disk_during_a_synchronous_muon_checkpoint_is_one_line(tiny_data, tmp_path):
    with tmpfs(tmp_path / "mnt", 1 << 20) as mnt:  # less than one checkpoint
        proc = lmforge("train", *run_args(tiny_data, mnt / "run", "--optim.name", "muon",
                                          "--checkpoint.async_save", "false", "--eval.every", "0",
                                          "--train.max_steps", "2"))
        last_error(proc, "no space left on device writing", "a checkpoint needs ~",
                   "no checkpoint of this run is complete")
        assert not list((mnt / "run" / "checkpoints").iterdir())


@pytest.mark.parametrize("disk", ["read_only", "full"])
def test_an_unwritable_or_full_run_directory_is_one_line(disk, tiny_data, tmp_path):
    with tmpfs(tmp_path / "mnt", 8 << 10) as mnt:  # two pages: the lock's, then train.log's
        if disk == "read_only":
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        proc = lmforge("train", *run_args(tiny_data, mnt / "run", "--train.max_steps", "2"))
        last_error(proc, "cannot write", "Read-only file system" if disk == "read_only"
                   else "No space left on device")
        assert not RunDir(mnt / "run").lock.exists()


def test_an_export_that_fills_its_disk_is_one_line_and_keeps_the_previous_one(tiny_data, tmp_path):
    run = tmp_path / "run"
    trained = lmforge("train", "--data.path", str(tiny_data), "--log.out_dir", str(run),
                      *TINY_ARGS, "--train.max_steps", "2", "--eval.every", "0")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert lmforge("export", "--ckpt", str(run), "--hf", str(tmp_path / "ref")).returncode == 0
    size = sum(len(b) for b in files_of(tmp_path / "ref").values())
    with tmpfs(tmp_path / "mnt", size * 3 // 2) as disk:  # one export fits, two do not
        out = disk / "hf"
        assert lmforge("export", "--ckpt", str(run), "--hf", str(out)).returncode == 0
        first = files_of(out)
        step = run / "checkpoints" / "step_00000002"
        proc = lmforge("export", "--ckpt", str(step), "--hf", str(out))
        last_error(proc, f"no space left on device writing the export {out} (free ",
                   "nothing was replaced")
        assert files_of(out) == first and [p.name for p in disk.iterdir()] == ["hf"]


def test_a_prepare_that_fills_its_disk_is_one_line_and_resumes_once_there_is_room(tmp_path):
    texts = [f"document {i}: " + "some words of text " * 100 for i in range(60)]  # ~115k tokens
    src = docs_dir(tmp_path, *texts)
    whole = tmp_path / "whole"
    argv = prepare(tmp_path, src, "--shard-tokens", "4000", "--val-fraction", "0.1",
                   out=str(whole))
    assert lmforge(*argv).returncode == 0
    with tmpfs(tmp_path / "mnt", 96 * 1024) as disk:  # the byte vocabulary and some shards
        out = disk / "data"
        argv = [*argv[:argv.index("--out") + 1], str(out), *argv[argv.index("--out") + 2:]]
        line = last_error(lmforge(*argv), f"no space left on device writing {out} (free ",
                          "then run the same command: it resumes")
        kept = int(line.split(" MB, ")[1].split()[0])
        assert kept > 0 and not [p for p in out.iterdir() if p.name.endswith(".tmp")]
        subprocess.run(["mount", "-o", f"remount,size={4 * 2**20}", str(disk)], check=True)
        assert lmforge(*argv).returncode == 0
        shards = sorted(p.name for p in whole.iterdir() if p.suffix in (".bin", ".idx"))
        assert [(out / n).read_bytes() for n in shards] == [(whole / n).read_bytes() for n in shards]


@pytest.fixture
def read_only(tmp_path):
    with tmpfs(tmp_path / "ro", 1 << 20, "ro") as path:
        yield path


@pytest.fixture(scope="module")
def ckpt(tiny_data, tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "final", tiny_data)


def test_prepare_into_a_read_only_path_is_one_line(read_only, tmp_path):
    proc_error(lmforge(*prepare(tmp_path, docs_dir(tmp_path, "text"), out=str(read_only / "data"))),
               "not writable")


def test_export_into_a_read_only_path_is_one_line(ckpt, read_only):
    proc_error(lmforge("export", "--ckpt", str(ckpt), "--hf", str(read_only / "hf")),
               "not writable")


def test_eval_json_into_a_read_only_path_is_said_before_evaluating(ckpt, tiny_data, read_only):
    proc = lmforge("eval", "--ckpt", str(ckpt), "--data", str(tiny_data), "--json",
                   str(read_only / "e.json"))
    proc_error(proc, "--json", "not writable")
    assert "perplexity" not in proc.stdout


def test_eval_json_on_a_full_disk_is_one_line_and_leaves_nothing(ckpt, tiny_data, tmp_path):
    with full_disk(tmp_path / "full") as full:
        proc = lmforge("eval", "--ckpt", str(ckpt), "--data", str(tiny_data), "--json",
                       str(full / "e.json"))
        proc_error(proc, "--json", "e.json")
        assert sorted(p.name for p in full.iterdir()) == ["filler"]
