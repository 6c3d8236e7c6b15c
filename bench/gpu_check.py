"""The GPU path in one call (started by bench/gpu_check.sh, which first prints `lmforge env`).

    python -m bench.gpu_check              # on a CUDA machine: 1-GPU step, then >= 2 GPU checks
    python -m bench.gpu_check --cpu-smoke  # the same code path, tiny shapes, CPU/gloo (a test)

1. step: a GPT-2-124M-shaped model (configs/gpt2_124m.toml, 50304-id vocab, synthetic tokens)
   on one GPU in the dtype `auto` picks (bf16 on any bf16 GPU) with torch.compile; prints the
   SDPA kernel the profiler saw (flash / efficient / math), tokens/s, MFU against the GPU's
   dense peak in that dtype and torch.cuda.max_memory_allocated.
2. with >= 2 GPUs: prepared data (builtin:pystdlib, offline), then 1-process, 2-process DDP
   (NCCL) and 2-process FSDP2 runs of the same config must give the same per-step losses within
   PARITY_TOL; then a 2-process run is SIGKILLed and `--resume auto` must match the
   uninterrupted run within RESUME_TOL.
Every stage runs under a timeout; any failure makes the exit status 1. A summary table ends it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench import runs as lu
from bench.common import GPT2_VOCAB, ROOT
from model import GPT
from pipeline.config import load_config
from pipeline.distributed import DistInfo
from pipeline.hardware import configure_cuda, dtype_name, matmul_peak, resolve_dtype
from pipeline.optim import build_optimizer
from pipeline.parallelize import Precision, parallelize
from pipeline.run_dir import RunDir

# bf16 on GPU: 1 process (autocast) vs 2 (other reduction order; FSDP casts the parameters
# themselves) agree to ~1e-3 early on and drift slowly; a real bug is off by far more.
PARITY_TOL = 2e-2
# Resume replays the same data and RNG; only non-deterministic GPU kernels (atomics in
# attention backward) separate it from the uninterrupted run.
RESUME_TOL = 1e-3


def sdpa_kernels(prof) -> str:
    names = {e.key for e in prof.key_averages()}
    found = [kind for kind, needle in (("flash", "flash"), ("efficient", "efficient_attention"),
                                       ("cudnn", "cudnn_attention"), ("math", "_math"))
             if any(needle in n for n in names)]
    return "+".join(found) or "none seen"


def step_check(device: torch.device, smoke: bool) -> dict:
    """Throughput of one training step of the 124M shape (tiny shapes with --cpu-smoke)."""
    cfg = load_config(str(ROOT / "configs" / "gpt2_124m.toml"), [])
    model_cfg = replace(cfg.model, vocab_size=50304)
    B, T, warmup, timed = 16, 1024, 3, 10
    if smoke:
        model_cfg = replace(model_cfg, n_layer=2, d_model=64, n_head=4, n_kv_head=4,
                            max_seq_len=64, vocab_size=512)
        B, T, warmup, timed = 4, 64, 1, 3
    dtype = resolve_dtype("auto", device)
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=device)
    torch.manual_seed(0)
    model = GPT(model_cfg).to(device)
    pm = parallelize(model, info, parallel="none", precision=Precision(dtype, device),
                     compile_model=device.type == "cuda", activation_checkpointing=False)
    opt = build_optimizer(pm.module, cfg.optim, device)
    x_BT = torch.randint(0, model_cfg.vocab_size, (B, T), device=device)
    y_BT = torch.randint(0, model_cfg.vocab_size, (B, T), device=device)

    def step() -> None:
        with pm.autocast():
            loss = pm.loss(x_BT, y_BT)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):  # the first compiles
        step()
    with torch.profiler.profile() as prof:
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(timed):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    tok_s = B * T * timed / (time.perf_counter() - t0)
    peak = matmul_peak(device, dtype)
    mfu = model.flops_per_token(T) * tok_s / peak if peak else None
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    sdpa = sdpa_kernels(prof)
    print(f"step: {model.num_params() / 1e6:.0f}M params, {B}x{T} tokens, {dtype_name(dtype)}, "
          f"compile {device.type == 'cuda'}, SDPA {sdpa}: {tok_s:,.0f} tok/s, MFU "
          f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'}"
          + ("" if mem is None else f", max memory allocated {mem:.1f} GiB"), flush=True)
    ok = "math" not in sdpa and sdpa != "none seen" and (mfu is None or 0 < mfu <= 1)
    return {"ok": ok, "detail": f"{tok_s:,.0f} tok/s, MFU "
            f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, SDPA {sdpa}"}


def prepare_data(work: Path, smoke: bool) -> Path:
    out = work / "data"
    tokenizer = "bpe:512" if smoke else (str(GPT2_VOCAB) if GPT2_VOCAB.is_file() else "bpe:4096")
    docs = "120" if smoke else "3000"
    res = lu.run([sys.executable, "-m", "launch.cli", "prepare", "--source", "builtin:pystdlib",
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
    stages = [("1-device step", lambda: {"1-device step": step_check(device, smoke)})]
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
