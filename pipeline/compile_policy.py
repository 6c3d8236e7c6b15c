"""When train.compile = auto compiles: the one home of the compile policy.

On CUDA always. On CPU when what compile saves over the run repays its cold compiles, judged from
what this machine measures: the matmul peak in the run's dtype (pipeline.hardware.matmul_peak)
and its memory bandwidth (hardware.memory_bandwidth). A step is modelled as a roofline: its
matmul FLOPs at the peak, plus the bytes its elementwise work moves at the bandwidth. Compile
leaves the matmuls as they are and fuses the elementwise work, so it gains where the peak is high
against the bandwidth (native bf16, GPUs) and little where matmuls dominate (fp32 on AVX2).

The pass counts below are design estimates read off the code, not measurements. What a run
measures replaces them: every CPU run writes its steady step time (eager or compiled) and, compiled,
its cold compile (first step minus a steady one) to this machine's ledger, `compile_ledger.json`
in $LMFORGE_CACHE_DIR (default ~/.cache/lmforge), under a key of everything that sets them (torch,
CPU model and ISA, threads, ranks, dtype, parallelism, attention, micro-batch, sequence length, model).
A later auto decision at the same key takes the measured gain where both modes were timed and the
measured cold compile where one compiled, and says which figures it measured. bench/train_bench.py
measures both at its shapes, bench/compile_auto.py the decision before and after the ledger
(results in bench/results/, with the CPU kind).

Rank 0 decides and every rank takes its decision; the decision is written into the run's config
(train.compile on|off), so a resumed run compiles as the run it continues.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from model import GPT, ModelConfig
from pipeline.attention import eager_scores
from pipeline.attention import resolve as resolve_attention
from pipeline.config import TrainConfig
from pipeline.distributed import DistInfo, broadcast_from_main
from pipeline.hardware import cpu_capability, cpu_model, dtype_name, matmul_peak, memory_bandwidth
from pipeline.metrics import get_logger
from pipeline.parallelize import resolve_parallel

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
# Eager attention (train.attention = eager) also passes over each layer's scores, n_head x the
# keys a query sees (causal: about half of S, pipeline.attention.eager_scores) per token: eager,
# the in-place mask and the softmax read and write them (4) and the softmax's backward reads two
# and writes one (3): ~7; fused, mask and softmax are one read and write, their backward ~3: ~5.
# SDPA runs the same kernels compiled or not: no term.
EAGER_VALUES_PER_SCORE, FUSED_VALUES_PER_SCORE = 7, 5
VALUE_BYTES = 4  # elementwise work runs in fp32 also under bf16 autocast (norms, softmax)
# The cold compile of the training graph the rule allows for until this machine has measured one
# at the run's key: a budget the design sets, of the order bench/train_bench.py measures on 2 CPU
# cores (bench/results/).
COLD_COMPILE_ALLOWANCE_S = 20.0
# The cold compiles a run pays, in training graphs: eval's (forward only, no AOT backward),
# compiled after training's, takes about a third of its time (bench/compile_auto.py prints both).
GRAPHS = 4 / 3
# The estimates above are rough: compile only when the run repays the cold compiles twice; where
# the gain and the cold compile are both measured here, once.
MARGIN = 2.0
LEDGER_ENV, LEDGER_FILE, LEDGER_VERSION = "LMFORGE_CACHE_DIR", "compile_ledger.json", 1
MEASURED_STEPS = 8
"""Steps a run times before it first files them in the ledger: the first (the compile) and the
median of the next seven."""


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
    keys_per_query = eager_scores(seq_len, seq_len) / seq_len if attention == "eager" else 0
    scores = cfg.n_layer * cfg.n_head * keys_per_query
    V = cfg.padded_vocab_size

    def elementwise_s(layer_values: float, score_values: float, head_values: float) -> float:
        values = layer_values * per_layer + score_values * scores + head_values * V
        return values * VALUE_BYTES / bandwidth

    return StepModel(model.flops_per_token(seq_len) / peak,
                     elementwise_s(EAGER_VALUES_PER_LAYER_D, EAGER_VALUES_PER_SCORE,
                                   EAGER_VALUES_HEAD_V),
                     elementwise_s(FUSED_VALUES_PER_LAYER_D, FUSED_VALUES_PER_SCORE,
                                   FUSED_VALUES_HEAD_V))


def threshold_s(gain: float, cold_s: float = COLD_COMPILE_ALLOWANCE_S,
                margin: float = MARGIN) -> float:
    """The shortest eager run (seconds) whose compile repays `margin` x the run's cold compiles,
    GRAPHS x cold_s (the training graph's: by default the design's allowance)."""
    saved = 1 - 1 / gain
    return float("inf") if saved <= 0 else margin * GRAPHS * cold_s / saved


def resolve_compile(requested: str, device: torch.device, est_eager_run_s: float | None = None,
                    gain: float | None = None, cold_s: float = COLD_COMPILE_ALLOWANCE_S,
                    margin: float = MARGIN) -> bool:
    """train.compile on|off|auto -> whether to compile. auto: always on CUDA; on CPU when the
    run's estimated eager seconds (None = unknown: no) reach threshold_s(gain, cold_s, margin)."""
    if requested != "auto":
        return requested == "on"
    if torch.device(device).type == "cuda":
        return True
    return (est_eager_run_s is not None and gain is not None
            and est_eager_run_s >= threshold_s(gain, cold_s, margin))


