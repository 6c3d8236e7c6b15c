"""`lmforge env` states the train.compile = auto rule as pipeline.compile_policy applies it: on
CPU the eager-time threshold resolve_compile switches at (for the demo's model), on CUDA always."""

from __future__ import annotations

import pytest
import torch

from launch.envinfo import compile_rule, main
from pipeline.compile_policy import resolve_compile, threshold_s

CPU = torch.device("cpu")


@pytest.mark.parametrize("attend", ["sdpa", "eager"])
def test_cpu_threshold_is_where_resolve_compile_switches(attend):
    rule = compile_rule(CPU, attend)
    t, gain = rule["threshold_s"], rule["gain"]
    assert gain > 1 and t == threshold_s(gain)
    assert resolve_compile("auto", CPU, t, gain)
    assert not resolve_compile("auto", CPU, t * 0.99, gain)


def test_env_prints_the_rule_not_a_fixed_off(capsys):
    assert main([]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("auto compile"))
    # For the attention auto picks for the demo's model (timed: either, on a noisy machine).
    minutes = {f"{compile_rule(CPU, a)['threshold_s'] / 60:.0f} min" for a in ("sdpa", "eager")}
    assert any(m in line for m in minutes) and "else off" in line, line


def test_cuda_rule_is_resolve_compiles():
    rule = compile_rule(torch.device("cuda", 0), "sdpa")
    assert rule["rule"].startswith("on on cuda") and rule["threshold_s"] is None
