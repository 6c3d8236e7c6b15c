"""Training throughput and memory: lmforge (eager, compiled) vs a GPT-2-style reference and
transformers' LlamaForCausalLM, at two shapes (a GPT-2-size vocabulary, where the head
dominates, and a small one), in the dtype train.dtype=auto picks here.

    python bench/train_bench.py               # 2 rounds, both shapes, memory (~25 min, 2 cores)
    python bench/train_bench.py --quick       # shape B only, 1 round, few steps (smoke test)
    python bench/train_bench.py --shapes B --rounds 4 --no-memory    # one shape, more rounds

Every configuration runs in a fresh process (its peak RSS is its own; its compile warm from
inductor's on-disk cache after the first time: a cold compile is measured apart, once per shape),
configurations interleaved round after round:
on a noisy machine only ratios measured in the same run mean anything, and the spread shows
how much. A training step is the same for all: forward + mean cross-entropy, backward,
gradient clipping at 1.0, AdamW. lmforge's step is the pipeline's (parallelize: compile of the
forward, with the loss when its logits fit one chunk, as at B; the chunked loss stays eager, as
at A); the references are compiled whole (model + loss). `faults` is the minor page faults of a
step (a fresh big tensor costs one per 4 KiB on CPU). Then: the cold
compile, and memory at shape A (peak RSS at batch 1 and 8, the largest micro-batch lmforge fits
in HF's peak, searched). bench/profile_step.py shows where a step's time goes.

Same FLOPs everywhere: lmforge's SwiGLU MLP with d_mlp 688 (3 matrices) = GPT-2's 4d GELU MLP
(2 matrices of 1024); the head is D x 50,304 (shape A, GPT-2 vocabulary padded) or 4,096 (B).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
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


def training_step(impl: str, vocab: int, compile_model: bool, batch: int):
    """The step every configuration runs, as a function of no arguments on a fixed random batch:
    forward + mean cross-entropy, backward, gradient clipping at 1.0, AdamW."""
    import torch

    torch.manual_seed(0)
    build = {"lmforge": build_lmforge, "gpt2": build_gpt2, "hf": build_hf}[impl]
    model, step, opt = build(vocab, compile_model)
    x_BT, y_BT = torch.randint(0, vocab, (2, batch, T))

    def one_step() -> None:
        step(x_BT, y_BT).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return one_step


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def worker(impl: str, vocab: int, compile_model: bool, steps: int, batch: int) -> dict:
    one_step = training_step(impl, vocab, compile_model, batch)
    base_mb = rss_mb()
    times, faults = [], []
    for _ in range(steps + 2):  # 2 warm-up steps: the compile, then the first compiled step
        f0, t0 = minor_faults(), time.perf_counter()
        one_step()
        times.append(time.perf_counter() - t0)
        faults.append(minor_faults() - f0)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"tok_s": batch * T / statistics.median(times[2:]), "first_step_s": times[0],
            "steady_s": statistics.median(times[2:]), "peak_rss_mb": peak_mb,
            "base_rss_mb": base_mb, "train_mb": peak_mb - base_mb,
            "faults_per_step": statistics.median(faults[2:])}


def rss_mb() -> float:
    """Resident set now (/proc/self/statm; Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def measure(impl, vocab, compile_model, steps, batch=BATCH, env=None) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, str(vocab), str(int(compile_model)),
           str(steps), str(batch)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def name(impl, comp):
    return f"{impl} {'compiled' if comp else 'eager'}"


# glibc keeps some freed blocks for reuse, so a process's peak RSS also depends on what the
# allocator held on to. A fixed mmap threshold hands every block >= 1 MiB back to the OS on free:
# RSS then follows the live tensors, for every implementation alike.
LIVE_RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def memory_section(vocab: int) -> None:
    """Peak RSS at batch 1 and BATCH per configuration (fresh process, 2 steps, LIVE_RSS_ENV).
    The budget is HF's lowest peak at BATCH; lmforge's largest micro-batch within it is
    estimated from its per-sequence slope, then run, and stepped down until it fits."""
    env = {**os.environ, **LIVE_RSS_ENV}
    configs = [("lmforge", False), ("lmforge", True), ("hf", False), ("hf", True)]
    print(f"\nmemory at shape A (peak RSS of a fresh process, 2 steps, {LIVE_RSS_ENV}):")
    fit = {}
    for impl, comp in configs:
        small, big = (measure(impl, vocab, comp, 2, b, env) for b in (1, BATCH))
        slope = (big["peak_rss_mb"] - small["peak_rss_mb"]) / (BATCH - 1)
        fit[impl, comp] = (small["peak_rss_mb"] - slope, slope, big)
        print(f"  {name(impl, comp):18} peak {small['peak_rss_mb']:6.0f} MB at batch 1, "
              f"{big['peak_rss_mb']:6.0f} MB at batch {BATCH} ({big['train_mb']:5.0f} MB above the "
              f"built model), {slope:4.0f} MB per sequence of {T}, {big['tok_s']:5.0f} tok/s")
    budget = min(fit["hf", c][2]["peak_rss_mb"] for c in (False, True))
    print(f"  budget: HF's lowest peak at batch {BATCH}, {budget:.0f} MB")
    for comp in (False, True):
        base, slope, at_batch = fit["lmforge", comp]
        print(f"  lmforge {name('', comp).strip()}: peak at batch {BATCH} = "
              f"{at_batch['peak_rss_mb'] / budget:.2f}x HF's")
        batch, tried = int((budget - base) / slope), {}
        while batch > BATCH and batch not in tried:
            tried[batch] = peak = measure("lmforge", vocab, comp, 2, batch, env)["peak_rss_mb"]
            print(f"    batch {batch}: peak {peak:.0f} MB ({'fits' if peak <= budget else 'over'})")
            if peak <= budget and batch + 1 in tried:
                break
            # Secant through batch BATCH and this one (the small-batch slope can mislead), then
            # one step at a time around the crossing.
            slope = (peak - at_batch["peak_rss_mb"]) / (batch - BATCH)
            guess = BATCH + int((budget - at_batch["peak_rss_mb"]) / slope)
            batch = guess if guess not in tried else batch + 1 if peak <= budget else batch - 1
        batch = max((b for b, p in tried.items() if p <= budget), default=BATCH)
        print(f"    largest micro-batch in HF's budget: {batch} = {batch / BATCH:.2f}x HF's {BATCH}")


def cold_compile(shapes: dict[str, int], res: dict) -> None:
    """lmforge's first compiled step with an empty inductor cache, less a steady step: the cost
    train.compile = auto weighs on CPU (pipeline.parallelize.CPU_COLD_COMPILE_S), and what the
    measured gain repays it in."""
    print("\ncold compile of lmforge (empty inductor cache; first step - steady step):")
    for s, vocab in shapes.items():
        with tempfile.TemporaryDirectory() as cache:
            r = measure("lmforge", vocab, True, 2, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
        gain = (statistics.median(x["tok_s"] for x in res[s, "lmforge", True])
                / statistics.median(x["tok_s"] for x in res[s, "lmforge", False]))
        cold = r["first_step_s"] - r["steady_s"]
        saved = 1 - 1 / gain
        repaid = f"repaid after {cold / saved:.0f} s of eager training" if saved > 0 else "never repaid"
        print(f"  {s}: {cold:.1f} s; compiled/eager {gain:.2f}x -> {repaid}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--no-memory", action="store_true", help="skip the micro-batch estimate")
    p.add_argument("--shapes", default="AB", help="which shapes to time (default: both, AB)")
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        impl, vocab, comp, steps, batch = a.worker
        print(json.dumps(worker(impl, int(vocab), comp == "1", int(steps), int(batch))))
        return

    import torch

    from model import GPT, ModelConfig
    from pipeline.hardware import cpu_capability, cpu_model, matmul_peak

    shapes = {s: v for s, v in SHAPES.items() if s in ("B" if a.quick else a.shapes.upper())}
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
          f"{'RSS MB':>7} {'faults':>7} {'1st step':>8}  lmforge compiled / this")
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
                  f"{statistics.median(r['faults_per_step'] for r in runs):7.0f} "
                  f"{statistics.median(r['first_step_s'] for r in runs):7.1f}s  {ratio:.2f}x")
    if not a.quick:
        cold_compile(shapes, res)
    if not (a.quick or a.no_memory):
        memory_section(SHAPES["A"])


if __name__ == "__main__":
    main()
