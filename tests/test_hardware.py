"""pipeline.hardware (dtype auto, the bf16 probe, the MFU peak, CUDA settings) and lmforge env.

The probe's answer is forced both ways (LMFORGE_CPU_BF16, or a patched measurement), so the
choice and its messages are checked on any CPU, with or without AVX512-BF16."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from bench.common import ROOT
from bench.runs import TINY_ARGS, metrics
from launch import envinfo
from pipeline import attention, hardware
from pipeline.config import ConfigError
from pipeline.metrics import setup_logging


@pytest.fixture(autouse=True)
def fresh_probe(monkeypatch):
    monkeypatch.delenv(hardware.FORCE_ENV, raising=False)
    hardware.cpu_bf16.cache_clear()
    yield
    hardware.cpu_bf16.cache_clear()


@pytest.fixture
def lines(caplog):
    """The lmforge logger's messages (it does not propagate to the root caplog listens on)."""
    setup_logging(0, None)
    logger = logging.getLogger("lmforge")
    logger.addHandler(caplog.handler)
    yield lambda: [r.getMessage() for r in caplog.records]
    logger.removeHandler(caplog.handler)


def force(monkeypatch, kind: str) -> None:
    monkeypatch.setenv(hardware.FORCE_ENV, kind)
    hardware.cpu_bf16.cache_clear()


def fake_cpu(monkeypatch, flags: set[str], bf16_flops: float, fp32_flops: float) -> None:
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    monkeypatch.setattr(hardware, "measure_bf16_fp32", lambda: (bf16_flops, fp32_flops))


CPU = torch.device("cpu")


@pytest.mark.parametrize("kind,expected", [("native", torch.bfloat16), ("emulated", torch.float32)])
def test_forced_probe_decides_auto(monkeypatch, lines, kind, expected):
    force(monkeypatch, kind)
    assert hardware.resolve_dtype("auto", CPU) == expected
    (line,) = lines()
    assert line.startswith(f"dtype auto -> {hardware.dtype_name(expected)}: ")
    assert f"forced by LMFORGE_CPU_BF16={kind}" in line


def test_measured_emulated_cpu_says_why(monkeypatch, lines):
    fake_cpu(monkeypatch, {"avx2", "fma"}, 0.3e9, 160e9)
    assert hardware.resolve_dtype("auto", CPU) == torch.float32
    assert lines() == ["dtype auto -> fp32: this CPU has no native bf16 (no avx512_bf16/amx_bf16 "
                       "flag; bf16 matmul 0.3 GFLOP/s vs fp32 160)"]


def test_measured_native_cpu_picks_bf16_only_when_faster(monkeypatch, lines):
    fake_cpu(monkeypatch, {"avx512f", "avx512_bf16"}, 260e9, 160e9)
    assert hardware.resolve_dtype("auto", CPU) == torch.bfloat16
    assert "natively (bf16 matmul 260 GFLOP/s vs fp32 160)" in lines()[-1]
    # The flag alone is not enough: bf16 must also be measured faster here.
    hardware.cpu_bf16.cache_clear()
    fake_cpu(monkeypatch, {"avx512f", "avx512_bf16"}, 100e9, 160e9)
    assert hardware.resolve_dtype("auto", CPU) == torch.float32


def test_auto_chooses_per_workload_and_says_so_in_one_line(monkeypatch, lines):
    """Training and eval run big products (bf16 wins on a native CPU); sampling decodes a few
    rows per step, probed apart: where bf16 loses there, sampling runs in fp32."""
    fake_cpu(monkeypatch, {"avx512f", "avx512_bf16"}, 260e9, 160e9)
    monkeypatch.setattr(hardware, "measure_decode_bf16_fp32", lambda: (20e9, 40e9))
    assert hardware.resolve_dtype("auto", CPU, "train") == torch.bfloat16
    assert hardware.resolve_dtype("auto", CPU, "eval") == torch.bfloat16
    assert hardware.resolve_dtype("auto", CPU, "sample") == torch.float32
    train, eval_, sample = lines()
    assert train.startswith("dtype auto -> bf16: ") and eval_.startswith("dtype auto -> bf16 for eval: ")
    assert sample == ("dtype auto -> fp32 for sampling: this CPU decodes faster in fp32 "
                      "(bf16 decode step 20 GFLOP/s vs fp32 40)")
    hardware.cpu_bf16.cache_clear()
    monkeypatch.setattr(hardware, "measure_decode_bf16_fp32", lambda: (60e9, 40e9))
    assert hardware.resolve_dtype("auto", CPU, "sample") == torch.bfloat16
    with pytest.raises(ValueError, match="workload"):
        hardware.resolve_dtype("auto", CPU, "decode")


