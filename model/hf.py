"""Export to / import from the Hugging Face Llama format (config.json + model.safetensors), or
Qwen3's for a model with model.qk_norm (Qwen3's block is Llama's plus an RMSNorm over each
head's queries and keys before RoPE: transformers >= 4.51 reads it). Options no such model
represents (a non-SwiGLU MLP, logit softcapping, value embeddings) are refused by name.

Our RoPE already rotates (x[i], x[i + K/2]) pairs, the half-split layout of HF Llama's
rotate_half, so q/k weights map across unpermuted (the logit-parity tests in tests/test_hf.py
would fail otherwise). Only the fused projections are split/joined: qkv ↔ q_proj/k_proj/v_proj
and the SwiGLU up ↔ gate_proj/up_proj; the vocabulary padding rows are dropped on export and
restored (as zeros) on import.

config.json is read by every transformers we allow (pyproject: >= 4.45): 4.x reads the
top-level `rope_theta` and `torch_dtype` and silently defaults to 10000 and fp32 without them,
5.x reads `rope_parameters` and `dtype`, so both forms are written. tests/test_hf.py checks the
logits against the oldest allowed transformers as well as the installed one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.model import GPT, ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
GENERATION_FILE = "generation_config.json"
COMPILED_PREFIX = "_orig_mod."  # what torch.compile puts in front of state_dict keys


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                   eos_token_id: int | None = None) -> dict:
    """The transformers LlamaConfig, or Qwen3Config with model.qk_norm (config.json), describing
    the same network; ValueError naming an option neither holds (check_exportable).

    eos_token_id is the end-of-text id, which is also the bos: documents start with it in the
    training shards (and `lmforge sample` prompts with it), so generation starts and stops there."""
    check_exportable(cfg)
    arch = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if cfg.qk_norm:
        arch = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": cfg.n_layer, "layer_types": ["full_attention"] * cfg.n_layer}
    return arch | {
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
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    }


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


def hf_generation_dict(eos_token_id: int | None) -> dict:
    """generation_config.json: `generate()` stops at end-of-text and pads with it (the model has
    no pad token, and padding is masked anyway)."""
    return {"bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id}


def _split_rows(w: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return [part.contiguous() for part in w.split(sizes, dim=0)]


def export_hf(model_or_state, cfg: ModelConfig, out_dir, dtype: torch.dtype = torch.float32,
              eos_token_id: int | None = None) -> Path:
    """Write out_dir/config.json, generation_config.json and model.safetensors for
    LlamaForCausalLM (Qwen3ForCausalLM with model.qk_norm). Pass the tokenizer's end-of-text
    id as eos_token_id, or generation never stops at the end of a text."""
    hf_cfg = hf_config_dict(cfg, dtype, eos_token_id)
    sd = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else model_or_state
    sd = {k.removeprefix(COMPILED_PREFIX): v.detach().to("cpu", dtype) for k, v in sd.items()}
    H, G, K, V = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.vocab_size
    out = {
        "model.embed_tokens.weight": sd["tok_emb.weight"][:V].contiguous(),
        "model.norm.weight": sd["norm_f.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"][:V].contiguous()
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = _split_rows(sd[ours + "attn.qkv.weight"], [H * K, G * K, G * K])
        gate, up = _split_rows(sd[ours + "mlp.up.weight"], [cfg.mlp_hidden] * 2)
        out |= {
            theirs + "input_layernorm.weight": sd[ours + "attn_norm.weight"],
            theirs + "self_attn.q_proj.weight": q,
            theirs + "self_attn.k_proj.weight": k,
            theirs + "self_attn.v_proj.weight": v,
            theirs + "self_attn.o_proj.weight": sd[ours + "attn.proj.weight"],
            theirs + "post_attention_layernorm.weight": sd[ours + "mlp_norm.weight"],
            theirs + "mlp.gate_proj.weight": gate,
            theirs + "mlp.up_proj.weight": up,
            theirs + "mlp.down_proj.weight": sd[ours + "mlp.down.weight"],
        }
        if cfg.qk_norm:
            out |= {theirs + f"self_attn.{n}_norm.weight": sd[ours + f"attn.{n}_norm.weight"] for n in "qk"}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in out.items()}, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2) + "\n")
    (out_dir / GENERATION_FILE).write_text(json.dumps(hf_generation_dict(eos_token_id), indent=2) + "\n")
    return out_dir


def _config_from_hf(hf: dict) -> ModelConfig:
    rope = hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
    unsupported = {
        "model_type": hf.get("model_type") not in ("llama", "qwen3"),
        "use_sliding_window": hf.get("use_sliding_window", False),
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "rope_parameters.rope_type": rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"),
        "attention_bias": hf.get("attention_bias", False),
        "mlp_bias": hf.get("mlp_bias", False),
    }
    for key, bad in unsupported.items():
        if bad:
            raise ValueError(f"cannot import this Hugging Face model: unsupported {key} "
                             "(plain Llama or Qwen3 only)")
    n_head = hf["num_attention_heads"]
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head,
        d_model=hf["hidden_size"],
        d_mlp=hf["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_seq_len=hf["max_position_embeddings"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
        qk_norm=hf["model_type"] == "qwen3",
    )
    if hf.get("head_dim", cfg.head_dim) != cfg.head_dim:
        raise ValueError(f"cannot import: head_dim {hf['head_dim']} != hidden_size / num_attention_heads")
    return cfg


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat((w, w.new_zeros(rows - w.shape[0], w.shape[1])))


def import_hf(hf_dir) -> GPT:
    """Build our GPT (fp32, CPU) from a Llama or Qwen3 config.json + model.safetensors directory."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / WEIGHTS_FILE).exists():
        raise ValueError(f"{hf_dir / WEIGHTS_FILE} not found (sharded checkpoints are not supported)")
    cfg = _config_from_hf(json.loads((hf_dir / CONFIG_FILE).read_text()))
    hf = {k: v.float() for k, v in load_file(hf_dir / WEIGHTS_FILE).items()}
    Vp = cfg.padded_vocab_size
    sd = {
        "tok_emb.weight": _pad_rows(hf["model.embed_tokens.weight"], Vp),
        "norm_f.weight": hf["model.norm.weight"],
    }
    # A tied model's state_dict lists the shared matrix under both names.
    sd["lm_head.weight"] = sd["tok_emb.weight"] if cfg.tie_embeddings else _pad_rows(hf["lm_head.weight"], Vp)
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        attn, mlp = theirs + "self_attn.", theirs + "mlp."
        sd |= {
            ours + "attn_norm.weight": hf[theirs + "input_layernorm.weight"],
            ours + "attn.qkv.weight": torch.cat([hf[attn + p + "_proj.weight"] for p in "qkv"]),
            ours + "attn.proj.weight": hf[attn + "o_proj.weight"],
            ours + "mlp_norm.weight": hf[theirs + "post_attention_layernorm.weight"],
            ours + "mlp.up.weight": torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]),
            ours + "mlp.down.weight": hf[mlp + "down_proj.weight"],
        }
        if cfg.qk_norm:
            sd |= {ours + f"attn.{n}_norm.weight": hf[attn + f"{n}_norm.weight"] for n in "qk"}
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.init_weights()  # RoPE tables (and the tie); every parameter is then overwritten
    model.load_state_dict(sd)
    return model
