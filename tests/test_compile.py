"""torch.compile of the forward with its loss in the graph (pipeline.parallelize, pipeline.loss's
FusedLoss): same numbers as eager, same parameter names, no recompile across train -> eval ->
train, and the train.compile=auto rule (pipeline.compile_policy).

A cold compile costs 25-35 s on a 2-core CPU, so the whole-model case is one compact test."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace

import pytest
import torch

from model import GPT, ModelConfig
from pipeline import attention
from pipeline import compile_policy as policy
from pipeline import loss as loss_module
from pipeline import parallelize as par
from pipeline.distributed import DistInfo
from pipeline.loss import FusedLoss, select_loss

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
    est = policy.estimate(model, long_run, 256, torch.float32, info)
    assert est.eager_run_s == pytest.approx(8192 * 100_000 * est.steps.eager_s)
    assert est.eager_run_s > 3600
    budgeted = TrainConfig(global_batch_tokens=8192, micro_batch_size=8, max_steps=100_000,
                           time_budget_s=300)
    assert policy.estimate(model, budgeted, 256, torch.float32, info).eager_run_s == 300
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
    assert "(a roofline estimate)" in lines[0] and "(estimated: matmuls" in lines[0]
    assert "(the design's allowance)" in lines[0] and lines[1].startswith("train.compile = auto -> on")


# The ledger (pipeline.compile_policy): what runs measured on this machine, by run key.
TINY = ModelConfig(vocab_size=4096, n_layer=2, n_head=4, d_model=64, max_seq_len=64)


def tiny_key(**train):
    from pipeline.config import TrainConfig

    return policy.run_key(TINY, TrainConfig(**train), 64, torch.float32, DistInfo(0, 0, 1, CPU))


def test_the_ledger_keeps_each_key_apart_and_merges_a_keys_figures(tmp_path, monkeypatch):
    monkeypatch.setenv(policy.LEDGER_ENV, str(tmp_path / "cache"))
    a, b = tiny_key(), tiny_key(micro_batch_size=4)
    assert policy.measured(a) == policy.Measured()  # no ledger yet
    policy.record(a, eager_s=2e-4)
    policy.record(a, compiled_s=1e-4, cold_compile_s=12.5)
    policy.record(b, eager_s=9e-4)
    assert policy.measured(a) == policy.Measured(2e-4, 1e-4, 12.5)
    assert policy.measured(b) == policy.Measured(eager_s=9e-4)
    assert policy.measured(tiny_key(attention="eager")) == policy.Measured()
    entry = next(e for e in json.loads(policy.ledger_path().read_text())["runs"].values()
                 if e["key"] == a)
    assert entry["key"]["micro_batch"] == 8 and entry["key"]["model"]["d_model"] == 64
    assert entry["key"]["isa"] and entry["key"]["cpu"]  # kinds that share a model name differ


@pytest.mark.parametrize("content", ["{not json", '{"version": 99, "runs": {}}', "[1, 2]"])
def test_an_unreadable_ledger_is_ignored_with_a_warning_and_then_replaced(
        tmp_path, monkeypatch, caplog, content):
    monkeypatch.setenv(policy.LEDGER_ENV, str(tmp_path))
    policy.ledger_path().write_text(content)
    with caplog.at_level(logging.WARNING, logger=policy.log.name):
        assert policy.measured(tiny_key()) == policy.Measured()
    assert "compile ledger" in caplog.text and "ignored" in caplog.text
    policy.record(tiny_key(), eager_s=3e-4)
    assert policy.measured(tiny_key()).eager_s == 3e-4


def test_a_ledger_that_cannot_be_written_is_only_a_warning(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(policy.LEDGER_ENV, str(blocker / "sub"))  # a directory under a file
    with caplog.at_level(logging.WARNING, logger=policy.log.name):
        policy.record(tiny_key(), eager_s=3e-4)
    assert "not written" in caplog.text and policy.LEDGER_ENV in caplog.text


def test_a_hand_edited_entry_with_bad_figures_is_not_taken(tmp_path, monkeypatch):
    monkeypatch.setenv(policy.LEDGER_ENV, str(tmp_path))
    policy.record(tiny_key(), eager_s=0.0, compiled_s=-1.0, cold_compile_s="fast")
    assert policy.measured(tiny_key()) == policy.Measured()


def test_the_step_meter_files_the_steady_step_and_the_first_steps_excess(tmp_path, monkeypatch):
    monkeypatch.setenv(policy.LEDGER_ENV, str(tmp_path))
    steady = [0.2, 0.3, 0.25, 0.25, 0.4, 0.2, 0.25][: policy.MEASURED_STEPS - 1]
    compiled = policy.StepMeter(tiny_key(), compiled=True, tokens_per_step=1000)
    for s in [31.0, *steady[:-1]]:
        compiled.step_done(s)
    assert policy.measured(tiny_key()) == policy.Measured()  # filed once every step is timed
    compiled.step_done(steady[-1])
    seen = policy.measured(tiny_key())
    assert seen.compiled_s == pytest.approx(0.25 / 1000) and seen.cold_compile_s == pytest.approx(30.75)
    assert seen.eager_s is None
    for s in (0.3, 0.3, 0.3, 0.3):  # later steps count at the run's end
        compiled.step_done(s)
    assert policy.measured(tiny_key()) == seen
    compiled.finish()
    later = policy.measured(tiny_key())
    assert later.compiled_s == pytest.approx(0.3 / 1000)  # the median of all steps but the first
    assert later.cold_compile_s == pytest.approx(30.7)
    eager = policy.StepMeter(tiny_key(), compiled=False, tokens_per_step=1000)
    for s in [0.9, *(2 * x for x in steady)]:
        eager.step_done(s)
    eager.finish()  # no step past MEASURED_STEPS: nothing new to file
    assert policy.measured(tiny_key()) == policy.Measured(0.5 / 1000, later.compiled_s,
                                                          later.cold_compile_s)


def test_auto_takes_what_the_ledger_measured_and_says_so(fixed_machine, tmp_path, monkeypatch,
                                                         caplog):
    """A run whose roofline says off compiles once this machine measured a large gain and a
    short cold compile at its key (and the margin drops to 1: nothing is estimated), and the
    reverse: a measured loss keeps a long run eager."""
    from pipeline.config import TrainConfig

    monkeypatch.setenv(policy.LEDGER_ENV, str(tmp_path))
    model = GPT(TINY)
    info = DistInfo(0, 0, 1, CPU)
    run = TrainConfig(global_batch_tokens=8192, max_steps=200)
    key = policy.run_key(TINY, run, 64, torch.float32, info)
    assert not policy.decide(model, run, 64, torch.float32, info)  # estimated: too short
    policy.record(key, eager_s=1e-4, compiled_s=5e-5, cold_compile_s=30.0)
    est = policy.estimate(model, run, 64, torch.float32, info, policy.measured(key))
    assert est.eager_run_s == pytest.approx(8192 * 200 * 1e-4) and est.gain == pytest.approx(2.0)
    assert est.margin == 1.0 and est.threshold_s == pytest.approx(policy.GRAPHS * 30.0 / 0.5)
    with caplog.at_level(logging.INFO, logger=policy.log.name):
        assert policy.decide(model, run, 64, torch.float32, info)  # 164 s >= 80 s
    assert caplog.records[-1].getMessage() == (
        "train.compile = auto -> on on CPU: eager run 164 s (its step measured here), compiled "
        "2.00x faster (measured here), cold compile 30 s for training's graph (measured here) "
        "and a third of it for eval's: compile pays from 80 s")
    policy.record(key, compiled_s=1.1e-4)  # compiled measured slower than eager
    assert not policy.decide(model, replace(run, max_steps=10**7), 64, torch.float32, info)


def test_auto_keeps_the_choice_a_resumed_run_started_with(fixed_machine, caplog):
    from pipeline.config import TrainConfig

    model, info = GPT(TINY), DistInfo(0, 0, 1, CPU)
    with caplog.at_level(logging.INFO, logger=policy.log.name):
        assert policy.decide(model, TrainConfig(max_steps=5), 64, torch.float32, info, "on")
        assert not policy.decide(model, TrainConfig(max_steps=10**7), 64, torch.float32, info, "off")
    assert caplog.records[-1].getMessage() == "train.compile = auto -> off: the choice this run started with"
    assert policy.decide(model, TrainConfig(max_steps=5, compile="on"), 64, torch.float32, info, "off")


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


def _compiled_loss_code(vocab_size: int, dtype: torch.dtype = torch.float32) -> str:
    """Inductor's code for FusedLoss's forward and backward, 4 chunks."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    h_BTD = torch.randn(2, 32, 32, generator=g).to(dtype).requires_grad_()
    w_VD = torch.randn(1024, 32, generator=g).to(dtype).requires_grad_()
    y_BT = torch.randint(0, vocab_size, (2, 32), generator=g)
    loss_fn = torch.compile(FusedLoss(16), dynamic=False)
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, code = run_and_get_code(lambda: loss_fn(h_BTD, w_VD, y_BT, vocab_size).backward())
    return "\n".join(code)