def test_real_decode_probe_measures_both_dtypes():
    bf16, fp32 = hardware.measure_decode_bf16_fp32()
    assert bf16 > 0 and fp32 > 0


def test_explicit_bf16_on_emulating_cpu_runs_with_one_warning(monkeypatch, lines):
    fake_cpu(monkeypatch, {"avx2"}, 0.3e9, 160e9)
    assert hardware.resolve_dtype("bf16", CPU) == torch.bfloat16
    (line,) = lines()
    assert "without native bf16" in line and "~533x slower than fp32" in line
    assert "--train.dtype auto" in line


def test_explicit_dtypes_need_no_probe(monkeypatch, lines):
    monkeypatch.setattr(hardware, "measure_bf16_fp32", lambda: pytest.fail("probe ran"))
    force(monkeypatch, "native")
    assert hardware.resolve_dtype("bf16", CPU) == torch.bfloat16
    assert hardware.resolve_dtype("fp32", CPU) == torch.float32
    assert lines() == ["dtype bf16: as configured", "dtype fp32: as configured"]


def test_bad_values_are_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="auto, bf16 or fp32"):
        hardware.resolve_dtype("fp16", CPU)
    force(monkeypatch, "maybe")
    with pytest.raises(ConfigError, match="LMFORGE_CPU_BF16"):
        hardware.resolve_dtype("auto", CPU)


def test_real_probe_agrees_with_the_cpu_flags():
    probe = hardware.cpu_bf16()
    assert probe.bf16_flops > 0 and probe.fp32_flops > 0
    if not any(f in hardware.cpu_flags() for f in hardware._BF16_FLAGS):
        assert not probe.native  # e.g. this project's AVX2-only CI machine
    assert hardware.cpu_bf16() is probe  # cached per process


