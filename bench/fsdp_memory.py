"""Peak memory per rank under FSDP2 on CPU (gloo), measured next to the --dry-run planner's figure.

    python -m bench.fsdp_memory                      # 1 process, FSDP2 on 2 and 4 ranks
    python -m bench.fsdp_memory --ranks 2 --old-init # also the full model built before sharding
    python -m bench.fsdp_memory --steps 2 --d-model 128 --n-layer 2   # a quick look

Each configuration is a fresh torchrun (or one plain process) running the trainer's own build
chain and training step (pipeline.train.Trainer.train_step, AdamW, fp32) on random tokens
written as a prepared dataset. Each rank reports its RSS (from /proc/self/status) after start-up
(python + torch + the process group), after the trainer is built, after the first step (the
optimizer state exists), and its peak (VmHWM) after all steps. The planner's figure
(pipeline.parallel.plan.strategies: sharded states + gathered parameters + activations + the loss) is
compared with peak minus start-up, the memory the run itself added.

--old-init builds the whole model on every rank before sharding it, as lmforge did before
pipeline/parallel/materialize.py, to show what that cost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, add_model_args, emit, header

MB = 2**20


def rss_mb(key: str = "VmRSS:") -> float:
    """This process's memory now (VmRSS) or at its peak (VmHWM); on CUDA (--device cuda) the
    allocator's memory_allocated / max_memory_allocated instead."""
    import torch

    if torch.cuda.is_initialized():
        peak = key == "VmHWM:"
        return (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) / MB
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    raise RuntimeError(key)


def job_args(a: argparse.Namespace, data: Path, out: Path, world: int) -> list[str]:
    parallel = "fsdp" if world > 1 else "none"
    return [
        f"data.path={data}", f"log.out_dir={out}", f"data.seq_len={a.seq_len}",
        f"model.vocab_size={a.vocab}", f"model.d_model={a.d_model}", f"model.n_layer={a.n_layer}",
        f"model.n_head={a.n_head}", f"model.n_kv_head={a.n_head}", f"model.max_seq_len={a.seq_len}",
        f"train.micro_batch_size={a.micro_batch}", f"train.parallel={parallel}",
        f"train.global_batch_tokens={a.seq_len * a.micro_batch * a.accum * world}",
        "train.dtype=fp32", "train.compile=off", "optim.name=adamw", f"train.max_steps={a.steps}",
        "eval.every=0", "sample.every=0", "checkpoint.every=0", "log.wandb=disabled",
        f"train.device={a.device}",
    ]


