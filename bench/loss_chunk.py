"""The LM-head loss's chunk size, in the whole training step: lmforge (eager or compiled) at
train_bench's shape A with chunks of several heights and with the full logits, tok/s and peak.

    python -m bench.loss_chunk                        # compiled, 3 interleaved rounds
    python -m bench.loss_chunk --eager --rounds 2
    python -m bench.loss_chunk --dtype fp32            # where auto picks bf16: fp32's regime

Each configuration is train_bench's step (bf16 autocast where auto picks it, AdamW, clipping) in
a fresh process, rounds interleaved; `default` is what the pipeline picks (pipeline.loss:
ChunkedLoss within EAGER_CHUNK_ELEMS, FusedLoss within FUSED_CHUNK_ELEMS); `full` is the model's
plain cross_entropy (the whole B x T x V logits). Every run keeps the CPU allocator policy the
pipeline sets (pipeline.hardware.set_cpu_allocator), as training does: a chunk's buffers under
its kept-block size are reused from the heap, larger ones are faulted in afresh each step, so
tok/s, faults per step and the peak RSS are the ones a run sees.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import torch

from bench.common import header
from bench.train_bench import FULL, SHAPES, Run, describe, measure
from pipeline.hardware import dtype_name
from pipeline.loss import chunk_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eager", action="store_true", help="time the eager step instead")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    args = p.parse_args()
    print(header(), flush=True)
    dtype, _, line = describe(torch.device("cpu"), args.dtype)
    print(line, flush=True)
    base = Run("lmforge", SHAPES["A"], not args.eager, "cpu", dtype_name(dtype),
               steps=args.steps, profile=False, **FULL)
    tokens, V = base.batch * base.seq_len, base.model_config().padded_vocab_size
    chunks = [chunk_tokens(V, tokens, 2**e) for e in (22, 23, 24, 25, 27)]
    heights = {"default": None, **{f"chunk {c}": c for c in chunks}, "full": 0}
    res = {k: [] for k in heights}
    for i in range(args.rounds):
        for k, chunk in heights.items():
            res[k].append(measure(replace(base, loss_chunk=chunk)))
            print(f"  [round {i} {k}: {res[k][-1]['tok_s']:.0f} tok/s]", flush=True)
    print(f"{'compiled' if base.compiled else 'eager'} lmforge at A ({tokens} tokens x V {V}), "
          f"{args.rounds} rounds x {args.steps} steps; the pipeline's allocator policy")
    ref = statistics.median(r["tok_s"] for r in res["default"])
    for k, runs in res.items():
        tok = [r["tok_s"] for r in runs]
        print(f"  {k:11} tok/s {' / '.join(f'{t:.0f}' for t in tok):24} median "
              f"{statistics.median(tok):6.0f} = {statistics.median(tok) / ref:.2f}x default; "
              f"peak {statistics.median(r['peak_mb'] for r in runs):5.0f} MB; "
              f"{statistics.median(r['faults_per_step'] for r in runs):7.0f} faults per step")


if __name__ == "__main__":
    main()
