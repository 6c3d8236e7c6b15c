"""Eager attention (HF's "eager", nanoGPT's path without flash): it saves the probabilities for
backward, but where the CPU's flash kernel is slow (bf16 without AMX, short sequences) it is much
faster (pipeline.attention's rule). Causal by blocks of queries, each computing only the keys its
rows see: about half the T x S scores, as flash kernels skip them."""

from __future__ import annotations

import torch

QUERY_BLOCK = 128  # smaller blocks skip more masked scores, in more and smaller matmuls


def eager_attention(q_BHTK: torch.Tensor, k_BGSK: torch.Tensor, v_BGSK: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                    enable_gqa: bool = False) -> torch.Tensor:
    """SDPA's result (no dropout, default scale) from two matmuls and a softmax. A boolean
    attn_mask is True where a query may attend; is_causal is SDPA's top-left causal mask, computed
    by query blocks (causal_blocks) that skip the keys no query of theirs sees."""
    H, K = q_BHTK.shape[1], q_BHTK.shape[3]
    G = k_BGSK.shape[1]
    if enable_gqa and G != H:
        k_BGSK = k_BGSK.repeat_interleave(H // G, dim=1)
        v_BGSK = v_BGSK.repeat_interleave(H // G, dim=1)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q_BHTK.dtype,
                                device=q_BHTK.device).masked_fill_(~attn_mask, float("-inf"))
    # The scale on q (T x K values) rather than on the scores (T x S).
    q_BHTK = q_BHTK * K**-0.5
    if not is_causal:
        return _attend(q_BHTK, k_BGSK, v_BGSK, attn_mask)
    T, S = q_BHTK.shape[2], k_BGSK.shape[2]
    bias_TS = torch.full((T, S), float("-inf"), dtype=q_BHTK.dtype, device=q_BHTK.device).triu(1)
    y = [_attend(q_BHTK[:, :, a:b], k_BGSK[:, :, :keys], v_BGSK[:, :, :keys], bias_TS[a:b, :keys])
         for a, b, keys in causal_blocks(T, S)]
    return y[0] if len(y) == 1 else torch.cat(y, dim=2)


def _attend(q_BHTK, k_BHSK, v_BHSK, bias_TS):
    # In the scores' dtype: CPU softmax computes bf16 in fp32 inside.
    s_BHTS = q_BHTK @ k_BHSK.transpose(-1, -2)
    if bias_TS is not None:
        s_BHTS = s_BHTS + bias_TS
    return torch.softmax(s_BHTS, dim=-1) @ v_BHSK


def causal_blocks(T: int, S: int) -> list[tuple[int, int, int]]:
    """Causal eager attention's query blocks (first row, end row, keys seen): under SDPA's
    top-left mask no query of rows [a, b) sees a key at or past b, so each block's scores stop
    there: about (1 + QUERY_BLOCK / T) / 2 of the T x S scores."""
    return [(a, min(a + QUERY_BLOCK, T), min(a + QUERY_BLOCK, S)) for a in range(0, T, QUERY_BLOCK)]

