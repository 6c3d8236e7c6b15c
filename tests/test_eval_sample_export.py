"""`lmforge eval | sample | export` on a randomly initialised checkpoint (no training needed), and
the eval windows shared with training. The trained, multi-process path is tests/test_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data_prep.shards import open_shard
from lmforge.data_prep.tokenizer import load_tokenizer_dir
from lmforge.launch.cli import main as lmforge
from lmforge.launch.export import EXPORT_MARKER
from lmforge.launch.sample import decode_stream
from lmforge.model import GPT, ModelConfig
from lmforge.pipeline.checkpoint.format import CheckpointMeta, save_consolidated
from lmforge.pipeline.config import config_from_dict
from lmforge.pipeline.data.loader import IGNORE_INDEX, TokenWindows
from lmforge.pipeline.evaluate import eval_batches
from tests.errors import cli_error

SEQ_LEN = 32


def make_checkpoint(out: Path, data: Path, *, d_model: int = 64) -> Path:
    """A consolidated checkpoint (what training's final/ is) of a random model for `data`."""
    vocab = load_tokenizer_dir(data / "tokenizer").n_vocab
    cfg = ModelConfig(vocab_size=vocab, n_layer=2, n_head=4, n_kv_head=2, d_model=d_model,
                      max_seq_len=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    job = config_from_dict({"data": {"seq_len": SEQ_LEN}, "eval": {"batch_size": 3}})
    meta = CheckpointMeta(step=7, model=cfg, config=job, lineage="test")
    return save_consolidated(out, model.state_dict(), meta, data / "tokenizer")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Hundreds of tiny forwards: on a busy 2-core machine a second thread costs 20x in waits.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tiny_data, tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "final", tiny_data)


def val_stream(data: Path) -> np.ndarray:
    return np.concatenate([open_shard(p) for p in sorted(data.glob("val_*.bin"))]).astype(np.int64)


# --------------------------------------------------------------------------------------------
# eval windows


@pytest.mark.parametrize("max_tokens", [None, 100, 64])
@pytest.mark.parametrize("world", [1, 3])
def test_eval_windows_tile_every_target_once(tiny_data, max_tokens, world):
    windows = TokenWindows(tiny_data, "val", SEQ_LEN, None)
    stream = val_stream(tiny_data)
    M = len(stream) - 1 if max_tokens is None else max_tokens
    assert (len(stream) - 1) % SEQ_LEN, "the split must leave a partial tail window to test"
    pairs = []
    counts = []
    for rank in range(world):
        batches = eval_batches(windows, 4, rank, world, max_tokens)
        counts.append(len(batches))
        for x, y in batches:
            assert x.shape == y.shape and x.shape[1] == SEQ_LEN
            for row_x, row_y in zip(x, y):
                n = int((row_y != IGNORE_INDEX).sum())
                assert (row_y[n:] == IGNORE_INDEX).all()  # padding only after the real targets
                pairs += list(zip(row_x[:n].tolist(), row_y[:n].tolist()))
    assert len(set(counts)) == 1  # every rank runs the same number of forwards
    assert len(pairs) == M
    # As a multiset the (input, target) pairs are exactly the split's next-token pairs 1..M.
    expected = list(zip(stream[:M].tolist(), stream[1:M + 1].tolist()))
    assert sorted(pairs) == sorted(expected)


# --------------------------------------------------------------------------------------------
# eval


def test_eval_prints_and_writes_json(ckpt, tiny_data, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert lmforge(["eval", "--ckpt", str(ckpt), "--data", str(tiny_data), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["tokens"] == len(val_stream(tiny_data)) - 1  # the whole split, tail included
    assert r["seq_len"] == SEQ_LEN and r["step"] == 7  # defaults from the run's config
    # An untrained model is close to uniform over the vocabulary.
    vocab = load_tokenizer_dir(tiny_data / "tokenizer").n_vocab
    assert abs(r["perplexity"] - vocab) < 0.2 * vocab
    assert f"{r['perplexity']:.4f}" in printed and f"{r['tokens']:,}" in printed
    assert r["bits_per_byte"] == pytest.approx(r["loss"] * r["tokens"] / np.log(2) / r["bytes"])


def test_eval_refuses_other_tokenizer(ckpt, tmp_path, capsys):
    from lmforge.launch.prepare import main as prepare

    other = tmp_path / "other"
    assert prepare(["--source", "builtin:pystdlib", "--tokenizer", "bpe:300", "--out", str(other),
                    "--max-docs", "20", "--val-docs", "2", "--workers", "1", "--quiet"]) == 0
    capsys.readouterr()
    err = cli_error(capsys, ["eval", "--ckpt", str(ckpt), "--data", str(other)])
    assert "tokenized with bpe300" in err and "--tokenizer" in err


def test_missing_checkpoint(tiny_data, tmp_path, capsys):
    for cmd in (["eval", "--data", str(tiny_data)], ["sample", "--prompt", "x"], ["export", "--hf", str(tmp_path / "o")]):
        err = cli_error(capsys, [*cmd, "--ckpt", str(tmp_path / "nope")])
        assert "does not exist" in err
    assert not (tmp_path / "o").exists()


def test_checkpoint_of_another_shape(ckpt, tiny_data, tmp_path, capsys):
    """Weights of one model under the meta.json of another: one line, not a size-mismatch trace."""
    bad = make_checkpoint(tmp_path / "bad", tiny_data, d_model=32)
    (bad / "meta.json").write_text((ckpt / "meta.json").read_text())
    err = cli_error(capsys, ["sample", "--ckpt", str(bad), "--prompt", "x"])
    assert "do not fit" in err


# --------------------------------------------------------------------------------------------
# sample


def test_stream_decoding_never_splits_a_character(tiny_data):
    enc = load_tokenizer_dir(tiny_data / "tokenizer")
    text = "naïve café — 日本語 ✓ 🙂 done"
    ids = enc.encode_ordinary(text)
    assert len(ids) > len(text.split())  # byte-level pieces: characters do span tokens
    pieces = list(decode_stream(enc, ids))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_sample_same_seed_same_text(ckpt, capsys):
    args = ["sample", "--ckpt", str(ckpt), "--prompt", "def f(x):", "--max-new-tokens", "20",
            "--num-samples", "2"]
    outs = []
    for seed in ("5", "5", "6"):
        assert lmforge([*args, "--seed", seed]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]
    assert outs[0].count("def f(x):") == 2 and "--- sample 2/2 ---" in outs[0]


def test_sample_prompt_errors_and_clamp(ckpt, tmp_path, capsys):
    long = "x = 1\n" * 100  # far more than the 64-token context
    err = cli_error(capsys, ["sample", "--ckpt", str(ckpt), "--prompt", long])
    assert "context is 64" in err and "shorten" in err
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("import os\n", encoding="utf-8")
    assert lmforge(["sample", "--ckpt", str(ckpt), "--prompt-file", str(prompt_file),
                    "--max-new-tokens", "1000", "--seed", "0", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "clamped to" in captured.err and captured.out.startswith("import os\n")


# --------------------------------------------------------------------------------------------
# export


def test_export_loads_in_transformers_with_same_tokens(ckpt, tiny_data, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert lmforge(["export", "--ckpt", str(ckpt), "--hf", str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    enc = load_tokenizer_dir(tiny_data / "tokenizer")
    text = enc.decode(val_stream(tiny_data).tolist())
    for doc in text.split("<|endoftext|>")[1:]:
        assert tok.encode(doc, add_special_tokens=False) == enc.encode_ordinary(doc)
    assert tok.eos_token_id == enc.eot_token
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == enc.n_vocab
    # Exporting again over an export is fine; over anything else it is refused, untouched.
    assert lmforge(["export", "--ckpt", str(ckpt), "--hf", str(out)]) == 0
    assert (out / EXPORT_MARKER).is_file()
    other = tmp_path / "precious"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    capsys.readouterr()
    err = cli_error(capsys, ["export", "--ckpt", str(ckpt), "--hf", str(other)])
    assert "not an lmforge export" in err
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
