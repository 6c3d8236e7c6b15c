"""Each choice's log-likelihood, batched, and lm-eval's verdict on it.

Tokenization is lm-evaluation-harness 0.4.13's (`LM.loglikelihood`, `_encode_pair`, and
`HFLM._loglikelihood_tokens`): a context's trailing whitespace moves to the front of the
continuation; the context and context+continuation are encoded, the continuation's ids being
the tail of the second past the first's length (so a token merged across the boundary counts
as the continuation's); an empty context becomes the end-of-text id (the export's BOS and EOS);
the model reads (context + continuation)[-(L+1):][:-1], left-truncated to its context L, and
its last len(continuation) positions predict the continuation.

Speed: the choices of an example share the start of their inputs (its context, most often). That
prefix runs once per example into a KV cache, which is then repeated for each choice's rest
(model.KVCache.repeat_rows); examples are sorted by length and packed into batches of at most
BATCH_TOKENS, and the LM head runs only on the positions scored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import tiktoken
import torch
import torch.nn.functional as F

from model import GPT, KVCache
from model.model import IGNORE_INDEX, cap_logits
from pipeline.parallel.parallelize import Precision
from pipeline.tasks.example import Example

BATCH_TOKENS = 1 << 14  # rows x (prefix + suffix) of one batch: the KV cache's and attention's size


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
    def tokens(self) -> int:
        return len(self.prefix) + max(map(len, self.suffixes))


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


@torch.no_grad()
def score_batch(model: GPT, batch: Sequence[Encoded]) -> list[list[float]]:
    """Each choice's summed log-likelihood, for every example of the batch."""
    device, dtype = model.tok_emb.weight.device, model.tok_emb.weight.dtype
    P = max(len(e.prefix) for e in batch)
    counts = torch.tensor([len(e.suffixes) for e in batch], device=device)
    rows = [s for e in batch for s in e.suffixes]
    targets = [t for e in batch for t in e.targets]
    M = max(map(len, rows))
    if P:  # each prefix once, left-padded, then its cache repeated for every choice
        pad_E = torch.tensor([P - len(e.prefix) for e in batch], device=device)
        cache = KVCache(model.cfg, len(batch), P, pad_B=pad_E, device=device, dtype=dtype)
        model.hidden(_tensor([e.prefix for e in batch], P, 0, True, device), kv_cache=cache)
        cache = cache.repeat_rows(counts, P + M)
    else:
        cache = KVCache(model.cfg, len(rows), M, device=device, dtype=dtype)
    idx_RM = _tensor(rows, M, 0, False, device)
    y_RM = torch.full((len(rows), M), IGNORE_INDEX, dtype=torch.long)
    for r, (s, t) in enumerate(zip(rows, targets)):
        y_RM[r, len(s) - len(t):len(s)] = torch.tensor(t)
    nll_RM = model(idx_RM, y_RM.to(device), reduction="none", loss_fn=scored_cross_entropy,
                   kv_cache=cache)
    lls = (-nll_RM.double().sum(1)).tolist()
    out, at = [], 0
    for n in counts.tolist():
        out.append(lls[at:at + n])
        at += n
    return out


def batches(encoded: Sequence[Encoded], max_len: int,
            batch_tokens: int = BATCH_TOKENS) -> list[list[int]]:
    """Indices of `encoded` in batches: longest first (an out-of-memory shows at once), each
    within batch_tokens (rows x cache length) and the model's context."""
    order = sorted(range(len(encoded)), key=lambda i: -encoded[i].tokens)
    out: list[list[int]] = []
    P = M = R = 0
    for i in order:
        e = encoded[i]
        ep, em, er = len(e.prefix), max(map(len, e.suffixes)), len(e.suffixes)
        p, m, r = max(P, ep), max(M, em), R + er
        if not out or p + m > max_len or r * (p + m) > batch_tokens:
            out.append([])
            p, m, r = ep, em, er
        out[-1].append(i)
        P, M, R = p, m, r
    return out


def choice_loglikelihoods(model: GPT, encoded: Sequence[Encoded], precision: Precision,
                          batch_tokens: int = BATCH_TOKENS,
                          done: Callable[[int], None] = lambda n: None) -> list[list[float]]:
    """The log-likelihood of each choice of each example, in order; done(n) after each batch."""
    was_training = model.training
    model.eval()
    out: list[list[float]] = [[] for _ in encoded]
    try:
        for batch in batches(encoded, model.cfg.max_seq_len, batch_tokens):
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
