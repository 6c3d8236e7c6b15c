"""Held-out loss, perplexity and bits per byte: one function for training's periodic eval and for
`lmforge eval`, which cut the split into the very same windows and batches (`eval_batches`), so
the two report the same number for the same checkpoint and tokens. Bits per byte (the summed
nats / ln 2 / the UTF-8 bytes of the targets) compares models with different tokenizers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.model import IGNORE_INDEX
from lmforge.pipeline.attention import Attend
from lmforge.pipeline.data.windows import TokenWindows
from lmforge.pipeline.loss import HeadLoss
from lmforge.pipeline.parallel.distributed import DistInfo, all_reduce_sum
from lmforge.pipeline.parallel.parallelize import Precision


@dataclass(frozen=True)
class EvalResult:
    loss: float
    perplexity: float
    bits_per_byte: float
    tokens: int
    bytes: int


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
             token_bytes: torch.Tensor, info: DistInfo, *, precision: Precision,
             loss_fn: HeadLoss, attend: Attend = F.scaled_dot_product_attention) -> EvalResult:
    """Loss, tokens and bytes over this rank's batches (IGNORE_INDEX targets not counted), reduced
    over ranks; `token_bytes[id]` is token id's UTF-8 length (0 for special tokens). loss_fn and
    attend: training passes its own, so a compiled model is not compiled again for eval. Every
    rank passes as many batches (FSDP runs each forward on all ranks): `eval_batches` pads."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=info.device)
    token_bytes = token_bytes.to(info.device)
    for x_BT, y_BT in batches:
        x_BT, y_BT = x_BT.to(info.device), y_BT.to(info.device)
        with precision.autocast(model):
            loss_sum = model(x_BT, y_BT, reduction="sum", loss_fn=loss_fn, attend=attend)
        valid_BT = y_BT != IGNORE_INDEX
        sums[0] += loss_sum.double()
        sums[1] += valid_BT.sum()
        sums[2] += (token_bytes[y_BT.clamp(min=0)] * valid_BT).sum().double()
    all_reduce_sum(sums, info)
    model.train(was_training)
    loss_sum, n_tokens, n_bytes = sums.tolist()
    if n_tokens == 0:
        raise ValueError("evaluation saw no tokens")
    loss = loss_sum / n_tokens
    bpb = loss_sum / (math.log(2) * n_bytes) if n_bytes else float("nan")
    return EvalResult(loss, math.exp(loss), bpb, int(n_tokens), int(n_bytes))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def eval_batches(windows: TokenWindows, batch_size: int, rank: int, world_size: int,
                 max_tokens: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (x_BT, y_BT) batches for the first `max_tokens` targets of the split (all when
    None). Window j predicts tokens jT+1 .. min(jT+T, M), so the windows tile the M targets
    exactly (the last may be shorter); it goes to rank j % world_size, so the union is the same
    at any world size. Every rank gets as many batches of one shape; short and missing rows are
    padded with IGNORE_INDEX targets, which `evaluate` skips."""
    T = windows.seq_len
    M = windows.num_tokens - 1 if max_tokens is None else min(max_tokens, windows.num_tokens - 1)
    if M < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    n = _ceil_div(M, T)
    mine = range(rank, n, world_size)
    most = _ceil_div(n, world_size)  # the most windows any rank has
    # A batch size above that would only add padding rows, computed and thrown away.
    batch_size = min(batch_size, most)
    x_NT = torch.zeros(_ceil_div(most, batch_size) * batch_size, T, dtype=torch.int64)
    y_NT = torch.full_like(x_NT, IGNORE_INDEX)
    for row, j in enumerate(mine):
        tokens = torch.from_numpy(windows.tokens(j * T, min(j * T + T, M) + 1))
        x_NT[row, :len(tokens) - 1] = tokens[:-1]
        y_NT[row, :len(tokens) - 1] = tokens[1:]
    return list(zip(x_NT.split(batch_size), y_NT.split(batch_size)))
