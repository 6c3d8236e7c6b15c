"""Each choice's log-likelihood, batched, and lm-eval's verdict on it.

Tokenization is lm-evaluation-harness 0.4.13's (`LM.loglikelihood`, `_encode_pair`, and
`HFLM._loglikelihood_tokens`): a context's trailing whitespace moves to the front of the
continuation; the context and context+continuation are encoded, the continuation's ids being
the tail of the second past the first's length (so a token merged across the boundary counts
as the continuation's); an empty context becomes the end-of-text id (the export's BOS and EOS);
the model reads (context + continuation)[-(L+1):][:-1], left-truncated to its context L, and
its last len(continuation) positions predict the continuation.

Speed: the choices of an example share the start of their inputs (its context, most often). That
prefix runs once per example into a KV cache, then all the example's choices run side by side in
one row (ChoicesCache: each sees the prefix and itself, at its own positions), so neither the
prefix nor a short choice is padded to the longest; examples are sorted by length and packed
into batches of at most BATCH_TOKENS, and the LM head runs only on the positions scored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import tiktoken
import torch
import torch.nn.functional as F

from model import GPT, KVCache, ModelConfig
from model.model import IGNORE_INDEX, cap_logits
from pipeline.parallel.parallelize import Precision
from pipeline.tasks.example import Example

BATCH_TOKENS = 1 << 15  # rows x (prefix + choices) of a batch: the size of its KV cache


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


class ChoicesCache(KVCache):
    """A KV cache for a prefill of each example's shared prefix (left-padded, one row per
    example), then one forward of all the example's choices side by side in its row: each choice
    attends to the prefix and causally to itself only, at the RoPE positions it has alone, so
    the row computes what separate rows would, without their padding."""

    def __init__(self, cfg: ModelConfig, prefix_lens: list[int], width: int, device, dtype):
        P = max(prefix_lens)
        # Slots, not positions: a row holds every choice after the prefix, which may be more
        # slots than the model's context (each choice's positions stay within it).
        super().__init__(replace(cfg, max_seq_len=max(cfg.max_seq_len, P + width)),
                         len(prefix_lens), P + width, device=device, dtype=dtype,
                         pad_B=torch.tensor([P - n for n in prefix_lens], device=device))
        self.choice_BT: torch.Tensor | None = None  # choice index of each slot, -1: padding
        self.pos_BT: torch.Tensor | None = None

    def begin(self, T: int) -> torch.Tensor:
        if self.choice_BT is None:  # the prefix prefill: KVCache's own masks
            return super().begin(T)
        c_BT, P = self.choice_BT, self.pos
        own_BTT = (c_BT[:, :, None] == c_BT[:, None, :]) & (c_BT[:, :, None] >= 0)
        own_BTT &= torch.ones(T, T, dtype=torch.bool, device=c_BT.device).tril()
        own_BTT |= torch.eye(T, dtype=torch.bool, device=c_BT.device)  # padding: itself only
        prefix_BTP = self.real_B11S[:, 0, :, :P].expand(-1, T, -1)
        self.attn_mask = torch.cat([prefix_BTP, own_BTT], dim=2)[:, None]  # (B, 1, T, P + T)
        self.is_causal = False
        return self.pos_BT


@torch.no_grad()
def score_batch(model: GPT, batch: Sequence[Encoded]) -> list[list[float]]:
    """Each choice's summed log-likelihood, for every example of the batch."""
    device, dtype = model.tok_emb.weight.device, model.tok_emb.weight.dtype
    T = max(sum(map(len, e.suffixes)) for e in batch)
    cache = ChoicesCache(model.cfg, [len(e.prefix) for e in batch], T, device, dtype)
    if cache.pos_BS.shape[1] > T:  # some example has a prefix: run them once
        P = cache.pos_BS.shape[1] - T
        model.hidden(_tensor([e.prefix for e in batch], P, 0, True, device), kv_cache=cache)
    # Row b: its choices one after the other; each position's choice, RoPE position, target
    # and request (the flat index of its choice in the batch).
    idx_BT = torch.zeros(len(batch), T, dtype=torch.long)
    y_BT = torch.full((len(batch), T), IGNORE_INDEX, dtype=torch.long)
    choice_BT, pos_BT = torch.full_like(idx_BT, -1), torch.zeros_like(idx_BT)
    request_BT, r = torch.zeros_like(idx_BT), 0
    for b, e in enumerate(batch):
        at = 0
        for c, (suffix, target) in enumerate(zip(e.suffixes, e.targets)):
            end = at + len(suffix)
            idx_BT[b, at:end] = torch.tensor(suffix, dtype=torch.long)
            y_BT[b, end - len(target):end] = torch.tensor(target, dtype=torch.long)
            choice_BT[b, at:end], request_BT[b, at:end] = c, r
            pos_BT[b, at:end] = torch.arange(len(e.prefix), len(e.prefix) + len(suffix))
            at, r = end, r + 1
    cache.choice_BT, cache.pos_BT = choice_BT.to(device), pos_BT.to(device)
    nll_BT = model(idx_BT.to(device), y_BT.to(device), reduction="none",
                   loss_fn=scored_cross_entropy, kv_cache=cache)
    lls = torch.zeros(r, dtype=torch.float64).index_add_(
        0, request_BT.flatten(), -nll_BT.double().cpu().flatten()).tolist()
    out, at = [], 0
    for e in batch:
        out.append(lls[at:at + len(e.suffixes)])
        at += len(e.suffixes)
    return out


def batches(encoded: Sequence[Encoded], batch_tokens: int = BATCH_TOKENS) -> list[list[int]]:
    """Indices of `encoded` in batches: longest first (an out-of-memory shows at once), each
    within batch_tokens (rows x (prefix + choices))."""
    order = sorted(range(len(encoded)), key=lambda i: -encoded[i].tokens)
    out: list[list[int]] = []
    P = T = 0
    for i in order:
        e = encoded[i]
        p, t = max(P, len(e.prefix)), max(T, sum(map(len, e.suffixes)))
        if not out or (len(out[-1]) + 1) * (p + t) > batch_tokens:
            out.append([])
            p, t = len(e.prefix), sum(map(len, e.suffixes))
        out[-1].append(i)
        P, T = p, t
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
