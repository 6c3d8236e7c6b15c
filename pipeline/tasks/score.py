"""Each choice's log-likelihood, batched, and lm-eval's verdict on it.

Tokenization is lm-evaluation-harness 0.4.13's (`LM.loglikelihood`, `_encode_pair`, and
`HFLM._loglikelihood_tokens`): a context's trailing whitespace moves to the front of the
continuation; the context and context+continuation are encoded, the continuation's ids being
the tail of the second past the first's length (so a token merged across the boundary counts
as the continuation's); an empty context becomes the end-of-text id (the export's BOS and EOS);
the model reads (context + continuation)[-(L+1):][:-1], left-truncated to its context L, and
its last len(continuation) positions predict the continuation.

Speed: the choices of an example share the start of their inputs (its context, most often). One
row holds that prefix once, then its choices after it (GPT.forward's pos_BT and attn_mask: each
choice sees the prefix and itself, at the positions it has alone), so the prefix is computed once
and no choice is padded to the longest; rows are sorted by length and batched up to BATCH_TOKENS,
and the LM head runs only on the positions scored.

Memory, bounded by neither the vocabulary nor the choice count: the head's logits by chunks of
LOGITS_ELEMS, and a row by ROW_TOKENS or the model's context (an example of many choices takes
several rows, each with its prefix), a batch's (B, 1, T, T) mask by MASK_ELEMS.
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
from lmforge.pipeline.loss import CHUNK_ELEMS, chunk_tokens
from lmforge.pipeline.parallel.parallelize import Precision
from lmforge.pipeline.tasks.example import Example

# Rows x the longest row (its prefix and choices) of a batch. On CPU a batch's activations (and
# the math attention's (B, H, T, T) scores) set the RSS peak, which glibc keeps: 2^14 tokens
# tripled `eval --tasks`'s peak over `eval`'s at GPT-2's vocabulary, 2^10 holds it within 1.15x
# (bench/downstream_bench.py --rss, bench/results/downstream_rss_avx2.txt).
BATCH_TOKENS = {"cpu": 1 << 10, "cuda": 1 << 14}
# An example's choices beyond this many tokens in its row go on in another row (with the prefix
# again: a row's mask is T x T), and a batch's masks hold at most MASK_ELEMS elements: the
# attention's memory bounded by the model's context, whatever an example's choice count.
ROW_TOKENS = 1 << 12
MASK_ELEMS = ROW_TOKENS * ROW_TOKENS
# The scoring's memory budget for logits: chunks of at most this many (fp32), two such buffers at
# a time (logits, log-probabilities), whatever the vocabulary and the batch: 2 x 32 MiB on CPU,
# 2 x 512 MiB on CUDA (training's chunked loss's sizes).
LOGITS_ELEMS = CHUNK_ELEMS


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


def scored_loss(h_BTD, w_VD, targets_BT, vocab_size, reduction="none",
                ignore_index=IGNORE_INDEX, softcap: float = 0.0) -> torch.Tensor:
    """GPT.forward's loss_fn, (B, T) token losses (0 where not scored): the LM head runs on the
    scored positions only (most positions of a batch are contexts), by chunks of at most
    LOGITS_ELEMS logits (sized as train.loss = "chunked" sizes its chunks), so that no buffer is
    sized by the vocabulary times the batch. Each chunk's loss is F.cross_entropy's, as lm-eval's
    log_softmax: ChunkedLoss's log-sum-exp (for training's speed) moved a choice's summed
    log-likelihood by up to 1.8e-5 at GPT-2's vocabulary."""
    assert reduction == "none"
    scored_BT = targets_BT != ignore_index
    h_ND, y_N = h_BTD[scored_BT], targets_BT[scored_BT]
    chunk = chunk_tokens(w_VD.shape[0], len(y_N),
                         LOGITS_ELEMS.get(h_BTD.device.type, LOGITS_ELEMS["cpu"]))
    losses = []
    for start in range(0, len(y_N), chunk):
        logits_CV = F.linear(h_ND[start:start + chunk], w_VD[:vocab_size]).float()  # contiguous
        if softcap:
            logits_CV = cap_logits(logits_CV, softcap)
        losses.append(F.cross_entropy(logits_CV, y_N[start:start + chunk], reduction="none"))
    out_BT = torch.zeros(targets_BT.shape, dtype=torch.float32, device=h_BTD.device)
    out_BT[scored_BT] = torch.cat(losses)  # every row scores a token at least
    return out_BT


IDLE = Encoded([], [[0]], [[0]])  # one token: a forward that only joins the others' gathers


@dataclass(frozen=True)
class Row:
    """One row of a batch: example `example`'s prefix, then its choices first..last-1."""

    example: int
    first: int
    last: int
    tokens: int


def rows_of(encoded: Sequence[Encoded], max_row: int) -> list[Row]:
    """Each example's choices in as few rows as hold them within max_row tokens (a row's mask is
    T x T: one row of a thousand choices would be quadratic in them). A row always takes one
    choice: the prefix and one choice fit the model's context."""
    out = []
    for i, e in enumerate(encoded):
        first, tokens = 0, len(e.prefix)
        for c, suffix in enumerate(e.suffixes):
            if c > first and tokens + len(suffix) > max_row:
                out.append(Row(i, first, c, tokens))
                first, tokens = c, len(e.prefix)
            tokens += len(suffix)
        out.append(Row(i, first, len(e.suffixes), tokens))
    return out


