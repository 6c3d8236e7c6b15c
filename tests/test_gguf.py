"""`lmforge export --gguf`: every file is read back with `gguf` (llama.cpp's reader) and held
against the model and tokenizer it came from; where llama_cpp is importable (bench/
install_llama_cpp.sh builds it), llama.cpp itself runs the file: its tokenizer gives the shards'
ids, its greedy ids are `lmforge sample --temperature 0`'s, its logits ours."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data_prep.hf_tokenizer import bytes_to_unicode
from lmforge.data_prep.shards import open_shard
from lmforge.data_prep.tokenizer import load_tokenizer_dir, mergeable_ranks
from lmforge.launch.cli import main as lmforge
from lmforge.launch.export_gguf import MARKER_KEY, permute
from lmforge.pipeline.inference import load_for_inference
from tests.errors import cli_error
from tests.gguf_dirs import (
    LLAMA3_SCALING,
    TEMPLATE,
    llama,
    llama3_factors,
    llama_greedy,
    llama_logits,
    random_model,
    smollm_dir,
    split_tokenizer,
    styled_dir,
)
from tests.hf_dirs import ODD_TEXTS
from tests.test_eval_sample_export import make_checkpoint

gguf = pytest.importorskip("gguf")
NO_LLAMA = "llama_cpp is not installed (bash bench/install_llama_cpp.sh builds it, ~30 min)"


def fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items()} | {
        "tensors": {t.name: t for t in reader.tensors}}


def export(ckpt, out: Path, *extra: str) -> dict:
    assert lmforge(["export", "--ckpt", str(ckpt), "--gguf", str(out), *extra]) == 0
    return fields(out)


@pytest.fixture(scope="module")
def corpus_data(tmp_path_factory) -> Path:
    """The test corpus with unicode, digit runs and whitespace runs of every kind, prepared with
    a trained BPE: the shards a llama.cpp tokenizer must reproduce."""
    from lmforge.launch.prepare import main as prepare
    from tests.hf_dirs import corpus

    root = tmp_path_factory.mktemp("gguf_corpus")
    docs = [*ODD_TEXTS, *corpus(40)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    assert prepare(["--source", str(root / "docs.jsonl"), "--tokenizer", "bpe:600",
                    "--out", str(root / "data"), "--val-docs", "0", "--workers", "1"]) == 0
    return root / "data"


@pytest.fixture(scope="module")
def ckpt(corpus_data, tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gguf_ckpt") / "final", corpus_data)


@pytest.fixture(scope="module")
def smollm(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    return smollm_dir(tmp_path_factory.mktemp("smollm") / "SmolLM2-like")


def test_gguf_holds_the_model_and_tokenizer(ckpt, tmp_path):
    f = export(ckpt, tmp_path / "m.gguf")
    loaded = load_for_inference(ckpt)
    cfg, enc = loaded.config, load_tokenizer_dir(loaded.tokenizer_dir)
    assert f["general.architecture"] == "llama" and f["tokenizer.ggml.pre"] == "llama-bpe"
    assert f["llama.block_count"] == cfg.n_layer and f["llama.attention.head_count_kv"] == cfg.n_kv_head
    chars = bytes_to_unicode()
    ranks = mergeable_ranks(enc)
    assert f["tokenizer.ggml.tokens"][:len(ranks)] == ["".join(chars[b] for b in t) for t in sorted(ranks, key=ranks.get)]
    assert f["tokenizer.ggml.tokens"][enc.eot_token] == "<|endoftext|>"
    assert f["tokenizer.ggml.token_type"][enc.eot_token] == gguf.TokenType.CONTROL
    assert len(f["tokenizer.ggml.merges"]) == len(ranks) - 256
    # Every document in the shards starts with end-of-text: llama.cpp puts it first too.
    assert f["tokenizer.ggml.bos_token_id"] == f["tokenizer.ggml.eos_token_id"] == enc.eot_token
    assert f["tokenizer.ggml.add_bos_token"] is True
    sd = loaded.model.state_dict()
    q_rows = cfg.n_head * cfg.head_dim
    q = np.asarray(f["tensors"]["blk.1.attn_q.weight"].data)
    assert np.array_equal(q, permute(sd["blocks.1.attn.qkv.weight"][:q_rows], cfg.n_head).numpy())
    emb = np.asarray(f["tensors"]["token_embd.weight"].data)
    assert np.array_equal(emb, sd["tok_emb.weight"][:cfg.vocab_size].numpy())


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_gguf_dtypes_keep_norms_in_f32(ckpt, tmp_path, dtype):
    f = export(ckpt, tmp_path / "m.gguf", "--gguf-dtype", dtype)
    kinds = {name: t.tensor_type.name for name, t in f["tensors"].items()}
    assert kinds["blk.0.attn_q.weight"] == kinds["token_embd.weight"] == dtype.upper()
    assert kinds["blk.0.attn_norm.weight"] == kinds["output_norm.weight"] == "F32"
    emb = load_for_inference(ckpt).model.state_dict()["tok_emb.weight"]
    stored = np.asarray(f["tensors"]["token_embd.weight"].data)
    want = emb.to(torch.float16 if dtype == "f16" else torch.bfloat16)
    got = torch.from_numpy((stored.view(np.float16) if dtype == "f16" else stored.view(np.int16)).copy())
    assert torch.equal(got if dtype == "f16" else got.view(torch.bfloat16), want[:len(stored)])


def test_gguf_refusals_leave_everything_as_it_was(ckpt, tmp_path, capsys):
    precious = tmp_path / "notes.gguf"
    precious.write_text("keep me")
    cli_error(capsys, ["export", "--ckpt", str(ckpt), "--gguf", str(precious)], "not a GGUF lmforge wrote")
    assert precious.read_text() == "keep me"
    cli_error(capsys, ["export", "--ckpt", str(ckpt), "--gguf", str(tmp_path)], str(tmp_path))
    # A split pattern llama.cpp has no pre-tokenizer for: refused before any file is written.
    odd = tmp_path / "odd"
    shutil.copytree(ckpt, odd)
    meta = json.loads((odd / "tokenizer" / "tokenizer.json").read_text())
    meta["pattern"] = r"\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+"
    (odd / "tokenizer" / "tokenizer.json").write_text(json.dumps(meta))
    cli_error(capsys, ["export", "--ckpt", str(odd), "--gguf", str(tmp_path / "o.gguf")],
              "no pre-tokenizer")
    assert not list(tmp_path.glob("*o.gguf*"))
    # A previous export is replaced; --hf and --gguf are one or the other.
    assert MARKER_KEY in export(ckpt, precious.with_name("m.gguf"))
    assert MARKER_KEY in export(ckpt, precious.with_name("m.gguf"), "--gguf-dtype", "f16")
    cli_error(capsys, ["export", "--ckpt", str(ckpt), "--gguf", "a.gguf", "--hf", "b"], "not allowed")


def test_gguf_of_a_released_model_keeps_its_identity(smollm, tmp_path):
    f = export(f"hf:{smollm}", tmp_path / "s.gguf")
    assert f["tokenizer.ggml.pre"] == "smollm"
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"],
            f["tokenizer.ggml.padding_token_id"]) == (1, 2, 2)
    assert f["tokenizer.ggml.add_bos_token"] is False  # its tokenizer adds none
    assert f["tokenizer.chat_template"] == TEMPLATE
    assert f["tokenizer.ggml.token_type"][1] == gguf.TokenType.CONTROL


def test_hf_export_carries_the_source_files_and_ids(smollm, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert lmforge(["export", "--ckpt", f"hf:{smollm}", "--hf", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (smollm / name).read_bytes(), name
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ours, theirs = (transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False) for d in (out, smollm))
    assert ours == theirs


def test_sample_chat_renders_the_template(smollm, ckpt, capsys):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(smollm)
    messages = [{"role": "user", "content": "Name 3 colours."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm).eval()
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                eos_token_id=2, pad_token_id=2)[0, len(ids):].tolist()
    greedy = greedy[:greedy.index(2)] if 2 in greedy else greedy
    assert lmforge(["sample", "--ckpt", f"hf:{smollm}", "--chat", "--prompt", "Name 3 colours.",
                    "--temperature", "0", "--max-new-tokens", "8", "--dtype", "fp32",
                    "--device", "cpu"]) == 0
    assert capsys.readouterr().out == text + tok.decode(greedy) + "\n"
    cli_error(capsys, ["sample", "--ckpt", str(ckpt), "--chat", "--prompt", "hi"], "no chat template")


# --------------------------------------------------------------------------------------------
# llama.cpp itself


def shard_docs(data: Path) -> list[list[int]]:
    """Each document's ids as the shards hold them (the end-of-text, and BOS, opening it dropped)."""
    from lmforge.data_prep.tokenizer import doc_start

    enc = load_tokenizer_dir(data / "tokenizer")
    start = len(doc_start(enc))
    ids = np.concatenate([open_shard(p) for p in sorted(data.glob("train_*.bin"))]).tolist()
    cuts = [i for i, t in enumerate(ids) if t == enc.eot_token] + [len(ids)]
    return [ids[a + start:b] for a, b in zip(cuts, cuts[1:])]


