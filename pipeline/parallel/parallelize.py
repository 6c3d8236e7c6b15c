"""Activation checkpointing (per block), then torch.compile, then DDP / FSDP2, applied to a plain
`GPT` from outside (torchtitan's pattern: the model file knows nothing of them).

`parallelize` returns a `ParallelModel`: the wrapped module with what differs between the modes
(the micro-step's gradient sync, the autocast), so the training loop never branches on the mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from lmforge.model import GPT
from lmforge.pipeline import attention
from lmforge.pipeline.attention import Attend
from lmforge.pipeline.config import TrainConfig
from lmforge.pipeline.hardware import dtype_name, resolve_dtype
from lmforge.pipeline.loss import HeadLoss, build_loss, resolve_loss
from lmforge.pipeline.metrics import get_logger
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.parallel.materialize import materialize

log = get_logger()


def resolve_compile(requested: str, device: torch.device) -> str:
    """train.compile auto|on|off -> on|off: auto compiles on CUDA only. On CPU a cold compile
    costs 25-40 s, more than the demo's eager steps gain from it (bench/results/README.md)."""
    if requested != "auto":
        return requested
    return "on" if torch.device(device).type == "cuda" else "off"


def kept(t: TrainConfig, started: TrainConfig | None, name: str) -> str:
    """A train.* choice as configured, else (auto) as the resumed run started with: auto
    again only for a fresh start, or a checkpoint written before that choice was saved."""
    mine = getattr(t, name)
    return mine if mine != "auto" else getattr(started, name, "auto")


def resolve_choices(t: TrainConfig, device: torch.device, dtype: torch.dtype, seq_len: int,
                    padded_vocab: int, started: TrainConfig | None = None) -> TrainConfig:
    """train.dtype (`dtype`: Precision.resolve of `kept` dtype) and train.compile, .attention and
    .loss, each auto resolved by its static rule; a resumed run keeps the choices it started
    with (`started`: its checkpoint's)."""
    rules = {
        "compile": lambda: resolve_compile("auto", device),
        "attention": lambda: attention.resolve("auto", device, dtype, seq_len),
        "loss": lambda: resolve_loss("auto", device, padded_vocab, t.micro_batch_size * seq_len),
    }
    chosen = {"dtype": dtype_name(dtype)}
    for name, rule in rules.items():
        choice = kept(t, started, name)
        chosen[name] = choice if choice != "auto" else rule()
    return replace(t, **chosen)


def resolve_parallel(requested: str, info: DistInfo) -> str:
    """auto: DDP when there are several processes. A GPU preset (ddp/fsdp) started as one plain
    process has nothing to replicate or shard across, so it runs as none rather than failing."""
    if requested == "auto" or not info.is_distributed:
        return "ddp" if info.is_distributed else "none"
    return requested


@dataclass(frozen=True)
class Precision:
    """The dtype matmuls compute in (master weights and optimizer state stay fp32 either way)."""

    dtype: torch.dtype
    device: torch.device

    @classmethod
    def resolve(cls, requested: str, device: torch.device, workload: str = "train") -> Precision:
        """train.dtype for `workload` (train, eval, sample) on `device` (hardware.resolve_dtype)."""
        return cls(resolve_dtype(requested, device, workload), torch.device(device))

    @property
    def bf16(self) -> bool:
        return self.dtype == torch.bfloat16

    def autocast(self, module: nn.Module):
        """bf16 autocast over `module`'s fp32 parameters when computing in bf16, except under
        FSDP2, whose MixedPrecisionPolicy already hands the forward bf16 parameters."""
        enabled = self.bf16 and not isinstance(module, FSDPModule)
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=enabled)


@dataclass(frozen=True)
class ParallelModel:
    """The module to train (as `parallelize` wrapped it) with the LM-head loss and the attention
    its forward is handed."""

    module: nn.Module
    mode: str  # "none" | "ddp" | "fsdp"
    precision: Precision
    head_loss: HeadLoss
    attend: Attend = F.scaled_dot_product_attention

    def loss(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor, reduction: str = "mean"):
        """The module's forward to the loss, computed by this run's head_loss and attention."""
        return self.module(idx_BT, targets_BT, reduction=reduction, loss_fn=self.head_loss,
                           attend=self.attend)

    def autocast(self):
        return self.precision.autocast(self.module)

    @contextlib.contextmanager
    def micro_step(self, sync: bool) -> Iterator[None]:
        """Around one micro-step's forward and backward: gradients reduced only when `sync`.
        DDP's forward decides whether the backward all-reduces, so no_sync covers it too; FSDP's
        switch persists, so it is put back on exit (a later backward still syncs)."""
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
    loss: str = "chunked",
    ddp_bucket_mb: float = 25.0,
    attend: Attend = F.scaled_dot_product_attention,
    init_seed: int | None = None,
) -> ParallelModel:
    """Wrap `model` for training; `parallel` and `loss` are resolved. With init_seed, `model` is a
    meta-device build, allocated on info.device and initialised after sharding, so that under
    FSDP2 a rank holds only its shards; without, it already holds its weights on info.device."""
    if activation_checkpointing:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if compile_model:
        compile_regions(model, per_block=parallel == "fsdp")
    head_loss = build_loss(loss, info.device, compile_alone=compile_model and parallel == "fsdp")
    module: nn.Module = model
    if parallel == "fsdp":
        if info.device.type == "cpu":
            from lmforge.pipeline.cpu.allocator import release_freed_blocks  # the CPU room

            release_freed_blocks()
        # bf16 parameters for compute, fp32 gradient reduction; the sharded fp32 parameters
        # the optimizer updates are the master weights.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision.bf16 else None,
                                  reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    if init_seed is not None:
        materialize(model, info.device, init_seed)
    if parallel == "ddp":
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        module = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=ddp_bucket_mb,
                                         gradient_as_bucket_view=True)
    return ParallelModel(module, parallel, precision, head_loss, attend)


def compile_regions(model: GPT, per_block: bool) -> None:
    """torch.compile the forward (with the loss it is handed) in place: Module.compile keeps
    parameter names free of an `_orig_mod.` prefix, so checkpoints load either way. Under FSDP2 the
    blocks compile alone (its all-gather hooks run between them), the loss as its own region.
    dynamic=False: training's and eval's one shape each get a static graph (faster than dynamic)."""
    for region in model.blocks if per_block else [model]:
        region.compile(dynamic=False)


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compiled_regions() -> int:
    """Regions inductor has compiled so far (a graph DDP splits at its buckets is several)."""
    return torch._dynamo.utils.counters["aot_autograd"]["total"]


class RecompileWatch:
    """Says what torch.compile built for each phase ("train", "eval") on its first call, and warns
    of a graph built after that: a recompile, which costs seconds every time."""

    def __init__(self):
        self.seen_phases, self.graphs, self.regions = set(), compiled_graphs(), compiled_regions()

    def check(self, phase: str, step: int) -> int:
        """Call after each phase; returns the graphs built since the last check."""
        new = compiled_graphs() - self.graphs
        self.graphs += new
        regions = compiled_regions() - self.regions
        self.regions += regions
        if new and phase not in self.seen_phases:
            log.info("torch.compile: %s built %d graph(s), %d compiled region(s)", phase, new,
                     regions)
        if new and phase in self.seen_phases:
            log.warning(
                "step %d: torch.compile recompiled %d graph(s) during %s after warm-up; "
                "rerun with TORCH_LOGS=recompiles to see which guard failed", step, new, phase,
            )
        self.seen_phases.add(phase)
        return new
