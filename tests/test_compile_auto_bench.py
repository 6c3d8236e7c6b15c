"""bench/compile_auto.py runs: its smoke run fills a ledger of its own and decides from it."""

from __future__ import annotations

import sys

from bench.runs import run


def test_compile_auto_bench_smoke_decides_from_the_ledger_it_filled():
    """bench/compile_auto.py: run 1 decides from the roofline, run 3 from what runs 1 and 2 filed."""
    out = run([sys.executable, "-m", "bench.compile_auto", "--smoke", "--seed-steps", "10"],
              timeout=400)
    assert out.returncode == 0, out.stdout
    lines = out.stdout.splitlines()
    decisions = [ln.strip() for ln in lines if ln.strip().startswith("train.compile = auto")]
    assert len(decisions) == 2, out.stdout
    assert "(a roofline estimate)" in decisions[0] and "(its step measured here)" in decisions[1]
    assert any(ln.startswith("run 3 / run 1 wall-clock: ") for ln in lines)
