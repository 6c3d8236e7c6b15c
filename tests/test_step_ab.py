"""bench/step_ab.py compares like with like: each predecessor it times computes what the shipped
function computes, the bench puts the shipped one back when done, and its CLI runs."""

from __future__ import annotations

import sys

import pytest
import torch

from bench import step_ab
from bench.runs import run
from model import ModelConfig
from model.model import apply_rope, rope_tables
from pipeline import attention
from pipeline import loss as loss_module
from pipeline import parallelize as par
from pipeline.loss import _eager_body, _eager_buffers, _eager_from_logits, _fused_body


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_by_roll_is_the_shipped_rotation(dtype):
    cfg = ModelConfig(vocab_size=64, n_layer=1, n_head=4, n_kv_head=2, d_model=64, max_seq_len=16)
    cos, sin = rope_tables(cfg)
    x_BTNK = torch.randn(2, 16, 6, cfg.head_dim).to(dtype)
    torch.testing.assert_close(step_ab.rope_by_roll(x_BTNK, cos[:, None], sin[:, None]),
                               apply_rope(x_BTNK, cos[:, None], sin[:, None]), rtol=0, atol=0)


@pytest.mark.parametrize("vocab_size", [1000, 1024])  # with padded columns and without
@pytest.mark.parametrize("want_grad", [True, False])
@pytest.mark.parametrize("before", [step_ab.fused_body_computed_columns,
                                    step_ab.fused_body_int32_columns])
def test_earlier_column_bodies_are_the_shipped_loss_body(vocab_size, want_grad, before):
    torch.manual_seed(0)
    h_CD, w_VD = torch.randn(24, 16), torch.randn(1024, 16)
    safe_C = torch.randint(0, vocab_size, (24,))
    ref = before(h_CD, w_VD, safe_C, vocab_size, None, want_grad)
    got = _fused_body(h_CD, w_VD, safe_C, vocab_size, None, want_grad)
    for a, b in zip(got[0], ref[0]):  # columns read or computed, fp32 or int32: the same numbers
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if want_grad:
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    assert (got[1] is None) == (not want_grad)


