"""The GPU path in one call (started by bench/gpu_check.sh, which first prints `lmforge env`).

    python -m bench.gpu_check              # on a CUDA machine: the 124M step A/B, then >= 2 GPU checks
    python -m bench.gpu_check --cpu-smoke  # the same code path, tiny shapes, CPU/gloo (a test)

1. step: the GPT-2-124M shape (configs/gpt2_124m.toml's model, 50,257-id vocabulary, B 16 x T
   1024, synthetic tokens) on one GPU in the dtype `auto` picks (bf16), compiled, AdamW, one
   configuration after another in this process: lmforge with the whole-logits loss (train.loss
   = full, what auto takes on CUDA) and with the chunked loss, the recipe preset
   (configs/gpt2_124m_modern.toml's model, if present), the bench's nanoGPT-style GPT-2
   reference and HF's LlamaForCausalLM (bench/peers.py). For each: tokens/s (median of timed
   steps), MFU against the GPU's dense bf16 peak, torch.cuda.max_memory_allocated, and the cold
   compile (first step less a steady one); lmforge's SDPA kernel as the profiler saw it. Then
   no pipeline.cpu module may have been imported (the CUDA path never imports the CPU room).
2. with >= 2 GPUs: prepared data (builtin:pystdlib, offline), then 1-process, 2-process DDP
   (NCCL) and 2-process FSDP2 runs of the same config must give the same per-step losses within
   PARITY_TOL; then a 2-process run is SIGKILLed and `--resume auto` must match the
   uninterrupted run within RESUME_TOL.
Every stage runs under a timeout; any failure makes the exit status 1. A summary table ends it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import GPT2_VOCAB, ROOT
from bench.train_bench import Run, training_step
from lmforge.pipeline.checkpoint.run_dir import RunDir
from lmforge.pipeline.hardware import configure_cuda, datasheet_peak, dtype_name, resolve_dtype
from lmforge.pipeline.parallel.materialize import meta_gpt
from tests import harness as lu

# bf16 on GPU: 1 process (autocast) vs 2 (other reduction order; FSDP casts the parameters
# themselves) agree to ~1e-3 early on and drift slowly; a real bug is off by far more.
PARITY_TOL = 2e-2
# Resume replays the same data and RNG; only non-deterministic GPU kernels (atomics in
# attention backward) separate it from the uninterrupted run.
RESUME_TOL = 1e-3
# GPT-2 small: d_mlp 2048 in SwiGLU's 3 matrices = GPT-2's 4d GELU MLP in 2 (the same FLOPs).
SHAPE_124M = dict(vocab=50257, d_model=768, n_layer=12, n_head=12, seq_len=1024, d_mlp=2048,
                  batch=16)
SHAPE_SMOKE = dict(vocab=512, d_model=64, n_layer=2, n_head=4, seq_len=64, d_mlp=172, batch=4)
PRESET = ROOT / "configs" / "gpt2_124m_modern.toml"


def sdpa_kernels(prof) -> str:
    names = {e.key for e in prof.key_averages()}
    found = [kind for kind, needle in (("flash", "flash"), ("efficient", "efficient_attention"),
                                       ("cudnn", "cudnn_attention"), ("math", "_math"))
             if any(needle in n for n in names)]
    return "+".join(found) or "none seen"


def configurations(base: Run) -> dict[str, Run]:
    found = {"lmforge full": replace(base, loss="full"),
             "lmforge chunked": replace(base, loss="chunked")}
    if PRESET.is_file():
        found["preset (modern)"] = replace(base, loss="full", model_toml=str(PRESET))
    return found | {"GPT-2 ref": replace(base, impl="gpt2"), "HF Llama": replace(base, impl="hf")}


def time_steps(r: Run, warmup: int, timed: int) -> dict:
    """One configuration: the first step (cold compile), warm-up, timed steps, peak memory."""
    device = torch.device(r.device)
    cuda = device.type == "cuda"
    torch._dynamo.reset()  # each configuration compiles cold, as a fresh run does
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    step = training_step(r)
    times, losses = [], []
    for _ in range(1 + warmup + timed):
        t0 = time.perf_counter()
        losses.append(float(step()))  # (the step synchronises on CUDA)
        times.append(time.perf_counter() - t0)
    steady = statistics.median(times[1 + warmup:])
    return {"tok_s": r.batch * r.seq_len / steady, "cold_s": times[0] - steady, "steady_s": steady,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            "loss_ok": all(math.isfinite(x) and x > 0 for x in losses), "step": step}


def step_check(device: torch.device, smoke: bool, only: list[str] | None = None) -> dict[str, dict]:
    """The 124M step of every configuration (or those named in `only`; tiny shapes with
    --cpu-smoke), one line each."""
    dtype = resolve_dtype("auto", device)
    # sdpa: what auto picks on CUDA; the smoke checks that path even where a bf16 CPU's auto
    # would pick the eager kernel.
    base = Run("lmforge", compiled=device.type == "cuda", device=str(device), attention="sdpa",
               dtype=dtype_name(dtype), **(SHAPE_SMOKE if smoke else SHAPE_124M))
    warmup, timed = (1, 2) if smoke else (3, 10)
    per_token = meta_gpt(base.model_config()).flops_per_token(base.seq_len)  # lmforge full's
    peak = datasheet_peak(device, dtype)[0]
    results, ref = {}, None
    for name, r in configurations(base).items():
        if only and name not in only:
            continue
        m = time_steps(r, warmup, timed)
        ref = ref or m["tok_s"]
        mfu = per_token * m["tok_s"] / peak if peak else None
        detail = (f"{m['tok_s']:,.0f} tok/s ({m['tok_s'] / ref:.2f}x lmforge full), MFU "
                  f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'}"
                  + (f", cold compile {m['cold_s']:.0f} s" if r.compiled else "")
                  + ("" if m["peak_gib"] is None else f", peak {m['peak_gib']:.1f} GiB"))
        ok = m["loss_ok"] and (mfu is None or 0 < mfu <= 1)
        if name == "lmforge full":
            with torch.profiler.profile() as prof:
                m["step"]()
            sdpa = sdpa_kernels(prof)
            detail += f", SDPA {sdpa}"
            ok = ok and "math" not in sdpa and sdpa != "none seen"
        print(f"step {name}: {detail}", flush=True)
        results[f"step {name}"] = {"ok": ok, "detail": detail}
    return results


def cpu_room_check(device: torch.device) -> dict[str, dict]:
    room = sorted(m for m in sys.modules if m.startswith("lmforge.pipeline.cpu"))
    if device.type != "cuda":
        return {}
    return {"no CPU room": {"ok": not room, "detail": f"pipeline.cpu modules imported: {room}"}}


def prepare_data(work: Path, smoke: bool) -> Path:
    out = work / "data"
    tokenizer = "bpe:512" if smoke else (str(GPT2_VOCAB) if GPT2_VOCAB.is_file() else "bpe:4096")
    docs = "120" if smoke else "3000"
    res = lu.run([sys.executable, "-m", "lmforge.launch.cli", "prepare", "--source", "builtin:pystdlib",
                  "--tokenizer", tokenizer, "--out", str(out), "--max-docs", docs,
                  "--val-docs", "12", "--workers", "4"], timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"prepare exited {res.returncode}\n{res.stdout[-2000:]}")
    return out


def run_args(data: Path, run: Path, smoke: bool, *extra: str) -> list[str]:
    """8 steps of the 124M shape (compile off: a cold compile per run would dominate the check;
    step_check covers compile)."""
    shape = lu.TINY_ARGS if smoke else [
        "--config", str(ROOT / "configs" / "gpt2_124m.toml"), "--train.global_batch_tokens",
        "65536", "--train.micro_batch_size", "8", "--train.compile", "off",
        "--eval.every", "0", "--sample.every", "0", "--log.log_every", "1"]
    # TINY_ARGS pins fp32 for CPU exactness; on GPU the real path is auto (bf16).
    return [*shape, "--data.path", str(data), "--log.out_dir", str(run), "--train.max_steps", "8",
            "--checkpoint.every", "2", "--eval.every", "0", "--train.device",
            "cpu" if smoke else "cuda", *extra]


def multi_gpu_checks(work: Path, smoke: bool, timeout: float,
                     data: Path | None) -> dict[str, dict]:
    data = data or prepare_data(work, smoke)
    results, losses = {}, {}
    for name, nproc, parallel in (("1 process", 1, "none"), ("2-proc DDP", 2, "ddp"),
                                  ("2-proc FSDP2", 2, "fsdp")):
        run = work / parallel
        lu.train(run_args(data, run, smoke, "--train.parallel", parallel), nproc=nproc,
                 timeout=timeout)
        losses[parallel] = lu.losses(run)
        if parallel != "none":
            d = lu.max_diff(losses[parallel], losses["none"])
            results[name] = {"ok": d <= PARITY_TOL,
                             "detail": f"max |loss - 1 process| {d:.2e} (tol {PARITY_TOL:g})"}
    run = work / "resumed"
    proc = lu.start(lu.train_cmd(run_args(data, run, smoke, "--train.parallel", "ddp"), 2))
    try:
        lu.wait_for_step(proc, run, 3, timeout=timeout)
    finally:
        lu.kill_group(proc)
        proc.communicate()
    if RunDir(run).final.exists():
        raise RuntimeError("the run to kill finished first: nothing was resumed")
    lu.train(run_args(data, run, smoke, "--train.parallel", "ddp", "--resume", "auto"), nproc=2,
             timeout=timeout)
    d = lu.max_diff(lu.losses(run), losses["ddp"])
    results["kill + resume"] = {"ok": d <= RESUME_TOL,
                                "detail": f"max |loss - uninterrupted| {d:.2e} (tol {RESUME_TOL:g})"}
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU/gloo (for tests)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per training run")
    p.add_argument("--data", type=Path, help="prepared data to reuse (default: prepare a slice)")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="step configurations to run (e.g. 'lmforge full' 'preset (modern)')")
    args = p.parse_args(argv)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("error: no CUDA device visible to torch (use --cpu-smoke to check the code path)",
              file=sys.stderr)
        return 2
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        configure_cuda()
    results: dict[str, dict] = {}
    stages = [("1-device step", lambda: step_check(device, smoke, args.only) | cpu_room_check(device))]
    if smoke or torch.cuda.device_count() >= 2:
        work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        stages.append(("multi-process", lambda: multi_gpu_checks(work, smoke, args.timeout, args.data)))
    else:
        results["multi-process"] = {"ok": None, "detail": "skipped: fewer than 2 GPUs"}
    for name, stage in stages:
        try:
            results |= stage()
        except Exception as e:  # report every stage, fail at the end
            msg = str(e).strip().splitlines()
            results[name] = {"ok": False, "detail": f"{type(e).__name__}: {msg[0] if msg else ''}"}
            print(f"{name} failed:\n{e}", file=sys.stderr)
    print("\n=== gpu_check summary" + (" (--cpu-smoke)" if smoke else ""))
    for name, r in results.items():
        status = {True: "PASS", False: "FAIL", None: "SKIP"}[r["ok"]]
        print(f"{status:<5} {name:<15} {r['detail']}")
    return 0 if all(r["ok"] is not False for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
