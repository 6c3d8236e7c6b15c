"""The LM-head loss paths (pipeline.loss: eager ChunkedLoss, both logits kernels, and FusedLoss,
eager and compiled): the same loss and gradients as cross-entropy on the full logits (the model's
own `cross_entropy`), without ever building the B×T×V logits or their gradient. Always reduced
in fp32, also when the head matmul is bf16 (autocast, FSDP's bf16 parameters).

The 2-rank checks run this file as a torchrun worker (`python -m tests.test_chunked_loss OUT`).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import pipeline.loss as loss_module
from model import GPT, ModelConfig
from pipeline.loss import ChunkedLoss, FusedLoss, select_loss

V_REAL = 1000  # padded to 1024 in the head: the padding columns must get no mass


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=V_REAL, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64)
    return ModelConfig(**(base | kw))


def batch(B=3, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx_BT = torch.randint(0, V_REAL, (B, T), generator=g)
    targets_BT = torch.randint(0, V_REAL, (B, T), generator=g)
    targets_BT[0, :5] = -100  # ignored tokens: no loss, no gradient, not in the mean's count
    return idx_BT, targets_BT


def plain_loss(model: GPT, idx_BT, targets_BT, reduction: str):
    """The reference: cross-entropy on the full logits (real vocabulary columns only)."""
    logits_BTV = model(idx_BT)
    loss = F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten(), reduction=reduction)
    return loss.view(targets_BT.shape) if reduction == "none" else loss


def loss_and_grads(model: GPT, loss_fn, upstream=None):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    (loss * (1.0 if upstream is None else upstream)).sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(params=["eager", "fused"])
def path(request):
    """Each loss path, as a function of the chunk size: ChunkedLoss, and FusedLoss run eagerly
    (compiled: tests/test_compile.py and the 2-rank check below)."""
    return FusedLoss if request.param == "fused" else ChunkedLoss


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", [7, 48, 4096])  # uneven last chunk; one chunk per row; one in all
@pytest.mark.parametrize("tie", [True, False])
def test_loss_and_gradients_equal_the_plain_path(reduction, chunk, tie, path):
    torch.manual_seed(0)
    model = GPT(tiny(tie_embeddings=tie))
    with torch.no_grad():  # make the padding rows of the head dominate if they were not masked
        model.lm_head.weight[V_REAL:] = 3.0
    idx_BT, targets_BT = batch()
    # "none" with a different upstream gradient per token: the backward that recomputes chunks.
    upstream = torch.rand(targets_BT.shape) if reduction == "none" else None
    ref, ref_grads = loss_and_grads(model, lambda: plain_loss(model, idx_BT, targets_BT, reduction), upstream)
    got, grads = loss_and_grads(
        model, lambda: model(idx_BT, targets_BT, reduction=reduction, loss_fn=path(chunk)), upstream)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=2e-5 if reduction == "sum" else 1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert model.lm_head.weight.grad[V_REAL:].abs().max() == 0
    if reduction == "none":
        assert got[0, :5].eq(0).all()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_head_without_padding_columns_equals_the_plain_path(reduction, path):
    """vocab_size a multiple of 64: no padded column, so FusedLoss builds no padding mask."""
    torch.manual_seed(0)
    model = GPT(tiny(vocab_size=1024))
    assert model.cfg.padded_vocab_size == 1024
    g = torch.Generator().manual_seed(1)
    idx_BT, targets_BT = torch.randint(0, 1024, (2, 3, 16), generator=g)
    targets_BT[:, -1] = 1023  # the last column: a target where a mask would have cut nothing
    upstream = torch.rand(targets_BT.shape) if reduction == "none" else None
    ref, ref_grads = loss_and_grads(model, lambda: plain_loss(model, idx_BT, targets_BT, reduction), upstream)
    got, grads = loss_and_grads(
        model, lambda: model(idx_BT, targets_BT, reduction=reduction, loss_fn=path(7)), upstream)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_target_whose_probability_underflows_gets_the_exact_loss(reduction, path):
    """A diverging run's logits can put a target's probability below fp32's smallest normal (a
    loss over 87 nats): there -log p is inf (p = 0) or rounded (p subnormal), yet the loss and its
    gradient must still be cross-entropy's."""
    D, V, vocab = 16, 24, 20  # columns 20-23 padded
    w_VD = torch.zeros(V, D)
    w_VD[:D] = torch.eye(D)
    h_BTD = torch.zeros(1, 6, D)
    h_BTD[0, :, 0] = torch.tensor([95.0, 300.0, 1.0, 150.0, 0.5, 2000.0])  # logit of column 0
    targets_BT = torch.tensor([[3, 5, 0, 1, 7, 2]])  # not column 0: losses ~95, 300, ..., 2000
    h_BTD, w_VD = h_BTD.requires_grad_(), w_VD.requires_grad_()
    upstream = torch.rand(targets_BT.shape) if reduction == "none" else 1.0

    def plain():
        loss = F.cross_entropy((h_BTD @ w_VD[:vocab].T).flatten(0, 1), targets_BT.flatten(),
                               reduction=reduction)
        return loss.view(targets_BT.shape) if reduction == "none" else loss

    def loss_and_grads_of(loss_fn):
        loss = loss_fn()
        return loss.detach(), torch.autograd.grad((loss * upstream).sum(), (h_BTD, w_VD))

    ref, ref_grads = loss_and_grads_of(plain)
    got, grads = loss_and_grads_of(lambda: path(2)(h_BTD, w_VD, targets_BT, vocab, reduction))
    assert torch.isfinite(got).all()
    if reduction == "none":
        assert got[0, 5] > 1000 and got[0, 0] > 90
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_never_builds_the_full_logits_nor_their_gradient(reduction, path):
    torch.manual_seed(0)
    model = GPT(tiny())
    B, T, V = 4, 32, model.cfg.padded_vocab_size
    idx_BT, targets_BT = batch(B, T)
    with LargestTensor() as seen:
        model(idx_BT, targets_BT, reduction=reduction, loss_fn=path(8)).sum().backward()
    # The largest tensors left are the head weight and its gradient (V×D), or a chunk's logits.
    assert seen.numel <= max(8 * V, V * model.cfg.d_model) < B * T * V, (seen.numel, B * T * V)
    with LargestTensor() as seen_plain:  # the check can fail: the plain path trips it
        plain_loss(model, idx_BT, targets_BT, "sum").backward()
    assert seen_plain.numel >= B * T * V_REAL


