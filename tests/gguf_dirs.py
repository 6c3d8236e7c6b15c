"""Fixtures of the GGUF / export-identity tests: a SmolLM2-Instruct-shaped Hugging Face directory
(Digits + ByteLevel tokenizer, `<|endoftext|>` 0, `<|im_start|>` 1 = bos, `<|im_end|>` 2 =
eos = pad, a chat template, tokenizer-side files written the way a release has them), tiny
models of other shapes, and llama.cpp's side of a parity check (greedy ids, logits)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.hf_dirs import EOS, TOKENIZER_VOCAB, corpus, make_model, make_tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK = ("<think>", "</think>")
# SmolLM2-Instruct's template, as it ships.
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
            "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\n' }}{% endif %}")
# Written as a release has them (key order, indentation, no final newline): a copy that
# re-serialises any of them is caught by comparing bytes.
SIDE_FILES = {
    "tokenizer_config.json": {"add_prefix_space": False, "bos_token": IM_START,
                              "clean_up_tokenization_spaces": False, "eos_token": IM_END,
                              "model_max_length": 8192, "pad_token": IM_END,
                              "tokenizer_class": "GPT2Tokenizer", "unk_token": EOS},
    "special_tokens_map.json": {"additional_special_tokens": [IM_START, IM_END],
                                "bos_token": IM_START, "eos_token": IM_END, "pad_token": IM_END},
    "generation_config.json": {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2,
                               "pad_token_id": 2, "transformers_version": "4.42.3"},
}


def smollm_tokenizer(out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=[EOS, IM_START, IM_END],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    for name, content in SIDE_FILES.items():
        (out / name).write_text(json.dumps(content, indent=1))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


def smollm_dir(out: Path) -> Path:
    """A random tied Llama of the SmolLM2-style tokenizer, config.json's ids 1 / 2 / 2."""
    import transformers

    smollm_tokenizer(out)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.25 if p.dim() == 2 else 1.0)
    side = (out / "generation_config.json").read_bytes()
    model.save_pretrained(out)
    (out / "generation_config.json").write_bytes(side)  # the release's, not save_pretrained's
    return out


def styled_dir(out: Path, style: str, arch: str = "llama") -> Path:
    """A tiny random model (tests/hf_dirs.py) with a tokenizer of `style` (gpt2, digits, llama3)."""
    tok = make_tokenizer(out / "tok", style)
    make_model(out / "model", arch=arch, tok_dir=tok, shard=None)
    return out / "model"


def llama(path: Path, n_ctx: int = 128):
    """llama.cpp on the GGUF, keeping every position's logits, K/V cached in f32 (its default,
    f16, rounds them: a parity check would measure that rounding, not the export)."""
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False,
                           n_threads=1, type_k=llama_cpp.GGML_TYPE_F32,
                           type_v=llama_cpp.GGML_TYPE_F32)


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    """float32[len(ids), n_vocab]: llama.cpp's logits at each position of `ids`."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def llama_greedy(llm, ids: list[int], n: int, stop: int) -> list[int]:
    """Up to n ids llama.cpp picks greedily after `ids`, stopping before `stop`."""
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if nxt == stop:
            break
        out.append(nxt)
        llm.eval([nxt])
    return out


def split_tokenizer(out: Path, style: str) -> Path:
    """tests/hf_dirs.py's tokenizers, and Qwen2's: its Split regex (single digits) + NFC, with
    (qwen2_think) Qwen3's `<think>` / `</think>`, added tokens that are not special."""
    if not style.startswith("qwen2"):
        return make_tokenizer(out, style)
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    from lmforge.launch.export_gguf import QWEN2_PATTERN

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=[EOS],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    if style == "qwen2_think":
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return out


def random_model(out: Path, arch: str, tok: Path, **extra) -> Path:
    """A random tiny `arch` (Qwen2 / Llama) of the tokenizer in `tok`, saved with its files."""
    import transformers

    torch.manual_seed(0)
    conf, model = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                   "llama": ("LlamaConfig", "LlamaForCausalLM")}[arch]
    cfg = getattr(transformers, conf)(
        vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, **extra)
    m = getattr(transformers, model)(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(std=0.25 if p.dim() == 2 else 1.0)
    m.save_pretrained(out)
    for f in tok.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


# Llama 3.2's scaling (factor 32) over a short original context, so that the tiny model's
# frequencies fall in all three of its bands.
LLAMA3_SCALING = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def llama3_factors(theta: float, dim: int, factor: float, low: float, high: float,
                   old: int) -> list[float]:
    """rope_freqs as llama.cpp's convert_hf_to_gguf.py computes it (LlamaModel), verbatim."""
    import math

    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out
