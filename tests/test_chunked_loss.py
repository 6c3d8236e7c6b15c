"""The chunked LM-head loss (pipeline.loss.ChunkedLoss, eager and compiled): the same loss and
gradients as cross-entropy on the full logits (the model's own `cross_entropy`), also with a
logit softcap, without ever building the B×T×V logits or their gradient; always reduced in fp32,
also when the head matmul is bf16 (autocast, FSDP's bf16 parameters). And train.loss = auto's rule.

The 2-rank checks run this file as a torchrun worker (`python -m tests.test_chunked_loss OUT`).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.model import GPT, ModelConfig
from lmforge.model.model import cross_entropy
from lmforge.pipeline.loss import (
    CHUNK_ELEMS,
    FULL_LOGITS_MAX_ELEMS,
    ChunkedLoss,
    build_loss,
    chunk_tokens,
    resolve_loss,
)

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


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", [7, 48, 4096])  # uneven last chunk; one chunk per row; one in all
@pytest.mark.parametrize("tie", [True, False])
def test_loss_and_gradients_equal_the_plain_path(reduction, chunk, tie):
    torch.manual_seed(0)
    model = GPT(tiny(tie_embeddings=tie))
    with torch.no_grad():  # make the padding rows of the head dominate if they were not masked
        model.lm_head.weight[V_REAL:] = 3.0
    idx_BT, targets_BT = batch()
    # "none" with a different upstream gradient per token: the backward that recomputes chunks.
    upstream = torch.rand(targets_BT.shape) if reduction == "none" else None
    ref, ref_grads = loss_and_grads(model, lambda: plain_loss(model, idx_BT, targets_BT, reduction), upstream)
    got, grads = loss_and_grads(
        model, lambda: model(idx_BT, targets_BT, reduction=reduction, loss_fn=ChunkedLoss(chunk)),
        upstream)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=2e-5 if reduction == "sum" else 1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert model.lm_head.weight.grad[V_REAL:].abs().max() == 0
    if reduction == "none":
        assert got[0, :5].eq(0).all()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_head_without_padding_columns_equals_the_plain_path(reduction):
    """vocab_size a multiple of 64: no padded column, and a target in the last column."""
    torch.manual_seed(0)
    model = GPT(tiny(vocab_size=1024))
    assert model.cfg.padded_vocab_size == 1024
    g = torch.Generator().manual_seed(1)
    idx_BT, targets_BT = torch.randint(0, 1024, (2, 3, 16), generator=g)
    targets_BT[:, -1] = 1023
    upstream = torch.rand(targets_BT.shape) if reduction == "none" else None
    ref, ref_grads = loss_and_grads(model, lambda: plain_loss(model, idx_BT, targets_BT, reduction), upstream)
    got, grads = loss_and_grads(
        model, lambda: model(idx_BT, targets_BT, reduction=reduction, loss_fn=ChunkedLoss(7)), upstream)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def head_operands(seed=0, B=2, T=24, D=16, V=72):
    g = torch.Generator().manual_seed(seed)
    h_BTD = (torch.randn(B, T, D, generator=g) * 2).requires_grad_()
    w_VD = torch.randn(V, D, generator=g).requires_grad_()
    return h_BTD, w_VD


def grads_of(loss_fn, h_BTD, w_VD, upstream):
    loss = loss_fn()
    return loss.detach(), torch.autograd.grad((loss * upstream).sum(), (h_BTD, w_VD))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", [5, None])
def test_softcap_equals_capping_the_full_logits(reduction, chunk):
    """softcap c: cross-entropy of c·tanh(logits / c) (Gemma 2's cap), computed the plain way
    for the reference; the padded columns (64-71) still get no mass and no gradient."""
    cap, vocab = 3.0, 64
    h_BTD, w_VD = head_operands()
    targets_BT = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(2))
    targets_BT[1, :4] = -100
    upstream = torch.rand(targets_BT.shape) if reduction == "none" else 1.0

    def plain():
        logits_NV = (h_BTD @ w_VD[:vocab].T).flatten(0, 1)
        loss = F.cross_entropy(cap * torch.tanh(logits_NV / cap), targets_BT.flatten(),
                               reduction=reduction)
        return loss.view(targets_BT.shape) if reduction == "none" else loss

    ref, ref_grads = grads_of(plain, h_BTD, w_VD, upstream)
    got, grads = grads_of(lambda: ChunkedLoss(chunk)(h_BTD, w_VD, targets_BT, vocab, reduction,
                                                     softcap=cap), h_BTD, w_VD, upstream)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    assert grads[1][vocab:].abs().max() == 0
    # The cap changes the numbers: the check compares two different losses without it.
    uncapped = ChunkedLoss(chunk)(h_BTD, w_VD, targets_BT, vocab, reduction)
    assert (uncapped.detach() - ref).abs().max() > 0.1


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_target_whose_probability_underflows_gets_the_exact_loss(reduction):
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

    ref, ref_grads = grads_of(plain, h_BTD, w_VD, upstream)
    got, grads = grads_of(lambda: ChunkedLoss(2)(h_BTD, w_VD, targets_BT, vocab, reduction),
                          h_BTD, w_VD, upstream)
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
def test_never_builds_the_full_logits_nor_their_gradient(reduction):
    torch.manual_seed(0)
    model = GPT(tiny())
    B, T, V = 4, 32, model.cfg.padded_vocab_size
    idx_BT, targets_BT = batch(B, T)
    with LargestTensor() as seen:
        model(idx_BT, targets_BT, reduction=reduction, loss_fn=ChunkedLoss(8)).sum().backward()
    # The largest tensors left are the head weight and its gradient (V×D), or a chunk's logits.
    assert seen.numel <= max(8 * V, V * model.cfg.d_model) < B * T * V, (seen.numel, B * T * V)
    with LargestTensor() as seen_plain:  # the check can fail: the plain path trips it
        plain_loss(model, idx_BT, targets_BT, "sum").backward()
    assert seen_plain.numel >= B * T * V_REAL


def test_chunk_size_follows_the_vocabulary_and_splits_evenly():
    """Unset, a chunk is at most ELEMS // V tokens, the chunks as even as that allows (2,048
    tokens at V 50,304 within 2^23: 13 chunks of <= 158, not 12 of 166 and one of 56); within
    CUDA's 2^27, or at V 1,024 on CPU, a batch is one chunk."""
    most = CHUNK_ELEMS["cpu"] // 50304
    assert chunk_tokens(50304) == most and chunk_tokens(2**30) == 1
    chunk = chunk_tokens(50304, 2048)
    n_chunks = -(-2048 // chunk)
    assert (chunk, n_chunks) == (158, 13) and n_chunks == -(-2048 // most)
    assert 2048 - (n_chunks - 1) * chunk > chunk - n_chunks  # the last chunk is not short
    assert chunk_tokens(50304, 2048, CHUNK_ELEMS["cuda"]) == 2048
    torch.manual_seed(0)
    model = GPT(tiny())
    idx_BT, targets_BT = batch(4, 32)
    with LargestTensor() as seen:
        model(idx_BT, targets_BT, loss_fn=ChunkedLoss()).backward()
    assert seen.numel >= 4 * 32 * model.cfg.padded_vocab_size  # one chunk: the whole logits


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
def test_bf16_autocast_loss_is_fp32_and_close_to_exact(chunk):
    torch.manual_seed(0)
    model = GPT(tiny())
    idx_BT, targets_BT = batch(4, 32)
    exact_BT = exact_token_losses(model, idx_BT, targets_BT)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_BT = model(idx_BT, targets_BT, reduction="none", loss_fn=ChunkedLoss(chunk))
        mean = model(idx_BT, targets_BT, loss_fn=ChunkedLoss(chunk))
    assert got_BT.dtype == mean.dtype == torch.float32
    assert (got_BT.double() - exact_BT).abs().max() < BF16_TOKEN_TOL
    valid_BT = targets_BT != -100
    assert abs(mean.double() - exact_BT[valid_BT].mean()) < BF16_MEAN_TOL


def test_bf16_autocast_gradients_are_as_close_to_fp64_as_the_full_logits_ones():
    """Under autocast the chunk's gradient is cast to bf16 for the two head products, as the
    full path's backward computes them in bf16: the head's gradients (h's, w's) stay within a
    couple of bf16 steps of the fp64 gradients, as close as the full path's."""
    torch.manual_seed(0)
    h_BTD, w_VD = head_operands(T=48, D=32, V=1024)
    targets_BT = torch.randint(0, V_REAL, (2, 48), generator=torch.Generator().manual_seed(3))
    h64_BTD, w64_VD = (t.detach().double().requires_grad_() for t in (h_BTD, w_VD))
    _, exact = grads_of(lambda: cross_entropy(h64_BTD, w64_VD, targets_BT, V_REAL), h64_BTD,
                        w64_VD, 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, full = grads_of(lambda: cross_entropy(h_BTD, w_VD, targets_BT, V_REAL), h_BTD, w_VD, 1.0)
        _, chunked = grads_of(lambda: ChunkedLoss(16)(h_BTD, w_VD, targets_BT, V_REAL), h_BTD,
                              w_VD, 1.0)
    for name, c, f, x in zip(("h", "w"), chunked, full, exact):
        scale = x.abs().max().item()
        err_chunked, err_full = (c.double() - x).abs().max().item(), (f.double() - x).abs().max().item()
        assert err_chunked <= max(2 * err_full, 2 * 2**-8 * scale), (name, err_chunked, err_full)


def test_bf16_head_gradient_added_by_blocks_is_bitwise_the_whole_add(monkeypatch):
    """Eager, each chunk's bf16 head-gradient product joins the fp32 sum by blocks of rows: the
    same additions, so the same bits as one block, here with 90-row blocks (the last one short,
    over real vocabulary rows)."""
    h_BTD, w_VD = head_operands(T=48, D=32, V=1024)
    targets_BT = torch.randint(0, V_REAL, (2, 48), generator=torch.Generator().manual_seed(3))
    got = {}
    for elems in (2**30, 32 * 90):
        monkeypatch.setattr("lmforge.pipeline.loss.ADD_BLOCK_ELEMS", elems)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, got[elems] = grads_of(lambda: ChunkedLoss(16)(h_BTD, w_VD, targets_BT, V_REAL),
                                     h_BTD, w_VD, 1.0)
    for whole, blocked in zip(got[2**30], got[32 * 90]):
        assert torch.equal(whole, blocked)
    assert got[2**30][1][990:V_REAL].abs().sum() > 0  # the short last block holds gradient


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_loss_compiled_alone_equals_eager_without_recompiles(reduction):
    """build_loss(compile_alone=True): FSDP2's compiled loss region (the whole model compiled
    with the loss in its graph: tests/test_compile.py). Several chunks, the last one short;
    training's call and eval's (no grad) each build one graph, and a second call none."""
    from lmforge.pipeline.parallel.parallelize import compiled_graphs

    torch._dynamo.reset()
    loss_fn = torch.compile(ChunkedLoss(10), dynamic=False)
    h_BTD, w_VD = head_operands()
    targets_BT = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(4))
    targets_BT[0, :3] = -100
    upstream = torch.rand(targets_BT.shape) if reduction == "none" else 1.0
    ref, ref_grads = grads_of(lambda: ChunkedLoss(10)(h_BTD, w_VD, targets_BT, 64, reduction),
                              h_BTD, w_VD, upstream)
    before, built = compiled_graphs(), []
    for _ in range(2):
        got, grads = grads_of(lambda: loss_fn(h_BTD, w_VD, targets_BT, 64, reduction), h_BTD,
                              w_VD, upstream)
        with torch.no_grad():
            evaluated = loss_fn(h_BTD, w_VD, targets_BT, 64, reduction)
        built.append(compiled_graphs() - before)
    assert built == [2, 2], built
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(evaluated, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("requested, device, tokens, expected", [
    ("full", "cpu", 8 * 256, "full"),  # an explicit choice is kept anywhere
    ("chunked", "cuda", 8 * 256, "chunked"),
    ("auto", "cpu", 8 * 256, "chunked"),
    ("auto", "cuda", 8 * 256, "full"),
    ("auto", "cuda", FULL_LOGITS_MAX_ELEMS // 1024, "full"),  # exactly at the limit
    ("auto", "cuda", FULL_LOGITS_MAX_ELEMS // 1024 + 1, "chunked"),  # one token past it
])
def test_auto_loss_is_full_on_cuda_below_the_logits_limit_and_chunked_on_cpu(
        requested, device, tokens, expected):
    assert resolve_loss(requested, torch.device(device), 1024, tokens) == expected


def test_build_loss_gives_each_device_its_chunk_and_compiles_only_when_alone():
    assert build_loss("full", torch.device("cpu")) is cross_entropy
    for device in ("cpu", "cuda"):
        assert build_loss("chunked", torch.device(device)) == ChunkedLoss(elems=CHUNK_ELEMS[device])
    alone = build_loss("chunked", torch.device("cpu"), compile_alone=True)
    assert not isinstance(alone, ChunkedLoss) and callable(alone)  # torch.compile's wrapper


# ---- 2 ranks, gloo: DDP and FSDP2 (fp32, bf16, compiled) -----------------------------------------


def dist_worker(out_path: str) -> None:
    """Each rank: the loss and gradients of its half of a batch, under DDP, FSDP2, FSDP2 bf16 and
    compiled DDP / FSDP2 (whole model with the chunked loss in its graph / per-block units and
    the loss compiled alone); rank 0 writes the largest differences from the plain
    single-process path."""
    from lmforge.pipeline.parallel.distributed import distributed

    with distributed("cpu") as info:
        out = dist_results(info)
    if info.is_main:
        with open(out_path, "w") as f:
            json.dump(out, f)


def dist_results(info) -> dict:
    from dataclasses import replace

    from torch.distributed.tensor import DTensor

    from lmforge.pipeline.parallel.parallelize import Precision, parallelize

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
                         compile_model=compiled, activation_checkpointing=False, loss="chunked")
        # As parallelize builds it, by chunks of 16 tokens (4 chunks of this rank's 64).
        alone = compiled and parallel == "fsdp"
        head_loss = ChunkedLoss(16)
        pm = replace(pm, head_loss=torch.compile(head_loss, dynamic=False) if alone else head_loss)
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
    from tests.harness import run

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


if __name__ == "__main__":
    dist_worker(sys.argv[1])


def test_an_eval_batch_never_builds_whole_logits_past_the_bound():
    """eval.batch_size (or `eval --batch-size`) may exceed the micro-batch that chose "full":
    an evaluation batch whose logits would pass FULL_LOGITS_MAX_ELEMS is scored by chunks."""
    from lmforge.pipeline.loss import FULL_LOGITS_MAX_ELEMS, eval_loss_name

    V = 50304
    fits = FULL_LOGITS_MAX_ELEMS // V
    assert eval_loss_name("full", V, fits) == "full"
    assert eval_loss_name("full", V, fits + 1) == "chunked"
    assert eval_loss_name("chunked", V, 1) == "chunked"
