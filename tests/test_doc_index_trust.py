"""A shard's document index (.idx) is checked when it is loaded: its sha256 against the manifest,
every offset within its shard (a uint64 never wraps to a negative int64) and at an EOT token.
Each case a real prepared dataset with its index edited, through `lmforge train` (align = doc)
and `lmforge prepare --verify`: one `error:` line, exit 2, no checkpoint written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.runs import ROOT, TINY_ARGS, env
from lmforge.data_prep.shards import index_path, write_doc_index
from tests.errors import cli_error, last_error


def train(data: Path, run: Path) -> subprocess.CompletedProcess:
    args = ["--data.path", str(data), "--log.out_dir", str(run), *TINY_ARGS,
            "--data.align", "doc", "--train.max_steps", "2", "--eval.every", "0"]
    return subprocess.run([sys.executable, "-m", "lmforge.launch.cli", "train", *args], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=300)


def edit_index(data: Path, edit, manifest: str) -> Path:
    """Rewrite the first train shard's index with `edit(offsets)`; the manifest's record of it:
    "kept" (now wrong), "updated" (a dataset consistent with the edit) or "dropped" (as data
    prepared before the index sha256 was recorded)."""
    m = json.loads((data / "manifest.json").read_text())
    info = next(s for s in m["shards"] if s["split"] == "train")
    shard = data / info["file"]
    raw = index_path(shard).read_bytes()
    offsets = np.frombuffer(raw, "<u8", offset=32).copy()
    edit(offsets)
    sha = write_doc_index(shard, offsets, info["tokens"])
    for s in m["shards"]:
        if manifest == "updated" and s is info:
            s["index_sha256"] = sha
        elif manifest == "dropped":
            s.pop("index_sha256", None)
    (data / "manifest.json").write_text(json.dumps(m))
    return shard


@pytest.fixture
def data(tiny_data, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_data, tmp_path / "data"))


def shift(offsets: np.ndarray) -> None:
    offsets[1:] += 3  # in range and increasing: rows would start 3 tokens into documents


def wrap(offsets: np.ndarray) -> None:
    offsets[0] = 2**64 - 1  # -1 as int64


@pytest.mark.parametrize(("edit", "manifest", "message"), [
    (shift, "kept", "fails its sha256 checksum"),
    (shift, "updated", "not end-of-text"),
    (shift, "dropped", "not end-of-text"),
    (wrap, "updated", "not increasing within its shard's"),
    (wrap, "dropped", "not increasing within its shard's"),
])
def test_a_bad_document_index_is_refused_at_load(data, tmp_path, capsys, edit, manifest, message):
    shard = edit_index(data, edit, manifest)
    last_error(train(data, tmp_path / "run"), index_path(shard).name, message)
    assert not list((tmp_path / "run").glob("checkpoints/*"))
    cli_error(capsys, ["prepare", "--verify", str(data)], message)


def test_a_manifest_without_index_checksums_still_trains(data, tmp_path):
    """Data prepared before the index sha256 was recorded: read, its index checked by its
    tokens."""
    edit_index(data, lambda offsets: None, "dropped")
    proc = train(data, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_prepare_records_each_index_checksum(tiny_data):
    from lmforge.data_prep.shards import file_sha256, load_manifest

    m = load_manifest(tiny_data)
    assert m.shards and all(s.index_sha256 == file_sha256(index_path(tiny_data / s.file))
                            for s in m.shards)
