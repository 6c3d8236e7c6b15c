"""data_prep: token-exact round trips, worker-independent bytes, kill/resume, corruption, bad
input through the CLI, parts + merge, sources."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lmforge.data_prep import shards as S
from lmforge.data_prep.tokenizer import EOT, load_tokenizer, load_tokenizer_dir, token_byte_lengths
from lmforge.launch.prepare import main
from tests.conftest import VOCAB_IDS
from tests.errors import proc_error

ENV = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


LMFORGE = [sys.executable, "-m", "lmforge.launch.cli"]


def run_cli(*args: str, command: str = "prepare", timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*LMFORGE, command, *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def prep(out: Path, *args: str) -> S.Manifest:
    assert main(["--out", str(out), "--quiet", *args]) == 0
    return S.load_manifest(out)


def decoded_docs(m: S.Manifest, split: str) -> list[np.ndarray]:
    """The token lists of a split's documents, cut at EOT (which precedes every document)."""
    docs = []
    for path in m.shard_paths(split):
        toks = np.asarray(S.open_shard(path))
        assert toks[0] == m.eot_id, f"{path.name} does not start with EOT"
        starts = np.flatnonzero(toks == m.eot_id)
        docs += np.split(toks, starts[1:])
    return [d[1:] for d in docs]


def assert_round_trip(m: S.Manifest, texts: list[str]) -> None:
    """Every input document appears once, in input order within its split, encoded exactly."""
    enc = load_tokenizer_dir(m.data_dir / "tokenizer")
    got = {sp: [enc.decode(d.tolist()) for d in decoded_docs(m, sp)] for sp in S.SPLITS}
    val = set(got["val"])
    assert got["train"] == [t for t in texts if t not in val]
    assert got["val"] == [t for t in texts if t in val]
    for sp in S.SPLITS:
        assert len(got[sp]) == m.num_documents(sp)
        for d, text in zip(decoded_docs(m, sp), got[sp], strict=True):
            assert d.tolist() == enc.encode_ordinary(text)


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def varied_texts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["alpha", "béta", "γάμμα", "日本語", "emoji 🎉", "  spaces", "\ttab\n", "x=1;",
             EOT, "<|fim_prefix|>", "don't", "1234567"]
    return [f"doc {i}: " + " ".join(rng.choice(words, size=int(rng.integers(1, 60))))
            for i in range(n)]


def test_round_trip_tiktoken_file_several_shards(vocab_tiktoken, tmp_path):
    texts = varied_texts(300)
    src = write_jsonl(tmp_path / "c.jsonl", texts)
    m = prep(tmp_path / "out", "--source", str(src), "--tokenizer", str(vocab_tiktoken),
             "--shard-tokens", "2000", "--val-fraction", "0.2")
    assert len(m.shard_paths("train")) > 3 and m.num_documents("val") > 10
    # A file of N ranks and no sidecar: <|endoftext|> = N, after them.
    assert m.vocab_size == VOCAB_IDS + 1 and m.eot_id == VOCAB_IDS and m.dtype == "uint16"
    assert_round_trip(m, texts)
    lengths = token_byte_lengths(load_tokenizer_dir(tmp_path / "out/tokenizer"))
    assert lengths[m.eot_id] == 0 and lengths.shape == (m.vocab_size,)


def test_round_trip_trained_bpe(tmp_path):
    m = prep(tmp_path / "out", "--tokenizer", "bpe:600", "--max-docs", "60",
             "--shard-tokens", "30000", "--val-fraction", "0.1", "--bpe-sample-chars", "400000")
    assert m.vocab_size == 600 and m.eot_id == 599 and m.tokenizer["kind"] == "bpe"
    from lmforge.data_prep.sources import Source
    texts = [t for t in Source("builtin:pystdlib") if t][:60]
    assert_round_trip(m, texts)
    # the saved vocabulary is self-describing: a fresh load encodes the same
    assert load_tokenizer(str(tmp_path / "out/tokenizer")).encode_ordinary(texts[0]) == \
        decoded_docs(m, "train")[0].tolist()


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_workers_do_not_change_bytes(vocab_tiktoken, tmp_path):
    common = ["--tokenizer", str(vocab_tiktoken), "--max-docs", "250", "--shard-tokens", "100000",
              "--val-fraction", "0.05"]
    prep(tmp_path / "w1", *common, "--workers", "1")
    prep(tmp_path / "w2", *common, "--workers", "2")
    same_files(tmp_path / "w1", tmp_path / "w2")