def test_avx2_proxy_runs_as_the_avx2_kind(tmp_path):
    """bench/avx2_proxy.sh: ATen in AVX2, bf16 emulated (so auto = fp32), inductor's own cache."""
    code = ("import os, torch; from pipeline import hardware; "
            "print(torch.backends.cpu.get_cpu_capability(), hardware.cpu_bf16().native, "
            "os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR",
                                                           hardware.FORCE_ENV)}
    out = subprocess.run(["bash", str(ROOT / "bench" / "avx2_proxy.sh"), sys.executable, "-c",
                          code], env={**env, "TMPDIR": str(tmp_path)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    capability, native, cache = out.split()
    assert (capability, native) == ("AVX2", "False")
    assert cache.startswith(str(tmp_path / "torchinductor_avx2_"))


def test_cuda_auto_is_bf16_where_supported(monkeypatch, lines):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    for supported, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda s=supported, **kw: s)
        assert hardware.resolve_dtype("auto", torch.device("cuda", 0)) == expected
    assert lines()[0] == "dtype auto -> bf16: NVIDIA H100 80GB HBM3 has bf16 tensor cores"


# ----------------------------------------------------------------------------- MFU peak


def test_cpu_peak_is_plausible_and_cached():
    peak = hardware.matmul_peak(CPU, torch.float32)
    # The old 512^3 probe in the emulated dtype printed ~1 GFLOP/s: any CPU that runs this
    # suite does several GFLOP/s of fp32 on a large matmul.
    assert peak > 2e9
    assert hardware.matmul_peak(CPU, torch.float32) == peak  # cached, not re-measured
    assert "measured fp32 matmul peak" in hardware.peak_note(CPU, torch.float32)


def test_cpu_peak_fresh_measures_again(monkeypatch):
    rates = iter([10e9, 20e9] * len(hardware._CPU_SIZES))
    monkeypatch.setattr(hardware, "_matmul_rate", lambda n, dtype, **kw: next(rates))
    monkeypatch.setattr(hardware, "_CPU_SIZES", (256,))
    hardware._peak.cache_clear()
    try:
        assert hardware.matmul_peak(CPU, torch.float32) == 10e9
        assert hardware.matmul_peak(CPU, torch.float32) == 10e9
        assert hardware.matmul_peak(CPU, torch.float32, fresh=True) == 20e9
    finally:
        hardware._peak.cache_clear()


@pytest.mark.parametrize("name,dtype,expected", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
    ("NVIDIA H200", torch.bfloat16, 989e12),
    ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5e12),  # default precision "highest": no TF32
    ("NVIDIA A10", torch.bfloat16, 125e12),
    ("NVIDIA A10G", torch.bfloat16, None),
    ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165e12),
    ("Some Future GPU", torch.bfloat16, None),
])
def test_gpu_peak_table(monkeypatch, name, dtype, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    hardware._peak.cache_clear()
    try:
        assert hardware.matmul_peak(torch.device("cuda", 0), dtype) == expected
    finally:
        hardware._peak.cache_clear()


def test_fp32_peak_follows_tf32_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    before = torch.get_float32_matmul_precision()
    try:
        assert hardware.matmul_peak(torch.device("cuda", 0), torch.float32) == 67e12
        hardware.configure_cuda()  # what every CUDA run does: TF32 for fp32 matmuls
        assert hardware.matmul_peak(torch.device("cuda", 0), torch.float32) == 495e12
        assert "dense tf32 peak" in hardware.peak_note(torch.device("cuda", 0), torch.float32)
    finally:
        torch.set_float32_matmul_precision(before)
        hardware._peak.cache_clear()


@pytest.mark.parametrize("kind,expected", [("native", torch.bfloat16), ("emulated", torch.float32)])
def test_training_mfu_uses_the_computed_dtype_and_stays_below_one(
        monkeypatch, tmp_path, tiny_data, kind, expected):
    from launch.train import main
    from pipeline import train

    force(monkeypatch, kind)
    asked = []
    real = train.peak_flops
    monkeypatch.setattr(train, "peak_flops", lambda device, dtype: asked.append(dtype)
                        or real(device, dtype))
    args = [a if a != "fp32" else "auto" for a in TINY_ARGS]  # TINY_ARGS pins fp32
    run = tmp_path / "run"
    assert main([*args, "--data.path", str(tiny_data), "--log.out_dir", str(run),
                 "--train.max_steps", "3", "--eval.every", "0"]) == 0
    assert asked == [expected]
    mfus = [r["mfu"] for r in metrics(run) if "mfu" in r]
    assert len(mfus) == 3 and all(m > 0 for m in mfus), mfus
    # MFU <= 100 % holds where the forced answer is this CPU's real one. Forcing "native" on a CPU
    # that emulates bf16 measures the emulated kernel's peak, which autocast's own kernels can beat.
    real_native = bool(hardware.cpu_flags() & {"avx512_bf16", "amx_bf16"})
    if (kind == "native") == real_native:
        assert all(m <= 1 for m in mfus), mfus
    assert f"dtype={hardware.dtype_name(expected)}" in (run / "train.log").read_text()


# ----------------------------------------------------------------------------- CUDA choices


def test_pinned_copies_only_for_cuda():
    assert hardware.pin_memory_for(torch.device("cuda", 0))
    assert not hardware.pin_memory_for(CPU)
    x = torch.arange(6).view(2, 3)
    assert torch.equal(hardware.to_device(x, CPU), x)


# ----------------------------------------------------------------------------- lmforge env


def test_env_text_and_json(monkeypatch, capsys):
    force(monkeypatch, "emulated")
    assert envinfo.main([]) == 0
    text = capsys.readouterr().out
    assert "auto dtype   fp32 on cpu: this CPU has no native bf16" in text
    for key in ("torch", "cpu isa", "cpu bf16     emulated", "matmul peak  fp32", "distributed",
                "gloo yes", "transformers", "tiktoken", "auto compile on cpu when",
                "auto attention ", "fp32 measured sdpa"):  # the demo's shape, timed in fp32
        assert key in text, key

    force(monkeypatch, "native")
    # Forced native where bf16 may be emulated: its timing would be slow and say nothing.
    monkeypatch.setattr(attention, "measure", lambda *a: {"sdpa": 2e-3, "eager": 1e-3})
    assert envinfo.main(["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["auto"]["attention"]["choice"] == "eager"
    assert "bf16 measured sdpa 2.0 ms, eager 1.0 ms" in info["auto"]["attention"]["why"]
    assert info["torch"]["version"] == torch.__version__
    assert info["auto"]["dtype"] == "bf16" and info["cpu"]["bf16_native"] is True
    assert set(info["auto"]["matmul_peak_gflops"]) == {"bf16", "fp32"}
    assert info["auto"]["matmul_peak_gflops"]["fp32"] > 2
    assert info["distributed"]["gloo"] is True
    assert set(info["packages"]) >= {"transformers", "datasets", "tiktoken", "accelerate", "wandb"}


def test_env_is_a_registered_subcommand():
    from launch.cli import SUBCOMMANDS

    assert SUBCOMMANDS["env"][:2] == ("launch.envinfo", "main")
