"""Apply activation checkpointing, torch.compile and DDP / FSDP2 to a plain `GPT` from outside.

The model file knows nothing of any of this (torchtitan's pattern). The order is fixed:
activation checkpointing (per block) -> compile -> data parallelism. Compile covers the forward
but the chunked LM-head loss, which stays eager (see compile_regions); under FSDP2 the compiled
regions are its units instead (each block), since FSDP's all-gather hooks run between them.

`parallelize` returns a `ParallelModel`: the wrapped module with the two things that differ
between the modes, the micro-step's gradient sync and the autocast, so the training loop never
branches on the mode. `Precision` is the compute dtype and the one rule for when to autocast.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from model import GPT
from pipeline.distributed import DistInfo
from pipeline.hardware import MMAP_THRESHOLD, fix_mmap_threshold, resolve_dtype
from pipeline.materialize import materialize
from pipeline.metrics import get_logger

log = get_logger()


def resolve_parallel(requested: str, info: DistInfo) -> str:
    """auto: DDP when there are several processes. A GPU preset (ddp/fsdp) started as one plain
    process has nothing to replicate or shard across, so it runs as none rather than failing."""
    if requested == "auto" or not info.is_distributed:
        return "ddp" if info.is_distributed else "none"
    return requested


# Cold compile (first step minus a steady step, empty inductor cache) of the forward + loss +
# backward on a 2-core AVX2 CPU (bench/train_bench.py shapes): 30.5-37.0 s at V 4,096 (three
# runs), 33.8 s at V 50,304. What it gains depends on the loss. Logits of one chunk or less (V 4k,
# 2,048 tokens: the tiny preset's shape) compile into the model's graph: 1.03x and 1.28x over
# eager in two bench runs, 1.06-1.19x in direct alternations, so 1.10x is used. The chunked loss
# stays eager (V 50k), and the matmuls, ~80 % of a step there, are the same kernels compiled or
# not (bench/profile_step.py): 1.02x. Break-even = cold compile / (1 - 1/gain): ~6 and ~29 min.
CPU_COLD_COMPILE_S = 34.0
CPU_COMPILE_GAIN_LOSS_IN_GRAPH = 1.10
CPU_COMPILE_GAIN_CHUNKED_LOSS = 1.02
# A run must last 3 break-evens: the eval graph compiles too (2x), and the gains were measured
# on one CPU kind, on a noisy machine (1.5x). Loss in the graph: ~19 min; chunked: ~87 min.
CPU_COMPILE_MARGIN = 3.0


def cpu_compile_threshold_s(loss_in_graph: bool, cold_compile_s: float = CPU_COLD_COMPILE_S) -> float:
    """The shortest estimated eager run (seconds) that train.compile = auto compiles on CPU."""
    gain = CPU_COMPILE_GAIN_LOSS_IN_GRAPH if loss_in_graph else CPU_COMPILE_GAIN_CHUNKED_LOSS
    return CPU_COMPILE_MARGIN * cold_compile_s / (1 - 1 / gain)


def resolve_compile(
    requested: str, device: torch.device, est_eager_run_s: float | None = None,
    loss_in_graph: bool = False,
) -> bool:
    """train.compile on|off|auto -> whether to compile. auto: always on CUDA; on CPU only when
    the run's estimated eager time (seconds; None = unknown) reaches cpu_compile_threshold_s,
    i.e. when what compile saves repays its cold compiles. loss_in_graph: the micro-batch's
    logits fit one chunk (GPT.head_loss), so the loss compiles with the model."""
    if requested != "auto":
        return requested == "on"
    if device.type == "cuda":
        return True
    return est_eager_run_s is not None and est_eager_run_s >= cpu_compile_threshold_s(loss_in_graph)


@dataclass(frozen=True)
class Precision:
    """The dtype matmuls compute in (master weights and optimizer state stay fp32 either way)."""

    dtype: torch.dtype
    device: torch.device

    @classmethod
    def resolve(cls, requested: str, device: torch.device) -> Precision:
        """train.dtype auto|bf16|fp32 on `device` (pipeline.hardware.resolve_dtype's rule)."""
        return cls(resolve_dtype(requested, device), torch.device(device))

    @property
    def bf16(self) -> bool:
        return self.dtype == torch.bfloat16

    def autocast(self, module: nn.Module):
        """The context to run `module` in, for training, eval and sampling alike: bf16 autocast
        over its fp32 parameters, except under FSDP2, whose MixedPrecisionPolicy already hands
        the forward bf16 parameters."""
        enabled = self.bf16 and not isinstance(module, FSDPModule)
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=enabled)


@dataclass(frozen=True)
class ParallelModel:
    """The module to train (as `parallelize` wrapped it) and what differs between the modes."""

    module: nn.Module
    mode: str  # "none" | "ddp" | "fsdp"
    precision: Precision

    def autocast(self):
        return self.precision.autocast(self.module)

    @contextlib.contextmanager
    def micro_step(self, sync: bool) -> Iterator[None]:
        """Around one micro-step's forward and backward: gradients are reduced across ranks only
        when `sync`. DDP's forward decides whether the coming backward all-reduces, so no_sync
        must cover the forward too. FSDP's switch is a persistent module setting: it is set on
        entry and put back to syncing on exit, so a backward outside a micro-step still syncs."""
        if TRACE_PREFIX:
            _trace_collectives(self.module, self.mode)
            _trace(f"micro sync={int(sync)}")
        if sync or self.mode == "none":
            yield
        elif self.mode == "ddp":
            with self.module.no_sync():
                yield
        else:
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)