@pytest.mark.parametrize("vocab_size", [1000, 1024])
def test_kept_exps_grad_is_the_shipped_fp32_grad(vocab_size, monkeypatch):
    torch.manual_seed(0)
    h_CD, w_VD = torch.randn(24, 16), torch.randn(1024, 16)
    safe_C = torch.randint(0, vocab_size, (24,))
    assert loss_module._grad_over_logits(torch.float32)  # (the swap differs from what ships)
    got = _fused_body(h_CD, w_VD, safe_C, vocab_size, None, True)
    monkeypatch.setattr(loss_module, "_grad_over_logits", step_ab.grad_from_kept_exps)
    ref = _fused_body(h_CD, w_VD, safe_C, vocab_size, None, True)
    for a, b in zip(got[0], ref[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-7)  # exps taken twice


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("want_grad", [True, False])
def test_onednn_body_is_the_shipped_eager_body(want_grad):
    torch.manual_seed(0)
    h_CD, w_VD = torch.randn(24, 16), torch.randn(1024, 16)
    safe_C = torch.randint(0, 1000, (24,))
    ref = step_ab.eager_body_onednn(h_CD, w_VD, safe_C, 1000, _eager_buffers(h_CD, w_VD, 24), want_grad)
    got = _eager_body(h_CD, w_VD, safe_C, 1000, _eager_buffers(h_CD, w_VD, 24), want_grad)
    for a, b in zip(got, ref):  # two GEMM kernels: equal to fp32 rounding, not bit for bit
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (got[1] is None) == (not want_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the gradient's dtype
@pytest.mark.parametrize("want_grad", [True, False])
def test_log_softmax_body_is_the_shipped_softmax_body(dtype, want_grad):
    torch.manual_seed(0)
    logits_CV, safe_C = torch.randn(24, 1024) * 4, torch.randint(0, 1000, (24,))
    w_VD = torch.empty(1024, 16)
    ref, got = (body(logits_CV.clone(), safe_C, 1000, _eager_buffers(logits_CV, w_VD, 24),
                     want_grad, dtype)
                for body in (step_ab.eager_from_logits_log_softmax, _eager_from_logits))
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)  # -log p vs log_softmax
    if want_grad:
        assert got[1].dtype == ref[1].dtype == dtype
        # Two fp32 gradients a rounding apart can round to neighbouring bf16 values (seen with
        # ATen's AVX2 exp): one bf16 ulp is 2**-7 of the value.
        rtol = 1e-6 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(got[1], ref[1], rtol=rtol, atol=1e-7)
    assert (got[1] is None) == (not want_grad)


def test_one_query_block_is_the_shipped_causal_attention(monkeypatch):
    g = torch.Generator().manual_seed(0)
    T = 2 * attention.QUERY_BLOCK + 3  # three blocks, the last one short
    q, k, v = (torch.randn(1, 2, T, 8, generator=g) for _ in range(3))
    dy = torch.randn(1, 2, T, 8, generator=g)
    out = []
    for blocks in (step_ab.one_query_block, attention.causal_blocks):
        monkeypatch.setattr(attention, "causal_blocks", blocks)
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        y = attention.eager_attention(*qkv, is_causal=True)
        y.backward(dy)
        out.append([y.detach()] + [t.grad for t in qkv])
    for a, b in zip(*out):  # the same sums, the masked keys' zeros left out
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_whole_add_is_the_shipped_blocked_add(monkeypatch):
    monkeypatch.setattr(loss_module, "ADD_BLOCK_ELEMS", 7 * 16)  # 7 rows: a short last block
    sum_VD, part_VD = torch.randn(100, 16), torch.randn(100, 16).bfloat16()
    ref, got = sum_VD.clone(), sum_VD.clone()
    step_ab.add_whole(ref, part_VD)
    loss_module._add_by_blocks(got, part_VD)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_logits_swap_refuses_what_it_cannot_compare():
    res = run([sys.executable, "-m", "bench.step_ab", "logits", "--smoke", "--dtype", "bf16"],
              timeout=120, retries=0)
    assert res.returncode == 2 and "error: logits swaps the eager fp32 loss's kernel" in res.stdout


def test_paired_alternates_and_puts_the_shipped_function_back():
    class Module:
        fn = staticmethod(lambda: "shipped")

    calls = []
    fns = {"shipped": Module.fn, "before": lambda: "before"}
    seconds = step_ab.paired(lambda: calls.append(Module.fn()), Module, "fn", fns, pairs=3)
    assert [len(s) for s in seconds.values()] == [3, 3]
    # every round runs both, the order alternating: no function always runs first
    assert calls == ["shipped", "before", "before", "shipped"] * 2 + ["shipped", "before"] * 1
    assert Module.fn() == "shipped"


def test_built_apart_builds_each_step_under_its_function_and_puts_the_shipped_back(monkeypatch):
    class Module:
        fn = staticmethod(lambda: "shipped")

    calls = []

    def training_step(r):
        built_with = Module.fn()  # what the step captured when it was built
        return lambda: calls.append(built_with)

    monkeypatch.setattr(step_ab.tb, "training_step", training_step)
    fns = {"shipped": Module.fn, "before": lambda: "before"}
    seconds = step_ab.built_apart(None, Module, "fn", fns, pairs=2)
    assert [len(s) for s in seconds.values()] == [2, 2]
    assert calls == ["shipped", "before", "before", "shipped"] * 2
    assert Module.fn() == "shipped"


def test_no_graph_passes_is_the_shipped_options_less_ours():
    assert step_ab.no_graph_passes() == {}
    assert set(par.compile_options()) == {"post_grad_custom_pre_pass"}


def test_a_build_swap_refuses_an_eager_run():
    res = run([sys.executable, "-m", "bench.step_ab", "tiedgrad", "--smoke"], timeout=120, retries=0)
    assert res.returncode == 2 and "error: tiedgrad swaps what torch.compile runs" in res.stdout


def test_cli_smoke_prints_the_paired_ratio():
    out = run([sys.executable, "-m", "bench.step_ab", "rope", "--smoke", "--pairs", "2",
               "--dtype", "fp32"], timeout=300)
    assert out.returncode == 0, out.stderr
    assert "before / shipped, paired:" in out.stdout


def test_report_ratio_is_each_time_over_the_reference():
    lines = step_ab.report({"shipped": [1.0, 1.0, 1.0], "before": [1.2, 1.1, 1.3]}, "shipped")
    assert "before / shipped, paired: 1.200x" in lines[1] and "paired" not in lines[0]