# ------------------------------------------------------------- what this machine has measured


@dataclass(frozen=True)
class Measured:
    """A ledger entry: steady seconds per token (on one rank) eager and compiled, and the cold
    compile of the training graph; None where no run at this key measured it."""

    eager_s: float | None = None
    compiled_s: float | None = None
    cold_compile_s: float | None = None

    @property
    def gain(self) -> float | None:
        """Compiled step rate / eager step rate, where both were timed."""
        return self.eager_s / self.compiled_s if self.eager_s and self.compiled_s else None


def ledger_path() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmforge"
    return Path(os.environ.get(LEDGER_ENV) or cache) / LEDGER_FILE


def run_key(m: ModelConfig, t: TrainConfig, seq_len: int, dtype: torch.dtype,
            info: DistInfo) -> dict:
    """Everything a step's time and its compile depend on, as the ledger files it."""
    # The model name alone can be one for several kinds ("AMD EPYC"): the ISA tells them apart.
    return {"torch": torch.__version__, "cpu": cpu_model(), "isa": cpu_capability(),
            "threads": torch.get_num_threads(),
            "ranks": info.world_size, "dtype": dtype_name(dtype), "attention": t.attention,
            "parallel": resolve_parallel(t.parallel, info), "micro_batch": t.micro_batch_size,
            "checkpointing": t.activation_checkpointing, "seq_len": seq_len, "model": m.to_dict()}


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _entries() -> dict:
    path = ledger_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("compile ledger %s unreadable (%s): ignored; delete it to start afresh", path, e)
        return {}
    if not (isinstance(data, dict) and data.get("version") == LEDGER_VERSION
            and isinstance(data.get("runs"), dict)):
        log.warning("compile ledger %s is not a version-%d ledger: ignored", path, LEDGER_VERSION)
        return {}
    return data["runs"]


def ledger_size() -> int:
    """Run keys this machine's ledger holds measurements for."""
    return len(_entries())


def measured(key: dict) -> Measured:
    """What runs at `key` measured on this machine (nothing where the ledger has no entry)."""
    entry = _entries().get(_digest(key))
    entry = entry if isinstance(entry, dict) else {}

    def seconds(name: str, positive: bool = True) -> float | None:  # a hand-edited entry: ignored
        v = entry.get(name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v < float("inf"):
            return None
        return float(v) if (v > 0 if positive else v >= 0) else None

    return Measured(seconds("eager_s"), seconds("compiled_s"),
                    seconds("cold_compile_s", positive=False))


def record(key: dict, **figures: float) -> None:
    """Merge `figures` into the ledger entry at `key`: a replaced file (a reader never sees half
    of one); a ledger that cannot be written is only a warning."""
    path, runs = ledger_path(), _entries()
    old = runs.get(_digest(key))
    runs[_digest(key)] = {**(old if isinstance(old, dict) else {}), **figures, "key": key,
                          "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{LEDGER_FILE}.")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": LEDGER_VERSION, "runs": runs}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("compile ledger %s not written (%s): train.compile = auto keeps estimating; "
                    "set %s to a writable directory", path, e, LEDGER_ENV)


class StepMeter:
    """Times a CPU run's steps into the ledger (rank 0's): the median steady step per token in
    the run's mode and, compiled, the first step's excess over it (the cold compile); filed once
    MEASURED_STEPS are timed (a run killed later still leaves them) and again, from every step,
    at the run's end."""

    def __init__(self, key: dict, compiled: bool, tokens_per_step: float):
        self.key, self.compiled, self.tokens = key, compiled, tokens_per_step
        self.seconds: list[float] = []

    def step_done(self, step_s: float) -> None:
        self.seconds.append(step_s)
        if len(self.seconds) == MEASURED_STEPS:
            self._file()

    def finish(self) -> None:
        if len(self.seconds) > MEASURED_STEPS:
            self._file()

    def _file(self) -> None:
        steady = statistics.median(self.seconds[1:])
        if self.compiled:
            record(self.key, compiled_s=steady / self.tokens,
                   cold_compile_s=max(0.0, self.seconds[0] - steady))
        else:
            record(self.key, eager_s=steady / self.tokens)


# ------------------------------------------------------------------------------ the decision


