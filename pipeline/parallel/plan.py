"""Plan before renting GPUs: `--dry-run --nproc N --nnodes M --gpu H100 --mfu 0.4`.

Per GPU, for DDP and FSDP2 as pipeline.parallel.parallelize builds them: the bytes of state
(exact: tests/test_plan.py), activations and the loss, whether they fit, the bytes each step moves
between GPUs, and the step time an assumed MFU implies.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import torch

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.shards import load_manifest
from lmforge.model import GPT, ModelConfig
from lmforge.pipeline.config import ConfigError, JobConfig, derive
from lmforge.pipeline.hardware import GPU_PEAKS, gpu_dtype  # the datasheet table, kept in one place
from lmforge.pipeline.loss import CHUNK_ELEMS, chunk_tokens, resolve_loss
from lmforge.pipeline.optim.optimizers import is_muon_matrix
from lmforge.pipeline.parallel.materialize import meta_gpt

FP32, BF16 = 4, 2
GiB = 2**30
GPT2_VOCAB = 50257
USABLE = 0.9  # of a GPU's memory: the CUDA context, NCCL buffers and fragmentation take the rest
GPU_MEMORY_GIB = {  # by the peak table's labels
    "H200 NVL": 141, "H200 SXM": 141, "H100 NVL": 94, "H100 PCIe": 80, "H100 SXM": 80,
    "A100": 80, "A10": 24, "L40S": 48, "L4": 24, "RTX 4090": 24, "RTX 3090": 24,
}


@dataclass(frozen=True)
class Gpu:
    label: str
    memory: int  # bytes
    bf16_peak: float  # dense FLOP/s


def find_gpu(name: str) -> Gpu:
    for pattern, label, peaks in GPU_PEAKS:
        if re.search(pattern, name, re.IGNORECASE) and label in GPU_MEMORY_GIB:
            return Gpu(label, GPU_MEMORY_GIB[label] * GiB, peaks["bf16"])
    raise ValueError(f"unknown GPU '{name}'; known: {', '.join(GPU_MEMORY_GIB)}")


# ----------------------------------------------------------------------------- state (exact)

def local_rows(rows: int, world: int, rank: int) -> int:
    """Rows of a dim-0 FSDP2 shard: torch.chunk's split, the last ranks possibly short or empty."""
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk))


@dataclass(frozen=True)
class State:
    """Bytes per GPU that live for the whole run (gradients: after backward, before zero_grad)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(shapes: list[tuple[int, ...]], world: int, sharded: bool, rank: int = 0,
                muon: list[bool] | None = None) -> State:
    """fp32 parameters, fp32 gradients and optimizer state on `rank`: AdamW's exp_avg, exp_avg_sq
    and step, or for the parameters `muon` marks, Muon's one momentum buffer."""
    numel = state = 0
    for shape, by_muon in zip(shapes, muon or [False] * len(shapes), strict=True):
        rows = local_rows(shape[0], world, rank) if sharded else shape[0]
        n = rows * math.prod(shape[1:])
        numel += n
        state += FP32 * n if by_muon else 2 * FP32 * n + FP32
    return State(FP32 * numel, FP32 * numel, state)


# ----------------------------------------------------------------------------- activations

def activation_bytes(m: ModelConfig, batch: int, seq_len: int, bf16: bool,
                     checkpointing: bool) -> int:
    """Bytes one micro-batch's forward saves for backward (eager, SDPA attention), counted tensor
    by tensor from model/model.py. `a` is the compute dtype's size; the residual stream stays fp32
    (the embedding is fp32, and adding bf16 branch outputs to it promotes to fp32)."""
    a = BF16 if bf16 else FP32
    D, H, G, K, F = m.d_model, m.n_head, m.n_kv_head, m.head_dim, m.mlp_hidden
    norms = 2 * (FP32 * D + FP32)  # each RMSNorm: its fp32 input and 1/rms
    matmul_inputs = 2 * a * D  # the normed inputs of qkv and up, in the compute dtype
    attn = (a * (H + 2 * G) * K  # qkv output (attention saves v, a view of it)
            + a * (H + G) * K  # q and k after RoPE
            + a * H * K + FP32 * H  # attention output and its log-sum-exp
            + a * H * K)  # heads merged (a contiguous copy) for the output projection
    if m.qk_norm:  # each head's normalised q and k (for the gains' gradient) and their 1/rms
        attn += a * (H + G) * K + FP32 * (H + G)
    # swiglu: up's output (gate and up halves), silu(gate), the gated product; gelu: in and out;
    # relu2: relu's output (its own and the square's backward read it) and the square.
    mlp = 4 * a * F if m.mlp == "swiglu" else 2 * a * F
    block = norms + matmul_inputs + attn + mlp
    # A value-embedding layer's values are v + ve, a tensor of their own (without, a view of qkv).
    value_embeds = a * G * K * len(m.value_embed_layers())
    # Final norm, LM-head input and its gradient (the chunked loss computes it in forward), int64
    # input ids and targets. The logits are never kept: see head_loss_bytes.
    head = FP32 * D + FP32 + a * D + a * D + 8 + 8
    # Checkpointing keeps each block's fp32 input; backward rebuilds one block at a time.
    blocks = FP32 * D * m.n_layer + block if checkpointing else block * m.n_layer + value_embeds
    return batch * seq_len * (blocks + head)


