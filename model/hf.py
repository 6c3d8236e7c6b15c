"""Export to / import from the Hugging Face Llama format (config.json + model.safetensors), or
Qwen3's for a model with model.qk_norm (Qwen3's block is Llama's plus an RMSNorm over each
head's queries and keys before RoPE: transformers >= 4.51 reads it). Options no such model
represents (a non-SwiGLU MLP, logit softcapping, value embeddings) are refused by name.

One table, `weight_table`, read both ways: export splits our tensors by it, import
(pipeline/checkpoint/hf_init.py, which reads the files) stacks Hugging Face's by it, so an import
that does not round-trip through the export cannot exist. Our RoPE already rotates
(x[i], x[i + K/2]) pairs, the half-split layout of HF Llama's rotate_half, and Hugging Face's
checkpoints are stored in that layout, so q/k weights map across unpermuted (the logit-parity
tests in tests/test_hf.py would fail otherwise). Only the fused projections are split/joined:
qkv <-> q_proj/k_proj/v_proj and the SwiGLU up <-> gate_proj/up_proj; the vocabulary padding rows
are dropped on export and restored (as zeros) on import.

config.json is read by every transformers we allow (pyproject: >= 4.45): 4.x reads the
top-level `rope_theta` and `torch_dtype` and silently defaults to 10000 and fp32 without them,
5.x reads `rope_parameters` and `dtype`, so both forms are written. tests/test_hf.py checks the
logits against the oldest allowed transformers as well as the installed one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from lmforge.model.model import GPT, ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
GENERATION_FILE = "generation_config.json"
COMPILED_PREFIX = "_orig_mod."  # what torch.compile puts in front of state_dict keys


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                   eos_token_id: int | None = None, bos_token_id: int | None = None) -> dict:
    """The transformers LlamaConfig, or Qwen3Config with model.qk_norm (config.json), describing
    the same network; ValueError naming an option neither holds (check_exportable).

    eos_token_id is the end-of-text id, which is also the bos unless the tokenizer adds a BOS of
    its own (bos_token_id): documents start with it in the training shards (and `lmforge sample`
    prompts with it), so generation starts and stops there."""
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
        "bos_token_id": eos_token_id if bos_token_id is None else bos_token_id,
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


def hf_generation_dict(eos_token_id: int | None, bos_token_id: int | None = None) -> dict:
    """generation_config.json: `generate()` stops at end-of-text and pads with it (the model has
    no pad token, and padding is masked anyway)."""
    bos = eos_token_id if bos_token_id is None else bos_token_id
    return {"bos_token_id": bos, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id}


def weight_table(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """The conversion table: each of our weights -> the Hugging Face tensors stacked by rows
    (dim 0) to make it, with their rows. A tied model's head is its embedding (no entry). Our
    embedding and head have padded_vocab_size rows, Hugging Face's vocab_size: the rest is zeros."""
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
    return table


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a Hugging Face checkpoint of `cfg` holds (no memory used)."""
    with torch.device("meta"):
        ours = {k: tuple(v.shape) for k, v in GPT(cfg).state_dict().items()}
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


def _refused(hf: dict) -> str | None:
    """The first config.json key (with its value) naming what our GPT does not model."""
    rope = hf.get("rope_parameters") or {}
    checks = {
        "model_type": hf.get("model_type") not in ("llama", "qwen3"),
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "attention_bias": hf.get("attention_bias", False),
        "mlp_bias": hf.get("mlp_bias", False),
        "rope_scaling": hf.get("rope_scaling"),
        "rope_parameters": rope.get("rope_type", "default") != "default",
        "use_sliding_window": hf.get("use_sliding_window", False),
        "layer_types": any(t != "full_attention" for t in hf.get("layer_types") or ()),
        "num_experts": hf.get("num_experts") or hf.get("num_local_experts"),
        "attention_dropout": hf.get("attention_dropout", 0.0),
    }
    bad = next((k for k, b in checks.items() if b), None)
    return bad and f"{bad} = {json.dumps(hf.get(bad, rope))}"


def config_from_hf(hf: dict) -> ModelConfig:
    """Our ModelConfig of a Llama or Qwen3 config.json; ValueError naming the first key of a
    feature we do not model (biases, rope scaling, sliding windows, experts, ...)."""
    if not isinstance(hf, dict):
        raise ValueError("config.json is not a JSON object")
    if bad := _refused(hf):
        raise ValueError(f"unsupported {bad} (lmforge loads plain Llama and Qwen3 models only)")
    rope = hf.get("rope_parameters") or {}
    try:
        n_head, d_model = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or d_model // n_head
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]), n_layer=int(hf["num_hidden_layers"]), n_head=n_head,
            n_kv_head=int(hf.get("num_key_value_heads") or n_head), d_model=d_model,
            d_head=None if head_dim * n_head == d_model else int(head_dim),
            d_mlp=int(hf["intermediate_size"]),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            max_seq_len=int(hf["max_position_embeddings"]),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=float(hf.get("initializer_range", 0.02)), qk_norm=hf["model_type"] == "qwen3")
    except KeyError as e:
        raise ValueError(f"config.json lacks {e}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.json holds a value lmforge cannot use ({e})") from None
