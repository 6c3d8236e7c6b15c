"""The attention kernel a run computes with, chosen here and handed to every forward
(`GPT.forward(..., attend=...)`), never set on the model: `train.attention`.

- `sdpa`: F.scaled_dot_product_attention, the model's own default. Flash kernels on CUDA; on CPU
  its flash kernel, which keeps no T x S matrix (memory O(T) per layer).
- `eager`: the scores as one matmul, an additive causal mask, softmax, a second matmul: HF's
  "eager" attention, nanoGPT's path without flash, but causal by blocks of queries, each
  computing only the keys its rows see (about half the T x S scores, as flash kernels skip
  them). It saves those probabilities for backward, but where the CPU flash kernel is slow
  (bf16 on a CPU without AMX, at short sequences) it is much faster: bench/attention_bench.py,
  figures in bench/results/.

`auto` measures, because which wins depends on the CPU kind, the dtype and the shape: on CUDA it
is sdpa (the flash kernels, and the memory they save); on CPU, one layer's forward and backward at
the run's own shape is timed both ways (a fraction of a second; compiled, as a compiled run
computes it, a few seconds more: compile fuses eager's passes over the scores, not SDPA's
kernel), and eager is taken when it is faster by EAGER_MARGIN and its probabilities would not
more than double the activations a micro-batch keeps. Rank 0 measures and every rank takes its
choice; a resumed run keeps the choice it started with (its checkpoint's config), so it
computes as the run it continues.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from model import ModelConfig
from pipeline.distributed import DistInfo, broadcast_from_main
from pipeline.hardware import dtype_name
from pipeline.metrics import get_logger
from pipeline.plan import activation_bytes

log = get_logger()

Attend = Callable[..., torch.Tensor]  # F.scaled_dot_product_attention's signature
EAGER_MARGIN = 1.10
"""How much faster eager must measure to be chosen: it holds more memory, and a tie is noise."""
MEASURE_BUDGET_S = 0.3  # per kernel, after one warm-up call and at least MIN_REPS timed calls
MIN_REPS = 2
QUERY_BLOCK = 128
"""Query rows per block of causal eager attention (causal_blocks): smaller blocks skip more of
the masked scores, in more and smaller matmuls. bench/attention_bench.py times the sizes around
it; bench/results/ has the figures."""


def eager_attention(q_BHTK: torch.Tensor, k_BGSK: torch.Tensor, v_BGSK: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                    enable_gqa: bool = False) -> torch.Tensor:
    """SDPA's result (no dropout, default scale) from two matmuls and a softmax. A boolean
    attn_mask is True where a query may attend; is_causal is SDPA's top-left causal mask, computed
    by query blocks (causal_blocks) that skip the keys no query of theirs sees."""
    H, K = q_BHTK.shape[1], q_BHTK.shape[3]
    G = k_BGSK.shape[1]
    if enable_gqa and G != H:
        k_BGSK = k_BGSK.repeat_interleave(H // G, dim=1)
        v_BGSK = v_BGSK.repeat_interleave(H // G, dim=1)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q_BHTK.dtype,
                                device=q_BHTK.device).masked_fill_(~attn_mask, float("-inf"))
    # The scale on q (T x K values) rather than on the scores (T x S).
    q_BHTK = q_BHTK * K**-0.5
    if not is_causal:
        return _attend(q_BHTK, k_BGSK, v_BGSK, attn_mask)
    T, S = q_BHTK.shape[2], k_BGSK.shape[2]
    bias_TS = torch.ops.lmforge.causal_bias(T, S, q_BHTK.dtype, q_BHTK.device)
    y = [_attend(q_BHTK[:, :, a:b], k_BGSK[:, :, :keys], v_BGSK[:, :, :keys], bias_TS[a:b, :keys])
         for a, b, keys in causal_blocks(T, S)]
    return y[0] if len(y) == 1 else torch.cat(y, dim=2)


def _attend(q_BHTK: torch.Tensor, k_BHSK: torch.Tensor, v_BHSK: torch.Tensor,
            bias_TS: torch.Tensor | None) -> torch.Tensor:
    # In the scores' dtype: CPU softmax computes bf16 in fp32 inside, and CUDA autocast runs it
    # in fp32 anyway.
    return torch.softmax(_BiasedScores.apply(q_BHTK, k_BHSK, bias_TS), dim=-1) @ v_BHSK


def causal_blocks(T: int, S: int) -> list[tuple[int, int, int]]:
    """Causal eager attention's query blocks (first row, end row, keys seen): under SDPA's
    top-left mask no query of rows [a, b) sees a key at or past b, so each block's scores stop
    there. T x S scores become about (1 + QUERY_BLOCK / T) / 2 of them, in fewer, smaller
    matmuls: bench/attention_bench.py times the kernels."""
    return [(a, min(a + QUERY_BLOCK, T), min(a + QUERY_BLOCK, S)) for a in range(0, T, QUERY_BLOCK)]


def eager_scores(T: int, S: int, is_causal: bool = True) -> int:
    """Scores (and probabilities, saved for backward) eager attention computes per batch row
    and head: what its memory and its passes over them scale with."""
    if not is_causal:
        return T * S
    return sum((b - a) * keys for a, b, keys in causal_blocks(T, S))


@torch.library.custom_op("lmforge::causal_bias", mutates_args=())
def _causal_bias(T: int, S: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """SDPA's top-left causal mask as an additive T x S bias (-inf above the diagonal). An op of
    our own, so that compiled, the softmax reads the bias: traced, triu's index compare is folded
    into the softmax's loop as int64 index vectors per vector of scores, which doubled that
    kernel's time (bench/results/step_ab_zen4.txt, step_ab's swap of 2026-12-03)."""
    return torch.full((T, S), float("-inf"), dtype=dtype, device=device).triu(1)


@_causal_bias.register_fake
def _(T, S, dtype, device):
    return torch.empty(T, S, dtype=dtype, device=device)


class _BiasedScores(torch.autograd.Function):
    """q @ kᵀ + bias. Autograd's k gradient of q @ k.transpose(-1, -2) is (qᵀ @ dS)ᵀ, a K x S
    product: compiled RoPE's backward then loads it element by element. Here it is dSᵀ @ q, in
    k's own layout."""

    @staticmethod
    def forward(ctx, q_BHTK, k_BHSK, bias_TS):
        ctx.save_for_backward(q_BHTK, k_BHSK)
        s_BHTS = q_BHTK @ k_BHSK.transpose(-1, -2)
        # In place: the backward needs the inputs, not the scores; an added bias measured faster
        # than masked_fill on CPU.
        return s_BHTS if bias_TS is None else s_BHTS.add_(bias_TS)

    @staticmethod
    def backward(ctx, ds_BHTS):
        # In the dtype autocast gave the forward's matmul (the scores'); autograd casts each
        # gradient back to its input's dtype.
        q_BHTK, k_BHSK = (t.to(ds_BHTS.dtype) for t in ctx.saved_tensors)
        return ds_BHTS @ k_BHSK, ds_BHTS.transpose(-1, -2) @ q_BHTK, None


