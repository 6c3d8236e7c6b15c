"""Hugging Face tokenizers as released models ship them (tests/hf_tok_shapes.py), held to the
`tokenizers` library itself: `lmforge prepare --tokenizer hf:DIR` writes exactly its ids, on a
corpus holding every rule's case, or refuses in one `error:` line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from lmforge.data_prep.shards import load_manifest, open_shard, read_doc_index
from lmforge.data_prep.sources import Source
from lmforge.data_prep.tokenizer import load_tokenizer, load_tokenizer_dir
from tests.conftest import ROOT, built_once
from tests.hf_dirs import hf_encode
from tests.hf_tok_shapes import SHAPES, appended_words, make_shape, shape_corpus

pytest.importorskip("tokenizers")


@pytest.fixture(scope="session")
def shapes(tmp_path_factory):
    root = built_once(tmp_path_factory, "hf_tok_shapes",
                      lambda root: [make_shape(root / s, s) for s in SHAPES])
    return {s: root / s for s in SHAPES}


def texts_of(tok_dir) -> list[str]:
    words = appended_words(tok_dir) if (tok_dir / "appended.json").is_file() else []
    return shape_corpus([w for word in words for w in (word, " " + word, f"a {word}s, {word}")])


@pytest.mark.parametrize("shape", SHAPES)
def test_encoding_is_tokenizers(shapes, shape):
    enc = load_tokenizer(f"hf:{shapes[shape]}")
    wrong = [t for t in texts_of(shapes[shape]) if enc.encode_ordinary(t) != hf_encode(shapes[shape], t)]
    assert not wrong, [repr(t[:60]) for t in wrong[:5]]
    again = load_tokenizer_dir(_saved(enc, shapes[shape].parent / f"{shape}.saved"))
    assert all(again.encode_ordinary(t) == enc.encode_ordinary(t) for t in texts_of(shapes[shape]))


def _saved(enc, path):
    from lmforge.data_prep.tokenizer import save_tokenizer_dir

    if not path.exists():
        save_tokenizer_dir(enc, path, "hf", enc.name)
    return path


def prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.launch.cli", "prepare", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def shard_docs(out) -> list[tuple]:
    m, docs = load_manifest(out), []
    for s in m.shards:
        tokens = open_shard(out / s.file)
        offsets = read_doc_index(out / s.file, len(tokens))
        docs += [tuple(d[1:].tolist()) for d in np.split(tokens, offsets[1:])]
    return docs


@pytest.mark.parametrize("shape", SHAPES)
def test_prepare_writes_tokenizers_ids(shapes, tmp_path, shape):
    """Each shape failed before: "lacks 21 of the 256 single-byte tokens" (smollm), <think> as
    text and Python's NFC (qwen), the text between matches dropped (gaps), appended merges
    tiktoken applies where `tokenizers` never does (appended)."""
    tok_dir, src = shapes[shape], tmp_path / "src"
    src.mkdir()
    texts = [t for t in texts_of(tok_dir) if t.strip()]
    for i, text in enumerate(texts):
        (src / f"{i:04d}.txt").write_bytes(text.encode())
    out = tmp_path / "data"
    res = prepare("--source", str(src), "--tokenizer", f"hf:{tok_dir}", "--out", str(out),
                  "--val-docs", "4", "--workers", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    expected = sorted(tuple(hf_encode(tok_dir, t)) for t in Source(str(src)))
    assert sorted(shard_docs(out)) == expected


def test_export_round_trips(tmp_path):
    """lmforge's own `export --hf` tokenizer.json (transformers' TikTokenConverter lists every
    split of every token, so merges name parts ranked above the token they make) read back as
    hf:: the same ids as the tokenizer it was exported from. It was refused ("tiktoken would
    merge in another order")."""
    pytest.importorskip("transformers")
    from lmforge.launch.export import save_hf_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(t for t in shape_corpus() if t.strip()):
        (src / f"{i:04d}.txt").write_bytes(text.encode())
    res = prepare("--source", str(src), "--tokenizer", "bpe:700", "--out", str(tmp_path / "a"),
                  "--val-docs", "4", "--workers", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    exported = tmp_path / "export"
    exported.mkdir()
    save_hf_tokenizer(tmp_path / "a" / "tokenizer", exported, 64)
    res = prepare("--source", str(src), "--tokenizer", f"hf:{exported}", "--out", str(tmp_path / "b"),
                  "--val-docs", "4", "--workers", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(shard_docs(tmp_path / "a")) == sorted(shard_docs(tmp_path / "b"))


def test_init_from_refuses_data_of_another_tokenizer(shapes, tmp_path):
    """`init_from DIR` held the dataset's tokenizer against DIR's by its id count alone: data of
    another 640-id tokenizer trained DIR's weights on ids that mean other text."""
    pytest.importorskip("transformers")
    from tests.hf_dirs import make_model, make_tokenizer, run_args

    model = tmp_path / "model"
    make_model(model, shard=None, tok_dir=make_tokenizer(tmp_path / "tok", "gpt2"))
    data = tmp_path / "data"
    res = prepare("--source", "builtin:pystdlib", "--max-docs", "40", "--val-docs", "4",
                  "--tokenizer", f"hf:{shapes['smollm']}", "--out", str(data), "--workers", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    run = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "lmforge.launch.cli", "train",
                          *run_args(data, run, "--checkpoint.init_from", str(model))],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "another tokenizer" in errors[0] and "sha256" in errors[0] and not run.exists()


def _edited(src, tmp_path, edit):
    d = tmp_path / "tok"
    d.mkdir()
    j = json.loads((src / "tokenizer.json").read_text())
    edit(j["model"])
    (d / "tokenizer.json").write_text(json.dumps(j))
    (d / "tokenizer_config.json").write_bytes((src / "tokenizer_config.json").read_bytes())
    return d


def _swap(model):
    model["merges"][10], model["merges"][200] = model["merges"][200], model["merges"][10]


@pytest.mark.parametrize("edit,named", [
    (_swap, "merges by merge order"),  # `tokenizers` merges by list order, tiktoken by id: they disagree
    # whole words an appended merge makes are given whole (ignore_merges), but inside a longer
    # word tiktoken would still join the parts `tokenizers` leaves apart
    (lambda m: m.update(ignore_merges=True), "is made from its bytes as"),
])
def test_merges_tiktoken_cannot_follow_are_one_line(shapes, tmp_path, edit, named):
    d = _edited(shapes["appended"], tmp_path, edit)
    out = tmp_path / "data"
    res = prepare("--source", "builtin:pystdlib", "--max-docs", "3", "--tokenizer", f"hf:{d}",
                  "--out", str(out))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert named in lines[0] and not out.exists()


def test_nfc_without_the_tokenizers_package_is_refused(shapes, monkeypatch):
    """NFC is applied by `tokenizers`' tables, never Python's (another Unicode version): where
    the package is missing, an NFC tokenizer is refused rather than normalised otherwise."""
    from lmforge.data_prep.errors import DataError

    monkeypatch.setitem(sys.modules, "tokenizers.normalizers", None)  # import fails
    with pytest.raises(DataError, match="pip install tokenizers"):
        load_tokenizer(f"hf:{shapes['qwen']}")


def test_lone_surrogates_in_jsonl(shapes, tmp_path):
    """A JSONL "\\ud800" escape is a lone surrogate, which `tokenizers` (its NFC) cannot take:
    encoded as U+FFFD, as tiktoken's own encode_ordinary does, instead of a traceback."""
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "caf\\u00e9 \\ud800 x <think>\\udfff</think>"}\n{"text": "plain"}\n')
    out = tmp_path / "data"
    res = prepare("--source", str(src), "--tokenizer", f"hf:{shapes['qwen']}", "--out", str(out),
                  "--val-docs", "1", "--workers", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    expected = [hf_encode(shapes["qwen"], t) for t in ("café \ufffd x <think>\ufffd</think>", "plain")]
    assert sorted(shard_docs(out)) == sorted(map(tuple, expected))
