"""`lmforge prepare` and `inspect` on damaged or unusual input (a corrupt or truncated source
file, a bad table record, an inconsistent vocabulary, a damaged manifest, a resume over changed
sources, parts of different runs): one `error:` line and exit 2 for a mistake, never a traceback
or silently wrong data, nothing outside the output directory touched, and the right tokens for
valid input."""

from __future__ import annotations

import base64
import bz2
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lmforge.data_prep import shards as S
from lmforge.launch.cli import main as lmforge
from tests.errors import cli_error

ENV_CMD = [sys.executable, "-m", "lmforge.launch.cli"]


def byte_vocab(path: Path, extra: dict[bytes, int] | None = None) -> Path:
    """A .tiktoken file of the 256 byte tokens (ranks 0-255) plus `extra`."""
    ranks = {bytes([i]): i for i in range(256)} | (extra or {})
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path


def docs_dir(tmp_path: Path, *texts: str) -> Path:
    d = tmp_path / "docs"
    d.mkdir(exist_ok=True)
    for i, text in enumerate(texts):
        (d / f"d{i}.txt").write_text(text)
    return d


def prepare(tmp_path: Path, source: Path | str, *args: str, out: str = "out") -> list[str]:
    return ["prepare", "--source", str(source), "--tokenizer",
            str(byte_vocab(tmp_path / "bytes.tiktoken")), "--out", str(tmp_path / out), "--quiet",
            *args]


