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


def _set(path: list, value):
    """A mutation of tokenizer.json setting the field at `path` to `value`."""
    def mutate(j):
        for key in path[:-1]:
            j = j[key]
        j[path[-1]] = value
    return mutate


# Each field of tokenizer.json / tokenizer_config.json made another type than the format's:
# each once ended in a traceback, each is one `error:` line.
MALFORMED = {
    "file a list": lambda j: [j],
    "model a string": _set(["model"], "BPE"),
    "vocab a list": _set(["model", "vocab"], ["a", "b"]),
    "vocab id a string": _set(["model", "vocab", "a"], "7"),
    "vocab of an empty token": _set(["model", "vocab", ""], 700),
    "merges a dict": _set(["model", "merges"], {"a": "b"}),
    "merge an int": _set(["model", "merges", 0], 5),
    "merge of three": _set(["model", "merges", 0], ["Ġ", "Ġ", "Ġ"]),
    "merge of an unknown token": _set(["model", "merges", 0], ["Ġ", "zzzq"]),
    "ignore_merges a string": _set(["model", "ignore_merges"], "yes"),
    "added_tokens a dict": _set(["added_tokens"], {"id": 0}),
    "added token a string": _set(["added_tokens", 0], "<|endoftext|>"),
    "added token id a string": _set(["added_tokens", 0, "id"], "0"),
    "added token content an int": _set(["added_tokens", 1, "content"], 7),
    "added token special a string": _set(["added_tokens", 1, "special"], "false"),
    "pre_tokenizer a string": _set(["pre_tokenizer"], "ByteLevel"),
    "pretokenizers a dict": _set(["pre_tokenizer", "pretokenizers"], {"type": "Split"}),
    "a pretokenizer a list": _set(["pre_tokenizer", "pretokenizers", 0], []),
    "split regex an int": _set(["pre_tokenizer", "pretokenizers", 0, "pattern", "Regex"], 5),
    "use_regex a string": _set(["pre_tokenizer", "pretokenizers", 1, "use_regex"], "no"),
    "normalizer a list": _set(["normalizer"], ["NFC"]),
    "normalizers a string": _set(["normalizer"], {"type": "Sequence", "normalizers": "NFC"}),
    "post_processor a list": _set(["post_processor"], [1]),
    "template single a string": _set(["post_processor", "single"], "$A"),
    "template item a string": _set(["post_processor", "single", 0], "<|begin_of_text|>"),
    "special token id a dict": _set(["post_processor", "single", 0, "SpecialToken", "id"], {}),
    "nested 100,000 deep": lambda j: None,  # the text is written below
}
CONFIG_MALFORMED = {"config a list": [1], "eos_token an int": {"eos_token": 5},
                    "eos_token a list": {"eos_token": ["<|endoftext|>"]}}


@pytest.mark.parametrize("case", [*MALFORMED, *CONFIG_MALFORMED])
def test_malformed_field_is_one_error(hf_tokenizers, tmp_path, case):
    from lmforge.data_prep.errors import DataError

    d = tmp_path / "tok"
    d.mkdir()
    j = json.loads((hf_tokenizers["llama3"] / "tokenizer.json").read_text())
    if case in MALFORMED:
        j = MALFORMED[case](j) or j
        text = json.dumps(j) if case != "nested 100,000 deep" else "[" * 100_000 + "]" * 100_000
        (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    else:
        text = json.dumps(j)
        (d / "tokenizer_config.json").write_text(json.dumps(CONFIG_MALFORMED[case]))
    (d / "tokenizer.json").write_text(text)
    with pytest.raises(DataError) as e:
        load_tokenizer(f"hf:{d}")
    assert "\n" not in str(e.value) and "tok" in str(e.value)


def test_malformed_through_the_cli(hf_tokenizers, tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    j = json.loads((hf_tokenizers["gpt2"] / "tokenizer.json").read_text())
    j["added_tokens"][0]["id"] = "0"
    (d / "tokenizer.json").write_text(json.dumps(j))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    out = tmp_path / "data"
    res = prepare("--source", "builtin:pystdlib", "--max-docs", "3", "--tokenizer", f"hf:{d}",
                  "--out", str(out))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert "added_tokens[0].id" in lines[0] and not out.exists()