def _chunk_kernels(code: str) -> tuple[dict[str, str], int]:
    """The chunks' kernels (those with an exp), by name, and how many times they are called."""
    kernels = {name: src for name, src in
               re.findall(r"^(\w+) = async_compile\.cpp_pybinding\((.*?)^'''\)", code, re.M | re.S)
               if "exp(" in src}
    calls = sum(len(re.findall(rf"^\s+{name}\(", code, re.M)) for name in kernels)
    return kernels, calls


@pytest.mark.parametrize("vocab_size", [1000, 1024])  # with padded columns and without
def test_the_fused_loss_with_kept_exps_is_one_loop_over_each_chunks_rows(vocab_size,
                                                                         monkeypatch):
    """FusedLoss's reason to be, on CPU: inductor makes each chunk one loop over its rows (the
    row's max, its exps kept in a row buffer, their sum, the gradient: one exp per element,
    one read of the logits). A per-row op joined to the chunk (the loss, a gather, a cat's
    copy) splits that loop into three passes over the whole chunk. The column indices and the
    padding mask are read, not built per vector of logits (arange). The bf16 rule, compiled in
    fp32 (bf16 at these tiny shapes fuses the chunks into one kernel)."""
    monkeypatch.setattr(loss_module, "_grad_over_logits", lambda dtype: False)
    assert loss_module._grad_over_logits(torch.float32) is False
    kernels, calls = _chunk_kernels(code := _compiled_loss_code(vocab_size))
    assert calls == 4, code  # one per chunk: no two chunks fused into one kernel
    assert all(k.count("for(int64_t x0=") == 1 for k in kernels.values()), code
    assert not any("arange(" in k for k in kernels.values()), code


