"""What the machine the run meets can do, and the choices that follow from it.

- `cpu_bf16`: is bf16 matmul native *and faster than fp32* on this CPU, for a workload's matmul
  shape? A measured probe, cached per process (CPUs without AVX512-BF16/AMX emulate bf16, far
  slower than fp32: bench/results/ has the figures).
  `LMFORGE_CPU_BF16=native|emulated` forces the answer (tests, or a user who knows better).
- `resolve_dtype`: train.dtype auto|bf16|fp32 -> the dtype a workload's (train, eval, sample)
  matmuls really compute in, with one log line saying why (the same rule for training, eval,
  sampling, the demo and the benches).
- `matmul_peak`: the peak FLOP/s MFU is relative to: NVIDIA's datasheet for GPUs, a measured
  large matmul for CPUs, in the dtype the run computes in. `memory_bandwidth`: a measured copy.
- `configure_cuda`, `pin_memory_for`, `to_device`: the CUDA settings every run wants.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.config import ConfigError
from pipeline.metrics import get_logger

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FORCE_ENV = "LMFORGE_CPU_BF16"


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]


# ----------------------------------------------------------------------------- CPU facts


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_capability() -> str:
    """The widest vector ISA torch dispatches to here, plus what bf16 hardware the CPU has."""
    flags = cpu_flags()
    extra = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{capability} ({', '.join(extra)})" if extra else capability


@dataclass(frozen=True)
class CpuBf16:
    native: bool
    """bf16 matmuls are native and faster than fp32: worth computing in."""
    bf16_flops: float | None
    fp32_flops: float | None
    """Measured probe rates (None when forced by LMFORGE_CPU_BF16)."""
    source: str
    """'measured' (+ '; no ... flag') or the forcing variable, for messages."""

    @property
    def evidence(self) -> str:
        if self.bf16_flops is None or self.fp32_flops is None:
            return f"forced by {self.source}"
        what = "decode step" if self.source.startswith("measured decode") else "matmul"
        rates = f"bf16 {what} {_gflops(self.bf16_flops)} GFLOP/s vs fp32 {_gflops(self.fp32_flops)}"
        return rates if "; " not in self.source else f"{self.source.split('; ')[1]}; {rates}"

    @property
    def slowdown(self) -> str:
        if self.bf16_flops and self.fp32_flops:
            return f"{self.fp32_flops / self.bf16_flops:.0f}x slower than fp32"
        return "much slower than fp32"


def _gflops(flops: float) -> str:
    g = flops / 1e9
    return f"{g:.1f}" if g < 10 else f"{g:.0f}"


def _matmul_rate(n: int, dtype: torch.dtype, budget_s: float, min_reps: int = 3) -> float:
    """Best FLOP/s of an n x n x n matmul after one warm-up, over `min_reps` or `budget_s`."""
    a_NN, b_NN = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a_NN @ b_NN  # warm-up: first call pays for allocation and kernel selection
    best, reps, deadline = 0.0, 0, time.perf_counter() + budget_s
    while reps < min_reps or time.perf_counter() < deadline:
        t = time.perf_counter()
        a_NN @ b_NN
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
        reps += 1
        if time.perf_counter() > deadline:
            break
    return best


WORKLOADS = ("train", "eval", "sample")
DTYPE_FLAG = {"train": "--train.dtype", "eval": "--dtype", "sample": "--dtype"}  # where each sets it


def measure_bf16_fp32() -> tuple[float, float]:
    """(bf16, fp32) matmul FLOP/s of one thread on a 256^3 product. 256 is big enough for native
    bf16 kernels (oneDNN AVX512-BF16/AMX) to beat fp32 and small enough that one product stays
    a fraction of a second where bf16 is emulated, so the probe is short. One thread: the
    ratio is the same with more, and a single thread is not stalled by a busy machine's other
    processes the way a team of threads waiting on each other is."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _matmul_rate(256, torch.bfloat16, 0.15, 1), _matmul_rate(256, torch.float32, 0.1)
    finally:
        torch.set_num_threads(threads)


def _decode_rate(bf16: bool, budget_s: float, rows: int = 8, width: int = 512) -> float:
    """Best FLOP/s of a decode step's shape: a few rows (one token per prompt) through four
    fp32 linear layers, under bf16 autocast when `bf16`, as sampling runs them."""
    layers = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(4)))
    x = torch.randn(rows, width)
    flops, best, deadline = 2 * rows * width * width * 4, 0.0, time.perf_counter() + budget_s
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        layers(x)  # warm-up
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            for _ in range(10):
                layers(x)
            best = max(best, 10 * flops / (time.perf_counter() - t))
    return best


