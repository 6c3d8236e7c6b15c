"""pipeline.attention: the eager kernel computes SDPA's attention (values and gradients, fp32 and
bf16, causal / masked / GQA / a longer key sequence), the model trains the same with either, and
train.attention = auto chooses from what it measures, says so, and keeps its choice on resume."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn.functional as F

from model import GPT, ModelConfig
from pipeline import attention
from pipeline.config import load_config
from pipeline.distributed import DistInfo
from pipeline.train import Trainer
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
        monkeypatch.setattr(attention, "QUERY_BLOCK", 12)


@pytest.mark.parametrize("H,G,T,S,kind", CASES)
def test_eager_attention_equals_sdpa_in_fp32(H, G, T, S, kind, query_block):
    kw = mask_kwargs(kind, T, S) | {"enable_gqa": G != H}
    ref = run(F.scaled_dot_product_attention, heads(2, H, G, T, S, torch.float32), **kw)
    got = run(attention.eager_attention, heads(2, H, G, T, S, torch.float32), **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (name, (a - b).abs().max().item())


@pytest.mark.parametrize("H,G,T,S,kind", CASES)
def test_eager_attention_in_bf16_is_as_close_to_fp64_as_sdpa_is(H, G, T, S, kind, query_block):
    """bf16 rounds the scores before the softmax (as HF's and nanoGPT's eager paths do): its
    error against a float64 reference stays within a few bf16 steps of SDPA's own."""
    kw = mask_kwargs(kind, T, S) | {"enable_gqa": G != H}
    exact = run(F.scaled_dot_product_attention, heads(2, H, G, T, S, torch.float64), **kw)
    sdpa = run(F.scaled_dot_product_attention, heads(2, H, G, T, S, torch.bfloat16), **kw)
    eager = run(attention.eager_attention, heads(2, H, G, T, S, torch.bfloat16), **kw)
    for name, e, s, x in zip(("out", "dq", "dk", "dv"), eager, sdpa, exact):
        scale = x.abs().max().item()
        err_eager, err_sdpa = (e - x).abs().max().item(), (s - x).abs().max().item()
        assert err_eager <= max(2 * err_sdpa, 4 * 2**-8 * scale), (name, err_eager, err_sdpa, scale)


def test_causal_eager_attention_skips_the_scores_right_of_each_query_block():
    """No query of a block sees a key past the block: its scores are never computed. At T a
    multiple of the block, that is (1 + QUERY_BLOCK / T) / 2 of the T x T scores (3/4 at 2
    blocks), in each of the forward's two matmuls."""
    from torch.utils.flop_counter import FlopCounterMode

    B, H, K, T = 1, 2, 16, 2 * attention.QUERY_BLOCK
    q, k, v = (torch.randn(B, H, T, K) for _ in range(3))
    with FlopCounterMode(display=False) as flops:
        attention.eager_attention(q, k, v, is_causal=True)
    scores = attention.eager_scores(T, T)
    assert scores == T * T * (1 + attention.QUERY_BLOCK / T) / 2
    assert flops.get_total_flops() == 2 * (2 * B * H * K * scores)
    assert attention.eager_scores(T, T, is_causal=False) == T * T


def test_the_key_gradient_comes_in_the_keys_own_layout():
    """Autograd's k gradient of q @ k.transpose(-1, -2) is (qᵀ @ dS)ᵀ, strided: compiled, RoPE's
    backward then loads it element by element. The eager kernel's is dSᵀ @ q."""
    q, k, v = heads(2, 4, 4, 32, 32, torch.float32)
    strides = []
    k.register_hook(lambda g: strides.append(g.stride()))
    run(attention.eager_attention, (q, k, v), is_causal=True)
    assert strides == [k.stride()]


