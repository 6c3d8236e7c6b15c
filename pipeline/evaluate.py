"""Held-out loss, perplexity and bits per byte — one function for training's periodic eval and
for `lmforge eval`, so the two report the same number for the same checkpoint and tokens.

The eval set of a split is cut by `eval_batches` into non-overlapping windows: every token after
the first is a target exactly once, the last window being shorter when seq_len does not divide the
split (nothing is dropped). Training's val eval and `lmforge eval --max-tokens N` call it with the
same arguments, so they evaluate the very same windows in the very same batches.

Bits per byte divides the summed loss (nats) by ln 2 and by the UTF-8 bytes the target tokens
decode to, which makes models with different tokenizers comparable.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.model import IGNORE_INDEX
from pipeline.attention import Attend
from pipeline.data.windows import TokenWindows
from pipeline.loss import HeadLoss
from pipeline.parallel.distributed import DistInfo, all_reduce_sum
from pipeline.parallel.parallelize import Precision


@dataclass(frozen=True)
class EvalResult:
    loss: float
    perplexity: float
    bits_per_byte: float
    tokens: int
    bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    token_bytes: torch.Tensor,
    info: DistInfo,
    *,
    precision: Precision,
    loss_fn: HeadLoss,
    attend: Attend = F.scaled_dot_product_attention,
) -> EvalResult:
    """Sum of token losses, token count and byte count over this rank's batches, reduced over
    ranks. `token_bytes[id]` is the UTF-8 length of token `id` (0 for special tokens); targets
    equal to IGNORE_INDEX are not counted. loss_fn: the LM-head loss training computes (its
    own, compiled with the model when the run is; `lmforge eval`: the run's train.loss); attend: the attention (training passes its own,
    so a compiled model is not compiled again for eval).

    Every rank must pass the same number of batches (FSDP runs each forward on all ranks):
    `eval_batches` pads with IGNORE_INDEX rows to guarantee it."""
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
    return EvalResult(
        loss=loss,
        perplexity=math.exp(loss),
        bits_per_byte=loss_sum / (math.log(2) * n_bytes) if n_bytes else float("nan"),
        tokens=int(n_tokens),
        bytes=int(n_bytes),
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def eval_batches(
    windows: TokenWindows, batch_size: int, rank: int, world_size: int,
    max_tokens: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (x_BT, y_BT) batches for evaluating the first `max_tokens` targets of the split
    (all of it when None), T = windows.seq_len.

    Window j predicts stream tokens jT+1 .. min(jT+T, M) from the T tokens before each, so the
    windows tile the M = min(max_tokens, tokens - 1) targets exactly; the last may be shorter.
    Window j goes to rank j % world_size: the union over ranks is the same whatever the world
    size. Every rank gets the same number of batches of the same shape (FSDP runs each forward
    on every rank), of at most `batch_size` rows and never more rows than the most windows any
    rank has; short rows and missing rows are padded with IGNORE_INDEX targets, which
    `evaluate` skips.
    """
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
