"""torch.compile of the forward with its loss in the graph (pipeline.parallel.parallelize): same numbers as
eager with either loss (full, chunked), same parameter names, no recompile across train -> eval
-> train; and the static rules of train.compile, .attention and .loss = auto as a run resolves
them (pipeline.parallel.parallelize.resolve_choices), a resumed run keeping the choices it started with.

A cold compile costs 25-35 s on a 2-core CPU, so the whole-model case is one compact test."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from lmforge.model import GPT, ModelConfig
from lmforge.model.model import cross_entropy
from lmforge.pipeline import attention
from lmforge.pipeline.config import TrainConfig
from lmforge.pipeline.loss import FULL_LOGITS_MAX_ELEMS, ChunkedLoss
from lmforge.pipeline.parallel import parallelize as par
from lmforge.pipeline.parallel.distributed import DistInfo

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("requested, device, expected", [
    ("auto", CUDA, "on"),
    ("auto", CPU, "off"),
    ("on", CPU, "on"),  # explicit choices are kept
    ("off", CUDA, "off"),
])
def test_auto_compiles_on_cuda_only(requested, device, expected):
    assert par.resolve_compile(requested, device) == expected


AUTO = TrainConfig(micro_batch_size=8)  # compile, attention and loss: auto


def choices(t: TrainConfig) -> tuple[str, str, str]:
    return t.compile, t.attention, t.loss


@pytest.mark.parametrize("device, dtype, seq_len, vocab, expected", [
    (CPU, torch.float32, 256, 4096, ("off", "sdpa", "chunked")),  # the demo on the AVX2 kind
    (CPU, torch.bfloat16, 256, 4096, ("off", "eager", "chunked")),  # ... where bf16 is native
    (CPU, torch.bfloat16, 1024, 4096, ("off", "sdpa", "chunked")),
    (CUDA, torch.bfloat16, 1024, 50304, ("on", "sdpa", "full")),
    # One micro-batch's logits past the limit: chunked on CUDA too (8 x 4096 x 50,304 > 2^30).
    (CUDA, torch.bfloat16, 4096, 50304, ("on", "sdpa", "chunked")),
])
def test_each_auto_choice_follows_its_rule(device, dtype, seq_len, vocab, expected):
    assert (8 * 4096 * 50304 > FULL_LOGITS_MAX_ELEMS) and (8 * 1024 * 50304 <= FULL_LOGITS_MAX_ELEMS)
    t = par.resolve_choices(AUTO, device, dtype, seq_len, vocab)
    assert choices(t) == expected
    assert t.dtype == {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]  # saved resolved
    assert replace(t, compile="auto", attention="auto", loss="auto", dtype="auto") == AUTO


def test_explicit_choices_are_kept_whatever_the_rule_says():
    explicit = replace(AUTO, compile="on", attention="eager", loss="full")
    assert choices(par.resolve_choices(explicit, CPU, torch.float32, 256, 4096)) == ("on", "eager", "full")


def test_a_resumed_run_keeps_the_choices_it_started_with():
    """Started on another machine (a bf16 CPU, or a GPU), resumed here: auto keeps the started
    run's choices; an explicit flag on the resumed run still wins."""
    started = replace(AUTO, compile="on", attention="eager", loss="full")
    t = par.resolve_choices(AUTO, CPU, torch.float32, 256, 4096, started)
    assert choices(t) == ("on", "eager", "full")
    t = par.resolve_choices(replace(AUTO, loss="chunked"), CPU, torch.float32, 256, 4096, started)
    assert choices(t) == ("on", "eager", "chunked")
    # A checkpoint from before a key existed holds auto for it: the rule decides.
    old = replace(AUTO, compile="on")
    assert choices(par.resolve_choices(AUTO, CPU, torch.float32, 256, 4096, old)) == (
        "on", "sdpa", "chunked")


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
# Several chunks, the last one short, and the eager attention traced; the whole-logits loss
# compiled with sdpa is tests/test_compiled_ddp.py's (under DDP, against eager).
@pytest.mark.parametrize("loss,attend", [("chunked", "eager")])
def test_compiled_forward_and_loss_equal_eager_without_recompiles(loss, attend):
    """The loss is in the model's graph: one graph for training's step, one for eval's."""
    cfg = ModelConfig(vocab_size=1000, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64)
    info = DistInfo(0, 0, 1, CPU)
    models = []
    for compile_model in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        pm = par.parallelize(model, info, parallel="none", precision=par.Precision(torch.float32, CPU),
                             compile_model=compile_model, activation_checkpointing=False,
                             loss=loss, attend=attention.kernel(attend))
        if loss == "full":
            assert pm.head_loss is cross_entropy
        else:  # by chunks of 40 tokens: 3 of training's 96 and 5 of eval's 192, the last short
            assert isinstance(pm.head_loss, ChunkedLoss)
            pm = replace(pm, head_loss=ChunkedLoss(40))
        models.append((model, pm))
    (eager, eager_pm), (model, compiled) = models
    assert list(model.state_dict()) == list(eager.state_dict())  # no `_orig_mod.` prefix
    g = torch.Generator().manual_seed(0)
    x_BT, y_BT = torch.randint(0, 1000, (2, 2, 48), generator=g)
    y_BT[0, :7] = -100
    eval_x_BT, eval_y_BT = torch.randint(0, 1000, (2, 3, 64), generator=g)  # eval's own shape

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    watch = par.RecompileWatch()
    ref_loss, ref_grads = loss_and_grads(eager, eager_pm, x_BT, y_BT)
    built = []
    for step in (1, 2, 3):
        loss_, grads = loss_and_grads(model, compiled, x_BT, y_BT)
        built.append(watch.check("train", step))
        model.eval()
        with torch.no_grad():
            eval_loss = compiled.loss(eval_x_BT, eval_y_BT, reduction="sum")
        model.train()
        built.append(watch.check("eval", step))
    assert built == [1, 1, 0, 0, 0, 0], built  # train's and eval's, then none
    assert not torch._dynamo.utils.counters["graph_break"], torch._dynamo.utils.counters["graph_break"]
    torch.testing.assert_close(loss_, ref_loss, rtol=1e-5, atol=1e-6)
    for got, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(eval_loss, eager_pm.loss(eval_x_BT, eval_y_BT, reduction="sum"),
                                   rtol=1e-5, atol=1e-4)
