"""The LM-head cross-entropy paths the pipeline chooses between (the model's own default,
`model.model.cross_entropy`, builds the full logits: a reference, not what training runs).

Every path is a `HeadLoss`: called as loss(h_BTD, w_VD, targets_BT, vocab_size, reduction,
ignore_index) on the final hidden states and the head weight (`GPT.forward(..., loss_fn=...)`),
it returns the fp32 loss of softmax(h @ wᵀ) over the first vocab_size columns. Two of them, one
math (`_Chunked` below, by chunks of tokens: memory O(chunk·V), no B×T×V logits nor gradient):

- `ChunkedLoss` (eager runs): each chunk's logits, probabilities and gradient go into two
  buffers allocated once per pass, on every device and dtype. One softmax gives both the
  gradient (softmax - one_hot, in place) and the loss (-log p of the target): one exp per
  element and one pass over the chunk, where log_softmax then exp took two of each. A fresh
  C×V tensor per chunk costs a page fault per 4 KiB on CPU (glibc hands blocks that big back to
  the OS), and in the heap the pipeline keeps (pipeline.hardware) its holes grow the peak:
  oneDNN's linear, whose product is faster on an AVX2 CPU in fp32 but has no out=, cost more
  memory than its speed was worth there (bench/results/README.md). Each eager op is one more
  pass over the chunk.
- `FusedLoss` (compiled runs): the same chunk loop in functional ops, traced by torch.compile
  with the model (or alone under FSDP2, where the blocks are compiled apart: `select_loss`).
  Inductor fuses each chunk's upcast, log-sum-exp, softmax - one_hot and cast into one loop
  over its rows (one exp per element, each row read once from memory) and plans the chunks'
  buffers within one graph (no eager allocation per op); at most one chunk of tokens, that is
  the whole logits in the graph.

Summed or averaged, the gradients are computed chunk by chunk in the forward pass, where the
logits are at hand, and only scaled in backward. Per token ("none"), the upstream gradient
differs by token, so backward recomputes each chunk instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.graph_passes import compile_options

HeadLoss = Callable[..., torch.Tensor]

# Logits elements per chunk. Eager, a chunk holds two fp32 C x V buffers (logits and
# probabilities): 2^23 elements, 32 MiB each, keeps memory O(chunk x V) whatever the batch,
# with chunks still hundreds of tokens tall at small vocabularies, so their matmuls run at full
# rate. Compiled, inductor fuses the fp32 work into the passes over the logits and their
# gradient, and taller chunks (fewer gradient accumulations into the V x D fp32 sum) ran faster
# and lighter (bench/results/loss_chunk_*.txt).
EAGER_CHUNK_ELEMS, FUSED_CHUNK_ELEMS = 2**23, 2**25


def chunk_tokens(padded_vocab: int, n_tokens: int | None = None,
                 elems: int = EAGER_CHUNK_ELEMS) -> int:
    """Tokens per chunk of the loss: at most elems // V and, given the number of tokens, the
    chunks as even as that allows (no short last chunk: one more matmul shape, a wasted pass)."""
    most = max(1, elems // padded_vocab)
    if not n_tokens:
        return most
    return -(-n_tokens // -(-n_tokens // most))


def compute_operands(h_BTD: torch.Tensor, w_VD: torch.Tensor):
    """h and w in the dtype the head matmul computes in: autocast's dtype when autocast is on,
    else the weight's (FSDP2's bf16 parameters)."""
    device = h_BTD.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w_VD.dtype
    return h_BTD.to(dtype), w_VD.to(dtype)


# ---- the two bodies of one chunk: -> (the loss's per-row parts, d loss / d logits in h's dtype)


def _eager_body(h_CD, w_VD, safe_C, vocab_size, bufs, want_grad):
    """Into the reused buffers: logits, then probabilities, then (in place) the gradient."""
    logits_CV = bufs["logits"][:len(h_CD)]
    if h_CD.dtype == torch.float32:
        torch.mm(h_CD, w_VD.T, out=logits_CV)
    else:
        logits_CV.copy_(h_CD @ w_VD.T)
    return _eager_from_logits(logits_CV, safe_C, vocab_size, bufs, want_grad, h_CD.dtype)


def _eager_from_logits(logits_CV, safe_C, vocab_size, bufs, want_grad, dtype):
    """A chunk's loss and its logits' gradient (in `dtype`) from its fp32 logits, through the
    reused probability buffer. A target's probability under fp32's smallest normal (a loss over
    UNDERFLOW_LOSS nats) gives no exact -log p: _exact_where_underflowed redoes those tokens."""
    C = len(logits_CV)
    probs_CV = bufs["probs"][:C]
    logits_CV[:, vocab_size:] = float("-inf")  # padded columns: no probability mass, no gradient
    torch.softmax(logits_CV, dim=-1, out=probs_CV)
    loss_C = -probs_CV.gather(1, safe_C[:, None]).squeeze(1).log()
    if not want_grad:
        return (loss_C,), None
    probs_CV[bufs["rows"][:C], safe_C] -= 1.0
    return (loss_C,), probs_CV.to(dtype)


UNDERFLOW_LOSS = -math.log(torch.finfo(torch.float32).tiny)  # 87.3 nats


def _exact_where_underflowed(loss_N, h_ND, w_VD, safe_N, vocab_size):
    """loss_N with the tokens whose -log p went past UNDERFLOW_LOSS (inf, or imprecise from a
    subnormal p) recomputed by the fused body's log-sum-exp. Only a diverging run has any; the
    check is one host sync per loss call on a GPU, none per chunk."""
    over_N = loss_N > UNDERFLOW_LOSS
    if not bool(over_N.any()):
        return loss_N
    rows = over_N.nonzero().squeeze(1)
    exact_R = _loss_of(_fused_body(h_ND[rows], w_VD, safe_N[rows], vocab_size, None, False)[0])
    return loss_N.index_put((rows,), exact_R)


# Column indices are compared as fp32 where fp32 holds them exactly (every index up to 2^24):
# the fp32 compare yields the float mask the blends over the logits take, where inductor's
# AVX2 kernel comparing int32 ran the fused chunk slower (bench/results/step_ab_avx2.txt).
# Beyond 2^24 columns only int32 is exact.
EXACT_FLOAT_INDEX = 2**24


def column_dtype(n_columns: int) -> torch.dtype:
    return torch.float32 if n_columns <= EXACT_FLOAT_INDEX else torch.int32


@torch.library.custom_op("lmforge::chunk_columns", mutates_args=())
def _chunk_columns(safe_C: torch.Tensor, n_columns: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """A chunk's targets and the head's column indices, in `dtype` (column_dtype's). An op of
    our own, so that inductor cannot fold the columns back into its loop over the logits: there
    an index vector built per vector of logits cost a third of the chunk's time, where reading
    one costs a load (bench/step_ab.py loss). One call per chunk (its targets): inductor fuses
    kernels that read one buffer into one, every chunk's logits alive at once. The dtype is an
    argument, not derived inside, so that it is written in the traced graph: inductor's cache
    keys compiled graphs on their code, not on what a custom op's fake returns."""
    cols_V = torch.arange(n_columns, dtype=dtype, device=safe_C.device)
    return [safe_C.to(dtype, copy=True), cols_V]  # (an op's outputs never alias its inputs)


@_chunk_columns.register_fake
def _(safe_C, n_columns, dtype):
    return [torch.empty_like(safe_C, dtype=dtype), safe_C.new_empty(n_columns, dtype=dtype)]


def _fused_body(h_CD, w_VD, safe_C, vocab_size, bufs, want_grad):
    """Functional ops only, so that inductor can fuse them (it turns out= and in-place writes
    into copies), and no padding term where the head has no padded column.

    Every op here spans the chunk's rows and columns, which lets inductor make one loop over
    the rows: each row's max, its exponentials (kept in a row buffer that stays in cache), their
    sum and the gradient, one exp per element and one read of the logits. A per-row op (the
    loss, or a gather of the target's logit) would split that loop into three passes over the
    whole chunk, so the target's logit is a masked sum and the loss is left to _loss_of, outside
    the chunk's loop (a sum over its rows, or a cat of the per-row parts kept [C, 1], which
    inductor writes in place) (bench/step_ab.py loss).

    The gradient reads the row's exponentials back from that buffer, one exp per element. In
    fp32 (_grad_over_logits) it is a second exp of the logits instead, which lets inductor write
    it over the logits: one C x V fp32 buffer per chunk, not two, for a second read of the chunk
    (the log-sum-exp it shares with the loss splits the loop into passes)."""
    n_columns = w_VD.shape[0]
    safe_C, cols_V = _chunk_columns(safe_C, n_columns, column_dtype(n_columns))
    return _fused_by_columns(h_CD, w_VD, safe_C, cols_V, vocab_size, want_grad)


def _grad_over_logits(dtype: torch.dtype) -> bool:
    """Whether the fused body's gradient is exp(logits - log-sum-exp), written over the logits,
    rather than the row's kept exponentials over their sum. In fp32: a C x V fp32 gradient of
    its own per chunk (at GPT-2's vocabulary larger than the heap keeps, so faulted in page by
    page) set the step's peak and most of its page faults, and the second exp and pass measured
    within the noise of the step; in bf16 they cost a few % of a step for little memory (the
    logits half as wide) (bench/results/step_ab_zen4.txt)."""
    return dtype == torch.float32


def _fused_by_columns(h_CD, w_VD, safe_C, cols_V, vocab_size, want_grad):
    logits_CV = (h_CD @ w_VD.T).float()
    if vocab_size < w_VD.shape[0]:
        logits_CV = logits_CV.masked_fill(cols_V >= vocab_size, float("-inf"))
    one_hot_CV = cols_V == safe_C[:, None]
    target_C1 = torch.where(one_hot_CV, logits_CV, 0.0).sum(dim=-1, keepdim=True)
    max_C1 = logits_CV.amax(dim=-1, keepdim=True)
    exp_CV = torch.exp(logits_CV - max_C1)
    sumexp_C1 = exp_CV.sum(dim=-1, keepdim=True)
    parts = (max_C1, sumexp_C1, target_C1)
    if not want_grad:
        return parts, None
    if _grad_over_logits(h_CD.dtype):
        grad_CV = torch.exp(logits_CV - (max_C1 + sumexp_C1.log())) - one_hot_CV.float()
    else:
        grad_CV = exp_CV / sumexp_C1 - one_hot_CV.float()
    return parts, grad_CV.to(h_CD.dtype)


def _loss_of(parts):
    """The per-token loss from a body's per-row parts (each concatenated over the chunks): the
    loss itself from the eager body, (max, sum of exp(logit - max), target's logit) from the
    fused one."""
    if len(parts) == 1:
        return parts[0]
    max_N1, sumexp_N1, target_N1 = parts
    return (max_N1 + sumexp_N1.log() - target_N1).squeeze(1)


def _eager_buffers(h_ND, w_VD, C):
    f32 = dict(dtype=torch.float32, device=h_ND.device)
    return {"logits": torch.empty(C, w_VD.shape[0], **f32),
            "probs": torch.empty(C, w_VD.shape[0], **f32),
            "rows": torch.arange(C, device=h_ND.device)}


# Elements per block when a bf16 product is added into an fp32 sum. On CPU an in-place add of
# another dtype first casts the whole operand: at GPT-2's vocabulary a fresh 51 MB fp32 copy of
# the head's gradient per chunk, faulted in page by page (glibc mmaps blocks that big). By blocks
# of 4 MiB the copy comes from the heap and stays in cache (bench/results/step_ab_zen4.txt).
ADD_BLOCK_ELEMS = 2**20


def _add_by_blocks(sum_VD: torch.Tensor, part_VD: torch.Tensor) -> None:
    rows = max(1, ADD_BLOCK_ELEMS // sum_VD.shape[1])
    for start in range(0, len(sum_VD), rows):
        sum_VD[start:start + rows] += part_VD[start:start + rows]


@torch.library.custom_op("lmforge::addmm_", mutates_args=("sum_VD",))
def _addmm_in_place(sum_VD: torch.Tensor, a_VC: torch.Tensor, b_CD: torch.Tensor) -> None:
    """sum_VD += a_VC @ b_CD in place. Traced, Tensor.addmm_ becomes inductor's out-of-place
    addmm, which copies the V x D sum into a fresh buffer per chunk; an op of our own that
    mutates its input is called in place (inductor's reinplacing of mutating custom ops)."""
    sum_VD.addmm_(a_VC, b_CD)


@_addmm_in_place.register_fake
def _(sum_VD, a_VC, b_CD) -> None:
    return None


def _add_head_grad(sum_VD, grad_CV, hs_CD, eager):
    """The head's fp32 gradient sum plus one chunk's grad_CVᵀ hs_CD. Before the first chunk the
    sum is None: it starts as that chunk's product, with no V x D zeros written first."""
    if sum_VD is None:
        return (grad_CV.T @ hs_CD).float()
    if grad_CV.dtype == torch.float32:
        _addmm_in_place(sum_VD, grad_CV.T, hs_CD)
    elif eager:  # no mixed-dtype addmm on CPU: a bf16 product added in fp32
        _add_by_blocks(sum_VD, grad_CV.T @ hs_CD)
    else:  # (inductor fuses the upcast into the add)
        sum_VD += grad_CV.T @ hs_CD
    return sum_VD


def _chunks(body, h_ND, w_VD, targets_N, vocab_size, ignore_index, chunk, grad_scale_N=None):
    """Loss of N tokens (fp32) by chunks of `chunk` tokens: (loss_N, None, None); or, given
    grad_scale_N, their summed loss and the gradients of sum(grad_scale_N * loss_N) w.r.t. h_ND
    (its dtype) and w_VD (fp32): (loss, grad_h_ND, grad_w_VD). The per-token scale goes on the
    D-wide factors, never on the C×V gradient."""
    valid_N = targets_N != ignore_index
    safe_N = torch.where(valid_N, targets_N, 0)
    want_grad = grad_scale_N is not None
    eager = body is _eager_body
    bufs = _eager_buffers(h_ND, w_VD, min(chunk, len(targets_N))) if eager else None
    parts, grads_h = [], []
    if want_grad:
        scale_N1 = torch.where(valid_N, grad_scale_N, 0.0)[:, None].to(h_ND.dtype)
    grad_w_VD = None
    starts = range(0, len(targets_N), chunk)
    for start in starts:
        part = slice(start, start + chunk)
        h_CD = h_ND[part]
        parts_C, grad_CV = body(h_CD, w_VD, safe_N[part], vocab_size, bufs, want_grad)
        parts.append(parts_C)
        if not want_grad:
            continue
        grads_h.append((grad_CV @ w_VD) * scale_N1[part])
        grad_w_VD = _add_head_grad(grad_w_VD, grad_CV, h_CD * scale_N1[part], eager)
    if want_grad and not eager:  # summed chunk by chunk: see _fused_body
        loss = sum(torch.where(valid_N[start:start + chunk], _loss_of(p), 0.0).sum()
                   for start, p in zip(starts, parts))
        return loss, torch.cat(grads_h), grad_w_VD
    loss_N = torch.where(valid_N, _loss_of([torch.cat(p) for p in zip(*parts)]), 0.0)
    if eager:  # (the fused body's log-sum-exp is exact at any probability)
        loss_N = _exact_where_underflowed(loss_N, h_ND, w_VD, safe_N, vocab_size)
    if not want_grad:
        return loss_N, None, None
    return loss_N.sum(), torch.cat(grads_h), grad_w_VD


class _Chunked(torch.autograd.Function):
    """Cross-entropy of softmax(h @ wᵀ) by chunks of tokens, with `body` doing each chunk."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, targets_N, vocab_size, ignore_index, chunk, per_token, body):
        ctx.args = (vocab_size, ignore_index, chunk)
        ctx.per_token, ctx.body = per_token, body
        if per_token:
            ctx.save_for_backward(h_ND, w_VD, targets_N)
            return _chunks(body, h_ND, w_VD, targets_N, *ctx.args)[0]
        ones_N = torch.ones(len(targets_N), device=h_ND.device)
        loss, grad_h_ND, grad_w_VD = _chunks(body, h_ND, w_VD, targets_N, *ctx.args, ones_N)
        ctx.save_for_backward(grad_h_ND, grad_w_VD.to(w_VD.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.per_token:
            h_ND, w_VD, targets_N = ctx.saved_tensors
            _, grad_h_ND, grad_w_VD = _chunks(ctx.body, h_ND, w_VD, targets_N, *ctx.args,
                                              grad_loss.float())
            return grad_h_ND, grad_w_VD.to(w_VD.dtype), None, None, None, None, None, None
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        return grad_h_ND * grad_loss, grad_w_VD * grad_loss, None, None, None, None, None, None


def _chunked_loss(body, h_BTD, w_VD, targets_BT, vocab_size, reduction, ignore_index, chunk,
                  elems):
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    h_BTD, w_VD = compute_operands(h_BTD, w_VD)
    h_ND, targets_N = h_BTD.flatten(0, 1), targets_BT.flatten()
    chunk = chunk or chunk_tokens(w_VD.shape[0], len(targets_N), elems)
    if torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad):
        loss = _Chunked.apply(h_ND, w_VD, targets_N, vocab_size, ignore_index, chunk,
                              reduction == "none", body)
    else:  # evaluation: the loss alone (the Function would also build the gradients)
        loss_N = _chunks(body, h_ND, w_VD, targets_N, vocab_size, ignore_index, chunk)[0]
        loss = loss_N if reduction == "none" else loss_N.sum()
    if reduction == "none":
        return loss.view(targets_BT.shape)
    if reduction == "mean":
        return loss / (targets_N != ignore_index).sum()
    return loss


@dataclass(frozen=True)
class ChunkedLoss:
    """The eager path. chunk: tokens per chunk (None: chunk_tokens of the head's vocabulary and
    the batch's tokens, within EAGER_CHUNK_ELEMS)."""

    chunk: int | None = None

    def __call__(self, h_BTD, w_VD, targets_BT, vocab_size, reduction="mean", ignore_index=-100):
        return _chunked_loss(_eager_body, h_BTD, w_VD, targets_BT, vocab_size, reduction,
                             ignore_index, self.chunk, EAGER_CHUNK_ELEMS)


EAGER_LOSS = ChunkedLoss()  # the default of what computes a loss without being told (eval)


@dataclass(frozen=True)
class FusedLoss:
    """The path torch.compile fuses (same numbers as ChunkedLoss to fp32 rounding); chunks within
    FUSED_CHUNK_ELEMS."""

    chunk: int | None = None

    def __call__(self, h_BTD, w_VD, targets_BT, vocab_size, reduction="mean", ignore_index=-100):
        return _chunked_loss(_fused_body, h_BTD, w_VD, targets_BT, vocab_size, reduction,
                             ignore_index, self.chunk, FUSED_CHUNK_ELEMS)


def select_loss(compiled: bool, compiled_with_model: bool, chunk: int | None = None) -> HeadLoss:
    """The loss a run computes: eager ChunkedLoss when nothing is compiled; FusedLoss when it is,
    traced with the model's graph (compiled_with_model) or compiled on its own (FSDP2 compiles
    the blocks apart, so the loss is its own region). dynamic=False: training's shape and eval's
    each get one static graph."""
    if not compiled:
        return ChunkedLoss(chunk)
    if compiled_with_model:
        return FusedLoss(chunk)
    return torch.compile(FusedLoss(chunk), dynamic=False, options=compile_options())
