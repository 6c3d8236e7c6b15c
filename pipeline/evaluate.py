"""Held-out loss, perplexity and bits per byte — one function for training's periodic eval and
for `lmforge eval`, so the two report the same number for the same checkpoint and tokens.

Bits per byte divides the summed loss (nats) by ln 2 and by the UTF-8 bytes the target tokens
decode to, which makes models with different tokenizers comparable.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from pipeline.data import IGNORE_INDEX
from pipeline.distributed import DistInfo, all_reduce_sum
from pipeline.parallelize import autocast


@dataclass(frozen=True)
class EvalResult:
    loss: float
    perplexity: float
    bits_per_byte: float
    tokens: int
    bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def _max_over_ranks(n: int, info: DistInfo) -> int:
    if not info.is_distributed:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    token_bytes: torch.Tensor,
    info: DistInfo,
    *,
    bf16: bool = False,
) -> EvalResult:
    """Sum of token losses, token count and byte count over this rank's batches, reduced over
    ranks. `token_bytes[id]` is the UTF-8 length of token `id` (0 for special tokens); targets
    equal to IGNORE_INDEX are not counted."""
    was_training = model.training
    model.eval()
    batches = list(batches)
    # FSDP needs every rank in every forward: ranks with fewer batches run throw-away ones.
    n_calls = _max_over_ranks(len(batches), info)
    sums = torch.zeros(3, dtype=torch.float64, device=info.device)
    token_bytes = token_bytes.to(info.device)
    for i in range(n_calls):
        real = i < len(batches)
        x_BT, y_BT = batches[i] if real else batches[0] if batches else _dummy(info)
        x_BT, y_BT = x_BT.to(info.device), y_BT.to(info.device)
        with autocast(info.device, bf16):
            loss_sum = model(x_BT, y_BT, reduction="sum")
        if real:
            valid_BT = y_BT != IGNORE_INDEX  # padding rows keep every rank's batch count equal
            sums[0] += loss_sum.double()
            sums[1] += valid_BT.sum()
            sums[2] += (token_bytes[y_BT.clamp(min=0)] * valid_BT).sum().double()
    all_reduce_sum(sums, info)
    model.train(was_training)
    loss_sum, n_tokens, n_bytes = sums.tolist()
    if n_tokens == 0:
        raise ValueError("evaluation saw no tokens")
    loss = loss_sum / n_tokens
    return EvalResult(
        loss=loss,
        perplexity=math.exp(loss),
        bits_per_byte=loss_sum / (math.log(2) * n_bytes) if n_bytes else float("nan"),
        tokens=int(n_tokens),
        bytes=int(n_bytes),
    )


def _dummy(info: DistInfo) -> tuple[torch.Tensor, torch.Tensor]:
    zeros = torch.zeros(1, 1, dtype=torch.int64)
    return zeros, zeros
