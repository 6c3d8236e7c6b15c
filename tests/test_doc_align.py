"""data.align = doc: rows that start at document starts, on shards whose documents run over shard
boundaries; the document index (written by prepare with its sha256 in the manifest, built once
when absent, and checked when it is loaded: its sha256, every offset within its shard and at an
EOT token, through `lmforge train` and `prepare --verify`); `lmforge inspect --rows --json` equals
the trainer's loader; the mixture's bad inputs, one line and exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data_prep.safe_files import file_sha256
from lmforge.data_prep.shards import (
    FORMAT_VERSION,
    Manifest,
    ShardError,
    ShardInfo,
    index_path,
    load_manifest,
    open_shard,
    read_doc_index,
    shard_name,
    verify,
    write_doc_index,
    write_shard,
)
from lmforge.model.model import IGNORE_INDEX
from lmforge.pipeline.data.loader import Source, TokenWindows, TrainLoader
from lmforge.pipeline.data.rows import DocRows
from tests.errors import cli_error, last_error
from tests.harness import ROOT, TINY_ARGS, env

EOT, VOCAB, SEQ = 0, 1000, 16


def docs_over_shards(path, seed=0):
    """Documents [EOT, t...] of random lengths (1 to 3 rows long) cut into shards at arbitrary
    points, so that documents cross shard boundaries (the second shard does not open with EOT)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 3 * (SEQ + 1), size=60)
    stream = np.concatenate([np.concatenate([[EOT], rng.integers(1, VOCAB, n - 1)]) for n in lengths])
    cuts = [0, 157, 158, 611, len(stream)]
    infos = []
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        name = shard_name("train", k)
        sha = write_shard(path / name, stream[a:b], VOCAB)
        infos.append(ShardInfo(name, "train", b - a, 1, sha))
    Manifest(version=FORMAT_VERSION, vocab_size=VOCAB, eot_id=EOT, tokenizer={}, source="test",
             args={}, shards=infos).save(path)
    return stream, lengths