def test_chunk_size_follows_the_vocabulary_and_splits_evenly():
    """Unset, a chunk is at most ELEMS // V tokens, the chunks as even as that allows (2,048
    tokens at V 50,304 within 2^23: 13 chunks of <= 158, not 12 of 166 and one of 56); at V
    1,024 a 4x32 batch is one chunk."""
    most = loss_module.EAGER_CHUNK_ELEMS // 50304
    assert loss_module.chunk_tokens(50304) == most and loss_module.chunk_tokens(2**30) == 1
    chunk = loss_module.chunk_tokens(50304, 2048)
    n_chunks = -(-2048 // chunk)
    assert chunk <= most and n_chunks == -(-2048 // most) and 2048 - (n_chunks - 1) * chunk > chunk - n_chunks
    assert loss_module.chunk_tokens(50304, 2048, loss_module.FUSED_CHUNK_ELEMS) == 512
    torch.manual_seed(0)
    model = GPT(tiny())
    idx_BT, targets_BT = batch(4, 32)
    with LargestTensor() as seen:
        model(idx_BT, targets_BT, loss_fn=FusedLoss()).backward()
    assert seen.numel >= 4 * 32 * model.cfg.padded_vocab_size  # one chunk: the whole logits


class FreshLogitsBuffers(TorchDispatchMode):
    """Counts the tensors of width V an op allocates (not views, not written in place or via out=)."""

    def __init__(self, V):
        super().__init__()
        self.V, self.count = V, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        storage = {t.untyped_storage().data_ptr() for t in (*args, *kwargs.values())
                   if isinstance(t, torch.Tensor)}  # views and in-place / out= results share one
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.V
                    and t.untyped_storage().data_ptr() not in storage):
                self.count += 1
        return out


@pytest.mark.parametrize("reduction, passes", [("sum", 1), ("none", 2)])
def test_chunks_reuse_their_buffers_whatever_their_number(reduction, passes):
    """A fresh C×V tensor per chunk costs page faults, memory traffic and heap holes on CPU:
    every eager chunk writes its probabilities and gradient into one buffer allocated once
    per pass (forward; and the per-token backward, which recomputes), and its logits into
    another. (Compiled, FusedLoss's buffers are inductor's to plan.)"""
    torch.manual_seed(0)
    model = GPT(tiny())
    V = model.cfg.padded_vocab_size
    idx_BT, targets_BT = batch(4, 32)  # 16 chunks
    with FreshLogitsBuffers(V) as seen:
        model(idx_BT, targets_BT, reduction=reduction, loss_fn=ChunkedLoss(8)).sum().backward()
    assert seen.count == 2 * passes, seen.count
    with FreshLogitsBuffers(V) as seen_plain:  # the counter sees the plain path's logits
        plain_loss(model, idx_BT, targets_BT, "sum").backward()
    assert seen_plain.count >= 2


def whole_casts(shape, run) -> int:
    """How many times run() casts a tensor of `shape` to another dtype, also inside an op (an
    in-place add of a bf16 operand into fp32 on CPU casts the operand first)."""
    from torch.profiler import profile

    with profile(record_shapes=True) as prof:
        run()
    return sum(e.name == "aten::_to_copy" and list(e.input_shapes[0]) == list(shape)
               for e in prof.events())


def test_bf16_head_gradient_adds_up_without_casting_it_whole_per_chunk(monkeypatch):
    """Under bf16 autocast each chunk's head gradient is a bf16 V×D product added into the fp32
    sum. Added whole, CPU first casts all of it to a fresh fp32 V×D tensor, every chunk (51 MB
    at GPT-2's vocabulary, page-faulted in each time); added by blocks, only the blocks are
    cast, and a step's whole V×D casts do not grow with the number of chunks."""
    monkeypatch.setattr(loss_module, "ADD_BLOCK_ELEMS", 64 * 32)  # blocks of 64 rows at D 32
    torch.manual_seed(0)
    model = GPT(tiny())
    shape = (model.cfg.padded_vocab_size, model.cfg.d_model)
    idx_BT, targets_BT = batch(4, 32)

    def step(chunk):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx_BT, targets_BT, loss_fn=ChunkedLoss(chunk))
        loss.backward()

    casts = {chunk: whole_casts(shape, lambda c=chunk: step(c)) for chunk in (64, 8)}  # 2, 16 chunks
    assert casts[8] == casts[64], casts
    added_whole = whole_casts(shape, lambda: torch.zeros(shape).add_(torch.ones(shape).bfloat16()))
    assert added_whole == 2  # the counter sees the cast inside add_ (and the one asked for)