def parallelize(
    model: GPT,
    info: DistInfo,
    *,
    parallel: str,
    precision: Precision,
    compile_model: bool,
    activation_checkpointing: bool,
    init_seed: int | None = None,
) -> ParallelModel:
    """Wrap `model` for training. `parallel` is resolved (none | ddp | fsdp: see
    resolve_parallel). With init_seed, `model` is a meta-device build (materialize.meta_gpt),
    allocated on info.device and initialised after sharding, so that under FSDP2 a rank holds only
    its shards; without, it must already hold its initial weights on info.device."""
    if activation_checkpointing:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if compile_model:
        compile_regions(model, per_block=parallel == "fsdp")
    module: nn.Module = model
    if parallel == "fsdp":
        # Sharding is for memory: on CPU, memory only shrinks with the ranks once malloc gives
        # FSDP2's freed per-block buffers back (a step costs more page faults for it).
        if info.device.type == "cpu" and fix_mmap_threshold():
            log.info("FSDP2 on CPU: glibc malloc's mmap threshold fixed at %d KiB, so freed "
                     "buffers go back to the OS (set MALLOC_MMAP_THRESHOLD_ to choose another)",
                     MMAP_THRESHOLD // 1024)
        # bf16 parameters for compute, fp32 gradient reduction; the sharded fp32 parameters
        # the optimizer updates are the master weights.
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if precision.bf16 else None, reduce_dtype=torch.float32
        )
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    if init_seed is not None:
        materialize(model, info.device, init_seed)
    if parallel == "ddp":
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        module = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    return ParallelModel(module, parallel, precision)


def compile_regions(model: GPT, per_block: bool) -> None:
    """torch.compile the forward + loss in place: Module.compile keeps parameter names free of an
    `_orig_mod.` prefix, so checkpoints load the same whether or not the run was compiled.
    dynamic=False: training's one shape and eval's one shape get a static graph each (eval
    batches are padded to one shape), instead of a slower dynamic-shape graph after eval."""
    # The chunked LM-head loss stays eager: it writes every chunk into reused buffers (out=, in
    # place), which inductor turns into fresh tensors and copies; compiled it measured 0.75x of
    # eager with 4x the page faults at V 50k (bench/profile_step.py). Its matmuls dominate anyway.
    model.chunked_loss = torch.compiler.disable(model.chunked_loss)
    if not per_block:
        # Logits of one chunk or less are built whole, in the model's graph (loss_joins_graph):
        # a compiled step took 0.80x the time it took with the chunked loss outside (V 4k).
        model.loss_whole_tokens = model.loss_chunk_tokens
        model.compile(dynamic=False)
        return
    for block in model.blocks:
        block.compile(dynamic=False)


def loss_joins_graph(model: GPT, parallel: str, tokens: int) -> bool:
    """Whether a compiled micro-batch of `tokens` computes its loss inside the model's graph:
    compile_regions compiles the whole model (FSDP2: its blocks only) and lets logits of one
    chunk or less be built whole there."""
    return parallel != "fsdp" and tokens <= model.loss_chunk_tokens


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class RecompileWatch:
    """Warns when torch.compile builds a graph after warm-up. Each phase ("train", "eval")
    compiles on its first call; any later graph is a recompile (a guard failed: a new shape,
    dtype or grad mode) that costs seconds every time it happens."""

    def __init__(self):
        self.seen_phases, self.graphs = set(), compiled_graphs()

    def check(self, phase: str, step: int) -> int:
        """Call after each phase; returns the graphs built since the last check."""
        new = compiled_graphs() - self.graphs
        self.graphs += new
        if new and phase in self.seen_phases:
            log.warning(
                "step %d: torch.compile recompiled %d graph(s) during %s after warm-up; "
                "rerun with TORCH_LOGS=recompiles to see which guard failed", step, new, phase,
            )
        self.seen_phases.add(phase)
        return new


# Test-only instrumentation (tests/test_accumulation.py): with LMFORGE_TRACE_GRAD_SYNC=PREFIX each
# rank appends to PREFIX.rank<N> a line "micro sync=0|1" per micro-step and "reduce" per gradient
# collective that DDP or FSDP launches, so a test can count the collectives of each optimizer
# step. Unset (always, outside tests) it costs one `if` per micro-step.
TRACE_PREFIX = os.environ.get("LMFORGE_TRACE_GRAD_SYNC")


def _trace(event: str) -> None:
    with open(f"{TRACE_PREFIX}.rank{os.environ.get('RANK', '0')}", "a") as f:
        f.write(event + "\n")


def _trace_collectives(model: nn.Module, parallel: str) -> None:
    """Once per model: wrap DDP's all-reduce / FSDP's reduce-scatter to log each call."""
    # Imported here: only the tests reach this, and FSDP's comm class is private.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    if getattr(model, "_grad_sync_traced", False):
        return
    model._grad_sync_traced = True
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
