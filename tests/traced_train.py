"""`python -m tests.traced_train ARGS` (under torchrun too): launch.train with every rank's
micro-steps and gradient collectives written to $LMFORGE_TRACE_GRAD_SYNC.rank<N>, a line
"micro sync=0|1" per micro-step and "reduce" per all-reduce (DDP) or reduce-scatter (FSDP2), so a
test can count the collectives of each optimizer step (tests/test_accumulation.py). The product
carries none of this: it wraps ParallelModel.micro_step from outside."""

from __future__ import annotations

import contextlib
import os
import sys
import weakref

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from lmforge.pipeline.parallel.parallelize import ParallelModel

PREFIX = os.environ["LMFORGE_TRACE_GRAD_SYNC"]
_TRACED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _trace(event: str) -> None:
    with open(f"{PREFIX}.rank{os.environ.get('RANK', '0')}", "a") as f:
        f.write(event + "\n")


def _trace_collectives(model: nn.Module, parallel: str) -> None:
    """Once per model: wrap DDP's all-reduce / FSDP's reduce-scatter to log each call."""
    if model in _TRACED:
        return
    _TRACED.add(model)
    if parallel == "ddp":
        def traced_allreduce(process_group, bucket):
            _trace("reduce")
            return allreduce_hook(process_group, bucket)

        model.register_comm_hook(None, traced_allreduce)
    elif parallel == "fsdp":
        class TracedReduceScatter(DefaultReduceScatter):
            def __call__(self, *args, **kwargs):
                _trace("reduce")
                return super().__call__(*args, **kwargs)

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(TracedReduceScatter())


_micro_step = ParallelModel.micro_step


@contextlib.contextmanager
def traced_micro_step(self: ParallelModel, sync: bool):
    _trace_collectives(self.module, self.mode)
    _trace(f"micro sync={int(sync)}")
    with _micro_step(self, sync):
        yield


if __name__ == "__main__":
    from lmforge.launch.cli import run_user_command
    from lmforge.launch.train import main

    ParallelModel.micro_step = traced_micro_step
    sys.exit(run_user_command(main, sys.argv[1:]))
