"""Gradient accumulation across ranks, where a lost no_sync or a mis-scaled micro-step hides:
2 ranks x 2 accumulation micro-steps, DDP and FSDP, against 1 process x 4 micro-steps on the same
global batch, in fp32, at the tolerance measured for fp32 round-off; and the gradient collectives
counted per optimizer step (tests/traced_train.py): DDP all-reduces
and FSDP reduce-scatters in the last micro-step of each step only. Dropping `no_sync` changes no
number, so only the count can catch it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import LAYOUT_STEPS as STEPS
from tests.harness import metrics

pytestmark = pytest.mark.dist

# fp32: the only difference from one process is the order in which the micro-batch gradients
# are summed. Measured over 12 steps (AVX2 CPU, gloo), relative: loss 2e-8 (DDP and FSDP), grad
# norm 1.2e-7 (DDP) and 1.8e-7 (FSDP). Syncing the first micro-step instead: loss 7e-3 off.
TOL, TOL_STEPS = 1e-6, range(1, 13)
COLLECTIVES_PER_SYNC = {"ddp": 1, "fsdp": 3}


def trace(runs: dict[str, Path], parallel: str, rank: int) -> Path:
    return runs[parallel].with_name(f"{parallel}.trace.rank{rank}")


def curve(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in metrics(run_dir) if key in r}


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_two_micro_steps_equal_one_process(layout_runs, parallel):
    for key in ("loss", "grad_norm"):
        single, multi = curve(layout_runs["none"], key), curve(layout_runs[parallel], key)
        assert sorted(single) == sorted(multi) == list(range(1, STEPS + 1))
        worst = max(abs(multi[s] - single[s]) / max(1.0, abs(single[s])) for s in TOL_STEPS)
        print(f"{parallel} {key}: max |diff| vs 1 process = {worst:.3g}")
        assert worst <= TOL, f"{parallel} {key} drifts {worst:.3g} from 1 process (> {TOL:g})"


def steps_of(trace: Path, accum: int = 2) -> list[list[tuple[int, int]]]:
    """Per optimizer step, per micro-step: (sync requested, gradient collectives launched)."""
    micro: list[list[int]] = []
    for line in trace.read_text().splitlines():
        if line.startswith("micro sync="):
            micro.append([int(line.removeprefix("micro sync=")), 0])
        else:
            assert line == "reduce" and micro, f"collective before any micro-step in {trace}"
            micro[-1][1] += 1
    assert len(micro) == accum * STEPS, f"{len(micro)} micro-steps traced, not {accum * STEPS}"
    return [[tuple(m) for m in micro[i : i + accum]] for i in range(0, len(micro), accum)]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_gradients_are_reduced_once_per_optimizer_step(layout_runs, parallel):
    for rank in (0, 1):
        steps = steps_of(trace(layout_runs, parallel, rank))
        per_step = {step[1][1] for step in steps}
        print(f"{parallel} rank {rank}: collectives per step (first, last micro-step): "
              f"{sorted({(a[1], b[1]) for a, b in steps})}")
        for i, (first, last) in enumerate(steps, 1):
            assert first == (0, 0), f"step {i}: the first micro-step synced gradients {first}"
            assert last[0] == 1 and last[1] >= 1, f"step {i}: no reduction in the last micro-step"
        # DDP: one all-reduce per bucket, and the tiny model fits DDP's first bucket (1 MB);
        # FSDP: one reduce-scatter per fully_shard unit, the 2 blocks and the root.
        assert per_step == {COLLECTIVES_PER_SYNC[parallel]}, per_step


def test_one_process_launches_no_collective(layout_runs):
    steps = steps_of(trace(layout_runs, "none", 0), accum=4)
    assert all(n == 0 for step in steps for _, n in step)
    assert [sync for sync, _ in steps[0]] == [0, 0, 0, 1]
