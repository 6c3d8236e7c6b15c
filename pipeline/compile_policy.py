"""When train.compile = auto compiles: the one home of the compile policy.

On CUDA always. On CPU when what compile saves over the run repays its cold compiles, judged from
what this machine measures: the matmul peak in the run's dtype (pipeline.hardware.matmul_peak)
and its memory bandwidth (hardware.memory_bandwidth). A step is modelled as a roofline: its
matmul FLOPs at the peak, plus the bytes its elementwise work moves at the bandwidth. Compile
leaves the matmuls as they are and fuses the elementwise work, so it gains where the peak is high
against the bandwidth (native bf16, GPUs) and little where matmuls dominate (fp32 on AVX2).

The pass counts below are design estimates read off the code, not measurements; what a machine
really gains and what its cold compile costs is measured by bench/train_bench.py (results in
bench/results/, with the CPU kind).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model import GPT
from pipeline.config import TrainConfig
from pipeline.distributed import DistInfo
from pipeline.hardware import matmul_peak, memory_bandwidth
from pipeline.metrics import get_logger

log = get_logger()

# Elementwise values read + written per token and step (forward + backward) outside the matmuls,
# per layer in units of d_model. Eager: each RMSNorm ~6 passes, RoPE ~5 over q and k (2D), the
# SwiGLU ~5 over its 2.7D, residual adds 3, attention's head transposes ~2: ~45D forward, about
# twice that backward. Compiled, inductor fuses each such run of ops into one read and one write.
EAGER_VALUES_PER_LAYER_D, FUSED_VALUES_PER_LAYER_D = 130, 40
# The same for the LM-head loss, in units of the (padded) vocabulary: eager, the chunk's logits
# are written, masked, log-softmaxed (3 passes), exponentiated in place and cast: ~9; fused, the
# matmul's output is read twice and the gradient written once: ~4 (ChunkedLoss / FusedLoss).
EAGER_VALUES_HEAD_V, FUSED_VALUES_HEAD_V = 9, 4
# Eager attention (train.attention = eager) also passes over each layer's T x S scores, n_head x S
# values per token: eager, the in-place mask and the softmax read and write them (4) and the
# softmax's backward reads two and writes one (3): ~7; fused, mask and softmax are one read and
# write, their backward ~3: ~5. SDPA runs the same kernels compiled or not: no term.
EAGER_VALUES_PER_SCORE, FUSED_VALUES_PER_SCORE = 7, 5
VALUE_BYTES = 4  # elementwise work runs in fp32 also under bf16 autocast (norms, softmax)
# The cold compile the rule allows for, per graph (training's and eval's): a budget the design
# sets, of the order bench/train_bench.py measures on 2 CPU cores (bench/results/).
COLD_COMPILE_ALLOWANCE_S = 20.0
GRAPHS = 2
# The estimates above are rough: compile only when the run repays the allowance twice.
MARGIN = 2.0


@dataclass(frozen=True)
class StepModel:
    """A training step as a roofline on this machine: seconds per token, eager and compiled."""

    matmul_s: float
    eager_elementwise_s: float
    fused_elementwise_s: float

    @property
    def eager_s(self) -> float:
        return self.matmul_s + self.eager_elementwise_s

    @property
    def gain(self) -> float:
        """Compiled step rate / eager step rate."""
        return self.eager_s / (self.matmul_s + self.fused_elementwise_s)


def step_model(model: GPT, seq_len: int, peak: float, bandwidth: float,
               attention: str = "sdpa") -> StepModel:
    """The roofline of a training step of `model` at seq_len, computing attention with
    `attention` (train.attention, resolved: sdpa or eager)."""
    cfg = model.cfg
    per_layer = cfg.n_layer * cfg.d_model
    scores = cfg.n_layer * cfg.n_head * seq_len if attention == "eager" else 0
    V = cfg.padded_vocab_size

    def elementwise_s(layer_values: float, score_values: float, head_values: float) -> float:
        values = layer_values * per_layer + score_values * scores + head_values * V
        return values * VALUE_BYTES / bandwidth

    return StepModel(model.flops_per_token(seq_len) / peak,
                     elementwise_s(EAGER_VALUES_PER_LAYER_D, EAGER_VALUES_PER_SCORE,
                                   EAGER_VALUES_HEAD_V),
                     elementwise_s(FUSED_VALUES_PER_LAYER_D, FUSED_VALUES_PER_SCORE,
                                   FUSED_VALUES_HEAD_V))


def threshold_s(gain: float) -> float:
    """The shortest eager run (seconds) whose compile repays MARGIN x the allowed cold compiles."""
    saved = 1 - 1 / gain
    return float("inf") if saved <= 0 else MARGIN * GRAPHS * COLD_COMPILE_ALLOWANCE_S / saved


def resolve_compile(requested: str, device: torch.device, est_eager_run_s: float | None = None,
                    gain: float | None = None) -> bool:
    """train.compile on|off|auto -> whether to compile. auto: always on CUDA; on CPU when the
    run's estimated eager seconds (None = unknown: no) reach threshold_s(gain)."""
    if requested != "auto":
        return requested == "on"
    if torch.device(device).type == "cuda":
        return True
    return est_eager_run_s is not None and gain is not None and est_eager_run_s >= threshold_s(gain)


def estimate(model: GPT, train_cfg: TrainConfig, seq_len: int, dtype: torch.dtype,
             info: DistInfo) -> tuple[float, StepModel] | None:
    """(seconds the run's steps would take eagerly, capped by train.time_budget_s; the step
    model) on this CPU; None off CPU or without a peak."""
    if info.device.type != "cpu":
        return None
    peak = matmul_peak(info.device, dtype)
    if not peak:
        return None
    steps = step_model(model, seq_len, peak, memory_bandwidth(info.device), train_cfg.attention)
    tokens = train_cfg.global_batch_tokens * train_cfg.max_steps / info.world_size
    eager_s = tokens * steps.eager_s
    return (min(eager_s, train_cfg.time_budget_s) if train_cfg.time_budget_s else eager_s), steps


def decide(model: GPT, train_cfg: TrainConfig, seq_len: int, dtype: torch.dtype,
           info: DistInfo) -> bool:
    """train.compile for this run, with one log line saying why when auto decides on CPU."""
    est = estimate(model, train_cfg, seq_len, dtype, info) if train_cfg.compile == "auto" else None
    if est is None:
        return resolve_compile(train_cfg.compile, info.device)
    eager_s, steps = est
    on = resolve_compile("auto", info.device, eager_s, steps.gain)
    log.info("train.compile = auto -> %s on CPU: estimated eager run %.0f s, compiled %.2fx "
             "faster (matmuls %.0f %% of an eager step), so compile pays from %.0f s",
             "on" if on else "off", eager_s, steps.gain, 100 * steps.matmul_s / steps.eager_s,
             threshold_s(steps.gain))
    return on
