"""RoPE pinned against an independent reference: Hugging Face Llama's `rotate_half` formulation,
written out here in float64, at the level of `apply_rope`/`rope_tables` and of a whole attention
layer (so RoPE dropped from the forward, a flipped sign or a wrong angle all fail)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.model import GPT, ModelConfig
from lmforge.model.model import apply_rope, rope_tables

CFG = ModelConfig(vocab_size=97, n_layer=1, n_head=4, n_kv_head=2, d_model=64, max_seq_len=48,
                  rope_theta=1000.0)
TOL = 1e-5


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def reference_rope(x_BTNK: torch.Tensor, theta: float) -> torch.Tensor:
    """transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb, in float64."""
    T, K = x_BTNK.shape[1], x_BTNK.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, K, 2, dtype=torch.float64) / K)
    freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (T, 1, K)
    x = x_BTNK.double()
    return x * emb.cos() + rotate_half(x) * emb.sin()


def test_apply_rope_matches_rotate_half_reference():
    torch.manual_seed(0)
    x_BTNK = torch.randn(2, CFG.max_seq_len, 3, CFG.head_dim)
    cos, sin = rope_tables(CFG)
    ours = apply_rope(x_BTNK, cos[:, None], sin[:, None])
    ref = reference_rope(x_BTNK, CFG.rope_theta)
    assert (ours.double() - ref).abs().max() < TOL
    # The control: positions beyond 0 really are rotated, far beyond the tolerance.
    assert (ref - x_BTNK.double())[:, 1:].abs().max() > 0.5


def test_rotation_scores_depend_only_on_relative_position():
    torch.manual_seed(1)
    q, k = torch.randn(2, 1, 1, 1, CFG.head_dim).unbind(0)
    cos, sin = rope_tables(CFG)

    def score(i, j):
        qi = apply_rope(q, cos[i : i + 1, None], sin[i : i + 1, None])
        kj = apply_rope(k, cos[j : j + 1, None], sin[j : j + 1, None])
        return (qi * kj).sum().item()

    assert score(9, 4) == pytest.approx(score(30, 25), abs=1e-4)
    assert abs(score(9, 4) - score(9, 8)) > 1e-2  # and the offset matters


def reference_attention(attn, x_BTD: torch.Tensor, theta: float | None) -> torch.Tensor:
    """One attention layer from its weights alone: q/k/v split, reference RoPE (none when theta
    is None), GQA by repeating k/v heads, causal softmax attention, output projection; float64."""
    B, T, _ = x_BTD.shape
    H, G, K = attn.n_head, attn.n_kv_head, attn.head_dim
    w = attn.qkv.weight.double()
    qkv = x_BTD.double() @ w.T
    rope = (lambda x: x) if theta is None else (lambda x: reference_rope(x, theta))
    q = rope(qkv[..., : H * K].view(B, T, H, K)).transpose(1, 2)
    k = rope(qkv[..., H * K : (H + G) * K].view(B, T, G, K)).transpose(1, 2)
    v = qkv[..., (H + G) * K :].view(B, T, G, K).transpose(1, 2)
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    scores = q @ k.transpose(-1, -2) / K**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = F.softmax(scores, dim=-1) @ v
    return y.transpose(1, 2).reshape(B, T, H * K) @ attn.proj.weight.double().T


def test_attention_layer_applies_rope_like_the_reference():
    torch.manual_seed(2)
    model = GPT(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)  # attention far from uniform: position information matters
    attn = model.blocks[0].attn
    x_BTD = torch.randn(2, 40, CFG.d_model)
    T = x_BTD.shape[1]
    with torch.no_grad():
        ours = attn(x_BTD, model.rope_cos[:T, None], model.rope_sin[:T, None])
        ref = reference_attention(attn, x_BTD, CFG.rope_theta)
        without_rope = reference_attention(attn, x_BTD, None)
    assert (ours.double() - ref).abs().max() < TOL * ref.abs().max()
    assert (without_rope - ref).abs().max() > 100 * TOL * ref.abs().max()
