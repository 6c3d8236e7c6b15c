"""The default val split of a small corpus: `lmforge prepare` without --val-fraction or
--val-docs takes, past the 1% hash rule, the documents with the smallest hashes until val holds
two eval windows of the 124M preset's 1024 tokens; its summary says so, and says what a smaller
val split can evaluate. Copies of a document count as one and go to one side. Real files through
the CLI, with a byte vocabulary (a document of B bytes is B + 1 tokens, its EOT included)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from lmforge.data_prep import shards as S
from lmforge.data_prep.prepare import VAL_FLOOR_TOKENS
from lmforge.launch.cli import main as lmforge
from lmforge.pipeline.config import load_config
from lmforge.pipeline.data.windows import TokenWindows
from tests.test_prepare_bad_input import docs_dir, prepare

ROOT = Path(__file__).resolve().parents[1]
DOC_BYTES = 200


def corpus(tmp_path: Path, n: int) -> tuple[Path, list[str]]:
    texts = [f"document {i:04d} " + "abcdefghij"[i % 10] * (DOC_BYTES - 14) for i in range(n)]
    assert all(len(t) == DOC_BYTES for t in texts)
    return docs_dir(tmp_path, *texts), texts


def by_hash(texts: list[str]) -> list[str]:
    """The documents in the order the split takes them: 64-bit little-endian blake2b ascending."""
    key = lambda t: int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little")
    return sorted(texts, key=key)


def run(capsys, tmp_path: Path, src: Path, *args: str, out: str = "out") -> tuple[S.Manifest, str]:
    assert lmforge(prepare(tmp_path, src, *args, out=out)) == 0
    return S.load_manifest(tmp_path / out), capsys.readouterr().out


def val_texts(m: S.Manifest) -> list[str]:
    """The val documents as text, sorted: the byte vocabulary's ids below 256 are the bytes."""
    texts = []
    for path in m.shard_paths("val"):
        toks = np.asarray(S.open_shard(path)).tolist()
        docs = " ".join(map(str, toks)).split(str(m.eot_id))  # each document follows an EOT
        texts += [bytes(map(int, d.split())).decode() for d in docs[1:]]
    return sorted(texts)


def test_the_default_split_of_a_small_corpus_holds_two_windows_of_1024(tmp_path, capsys):
    src, texts = corpus(tmp_path, 60)  # 12,060 tokens: the 1% rule alone gives ~0.6 documents
    m, out = run(capsys, tmp_path, src)
    need = -(-VAL_FLOOR_TOKENS // (DOC_BYTES + 1))  # the fewest documents holding the floor
    assert m.num_documents("val") == need and m.num_tokens("val") >= 2 * 1024 + 1
    assert TokenWindows(m.data_dir, "val", 1024, m.vocab_size).num_windows == 2
    assert val_texts(m) == sorted(by_hash(texts)[:need])  # the smallest hashes, not the first files
    assert m.num_documents("train") == 60 - need
    assert "val floor" in out and f"{VAL_FLOOR_TOKENS:,} tokens" in out and "note" not in out


def test_explicit_val_flags_are_kept_and_a_small_val_is_noted(tmp_path, capsys):
    src, texts = corpus(tmp_path, 60)
    m, out = run(capsys, tmp_path, src, "--val-docs", "1", out="one")
    assert val_texts(m) == by_hash(texts)[:1] and "val floor" not in out
    note = [ln for ln in out.splitlines() if ln.startswith("note")]
    assert len(note) == 1 and "val holds 201 tokens" in note[0] and "data.seq_len <= 200" in note[0]
    m, out = run(capsys, tmp_path, src, "--val-fraction", "0", out="none")
    assert m.num_tokens("val") == 0 and "note" not in out and "val floor" not in out


def test_a_tiny_corpus_gives_val_at_most_half_its_documents(tmp_path, capsys):
    src, texts = corpus(tmp_path, 3)
    m, out = run(capsys, tmp_path, src)
    assert val_texts(m) == by_hash(texts)[:1] and m.num_documents("train") == 2
    assert "val floor" in out and "val holds 201 tokens" in out


def test_the_val_floor_counts_copies_of_a_document(tmp_path, capsys):
    """3 documents, 4 copies each: at most 6 of the 12 may go to val; the copies of one
    document all go to one side (none leaks into train), so val takes 4."""
    m, _ = run(capsys, tmp_path, docs_dir(tmp_path, *[f"text number {i % 3}" for i in range(12)]))
    assert m.num_documents("val") == 4 and m.num_documents("train") == 8


def test_a_corpus_of_copies_prepares_with_an_empty_val_and_says_so(tmp_path, capsys):
    m, out = run(capsys, tmp_path, docs_dir(tmp_path, *["the very same text"] * 5))
    assert m.num_documents("train") == 5 and m.num_documents("val") == 0
    assert "val holds 0 tokens" in out


def test_parts_split_like_the_whole(tmp_path, capsys):
    src, _ = corpus(tmp_path, 60)
    whole, _ = run(capsys, tmp_path, src, out="whole")
    for i in (1, 2):
        run(capsys, tmp_path, src, "--part", f"{i}/2", out=f"p{i}")
    assert lmforge(["prepare", "--out", str(tmp_path / "merged"), "--merge",
                    str(tmp_path / "p1"), str(tmp_path / "p2")]) == 0
    merged = S.load_manifest(tmp_path / "merged")
    assert val_texts(merged) == val_texts(whole) and merged.num_documents("val") > 1
    assert merged.stats["val_floor"] == whole.stats["val_floor"] == VAL_FLOOR_TOKENS
    assert "val floor" in capsys.readouterr().out


def test_the_floor_covers_every_preset():
    presets = sorted((ROOT / "configs").glob("*.toml"))
    assert presets
    for path in presets:
        assert VAL_FLOOR_TOKENS >= load_config(path).data.seq_len + 1, path
    assert VAL_FLOOR_TOKENS >= 2 * 1024 + 1