def worker(a: argparse.Namespace) -> None:
    import torch

    from lmforge.pipeline import train as train_mod
    from lmforge.pipeline.config import load_config
    from lmforge.pipeline.parallel.distributed import init_distributed

    info = init_distributed(a.device)
    if info.device.type == "cuda":
        torch.cuda.init()
    start = rss_mb()
    if a.old_init:  # the whole model on every rank first, as before meta-device builds
        from lmforge.model import GPT
        train_mod.meta_gpt = GPT
    cfg = load_config(None, [f"--{kv}" for kv in a.job])
    trainer = train_mod.Trainer(cfg, info)
    built, built_hwm = rss_mb(), rss_mb("VmHWM:")
    trainer.train_step()
    first, first_hwm = rss_mb(), rss_mb("VmHWM:")
    step_s = []
    for _ in range(a.steps - 1):
        t0 = time.perf_counter()
        trainer.train_step()
        step_s.append(time.perf_counter() - t0)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                for p in trainer.parallel.module.parameters())
    report = {"rank": info.rank, "start": start, "built": built, "first_step": first,
              "built_hwm": built_hwm, "first_hwm": first_hwm,
              "peak": rss_mb("VmHWM:"), "local_params": local,
              "step_s": sorted(step_s)[len(step_s) // 2] if step_s else float("nan")}
    (Path(a.report) / f"rank{info.rank}.json").write_text(json.dumps(report))
    if info.is_distributed:
        torch.distributed.destroy_process_group()


def write_data(a: argparse.Namespace, root: Path) -> Path:
    """A small slice of the built-in corpus with a trained BPE of the model's vocabulary (memory
    does not depend on what the tokens say)."""
    from lmforge.launch.prepare import main as prepare

    out = root / "data"
    rc = prepare(["--source", "builtin:pystdlib", "--tokenizer", f"bpe:{a.vocab}", "--out",
                  str(out), "--max-docs", "120", "--val-docs", "12", "--workers", "1", "--quiet"])
    if rc:
        raise SystemExit(f"preparing the bench data failed ({rc})")
    return out


def planned_mb(a: argparse.Namespace, world: int) -> dict[str, float]:
    from lmforge.model import ModelConfig
    from lmforge.pipeline.config import load_config
    from lmforge.pipeline.parallel.materialize import meta_gpt
    from lmforge.pipeline.parallel.plan import strategies

    cfg = load_config(None, [f"--{kv}" for kv in job_args(a, Path("."), Path("."), world)])
    model = meta_gpt(ModelConfig(**{**cfg.model.to_dict(), "vocab_size": a.vocab}))
    ddp, fsdp = strategies(cfg, model, world, bf16=False)
    s = fsdp if world > 1 else ddp
    return {"states": s.state.total / MB, "gathered": s.compute_copy / MB,
            "accumulated": s.accumulated / MB, "activations+loss": (s.activations + s.head_loss) / MB,
            "peak": s.peak(False) / MB}


def run_config(a: argparse.Namespace, data: Path, world: int, old_init: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        job = job_args(a, data, Path(out), world)
        me = ["-m", "bench.fsdp_memory", "--worker", "--report", out, "--device", a.device,
              *(["--old-init"] if old_init else []),
              "--steps", str(a.steps), "--job", *job]
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={world}", *me] if world > 1 else [sys.executable, *me])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
               "PYTHONPATH": str(ROOT)}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
        if res.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--job", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--old-init", action="store_true", help="also measure the pre-meta build")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: torch.cuda.max_memory_allocated instead of the peak RSS")
    add_model_args(p, d_model=768, n_layer=8, n_head=12)
    p.add_argument("--accum", type=int, default=1, help="accumulation steps per rank")
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args()
    if a.worker:
        return worker(a)


    memory = "max_memory_allocated" if a.device == "cuda" else "RSS"
    lines = [f"{header(a.device)}, memory: {memory}",
             f"# model d{a.d_model} L{a.n_layer} V{a.vocab}, fp32, AdamW, micro-batch "
             f"{a.micro_batch} x {a.seq_len}, {a.accum} accumulation step(s) per rank, "
             f"{a.steps} steps; MB = MiB; run = peak - start-up",
             "# built / step 1: RSS then (peak so far); peak: after all steps",
             f"{'config':<18}{'rank':>4}{'start-up':>9}{'built':>14}{'step 1':>14}{'peak':>7}"
             f"{'run':>6}{'planned':>8}  planned: states + gathered + accum + acts/loss"]
    with tempfile.TemporaryDirectory() as tmp:
        data = a.data or write_data(a, Path(tmp))
        configs = [(w, False) for w in a.ranks] + [(w, True) for w in a.ranks if a.old_init and w > 1]
        for world, old in configs:
            plan = planned_mb(a, world)
            name = f"{'FSDP2' if world > 1 else '1 process'} x{world}{' old-init' if old else ''}"
            for r in run_config(a, data, world, old):
                parts = " + ".join(f"{plan[k]:.0f}" for k in
                                   ("states", "gathered", "accumulated", "activations+loss"))
                built = f"{r['built']:.0f} ({r['built_hwm']:.0f})"
                first = f"{r['first_step']:.0f} ({r['first_hwm']:.0f})"
                lines.append(f"{name:<18}{r['rank']:>4}{r['start']:>9.0f}{built:>14}{first:>14}"
                             f"{r['peak']:>7.0f}{r['peak'] - r['start']:>6.0f}{plan['peak']:>8.0f}"
                             f"  {parts}; step {r['step_s'] * 1e3:.0f} ms")
            print("\n".join(lines[-world:]), flush=True)
    emit(lines, a.out)


if __name__ == "__main__":
    main()