def planned_loss(cfg: JobConfig, m: ModelConfig) -> str:
    """train.loss as a GPU run resolves it (the plan is for GPUs)."""
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    return resolve_loss(cfg.train.loss, torch.device("cuda"), m.padded_vocab_size, tokens)


def head_loss_bytes(model: GPT, tokens: int, loss: str, bf16: bool) -> int:
    """The most the LM-head loss of `tokens` holds on a GPU: full, the logits in the compute dtype
    with their fp32 copy and log-probabilities (in backward, the fp32 gradient and its cast);
    chunked, two fp32 chunk x V buffers and the head's fp32 gradient sum."""
    V = model.cfg.padded_vocab_size
    if loss == "full":
        return tokens * V * ((BF16 if bf16 else FP32) + 2 * FP32)
    chunk = chunk_tokens(V, tokens, CHUNK_ELEMS["cuda"])
    return 2 * FP32 * chunk * V + FP32 * V * model.cfg.d_model


# ----------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Strategy:
    name: str  # "DDP" or "FSDP2"
    state: State
    compute_copy: int  # bf16 weight copies alive during a micro-step
    accumulated: int  # FSDP2 accumulating without sync keeps unsharded gradients between micro-steps
    activations: int
    activations_ac: int
    head_loss: int  # logits (whole or by chunks) + the head's gradient, during the loss
    all_gather: int  # bytes per optimizer step, whole tensors (each GPU sends (W-1)/W of them)
    reduce_scatter: int
    all_reduce: int  # a ring all-reduce sends 2 (W-1)/W of it per GPU
    muon: int = 0  # FSDP2 + Muon: each block matrix gathered whole to its owner and scattered back

    def peak(self, checkpointing: bool) -> int:
        acts = self.activations_ac if checkpointing else self.activations
        return self.state.total + self.compute_copy + self.accumulated + acts + self.head_loss


def _blocks_bytes(model: GPT) -> tuple[int, int]:
    """(largest block's parameters, parameters outside the blocks)."""
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    in_blocks = sum(p.numel() for b in model.blocks for p in b.parameters())
    return block, model.num_params() - in_blocks


def strategies(cfg: JobConfig, model: GPT, world: int, bf16: bool) -> list[Strategy]:
    model_cfg = model.cfg
    shapes = [tuple(p.shape) for p in model.parameters()]
    muon = [cfg.optim.name == "muon" and is_muon_matrix(n, p) for n, p in model.named_parameters()]
    muon_numel = sum(p.numel() for p, by_muon in zip(model.parameters(), muon, strict=True) if by_muon)
    n = model.num_params()
    accum = derive(cfg, world).grad_accum_steps
    mb, T = cfg.train.micro_batch_size, cfg.data.seq_len
    acts = activation_bytes(model_cfg, mb, T, bf16, False)
    acts_ac = activation_bytes(model_cfg, mb, T, bf16, True)
    head = head_loss_bytes(model, mb * T, planned_loss(cfg, model_cfg), bf16)
    p_bytes = BF16 if bf16 else FP32
    block, outside = _blocks_bytes(model)
    ddp = Strategy("DDP", state_bytes(shapes, world, sharded=False, muon=muon),
                   compute_copy=BF16 * n if bf16 else 0, accumulated=0, activations=acts,
                   activations_ac=acts_ac, head_loss=head,
                   all_gather=0, reduce_scatter=0, all_reduce=FP32 * n if world > 1 else 0)
    # FSDP2: the root's parameters stay gathered from forward to backward, one block is gathered
    # as the next is prefetched, in forward and backward of every micro-step; gradients
    # reduce-scatter on the last micro-step only.
    fsdp = Strategy("FSDP2", state_bytes(shapes, world, sharded=True, muon=muon),
                    compute_copy=p_bytes * (outside + 2 * block) if world > 1 else 0,
                    accumulated=FP32 * n if world > 1 and accum > 1 else 0,
                    activations=acts, activations_ac=acts_ac, head_loss=head,
                    all_gather=2 * accum * p_bytes * n if world > 1 else 0,
                    reduce_scatter=FP32 * n if world > 1 else 0, all_reduce=0,
                    muon=2 * FP32 * muon_numel if world > 1 else 0)
    return [ddp, fsdp]


def _gib(b: float) -> str:
    return f"{b / GiB:.2f} GiB"


