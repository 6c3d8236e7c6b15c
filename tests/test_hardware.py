"""pipeline.hardware (dtype auto by pipeline.cpu.machine's flag rule, the MFU peak, CUDA
settings) and lmforge env.

The CPU's flags are faked (or the answer forced with LMFORGE_CPU_BF16), so the choice and its
messages are checked on any CPU, with or without AVX512-BF16."""

from __future__ import annotations

import json
import logging
import platform

import pytest
import torch

from lmforge.launch import envinfo
from lmforge.pipeline import hardware
from lmforge.pipeline.config import ConfigError
from lmforge.pipeline.cpu import machine
from lmforge.pipeline.metrics import setup_logging
from tests.errors import cli_error
from tests.harness import TINY_ARGS, metrics


@pytest.fixture(autouse=True)
def unforced(monkeypatch):
    monkeypatch.delenv(machine.FORCE_ENV, raising=False)


@pytest.fixture
def lines(caplog):
    """The lmforge logger's messages (it does not propagate to the root caplog listens on)."""
    setup_logging(0, None)
    logger = logging.getLogger("lmforge")
    logger.addHandler(caplog.handler)
    yield lambda: [r.getMessage() for r in caplog.records]
    logger.removeHandler(caplog.handler)


def force(monkeypatch, kind: str) -> None:
    monkeypatch.setenv(machine.FORCE_ENV, kind)


def fake_flags(monkeypatch, *flags: str) -> None:
    monkeypatch.setattr(machine, "cpu_flags", lambda: set(flags))


CPU = torch.device("cpu")
EMULATED = "this CPU has no native bf16 (no avx512_bf16/amx_bf16 flag: bf16 is emulated)"


@pytest.mark.parametrize("flags, expected, why", [
    (("avx2", "fma"), torch.float32, EMULATED),
    (("avx2", "avx512f"), torch.float32, EMULATED),  # AVX-512 without its BF16 extension
    (("avx512f", "avx512_bf16"), torch.bfloat16, "natively (avx512_bf16)"),
    (("avx512f", "amx_tile", "amx_bf16"), torch.bfloat16, "natively (amx_bf16)"),
    (("asimd", "bf16"), torch.bfloat16, "natively (bf16)"),  # Arm's BF16 extension
])
def test_auto_follows_the_cpu_flags_and_says_why_in_one_line(monkeypatch, lines, flags, expected,
                                                             why):
    fake_flags(monkeypatch, *flags)
    assert hardware.resolve_dtype("auto", CPU) == expected
    (line,) = lines()
    assert line.startswith(f"dtype auto -> {hardware.dtype_name(expected)}: ") and why in line


@pytest.mark.parametrize("kind, flags, expected", [
    ("native", ("avx2",), torch.bfloat16),
    ("emulated", ("avx512f", "avx512_bf16"), torch.float32),
    (" Native ", ("avx2",), torch.bfloat16),  # as typed: case and spaces do not matter
])
def test_the_env_variable_forces_the_answer_against_the_flags(monkeypatch, lines, kind, flags,
                                                              expected):
    fake_flags(monkeypatch, *flags)
    force(monkeypatch, kind)
    assert hardware.resolve_dtype("auto", CPU) == expected
    (line,) = lines()
    assert line == (f"dtype auto -> {hardware.dtype_name(expected)}: forced by "
                    f"LMFORGE_CPU_BF16={kind.strip().lower()}")


def test_auto_says_which_workload_it_chose_for(monkeypatch, lines):
    fake_flags(monkeypatch, "avx512_bf16")
    assert hardware.resolve_dtype("auto", CPU, "train") == torch.bfloat16
    assert hardware.resolve_dtype("auto", CPU, "eval") == torch.bfloat16
    assert hardware.resolve_dtype("auto", CPU, "sample") == torch.bfloat16
    train, eval_, sample = lines()
    assert train.startswith("dtype auto -> bf16: ")
    assert eval_.startswith("dtype auto -> bf16 for eval: ")
    assert sample.startswith("dtype auto -> bf16 for sampling: ")
    with pytest.raises(ValueError, match="workload"):
        hardware.resolve_dtype("auto", CPU, "decode")


@pytest.mark.parametrize("workload, flag", [("train", "--train.dtype auto"),
                                            ("sample", "--dtype auto")])
def test_explicit_bf16_on_emulating_cpu_runs_with_one_warning(monkeypatch, lines, workload, flag):
    fake_flags(monkeypatch, "avx2")
    assert hardware.resolve_dtype("bf16", CPU, workload) == torch.bfloat16
    (line,) = lines()
    assert "without native bf16" in line and "~400x slower than fp32" in line and flag in line


def test_explicit_dtypes_on_a_native_cpu_are_taken_as_configured(monkeypatch, lines):
    fake_flags(monkeypatch, "avx512_bf16")
    assert hardware.resolve_dtype("bf16", CPU) == torch.bfloat16
    assert hardware.resolve_dtype("fp32", CPU) == torch.float32
    assert lines() == ["dtype bf16: as configured", "dtype fp32: as configured"]