def damaged(tmp_path: Path, kind: str) -> Path:
    good = b'{"text": "hello world"}\n' * 50
    if kind == "json array":
        path = tmp_path / "a.json"
        path.write_text('[{"text": "x1"}, {"text": "x2"}')  # no closing bracket
    elif kind == "gzip garbage":
        path = tmp_path / "a.jsonl.gz"
        path.write_bytes(bytes(range(256)) * 2)
    elif kind == "gzip truncated":
        path = tmp_path / "a.jsonl.gz"
        path.write_bytes(gzip.compress(good)[:30])
    elif kind == "bz2 truncated":
        path = tmp_path / "a.jsonl.bz2"
        data = bz2.compress(good)
        path.write_bytes(data[: len(data) // 2])
    else:  # "xz garbage"
        path = tmp_path / "a.txt.xz"
        path.write_bytes(b"\xfd7zXZ\x00" + bytes(200))
    return path


@pytest.mark.parametrize("kind", ["json array", "gzip garbage", "gzip truncated", "bz2 truncated",
                                  "xz garbage"])
def test_a_damaged_file_is_one_error_naming_it(tmp_path, capsys, kind):
    path = damaged(tmp_path, kind)
    cli_error(capsys, prepare(tmp_path, path), path.name)
    assert not (tmp_path / "out").exists()


def test_a_bad_table_record_is_named_by_its_place_in_the_file(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [f"row {i}" for i in range(2000)]
    rows[1499] = None  # record 1500, in the second 1024-row batch
    pq.write_table(pa.table({"text": rows}), tmp_path / "t.parquet")
    cli_error(capsys, prepare(tmp_path, tmp_path / "t.parquet"), "record 1500 of")


def test_a_vocabulary_with_a_gap_puts_end_of_text_past_every_rank(tmp_path, capsys):
    """Ranks 0-255 and 257: <|endoftext|> = 258, not len(ranks) = 257, which is "ab"'s."""
    vocab = byte_vocab(tmp_path / "gap.tiktoken", {b"ab": 257})
    out = tmp_path / "out"
    argv = ["prepare", "--source", str(docs_dir(tmp_path, "xx ab", "zz")), "--tokenizer",
            str(vocab), "--out", str(out), "--val-fraction", "0", "--quiet"]
    assert lmforge(argv) == 0
    m = S.load_manifest(out)
    tokens = np.asarray(S.open_shard(m.shard_paths("train")[0])).tolist()
    assert m.eot_id == 258 and tokens == [258, *b"xx ", 257, 258, *b"zz"]
    assert tokens.count(m.eot_id) == m.num_documents("train") == 2


@pytest.mark.parametrize("case", ["duplicate rank", "missing bytes", "sidecar list",
                                  "special clash"])
def test_an_inconsistent_vocabulary_is_refused(tmp_path, capsys, case):
    path = tmp_path / "v.tiktoken"
    if case == "duplicate rank":
        byte_vocab(path, {b"ab": 5})
    elif case == "missing bytes":
        path.write_text("YQ== 0\nYg== 1\n")  # "a" and "b" only: tiktoken panics on "c"
    else:
        byte_vocab(path, {b"ab": 256})
        special = [1] if case == "sidecar list" else {"special_tokens": {"<|endoftext|>": 256}}
        (tmp_path / "v.tiktoken.json").write_text(json.dumps(special))
    argv = ["prepare", "--source", str(docs_dir(tmp_path, "abc")), "--tokenizer", str(path),
            "--out", str(tmp_path / "out"), "--quiet"]
    named = {"special clash": "<|endoftext|> has the id of a mergeable token",
             "sidecar list": "v.tiktoken.json"}.get(case, "v.tiktoken")
    cli_error(capsys, argv, named)
    assert not (tmp_path / "out").exists()


def test_out_must_be_a_directory_and_flags_are_given_once(tmp_path, capsys):
    src = docs_dir(tmp_path, "some text")
    (tmp_path / "afile").write_text("keep me")
    cli_error(capsys, prepare(tmp_path, src, out="afile"), "afile is a file")
    cli_error(capsys, prepare(tmp_path, src, out="afile/sub"), "afile is a file")
    assert (tmp_path / "afile").read_text() == "keep me"
    cli_error(capsys, prepare(tmp_path, ""), "--source is empty")
    cli_error(capsys, prepare(tmp_path, src, "--source", str(src)), "--source is given twice")
    assert not (tmp_path / "out").exists()


def test_a_bpe_the_corpus_cannot_fill_says_so_and_is_named_by_its_size(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["prepare", "--source", str(docs_dir(tmp_path, "xx ab yy", "zz")), "--tokenizer",
            "bpe:5000", "--out", str(out), "--val-fraction", "0", "--quiet"]
    assert lmforge(argv) == 0
    m = S.load_manifest(out)
    assert m.vocab_size < 5000 and m.tokenizer["name"] == f"bpe{m.vocab_size}"
    assert f"bpe:5000 trained {m.vocab_size:,} ids, not 5,000" in capsys.readouterr().err


@pytest.mark.parametrize("edit", ["not an object", "vocab text", "tokenizer null", "stats null",
                                  "shard tokens text", "eot past vocab"])
def test_a_damaged_manifest_is_one_error(tmp_path, capsys, edit):
    assert lmforge(prepare(tmp_path, docs_dir(tmp_path, "some text"), "--val-fraction", "0")) == 0
    path = tmp_path / "out" / S.MANIFEST_NAME
    d = json.loads(path.read_text())
    if edit == "not an object":
        d = [d]
    elif edit == "vocab text":
        d["vocab_size"] = "big"
    elif edit == "tokenizer null":
        d["tokenizer"] = None
    elif edit == "stats null":
        d["stats"] = None
    elif edit == "shard tokens text":
        d["shards"][0]["tokens"] = "x"
    else:
        d["eot_id"] = d["vocab_size"]
    path.write_text(json.dumps(d))
    cli_error(capsys, ["inspect", str(tmp_path / "out")], "manifest.json")


def interrupted(tmp_path: Path, capsys) -> tuple[Path, list[str]]:
    """A prepare whose shards are all finished but whose manifest was never written."""
    argv = prepare(tmp_path, docs_dir(tmp_path, "first text", "second text"), "--val-fraction", "0")
    assert lmforge(argv) == 0
    capsys.readouterr()
    (tmp_path / "out" / S.MANIFEST_NAME).unlink()
    return tmp_path / "out" / ".prepare_state.json", argv


def test_a_resume_state_naming_a_file_outside_is_refused(tmp_path, capsys):
    state, argv = interrupted(tmp_path, capsys)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    d = json.loads(state.read_text())
    d["shards"][0]["file"] = "../victim.txt"
    state.write_text(json.dumps(d))
    cli_error(capsys, argv, "outside its directory")
    assert victim.read_text() == "precious"
    state.write_text("[1, 2]")
    cli_error(capsys, argv, "not a prepare's resume state")


def test_resuming_over_changed_source_files_is_refused(tmp_path, capsys):
    state, argv = interrupted(tmp_path, capsys)
    shard = tmp_path / "out" / "train_000000.bin"
    before = shard.read_bytes()
    (tmp_path / "docs" / "d1.txt").write_text("another corpus altogether")
    cli_error(capsys, argv, "the files of --source changed")
    assert shard.read_bytes() == before and not (tmp_path / "out" / S.MANIFEST_NAME).exists()


def test_inspect_rows_mark_real_document_starts_only(tmp_path, capsys):
    texts = ["one <|endoftext|> two " * 20, "three <|endoftext|> four " * 20]  # literal text
    assert lmforge(prepare(tmp_path, docs_dir(tmp_path, *texts), "--val-fraction", "0")) == 0
    capsys.readouterr()
    for align in ("doc", "stream"):
        assert lmforge(["inspect", str(tmp_path / "out"), "--rows", "4", "--seq-len", "100",
                        "--align", align]) == 0
        out = capsys.readouterr().out
        for row in out.split("--- row ")[1:]:
            title, eots, text = row.split("\n", 2)
            positions = eots.removeprefix("(document starts, EOT at positions: ").rstrip(")")
            n_eot = 0 if positions == "none" else len(positions.split())
            assert text.count("<|doc|>") == n_eot, row  # a document's own "<|endoftext|>" is text
            assert "<|endoftext|>" in text, row
            assert ("starts at a document start" in title) == positions.startswith("0"), row
    assert "starts mid-document" in out  # stream rows are cut anywhere


def test_a_closed_pipe_ends_inspect_quietly(tmp_path, capsys):
    assert lmforge(prepare(tmp_path, docs_dir(tmp_path, "some text " * 50))) == 0
    proc = subprocess.Popen([*ENV_CMD, "inspect", str(tmp_path / "out"), "--tokens", "400"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before anything is written (`| head -0`)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and not err.strip(), err


def test_resuming_over_a_changed_local_hf_dataset_is_refused(tmp_path, capsys, monkeypatch):
    """hf:DIR reads a local directory of data files: a resume checks them like a file source's."""
    pytest.importorskip("datasets", reason="hf: sources need the datasets package")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "hfdata"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 40}) + "\n"
                                              for i in range(30)))
    argv = prepare(tmp_path, f"hf:{data}", "--val-fraction", "0", "--shard-tokens", "2000")
    assert lmforge(argv) == 0
    out = tmp_path / "out"
    (out / S.MANIFEST_NAME).unlink()  # as if killed after its last shard
    shards = {p.name: p.read_bytes() for p in out.glob("*.bin")}
    assert len(shards) > 1
    (data / "train.jsonl").write_text(json.dumps({"text": "another corpus altogether"}) + "\n")
    cli_error(capsys, argv, "the files of --source changed")
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == shards
    assert not (out / S.MANIFEST_NAME).exists()


@pytest.mark.parametrize("change", ["source edited between parts", "another split rule"])
def test_parts_of_different_runs_are_not_merged(tmp_path, capsys, change):
    src = docs_dir(tmp_path, *(f"text number {i} " * 30 for i in range(12)))
    for i in (1, 2):
        if i == 2 and change == "source edited between parts":
            (src / "d3.txt").write_text("an edit made after part 1 was prepared")
        assert lmforge(prepare(tmp_path, src, "--part", f"{i}/2", out=f"p{i}")) == 0
    if change == "another split rule":  # as a part prepared by another lmforge would record
        manifest = tmp_path / "p2" / S.MANIFEST_NAME
        d = json.loads(manifest.read_text())
        d["stats"]["val_threshold"] += 1
        manifest.write_text(json.dumps(d))
    capsys.readouterr()
    merged = tmp_path / "merged"
    line = cli_error(capsys, ["prepare", "--out", str(merged), "--merge", str(tmp_path / "p1"),
                              str(tmp_path / "p2")], "are not parts of one run")
    assert ("files of --source differ" in line) == (change == "source edited between parts")
    assert not merged.exists()


def test_a_fifo_source_is_refused_unopened_and_skipped_inside_a_directory(tmp_path):
    """A corpus's links are followed (it is the user's), but a FIFO is never opened: the open
    would wait for a writer that never comes."""
    d = docs_dir(tmp_path, "hello world " * 20)
    os.mkfifo(d / "pipe.txt")
    res = subprocess.run([*ENV_CMD, *prepare(tmp_path, d / "pipe.txt")], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "pipe.txt is a FIFO; give a regular file" in res.stderr
    res = subprocess.run([*ENV_CMD, *prepare(tmp_path, d)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_a_config_named_through_a_link_is_read_and_a_fifo_refused(tmp_path):
    from lmforge.pipeline.config import load_config

    toml = tmp_path / "mine.toml"
    toml.write_text("[train]\nmax_steps = 7\n")
    (tmp_path / "link.toml").symlink_to(toml)
    assert load_config(tmp_path / "link.toml").train.max_steps == 7
    os.mkfifo(tmp_path / "fifo.toml")  # in a subprocess: an open of it would wait
    res = subprocess.run([*ENV_CMD, "train", "--config", str(tmp_path / "fifo.toml"), "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "fifo.toml is a FIFO" in res.stderr.splitlines()[-1]
