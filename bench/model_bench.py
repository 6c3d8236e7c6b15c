"""lmforge's model vs transformers.LlamaForCausalLM of identical shape and weights, on this CPU.

    python -m bench.model_bench            # the configs/tiny.toml model shape
    python -m bench.model_bench --quick    # fewer rounds and steps

Prints, as ratios measured in this same run (only ratios mean anything on a shared machine):
  train   tokens/s of a training step: forward + mean cross-entropy + backward + AdamW step
  decode  tokens/s of greedy decoding, batch 1, 256 new tokens, KV cache (ours: model.generate,
          reference: LlamaForCausalLM.generate with its default cache)
  decode+c the same with both sides compiled: our generate(compile=True) vs transformers' static
          cache + compiled forward; compilation is done in an untimed call and not counted
  cache   our decode with the KV cache vs full recompute, 32 new tokens after 512 of context
  gqa     F.scaled_dot_product_attention with enable_gqa=True vs repeat_interleave of K/V
Both models are fp32, eager, SDPA attention; the reference is loaded from our export_hf output
so the weights are identical (the greedy tokens are compared as a sanity check). Measurements
are interleaved round by round; the median per-round ratio is reported, with the best-round ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from model import GPT, ModelConfig, SamplingParams, generate
from model.hf import export_hf

SHAPE = dict(vocab_size=4096, n_layer=4, n_head=4, n_kv_head=2, d_model=256, max_seq_len=1024)
TRAIN_BATCH, TRAIN_SEQ = 8, 256
DECODE_PROMPT, DECODE_NEW = 16, 256
CACHE_CONTEXT, CACHE_NEW = 512, 32


CLOCK = time.perf_counter  # main() switches to CPU time for single-threaded runs


def timed(fn: Callable[[], object]) -> float:
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def interleaved(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run each variant once per round, alternating the order; every round's rate per variant."""
    rates: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            rates[name].append(variants[name]())
    return rates


def build_pair(cfg: ModelConfig):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    ours = GPT(cfg)
    with tempfile.TemporaryDirectory() as d:
        export_hf(ours, cfg, d)
        ref = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
    return ours, ref


