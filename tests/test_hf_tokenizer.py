"""`lmforge prepare --tokenizer hf:DIR`: the shards hold exactly the ids the `tokenizers`
library gives each document, its EOS (and BOS) open every document, and a tokenizer that cannot be
reproduced is one `error:` line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from lmforge.data_prep.shards import load_manifest, open_shard, read_doc_index
from lmforge.data_prep.sources import Source
from lmforge.data_prep.tokenizer import bos_id, eot_id, load_tokenizer, load_tokenizer_dir
from tests.conftest import ROOT, built_once
from tests.hf_dirs import BOS, EOS, ODD_TEXTS, corpus, hf_encode, make_tokenizer

pytest.importorskip("tokenizers")

STYLES = ("gpt2", "digits", "llama3")


@pytest.fixture(scope="session")
def hf_tokenizers(tmp_path_factory):
    root = built_once(tmp_path_factory, "hf_tokenizers",
                      lambda root: [make_tokenizer(root / s, s) for s in STYLES])
    return {s: root / s for s in STYLES}


@pytest.mark.parametrize("style", STYLES)
def test_encoding_matches_tokenizers(hf_tokenizers, style):
    tok_dir = hf_tokenizers[style]
    enc = load_tokenizer(f"hf:{tok_dir}")
    assert enc.n_vocab == 640 and enc.decode([eot_id(enc)]) == EOS
    bos = [enc.encode_single_token(BOS)] if style == "llama3" else []
    assert (bos_id(enc) is None) == (style != "llama3")
    texts = corpus(60, skip=160) + ODD_TEXTS
    mismatched = [t[:40] for t in texts if bos + enc.encode_ordinary(t) != hf_encode(tok_dir, t)]
    assert not mismatched
    assert eot_id(enc) not in enc.encode_ordinary(ODD_TEXTS[5])  # the marker in text is text


def prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.launch.cli", "prepare", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("style", STYLES)
def test_prepare_shards_hold_tokenizers_ids(hf_tokenizers, tmp_path, style):
    tok_dir, src = hf_tokenizers[style], tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(corpus(40, skip=200) + ODD_TEXTS):
        (src / f"{i:03d}.txt").write_bytes(text.encode())
    out = tmp_path / "data"
    res = prepare("--source", str(src), "--tokenizer", f"hf:{tok_dir}", "--out", str(out),
                  "--val-docs", "4", "--workers", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    m = load_manifest(out)
    enc = load_tokenizer_dir(out / "tokenizer")  # what training and sampling will read
    assert m.eot_id == eot_id(enc) == 0 and m.vocab_size == 640
    assert m.tokenizer["bos_id"] == bos_id(enc) == (640 - 1 if style == "llama3" else None)
    docs = []
    for s in m.shards:
        tokens = open_shard(out / s.file)
        offsets = read_doc_index(out / s.file, len(tokens))
        docs += [tuple(d[1:].tolist()) for d in np.split(tokens, offsets[1:])]
        assert (tokens[offsets] == m.eot_id).all()
    expected = [tuple(hf_encode(tok_dir, t)) for t in Source(str(src))]
    assert sorted(docs) == sorted(expected)


def tokenizer_json(tmp_path, model: dict, pre: dict | None = None):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "added_tokens": [{"id": 0, "content": EOS, "special": True}],
        "normalizer": None, "pre_tokenizer": pre, "post_processor": None, "decoder": None,
        "model": model}))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return d


@pytest.mark.parametrize("kind", ["wordpiece", "metaspace"])
def test_unsupported_tokenizer_is_one_line(tmp_path, kind):
    if kind == "wordpiece":
        d = tokenizer_json(tmp_path, {"type": "WordPiece", "vocab": {EOS: 0, "a": 1},
                                      "unk_token": "[UNK]"}, {"type": "BertPreTokenizer"})
        named = "BertPreTokenizer"
    else:  # SentencePiece-style BPE (Llama 2, Mistral): not byte-level
        d = tokenizer_json(tmp_path, {"type": "BPE", "vocab": {EOS: 0, "▁a": 1}, "merges": [],
                                      "byte_fallback": True},
                           {"type": "Metaspace", "replacement": "▁"})
        named = "Metaspace"
    out = tmp_path / "data"
    res = prepare("--source", "builtin:pystdlib", "--max-docs", "3", "--tokenizer", f"hf:{d}",
                  "--out", str(out))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert named in lines[0] and "byte-level" in lines[0]
    assert not out.exists()
