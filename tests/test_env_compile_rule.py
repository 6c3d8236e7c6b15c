"""`lmforge env` states the train.compile = auto rule as pipeline.parallelize applies it: on CPU
the eager-time thresholds resolve_compile compiles from, on CUDA always on."""

from __future__ import annotations

import pytest
import torch

from launch.envinfo import compile_rule, main
from pipeline.parallelize import cpu_compile_threshold_s, resolve_compile

CPU = torch.device("cpu")


@pytest.mark.parametrize("loss_in_graph", [True, False])
def test_cpu_thresholds_are_where_resolve_compile_switches(loss_in_graph):
    key = "loss_in_graph" if loss_in_graph else "chunked_loss"
    threshold_s = compile_rule(CPU)["threshold_s"][key]
    assert threshold_s == cpu_compile_threshold_s(loss_in_graph)
    assert resolve_compile("auto", CPU, threshold_s, loss_in_graph)
    assert not resolve_compile("auto", CPU, threshold_s * 0.99, loss_in_graph)


def test_env_prints_the_rule_not_a_fixed_off(capsys):
    assert main([]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("auto compile"))
    for loss_in_graph in (True, False):
        assert f"{cpu_compile_threshold_s(loss_in_graph) / 60:.0f} min" in line, line
    assert "else off" in line


def test_cuda_rule_is_resolve_compiles():
    rule = compile_rule(torch.device("cuda", 0))
    assert rule["rule"].startswith("on on cuda") and rule["threshold_s"] is None
