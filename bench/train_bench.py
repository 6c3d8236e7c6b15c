"""Training throughput and memory: lmforge (eager, compiled) vs a GPT-2-style reference and
transformers' LlamaForCausalLM, at two shapes (a GPT-2-size vocabulary, where the head
dominates, and a small one), in the dtype train.dtype=auto picks here.

    python bench/train_bench.py               # 2 interleaved rounds, both shapes (~8 min, 2 cores)
    python bench/train_bench.py --quick       # shape B only, 1 round, few steps (smoke test)

Every configuration runs in a fresh process (its peak RSS is its own, its compile cold except
for inductor's on-disk cache in later rounds), configurations interleaved round after round:
on a noisy machine only ratios measured in the same run mean anything, and the spread shows
how much. A training step is the same for all: forward + mean cross-entropy, backward,
gradient clipping at 1.0, AdamW. lmforge's step is the pipeline's (parallelize: compile of the
whole forward + chunked loss); the references are compiled whole (model + loss).

Same FLOPs everywhere: lmforge's SwiGLU MLP with d_mlp 688 (3 matrices) = GPT-2's 4d GELU MLP
(2 matrices of 1024); the head is D x 50,304 (shape A, GPT-2 vocabulary padded) or 4,096 (B).
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

D, L, H, T, BATCH, D_MLP = 256, 4, 4, 256, 8, 688
SHAPES = {"A": 50257, "B": 4096}  # real vocabulary; the heads pad it to a multiple of 64
IMPLS = [("lmforge", False), ("lmforge", True), ("gpt2", True), ("hf", False), ("hf", True)]


def build_lmforge(vocab: int, compile_model: bool):
    import torch

    from model import GPT, ModelConfig
    from pipeline.config import OptimConfig
    from pipeline.distributed import DistInfo
    from pipeline.optim import build_optimizer
    from pipeline.parallelize import Precision, parallelize

    info = DistInfo(0, 0, 1, torch.device("cpu"))
    model = GPT(ModelConfig(vocab_size=vocab, n_layer=L, n_head=H, n_kv_head=H, d_model=D,
                            d_mlp=D_MLP, max_seq_len=T))
    precision = Precision(torch.float32, info.device)
    trained = parallelize(model, info, parallel="none", precision=precision,
                          compile_model=compile_model, activation_checkpointing=False).module
    return model, trained, build_optimizer(trained, OptimConfig(), info.device)


def build_gpt2(vocab: int, compile_model: bool):
    """nanoGPT-style GPT-2: LayerNorm, GELU MLP 4d, learned positions, SDPA, tied head."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    V = -(-vocab // 64) * 64

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(self, x_BTD):
            B, T_, _ = x_BTD.shape
            q, k, v = self.qkv(self.ln1(x_BTD)).view(B, T_, 3, H, D // H).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x_BTD = x_BTD + self.proj(y.transpose(1, 2).reshape(B, T_, D))
            return x_BTD + self.out(F.gelu(self.fc(self.ln2(x_BTD))))

    class GPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(D)
            self.head = nn.Linear(D, V, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, idx_BT, targets_BT):
            x_BTD = self.wte(idx_BT) + self.wpe(torch.arange(idx_BT.shape[1]))
            for block in self.blocks:
                x_BTD = block(x_BTD)
            logits_BTV = self.head(self.ln_f(x_BTD))
            return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())

    model = GPT2()
    step = torch.compile(model) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return model, step, opt


