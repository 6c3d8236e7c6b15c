"""`lmforge env`: what this machine is and what lmforge will do on it. Run it first when
something is slow or fails, and paste it into bug reports.

    lmforge env            # human-readable
    lmforge env --json     # the same facts for scripts

It states what `auto` picks here (dtype, compile, attention and loss, each a static rule) and
the datasheet matmul peak that MFU is relative to (a GPU's; unknown on a CPU, where training
reports no MFU).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata

import torch
import torch.distributed as dist

from lmforge.launch.cli import ArgumentParser
from lmforge.pipeline import attention, hardware
from lmforge.pipeline.config import ConfigError
from lmforge.pipeline.loss import resolve_loss
from lmforge.pipeline.parallel.parallelize import resolve_compile

# configs/tiny.toml's shape with the demo's 4096-id BPE: what the rules are stated for.
DEMO_VOCAB, DEMO_SEQ_LEN, DEMO_BATCH = 4096, 256, 8
PACKAGES = ("numpy", "transformers", "datasets", "tiktoken", "safetensors", "accelerate", "wandb")


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def torch_build() -> dict:
    if torch.version.cuda:
        build = f"CUDA {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        build = f"ROCm {torch.version.hip}"
    else:
        build = "CPU only"
    return {"version": torch.__version__, "build": build,
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None}


def gpus() -> list[dict]:
    out = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(i)
        out.append({
            "index": i, "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "compute_capability": f"{props.major}.{props.minor}",
            "bf16": props.major >= 8,  # bf16 tensor cores: Ampere (8.0) and later
        })
    return out


def cpu() -> dict:
    from lmforge.pipeline.cpu.machine import cpu_capability, cpu_flags, cpu_model, native_bf16

    flags = cpu_flags()
    try:
        native, why = native_bf16()
    except ValueError as e:  # a bad LMFORGE_CPU_BF16
        raise ConfigError(str(e)) from None
    return {
        "model": cpu_model(), "capability": cpu_capability(),
        "avx2": "avx2" in flags, "avx512": "avx512f" in flags, "amx": "amx_tile" in flags,
        "bf16_native": native, "bf16_evidence": why,
        "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
    }


def auto_choices(device: torch.device) -> dict:
    dtype, why = hardware.auto_dtype(device)
    peaks = {}
    for d in dict.fromkeys([dtype, torch.float32]):  # the auto dtype's peak, and fp32's
        peak = hardware.datasheet_peak(device, d)[0]  # a CPU has none: unknown
        peaks[hardware.dtype_name(d)] = None if peak is None else round(peak / 1e9, 1)
    return {
        "device": str(device),
        "dtype": hardware.dtype_name(dtype), "dtype_why": why,
        "compile": resolve_compile("auto", device),
        "attention": attention.resolve("auto", device, dtype, DEMO_SEQ_LEN),
        "loss": resolve_loss("auto", device, DEMO_VOCAB, DEMO_BATCH * DEMO_SEQ_LEN),
        "matmul_peak_gflops": peaks,
    }


def collect() -> dict:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        hardware.configure_cuda()  # as training runs: the fp32 peak is then TF32's
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch_build(),
        "gpus": gpus(),
        "cpu": cpu(),
        "auto": auto_choices(device),
        "distributed": {name: getattr(dist, f"is_{name}_available")()
                        for name in ("gloo", "nccl", "mpi")},
        "packages": package_versions(),
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def render(info: dict) -> str:
    t, c, a = info["torch"], info["cpu"], info["auto"]
    lines = [
        f"python       {info['python']} ({info['platform']})",
        f"torch        {t['version']} ({t['build']}"
        + (f", cuDNN {t['cudnn']})" if t["cudnn"] else ")"),
    ]
    for g in info["gpus"]:
        lines.append(f"gpu {g['index']:<8} {g['name']}, {g['memory_gib']} GiB, compute "
                     f"capability {g['compute_capability']}, bf16 {_yes(g['bf16'])}")
    if not info["gpus"]:
        lines.append("gpus         none visible to torch")
    lines += [
        f"cpu          {c['model']}, {c['cores']} cores, torch uses {c['torch_threads']} threads",
        f"cpu isa      {c['capability']} (AVX2 {_yes(c['avx2'])}, AVX-512 {_yes(c['avx512'])}, "
        f"AMX {_yes(c['amx'])})",
        f"cpu bf16     {'native' if c['bf16_native'] else 'emulated'} ({c['bf16_evidence']})",
        f"auto dtype   {a['dtype']} on {a['device']}: {a['dtype_why']}",
        f"auto compile {a['compile']} on {a['device']} (on for CUDA, off for CPU)",
        f"auto attention {a['attention']} at the demo's shape (eager only on a CPU in bf16 at "
        f"seq_len <= {attention.EAGER_MAX_T})",
        f"auto loss    {a['loss']} at the demo's shape (full on CUDA, chunked on CPU)",
        "matmul peak  " + ", ".join(
            f"{k} {'unknown' if v is None else f'{v:,.1f} GFLOP/s'}"
            for k, v in a["matmul_peak_gflops"].items()) + f" on {a['device']}",
        "distributed  " + ", ".join(f"{k} {_yes(v)}" for k, v in info["distributed"].items()),
        "packages     " + ", ".join(f"{k} {v}" for k, v in info["packages"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="lmforge env", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = p.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
