"""Rotary position embeddings (RoPE): the frequencies, their tables and the rotation. `cfg` is a
model.model.ModelConfig (head_dim, rope_theta, max_seq_len and the rope_scaling keys)."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(cfg) -> torch.Tensor:
    """The K/2 rotary frequencies (fp32, CPU) the model uses: theta^(-2i/K) for pair i. Under
    rope_scaling = "llama3" (Llama 3.1/3.2), rescaled by wavelength as transformers'
    _compute_llama3_parameters does, op for op: wavelengths longer than rope_original_max_len /
    rope_low_freq_factor are stretched rope_scaling_factor times, those shorter than
    rope_original_max_len / rope_high_freq_factor kept, the band between interpolated (the
    logit-parity tests in tests/test_hf_init.py and tests/test_hf_export.py hold it to
    transformers)."""
    K = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, K, 2, dtype=torch.float32) / K)
    if cfg.rope_scaling != "llama3":
        return inv_freq
    old, low, high, factor = (cfg.rope_original_max_len, cfg.rope_low_freq_factor,
                              cfg.rope_high_freq_factor, cfg.rope_scaling_factor)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~(wavelen < old / high) * ~(wavelen > old / low), smoothed, scaled)


def rope_tables(cfg, device: torch.device | str | None = None):
    """RoPE tables (max_seq_len, K), fp32, laid out for apply_rope: with angle[t, i] =
    t · rope_inv_freq[i] for i < K/2, cos = [cos(angle), cos(angle)], sin = [-sin(angle), sin(angle)]."""
    inv_freq = rope_inv_freq(cfg).to(device)
    angle = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    cos, sin = angle.cos(), angle.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x_BTNK: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + K/2]) by its angle: the half-split layout of Hugging Face
    Llama's rotate_half, so q/k weights export unpermuted. The halves swap by slices and a cat:
    compiled, its backward reads whole runs of each half, where roll's wrapped index made
    inductor load element by element (bench/results/README.md, "Other": the RoPE kernel 8.5 ->
    5.8 ms a step). cos/sin broadcast to (B, T, 1, K)."""
    cos, sin = cos.to(x_BTNK.dtype), sin.to(x_BTNK.dtype)
    x1, x2 = x_BTNK.chunk(2, dim=-1)
    return x_BTNK * cos + torch.cat((x2, x1), dim=-1) * sin