def build_hf(vocab: int, compile_model: bool):
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=D, intermediate_size=D_MLP, num_hidden_layers=L,
        num_attention_heads=H, num_key_value_heads=H, max_position_embeddings=T,
        tie_word_embeddings=True, attn_implementation="sdpa",
    ))

    def loss_fn(x_BT, y_BT):
        logits_BTV = hf(input_ids=x_BT).logits
        return F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())

    step = torch.compile(loss_fn) if compile_model else loss_fn
    opt = torch.optim.AdamW(hf.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return hf, step, opt


def worker(impl: str, vocab: int, compile_model: bool, steps: int, batch: int) -> dict:
    import torch

    torch.manual_seed(0)
    build = {"lmforge": build_lmforge, "gpt2": build_gpt2, "hf": build_hf}[impl]
    model, step, opt = build(vocab, compile_model)
    x_BT, y_BT = torch.randint(0, vocab, (2, batch, T))
    times = []
    for _ in range(steps + 2):  # 2 warm-up steps: the compile, then the first compiled step
        t0 = time.perf_counter()
        step(x_BT, y_BT).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"tok_s": batch * T / statistics.median(times[2:]), "first_step_s": times[0],
            "steady_s": statistics.median(times[2:]),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure(impl, vocab, compile_model, steps, batch=BATCH) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, str(vocab), str(int(compile_model)),
           str(steps), str(batch)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def name(impl, comp):
    return f"{impl} {'compiled' if comp else 'eager'}"


def memory_section(vocab: int) -> None:
    """Peak RSS at batch 1 and BATCH per impl: slope = memory per sequence; the batch that fits
    in HF's peak at BATCH is estimated from it (not searched)."""
    print(f"\nmemory at shape A (compiled, peak RSS of a fresh process, batch 1 and {BATCH}):")
    fit = {}
    for impl in ("lmforge", "hf"):
        small, big = (measure(impl, vocab, True, 2, b)["peak_rss_mb"] for b in (1, BATCH))
        slope = (big - small) / (BATCH - 1)
        fit[impl] = (small - slope, slope, big)
        print(f"  {impl:8} batch 1 {small:6.0f} MB, batch {BATCH} {big:6.0f} MB, "
              f"{slope:5.0f} MB per sequence of {T}")
    budget = fit["hf"][2]
    for impl, (base, slope, _) in fit.items():
        print(f"  {impl:8} fits batch {(budget - base) / slope:5.1f} in {budget:.0f} MB (HF's peak "
              f"at batch {BATCH}; estimated from the slope)")
    print(f"  micro-batch ratio lmforge/HF in that budget: "
          f"{((budget - fit['lmforge'][0]) / fit['lmforge'][1]) / BATCH:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--no-memory", action="store_true", help="skip the micro-batch estimate")
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        impl, vocab, comp, steps, batch = a.worker
        print(json.dumps(worker(impl, int(vocab), comp == "1", int(steps), int(batch))))
        return

    import torch

    from model import GPT, ModelConfig
    from pipeline.hardware import cpu_capability, cpu_model, matmul_peak

    shapes = {"B": SHAPES["B"]} if a.quick else SHAPES
    rounds, steps = (1, 3) if a.quick else (a.rounds, a.steps)
    peak = matmul_peak(torch.device("cpu"), torch.float32)
    print(f"CPU: {cpu_model()}, {cpu_capability()}, {torch.get_num_threads()} threads; dtype fp32 "
          f"(auto's pick without native bf16); measured fp32 matmul peak {peak / 1e9:.0f} GFLOP/s")
    print(f"d_model {D}, {L} layers, {H} heads, T {T}, batch {BATCH}; {rounds} interleaved rounds "
          f"x {steps} steps after 2 warm-up steps (median step per run)\n")
    res = {(s, impl, comp): [] for s in shapes for impl, comp in IMPLS}
    for _ in range(rounds):
        for s, vocab in shapes.items():
            for impl, comp in IMPLS:
                r = measure(impl, vocab, comp, steps)
                res[s, impl, comp].append(r)
                print(f"  [{s} {name(impl, comp)}: {r['tok_s']:.0f} tok/s, {r['peak_rss_mb']:.0f} MB]",
                      file=sys.stderr, flush=True)  # partial results survive an interrupted run
    print(f"{'shape':5} {'config':18} {'tok/s per round':>22} {'median':>7} {'MFU':>6} "
          f"{'RSS MB':>7} {'1st step':>8}  lmforge compiled / this")
    for s, vocab in shapes.items():
        cfg = ModelConfig(vocab_size=vocab, n_layer=L, n_head=H, d_model=D, d_mlp=D_MLP, max_seq_len=T)
        with torch.device("meta"):
            fpt = GPT(cfg).flops_per_token(T)
        med = {k[1:]: statistics.median(r["tok_s"] for r in v) for k, v in res.items() if k[0] == s}
        for impl, comp in IMPLS:
            runs = res[s, impl, comp]
            per_round = " / ".join(f"{r['tok_s']:.0f}" for r in runs)
            ratio = med["lmforge", True] / med[impl, comp]
            print(f"{s:5} {name(impl, comp):18} {per_round:>22} {med[impl, comp]:7.0f} "
                  f"{fpt * med[impl, comp] / peak:6.1%} {max(r['peak_rss_mb'] for r in runs):7.0f} "
                  f"{statistics.median(r['first_step_s'] for r in runs):7.1f}s  {ratio:.2f}x")
    if not (a.quick or a.no_memory):
        memory_section(SHAPES["A"])


if __name__ == "__main__":
    main()
