"""torch.compile of the forward with its loss in the graph (pipeline.parallelize, pipeline.loss's
FusedLoss): same numbers as eager, same parameter names, no recompile across train -> eval ->
train, and the train.compile=auto rule (pipeline.compile_policy).

A cold compile costs 25-35 s on a 2-core CPU, so the whole-model case is one compact test."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from model import GPT, ModelConfig
from pipeline import attention
from pipeline import compile_policy as policy
from pipeline import parallelize as par
from pipeline.distributed import DistInfo
from pipeline.loss import select_loss

CPU = torch.device("cpu")


GAIN = 1.3
AT = policy.threshold_s(GAIN)


@pytest.mark.parametrize(
    "requested, device, est_s, gain, expected",
    [
        ("on", "cpu", None, None, True),
        ("off", "cuda", 1e9, 2.0, False),
        ("auto", "cuda", None, None, True),
        ("auto", "cpu", None, GAIN, False),  # run length unknown: no compile on CPU
        ("auto", "cpu", 0.9 * AT, GAIN, False),
        ("auto", "cpu", 1.1 * AT, GAIN, True),
        ("auto", "cpu", 1.1 * AT, 1.1, False),  # a smaller gain needs a longer run
        ("auto", "cpu", 1e12, 1.0, False),  # nothing gained: never
    ],
)
def test_resolve_compile_rule(requested, device, est_s, gain, expected):
    assert policy.resolve_compile(requested, torch.device(device), est_s, gain) is expected


def test_threshold_is_the_margin_times_the_break_even_of_the_allowed_cold_compiles():
    cold = policy.GRAPHS * policy.COLD_COMPILE_ALLOWANCE_S
    assert AT == pytest.approx(policy.MARGIN * cold / (1 - 1 / GAIN))


SHAPE_A = ModelConfig(vocab_size=50257, n_layer=4, n_head=4, n_kv_head=4, d_model=256,
                      d_mlp=688, max_seq_len=256)


def test_compile_gains_more_where_matmuls_are_cheap_against_memory():
    """The roofline: the same model on the same memory gains more from compile where the peak
    is higher (native bf16) than where matmuls dominate (fp32 on AVX2), always > 1."""
    with torch.device("meta"):
        model = GPT(SHAPE_A)
    fast, slow = (policy.step_model(model, 256, peak, bandwidth=20e9) for peak in (400e9, 150e9))
    assert fast.gain > slow.gain > 1
    assert fast.eager_s < slow.eager_s
    assert policy.threshold_s(fast.gain) < policy.threshold_s(slow.gain)


def test_eager_attention_adds_its_score_passes_to_the_step():
    """train.attention = eager passes over T x S scores per layer, which compile fuses; SDPA's
    kernels are the same either way."""
    with torch.device("meta"):
        model = GPT(SHAPE_A)
    sdpa, eager = (policy.step_model(model, 256, 400e9, 20e9, a) for a in ("sdpa", "eager"))
    assert eager.matmul_s == sdpa.matmul_s
    assert eager.eager_elementwise_s > sdpa.eager_elementwise_s
    assert eager.gain > sdpa.gain


@pytest.fixture
def fixed_machine(monkeypatch):
    monkeypatch.setattr(policy, "matmul_peak", lambda device, dtype: 400e9)
    monkeypatch.setattr(policy, "memory_bandwidth", lambda device: 20e9)


def test_auto_compile_estimate_is_capped_by_the_time_budget(fixed_machine):
    from pipeline.config import TrainConfig

    model = GPT(ModelConfig(vocab_size=4096, n_layer=4, n_head=4, n_kv_head=2, d_model=256,
                            max_seq_len=256))
    info = DistInfo(0, 0, 1, CPU)
    long_run = TrainConfig(global_batch_tokens=8192, micro_batch_size=8, max_steps=100_000)
    est, steps = policy.estimate(model, long_run, 256, torch.float32, info)
    assert est == pytest.approx(8192 * 100_000 * steps.eager_s) and est > 3600
    budgeted = TrainConfig(global_batch_tokens=8192, micro_batch_size=8, max_steps=100_000,
                           time_budget_s=300)
    assert policy.estimate(model, budgeted, 256, torch.float32, info)[0] == 300
    assert policy.estimate(model, long_run, 256, torch.float32, DistInfo(0, 0, 1, torch.device("cuda"))) is None


def test_auto_decision_says_why_in_one_line(fixed_machine, caplog):
    from pipeline.config import TrainConfig

    model = GPT(ModelConfig(vocab_size=4096, n_layer=2, n_head=4, d_model=64, max_seq_len=64))
    info = DistInfo(0, 0, 1, CPU)
    with caplog.at_level(logging.INFO, logger=policy.log.name):
        short = policy.decide(model, TrainConfig(max_steps=5), 64, torch.float32, info)
        long = policy.decide(model, TrainConfig(max_steps=10**7), 64, torch.float32, info)
        forced = policy.decide(model, TrainConfig(max_steps=5, compile="on"), 64, torch.float32, info)
    assert (short, long, forced) == (False, True, True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("train.compile = auto -> off on CPU: ")
    assert "faster (matmuls" in lines[0] and lines[1].startswith("train.compile = auto -> on")


def test_recompile_watch_warns_only_after_each_phase_warmed_up(monkeypatch, caplog):
    graphs = iter([0, 1, 2, 2, 2, 3])  # built: train 1st, eval 1st, -, -, train again
    monkeypatch.setattr(par, "compiled_graphs", lambda: next(graphs))
    watch = par.RecompileWatch()
    with caplog.at_level(logging.WARNING, logger=par.log.name):
        assert [watch.check(p, s) for p, s in
                [("train", 1), ("eval", 1), ("train", 2), ("eval", 2), ("train", 3)]] == [1, 1, 0, 0, 1]
    assert len(caplog.records) == 1 and "step 3" in caplog.text and "recompiled 1" in caplog.text


def loss_and_grads(model, pm, x_BT, y_BT):
    model.zero_grad(set_to_none=True)
    loss = pm.loss(x_BT, y_BT)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow  # two cold compiles (train, eval): ~60 s on 2 idle cores, 360 s loaded
@pytest.mark.parametrize("chunk,attend", [
    (24, "eager"),  # several chunks, the last one short; the eager attention traced in the graph
    (None, "sdpa"),  # logits of one chunk
])
def test_compiled_forward_and_loss_equal_eager_without_recompiles(chunk, attend):
    """The loss is in the model's graph: one graph for training's step, one for eval's."""
    cfg = ModelConfig(vocab_size=1000, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64)
    info = DistInfo(0, 0, 1, CPU)
    models = []
    for compile_model in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        pm = par.parallelize(model, info, parallel="none", precision=par.Precision(torch.float32, CPU),
                             compile_model=compile_model, activation_checkpointing=False,
                             attend=attention.kernel(attend))
        assert type(pm.head_loss) is type(select_loss(compile_model, True))
        models.append((model, replace(pm, head_loss=select_loss(compile_model, True, chunk))))
    (eager, eager_pm), (model, compiled) = models
    assert list(model.state_dict()) == list(eager.state_dict())  # no `_orig_mod.` prefix
    g = torch.Generator().manual_seed(0)
    x_BT, y_BT = torch.randint(0, 1000, (2, 2, 48), generator=g)
    y_BT[0, :7] = -100
    eval_x_BT, eval_y_BT = torch.randint(0, 1000, (2, 3, 64), generator=g)  # eval's own shape

    watch = par.RecompileWatch()
    ref_loss, ref_grads = loss_and_grads(eager, eager_pm, x_BT, y_BT)
    built = []
    for step in (1, 2, 3):
        loss, grads = loss_and_grads(model, compiled, x_BT, y_BT)
        built.append(watch.check("train", step))
        model.eval()
        with torch.no_grad():
            eval_loss = compiled.loss(eval_x_BT, eval_y_BT, reduction="sum")
        model.train()
        built.append(watch.check("eval", step))
    assert built == [1, 1, 0, 0, 0, 0], built  # train's and eval's, then none
    assert not torch._dynamo.utils.counters["graph_break"], torch._dynamo.utils.counters["graph_break"]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for got, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(eval_loss, eager_pm.loss(eval_x_BT, eval_y_BT, reduction="sum"),
                                   rtol=1e-5, atol=1e-4)