def measure_decode_bf16_fp32() -> tuple[float, float]:
    """(bf16, fp32) FLOP/s of one thread on decode-shaped steps (`_decode_rate`), ~0.2 s: where
    autocast's per-op casts and a CPU's small-matrix bf16 kernels cost more than bf16 saves,
    sampling is faster in fp32 although training is faster in bf16."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _decode_rate(True, 0.1), _decode_rate(False, 0.1)
    finally:
        torch.set_num_threads(threads)


# CPU flags (Linux /proc/cpuinfo) that mean bf16 dot products in hardware: x86 AVX512-BF16 and
# AMX, Arm's BF16 extension. Without them oneDNN emulates bf16 with fp32 conversions.
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@functools.cache
def cpu_bf16(decode: bool = False) -> CpuBf16:
    """Cached per process and workload. Native iff the CPU has bf16 instructions (when its flags
    are readable) and the measured bf16 rate beats fp32: on a big product (training, eval) or,
    `decode`, on decode-shaped steps (sampling). The flags
    settle the common case (no AVX512-BF16/AMX: emulated) whatever the load; the measurement,
    orders of magnitude apart between the kinds, checks that hardware bf16 is really faster
    here, for this workload."""
    forced = os.environ.get(FORCE_ENV, "").strip().lower()
    if forced:
        if forced not in ("native", "emulated"):
            raise ConfigError(f"{FORCE_ENV}={forced!r}: use native or emulated, or unset it")
        return CpuBf16(forced == "native", None, None, f"{FORCE_ENV}={forced}")
    flags = cpu_flags()
    has_bf16 = not flags or any(f in flags for f in _BF16_FLAGS)
    bf16, fp32 = measure_decode_bf16_fp32() if decode else measure_bf16_fp32()
    source = "measured decode steps" if decode else "measured"
    return CpuBf16(has_bf16 and bf16 > fp32, bf16, fp32,
                   source if has_bf16 else f"{source}; no avx512_bf16/amx_bf16 flag")


def _agree(native: bool) -> bool:
    """All ranks must compute in the same dtype (FSDP's policy, DDP's buckets): bf16 only if
    every rank's probe says so."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return native
    flag = torch.tensor([int(native)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# ----------------------------------------------------------------------------- dtype


def cuda_bf16(device: torch.device) -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def gpu_dtype(requested: str, has_bf16: bool = True) -> torch.dtype:
    """The rule on a CUDA GPU known only by whether it has bf16 tensor cores (also the
    planner's, for the GPUs of its table): auto = bf16 exactly there."""
    if requested == "auto":
        return torch.bfloat16 if has_bf16 else torch.float32
    return DTYPES[requested]


def auto_dtype(device: torch.device, workload: str = "train") -> tuple[torch.dtype, str]:
    """What `auto` picks on `device` for `workload` (train, eval or sample), and why (no
    logging, no collectives)."""
    device = torch.device(device)
    if device.type == "cuda":
        has = cuda_bf16(device)
        name = torch.cuda.get_device_name(device)
        return gpu_dtype("auto", has), f"{name} has {'bf16 tensor cores' if has else 'no native bf16'}"
    if device.type == "cpu":
        probe = cpu_bf16(decode=workload == "sample")
        if probe.native:
            return torch.bfloat16, f"this CPU computes bf16 natively ({probe.evidence})"
        if workload == "sample" and cpu_bf16().native:
            return torch.float32, f"this CPU decodes faster in fp32 ({probe.evidence})"
        return torch.float32, f"this CPU has no native bf16 ({probe.evidence})"
    return torch.float32, f"no bf16 rule for {device.type}"


def _for(workload: str) -> str:
    return "" if workload == "train" else f" for {'sampling' if workload == 'sample' else workload}"


def resolve_dtype(requested: str, device: torch.device, workload: str = "train") -> torch.dtype:
    """train.dtype (auto|bf16|fp32) -> the dtype `workload`'s (train, eval or sample) matmuls
    compute in on `device`. Logs one line.

    Collective when a CPU process group is initialised (ranks agree on the probe): every rank
    must call it."""
    if requested not in ("auto", *DTYPES):
        raise ConfigError(f"dtype must be auto, bf16 or fp32, got {requested!r}")
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    device = torch.device(device)
    log = get_logger()
    if requested == "auto":
        dtype, why = auto_dtype(device, workload)
        bf16 = dtype == torch.bfloat16
        if device.type == "cpu" and _agree(bf16) != bf16:
            dtype, why = torch.float32, "another rank's CPU has no native bf16"
        log.info(f"dtype auto -> {dtype_name(dtype)}{_for(workload)}: {why}")
        return dtype
    dtype = DTYPES[requested]
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_bf16().native:
        probe = cpu_bf16()
        log.warning(f"dtype bf16 on a CPU without native bf16 ({probe.evidence}): matmuls run "
                    f"~{probe.slowdown}; use {DTYPE_FLAG[workload]} auto (or fp32) to run at full speed")
    else:
        log.info(f"dtype {requested}{_for(workload)}: as configured")
    return dtype


# ----------------------------------------------------------------------------- peak FLOP/s

# Dense (no sparsity) peak FLOP/s from NVIDIA's datasheets; bf16/fp16 tensor cores accumulating
# in fp32 (GeForce cards run those at half their fp16-accumulate rate). Searched in order, so a
# more specific name comes first; \b keeps "A10" from matching "A100" or "A10G".
GPU_PEAKS: list[tuple[str, str, dict[str, float]]] = [
    (r"H200 NVL", "H200 NVL", {"bf16": 835e12, "tf32": 417e12, "fp32": 60e12}),
    (r"H200", "H200 SXM", {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}),
    (r"H100 NVL", "H100 NVL", {"bf16": 835e12, "tf32": 417e12, "fp32": 60e12}),
    (r"H100.*PCIe", "H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    (r"H100", "H100 SXM", {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}),
    (r"A100", "A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    (r"\bA10\b", "A10", {"bf16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    (r"L40S", "L40S", {"bf16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    (r"\bL4\b", "L4", {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    (r"RTX 4090", "RTX 4090", {"bf16": 165e12, "tf32": 82.6e12, "fp32": 82.6e12}),
    (r"RTX 3090", "RTX 3090", {"bf16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12}),
]


def _cuda_peak(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    name = torch.cuda.get_device_name(device)
    if dtype in (torch.bfloat16, torch.float16):
        kind = "bf16"
    else:  # fp32 matmuls run on tensor cores as TF32 unless the precision is "highest"
        kind = "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    for pattern, label, peaks in GPU_PEAKS:
        if re.search(pattern, name):
            return peaks[kind], (f"MFU relative to the {label} dense {kind} peak, "
                                 f"{peaks[kind] / 1e12:.0f} TFLOP/s")
    return None, f"no peak FLOP/s known for '{name}'; MFU is not reported"


# Largest square matmul tried: 4096^3 fp32 is past where a CPU's matmul reaches its peak; sizes
# grow until one product takes longer than _CPU_STEP_S, so the whole measurement stays short
# even where bf16 is emulated (there the small sizes already pass _CPU_STEP_S).
_CPU_SIZES = (256, 512, 1024, 2048, 4096)
_CPU_STEP_S = 0.25


def _cpu_peak(dtype: torch.dtype) -> tuple[float, str]:
    best, biggest = 0.0, _CPU_SIZES[0]
    for n in _CPU_SIZES:
        rate = _matmul_rate(n, dtype, budget_s=0.2, min_reps=2)
        best, biggest = max(best, rate), n
        if 2 * n**3 / rate > _CPU_STEP_S:
            break
    return best, (f"MFU relative to this CPU's measured {dtype_name(dtype)} matmul peak, "
                  f"{_gflops(best)} GFLOP/s (best up to {biggest}^3, "
                  f"{torch.get_num_threads()} threads)")


@functools.cache
def _peak(device_type: str, index: int | None, dtype: torch.dtype,
          precision: str) -> tuple[float | None, str]:
    if device_type == "cuda":
        return _cuda_peak(torch.device("cuda", index), dtype)
    if device_type == "cpu":
        return _cpu_peak(dtype)
    return None, f"no peak FLOP/s known for {device_type}; MFU is not reported"


def matmul_peak(device: torch.device, dtype: torch.dtype, fresh: bool = False) -> float | None:
    """Peak matmul FLOP/s of `device` in `dtype`, the dtype the run really computes in (None if
    unknown). Cached per process (`fresh` measures again); MFU = achieved model FLOP/s / this."""
    device = torch.device(device)
    if fresh:
        _peak.cache_clear()
    return _peak(device.type, device.index, dtype, torch.get_float32_matmul_precision())[0]


def peak_note(device: torch.device, dtype: torch.dtype) -> str:
    """The line that says which peak `matmul_peak` is (or why there is none)."""
    device = torch.device(device)
    return _peak(device.type, device.index, dtype, torch.get_float32_matmul_precision())[1]


# ----------------------------------------------------------------------------- CPU allocator

MMAP_THRESHOLD = 128 * 1024  # glibc's default; fixed, it stops malloc raising it
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # mallopt's parameters (malloc.h)
# "release" (FSDP2): every freed block of MMAP_THRESHOLD or more goes back to the OS at once.
# "keep" (a whole replica per process): every block comes from the heap (no mmap: glibc's
# threshold stops at 32 MiB, which a step's fp32 loss chunk or head gradient reaches), and the
# heap is never trimmed (-1), so a step's buffers come back without page faults, as a GPU's
# caching allocator hands them back. bench/results/ has the faults, step times and peaks.
ALLOCATOR_MODES = {"release": ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD),),
                   "keep": ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))}
_USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_",
                    "MALLOC_TOP_PAD_")


def set_cpu_allocator(mode: str) -> bool:
    """Set glibc malloc's policy for large blocks (ALLOCATOR_MODES) for the rest of the process.

    By default glibc mmaps every block above its threshold (raised towards 32 MiB as big blocks
    are freed, but a block of the size just freed is mmapped again) and unmaps it on free, and
    trims the heap's free top: a training step's tensors (activations, gradients, the loss's
    buffers) are then faulted in afresh every step, a page fault per 4 KiB; "keep" ends that for
    all but the largest, at the price of the RSS staying at its peak. FSDP2's per-block buffers
    (gathered parameters, unsharded gradients, reduce-scatter inputs) are the opposite case: kept
    in the heap they fragment, and a rank's peak RSS grows far past the sharded state the plan
    counts, so "release" gives them back. bench/results/ has the faults,
    step times and peaks of both. Returns whether it was set: not when the user chose with a
    MALLOC_*_ variable, or malloc is not glibc's."""
    if any(k in os.environ for k in _USER_MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in ALLOCATOR_MODES[mode])


def keep_freed_blocks_after_first_step(optimizer: torch.optim.Optimizer) -> None:
    """set_cpu_allocator("keep") once `optimizer` has stepped: by then the run's long-lived
    tensors (the parameters, the optimizer's state, made at its first step) are placed, and the
    heap the later steps reuse holds only what a step frees. Kept from the start, the first
    step's buffers and that state interleave, and the peak RSS grows by the holes."""
    def keep(*_):
        handle.remove()
        if set_cpu_allocator("keep"):
            get_logger().info("CPU: glibc malloc keeps freed blocks for reuse from now on: a "
                              "step's buffers cost no page faults, and the RSS stays at its peak "
                              "(set MALLOC_MMAP_MAX_ to choose another)")

    handle = optimizer.register_step_post_hook(keep)


_BANDWIDTH_BYTES = 64 * 2**20  # well past any cache: what elementwise passes over big tensors see


@functools.cache
def memory_bandwidth(device: torch.device) -> float:
    """Bytes/s one elementwise pass moves on `device` (read + write of a 64 MiB copy, best of
    3 after a warm-up, all torch threads): what bounds the work between the matmuls."""
    device = torch.device(device)
    src = torch.empty(_BANDWIDTH_BYTES // 4, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(4):
        t = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * _BANDWIDTH_BYTES / best


# ----------------------------------------------------------------------------- CUDA settings


def configure_cuda() -> None:
    # TF32 for fp32 matmuls/convs: ~8x the fp32 rate on Ampere+ at a 10-bit mantissa, which
    # training tolerates (the peak table then reads tf32). The legacy API only: mixing it with
    # torch.backends.*.fp32_precision makes torch refuse to report the precision.
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True


def pin_memory_for(device: torch.device) -> bool:
    # Page-locked host buffers let host->GPU copies run asynchronously (DMA); on CPU they
    # would only cost memory.
    return torch.device(device).type == "cuda"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on `device`: pinned + non_blocking on CUDA so the copy overlaps compute."""
    if pin_memory_for(device):
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of `device` for matmuls in `dtype` (None if unknown), logging which peak it
    is; `dtype` must be the one the run computes in."""
    get_logger().info(peak_note(device, dtype))
    return matmul_peak(device, dtype)
