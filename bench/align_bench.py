"""data.align = doc against stream: steps to a target val loss on the built-in corpus.

    python -m bench.align_bench                    # 3 seeds x (doc, stream), a few minutes on 2 cores
    python -m bench.align_bench --seeds 5 --steps 100 --batch-tokens 4096

The built-in corpus (builtin:pystdlib, its first --max-docs documents, 5% of them val, BPE 1024, prepared once
into --data), a small model (configs/tiny.toml's shape at --layers / --d-model), rows of the
demo's length (256 tokens), trained by the pipeline itself (pipeline.train.Trainer, one
process, fp32). Both alignments see the same seed, the same batch size and number of steps (doc
rows hold a little padding: the table gives their trained targets) and are evaluated on the same
val windows (eval stays stream windows whatever the alignment). For each seed the target is the
worse of the two final val losses; the step a run reaches it is read off its val curve, the
evaluations joined by straight lines.
The runs interleave seed after seed, so a burst of load on a shared machine hits both.
Prints a table and writes OUT/results.json; the samples of each final model are printed too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench.common import ROOT

os.environ.setdefault("WANDB_MODE", "disabled")

from bench.speedrun import reach, read_records, spread


def prepare_data(data: Path, max_docs: int) -> Path:
    from lmforge.launch.prepare import main as prepare

    if not (data / "manifest.json").is_file():
        rc = prepare(["--source", "builtin:pystdlib", "--tokenizer", "bpe:1024", "--out", str(data),
                      "--max-docs", str(max_docs), "--val-docs", str(max_docs // 20), "--quiet"])
        if rc != 0:
            sys.exit(f"error: preparing {data} failed (exit {rc})")
    return data


def train_one(data: Path, out: Path, seed: int, align: str, args) -> None:
    import torch

    from lmforge.pipeline.config import load_config
    from lmforge.pipeline.parallel.distributed import DistInfo
    from lmforge.pipeline.train import Trainer

    overrides = [
        "--data.path", str(data), "--data.align", align, "--log.out_dir", str(out),
        "--train.seed", str(seed), "--train.max_steps", str(args.steps),
        "--train.global_batch_tokens", str(args.batch_tokens), "--train.dtype", "fp32",
        "--train.compile", "off", "--model.n_layer", str(args.layers),
        "--model.d_model", str(args.d_model), "--optim.warmup_steps", str(max(1, args.steps // 10)),
        "--eval.every", str(args.eval_every), "--eval.tokens", str(args.eval_tokens),
        "--sample.every", "0", "--sample.max_new_tokens", "24", "--checkpoint.every", "0",
        "--log.log_every", "1",
    ]
    cfg = load_config(ROOT / "configs" / "tiny.toml", overrides)
    Trainer(cfg, DistInfo(0, 0, 1, torch.device("cpu"))).fit()


def interpolated_step(recs: list[dict], target: float) -> float | None:
    """The step at which the val loss curve (evals joined by straight lines) reaches `target`:
    finer than the first eval at or below it, which moves in steps of --eval-every."""
    points = [(0, float("inf"))] + [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if v1 <= target:
            return float(s1) if v0 == float("inf") else s0 + (s1 - s0) * (v0 - target) / (v0 - v1)
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=ROOT / "runs" / "align_bench" / "data")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "align_bench")
    p.add_argument("--max-docs", type=int, default=400)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-tokens", type=int, default=8192)
    args = p.parse_args()

    data = prepare_data(args.data, args.max_docs)
    t0 = time.perf_counter()
    records: dict[str, list[list[dict]]] = {"doc": [], "stream": []}
    for i in range(args.seeds):
        for align in (["doc", "stream"] if i % 2 == 0 else ["stream", "doc"]):
            out = args.out / "runs" / f"{align}_seed{i}"
            shutil.rmtree(out, ignore_errors=True)
            train_one(data, out, 1337 + i, align, args)
            records[align].append(read_records(out))

    def final(recs):
        return [r for r in recs if "val_loss" in r][-1]

    print(f"\nalign_bench: {args.steps} steps x {args.batch_tokens} tokens of 256-token rows, "
          f"{args.layers} layers d_model {args.d_model}, fp32, builtin:pystdlib first "
          f"{args.max_docs} docs (BPE 1024), eval {args.eval_tokens} val tokens every "
          f"{args.eval_every} steps; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {time.perf_counter() - t0:.0f} s; "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"{'seed':>6} {'target':>8} {'doc step':>9} {'stream step':>11} {'doc final':>10} "
          f"{'stream final':>12}")
    rows, ratios = [], []
    for i in range(args.seeds):
        fd, fs = final(records["doc"][i]), final(records["stream"][i])
        target = max(fd["val_loss"], fs["val_loss"])
        d, s = reach(records["doc"][i], target), reach(records["stream"][i], target)
        d["interpolated"] = interpolated_step(records["doc"][i], target)
        s["interpolated"] = interpolated_step(records["stream"][i], target)
        ratios.append(d["interpolated"] / s["interpolated"])
        rows.append({"seed": 1337 + i, "target": target, "doc": d, "stream": s,
                     "doc_final": fd["val_loss"], "stream_final": fs["val_loss"],
                     "samples": {"doc": fd.get("samples"), "stream": fs.get("samples")}})
        print(f"{1337 + i:>6} {target:>8.4f} {d['interpolated']:>9.1f} {s['interpolated']:>11.1f} "
              f"{fd['val_loss']:>10.4f} {fs['val_loss']:>12.4f}")
    print(f"doc / stream steps to the worse final val loss (interpolated between evals): "
          f"{spread(ratios)}; final val loss "
          f"doc {spread([r['doc_final'] for r in rows])}, stream "
          f"{spread([r['stream_final'] for r in rows])} (mean ± sd over {args.seeds} seeds)")
    print(f"doc - stream final val loss per seed: "
          f"{[round(r['doc_final'] - r['stream_final'], 4) for r in rows]}, mean "
          f"{statistics.fmean(r['doc_final'] - r['stream_final'] for r in rows):+.4f}")
    for r in rows[:1]:
        for align in ("doc", "stream"):
            print(f"samples ({align}, seed {r['seed']}): {r['samples'][align]}")
    (args.out / "results.json").write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
