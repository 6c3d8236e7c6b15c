"""Each choice's log-likelihood, batched, and lm-eval's verdict on it.

Tokenization is lm-evaluation-harness 0.4.13's (`LM.loglikelihood`, `_encode_pair`, and
`HFLM._loglikelihood_tokens`): a context's trailing whitespace moves to the front of the
continuation; the context and context+continuation are encoded, the continuation's ids being
the tail of the second past the first's length (so a token merged across the boundary counts
as the continuation's); an empty context becomes the end-of-text id (the export's BOS and EOS);
the model reads (context + continuation)[-(L+1):][:-1], left-truncated to its context L, and
its last len(continuation) positions predict the continuation.

Speed: the choices of an example share the start of their inputs (its context, most often). One
row holds that prefix once, then every choice after it (PackedRows: each choice sees the prefix
and itself, at the positions it has alone), so the prefix is computed once and no choice is
padded to the longest; rows are sorted by length and batched up to BATCH_TOKENS, and the LM head
runs only on the positions scored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import tiktoken
import torch
import torch.nn.functional as F

from lmforge.model import GPT
from lmforge.model.model import IGNORE_INDEX, cap_logits
from lmforge.pipeline.parallel.parallelize import Precision
from lmforge.pipeline.tasks.example import Example

BATCH_TOKENS = 1 << 14  # rows x the longest row (its prefix and choices) of a batch


def encode_pair(enc: tiktoken.Encoding, context: str, continuation: str,
                prefix_id: int) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) by lm-eval's rule (see the module docstring)."""
    if context == "":
        cont = enc.encode_ordinary(continuation)
        return ([prefix_id], cont) if cont[0] != prefix_id else (cont[:1], cont[1:])
    if n_spaces := len(context) - len(context.rstrip()):
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = enc.encode_ordinary(context + continuation)
    ctx = enc.encode_ordinary(context)
    return ctx, whole[len(ctx):]


@dataclass(frozen=True)
class Encoded:
    """One example as model inputs: the prefix all its choices share, then each choice's rest,
    whose last len(targets[i]) positions predict targets[i] (the continuation's ids)."""

    prefix: list[int]
    suffixes: list[list[int]]
    targets: list[list[int]]

    @property
    def tokens(self) -> int:  # what its row holds: the prefix, then every choice
        return len(self.prefix) + sum(map(len, self.suffixes))


def encode_example(enc: tiktoken.Encoding, ex: Example, max_len: int, prefix_id: int) -> Encoded:
    inputs, targets = [], []
    for i, (context, continuation) in enumerate(ex.requests):
        ctx, cont = encode_pair(enc, context, continuation, prefix_id)
        if not 0 < len(cont) <= max_len:
            raise ValueError(f"choice {i} ({continuation[:40]!r}) is {len(cont)} tokens after "
                             f"its context; lm-eval scores 1 to the model's context, {max_len}")
        inputs.append((ctx + cont)[-(max_len + 1):][:-1])
        targets.append(cont)
    # The shared prefix stops before the first scored position of any choice.
    shared = min(len(x) - len(t) for x, t in zip(inputs, targets))
    first = inputs[0]
    p = next((j for j in range(shared) if any(x[j] != first[j] for x in inputs)), shared)
    return Encoded(first[:p], [x[p:] for x in inputs], targets)


def scored_cross_entropy(h_BTD, w_VD, targets_BT, vocab_size, reduction="none",
                         ignore_index=IGNORE_INDEX, softcap: float = 0.0) -> torch.Tensor:
    """GPT.forward's loss_fn, (B, T) token losses (0 where not scored), the LM head run on the
    scored positions only: most positions of a batch are contexts and padding."""
    assert reduction == "none"
    scored_BT = targets_BT != ignore_index
    logits_NV = F.linear(h_BTD[scored_BT], w_VD)[:, :vocab_size].float()
    if softcap:
        logits_NV = cap_logits(logits_NV, softcap)
    out_BT = torch.zeros(targets_BT.shape, dtype=torch.float32, device=h_BTD.device)
    out_BT[scored_BT] = F.cross_entropy(logits_NV, targets_BT[scored_BT], reduction="none")
    return out_BT


def _tensor(rows: list[list[int]], width: int, fill: int, left_pad: bool, device) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    for r, row in enumerate(rows):
        start = width - len(row) if left_pad else 0
        out[r, start:start + len(row)] = torch.tensor(row, dtype=torch.long)
    return out.to(device)