def test_bad_values_are_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="auto, bf16 or fp32"):
        hardware.resolve_dtype("fp16", CPU)
    force(monkeypatch, "maybe")
    for requested in ("auto", "bf16"):  # explicit bf16 also asks the CPU (for its warning)
        with pytest.raises(ConfigError, match="LMFORGE_CPU_BF16='maybe': use native or emulated"):
            hardware.resolve_dtype(requested, CPU)


def test_the_real_flags_decide_on_this_cpu(lines):
    if platform.machine() in ("x86_64", "AMD64"):
        assert "sse2" in machine.cpu_flags()  # /proc/cpuinfo was read, not an empty set
    native = bool(machine.cpu_flags() & set(machine.BF16_FLAGS))
    expected = torch.bfloat16 if native else torch.float32  # fp32 on this project's AVX2 kind
    assert hardware.resolve_dtype("auto", CPU) == expected
    assert "forced" not in lines()[0]


def test_cuda_auto_is_bf16_where_supported(monkeypatch, lines):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    for supported, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda s=supported, **kw: s)
        assert hardware.resolve_dtype("auto", torch.device("cuda", 0)) == expected
    assert lines()[0] == "dtype auto -> bf16: NVIDIA H100 80GB HBM3 has bf16 tensor cores"


# ----------------------------------------------------------------------------- MFU peak


def test_cpu_has_no_peak_so_no_mfu(lines):
    assert hardware.peak_flops(CPU, torch.float32) is None
    assert lines() == ["MFU n/a on cpu: no datasheet peak FLOP/s to measure it against"]


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
    assert hardware.datasheet_peak(torch.device("cuda", 0), dtype)[0] == expected


def test_fp32_peak_follows_tf32_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    before = torch.get_float32_matmul_precision()
    try:
        assert hardware.datasheet_peak(torch.device("cuda", 0), torch.float32)[0] == 67e12
        hardware.configure_cuda()  # what every CUDA run does: TF32 for fp32 matmuls
        peak, note = hardware.datasheet_peak(torch.device("cuda", 0), torch.float32)
        assert peak == 495e12 and "dense tf32 peak" in note
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("kind,expected", [("native", torch.bfloat16), ("emulated", torch.float32)])
def test_training_asks_the_peak_of_the_computed_dtype_and_has_no_cpu_mfu(
        monkeypatch, tmp_path, tiny_data, kind, expected):
    from lmforge.launch.train import main
    from lmforge.pipeline import train

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
    assert mfus == [None] * 3, mfus  # null in metrics.jsonl: a CPU has no datasheet peak
    log = (run / "train.log").read_text()
    assert f"dtype={hardware.dtype_name(expected)}" in log and "MFU n/a" in log


# ----------------------------------------------------------------------------- CUDA choices


def test_pinned_copies_only_for_cuda(monkeypatch):
    x = torch.arange(6).view(2, 3)
    assert torch.equal(hardware.to_device(x, CPU), x)
    pinned, copies = [], []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or t)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **kw: copies.append((a, kw)) or t)
    hardware.to_device(x, CPU)
    assert not pinned and copies == [((CPU,), {})]
    cuda = torch.device("cuda", 0)
    hardware.to_device(x, cuda)
    assert len(pinned) == 1 and copies[1] == ((cuda,), {"non_blocking": True})


# ----------------------------------------------------------------------------- lmforge env


def test_env_text_and_json(monkeypatch, capsys):
    fake_flags(monkeypatch, "avx2", "fma")
    assert envinfo.main([]) == 0
    text = capsys.readouterr().out
    for key in ("torch", "cpu isa", f"cpu bf16     emulated ({EMULATED})",
                f"auto dtype   fp32 on cpu: {EMULATED}",
                "auto compile off on cpu (on for CUDA, off for CPU)",
                "auto attention sdpa at the demo's shape", "auto loss    chunked at the demo's",
                "matmul peak  fp32 unknown on cpu", "distributed", "gloo yes", "transformers", "tiktoken"):
        assert key in text, key

    force(monkeypatch, "native")
    assert envinfo.main(["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"]["version"] == torch.__version__
    assert info["cpu"]["bf16_native"] is True
    assert info["cpu"]["bf16_evidence"] == "forced by LMFORGE_CPU_BF16=native"
    assert {k: info["auto"][k] for k in ("device", "dtype", "compile", "attention", "loss")} == {
        "device": "cpu", "dtype": "bf16", "compile": "off",
        "attention": "eager",  # bf16 on a CPU at the demo's 256 tokens
        "loss": "chunked"}
    assert info["auto"]["matmul_peak_gflops"] == {"bf16": None, "fp32": None}  # no datasheet
    assert info["distributed"]["gloo"] is True
    assert set(info["packages"]) >= {"transformers", "datasets", "tiktoken", "accelerate", "wandb"}


def test_env_with_a_bad_forcing_value_is_one_error_line(monkeypatch, capsys):
    force(monkeypatch, "maybe")
    cli_error(capsys, ["env"], "LMFORGE_CPU_BF16", "native or emulated")


def test_env_is_a_registered_subcommand():
    from lmforge.launch.cli import SUBCOMMANDS

    assert SUBCOMMANDS["env"][:2] == ("lmforge.launch.envinfo", "main")