KERNELS: dict[str, Attend] = {"sdpa": F.scaled_dot_product_attention, "eager": eager_attention}


def kernel(name: str) -> Attend:
    """The attention of a resolved train.attention; `auto` left in an older run's config is
    sdpa, what such a run trained with."""
    return KERNELS.get(name, F.scaled_dot_product_attention)


def measure(m: ModelConfig, batch: int, seq_len: int, dtype: torch.dtype,
            device: torch.device, compiled: bool = False) -> dict[str, float]:
    """Best seconds of one layer's causal attention forward + backward at this shape, by kernel
    (compiled: each by torch.compile, as a compiled run computes it): a warm-up call each, then
    the kernels in turn (so that both see the same machine) for at least MIN_REPS calls each
    and MEASURE_BUDGET_S each."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(batch, heads, seq_len, m.head_dim, generator=gen, device=device,
                           dtype=dtype).requires_grad_()

    q, k, v = rand(m.n_head), rand(m.n_kv_head), rand(m.n_kv_head)
    gqa = m.n_kv_head != m.n_head

    def seconds(attend: Attend) -> float:  # on CPU (choose never measures elsewhere)
        t = time.perf_counter()
        attend(q, k, v, is_causal=True, enable_gqa=gqa).sum().backward()
        return time.perf_counter() - t

    kernels = {name: torch.compile(fn, dynamic=False) if compiled else fn
               for name, fn in KERNELS.items()}
    for fn in kernels.values():
        seconds(fn)  # the first call pays for allocation, kernel selection (and the compile)
    best = dict.fromkeys(kernels, float("inf"))
    reps, deadline = 0, time.perf_counter() + MEASURE_BUDGET_S * len(kernels)
    while reps < MIN_REPS or time.perf_counter() < deadline:
        for name, fn in kernels.items():
            best[name] = min(best[name], seconds(fn))
        reps += 1
    return best


def eager_fits(m: ModelConfig, batch: int, seq_len: int, dtype: torch.dtype) -> bool:
    """Eager's saved probabilities (every layer's B x H x eager_scores) at most the activations
    the model keeps otherwise (pipeline.plan's count)."""
    bf16 = dtype == torch.bfloat16
    probs = m.n_layer * batch * m.n_head * eager_scores(seq_len, seq_len) * (2 if bf16 else 4)
    return probs <= activation_bytes(m, batch, seq_len, bf16, checkpointing=False)


def pick(seconds: dict[str, float]) -> str:
    """eager where it measured faster by EAGER_MARGIN, else sdpa."""
    return "eager" if seconds["eager"] * EAGER_MARGIN <= seconds["sdpa"] else "sdpa"


def choose(m: ModelConfig, batch: int, seq_len: int, dtype: torch.dtype,
           device: torch.device, compiled: bool = False) -> tuple[str, str]:
    """auto's choice on `device` for micro-batches of `batch` x `seq_len` (of a compiled run or
    not), and why."""
    if device.type != "cpu":
        return "sdpa", f"sdpa on {device.type} (its flash kernels)"
    if not eager_fits(m, batch, seq_len, dtype):
        return "sdpa", (f"sdpa: eager's T x T probabilities at T {seq_len} would more than "
                        "double the activations")
    s = measure(m, batch, seq_len, dtype, device, compiled)
    choice = pick(s)
    return choice, (f"{choice}: one layer's forward + backward at batch {batch}, T {seq_len}, "
                    f"{dtype_name(dtype)}{', compiled' if compiled else ''} measured sdpa "
                    f"{1e3 * s['sdpa']:.1f} ms, eager {1e3 * s['eager']:.1f} ms")


def resolve(requested: str, m: ModelConfig, batch: int, seq_len: int, dtype: torch.dtype,
            info: DistInfo, started_with: str | None = None, compiled: bool = False) -> str:
    """train.attention auto|sdpa|eager -> sdpa|eager for this run (compiled or not), with one
    log line saying why when auto decides. started_with: a resumed run's resolved choice."""
    if requested != "auto":
        return requested
    if started_with in KERNELS:
        log.info("train.attention = auto -> %s: the choice this run started with", started_with)
        return started_with
    # Rank 0 alone times (ranks timing at once would share the cores) and every rank takes its
    # choice: timings differ between processes.
    names, index = list(KERNELS), -1
    if info.is_main:
        choice, why = choose(m, batch, seq_len, dtype, info.device, compiled)
        log.info("train.attention = auto -> %s", why)
        index = names.index(choice)
    if info.is_distributed:
        index = int(broadcast_from_main(torch.tensor([index], device=info.device), info).item())
    return names[index]