def row_mask(part_BT: torch.Tensor) -> torch.Tensor:
    """SDPA's additive (B, 1, T, T) mask for rows of a prefix then choices (part_BT: 0 for a
    prefix token, c + 1 for choice c's, -1 for padding): a prefix token sees the prefix before
    it, a choice's token the prefix and its own choice before it, never another choice."""
    T = part_BT.shape[1]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=part_BT.device).tril()
    q_BT1, k_B1T = part_BT[:, :, None], part_BT[:, None, :]
    seen_BTT = causal_TT & ((k_B1T == 0) | (k_B1T == q_BT1)) & (q_BT1 >= 0) & (k_B1T >= 0)
    seen_BTT |= torch.eye(T, dtype=torch.bool, device=part_BT.device)  # padding: itself
    # Additive: SDPA would convert a boolean mask in every layer.
    return torch.zeros(seen_BTT.shape, device=part_BT.device).masked_fill_(
        ~seen_BTT, float("-inf"))[:, None]


@torch.no_grad()
def score_batch(model: GPT, encoded: Sequence[Encoded], batch: Sequence[Row]) -> list[list[float]]:
    """Each choice's summed log-likelihood, for every row of the batch: the choices of each
    compute at the positions they have alone, the prefix once."""
    device = model.tok_emb.weight.device
    T = max(row.tokens for row in batch)
    idx_BT = torch.zeros(len(batch), T, dtype=torch.long)
    y_BT = torch.full((len(batch), T), IGNORE_INDEX, dtype=torch.long)
    part_BT, pos_BT = torch.full_like(idx_BT, -1), torch.zeros_like(idx_BT)
    request_BT, r = torch.zeros_like(idx_BT), 0  # the flat index of each token's choice
    for b, row in enumerate(batch):
        e = encoded[row.example]
        p = at = len(e.prefix)
        idx_BT[b, :p], part_BT[b, :p], pos_BT[b, :p] = torch.tensor(e.prefix), 0, torch.arange(p)
        for c in range(row.first, row.last):
            suffix, target = e.suffixes[c], e.targets[c]
            end = at + len(suffix)
            idx_BT[b, at:end] = torch.tensor(suffix, dtype=torch.long)
            y_BT[b, end - len(target):end] = torch.tensor(target, dtype=torch.long)
            part_BT[b, at:end], request_BT[b, at:end] = c + 1, r
            pos_BT[b, at:end] = torch.arange(p, p + len(suffix))
            at, r = end, r + 1
    part_BT = part_BT.to(device)
    nll_BT = model(idx_BT.to(device), y_BT.to(device), reduction="none", loss_fn=scored_loss,
                   pos_BT=pos_BT.to(device), attn_mask=row_mask(part_BT))
    lls = torch.zeros(r, dtype=torch.float64).index_add_(
        0, request_BT.flatten(), -nll_BT.double().cpu().flatten()).tolist()
    out, at = [], 0
    for row in batch:
        out.append(lls[at:at + row.last - row.first])
        at += row.last - row.first
    return out


def batches(rows: Sequence[Row], batch_tokens: int) -> list[list[Row]]:
    """`rows` in batches: longest first (an out-of-memory shows at once), each within
    batch_tokens (rows x the longest row) and MASK_ELEMS (rows x its square)."""
    out: list[list[Row]] = []
    for row in sorted(rows, key=lambda row: -row.tokens):
        n, T = len(out[-1]) + 1 if out else 0, out[-1][0].tokens if out else 0
        if not out or n * T > batch_tokens or n * T * T > MASK_ELEMS:
            out.append([])
        out[-1].append(row)
    return out


def scoring_batches(model: GPT, encoded: Sequence[Encoded]) -> list[list[Row]]:
    device = model.tok_emb.weight.device.type
    return batches(rows_of(encoded, max(ROW_TOKENS, model.cfg.max_seq_len)),
                   BATCH_TOKENS.get(device, BATCH_TOKENS["cpu"]))


def choice_loglikelihoods(model: GPT, encoded: Sequence[Encoded], precision: Precision,
                          done: Callable[[int], None] = lambda n: None,
                          n_batches: int | None = None) -> list[list[float]]:
    """The log-likelihood of each choice of each example, in order; done(n) after each batch,
    n the examples it completed. n_batches: forwards to run in all (at least this rank's
    batches), the rest on a one-token row: under FSDP every rank runs as many (each gathers
    the weights with the others)."""
    was_training = model.training
    model.eval()
    out = [[0.0] * len(e.suffixes) for e in encoded]
    todo = scoring_batches(model, encoded)
    try:
        for batch in todo + [[]] * ((n_batches or 0) - len(todo)):
            with precision.autocast(model):
                if not batch:
                    score_batch(model, [IDLE], [Row(0, 0, 1, 1)])
                    continue
                lls = score_batch(model, encoded, batch)
            for row, ll in zip(batch, lls):
                out[row.example][row.first:row.last] = ll
            done(sum(row.last == len(encoded[row.example].suffixes) for row in batch))
    finally:
        model.train(was_training)
    return out


def verdict(ex: Example, lls: Sequence[float]) -> tuple[bool, bool]:
    """(acc, acc_norm) of one example as lm-eval's process_results decides them: argmax of the
    log-likelihoods, and of them divided by the choices' lengths in characters (ties: the first)."""
    ll = np.asarray(lls, dtype=np.float64)
    return (int(np.argmax(ll)) == ex.gold,
            int(np.argmax(ll / np.asarray(ex.norm_chars, dtype=np.float64))) == ex.gold)
