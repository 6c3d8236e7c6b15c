"""Training throughput of lmforge vs transformers.LlamaForCausalLM of identical shape.

    python bench/train_bench.py                 # tiny + small shapes, eager and compiled
    python bench/train_bench.py --quick         # tiny only, eager only, fewer steps

Each measurement runs in its own process (so peak RSS is per variant) and the variants are
interleaved round after round: this machine is noisy, so only ratios measured in the same run
mean anything. A training step is the same for both: forward on a batch, mean cross-entropy,
backward, gradient clipping at 1.0, AdamW (decoupled weight decay) step. lmforge's step is the
pipeline's own (parallelize + build_optimizer + autocast); the reference is a plain loop.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (model shape, micro-batch, seq_len). tiny = configs/tiny.toml's model at vocab 4096.
SHAPES = {
    "tiny": (dict(vocab_size=4096, n_layer=4, n_head=4, n_kv_head=2, d_model=256, max_seq_len=256), 8, 256),
    "small": (dict(vocab_size=8192, n_layer=6, n_head=8, n_kv_head=2, d_model=512, max_seq_len=512), 4, 512),
}


def build_lmforge(shape: dict, compile_model: bool):
    import torch

    from model import GPT, ModelConfig
    from pipeline.config import OptimConfig
    from pipeline.distributed import DistInfo
    from pipeline.optim import build_optimizer
    from pipeline.parallelize import parallelize

    info = DistInfo(0, 0, 1, torch.device("cpu"))
    model = GPT(ModelConfig(**shape))
    trained = parallelize(model, info, parallel="none", bf16=False, compile_model=compile_model,
                          activation_checkpointing=False)
    opt = build_optimizer(trained, OptimConfig(), info.device)
    return model, lambda x, y: trained(x, y), opt


def build_hf(shape: dict, compile_model: bool):
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from model import ModelConfig

    cfg = ModelConfig(**shape)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=True, attn_implementation="sdpa",
    ))
    if compile_model:
        hf.compile()
    opt = torch.optim.AdamW(hf.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def loss_fn(x, y):
        logits = hf(input_ids=x).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    return hf, loss_fn, opt


def worker(impl: str, shape_name: str, compile_model: bool, steps: int, warmup: int) -> dict:
    import torch

    torch.manual_seed(0)
    shape, batch, seq_len = SHAPES[shape_name]
    model, loss_fn, opt = (build_lmforge if impl == "lmforge" else build_hf)(shape, compile_model)
    x = torch.randint(0, shape["vocab_size"], (batch, seq_len))
    y = torch.randint(0, shape["vocab_size"], (batch, seq_len))
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"tokens_per_s": batch * seq_len / statistics.median(times),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure(impl, shape, compile_model, steps, warmup) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, shape, str(int(compile_model)), str(steps), str(warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        impl, shape, comp, steps, warmup = a.worker
        print(json.dumps(worker(impl, shape, comp == "1", int(steps), int(warmup))))
        return

    import torch

    from model import GPT, ModelConfig
    from pipeline.metrics import peak_flops

    shapes = ["tiny"] if a.quick else list(SHAPES)
    modes = [False] if a.quick else [False, True]
    rounds, steps = (1, 4) if a.quick else (a.rounds, a.steps)
    peak = peak_flops(torch.device("cpu"), torch.float32)
    print(f"CPU fp32 matmul peak measured: {peak / 1e9:.0f} GFLOP/s; {torch.get_num_threads()} threads; "
          f"{rounds} interleaved rounds x {steps} steps (median step time per run)")
    print(f"{'shape':6} {'mode':8} {'impl':8} {'tok/s':>9} {'MFU':>6} {'peak RSS':>9}  ratio lmforge/HF")
    for shape in shapes:
        fpt = GPT(ModelConfig(**SHAPES[shape][0])).flops_per_token(SHAPES[shape][2])
        for comp in modes:
            warmup = 3 if comp else 2
            res = {"lmforge": [], "hf": []}
            for _ in range(rounds):
                for impl in res:
                    res[impl].append(measure(impl, shape, comp, steps, warmup))
            tps = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in res.items()}
            for impl, runs in res.items():
                rss = max(r["peak_rss_mb"] for r in runs)
                print(f"{shape:6} {'compiled' if comp else 'eager':8} {impl:8} {tps[impl]:9.0f} "
                      f"{fpt * tps[impl] / peak:6.1%} {rss:7.0f}MB", end="")
                print(f"  {tps['lmforge'] / tps['hf']:.2f}x" if impl == "hf" else "")


if __name__ == "__main__":
    main()
