"""One layer's attention, forward + backward, by kernel (pipeline.attention: sdpa, eager) at
train_bench's shape and longer sequences, in fp32 and in bf16 where this CPU computes it natively:
what train.attention = auto times before a run, measured here over interleaved rounds.

    python -m bench.attention_bench                  # batch 8, 4 heads of 64, T 256/512/1024
    python -m bench.attention_bench --rounds 9 --seq-lens 128 256

Each round times both kernels once (pipeline.attention.measure: best of a few calls after a
warm-up), so both see the same machine; the figure is the median over rounds, and the ratio is
sdpa's time over eager's (above 1: eager faster). `auto` is what the run would choose at that
shape (with its margin and memory rule), from the medians.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import header
from bench.train_bench import FULL, Run
from pipeline import attention
from pipeline.hardware import auto_dtype, dtype_name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024])
    a = p.parse_args()
    device = torch.device("cpu")
    dtypes = [torch.float32]
    if auto_dtype(device)[0] == torch.bfloat16:
        dtypes.append(torch.bfloat16)
    print(header())
    print(f"batch {a.batch}, {FULL['n_head']} heads of {FULL['d_model'] // FULL['n_head']}, "
          f"{a.rounds} interleaved rounds; ms per layer, forward + backward")
    print(f"{'dtype':5} {'T':>5} {'sdpa ms':>8} {'eager ms':>8} {'sdpa/eager':>10}  auto")
    for dtype in dtypes:
        for T in a.seq_lens:
            m = Run("lmforge", 50257, False, "cpu", dtype_name(dtype),
                    **{**FULL, "seq_len": T}).model_config()
            rounds = [attention.measure(m, a.batch, T, dtype, device) for _ in range(a.rounds)]
            ms = {k: 1e3 * statistics.median(r[k] for r in rounds) for k in attention.KERNELS}
            fits = attention.eager_fits(m, a.batch, T, dtype)
            auto = attention.pick(ms) if fits else "sdpa"
            print(f"{dtype_name(dtype):5} {T:5} {ms['sdpa']:8.1f} {ms['eager']:8.1f} "
                  f"{ms['sdpa'] / ms['eager']:9.2f}x  {auto}{'' if fits else ' (eager does not fit)'}")


if __name__ == "__main__":
    main()