def exact_token_losses(model: GPT, idx_BT, targets_BT) -> torch.Tensor:
    """Per-token loss in fp64 from the fp32 weights: the number bf16 runs are judged against."""
    ref = GPT(model.cfg).double()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        return ref(idx_BT, targets_BT, reduction="none")


# bf16 matmuls and activations move a token's loss off the fp64 one by up to 1.6e-3 here
# (measured, FSDP bf16; autocast less); a loss rounded to bf16 (ulp 0.03 at 6.9) by up to 1.6e-2.
BF16_TOKEN_TOL, BF16_MEAN_TOL = 5e-3, 5e-4


@pytest.mark.parametrize("chunk", [16, None])  # chunked; logits of one chunk
@pytest.mark.parametrize("loss_fn", [ChunkedLoss, FusedLoss])
def test_bf16_autocast_loss_is_fp32_and_close_to_exact(chunk, loss_fn):
    torch.manual_seed(0)
    model = GPT(tiny())
    idx_BT, targets_BT = batch(4, 32)
    exact_BT = exact_token_losses(model, idx_BT, targets_BT)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_BT = model(idx_BT, targets_BT, reduction="none", loss_fn=loss_fn(chunk))
        mean = model(idx_BT, targets_BT, loss_fn=loss_fn(chunk))
    assert got_BT.dtype == mean.dtype == torch.float32
    assert (got_BT.double() - exact_BT).abs().max() < BF16_TOKEN_TOL
    valid_BT = targets_BT != -100
    assert abs(mean.double() - exact_BT[valid_BT].mean()) < BF16_MEAN_TOL


# ---- 2 ranks, gloo: DDP and FSDP2 (fp32, bf16, compiled) -----------------------------------------


def dist_worker(out_path: str) -> None:
    """Each rank: the loss and gradients of its half of a batch, under DDP, FSDP2, FSDP2 bf16 and
    compiled DDP / FSDP2 (whole model with the fused loss in its graph / per-block units and the
    fused loss compiled alone); rank 0 writes the largest differences from the plain
    single-process path."""
    from pipeline.distributed import distributed

    with distributed("cpu") as info:
        out = dist_results(info)
    if info.is_main:
        with open(out_path, "w") as f:
            json.dump(out, f)


