"""Nothing in a checkpoint sizes lmforge's memory: a crafted DCP index declaring a 600M-parameter
model over a 64-byte file, or a compressed (transformed) entry, is one `error:` line before a
model is built, and eval / sample / export / --resume of it peak no higher than of a genuine
tiny checkpoint (ru_maxrss of the CLI's own process)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from lmforge.model import ModelConfig
from lmforge.pipeline.parallel.materialize import meta_gpt
from tests import test_checkpoint_trust as trust
from tests.errors import cli_error, last_error, proc_error
from tests.harness import ROOT, TINY_ARGS, env
from tests.test_checkpoint_trust import (
    inference_commands,
    read_metadata,
    storage_of,
    write_metadata,
)

trained, step = trust.trained, trust.step  # its fixtures: a finished 2-step run, a copy of its step 2

MB = 1 << 20
BIG = {"d_model": 2048, "n_layer": 8, "n_head": 16, "n_kv_head": 16, "d_mlp": None}


def craft_big(ckpt: Path, disjoint: bool) -> None:
    """meta.json and .metadata both declare a d_model 2048, 8-layer model; every tensor is stored
    in a 64-byte __0_0.distcp (at offset 0, or, `disjoint`, at offsets past its end)."""
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["model"].update(BIG)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    md = read_metadata(ckpt)
    sd = meta_gpt(ModelConfig.from_dict(meta["model"])).state_dict()
    md.state_dict_metadata = {
        f"model.{k}": TensorStorageMetadata(TensorProperties(v.dtype), v.shape,
                                            [ChunkStorageMetadata((0,) * v.dim(), v.shape)])
        for k, v in sd.items()}
    md.storage_data = {MetadataIndex(f"model.{k}", (0,) * v.dim()):
                       _StorageInfo("__0_0.distcp", 64 * i if disjoint else 0, 64)
                       for i, (k, v) in enumerate(sd.items())}
    md.planner_data = {}
    write_metadata(ckpt, md)
    for f in ckpt.glob("__*.distcp"):
        f.unlink()
    (ckpt / "__0_0.distcp").write_bytes(b"\0" * 64)


# Linux carries a process's peak RSS across fork + exec: a CLI started from this (large) pytest
# process would report pytest's peak. So a small launcher starts it and reports its child's peak.
_LAUNCHER = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
             "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN)"
             ".ru_maxrss)); sys.exit(rc)")


def measured(argv: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    """`lmforge ARGV` in a subprocess: (the finished process, its peak resident MB)."""
    peak = tmp_path / "peak_kb"
    proc = subprocess.run([sys.executable, "-c", _LAUNCHER, str(peak), sys.executable, "-m",
                           "lmforge.launch.cli", *argv], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)
    return proc, int(peak.read_text()) / 1024


def resume_argv(run: Path, data: Path) -> list[str]:
    return ["train", "--data.path", str(data), "--log.out_dir", str(run), *TINY_ARGS,
            "--train.max_steps", "3", "--checkpoint.resume", "auto", "--eval.every", "0"]


@pytest.mark.parametrize("disjoint", [False, True])
def test_a_big_model_over_a_64_byte_file_is_refused_before_it_is_built(step, tiny_data, tmp_path,
                                                                      capsys, disjoint):
    craft_big(step, disjoint)
    why = "ends at byte" if disjoint else "overlaps"
    for argv in inference_commands(step, tiny_data, tmp_path / "hf"):
        cli_error(capsys, argv, "refusing to load", why)
    assert not (tmp_path / "hf").exists()


def test_a_tensor_larger_than_its_storage_is_refused(step, tiny_data, capsys):
    md = read_metadata(step)
    index, info = storage_of(md, "model.norm_f.weight")  # 64 floats: 256 bytes of data
    md.storage_data[index] = _StorageInfo(info.relative_path, info.offset, 200)
    write_metadata(step, md)
    cli_error(capsys, ["sample", "--ckpt", str(step), "--prompt", "x"], "model.norm_f.weight",
              "needs 256 bytes")


@pytest.mark.parametrize("field", [("transform_descriptors", ["stream.zstd/1"]),
                                   ("extra_field", 1)])
def test_a_storage_transform_is_refused_before_any_read(step, tiny_data, capsys, field):
    md = read_metadata(step)
    for info in md.storage_data.values():
        setattr(info, *field)
    write_metadata(step, md)
    cli_error(capsys, ["eval", "--ckpt", str(step), "--data", str(tiny_data)],
              "fields lmforge never writes", field[0])
    proc = subprocess.run([sys.executable, "-m", "lmforge.launch.cli",
                           *resume_argv(step.parents[1], tiny_data)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    last_error(proc, "fields lmforge never writes")


def test_a_crafted_checkpoint_costs_no_more_memory_than_a_genuine_one(trained, tiny_data,
                                                                      tmp_path):
    genuine = tmp_path / "genuine"
    shutil.copytree(trained / "checkpoints" / "step_00000002",
                    genuine / "checkpoints" / "step_00000002")
    crafted, resume = (Path(shutil.copytree(genuine, tmp_path / n)) for n in ("crafted", "resume"))
    craft_big(crafted / "checkpoints" / "step_00000002", disjoint=True)
    # --resume: the config is the genuine model's, so only the index lies
    craft_index_only(resume / "checkpoints" / "step_00000002")
    assert sum(f.stat().st_size for f in crafted.rglob("*distcp")) == 64
    peaks = {}
    for name, run in (("genuine", genuine), ("crafted", crafted)):
        commands = inference_commands(run, tiny_data, tmp_path / f"hf-{name}")
        train = resume_argv(run if name == "genuine" else resume, tiny_data)
        for argv in [*commands, train]:
            proc, peak = measured(argv, tmp_path)
            if name == "genuine":
                assert proc.returncode == 0, proc.stderr[-2000:]
            elif argv[0] == "train":
                last_error(proc, "refusing to load")
            else:
                proc_error(proc, "refusing to load")
            peaks[name, argv[0]] = peak
    print("peak resident MB:", peaks)
    for command in ("eval", "sample", "export", "train"):
        assert peaks["crafted", command] <= peaks["genuine", command] + 100, peaks
    assert not (tmp_path / "hf-crafted").exists()


def craft_index_only(ckpt: Path) -> None:
    """The genuine meta.json (so the resume's config matches it); every tensor of .metadata at
    disjoint 64-byte ranges of a 64-byte file."""
    md = read_metadata(ckpt)
    md.storage_data = {i: _StorageInfo("__0_0.distcp", 64 * n, 64)
                       for n, i in enumerate(md.storage_data)}
    write_metadata(ckpt, md)
    for f in ckpt.glob("__*.distcp"):
        f.unlink()
    (ckpt / "__0_0.distcp").write_bytes(b"\0" * 64)