def test_every_row_but_continuations_starts_with_eot(tmp_path):
    stream, lengths = docs_over_shards(tmp_path)
    rows = DocRows(TokenWindows(tmp_path, "train", SEQ, VOCAB))
    w, used = rows.read(range(rows.num_rows))
    cont = rows.continues(range(rows.num_rows))
    assert (w[~cont, 0] == EOT).all() and (w[cont, 0] != EOT).all()
    # Every next-token pair of the stream is trained once: the pairs of all rows (padding out).
    pairs = sorted((int(a), int(b)) for r, n in zip(w, used, strict=True)
                   for a, b in zip(r[:n - 1], r[1:n], strict=True) if b != EOT)
    assert pairs == sorted((int(a), int(b)) for a, b in zip(stream[:-1], stream[1:], strict=True)
                           if b != EOT)
    # Only a document longer than a row has continuation rows.
    assert cont.sum() == sum((n - 2) // SEQ for n in lengths if n > SEQ + 1)
    assert (used[cont] == SEQ + 1).all()  # continuation rows are full
    assert 0 < rows.padding < 0.05


def test_index_built_once_when_absent_and_validated(tmp_path):
    docs_over_shards(tmp_path)
    shard = tmp_path / shard_name("train", 0)
    assert not index_path(shard).exists()  # written by hand, as by a prepare before the index
    first = DocRows(TokenWindows(tmp_path, "train", SEQ, VOCAB))
    assert index_path(shard).is_file()
    again = DocRows(TokenWindows(tmp_path, "train", SEQ, VOCAB))  # read, not rebuilt
    assert (first.seg_start == again.seg_start).all()
    raw = bytearray(index_path(shard).read_bytes())
    raw[-1] ^= 0x7F
    index_path(shard).write_bytes(bytes(raw))
    with pytest.raises(ShardError, match="document index"):
        read_doc_index(shard, 157)


def test_prepare_writes_the_index_and_verify_checks_it(tiny_data, tmp_path):
    m = load_manifest(tiny_data)
    for info in m.shards:
        shard = tiny_data / info.file
        offsets = read_doc_index(shard, info.tokens)
        assert info.index_sha256 == file_sha256(index_path(shard))
        assert len(offsets) == info.documents
        assert (np.flatnonzero(np.asarray(open_shard(shard)) == m.eot_id) == offsets).all()
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    shard = data / m.shards[0].file
    offsets = read_doc_index(shard, m.shards[0].tokens)
    offsets[1] += 1  # off its EOT, still increasing
    write_doc_index(shard, offsets, m.shards[0].tokens)
    with pytest.raises(ShardError, match="fails its sha256"):  # the manifest records its sha256
        verify(data)


def test_loader_rows_carry_padding_as_ignored_targets(tmp_path):
    docs_over_shards(tmp_path)
    rows = DocRows(TokenWindows(tmp_path, "train", SEQ, VOCAB))
    loader = TrainLoader([Source("t", rows)], 4, 2, 0, 1, seed=0)
    for _ in range(rows.num_rows // 8):
        step = loader.next_step()
        loader.step -= 1  # the same step again, through next_micro_batches
        for c in loader.cursors.values():
            c["position"] -= 8
        batches = loader.next_micro_batches()
        y = torch.cat([y for _, y in batches])
        assert int((y != IGNORE_INDEX).sum()) == loader.step_targets == int((step.used - 1).sum())
        assert ((y == IGNORE_INDEX).sum(1).numpy() == SEQ + 1 - step.used).all()


def test_inspect_json_equals_the_trainers_loader(tiny_data, tmp_path):
    from lmforge.launch.train import parse_args
    from lmforge.pipeline.config import load_config
    from lmforge.pipeline.parallel.distributed import DistInfo
    from lmforge.pipeline.train import Trainer

    other = tmp_path / "other"
    shutil.copytree(tiny_data, other)
    mix = f"{tiny_data}:0.6,{other}:0.4"
    args = [*TINY_ARGS, "--data.mix", mix, "--data.align", "doc", "--log.out_dir",
            str(tmp_path / "run")]
    cfg = load_config(None, parse_args(args)[1])
    trainer = Trainer(cfg, DistInfo(rank=0, world_size=1, local_rank=0,
                                    device=torch.device("cpu")))
    want = []
    for x, y in trainer.data.loader.next_micro_batches():
        for xr, yr in zip(x.tolist(), y.tolist(), strict=True):
            want.append([xr[0]] + [t for t in yr if t != IGNORE_INDEX])
    out = subprocess.run([sys.executable, "-m", "lmforge.launch.cli", "inspect", str(tiny_data),
                          "--rows", "6", "--seq-len", "64", "--align", "doc", "--mix", mix,
                          "--seed", str(cfg.train.seed), "--json"],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [r["ids"] for r in rows] == want[:6]
    assert {r["source"] for r in rows} <= {"pystdlib", "other"}
    assert all(r["continues"] or r["ids"][0] == trainer.data.tokenizer.eot_token for r in rows)


@pytest.mark.parametrize("extra,message", [
    (["--data.mix", "{a}:0,{a}:1"], "weight"),
    (["--data.mix", "{a}:nan,{b}:1"], "weight"),
    (["--data.sources", '[{{path = "{a}"}}]'], "weight"),
    (["--data.mix", "{a}:1,{missing}:1"], "does not exist"),
    (["--data.mix", "{a}:1,{unprepared}:1"], "no manifest.json"),
    (["--data.mix", "{a}:1,{foreign}:1"], "different tokenizers"),
    (["--data.path", "{a}", "--data.sources", '[{{path = "{b}", weight = 1}}]'], "both set"),
    (["--data.mix", "{a}:1", "--data.phases",
      '[{{from_step = 0.5, sources = [{{path = "{a}", weight = 1}}]}}, '
      '{{from_step = 0.25, sources = [{{path = "{a}", weight = 1}}]}}]'], "previous"),
])
def test_bad_mixtures_are_one_line_exit_2(tiny_data, tmp_path, extra, message):
    foreign = tmp_path / "foreign"
    if not foreign.exists():
        shutil.copytree(tiny_data, foreign)
        m = json.loads((foreign / "manifest.json").read_text())
        m["tokenizer"]["sha256"] = "0" * 64  # another vocabulary file
        (foreign / "manifest.json").write_text(json.dumps(m))
        (tmp_path / "unprepared").mkdir()
    paths = {"a": tiny_data, "b": foreign, "missing": tmp_path / "nope",
             "unprepared": tmp_path / "unprepared", "foreign": foreign}
    args = [a.format(**paths) for a in extra]
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "lmforge.launch.cli", "train", *TINY_ARGS,
                          "--log.out_dir", str(run_dir), *args],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (run_dir / "checkpoints").exists()


def test_prepare_and_inspect_start_without_torch(tmp_path, vocab_tiktoken):
    """`lmforge prepare`, through the CLI's entry point and its error handling, never imports
    torch (seconds of start-up, bench/prepare_bench.py's fixed cost); inspect --rows imports the
    trainer's loader only when asked, with its default seed."""
    from lmforge.launch.prepare import ROWS_SEED
    from lmforge.pipeline.config import TrainConfig

    assert ROWS_SEED == TrainConfig.seed
    code = ("import sys; from lmforge.launch.cli import main; "
            "rc = main(['prepare', '--out', sys.argv[1], '--tokenizer', sys.argv[2], "
            "'--max-docs', '2', '--quiet']); print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d"), str(vocab_tiktoken)],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.split()[-2:] == ["0", "False"], out.stderr


# ---- a document index that does not match its shard is refused at load ------------------------


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
