"""Step time of FSDP2 + Muon against FSDP2 + AdamW on CPU ranks (gloo), rounds interleaved.

    python -m bench.fsdp_muon_step                       # 2 ranks, d512 L4, 3 rounds
    python -m bench.fsdp_muon_step --ranks 2 --rounds 1 --steps 6   # a quick look

Each run is the real trainer under torchrun (fp32, eager); a run's step time is the median over
its steps after the first of global_batch_tokens / tokens_per_s (metrics.jsonl). Muon under
FSDP2 adds, per step, each block matrix gathered to its owner, Newton-Schulz there, and the
result scattered back (pipeline/optim/muon.py); the --dry-run plan counts those bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, add_model_args, emit, header
from bench.fsdp_memory import write_data


def step_seconds(a: argparse.Namespace, data: Path, optimizer: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        tokens = a.seq_len * a.micro_batch * a.ranks
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={a.ranks}", "-m", "lmforge.launch.train", "--data.path", str(data),
               "--log.out_dir", out, "--data.seq_len", str(a.seq_len), "--model.d_model",
               str(a.d_model), "--model.n_layer", str(a.n_layer), "--model.n_head", str(a.n_head),
               "--model.n_kv_head", str(a.n_head), "--model.max_seq_len", str(a.seq_len),
               "--train.micro_batch_size", str(a.micro_batch), "--train.global_batch_tokens",
               str(tokens), "--train.max_steps", str(a.steps), "--train.dtype", "fp32",
               "--train.compile", "off", "--train.parallel", a.parallel, "--optim.name", optimizer,
               "--eval.every", "0", "--sample.every", "0", "--checkpoint.every", "0",
               "--log.log_every", "1"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
               "PYTHONPATH": str(ROOT)}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
        if res.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
        records = [json.loads(ln) for ln in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        return statistics.median(tokens / r["tokens_per_s"] for r in records
                                 if "tokens_per_s" in r and r["step"] > 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--parallel", choices=["fsdp", "ddp"], default="fsdp",
                   help="ddp: the same comparison where every rank orthogonalises every matrix")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    add_model_args(p, d_model=512, n_layer=4, n_head=8)
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args()

    times: dict[str, list[float]] = {"adamw": [], "muon": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = a.data or write_data(a, Path(tmp))
        for _ in range(a.rounds):
            for opt in times:
                times[opt].append(step_seconds(a, data, opt))
    ratios = [m / w for m, w in zip(times["muon"], times["adamw"], strict=True)]
    lines = [header(),
             f"# {a.parallel} x{a.ranks} (gloo), d{a.d_model} L{a.n_layer} V{a.vocab}, fp32, "
             f"{a.micro_batch} x {a.seq_len} tokens per rank per step, {a.steps} steps per run",
             *(f"round {i + 1}: AdamW {w * 1e3:.0f} ms, Muon {m * 1e3:.0f} ms ({m / w:.2f}x)"
               for i, (w, m) in enumerate(zip(times["adamw"], times["muon"], strict=True))),
             f"median step: AdamW {statistics.median(times['adamw']) * 1e3:.0f} ms, Muon "
             f"{statistics.median(times['muon']) * 1e3:.0f} ms; Muon/AdamW "
             f"{statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})"]
    emit(lines, a.out)


if __name__ == "__main__":
    main()