class PackedRows:
    """What GPT.forward's kv_cache argument supplies, for rows that each hold an example's
    shared prefix then all its choices: the RoPE positions each token would have in its own
    sequence, and a mask by which a prefix token sees the prefix before it and a choice's token
    the prefix and its own choice before it (never another choice). Nothing is cached: one
    forward computes every choice of the row, the prefix once."""

    def __init__(self, part_BT: torch.Tensor, pos_BT: torch.Tensor):
        """part_BT: 0 for a prefix token, c + 1 for choice c's, -1 for padding."""
        T = part_BT.shape[1]
        causal_TT = torch.ones(T, T, dtype=torch.bool, device=part_BT.device).tril()
        q_BT1, k_B1T = part_BT[:, :, None], part_BT[:, None, :]
        seen_BTT = causal_TT & ((k_B1T == 0) | (k_B1T == q_BT1)) & (q_BT1 >= 0) & (k_B1T >= 0)
        seen_BTT |= torch.eye(T, dtype=torch.bool, device=part_BT.device)  # padding: itself
        # Additive: SDPA would convert a boolean mask in every layer.
        self.attn_mask = torch.zeros(seen_BTT.shape, device=part_BT.device).masked_fill_(
            ~seen_BTT, float("-inf"))[:, None]
        self.is_causal, self.pos_BT = False, pos_BT

    def begin(self, T: int) -> torch.Tensor:
        return self.pos_BT

    def update(self, layer: int, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor):
        return k_BGTK, v_BGTK

    def advance(self, T: int) -> None:
        pass


@torch.no_grad()
def score_batch(model: GPT, batch: Sequence[Encoded]) -> list[list[float]]:
    """Each choice's summed log-likelihood, for every example of the batch (one row each)."""
    device = model.tok_emb.weight.device
    T = max(e.tokens for e in batch)
    idx_BT = torch.zeros(len(batch), T, dtype=torch.long)
    y_BT = torch.full((len(batch), T), IGNORE_INDEX, dtype=torch.long)
    part_BT, pos_BT = torch.full_like(idx_BT, -1), torch.zeros_like(idx_BT)
    request_BT, r = torch.zeros_like(idx_BT), 0  # the flat index of each token's choice
    for b, e in enumerate(batch):
        p = at = len(e.prefix)
        idx_BT[b, :p], part_BT[b, :p], pos_BT[b, :p] = torch.tensor(e.prefix), 0, torch.arange(p)
        for c, (suffix, target) in enumerate(zip(e.suffixes, e.targets)):
            end = at + len(suffix)
            idx_BT[b, at:end] = torch.tensor(suffix, dtype=torch.long)
            y_BT[b, end - len(target):end] = torch.tensor(target, dtype=torch.long)
            part_BT[b, at:end], request_BT[b, at:end] = c + 1, r
            pos_BT[b, at:end] = torch.arange(p, p + len(suffix))
            at, r = end, r + 1
    rows = PackedRows(part_BT.to(device), pos_BT.to(device))
    nll_BT = model(idx_BT.to(device), y_BT.to(device), reduction="none",
                   loss_fn=scored_cross_entropy, kv_cache=rows)
    lls = torch.zeros(r, dtype=torch.float64).index_add_(
        0, request_BT.flatten(), -nll_BT.double().cpu().flatten()).tolist()
    out, at = [], 0
    for e in batch:
        out.append(lls[at:at + len(e.suffixes)])
        at += len(e.suffixes)
    return out


def batches(encoded: Sequence[Encoded], batch_tokens: int = BATCH_TOKENS) -> list[list[int]]:
    """Indices of `encoded` in batches of rows (one example each): longest first (an
    out-of-memory shows at once), each within batch_tokens (rows x the longest row)."""
    order = sorted(range(len(encoded)), key=lambda i: -encoded[i].tokens)
    out: list[list[int]] = []
    for i in order:
        if not out or (len(out[-1]) + 1) * encoded[out[-1][0]].tokens > batch_tokens:
            out.append([])
        out[-1].append(i)
    return out


def choice_loglikelihoods(model: GPT, encoded: Sequence[Encoded], precision: Precision,
                          batch_tokens: int = BATCH_TOKENS,
                          done: Callable[[int], None] = lambda n: None) -> list[list[float]]:
    """The log-likelihood of each choice of each example, in order; done(n) after each batch."""
    was_training = model.training
    model.eval()
    out: list[list[float]] = [[] for _ in encoded]
    try:
        for batch in batches(encoded, batch_tokens):
            with precision.autocast(model):
                lls = score_batch(model, [encoded[i] for i in batch])
            for i, ll in zip(batch, lls):
                out[i] = ll
            done(len(batch))
    finally:
        model.train(was_training)
    return out


def verdict(ex: Example, lls: Sequence[float]) -> tuple[bool, bool]:
    """(acc, acc_norm) of one example as lm-eval's process_results decides them: argmax of the
    log-likelihoods, and of them divided by the choices' lengths in characters (ties: the first)."""
    ll = np.asarray(lls, dtype=np.float64)
    return (int(np.argmax(ll)) == ex.gold,
            int(np.argmax(ll / np.asarray(ex.norm_chars, dtype=np.float64))) == ex.gold)
