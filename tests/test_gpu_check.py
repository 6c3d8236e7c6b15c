"""bench/gpu_check.py cannot rot: its --cpu-smoke mode runs every stage (the 1-device step of each
configuration with the SDPA-kernel check, 1 vs 2-process DDP/FSDP2 parity, SIGKILL + --resume
auto) on CPU/gloo."""

from __future__ import annotations

import sys

import pytest

from tests.harness import run


@pytest.mark.slow
def test_gpu_check_cpu_smoke(tiny_data):
    res = run([sys.executable, "-m", "bench.gpu_check", "--cpu-smoke",
               "--data", str(tiny_data), "--timeout", "180"], timeout=600, retries=0)
    assert res.returncode == 0, res.stdout[-4000:]
    summary = res.stdout.split("=== gpu_check summary (--cpu-smoke)")[1].splitlines()[1:]
    assert summary and all(line.split()[0] == "PASS" for line in summary), summary
    for stage in ("step lmforge full", "step lmforge chunked", "step preset (modern)",
                  "step GPT-2 ref", "step HF Llama", "2-proc DDP", "2-proc FSDP2", "kill + resume"):
        assert any(stage in line for line in summary), stage
    assert "SDPA flash" in res.stdout  # the CPU flash kernel, not the math fallback