def _duration(s: float) -> str:
    if s >= 86400:
        return f"{s / 86400:.1f} days"
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s:.1f} s" if s < 60 else f"{s / 60:.1f} min"


def planned_model(cfg: JobConfig) -> tuple[ModelConfig, str]:
    """The model with its vocabulary: the config's, the prepared data's, or GPT-2's."""
    if cfg.model.vocab_size:
        return cfg.model, f"vocab {cfg.model.vocab_size} (config)"
    try:
        vocab = load_manifest(cfg.data.first_path).vocab_size
        return replace(cfg.model, vocab_size=vocab), f"vocab {vocab} (from {cfg.data.first_path})"
    except DataError:
        note = (f"vocab {GPT2_VOCAB} assumed (GPT-2; no prepared data at {cfg.data.first_path}: "
                "set --model.vocab_size)")
        return replace(cfg.model, vocab_size=GPT2_VOCAB), note


def report(cfg: JobConfig, nproc: int, nnodes: int, gpu_name: str, mfu: float) -> str:
    """The dry-run plan as text: memory per GPU, traffic per step, time, for DDP and FSDP2."""
    try:
        gpu = find_gpu(gpu_name)
    except ValueError as e:
        raise ConfigError(f"--gpu: {e}") from None
    model_cfg, vocab_note = planned_model(cfg)
    world = nproc * nnodes
    bf16 = gpu_dtype(cfg.train.dtype) == torch.bfloat16  # every GPU of the table has bf16
    derived, model = derive(cfg, world), meta_gpt(model_cfg)
    with_ac = cfg.train.activation_checkpointing
    lines = [
        f"plan: {nnodes} node(s) x {nproc} {gpu.label} = {world} GPUs "
        f"({gpu.memory / GiB:.0f} GiB, {gpu.bf16_peak / 1e12:.0f} TFLOP/s dense bf16 each), "
        f"{'bf16' if bf16 else 'fp32'} compute, micro-batch {cfg.train.micro_batch_size} x "
        f"{cfg.data.seq_len} tokens, {derived.grad_accum_steps} accumulation step(s); "
        f"{model.num_params() / 1e6:.1f}M params, {vocab_note}",
        f"{'per GPU':<34}{'DDP':>14}{'FSDP2':>14}",
    ]
    ddp, fsdp = strategies(cfg, model, world, bf16)
    muon = cfg.optim.name == "muon"
    optimizer_label = "Muon+AdamW state (1|2 moments)" if muon else "AdamW state (2 fp32 moments)"
    rows = [
        ("parameters (fp32)", lambda s: s.state.params),
        ("gradients (fp32)", lambda s: s.state.grads),
        (optimizer_label, lambda s: s.state.optimizer),
        ("bf16 weight copies (transient)", lambda s: s.compute_copy),
        ("unsharded grads (accumulation)", lambda s: s.accumulated),
        ("activations / micro-batch", lambda s: s.activations),
        ("  with activation checkpointing", lambda s: s.activations_ac),
        (f"LM-head loss ({planned_loss(cfg, model_cfg)})", lambda s: s.head_loss),
        (f"peak (checkpointing {'on' if with_ac else 'off'})", lambda s: s.peak(with_ac)),
    ]
    lines += [f"{label:<34}{_gib(f(ddp)):>14}{_gib(f(fsdp)):>14}" for label, f in rows]
    usable = USABLE * gpu.memory
    fit = [("fits" if s.peak(with_ac) <= usable else "does NOT fit") for s in (ddp, fsdp)]
    lines.append(f"{f'fits {USABLE:.0%} of {gpu.memory / GiB:.0f} GiB?':<34}{fit[0]:>14}{fit[1]:>14}")
    comm = [("all-gather / step", "all_gather"), ("reduce-scatter / step", "reduce_scatter"),
            ("all-reduce / step", "all_reduce")]
    if muon:  # the owner receives each matrix's (W-1)/W, then sends it back
        comm.append(("Muon gather+scatter (fp32) / step", "muon"))
    lines += [f"{label:<34}{_gib(getattr(ddp, k)):>14}{_gib(getattr(fsdp, k)):>14}"
              for label, k in comm]
    step_s = model.flops_per_token(cfg.data.seq_len) * cfg.train.global_batch_tokens / (world * gpu.bf16_peak * mfu)
    lines.append(
        f"time at {mfu:.0%} MFU: {step_s:.2f} s/step, "
        f"{cfg.train.global_batch_tokens / step_s:,.0f} tokens/s "
        f"({cfg.train.global_batch_tokens / step_s / world:,.0f} per GPU), "
        f"{cfg.train.max_steps:,} steps in {_duration(step_s * cfg.train.max_steps)}"
        + (" (+~1/3 compute with activation checkpointing)" if with_ac else ""))
    return "\n".join(lines)