def dist_results(info) -> dict:
    from dataclasses import replace

    from torch.distributed.tensor import DTensor

    from pipeline.parallelize import Precision, parallelize

    cfg = tiny()
    idx_BT, targets_BT = batch(4, 32)
    mine = slice(2 * info.rank, 2 * info.rank + 2)
    torch.manual_seed(0)
    ref = GPT(cfg)
    # DDP/FSDP average the gradients of the ranks' sums: the plain gradient of the sum / 2.
    _, ref_grads = loss_and_grads(ref, lambda: plain_loss(ref, idx_BT, targets_BT, "sum") / 2)
    exact_BT = exact_token_losses(ref, idx_BT, targets_BT)[mine]
    out = {}
    for parallel, bf16, compiled in (("ddp", False, False), ("fsdp", False, False),
                                     ("fsdp", True, False), ("ddp", False, True), ("fsdp", False, True)):
        torch.manual_seed(0)
        model = GPT(cfg)
        precision = Precision(torch.bfloat16 if bf16 else torch.float32, info.device)
        pm = parallelize(model, info, parallel=parallel, precision=precision,
                         compile_model=compiled, activation_checkpointing=False)
        # The loss parallelize selects, by chunks of 16 tokens (4 chunks of this rank's 64).
        pm = replace(pm, head_loss=select_loss(compiled, parallel != "fsdp", chunk=16))
        loss_BT = pm.loss(idx_BT[mine], targets_BT[mine], reduction="none")
        loss_BT.sum().backward()
        name = parallel + ("_bf16" if bf16 else "") + ("_compiled" if compiled else "")
        if bf16:
            err = (loss_BT.detach().double() - exact_BT).abs()
            valid_BT = targets_BT[mine] != -100
            mean_err = abs(loss_BT.detach().double()[valid_BT].mean() - exact_BT[valid_BT].mean())
            out[name] = {"dtype": str(loss_BT.dtype), "token_err": err.max().item(),
                         "mean_err": mean_err.item()}
            continue
        grad_err = 0.0
        for p, ref_p in zip(model.parameters(), ref.parameters(), strict=True):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grad_err = max(grad_err, (g - ref_p.grad).abs().max().item())
        out[name] = {"token_err": (loss_BT.detach().double() - exact_BT).abs().max().item(),
                     "grad_err": grad_err}
    return out


@pytest.mark.dist
@pytest.mark.slow  # two cold compiles per rank: ~2 min on 2 idle cores
def test_ddp_and_fsdp_two_ranks_eager_and_compiled_equal_plain_path_and_bf16_loss_is_fp32(tmp_path):
    from bench.runs import run

    out = tmp_path / "out.json"
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", "tests.test_chunked_loss", str(out)], timeout=600)
    assert res.returncode == 0, res.stdout[-3000:]
    got = json.loads(out.read_text())
    for name in ("ddp", "fsdp"):
        assert got[name]["token_err"] < 1e-5 and got[name]["grad_err"] < 1e-6, got
        # Compiled kernels may sum in another order: same numbers to fp32 rounding.
        compiled = got[f"{name}_compiled"]
        assert compiled["token_err"] < 1e-5 and compiled["grad_err"] < 1e-5, got
    # Under FSDP bf16 there is no autocast: the loss must still be computed and returned in fp32.
    assert got["fsdp_bf16"]["dtype"] == "torch.float32", got
    assert got["fsdp_bf16"]["token_err"] < BF16_TOKEN_TOL, got
    assert got["fsdp_bf16"]["mean_err"] < BF16_MEAN_TOL, got


@pytest.mark.parametrize("n_columns", [loss_module.EXACT_FLOAT_INDEX,
                                       loss_module.EXACT_FLOAT_INDEX + 1])
def test_chunk_columns_hold_every_index_exactly(n_columns):
    """The fused loss compares columns and targets in column_dtype: fp32 while it holds every
    index (2^24 + 1 would round to 2^24 in fp32), int32 beyond."""
    targets_C = torch.tensor([0, n_columns - 2, n_columns - 1])
    dtype = loss_module.column_dtype(n_columns)
    assert dtype == (torch.float32 if n_columns <= 2**24 else torch.int32)
    safe_C, cols_V = torch.ops.lmforge.chunk_columns(targets_C, n_columns, dtype)
    assert torch.equal(cols_V.long(), torch.arange(n_columns))
    assert torch.equal(safe_C.long(), targets_C) and torch.equal(cols_V[safe_C.long()], safe_C)


if __name__ == "__main__":
    dist_worker(sys.argv[1])
