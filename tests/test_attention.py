"""pipeline.attention and its eager kernel (pipeline.cpu.attention): the eager kernel computes
SDPA's attention (values and gradients, fp32 and bf16, causal / masked / GQA / a longer key
sequence) computing only the scores its query blocks see, the model trains the same with either,
and train.attention = auto is a static rule a run records in its config and keeps on resume."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.model import GPT, ModelConfig
from lmforge.pipeline import attention
from lmforge.pipeline.config import load_config
from lmforge.pipeline.cpu import attention as eager
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.train import Trainer
from tests.test_train import cfg_for

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
CFG = ModelConfig(vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, d_model=64, max_seq_len=64)


def heads(B, H, G, T, S, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, 16, generator=g) * 2  # scores far from uniform
    k, v = torch.randn(B, G, S, 16, generator=g), torch.randn(B, G, S, 16, generator=g)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def run(attend, qkv, **kw):
    out = attend(*qkv, **kw)
    out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    return [out.detach().double()] + [t.grad.double() for t in qkv]


CASES = [  # (H, G, T, S, mask kwargs)
    (4, 4, 32, 32, "causal"),
    (4, 2, 32, 32, "causal"),  # GQA
    (4, 1, 8, 24, "causal"),  # MQA, more keys than queries: SDPA's top-left causal mask
    (4, 2, 16, 16, "bool"),  # the KV cache's kind of mask
    (4, 4, 16, 16, "none"),
]


def mask_kwargs(kind, T, S):
    if kind == "causal":
        return {"is_causal": True}
    if kind == "bool":
        m = torch.rand(T, S, generator=torch.Generator().manual_seed(1)) > 0.4
        m[:, 0] = True  # every query sees at least one key
        return {"attn_mask": m}
    return {}


CASES += [(4, 2, 40, 40, "causal"), (4, 1, 20, 44, "causal"), (4, 2, 40, 20, "causal")]


@pytest.fixture(params=["default", "small"])
def query_block(request, monkeypatch):
    """Causal eager attention by the shipped block size (above the cases' T: one block) and by
    blocks of 12 queries (several, the last one short)."""
    if request.param == "small":
        monkeypatch.setattr(eager, "QUERY_BLOCK", 12)


@pytest.mark.parametrize("H,G,T,S,kind", CASES)
def test_eager_attention_equals_sdpa_in_fp32(H, G, T, S, kind, query_block):
    kw = mask_kwargs(kind, T, S) | {"enable_gqa": G != H}
    ref = run(F.scaled_dot_product_attention, heads(2, H, G, T, S, torch.float32), **kw)
    got = run(eager.eager_attention, heads(2, H, G, T, S, torch.float32), **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (name, (a - b).abs().max().item())


@pytest.mark.parametrize("H,G,T,S,kind", CASES)
def test_eager_attention_in_bf16_is_as_close_to_fp64_as_sdpa_is(H, G, T, S, kind, query_block):
    """bf16 rounds the scores before the softmax (as HF's and nanoGPT's eager paths do): its
    error against a float64 reference stays within a few bf16 steps of SDPA's own."""
    kw = mask_kwargs(kind, T, S) | {"enable_gqa": G != H}
    exact = run(F.scaled_dot_product_attention, heads(2, H, G, T, S, torch.float64), **kw)
    sdpa = run(F.scaled_dot_product_attention, heads(2, H, G, T, S, torch.bfloat16), **kw)
    ours = run(eager.eager_attention, heads(2, H, G, T, S, torch.bfloat16), **kw)
    for name, e, s, x in zip(("out", "dq", "dk", "dv"), ours, sdpa, exact):
        scale = x.abs().max().item()
        err_eager, err_sdpa = (e - x).abs().max().item(), (s - x).abs().max().item()
        assert err_eager <= max(2 * err_sdpa, 4 * 2**-8 * scale), (name, err_eager, err_sdpa, scale)


def test_causal_eager_attention_skips_the_scores_right_of_each_query_block():
    """No query of a block sees a key past the block: its scores are never computed. At T a
    multiple of the block, that is (1 + QUERY_BLOCK / T) / 2 of the T x T scores (3/4 at 2
    blocks), in each of the forward's two matmuls."""
    from torch.utils.flop_counter import FlopCounterMode

    B, H, K, T = 1, 2, 16, 2 * eager.QUERY_BLOCK
    q, k, v = (torch.randn(B, H, T, K) for _ in range(3))
    with FlopCounterMode(display=False) as flops:
        eager.eager_attention(q, k, v, is_causal=True)
    scores = sum((b - a) * keys for a, b, keys in eager.causal_blocks(T, T))
    assert scores == T * T * (1 + eager.QUERY_BLOCK / T) / 2
    assert flops.get_total_flops() == 2 * (2 * B * H * K * scores)


def loss_and_grads(attend):
    torch.manual_seed(0)
    model = GPT(CFG)
    x_BT, y_BT = torch.randint(0, 300, (2, 2, 48), generator=torch.Generator().manual_seed(0))
    loss = model(x_BT, y_BT, attend=attend)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_the_model_trains_the_same_with_either_kernel():
    ref_loss, ref = loss_and_grads(F.scaled_dot_product_attention)
    loss, got = loss_and_grads(eager.eager_attention)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for n in ref:
        assert torch.allclose(got[n], ref[n], rtol=1e-4, atol=1e-6), n




def test_causal_blocks_cover_every_query_once_and_stop_at_their_last_row():
    Q = eager.QUERY_BLOCK
    T = 2 * Q + 5  # two whole blocks and a short one
    assert eager.causal_blocks(T, T) == [(0, Q, Q), (Q, 2 * Q, 2 * Q), (2 * Q, T, T)]


@pytest.mark.parametrize("requested, device, dtype, seq_len, expected", [
    ("auto", "cuda", torch.bfloat16, 256, "sdpa"),
    ("auto", "cuda", torch.float32, 256, "sdpa"),
    ("auto", "cpu", torch.float32, 256, "sdpa"),  # fp32: sdpa won at every length
    ("auto", "cpu", torch.bfloat16, 64, "eager"),
    ("auto", "cpu", torch.bfloat16, attention.EAGER_MAX_T, "eager"),
    ("auto", "cpu", torch.bfloat16, attention.EAGER_MAX_T + 1, "sdpa"),
    ("auto", "cpu", torch.bfloat16, 1024, "sdpa"),
    ("eager", "cuda", torch.bfloat16, 4096, "eager"),  # explicit choices are kept
    ("sdpa", "cpu", torch.bfloat16, 64, "sdpa"),
])
def test_auto_is_eager_only_on_a_bf16_cpu_at_short_sequences(requested, device, dtype, seq_len,
                                                            expected):
    assert attention.EAGER_MAX_T == 512
    assert attention.resolve(requested, torch.device(device), dtype, seq_len) == expected


def test_each_choice_names_its_kernel():
    assert attention.kernel("sdpa") is F.scaled_dot_product_attention
    assert attention.kernel("eager") is eager.eager_attention


def test_a_run_records_its_choice_and_keeps_it_on_resume(tiny_data, tmp_path, monkeypatch):
    """Started where auto meant eager (a bf16 CPU: the rule is patched, bf16 is emulated here),
    resumed where the rule says sdpa (this fp32 CPU): the resumed run computes as it started."""
    run_dir = tmp_path / "run"
    real = attention.resolve
    monkeypatch.setattr(attention, "resolve", lambda *a: "eager")
    auto = ("--train.attention", "auto", "--checkpoint.every", "3", "--train.max_steps", "6")
    Trainer(cfg_for(tiny_data, run_dir, *auto), CPU).fit()
    assert load_config(str(run_dir / "config.toml"), []).train.attention == "eager"
    monkeypatch.setattr(attention, "resolve", real)
    assert attention.resolve("auto", CPU.device, torch.float32, 64) == "sdpa"
    fresh = Trainer(cfg_for(tiny_data, tmp_path / "fresh", *auto), CPU)
    assert fresh.cfg.train.attention == "sdpa"  # what the rule gives a run started here
    assert fresh.parallel.attend is F.scaled_dot_product_attention
    step_3 = run_dir / "checkpoints" / "step_00000003"
    trainer = Trainer(cfg_for(tiny_data, run_dir, *auto, "--checkpoint.resume", str(step_3)), CPU)
    assert trainer.step == 3 and trainer.cfg.train.attention == "eager"
    assert trainer.parallel.attend is eager.eager_attention
    trainer.fit()
    assert load_config(str(run_dir / "config.toml"), []).train.attention == "eager"
