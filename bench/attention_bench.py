"""One layer's attention, forward + backward, by kernel (pipeline.attention: sdpa, eager) at
train_bench's shape and longer sequences, in fp32 and in bf16 where this CPU computes it natively:
what train.attention = auto times before a run, measured here over interleaved rounds.

    python -m bench.attention_bench                  # batch 8, 4 heads of 64, T 256/512/1024
    python -m bench.attention_bench --rounds 9 --seq-lens 128 256
    python -m bench.attention_bench --compile --query-blocks 64 128 100000  # 100000: one block

Each round times both kernels once (pipeline.attention.measure: best of a few calls after a
warm-up; --compile: each kernel compiled, as a compiled run measures them), so both see the same
machine; the figure is the median over rounds, and the ratio is sdpa's time over eager's (above
1: eager faster). --query-blocks times causal eager attention at each block size
(pipeline.attention.QUERY_BLOCK; one at least T is the whole T x T scores, the kernel before
blocks), each size its own row. `auto` is what the run would choose at that shape (with its
margin and memory rule), from the medians.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import header
from bench.train_bench import FULL, Run
from pipeline import attention
from pipeline.hardware import auto_dtype, dtype_name


def medians(m, batch: int, T: int, dtype, device, compiled: bool, blocks: list[int],
            rounds: int) -> dict[int, dict[str, float]]:
    """Median ms per kernel over interleaved rounds, by query block size."""
    seen: dict[int, list[dict[str, float]]] = {qb: [] for qb in blocks}
    for _ in range(rounds):
        for qb in blocks:
            attention.QUERY_BLOCK = qb  # a global the compiled kernel guards on: one graph each
            seen[qb].append(attention.measure(m, batch, T, dtype, device, compiled))
    return {qb: {k: 1e3 * statistics.median(r[k] for r in rs) for k in attention.KERNELS}
            for qb, rs in seen.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--compile", action="store_true", help="time the kernels compiled")
    p.add_argument("--query-blocks", type=int, nargs="+", default=[attention.QUERY_BLOCK],
                   help="causal eager attention's query rows per block, each timed")
    a = p.parse_args()
    device = torch.device("cpu")
    dtypes = [torch.float32]
    if auto_dtype(device)[0] == torch.bfloat16:
        dtypes.append(torch.bfloat16)
    # One graph per kernel, block size, shape and dtype: more than dynamo's default allows.
    torch._dynamo.config.recompile_limit = 4 * len(a.query_blocks) * len(a.seq_lens) * len(dtypes)
    print(header())
    print(f"batch {a.batch}, {FULL['n_head']} heads of {FULL['d_model'] // FULL['n_head']}, "
          f"{a.rounds} interleaved rounds; ms per layer, forward + backward"
          f"{', compiled' if a.compile else ''}")
    print(f"{'dtype':5} {'T':>5} {'block':>6} {'sdpa ms':>8} {'eager ms':>8} "
          f"{'sdpa/eager':>10}  auto")
    for dtype in dtypes:
        for T in a.seq_lens:
            m = Run("lmforge", 50257, False, "cpu", dtype_name(dtype),
                    **{**FULL, "seq_len": T}).model_config()
            fits = attention.eager_fits(m, a.batch, T, dtype)
            by_block = medians(m, a.batch, T, dtype, device, a.compile, a.query_blocks, a.rounds)
            for qb, ms in by_block.items():
                auto = attention.pick(ms) if fits else "sdpa"
                print(f"{dtype_name(dtype):5} {T:5} {qb:6} {ms['sdpa']:8.1f} {ms['eager']:8.1f} "
                      f"{ms['sdpa'] / ms['eager']:9.2f}x  {auto}"
                      f"{'' if fits else ' (eager does not fit)'}")


if __name__ == "__main__":
    main()
