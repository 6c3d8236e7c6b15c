"""One AdamW step on a model's parameters: the foreach implementation (torch's default on CPU,
what the bench's GPT-2 and HF references run) against the fused kernel (optim.fused = auto).

    python -m bench.adamw_step                    # train_bench's shapes A and B, 30 rounds
    python -m bench.adamw_step --shapes A --rounds 10

Both optimizers are built by pipeline.optim.build_optimizer on their own copy of the same model,
with the same random gradients, and stepped alternately (foreach, fused, foreach, ...) so that
both see the same machine; the figure is the median step. After the timed steps the two copies
have taken the same updates: their largest parameter difference is printed (fp32 rounding).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from bench.common import header
from bench.train_bench import FULL, SHAPES, Run
from model import GPT
from pipeline.config import OptimConfig
from pipeline.optim import build_optimizer


def one_shape(vocab: int, rounds: int) -> str:
    torch.manual_seed(0)
    models = {"foreach": GPT(Run("lmforge", vocab, False, "cpu", "fp32", **FULL).model_config())}
    models["fused"] = copy.deepcopy(models["foreach"])
    opts = {}
    for kind, model in models.items():
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
        opts[kind] = build_optimizer(model, OptimConfig(fused="on" if kind == "fused" else "off"),
                                     torch.device("cpu"))
        opts[kind].step()  # the moments' first allocation, outside the timed steps
    times = {kind: [] for kind in models}
    for _ in range(rounds):
        for kind, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[kind].append(time.perf_counter() - t0)
    ms = {kind: 1e3 * statistics.median(t) for kind, t in times.items()}
    diff = max((a - b).abs().max().item() for a, b in
               zip(models["foreach"].parameters(), models["fused"].parameters()))
    n = sum(p.numel() for p in models["fused"].parameters())
    return (f"V {vocab:6,}, {n / 1e6:5.1f}M params: foreach {ms['foreach']:6.1f} ms, fused "
            f"{ms['fused']:5.1f} ms per step; fused / foreach = {ms['fused'] / ms['foreach']:.2f}x "
            f"the time; largest parameter difference after {rounds + 1} steps {diff:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="AB")
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    print(header(), flush=True)
    print(f"{torch.get_num_threads()} threads, fp32 parameters and moments")
    for shape in args.shapes:
        print(f"{shape}: {one_shape(SHAPES[shape], args.rounds)}", flush=True)


if __name__ == "__main__":
    main()