try:
    import llama_cpp
except ImportError:
    llama_cpp = None
needs_llama = pytest.mark.skipif(llama_cpp is None, reason=NO_LLAMA)
# Beside the checkout, as CI lays it out (a clone without it skips this one case and says so).
GPT2_FILE = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "gpt2.tiktoken"


def prepared(root: Path, tokenizer: str) -> Path:
    """The test corpus (unicode, digit runs, whitespace runs) prepared with `tokenizer`."""
    from lmforge.launch.prepare import main as prepare
    from tests.hf_dirs import corpus

    docs = [*ODD_TEXTS, *corpus(40), "<think>2 + 2</think> is 4 <think>\n</think>x</think>"]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    assert prepare(["--source", str(root / "docs.jsonl"), "--tokenizer", tokenizer, "--out",
                    str(root / "data"), "--val-docs", "0", "--workers", "1"]) == 0
    return root / "data"


@needs_llama
@pytest.mark.parametrize("style", ["bpe", "gpt2.tiktoken", "gpt2", "digits", "llama3", "qwen2",
                                   "qwen2_think"])
def test_llama_cpp_tokenizes_as_the_shards(style, tmp_path):
    """Each pre-tokenizer lmforge maps (see export_gguf.PRE_TOKENIZERS), on shards of text with
    unicode, digits and whitespace runs: llama.cpp's ids are the shards' ids, document by document."""
    if style == "bpe":
        tokenizer = "bpe:600"
    elif style == "gpt2.tiktoken":
        if not GPT2_FILE.is_file():
            pytest.skip(f"{GPT2_FILE} is not on this machine")
        tokenizer = str(GPT2_FILE)
    else:
        tokenizer = f"hf:{split_tokenizer(tmp_path / 'tok', style)}"
    data = prepared(tmp_path, tokenizer)
    ckpt = make_checkpoint(tmp_path / "final", data, d_model=32)
    export(ckpt, tmp_path / "m.gguf")
    llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), vocab_only=True, verbose=False)
    enc = load_tokenizer_dir(data / "tokenizer")
    docs = shard_docs(data)
    assert len(docs) >= len(ODD_TEXTS)
    for doc in docs:
        text = enc.decode(doc)
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == doc, text[:80]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    return styled_dir(tmp_path_factory.mktemp("qwen3"), "llama3", arch="qwen3")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("qwen2")
    return random_model(root / "model", "qwen2", split_tokenizer(root / "tok", "qwen2"))


