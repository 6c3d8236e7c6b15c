"""The GPU presets' exact path on CPU/gloo: compiled DDP (train.compile = on) with gradient
buckets small enough that dynamo's DDPOptimizer splits the compiled graph at their boundaries,
2 processes against 1 eager process with accumulation, with the whole-logits loss the GPU
presets take and with the chunked loss opt-in."""

from __future__ import annotations

import re

import pytest

from lmforge.pipeline.checkpoint.run_dir import RunDir
from tests.conftest import LAYOUT_STEPS, layout_args
from tests.harness import losses, max_diff, train

pytestmark = pytest.mark.dist

# 3.3 MB of fp32 gradients: 4 buckets of 1 MiB (the smallest a compiled DDP model takes).
SHAPE = ("--model.d_model", "128", "--model.n_layer", "4", "--train.ddp_bucket_mb", "1")
# fp32: compiled kernels fuse and reorder the elementwise work and the ranks reduce in another
# order than one process accumulates; a wrong split or a missed bucket is off by far more.
TOL = 1e-4


def compiled_regions(run) -> int:
    """What rank 0's log says torch.compile built for the training step (RecompileWatch)."""
    found = re.search(r"torch\.compile: train built \d+ graph\(s\), (\d+) compiled region",
                      RunDir(run).log.read_text())
    assert found, "the run did not log what torch.compile built"
    return int(found.group(1))


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    """1 process x 4 micro-steps, eager: the reference."""
    run = tmp_path_factory.mktemp("single")
    train(layout_args(tiny_data, run, *SHAPE), nproc=1)
    return losses(run)


@pytest.mark.parametrize("loss", ["full", "chunked"])
def test_compiled_ddp_with_split_buckets_equals_one_process(single, tiny_data, tmp_path, loss):
    run = tmp_path / loss
    train(layout_args(tiny_data, run, *SHAPE, "--train.parallel", "ddp", "--train.compile", "on",
                      "--train.loss", loss), nproc=2, timeout=540)
    assert compiled_regions(run) >= 2  # the graph was split at DDP's buckets
    ddp = losses(run)
    assert sorted(ddp) == sorted(single) == list(range(1, LAYOUT_STEPS + 1))
    worst = max_diff(ddp, single)
    assert worst <= TOL, f"max |loss diff| {worst:.3g} > {TOL:g}"