@pytest.mark.parametrize("vocab_size", [1000, 1024])
def test_the_fused_fp32_loss_writes_each_chunks_gradient_over_its_logits(vocab_size):
    """In fp32 the gradient is exp(logits - log-sum-exp), so inductor writes it into the
    logits' own buffer (in_out_ptr): no second C x V buffer per chunk. bf16 keeps the exps."""
    assert not loss_module._grad_over_logits(torch.bfloat16)
    kernels, calls = _chunk_kernels(code := _compiled_loss_code(vocab_size))
    assert calls == 4, code
    assert all("float* in_out_ptr0" in k for k in kernels.values()), code
    assert not any("arange(" in k for k in kernels.values()), code


def test_the_fp32_head_gradient_is_summed_in_place():
    """Each chunk's fp32 head gradient is added into the V x D sum in place: no out-of-place
    addmm (a copy of the sum per chunk), and no V x D zeros before the first chunk."""
    code = _compiled_loss_code(1000)
    assert "extern_kernels.addmm(" not in code, code
    assert code.count("torch.ops.lmforge.addmm_.default(") == 3, code  # chunks 2-4
    assert "(1024, 32), (32, 1), torch.float32)" in code  # the sum: the first chunk's product
    assert not re.search(r"cpp_fused_[a-z_]*zeros", code), code