@dataclass(frozen=True)
class Estimate:
    """An auto decision's figures on CPU, each from the ledger where it has one."""

    eager_run_s: float
    gain: float
    cold_s: float  # training graph's
    steps: StepModel  # the roofline, for what the ledger lacks
    seen: Measured

    @property
    def margin(self) -> float:
        measured_all = self.seen.gain is not None and self.seen.cold_compile_s is not None
        return 1.0 if measured_all else MARGIN

    @property
    def threshold_s(self) -> float:
        return threshold_s(self.gain, self.cold_s, self.margin)

    @property
    def on(self) -> bool:
        return resolve_compile("auto", torch.device("cpu"), self.eager_run_s, self.gain,
                               self.cold_s, self.margin)

    def why(self) -> str:
        s, roof = self.seen, self.steps
        step = "its step measured here" if s.eager_s else "a roofline estimate"
        gain = ("measured here" if s.gain is not None else
                f"estimated: matmuls {100 * roof.matmul_s / roof.eager_s:.0f} % of an eager step")
        cold = "measured here" if s.cold_compile_s is not None else "the design's allowance"
        run_s = f"{self.eager_run_s:.{0 if self.eager_run_s >= 10 else 1}f}"
        return (f"eager run {run_s} s ({step}), compiled {self.gain:.2f}x faster "
                f"({gain}), cold compile {self.cold_s:.0f} s for training's graph ({cold}) and a "
                f"third of it for eval's: compile pays from {self.threshold_s:.0f} s")


def estimate(model: GPT, train_cfg: TrainConfig, seq_len: int, dtype: torch.dtype,
             info: DistInfo, seen: Measured = Measured()) -> Estimate | None:
    """The figures train.compile = auto weighs for this run on this CPU (the eager run capped by
    train.time_budget_s); None off CPU or without a peak."""
    if info.device.type != "cpu":
        return None
    peak = matmul_peak(info.device, dtype)
    if not peak:
        return None
    steps = step_model(model, seq_len, peak, memory_bandwidth(info.device), train_cfg.attention)
    tokens = train_cfg.global_batch_tokens * train_cfg.max_steps / info.world_size
    eager_s = tokens * (seen.eager_s or steps.eager_s)
    if train_cfg.time_budget_s:
        eager_s = min(eager_s, train_cfg.time_budget_s)
    gain = steps.gain if seen.gain is None else seen.gain
    cold = COLD_COMPILE_ALLOWANCE_S if seen.cold_compile_s is None else seen.cold_compile_s
    return Estimate(eager_s, gain, cold, steps, seen)


def decide(model: GPT, train_cfg: TrainConfig, seq_len: int, dtype: torch.dtype,
           info: DistInfo, started_with: str | None = None) -> bool:
    """train.compile for this run: on|off as set; auto resolved by rank 0 (with one log line
    saying why on CPU) and taken by every rank, or kept from the run it resumes (started_with:
    that run's resolved train.compile). train_cfg.attention: resolved."""
    if train_cfg.compile != "auto":
        return train_cfg.compile == "on"
    if started_with in ("on", "off"):
        log.info("train.compile = auto -> %s: the choice this run started with", started_with)
        return started_with == "on"
    on = torch.zeros(1, dtype=torch.int32, device=info.device)
    if info.is_main:
        key = run_key(model.cfg, train_cfg, seq_len, dtype, info)
        est = estimate(model, train_cfg, seq_len, dtype, info, measured(key))
        on[0] = resolve_compile("auto", info.device) if est is None else est.on
        if est is not None:
            log.info("train.compile = auto -> %s on CPU: %s", "on" if on else "off", est.why())
    return bool(broadcast_from_main(on, info).item())


def meter(model: GPT, train_cfg: TrainConfig, seq_len: int, dtype: torch.dtype,
          info: DistInfo) -> StepMeter | None:
    """The ledger's step timer for this run: rank 0 of a CPU run (train_cfg: resolved)."""
    if not info.is_main or info.device.type != "cpu":
        return None
    return StepMeter(run_key(model.cfg, train_cfg, seq_len, dtype, info),
                     train_cfg.compile == "on", train_cfg.global_batch_tokens / info.world_size)


def resolve_choices(model: GPT, t: TrainConfig, seq_len: int, dtype: torch.dtype,
                    info: DistInfo, started: TrainConfig | None = None) -> TrainConfig:
    """t with train.attention and train.compile resolved, a resumed run's (started) kept: the
    attention timed as the run computes it (compiled or not), then the compile decision, which
    weighs it. Both auto: the attention is timed eager for the decision and, compile on, again
    compiled."""
    known = t.compile if t.compile != "auto" else started and started.compile  # None: undecided
    attend = partial(resolve_attention, t.attention, model.cfg, t.micro_batch_size, seq_len,
                     dtype, info, started and started.attention)
    t = replace(t, attention=attend(compiled=known == "on"))
    on = decide(model, t, seq_len, dtype, info, started_with=started and started.compile)
    if on and known is None:
        t = replace(t, attention=attend(compiled=True))
    return replace(t, compile="on" if on else "off")
