"""`lmforge export --gguf FILE`: a checkpoint -> one GGUF file that llama.cpp (and ollama, which
runs llama.cpp) loads, written with `gguf`, llama.cpp's own writer.

The weights are model/hf.py's Hugging Face tensors named by gguf's TensorNameMap (llama.cpp's
own table), as its convert_hf_to_gguf.py names them: arch `llama`, `qwen2` for a model with
q/k/v biases, `qwen3` for one with QK-norm. llama.cpp's `llama` rotates interleaved pairs
(x[2i], x[2i+1]) where Hugging Face (and our RoPE) rotates halves (x[i], x[i + K/2]), so q and k
are permuted as its converter does; qwen2/qwen3 rotate halves (NEOX) and are not. Llama 3
rope scaling becomes `rope_freqs.weight`, the factor dividing each frequency.

The tokenizer is written from our tiktoken ranks: the tokens in GPT-2's byte-to-unicode form,
the merges in rank order (each token split as tiktoken's BPE makes it, so llama.cpp merges as
tiktoken does), special tokens as CONTROL, ids without a token as UNUSED. llama.cpp picks its
split regex by name (`tokenizer.ggml.pre`); a pattern with no llama.cpp equal is refused.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from lmforge.data_prep.hf_tokenizer import (
    BYTE_LEVEL_PATTERN,
    DIGITS_BYTE_LEVEL_PATTERN,
    bytes_to_unicode,
)
from lmforge.data_prep.safe_files import check_file, check_writable, open_file
from lmforge.data_prep.tokenizer import (
    CL100K_PATTERN,
    GPT2_PATTERN,
    O200K_PATTERN,
    Encoding,
    bos_id,
    load_tokenizer_dir,
    mergeable_ranks,
)
from lmforge.launch.source import chat_template, first_id, source_dir, token_ids
from lmforge.model import ModelConfig
from lmforge.model.hf import COMPILED_PREFIX, hf_config_dict, weight_table
from lmforge.pipeline.config import ConfigError
from lmforge.pipeline.inference import LoadedCheckpoint, load_for_inference

MARKER_KEY = "lmforge.checkpoint"  # only a GGUF holding it is ever replaced
GGUF_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# Hugging Face's own split regexes (tokenizer.json's Split), as data_prep.hf_tokenizer reads them.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Our split pattern -> llama.cpp's pre-tokenizer doing the same split (src/llama-vocab.cpp).
# cl100k (tiktoken's, and what `bpe:N` trains with) is Llama 3's regex in tiktoken's dialect.
PRE_TOKENIZERS = {GPT2_PATTERN: "gpt-2", BYTE_LEVEL_PATTERN: "gpt-2", CL100K_PATTERN: "llama-bpe",
                  LLAMA3_PATTERN: "llama-bpe", QWEN2_PATTERN: "qwen2",
                  DIGITS_BYTE_LEVEL_PATTERN: "smollm", O200K_PATTERN: "gpt-4o"}


def gguf_arch(cfg: ModelConfig) -> str:
    """llama.cpp's architecture for `cfg`; ConfigError for what none of them holds."""
    try:  # the options no Hugging Face architecture holds are none of llama.cpp's either
        hf_config_dict(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    bias, scaled = getattr(cfg, "qkv_bias", False), getattr(cfg, "rope_scaling", "")
    if bias and (cfg.qk_norm or scaled):
        what = "model.qk_norm" if cfg.qk_norm else f"model.rope_scaling={scaled!r}"
        raise ConfigError(f"model.qkv_bias with {what} has no llama.cpp architecture (qwen2 has "
                          "biases alone); export it with --hf instead")
    if scaled not in ("", "llama3"):
        raise ConfigError(f"model.rope_scaling={scaled!r} has no GGUF form here (llama3 has)")
    return "qwen2" if bias else "qwen3" if cfg.qk_norm else "llama"


def pre_tokenizer(enc: Encoding) -> str:
    """tokenizer.ggml.pre: the llama.cpp pre-tokenizer splitting text as `enc` does."""
    name = PRE_TOKENIZERS.get(enc._pat_str)
    if name is None:
        raise ConfigError(f"tokenizer {enc.name!r} splits text with a pattern llama.cpp has no "
                          f"pre-tokenizer for ({enc._pat_str[:60]!r}...); export it with --hf, "
                          "or train with a tokenizer of GPT-2's, cl100k's, Llama 3's, Qwen2's "
                          "or SmolLM's split")
    return name


def bpe_parts(ranks: dict[bytes, int], token: bytes) -> list[bytes]:
    """`token` as tiktoken's BPE builds it, stopped before its own rank: the pair it merges last
    (llama.cpp's convert_hf_to_gguf.py, QwenModel.bpe)."""
    parts, rank = [bytes([b]) for b in token], ranks[token]
    while len(parts) > 1:
        pair_ranks = [ranks.get(a + b, rank) for a, b in zip(parts, parts[1:])]
        best = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
        if pair_ranks[best] >= rank:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts


def vocabulary(enc: Encoding, n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) for the model's n_vocab ids."""
    import gguf

    chars = bytes_to_unicode()
    text = lambda b: "".join(chars[x] for x in b)  # noqa: E731
    ranks = mergeable_ranks(enc)
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    merges = []
    for token, i in sorted(ranks.items(), key=lambda kv: kv[1]):
        tokens[i], types[i] = text(token), gguf.TokenType.NORMAL
        if len(token) > 1:
            parts = bpe_parts(ranks, token)
            if len(parts) != 2:
                raise ConfigError(f"tokenizer {enc.name!r}: token {token!r} is made by no merge "
                                  "of two tokens, which llama.cpp needs; export it with --hf")
            merges.append(" ".join(map(text, parts)))
    # Added tokens a text may contain (Qwen's `<think>`, where the tokenizer keeps them) are
    # matched in text by llama.cpp as USER_DEFINED, never as CONTROL.
    in_text = getattr(enc, "text_tokens", {})
    for name, i in enc._special_tokens.items():
        tokens[i] = name
        types[i] = gguf.TokenType.USER_DEFINED if name in in_text else gguf.TokenType.CONTROL
    return tokens, types, merges


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of each head from halves order to interleaved pairs (convert_hf_to_gguf's permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_factors(cfg: ModelConfig) -> torch.Tensor | None:
    """Llama 3 scaling as llama.cpp's rope_freqs: each frequency's divisor (None: unscaled)."""
    if getattr(cfg, "rope_scaling", "") != "llama3":
        return None
    from lmforge.model.model import rope_inv_freq  # the one home of the scaling rule

    return (rope_inv_freq(replace(cfg, rope_scaling="")) / rope_inv_freq(cfg)).float()


def hf_tensors(model: torch.nn.Module, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Each Hugging Face tensor of the model, split from ours by model/hf.py's weight_table
    (views: nothing copied); the vocabulary padding rows dropped."""
    sd = {k.removeprefix(COMPILED_PREFIX): v.detach() for k, v in model.state_dict().items()}
    for ours, parts in weight_table(cfg).items():
        rows = [r for _, r in parts]
        yield from zip((name for name, _ in parts), sd[ours][:sum(rows)].split(rows))


def gguf_tensors(model: torch.nn.Module, cfg: ModelConfig, arch: str,
                 dtype: torch.dtype) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, array) of every tensor llama.cpp reads; 1-D ones (norms, biases,
    rope_freqs) in f32, as llama.cpp's converter keeps them."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.n_layer)
    heads = {"q_proj": cfg.n_head, "k_proj": cfg.n_kv_head}
    for hf_name, t in hf_tensors(model, cfg):
        proj = hf_name.split(".")[-2]
        if arch == "llama" and proj in heads:
            t = permute(t, heads[proj])
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        yield name, t.to(dtype if t.dim() > 1 else torch.float32).cpu().contiguous()
    if (factors := rope_factors(cfg)) is not None:
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors


def as_array(t: torch.Tensor) -> tuple[np.ndarray, object]:
    """numpy has no bf16: its bits travel as uint16, typed BF16 for the writer."""
    import gguf

    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy(), gguf.GGMLQuantizationType.BF16
    return t.numpy(), None


def add_tokenizer(w, ckpt: LoadedCheckpoint, enc: Encoding) -> None:
    """The tokenizer's keys: vocabulary, merges, pre-tokenizer, bos/eos as trained (the source's
    where it came from a Hugging Face model), and its chat template where it has one."""
    pre = pre_tokenizer(enc)
    tokens, types, merges = vocabulary(enc, ckpt.config.vocab_size)
    ids = token_ids(ckpt.tokenizer_dir, enc)
    w.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(first_id(ids["bos_token_id"]))
    w.add_eos_token_id(first_id(ids["eos_token_id"]))
    if "pad_token_id" in ids:
        w.add_pad_token_id(first_id(ids["pad_token_id"]))
    # Our shards start every document with end-of-text (the BOS declared above); a Hugging Face
    # tokenizer starts a text with its BOS only where its post-processor adds one.
    w.add_add_bos_token(source_dir(ckpt.tokenizer_dir) is None or bos_id(enc) is not None)
    w.add_add_eos_token(False)
    if (template := chat_template(ckpt.tokenizer_dir)) is not None:
        w.add_chat_template(template)
    ranks = mergeable_ranks(enc)
    if missing := [b for b in range(256) if bytes([b]) not in ranks]:
        print(f"note: the vocabulary has no token for {len(missing)} single bytes (SmolLM's way); "
              "llama.cpp drops such a byte after merging its neighbours, `tokenizers` before: "
              "a text holding one may get other ids there", file=sys.stderr)
    if getattr(enc, "normalizer", None):
        print(f"note: tokenizer {enc.name!r} normalizes text to {enc.normalizer} first, which "
              f"llama.cpp does not: text already in {enc.normalizer} is tokenized the same",
              file=sys.stderr)


def add_model(w, cfg: ModelConfig, arch: str, dtype: str) -> None:
    import gguf

    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.mlp_hidden)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "bf16": gguf.LlamaFileType.MOSTLY_BF16}[dtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_gguf(ckpt: LoadedCheckpoint, enc: Encoding, arch: str, dtype: str, name: str, f) -> None:
    """The whole GGUF into the open file `f`: header, keys, tensor infos, then the tensors."""
    import gguf

    w = gguf.GGUFWriter(path=None, arch=arch)
    w.add_name(name)
    w.add_string(MARKER_KEY, f"{ckpt.path.resolve()} step {ckpt.step}")
    add_model(w, ckpt.config, arch, dtype)
    add_tokenizer(w, ckpt, enc)
    for name, t in gguf_tensors(ckpt.model, ckpt.config, arch, GGUF_DTYPES[dtype]):
        array, raw = as_array(t)
        w.add_tensor(name, array, raw_dtype=raw)
    # The writer opens files by name; given ours (opened by data_prep/safe_files' rule), it
    # writes there: a file object set before the header is the state its own open leaves.
    w.fout, w.state = [f], gguf.gguf_writer.WriterState.EMPTY
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    f.flush()
    os.fsync(f.fileno())


def check_target(out: Path) -> None:
    """FILE may be new or a GGUF this command wrote; never anything else (it is replaced)."""
    if out.name in ("", ".", "..") or (os.path.lexists(out) and not check_file(out, writing=True)):
        raise ConfigError(f"--gguf {out} is not a file name; give a path ending in a file's name")
    if not os.path.lexists(out):
        return
    try:
        import gguf

        with open_file(out, "rb", what="--gguf") as f:
            ours = MARKER_KEY in gguf.GGUFReader(f).fields
    except (ValueError, OSError, IndexError, KeyError):
        ours = False
    if not ours:
        raise ConfigError(f"--gguf {out} exists and is not a GGUF lmforge wrote; give a new path "
                          "(nothing was written)")


def export_gguf(ckpt_path: str | Path, out: Path, dtype: str = "f32") -> Path:
    """Write the checkpoint as the GGUF file `out` (beside it, then renamed into place)."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ConfigError("--gguf writes with llama.cpp's `gguf` package, which is not "
                          "installed: pip install 'lmforge[gguf]'") from None
    out = Path(os.path.abspath(out))
    check_target(out)
    check_writable(out.parent, what="--gguf")
    ckpt = load_for_inference(ckpt_path, "cpu")
    arch = gguf_arch(ckpt.config)
    enc = load_tokenizer_dir(ckpt.tokenizer_dir)
    pre_tokenizer(enc)  # refused before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        with open_file(tmp, "wb", what="--gguf") as f:
            write_gguf(ckpt, enc, arch, dtype, out.stem, f)
        os.replace(tmp, out)
    except OSError as e:
        raise ConfigError(f"cannot write the GGUF {out} ({e.strerror}); nothing was replaced: "
                          "free space, or give --gguf on another disk") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return out
