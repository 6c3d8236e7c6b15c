"""Export to / import from the Hugging Face Llama format (config.json + model.safetensors), Qwen3's
for a model with model.qk_norm (Qwen3's block is Llama's plus an RMSNorm over each head's queries
and keys before RoPE: transformers >= 4.51 reads it), or Qwen2's for one with model.qkv_bias
(Llama's with biases on q, k and v). Llama 3.1's rope scaling is written and read as
transformers 4.x (`rope_scaling`) and 5.x (`rope_parameters`) name it. Options no such model
represents (a non-SwiGLU MLP, logit softcapping, value embeddings, QK-norm with biases) are
refused by name.

One table, `weight_table`, read both ways: export splits our tensors by it, import
(pipeline/checkpoint/hf_init.py, which reads the files) stacks Hugging Face's by it, so an import
that does not round-trip through the export cannot exist. Our RoPE already rotates
(x[i], x[i + K/2]) pairs, the half-split layout of HF Llama's rotate_half, and Hugging Face's
checkpoints are stored in that layout, so q/k weights map across unpermuted (the logit-parity
tests in tests/test_hf_export.py would fail otherwise). Only the fused projections are split/joined:
qkv <-> q_proj/k_proj/v_proj and the SwiGLU up <-> gate_proj/up_proj; the vocabulary padding rows
are dropped on export and restored (as zeros) on import.

config.json is read by every transformers we allow (pyproject: >= 4.45): 4.x reads the
top-level `rope_theta` and `torch_dtype` and silently defaults to 10000 and fp32 without them,
5.x reads `rope_parameters` and `dtype`, so both forms are written. tests/test_hf_export.py checks the
logits against the oldest allowed transformers as well as the installed one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from lmforge.model.model import ModelConfig, state_shapes

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
GENERATION_FILE = "generation_config.json"
COMPILED_PREFIX = "_orig_mod."  # what torch.compile puts in front of state_dict keys


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                   eos_token_id: int | None = None, bos_token_id: int | None = None) -> dict:
    """The transformers LlamaConfig, Qwen3Config (model.qk_norm) or Qwen2Config (model.qkv_bias)
    as config.json, describing the same network; ValueError naming an option none holds.

    eos_token_id is the end-of-text id, which is also the bos unless the tokenizer adds a BOS of
    its own (bos_token_id): documents start with it in the training shards (and `lmforge sample`
    prompts with it), so generation starts and stops there."""
    check_exportable(cfg)
    arch = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if cfg.qk_norm or cfg.qkv_bias:
        name = "Qwen3" if cfg.qk_norm else "Qwen2"
        arch = {"architectures": [f"{name}ForCausalLM"], "model_type": name.lower(),
                "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": cfg.n_layer, "layer_types": ["full_attention"] * cfg.n_layer}
    rope = {"rope_type": "default"}
    if cfg.rope_scaling:
        rope = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_scaling_factor,
                "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_len}
    hf = arch | {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope | {"rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "bos_token_id": eos_token_id if bos_token_id is None else bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    } | ({"rope_scaling": rope} if cfg.rope_scaling else {})  # transformers 4.x's key
    if arch["model_type"] == "qwen2":  # Qwen2 has no head_dim key: 4.x derives it
        del hf["head_dim"]
    return hf


def check_exportable(cfg: ModelConfig) -> None:
    """ValueError naming the first option of `cfg` that no Hugging Face architecture holds."""
    if cfg.mlp != "swiglu":
        raise ValueError(f"model.mlp={cfg.mlp!r} has no Hugging Face counterpart (Llama and Qwen3 "
                         "are SwiGLU only); train with model.mlp='swiglu' to export")
    if cfg.logit_softcap:
        raise ValueError(f"model.logit_softcap={cfg.logit_softcap} has no Hugging Face counterpart "
                         "(Llama and Qwen3 do not cap logits); train with model.logit_softcap=0 to export")
    if cfg.value_embeds:
        raise ValueError("model.value_embeds=true has no Hugging Face counterpart (Llama and Qwen3 "
                         "have no value embeddings); train with model.value_embeds=false to export")
    if cfg.qk_norm and cfg.qkv_bias:
        raise ValueError("model.qk_norm with model.qkv_bias has no Hugging Face counterpart (Qwen3 "
                         "has the norms, Qwen2 the biases); train with one of them to export")
    if cfg.qkv_bias and cfg.head_dim * cfg.n_head != cfg.d_model:
        raise ValueError(f"model.qkv_bias with model.d_head={cfg.d_head} apart from d_model / n_head "
                         "has no Hugging Face counterpart (Qwen2's head_dim is always that); "
                         "leave model.d_head unset to export")


def hf_generation_dict(eos_token_id: int | None, bos_token_id: int | None = None) -> dict:
    """generation_config.json: `generate()` stops at end-of-text and pads with it (the model has
    no pad token, and padding is masked anyway)."""
    bos = eos_token_id if bos_token_id is None else bos_token_id
    return {"bos_token_id": bos, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id}


def weight_table(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """The conversion table: each of our weights -> the Hugging Face tensors stacked by rows
    (dim 0) to make it, with their rows. A tied model's head is its embedding (no entry). Our
    embedding and head have padded_vocab_size rows, Hugging Face's vocab_size: the rest is zeros.
    The fused qkv's bias (model.qkv_bias) stacks as its weight does."""
    H, G, K, D, F, V = (cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_model, cfg.mlp_hidden,
                        cfg.vocab_size)
    table = {"tok_emb.weight": [("model.embed_tokens.weight", V)],
             "norm_f.weight": [("model.norm.weight", D)]}
    if not cfg.tie_embeddings:
        table["lm_head.weight"] = [("lm_head.weight", V)]
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        attn, mlp = theirs + "self_attn.", theirs + "mlp."
        table |= {
            ours + "attn_norm.weight": [(theirs + "input_layernorm.weight", D)],
            ours + "attn.qkv.weight": [(attn + "q_proj.weight", H * K), (attn + "k_proj.weight", G * K),
                                       (attn + "v_proj.weight", G * K)],
            ours + "attn.proj.weight": [(attn + "o_proj.weight", D)],
            ours + "mlp_norm.weight": [(theirs + "post_attention_layernorm.weight", D)],
            ours + "mlp.up.weight": [(mlp + "gate_proj.weight", F), (mlp + "up_proj.weight", F)],
            ours + "mlp.down.weight": [(mlp + "down_proj.weight", D)],
        }
        if cfg.qk_norm:
            table |= {ours + f"attn.{n}_norm.weight": [(attn + f"{n}_norm.weight", K)] for n in "qk"}
        if cfg.qkv_bias:
            table[ours + "attn.qkv.bias"] = [(attn + f"{n}_proj.bias", r) for n, r in zip(
                "qkv", (H * K, G * K, G * K))]
    return table