@pytest.fixture(scope="module")
def llama3_scaled(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("llama3")
    tok = split_tokenizer(root / "tok", "llama3")
    return random_model(root / "model", "llama", tok, rope_parameters=LLAMA3_SCALING)


def test_gguf_of_qwen2_keeps_its_biases(qwen2, tmp_path):
    from safetensors.torch import load_file

    f = export(f"hf:{qwen2}", tmp_path / "q.gguf")
    assert f["general.architecture"] == "qwen2" and f["tokenizer.ggml.pre"] == "qwen2"
    theirs = load_file(qwen2 / "model.safetensors")
    for i in range(2):
        for n in "qkv":  # qwen2 rotates halves, as Hugging Face: nothing permuted
            got = np.asarray(f["tensors"][f"blk.{i}.attn_{n}.bias"].data)
            assert np.array_equal(got, theirs[f"model.layers.{i}.self_attn.{n}_proj.bias"].numpy())


def test_gguf_of_llama3_scaling_has_llama_cpps_rope_freqs(llama3_scaled, tmp_path):
    f = export(f"hf:{llama3_scaled}", tmp_path / "l.gguf")
    got = np.asarray(f["tensors"]["rope_freqs.weight"].data)
    s = LLAMA3_SCALING
    want = llama3_factors(s["rope_theta"], 16, s["factor"], s["low_freq_factor"],
                          s["high_freq_factor"], s["original_max_position_embeddings"])
    assert len(set(want)) > 2  # all three bands
    np.testing.assert_allclose(got, want, rtol=1e-6)


@needs_llama
@pytest.mark.parametrize("source", ["ckpt", "smollm", "qwen3", "qwen2", "llama3_scaled"])
def test_llama_cpp_runs_the_model_as_lmforge_does(source, request, tmp_path, capsys):
    """The same first-token logits (f32 throughout, K/V cached in f32: within 1e-4 of the
    largest logit, float32 sums in another order; a q/k permutation missed, or a norm's eps,
    is off by whole units) and the same greedy continuation as `lmforge sample --temperature 0`."""
    from lmforge.data_prep.tokenizer import encode_prompt, eot_id

    ckpt = request.getfixturevalue(source)
    ckpt = ckpt if source == "ckpt" else f"hf:{ckpt}"
    path = tmp_path / "m.gguf"
    export(ckpt, path)
    loaded = load_for_inference(ckpt)
    enc = load_tokenizer_dir(loaded.tokenizer_dir)
    prompt = "def main(argv):\n    x = 12"
    ids = encode_prompt(enc, prompt)
    llm = llama(path)
    with torch.no_grad():
        ours = loaded.model(torch.tensor([ids]))[0].numpy()
    theirs = llama_logits(llm, ids)
    assert np.abs(theirs - ours).max() <= 1e-4 * np.abs(ours).max()
    new = llama_greedy(llm, ids, 24, stop=eot_id(enc))
    capsys.readouterr()
    assert lmforge(["sample", "--ckpt", str(ckpt), "--prompt", prompt, "--temperature", "0",
                    "--max-new-tokens", "24", "--dtype", "fp32", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == prompt + enc.decode(new) + "\n"