def test_sigkill_then_resume_matches_uninterrupted(vocab_tiktoken, tmp_path):
    common = ["--tokenizer", str(vocab_tiktoken), "--max-docs", "900", "--shard-tokens", "20000",
              "--workers", "1", "--quiet"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_cli("--out", str(ref), *common).returncode == 0
    proc = subprocess.Popen([*LMFORGE, "prepare", "--out", str(out), *common],
                            env=ENV, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (out / "train_000001.bin").exists() and time.time() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (out / S.MANIFEST_NAME).exists(), "finished before the kill; test proves nothing"
    first = (out / "train_000000.bin").stat()
    r = run_cli("--out", str(out), *common)
    assert r.returncode == 0, r.stderr
    assert (out / "train_000000.bin").stat().st_mtime_ns == first.st_mtime_ns  # kept, not redone
    same_files(ref, out)
    mtimes = {p: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
    r = run_cli("--out", str(out), *common)  # finished: a no-op
    assert r.returncode == 0 and "nothing to do" in r.stderr
    assert mtimes == {p: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}


def test_corrupted_shard_caught(vocab_tiktoken, tmp_path):
    out = tmp_path / "out"
    m = prep(out, "--tokenizer", str(vocab_tiktoken), "--max-docs", "40", "--shard-tokens", "50000")
    path = m.shard_paths("train")[1]
    data = bytearray(path.read_bytes())
    data[S.HEADER_BYTES + 100] ^= 0xFF  # payload byte: only the checksum can see it
    path.write_bytes(bytes(data))
    r = run_cli("--verify", str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and path.name in r.stderr
    assert "checksum" in r.stderr
    with pytest.raises(S.ShardError, match="checksum"):
        S.verify(out)
    path.write_bytes(bytes(data[:-3]))  # truncated: open_shard itself refuses it
    with pytest.raises(S.ShardError, match=path.name):
        S.open_shard(path)
    path.write_bytes(b"garbage" + bytes(data[7:]))
    with pytest.raises(S.ShardError, match="magic"):
        S.open_shard(path)


def _fake_vocab(path: Path, n: int) -> Path:
    import base64
    toks = [bytes([i]) for i in range(256)]
    toks += [i.to_bytes(3, "big") for i in range(1 << 16, (1 << 16) + n - 256)]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(toks)))
    return path


def test_bad_inputs_one_line_nothing_written(tmp_path):
    out = tmp_path / "out"
    proc_error(run_cli("--source", str(tmp_path / "nope.jsonl"), "--out", str(out)),
                          "not found")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty/a.txt").write_text("")
    proc_error(run_cli("--source", str(tmp_path / "empty"), "--out", str(out)),
                          "no documents")
    src = write_jsonl(tmp_path / "c.jsonl", ["a", "b"], field="content")
    proc_error(run_cli("--source", str(src), "--out", str(out)), "--text-field")
    big = _fake_vocab(tmp_path / "big.tiktoken", 70_000)
    proc_error(run_cli("--source", str(src), "--text-field", "content", "--tokenizer",
                                  str(big), "--dtype", "uint16", "--out", str(out)), "uint16")
    assert not out.exists()
    # a directory that is not ours
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign/notes.txt").write_text("keep me")
    proc_error(run_cli("--source", str(src), "--text-field", "content", "--out",
                                  str(tmp_path / "foreign")), "not empty")
    assert sorted(os.listdir(tmp_path / "foreign")) == ["notes.txt"]


def test_big_vocab_uses_uint32(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", varied_texts(20))
    m = prep(tmp_path / "out", "--source", str(src), "--tokenizer",
             str(_fake_vocab(tmp_path / "big.tiktoken", 70_000)))
    assert m.dtype == "uint32" and S.open_shard(m.shard_paths("train")[0]).dtype == np.uint32


def test_other_arguments_on_prepared_dir_refused(vocab_tiktoken, tmp_path):
    out = tmp_path / "out"
    prep(out, "--tokenizer", str(vocab_tiktoken), "--max-docs", "20")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    r = run_cli("--tokenizer", str(vocab_tiktoken), "--max-docs", "21", "--out", str(out))
    proc_error(r, "max_docs")
    assert before == {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def test_invalid_utf8_replaced_and_counted(vocab_tiktoken, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src/a.txt").write_bytes(b"good \xff\xfe bytes")
    (tmp_path / "src/b.txt").write_bytes("fine \ufffd already".encode())
    m = prep(tmp_path / "out", "--source", str(tmp_path / "src"), "--tokenizer", str(vocab_tiktoken),
             "--val-fraction", "0")
    assert m.stats["replaced_chars"] == 2
    assert_round_trip(m, ["good \ufffd\ufffd bytes", "fine \ufffd already"])


def test_parts_merge_to_whole(vocab_tiktoken, tmp_path):
    texts = varied_texts(120)
    src = str(write_jsonl(tmp_path / "c.jsonl", texts))
    common = ["--source", src, "--tokenizer", str(vocab_tiktoken), "--shard-tokens", "1500",
              "--val-fraction", "0.1"]
    whole = prep(tmp_path / "whole", *common)
    for i in (1, 2, 3):
        prep(tmp_path / f"p{i}", *common, "--part", f"{i}/3")
    merged_dir = tmp_path / "merged"
    assert main(["--merge", *(str(tmp_path / f"p{i}") for i in (3, 1, 2)), "--out",
                 str(merged_dir)]) == 0
    S.verify(merged_dir)
    merged = S.load_manifest(merged_dir)
    for sp in S.SPLITS:
        assert merged.num_tokens(sp) == whole.num_tokens(sp)
        assert sorted(map(bytes, decoded_docs(merged, sp))) == \
            sorted(map(bytes, decoded_docs(whole, sp)))
    r = run_cli("--merge", str(tmp_path / "p1"), str(tmp_path / "p2"), "--out",
                str(tmp_path / "m2"))
    proc_error(r, "exactly once")


@pytest.mark.parametrize("kind", ["parquet", "arrow", "arrow-file", "hf", "lines", "jsonl.gz", "json"])
def test_sources(vocab_tiktoken, tmp_path, kind):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = varied_texts(30)
    table = pa.table({"text": texts})
    (tmp_path / "d").mkdir()
    if kind == "parquet":
        src = tmp_path / "d/c.parquet"
        pq.write_table(table, src, row_group_size=7)
    elif kind.startswith("arrow"):  # IPC stream (datasets' save_to_disk) or IPC file
        src = tmp_path / "d/c.arrow"
        with (pa.ipc.new_file if kind == "arrow-file" else pa.ipc.new_stream)(src, table.schema) as w:
            for i in range(0, len(texts), 7):  # several record batches
                w.write_table(table.slice(i, 7))
    elif kind == "hf":
        write_jsonl(tmp_path / "d/train.jsonl", texts)
        src = f"hf:{tmp_path / 'd'}@train"
    elif kind == "lines":
        texts = [t.replace("\n", " ").replace("\r", " ") for t in texts]
        src = tmp_path / "d/c.txt"
        src.write_text("\n\n".join(texts) + "\n")
    elif kind == "json":
        src = tmp_path / "d/c.json"
        src.write_text(json.dumps([{"text": t} for t in texts]))
    else:
        src = tmp_path / "d/c.jsonl.gz"
        with gzip.open(src, "wt") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    extra = ["--lines"] if kind == "lines" else []
    m = prep(tmp_path / "out", "--source", str(src), "--tokenizer", str(vocab_tiktoken), *extra)
    assert_round_trip(m, texts)


def test_inspect_and_missing_manifest(vocab_tiktoken, tmp_path):
    prep(tmp_path / "out", "--tokenizer", str(vocab_tiktoken), "--max-docs", "5")
    r = run_cli(str(tmp_path / "out"), "--tokens", "50", "--seed", "0", command="inspect")
    assert r.returncode == 0 and "tokenizer bpe1024 (file)" in r.stdout and "tokens [" in r.stdout
    r = run_cli(str(tmp_path / "missing"), command="inspect")
    proc_error(r, "lmforge prepare")