def train_rate(loss_fn: Callable, params, steps: int, batches) -> Callable[[], float]:
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)

    def run() -> float:
        def loop():
            for x, y in batches[:steps]:
                loss_fn(x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        return steps * batches[0][0].numel() / timed(loop)

    run()  # warm-up: allocator, optimizer state
    return run


def bench_train(ours, ref, steps: int, rounds: int) -> dict[str, float]:
    V = ours.cfg.vocab_size
    batches = [(torch.randint(0, V, (TRAIN_BATCH, TRAIN_SEQ)),) * 2 for _ in range(steps)]
    # labels=x: transformers shifts internally; ours gets the already-shifted role by convention.
    # Both compute a mean cross-entropy over B×T(-1) positions of the full vocabulary.
    ref_loss = lambda x, y: ref(input_ids=x, labels=y).loss
    return interleaved(
        {
            "ours": train_rate(lambda x, y: ours(x, y), ours.parameters(), steps, batches),
            "transformers": train_rate(ref_loss, ref.parameters(), steps, batches),
        },
        rounds,
    )


def bench_decode(ours, ref, rounds: int, compile: bool) -> tuple[dict[str, list[float]], float]:
    """Eager: our generate vs transformers' generate with its default DynamicCache. Compiled: our
    compile=True vs transformers' own compiled path, a static cache with its forward compiled
    (CompileConfig with _compile_all_devices, as transformers only auto-compiles on accelerators).
    One untimed call of each first: compilation is excluded from the rates."""
    from transformers import CompileConfig

    prompt = torch.randint(0, ours.cfg.vocab_size, (1, DECODE_PROMPT))
    out: dict[str, list[int]] = {}
    ref_kwargs = {}
    if compile:
        compile_config = CompileConfig(mode="default", fullgraph=True, dynamic=False)
        compile_config._compile_all_devices = True
        ref_kwargs = dict(cache_implementation="static", compile_config=compile_config)

    greedy = SamplingParams(max_new_tokens=DECODE_NEW, temperature=0)

    def run_ours() -> float:
        def call():
            out["ours"] = generate(ours, prompt.tolist(), greedy, compile=compile)[0]

        return DECODE_NEW / timed(call)

    def run_ref() -> float:
        def call():
            with torch.inference_mode():
                seq = ref.generate(
                    prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=DECODE_NEW,
                    min_new_tokens=DECODE_NEW, do_sample=False, use_cache=True, pad_token_id=0, **ref_kwargs,
                )
            out["transformers"] = seq[0, DECODE_PROMPT:].tolist()

        return DECODE_NEW / timed(call)

    run_ours(), run_ref()
    rates = interleaved({"ours": run_ours, "transformers": run_ref}, rounds)
    same = sum(a == b for a, b in zip(out["ours"], out["transformers"])) / DECODE_NEW
    return rates, same


def bench_cache(ours, rounds: int) -> dict[str, float]:
    prompt = torch.randint(0, ours.cfg.vocab_size, (1, CACHE_CONTEXT)).tolist()
    greedy = SamplingParams(max_new_tokens=CACHE_NEW, temperature=0)

    def run(use_cache: bool) -> Callable[[], float]:
        return lambda: CACHE_NEW / timed(
            lambda: generate(ours, prompt, greedy, use_cache=use_cache)
        )

    return interleaved({"cache": run(True), "no cache": run(False)}, rounds)


def bench_gqa(cfg: ModelConfig, rounds: int) -> dict[str, float]:
    H, G, K = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    q = torch.randn(TRAIN_BATCH, H, TRAIN_SEQ, K, requires_grad=True)
    k, v = (torch.randn(TRAIN_BATCH, G, TRAIN_SEQ, K, requires_grad=True) for _ in range(2))

    def run(gqa: bool) -> Callable[[], float]:
        def step():
            for _ in range(10):
                if gqa:
                    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                else:
                    rk, rv = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
                    y = F.scaled_dot_product_attention(q, rk, rv, is_causal=True)
                y.sum().backward()

        return lambda: 10 / timed(step)

    return interleaved({"enable_gqa": run(True), "repeat_interleave": run(False)}, rounds)


def report(name: str, rates: dict[str, list[float]], unit: str, target: float) -> None:
    """Median rates and the median of the per-round ratios; the best-round ratio beside it, as
    interference from other processes only ever slows a round down."""
    (a, ra), (b, rb) = rates.items()
    ratio = statistics.median(x / y for x, y in zip(ra, rb))
    verdict = "ok" if ratio >= target else "BELOW TARGET"
    print(
        f"{name:7s} {a} {statistics.median(ra):8.1f} {unit} | {b} {statistics.median(rb):8.1f} {unit} | "
        f"ratio {ratio:5.2f}x (best rounds {max(ra) / max(rb):5.2f}x)  target >= {target}x: {verdict}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    # One thread by default: on this shared 2-core machine, 2 OpenMP threads competing with other
    # jobs swing step times by up to 10x; one thread gives repeatable ratios.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global CLOCK
    if args.threads == 1:
        # CPU time of this process: waiting while other jobs hold the cores is not counted, so
        # the figures reflect the work each implementation does rather than the machine's load.
        CLOCK = time.process_time
    rounds, steps = (3, 2) if args.quick else (7, 4)
    cfg = ModelConfig(**SHAPE)
    ours, ref = build_pair(cfg)
    print(f"model: {ours.summary()}")
    clock = "process CPU time" if CLOCK is time.process_time else "wall time"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {clock}, {rounds} interleaved rounds")
    print(f"train: batch {TRAIN_BATCH} x {TRAIN_SEQ} tokens, {steps} steps per round, fp32, AdamW")
    report("train", bench_train(ours, ref, steps, rounds), "tok/s", 1.2)
    for compile in (False, True):
        decode, same = bench_decode(ours, ref, rounds, compile)
        report("decode" + ("+c" if compile else ""), decode, "tok/s", 2.0)
        how = "both torch.compile'd, static caches" if compile else "both eager"
        print(f"        {how}; greedy tokens identical to transformers: {same:.0%} (prompt {DECODE_PROMPT}, {DECODE_NEW} new)")
    report("cache", bench_cache(ours, rounds), "tok/s", 5.0)
    print(f"        context {CACHE_CONTEXT} tokens, {CACHE_NEW} new")
    report("gqa", bench_gqa(cfg, rounds), "it/s", 1.0)


if __name__ == "__main__":
    main()
