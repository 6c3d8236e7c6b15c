"""Tiny Hugging Face directories for the continued-pretraining tests: a byte-level BPE
tokenizer.json trained with `tokenizers` on the built-in corpus, and random LlamaForCausalLM /
Qwen3ForCausalLM models of its vocabulary written by save_pretrained."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

from tests.harness import TINY_ARGS

EOS = "<|endoftext|>"
BOS = "<|begin_of_text|>"
TOKENIZER_VOCAB = 640
# Llama 3's split regex (tokenizer.json's Split pre-tokenizer), used with an NFC normaliser and
# a BOS post-processor: the Llama 3 / Qwen shape of tokenizer.json.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Text a byte-level BPE must reproduce exactly: unicode (combining marks NFC changes, CJK, emoji,
# fullwidth digits), whitespace runs of every kind, digit runs, contractions, and the
# end-of-text marker as plain text.
ODD_TEXTS = [
    "héllo wörld 12345 ½ ⅔ 日本語のテキスト 🎉🎉 \t\t  \n\n\n   x  1 2  33\u00a0nbsp \r\n e\u0301 café",
    "    leading spaces, trailing tabs\t\t\t", "a" * 700, " 12 " * 40 + "１２３ 0.5e-3",
    "It's 'S 'll've I'M don't\n\n\n\n", f"text {EOS} after the marker {EOS}{EOS}",
    "\u3000\u2003 mixed\u2009spaces \x0b\x0c\x1c end", "x\r\ny\rz\n\r\n",
]


def corpus(n: int = 160, skip: int = 0) -> list[str]:
    from lmforge.data_prep.sources import Source

    return list(itertools.islice(Source("builtin:pystdlib"), skip, skip + n))


def make_tokenizer(out: Path, style: str = "gpt2") -> Path:
    """tokenizer.json (+ tokenizer_config.json naming the EOS) in `out`: "gpt2" is ByteLevel
    alone (GPT-2), "digits" Digits(individual_digits) then ByteLevel (StarCoder / SmolLM style),
    "llama3" a Split regex + NFC + BOS template (Llama 3, Qwen)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=style != "llama3")
    if style == "gpt2":
        tok.pre_tokenizer = byte_level
    elif style == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB - (style == "llama3"),
                                  special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    if style == "llama3":
        tok.add_special_tokens([BOS])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    assert tok.get_vocab_size() == TOKENIZER_VOCAB
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return out


def hf_encode(tok_dir: Path, text: str) -> list[int]:
    """What `tokenizers` gives for `text`, the end-of-text marker read as text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.encode_special_tokens = True
    return tok.encode(text).ids


# Llama 3.2 1B/3B's scaling (factor 32) over a short pretraining context: at rope_theta 500 and
# head_dim 16 the pairs' wavelengths (6.3 ... 1148 positions) fall in all three of its bands
# (kept under 32 / 4, stretched over 32, interpolated between).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
ARCHS = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}  # Qwen2: q/k/v biases


def make_model(out: Path, arch: str = "llama", tie: bool = False, n_kv_head: int = 2,
               shard: str | None = "120KB", head_dim: int | None = None, seed: int = 0,
               tok_dir: Path | None = None, vocab: int = TOKENIZER_VOCAB, rope: dict | None = None):
    """A random tiny model of the tokenizer's vocabulary saved in `out` (sharded unless
    shard=None), weights large enough that attention is far from uniform; returns the model."""
    import transformers

    torch.manual_seed(seed)
    conf = getattr(transformers, f"{ARCHS[arch]}Config")
    kw = {"head_dim": head_dim} if head_dim else {}
    cfg = conf(vocab_size=vocab, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=n_kv_head,
               max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=tie,
               rope_parameters=rope or {"rope_type": "default", "rope_theta": 500.0},
               eos_token_id=0, bos_token_id=0, **kw)
    model = getattr(transformers, f"{ARCHS[arch]}ForCausalLM")(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.25 if p.dim() == 2 else 1.0)
    model.eval()
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    for f in (tok_dir.iterdir() if tok_dir else ()):
        (out / f.name).write_bytes(f.read_bytes())
    return model


def run_args(data: Path | str, out: Path, *extra: str) -> list[str]:
    """tests.harness' tiny-run flags without its --model.* ones (init_from gives the model); `data`
    a directory, or a `--data.mix` string."""
    pairs = list(zip(TINY_ARGS[::2], TINY_ARGS[1::2], strict=True))
    return ["--data.mix" if isinstance(data, str) else "--data.path", str(data), "--log.out_dir", str(out),
            *(a for k, v in pairs if not k.startswith("--model.") for a in (k, v)), *extra]