def hf_shapes(cfg: ModelConfig, most: int) -> dict[str, tuple[int, ...]] | None:
    """The shape of every tensor a Hugging Face checkpoint of `cfg` holds (no memory used); None
    when it would hold more than `most` tensors (model.model.state_shapes)."""
    ours = state_shapes(cfg, most + 1)  # ours may count a tied head theirs leaves out
    if ours is None:
        return None
    return {name: (rows, *ours[k][1:]) for k, parts in weight_table(cfg).items() for name, rows in parts}


def export_hf(model_or_state, cfg: ModelConfig, out_dir, dtype: torch.dtype = torch.float32,
              eos_token_id: int | None = None, bos_token_id: int | None = None) -> Path:
    """Write out_dir/config.json, generation_config.json and model.safetensors for
    LlamaForCausalLM (Qwen3ForCausalLM with model.qk_norm). Pass the tokenizer's end-of-text
    id as eos_token_id, or generation never stops at the end of a text."""
    hf_cfg = hf_config_dict(cfg, dtype, eos_token_id, bos_token_id)
    sd = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else model_or_state
    sd = {k.removeprefix(COMPILED_PREFIX): v.detach().to("cpu", dtype) for k, v in sd.items()}
    out = {}
    for ours, parts in weight_table(cfg).items():
        rows = [r for _, r in parts]
        out |= {name: w.contiguous() for (name, _), w in zip(parts, sd[ours][:sum(rows)].split(rows))}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2) + "\n")
    generation = hf_generation_dict(eos_token_id, bos_token_id)
    (out_dir / GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir


MODEL_TYPES = ("llama", "qwen2", "qwen3")
LLAMA3_KEYS = {"rope_scaling_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
               "rope_high_freq_factor": "high_freq_factor"}


def _rope_type(rope: dict):
    return rope.get("rope_type", rope.get("type", "default"))  # "type": before transformers 4.45


def _refused(hf: dict, rope: dict) -> str | None:
    """The first config.json key (with its value) naming what our GPT does not model."""
    shown = hf | {k: rope.get(k) for k in ("partial_rotary_factor",)} | {"rope_type": _rope_type(rope)}
    checks = {
        "model_type": hf.get("model_type") not in MODEL_TYPES,
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        # Llama's and Qwen3's biases are on o_proj too; Qwen2's q/k/v biases have no key
        "attention_bias": hf.get("attention_bias", False),
        "mlp_bias": hf.get("mlp_bias", False),
        "rope_type": _rope_type(rope) not in ("default", "llama3"),
        "partial_rotary_factor": rope.get("partial_rotary_factor", 1.0) != 1.0,
        "use_sliding_window": hf.get("use_sliding_window", False),
        "layer_types": not isinstance(hf.get("layer_types") or [], list) or any(
            t != "full_attention" for t in hf.get("layer_types") or ()),
        "num_experts": hf.get("num_experts"),
        "num_local_experts": hf.get("num_local_experts"),
        "attention_dropout": hf.get("attention_dropout", 0.0),
    }
    bad = next((k for k, b in checks.items() if b), None)
    return bad and f"{bad} = {json.dumps(shown.get(bad))[:80]}"


def _number(d: dict, key: str, kind: type, default=None):
    """d[key] (or `default`) as an int (kind int: a positive one) or float; ValueError naming it."""
    value = d.get(key, default)
    if value is None:
        raise ValueError(f"config.json lacks {key!r}")
    ok = type(value) is int and value > 0 if kind is int else type(value) in (int, float)
    if not ok:
        shown = json.dumps(value)[:40]
        raise ValueError(f"config.json's {key} = {shown} is not a {'positive integer' if kind is int else 'number'}")
    return kind(value)


def _rope(hf: dict) -> dict:
    """config.json's RoPE settings, as 5.x's `rope_parameters` and 4.x's `rope_scaling` (with a
    top-level rope_theta and partial_rotary_factor) give them, merged; ValueError where either
    is not an object, or both are given and disagree (4.x would read one, 5.x the other)."""
    given = {key: hf.get(key) or {} for key in ("rope_scaling", "rope_parameters")}
    for key, value in given.items():
        if not isinstance(value, dict):
            raise ValueError(f"config.json's {key} = {json.dumps(value)[:40]} is not an object")
    old, new = given.values()
    legacy = {k: hf[k] for k in ("rope_theta", "partial_rotary_factor") if k in hf} | old
    if old and new and _rope_type(old) != _rope_type(new) or any(
            new[k] != v for k, v in legacy.items() if k in new):
        raise ValueError("config.json's rope_scaling (and rope_theta) and rope_parameters "
                         f"disagree ({json.dumps(legacy)[:60]} vs {json.dumps(new)[:60]})")
    return legacy | new


def config_from_hf(hf: dict) -> ModelConfig:
    """Our ModelConfig of a Llama, Qwen2 or Qwen3 config.json; ValueError naming the first key of
    a feature we do not model (o_proj biases, rope scaling other than Llama 3.1's, sliding windows,
    experts, ...) or of a value we cannot use."""
    if not isinstance(hf, dict):
        raise ValueError("config.json is not a JSON object")
    rope = _rope(hf)
    if bad := _refused(hf, rope):
        raise ValueError(f"unsupported {bad} (lmforge loads Llama, Qwen2 and Qwen3 models, "
                         "with Llama 3.1's rope scaling or none)")
    n_head, d_model = _number(hf, "num_attention_heads", int), _number(hf, "hidden_size", int)
    head_dim = _number(hf, "head_dim", int, d_model // n_head or None)
    scaling = _rope_type(rope) == "llama3"
    if type(tied := hf.get("tie_word_embeddings", False)) is not bool:
        raise ValueError(f"config.json's tie_word_embeddings = {json.dumps(tied)[:40]} is not true or false")
    llama3 = {ours: _number(rope, theirs, float) for ours, theirs in LLAMA3_KEYS.items()} | {
        "rope_original_max_len": _number(rope, "original_max_position_embeddings", int,
                                         hf.get("max_position_embeddings"))} if scaling else {}
    return ModelConfig(
        vocab_size=_number(hf, "vocab_size", int), n_layer=_number(hf, "num_hidden_layers", int),
        n_head=n_head, n_kv_head=_number(hf, "num_key_value_heads", int, n_head), d_model=d_model,
        d_head=None if head_dim * n_head == d_model else head_dim,
        d_mlp=_number(hf, "intermediate_size", int),
        rope_theta=_number(rope, "rope_theta", float, 10000.0),
        rope_scaling="llama3" if scaling else "", **llama3,
        max_seq_len=_number(hf, "max_position_embeddings", int),
        norm_eps=_number(hf, "rms_norm_eps", float, 1e-6),
        tie_embeddings=tied,
        init_std=_number(hf, "initializer_range", float, 0.02),
        qk_norm=hf["model_type"] == "qwen3", qkv_bias=hf["model_type"] == "qwen2")