def test_compiled_softmax_reads_the_causal_mask():
    """Traced, triu's mask became an int64 index compare per vector of scores inside the
    softmax's loop; the lmforge::causal_bias op is read instead."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    q, k, v = heads(2, 4, 4, 64, 64, torch.float32)
    attend = torch.compile(attention.eager_attention, dynamic=False)
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, code = run_and_get_code(lambda: attend(q, k, v, is_causal=True).sum().backward())
    code = "\n".join(code)
    assert "torch.ops.lmforge.causal_bias.default(" in code, code
    kernels = re.findall(r"async_compile\.cpp_pybinding\((.*?)^'''\)", code, re.M | re.S)
    softmax = [src for src in kernels if "exp(" in src]
    assert softmax and not any("arange(" in src for src in softmax), code


def loss_and_grads(attend):
    torch.manual_seed(0)
    model = GPT(CFG)
    x_BT, y_BT = torch.randint(0, 300, (2, 2, 48), generator=torch.Generator().manual_seed(0))
    loss = model(x_BT, y_BT, attend=attend)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_the_model_trains_the_same_with_either_kernel():
    ref_loss, ref = loss_and_grads(F.scaled_dot_product_attention)
    loss, got = loss_and_grads(attention.eager_attention)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for n in ref:
        assert torch.allclose(got[n], ref[n], rtol=1e-4, atol=1e-6), n


def test_explicit_choices_are_kept_and_auto_never_measures_off_cpu(monkeypatch):
    monkeypatch.setattr(attention, "measure", lambda *a: pytest.fail("measured"))
    for name in ("sdpa", "eager"):
        assert attention.resolve(name, CFG, 4, 64, torch.float32, CPU) == name
    cuda = DistInfo(0, 0, 1, torch.device("cuda", 0))
    assert attention.resolve("auto", CFG, 4, 64, torch.bfloat16, cuda) == "sdpa"
    assert attention.resolve("auto", CFG, 4, 64, torch.float32, CPU, started_with="eager") == "eager"


@pytest.mark.parametrize("sdpa_s,eager_s,expected", [
    (2.0, 1.0, "eager"),
    (1.0, 1.0, "sdpa"),
    (1.05, 1.0, "sdpa"),  # within EAGER_MARGIN: a tie, and eager holds more memory
    (1.0, 2.0, "sdpa"),
])
def test_auto_takes_eager_only_when_clearly_faster(monkeypatch, caplog, sdpa_s, eager_s, expected):
    monkeypatch.setattr(attention, "measure", lambda *a: {"sdpa": sdpa_s, "eager": eager_s})
    with caplog.at_level(logging.INFO, logger=attention.log.name):
        assert attention.resolve("auto", CFG, 4, 64, torch.float32, CPU) == expected
    line = [r.getMessage() for r in caplog.records if "train.attention" in r.getMessage()]
    assert len(line) == 1 and f"-> {expected}:" in line[0]
    assert f"sdpa {1e3 * sdpa_s:.1f} ms, eager {1e3 * eager_s:.1f} ms" in line[0]


def test_auto_keeps_sdpa_where_eager_scores_would_dwarf_the_activations(monkeypatch):
    monkeypatch.setattr(attention, "measure", lambda *a: {"sdpa": 9.0, "eager": 1.0})
    long = ModelConfig(vocab_size=300, n_layer=2, n_head=16, d_model=256, max_seq_len=8192)
    assert attention.eager_fits(long, 1, 256, torch.bfloat16)
    assert not attention.eager_fits(long, 1, 8192, torch.bfloat16)
    assert attention.resolve("auto", long, 1, 8192, torch.bfloat16, CPU) == "sdpa"


def test_auto_measures_both_kernels_on_this_cpu():
    seconds = attention.measure(CFG, 2, 64, torch.float32, CPU.device)
    assert set(seconds) == {"sdpa", "eager"} and all(0 < s < 5 for s in seconds.values())


def test_compiled_runs_measure_compiled_kernels(monkeypatch):
    compiled = []

    def compile_(fn, **kw):
        compiled.append(fn)
        return fn

    monkeypatch.setattr(torch, "compile", compile_)
    attention.measure(CFG, 2, 64, torch.float32, CPU.device, compiled=True)
    assert compiled == list(attention.KERNELS.values())
    compiled.clear()
    attention.measure(CFG, 2, 64, torch.float32, CPU.device)
    assert compiled == []


@pytest.mark.parametrize("compile_flag,decided,measured", [
    ("off", None, [False]),
    ("on", None, [True]),
    ("auto", False, [False]),
    ("auto", True, [False, True]),  # eager for compile's decision, then as the run computes
])
def test_auto_measures_the_attention_as_the_run_computes_it(
        tiny_data, tmp_path, monkeypatch, compile_flag, decided, measured):
    from pipeline import compile_policy

    seen = []
    monkeypatch.setattr(attention, "measure",
                        lambda *a: seen.append(a[-1]) or {"sdpa": 2.0, "eager": 1.0})
    if decided is not None:
        monkeypatch.setattr(compile_policy, "decide", lambda *a, **kw: decided)
    flags = ("--train.attention", "auto", "--train.compile", compile_flag)
    trainer = Trainer(cfg_for(tiny_data, tmp_path / "run", *flags), CPU)
    assert seen == measured
    assert trainer.cfg.train.compile == ("on" if measured[-1] else "off")
    assert trainer.cfg.train.attention == "eager"


def test_a_run_records_its_choice_and_keeps_it_on_resume(tiny_data, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    timings = {"sdpa": 2.0, "eager": 1.0}
    monkeypatch.setattr(attention, "measure", lambda *a: dict(timings))
    auto = ("--train.attention", "auto", "--checkpoint.every", "3", "--train.max_steps", "6")
    Trainer(cfg_for(tiny_data, run_dir, *auto), CPU).fit()
    assert load_config(str(run_dir / "config.toml"), []).train.attention == "eager"
    timings.update(sdpa=1.0, eager=2.0)  # the machine now measures the other way
    step_3 = run_dir / "checkpoints" / "step_00000003"
    trainer = Trainer(cfg_for(tiny_data, run_dir, *auto, "--checkpoint.resume", str(step_3)), CPU)
    assert trainer.step == 3 and trainer.cfg.train.attention == "eager"
    assert trainer.parallel.attend is attention.eager_attention
    trainer.fit()
    assert load_config(str(run_dir / "config.toml"), []).train.attention == "eager"
