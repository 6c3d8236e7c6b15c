"""What the device can do, and the choices that follow: the dtype matmuls compute in (one rule
for training, eval, sampling, the demo and the benches), the peak MFU is relative to, the CUDA
settings every run wants."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from lmforge.pipeline.config import ConfigError
from lmforge.pipeline.metrics import get_logger

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Each workload: its log lines' suffix, and the flag that sets its dtype.
WORKLOADS = {"train": ("", "--train.dtype"), "eval": (" for eval", "--dtype"),
             "sample": (" for sampling", "--dtype")}


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]


def gpu_dtype(requested: str, has_bf16: bool = True) -> torch.dtype:
    """auto on a CUDA GPU (also the planner's, for its table): bf16 exactly with bf16 tensor cores."""
    if requested == "auto":
        return torch.bfloat16 if has_bf16 else torch.float32
    return DTYPES[requested]


def _cpu_native_bf16() -> tuple[bool, str]:
    from lmforge.pipeline.cpu.machine import native_bf16  # the CPU room: only on a CPU

    try:
        return native_bf16()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """What `auto` picks on `device`, and why (no logging, no collectives)."""
    device = torch.device(device)
    if device.type == "cuda":
        has = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
        name = torch.cuda.get_device_name(device)
        return gpu_dtype("auto", has), f"{name} has {'bf16 tensor cores' if has else 'no native bf16'}"
    if device.type == "cpu":
        native, why = _cpu_native_bf16()
        return (torch.bfloat16 if native else torch.float32), why
    return torch.float32, f"no bf16 rule for {device.type}"


def _agree(native: bool) -> bool:
    """All ranks must compute in the same dtype (FSDP's policy, DDP's buckets): bf16 only if
    every rank's CPU has it."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return native
    flag = torch.tensor([int(native)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def resolve_dtype(requested: str, device: torch.device, workload: str = "train") -> torch.dtype:
    """auto|bf16|fp32 -> the dtype `workload`'s (a WORKLOADS key) matmuls compute in on
    `device`, logged in one line. Collective under a CPU process group: every rank calls it."""
    if requested not in ("auto", *DTYPES):
        raise ConfigError(f"dtype must be auto, bf16 or fp32, got {requested!r}")
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {tuple(WORKLOADS)}, got {workload!r}")
    suffix, flag = WORKLOADS[workload]
    device = torch.device(device)
    log = get_logger()
    if requested == "auto":
        dtype, why = auto_dtype(device)
        bf16 = dtype == torch.bfloat16
        if device.type == "cpu" and _agree(bf16) != bf16:
            dtype, why = torch.float32, "another rank's CPU has no native bf16"
        log.info(f"dtype auto -> {dtype_name(dtype)}{suffix}: {why}")
        return dtype
    dtype = DTYPES[requested]
    if dtype == torch.bfloat16 and device.type == "cpu" and not _cpu_native_bf16()[0]:
        log.warning(f"dtype bf16 on a CPU without native bf16: matmuls run ~400x slower than "
                    f"fp32; use {flag} auto (or fp32) to run at full speed")
    else:
        log.info(f"dtype {requested}{suffix}: as configured")
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


def datasheet_peak(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """The datasheet peak FLOP/s MFU is relative to, in the dtype the run computes in, and the
    line that says which. None where there is no datasheet: a CPU's peak is no fixed number."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"MFU n/a on {device.type}: no datasheet peak FLOP/s to measure it against"
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


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """datasheet_peak, logging which peak it is."""
    peak, note = datasheet_peak(device, dtype)
    get_logger().info(note)
    return peak


# ----------------------------------------------------------------------------- CUDA settings


def configure_cuda() -> None:
    # TF32 for fp32 matmuls/convs: ~8x the fp32 rate on Ampere+ at a 10-bit mantissa, which
    # training tolerates (the peak table then reads tf32). The legacy API only: mixing it with
    # torch.backends.*.fp32_precision makes torch refuse to report the precision.
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on `device`; on CUDA from page-locked memory, non-blocking, so the copy
    overlaps compute (DMA). On CPU pinning would only cost memory."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)

