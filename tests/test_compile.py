"""torch.compile of the forward + loss, whole or chunked (pipeline.parallelize): same numbers as eager,
same parameter names, no recompile across train -> eval -> train, and the train.compile=auto rule.

A cold compile costs 25-35 s on a 2-core CPU, so the whole-model case is one compact test."""

from __future__ import annotations

import logging

import pytest
import torch

from model import GPT, ModelConfig
from pipeline import parallelize as par
from pipeline.distributed import DistInfo

CPU = torch.device("cpu")


IN_GRAPH, CHUNKED = par.cpu_compile_threshold_s(True), par.cpu_compile_threshold_s(False)


@pytest.mark.parametrize(
    "requested, device, est_s, loss_in_graph, expected",
    [
        ("on", "cpu", None, False, True),
        ("off", "cuda", 1e9, True, False),
        ("auto", "cuda", None, False, True),
        ("auto", "cpu", None, True, False),  # run length unknown: no compile on CPU
        ("auto", "cpu", 0.9 * IN_GRAPH, True, False),
        ("auto", "cpu", 1.1 * IN_GRAPH, True, True),
        ("auto", "cpu", 1.1 * IN_GRAPH, False, False),  # the chunked loss gains less: longer runs
        ("auto", "cpu", 0.9 * CHUNKED, False, False),
        ("auto", "cpu", 1.1 * CHUNKED, False, True),
    ],
)
def test_resolve_compile_rule(requested, device, est_s, loss_in_graph, expected):
    assert par.resolve_compile(requested, torch.device(device), est_s, loss_in_graph) is expected


def test_compile_threshold_is_three_break_evens_of_the_measured_gain():
    # 34 s / (1 - 1/1.10) = 374 s to break even with the loss in the graph; 1,734 s chunked.
    assert 17 * 60 < IN_GRAPH < 21 * 60 and 80 * 60 < CHUNKED < 95 * 60


def test_auto_compile_estimate_is_capped_by_the_time_budget():
    from pipeline.config import TrainConfig
    from pipeline.train import estimated_eager_run_s

    model = GPT(ModelConfig(vocab_size=4096, n_layer=4, n_head=4, n_kv_head=2, d_model=256,
                            max_seq_len=256))
    info, precision = DistInfo(0, 0, 1, CPU), par.Precision(torch.float32, CPU)
    long_run = TrainConfig(global_batch_tokens=8192, micro_batch_size=8, max_steps=100_000)
    est = estimated_eager_run_s(model, long_run, 256, precision, info)
    assert est > 3600  # ~100k steps of 8k tokens take hours on any CPU
    budgeted = TrainConfig(global_batch_tokens=8192, micro_batch_size=8, max_steps=100_000,
                           time_budget_s=300)
    assert estimated_eager_run_s(model, budgeted, 256, precision, info) == 300


def test_recompile_watch_warns_only_after_each_phase_warmed_up(monkeypatch, caplog):
    graphs = iter([0, 1, 2, 2, 2, 3])  # built: train 1st, eval 1st, -, -, train again
    monkeypatch.setattr(par, "compiled_graphs", lambda: next(graphs))
    watch = par.RecompileWatch()
    with caplog.at_level(logging.WARNING, logger=par.log.name):
        assert [watch.check(p, s) for p, s in
                [("train", 1), ("eval", 1), ("train", 2), ("eval", 2), ("train", 3)]] == [1, 1, 0, 0, 1]
    assert len(caplog.records) == 1 and "step 3" in caplog.text and "recompiled 1" in caplog.text


def loss_and_grads(model, trained, x_BT, y_BT):
    model.zero_grad(set_to_none=True)
    loss = trained(x_BT, y_BT)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow  # two cold compiles (train, eval): ~60 s on 2 idle cores, 360 s loaded
@pytest.mark.parametrize("chunk, graphs", [
    (24, 2),  # several chunks, the last one short: the model up to the loss, the final norm
    (None, 1),  # logits of one chunk: the whole forward and loss in one graph
])
def test_compiled_forward_and_loss_equal_eager_without_recompiles(chunk, graphs):
    cfg = ModelConfig(vocab_size=1000, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64)
    info = DistInfo(0, 0, 1, CPU)
    models = []
    for compile_model in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        model.loss_chunk_tokens = chunk or model.loss_chunk_tokens
        models.append((model, par.parallelize(
            model, info, parallel="none", precision=par.Precision(torch.float32, CPU),
            compile_model=compile_model, activation_checkpointing=False).module))
    (eager, _), (model, compiled) = models
    assert list(model.state_dict()) == list(eager.state_dict())  # no `_orig_mod.` prefix
    g = torch.Generator().manual_seed(0)
    x_BT, y_BT = torch.randint(0, 1000, (2, 2, 48), generator=g)
    y_BT[0, :7] = -100
    eval_x_BT, eval_y_BT = torch.randint(0, 1000, (2, 3, 64), generator=g)  # eval's own shape

    watch = par.RecompileWatch()
    ref_loss, ref_grads = loss_and_grads(eager, eager, x_BT, y_BT)
    built = []
    for step in (1, 2, 3):
        loss, grads = loss_and_grads(model, compiled, x_BT, y_BT)
        built.append(watch.check("train", step))
        compiled.eval()
        with torch.no_grad():
            eval_loss = compiled(eval_x_BT, eval_y_BT, reduction="sum")
        compiled.train()
        built.append(watch.check("eval", step))
    assert built == [graphs, graphs, 0, 0, 0, 0], built  # train's and eval's, then none
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for got, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(eval_loss, eager(eval_x_BT, eval_y_BT, reduction="sum"),
                                   rtol=1e-5, atol=1e-4)
