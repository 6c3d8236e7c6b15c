"""The LM-head loss a run trains and evaluates with (`train.loss = auto | full | chunked`), called
as loss(h_BTD, w_VD, targets_BT, vocab_size, reduction, ignore_index, softcap=...) on the final
hidden states and the head weight: the fp32 loss of softmax(h @ wᵀ) over the first vocab_size
columns.

- full: the model's own `cross_entropy` on the whole upcast logits, compiled with the model.
- chunked: the same numbers by chunks of tokens, in memory O(chunk · V), never the B × T × V
  logits nor their gradient. Summed or averaged, each chunk's gradients are computed in the
  forward pass, where its logits are at hand, and only scaled in backward; per token ("none"),
  the upstream gradient differs by token, so backward recomputes each chunk instead.

auto is full on CUDA unless one micro-batch's logits pass FULL_LOGITS_MAX_ELEMS, chunked on CPU,
where the kept logits and their gradient set a step's peak memory (bench/results/README.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmforge.model.model import cross_entropy

HeadLoss = Callable[..., torch.Tensor]

# Logits elements per chunk: two fp32 chunk x V buffers (logits, log-probabilities) at a time. On
# CPU 2^23 (32 MiB each: chunks still hundreds of tokens tall at small vocabularies, so their
# matmuls run at full rate); on a GPU 2^27, so that a compiled graph holds a few chunks, not
# dozens.
CHUNK_ELEMS = {"cpu": 2**23, "cuda": 2**27}
# Above this many logits in one micro-batch (4 GiB in fp32, with as much again for their
# gradient), auto chunks on CUDA too.
FULL_LOGITS_MAX_ELEMS = 2**30


def resolve_loss(requested: str, device: torch.device, padded_vocab: int, tokens: int) -> str:
    """train.loss auto|full|chunked -> full|chunked for micro-batches of `tokens` tokens."""
    if requested != "auto":
        return requested
    if torch.device(device).type == "cuda" and tokens * padded_vocab <= FULL_LOGITS_MAX_ELEMS:
        return "full"
    return "chunked"


def eval_loss_name(resolved: str, padded_vocab: int, tokens: int) -> str:
    """The loss an evaluation batch of `tokens` computes with: the run's resolved one, but never
    whole logits past FULL_LOGITS_MAX_ELEMS (`eval.batch_size` / `eval --batch-size` may exceed
    the training micro-batch that chose "full")."""
    return "chunked" if tokens * padded_vocab > FULL_LOGITS_MAX_ELEMS else resolved


def chunk_tokens(padded_vocab: int, n_tokens: int | None = None,
                 elems: int = CHUNK_ELEMS["cpu"]) -> int:
    """Tokens per chunk: at most elems // V and, given the number of tokens, the chunks as even
    as that allows (no short last chunk: one more matmul shape)."""
    most = max(1, elems // padded_vocab)
    if not n_tokens:
        return most
    return -(-n_tokens // -(-n_tokens // most))


def _chunk(h_CD, w_VD, safe_C, vocab_size, softcap, want_grad):
    """One chunk: (loss_C, d loss_C.sum() / d raw logits in h's dtype, or None)."""
    logits_CV = (h_CD @ w_VD.T).float()
    if softcap:
        tanh_CV = torch.tanh(logits_CV / softcap)
        logits_CV = softcap * tanh_CV
    if vocab_size < logits_CV.shape[1]:
        logits_CV[:, vocab_size:] = float("-inf")  # padded columns: no mass, no gradient
    probs_CV = torch.softmax(logits_CV, dim=-1)  # one pass over each row, one exp per element
    # A row's largest probability, at its largest logit, is exactly 1 / sum(exp(z - max)), never
    # below 1/V: the log-sum-exp from it is exact where the target's own probability underflows
    # fp32. (amax, values only, takes an eighth of max(dim=-1)'s time, which also finds indices.)
    lse_C = logits_CV.amax(dim=-1) - probs_CV.amax(dim=-1).log()
    loss_C = lse_C - logits_CV.gather(1, safe_C[:, None]).squeeze(1)
    if not want_grad:
        return loss_C, None
    grad_CV = probs_CV  # softmax - one_hot, in place
    grad_CV[torch.arange(len(safe_C), device=safe_C.device), safe_C] -= 1.0
    if softcap:  # d(c·tanh(z/c))/dz = 1 - tanh²
        grad_CV *= 1.0 - tanh_CV * tanh_CV
    return loss_C, grad_CV.to(h_CD.dtype)


# Elements per block when, eager, a bf16 product is added into the fp32 head-gradient sum. Added
# whole, the CPU casts the operand into a fresh V x D fp32 copy first: at GPT-2's vocabulary 2-3x
# the add's time. By blocks the copy stays in cache (bench/results/README.md, the eager floor).
ADD_BLOCK_ELEMS = 2**20


def _add_by_blocks(sum_VD: torch.Tensor, part_VD: torch.Tensor) -> None:
    rows = max(1, ADD_BLOCK_ELEMS // sum_VD.shape[1])
    for start in range(0, len(sum_VD), rows):
        sum_VD[start:start + rows] += part_VD[start:start + rows]


def _chunks(h_ND, w_VD, targets_N, vocab_size, ignore_index, chunk, softcap, grad_scale_N=None):
    """(loss_N, None, None); or, given grad_scale_N, (sum of loss_N, the gradients of
    sum(grad_scale_N * loss_N) w.r.t. h_ND (its dtype) and w_VD (fp32)). The per-token scale goes
    on the D-wide factors, never on the C × V gradient."""
    valid_N = targets_N != ignore_index
    safe_N = torch.where(valid_N, targets_N, 0)
    want_grad = grad_scale_N is not None
    if want_grad:
        scale_N1 = torch.where(valid_N, grad_scale_N, 0.0)[:, None].to(h_ND.dtype)
    losses, grads_h, grad_w_VD = [], [], None
    for start in range(0, len(targets_N), chunk):
        part = slice(start, start + chunk)
        loss_C, grad_CV = _chunk(h_ND[part], w_VD, safe_N[part], vocab_size, softcap, want_grad)
        losses.append(loss_C)
        if not want_grad:
            continue
        grads_h.append((grad_CV @ w_VD) * scale_N1[part])
        hs_CD = h_ND[part] * scale_N1[part]
        if grad_w_VD is None:
            grad_w_VD = (grad_CV.T @ hs_CD).float()
        elif grad_CV.dtype == torch.float32:
            grad_w_VD.addmm_(grad_CV.T, hs_CD)
        elif torch.compiler.is_compiling():  # inductor fuses the upcast into one whole add
            grad_w_VD += grad_CV.T @ hs_CD
        else:
            _add_by_blocks(grad_w_VD, grad_CV.T @ hs_CD)
    loss_N = torch.where(valid_N, torch.cat(losses), 0.0)
    if not want_grad:
        return loss_N, None, None
    return loss_N.sum(), torch.cat(grads_h), grad_w_VD


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, targets_N, vocab_size, ignore_index, chunk, softcap, per_token):
        ctx.args = (vocab_size, ignore_index, chunk, softcap)
        ctx.per_token = per_token
        if per_token:
            ctx.save_for_backward(h_ND, w_VD, targets_N)
            return _chunks(h_ND, w_VD, targets_N, *ctx.args)[0]
        ones_N = torch.ones(len(targets_N), device=h_ND.device)
        loss, grad_h_ND, grad_w_VD = _chunks(h_ND, w_VD, targets_N, *ctx.args, ones_N)
        ctx.save_for_backward(grad_h_ND, grad_w_VD.to(w_VD.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.per_token:
            h_ND, w_VD, targets_N = ctx.saved_tensors
            _, grad_h_ND, grad_w_VD = _chunks(h_ND, w_VD, targets_N, *ctx.args, grad_loss.float())
            grad_w_VD = grad_w_VD.to(w_VD.dtype)
        else:
            grad_h_ND, grad_w_VD = ctx.saved_tensors
            grad_h_ND, grad_w_VD = grad_h_ND * grad_loss, grad_w_VD * grad_loss
        return grad_h_ND, grad_w_VD, None, None, None, None, None, None


@dataclass(frozen=True)
class ChunkedLoss:
    """Cross-entropy of softmax(h @ wᵀ) by chunks of `chunk` tokens (None: chunk_tokens within
    `elems` logits), eager or traced by torch.compile with the model."""

    chunk: int | None = None
    elems: int = CHUNK_ELEMS["cpu"]

    def __call__(self, h_BTD, w_VD, targets_BT, vocab_size, reduction="mean", ignore_index=-100,
                 softcap: float = 0.0):
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        # The head matmul's dtype: autocast's when on, else the weight's (FSDP2's bf16 params).
        device = h_BTD.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w_VD.dtype
        h_BTD, w_VD = h_BTD.to(dtype), w_VD.to(dtype)
        h_ND, targets_N = h_BTD.flatten(0, 1), targets_BT.flatten()
        chunk = self.chunk or chunk_tokens(w_VD.shape[0], len(targets_N), self.elems)
        args = (vocab_size, ignore_index, chunk, softcap)
        if torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad):
            loss = _Chunked.apply(h_ND, w_VD, targets_N, *args, reduction == "none")
        else:  # evaluation: the loss alone (the Function would also build the gradients)
            loss_N = _chunks(h_ND, w_VD, targets_N, *args)[0]
            loss = loss_N if reduction == "none" else loss_N.sum()
        if reduction == "none":
            return loss.view(targets_BT.shape)
        if reduction == "mean":
            return loss / (targets_N != ignore_index).sum()
        return loss


def build_loss(name: str, device: torch.device, compile_alone: bool = False) -> HeadLoss:
    """The HeadLoss of a resolved train.loss on `device`. compile_alone: the model's blocks are
    compiled apart (FSDP2), so the loss is compiled as its own region."""
    loss: HeadLoss = cross_entropy if name == "full" else ChunkedLoss(
        elems=CHUNK_ELEMS.get(torch.device(device).type, CHUNK_ELEMS["cpu"]))
    return torch.compile(loss, dynamic=False) if compile_alone else loss
