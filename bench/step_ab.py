"""A change to one function of lmforge's training step, measured against what it replaced, paired
within one process: step after step, the shipped function and its predecessor alternate on the
same model, batch and optimizer (bench/train_bench.py's lmforge step). On a noisy machine the
ratio of neighbouring steps holds where the fresh processes of train_bench drift by 10-30 %.
Compiled, each function gets its own graph (dynamo guards on the function), both warm before
timing.

    python -m bench.step_ab rope --shape B --compile      # model.model.apply_rope
    python -m bench.step_ab loss --shape A --compile      # pipeline.loss._fused_body
    python -m bench.step_ab columns --shape A --compile   # pipeline.loss.column_dtype
    python -m bench.step_ab logits --shape A --dtype fp32 # pipeline.loss._eager_body (CPU)
    python -m bench.step_ab softmax --shape A             # pipeline.loss._eager_from_logits
    python -m bench.step_ab accumulate --shape A          # pipeline.loss._add_by_blocks (bf16)
    python -m bench.step_ab headgrad --shape A --compile --dtype fp32  # pipeline.loss._add_head_grad
    python -m bench.step_ab causalblocks --compile  # pipeline.attention.causal_blocks (eager)
    python -m bench.step_ab gradexp --shape A --compile --dtype fp32  # pipeline.loss._grad_over_logits
    python -m bench.step_ab tiedgrad --shape A --compile  # pipeline.graph_passes (two models)
    python -m bench.step_ab rope --decode                 # KV-cache decoding, batch 1
    python -m bench.step_ab peers --shape B --dtype fp32  # train_bench's configurations, paired
    python -m bench.step_ab loss --smoke --pairs 2        # tiny shapes: the code path (a test)

Prints each function's median step (or decode call) and the median of the paired time ratios
before / shipped (> 1: the shipped function is faster). `peers`: train_bench's configurations
(lmforge compiled and eager, GPT-2 and HF compiled), each its own model, alternating the same
way; time ratios each / lmforge compiled (> 1: lmforge compiled is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from bench import train_bench as tb
from bench.common import header
from pipeline.loss import _add_head_grad, _eager_from_logits, _fused_by_columns

WARMUP = 2


def rope_by_roll(x_BTNK, cos, sin):
    """apply_rope before: the halves swapped by one roll."""
    cos, sin = cos.to(x_BTNK.dtype), sin.to(x_BTNK.dtype)
    return x_BTNK * cos + x_BTNK.roll(x_BTNK.shape[-1] // 2, dims=-1) * sin


def fused_body_computed_columns(h_CD, w_VD, safe_C, vocab_size, bufs, want_grad):
    """FusedLoss's chunk body before: the column indices made inside the traced code, which
    inductor folds into its loop over each row (an index vector built per vector of logits,
    for the padding mask and the target's one-hot) instead of reading them."""
    cols_V = torch.arange(w_VD.shape[0], device=h_CD.device, dtype=torch.int32)
    return _fused_by_columns(h_CD, w_VD, safe_C.to(torch.int32), cols_V, vocab_size, want_grad)


def fused_body_int32_columns(h_CD, w_VD, safe_C, vocab_size, bufs, want_grad):
    """FusedLoss's chunk body before: the padding mask and the one-hot compared in int32."""
    safe_C, cols_V = torch.ops.lmforge.chunk_columns(safe_C, w_VD.shape[0], torch.int32)
    return _fused_by_columns(h_CD, w_VD, safe_C, cols_V, vocab_size, want_grad)


def eager_body_onednn(h_CD, w_VD, safe_C, vocab_size, bufs, want_grad):
    """ChunkedLoss's chunk body before, for fp32 on CPU: the logits from oneDNN's linear, a fresh
    tensor per chunk (no out=), instead of torch.mm into the reused buffer."""
    logits_CV = torch.ops.mkldnn._linear_pointwise(h_CD.contiguous(), w_VD, None, "none", [], "")
    return _eager_from_logits(logits_CV, safe_C, vocab_size, bufs, want_grad, h_CD.dtype)


def eager_from_logits_log_softmax(logits_CV, safe_C, vocab_size, bufs, want_grad, dtype):
    """ChunkedLoss's loss and gradient before: log_softmax into the buffer, the loss read from
    it, then exp in place for the gradient (two exps per element, two passes)."""
    C = len(logits_CV)
    logp_CV = bufs["probs"][:C]
    logits_CV[:, vocab_size:] = float("-inf")
    torch.log_softmax(logits_CV, dim=-1, out=logp_CV)
    loss_C = -logp_CV.gather(1, safe_C[:, None]).squeeze(1)
    if not want_grad:
        return (loss_C,), None
    grad_CV = logp_CV.exp_()
    grad_CV[bufs["rows"][:C], safe_C] -= 1.0
    return (loss_C,), grad_CV.to(dtype)


def add_whole(sum_VD, part_VD):
    """The eager loss's bf16 head gradient added into the fp32 sum before: whole, in one add_
    (on CPU a fresh fp32 copy of the operand per chunk)."""
    sum_VD += part_VD


def head_grad_zeros_addmm(sum_VD, grad_CV, hs_CD, eager):
    """The head's fp32 gradient before: a sum of V x D zeros first, and fp32 chunks added by
    Tensor.addmm_, which inductor traces into an out-of-place addmm (a copy of the sum per
    chunk). Other dtypes: as shipped."""
    if grad_CV.dtype != torch.float32:
        return _add_head_grad(sum_VD, grad_CV, hs_CD, eager)
    if sum_VD is None:
        sum_VD = hs_CD.new_zeros(grad_CV.shape[1], hs_CD.shape[1])
    return sum_VD.addmm_(grad_CV.T, hs_CD)


def one_query_block(T: int, S: int) -> list[tuple[int, int, int]]:
    """Causal eager attention before: every query against every key (one block), the scores
    above the diagonal computed and masked."""
    return [(0, T, S)]


def grad_from_kept_exps(dtype: torch.dtype) -> bool:
    """FusedLoss's chunk gradient before, in every dtype: the row's kept exponentials over their
    sum (one exp per element), into a C x V buffer of its own."""
    return False


def no_graph_passes() -> dict:
    """pipeline.graph_passes.compile_options before: inductor's own passes only (the tied
    weight's two gradients summed as autograd's decomposition leaves them)."""
    return {}


# name: (module, attribute, the function it replaced)
SWAPS = {"rope": ("model.model", "apply_rope", rope_by_roll),
         "loss": ("pipeline.loss", "_fused_body", fused_body_computed_columns),
         "columns": ("pipeline.loss", "_fused_body", fused_body_int32_columns),
         "logits": ("pipeline.loss", "_eager_body", eager_body_onednn),
         "softmax": ("pipeline.loss", "_eager_from_logits", eager_from_logits_log_softmax),
         "accumulate": ("pipeline.loss", "_add_by_blocks", add_whole),
         "headgrad": ("pipeline.loss", "_add_head_grad", head_grad_zeros_addmm),
         "causalblocks": ("pipeline.attention", "causal_blocks", one_query_block),
         "gradexp": ("pipeline.loss", "_grad_over_logits", grad_from_kept_exps)}
BUILD_SWAPS = {"tiedgrad": ("pipeline.parallelize", "compile_options", no_graph_passes)}


def decode_once(r: tb.Run, new_tokens: int) -> Callable[[], None]:
    from model import GPT, SamplingParams, generate

    torch.manual_seed(0)
    model = GPT(r.model_config()).eval()
    prompt = torch.randint(0, r.vocab, (1, 16)).tolist()
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    return lambda: generate(model, prompt, greedy)


def alternating(calls: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each call per round after WARMUP rounds, the order reversed every other round
    (no call always runs first)."""
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(WARMUP + rounds):
        for name in calls if i % 2 == 0 else reversed(list(calls)):
            t0 = time.perf_counter()
            calls[name]()
            if i >= WARMUP:
                seconds[name].append(time.perf_counter() - t0)
    return seconds


@contextlib.contextmanager
def shipped_put_back(module, attr: str) -> Iterator[None]:
    """module.attr as it was on entry, whatever the body set it to."""
    shipped = getattr(module, attr)
    try:
        yield
    finally:
        setattr(module, attr, shipped)


def paired(run_once: Callable[[], None], module, attr: str, fns: dict, pairs: int) -> dict:
    """alternating() of run_once with module.attr set to each of fns; the shipped one put back."""
    def with_fn(fn):
        def call():
            setattr(module, attr, fn)
            run_once()
        return call

    with shipped_put_back(module, attr):
        return alternating({name: with_fn(fn) for name, fn in fns.items()}, pairs)


def built_apart(r: tb.Run, module, attr: str, fns: dict, pairs: int) -> dict:
    """alternating() of one step per fn, each built (and compiled) with module.attr set to it."""
    steps = {}
    with shipped_put_back(module, attr):
        for name, fn in fns.items():
            setattr(module, attr, fn)
            steps[name] = tb.training_step(r)
    return alternating(steps, pairs)


def report(seconds: dict[str, list[float]], ref: str) -> list[str]:
    """Each call's median, and the median (and quartiles) of its time over `ref`'s, paired round
    by round (> 1: `ref` is the faster)."""
    lines = []
    for name, s in seconds.items():
        line = (f"  {name:18} median {statistics.median(s) * 1e3:8.1f} ms  "
                f"(min {min(s) * 1e3:.1f}, max {max(s) * 1e3:.1f})")
        if name != ref:
            ratios = [x / r for x, r in zip(s, seconds[ref])]
            q = statistics.quantiles(ratios, n=4)
            line += (f"  {name} / {ref}, paired: {statistics.median(ratios):.3f}x "
                     f"(quartiles {q[0]:.3f}-{q[2]:.3f})")
        lines.append(line)
    return lines


def peers(shapes, dims, shape: str, dtype: str) -> dict[str, Callable[[], None]]:
    """train_bench's configurations at one shape, each a step of its own model in this process."""
    configs = [(impl, c) for impl, c in tb.IMPLS if c or impl == "lmforge"]  # HF eager left out
    return {tb.name(impl, c): tb.training_step(tb.Run(impl, shapes[shape], c, "cpu", dtype, **dims))
            for impl, c in configs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("swap", choices=[*SWAPS, *BUILD_SWAPS, "peers"])
    p.add_argument("--shape", choices=list(tb.SHAPES), default="B")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="train_bench's tiny shapes: the code path")
    p.add_argument("--decode", action="store_true", help="time KV-cache decoding (128 tokens, "
                   "batch 1, fp32, eager) instead of the training step")
    a = p.parse_args()

    from pipeline.hardware import auto_dtype, dtype_name

    dtype = dtype_name(auto_dtype(torch.device("cpu"))[0]) if a.dtype == "auto" else a.dtype
    shapes, dims = (tb.SMOKE_SHAPES, tb.SMOKE) if a.smoke else (tb.SHAPES, tb.FULL)
    if a.swap == "logits" and (dtype != "fp32" or a.compile or a.decode):
        p.error("logits swaps the eager fp32 loss's kernel: run it with --dtype fp32, without "
                "--compile or --decode")
    if a.swap in ("softmax", "accumulate") and (a.compile or a.decode):
        p.error(f"{a.swap} swaps a step of the eager loss: run it without --compile or --decode")
    if a.swap in BUILD_SWAPS and (not a.compile or a.decode):
        p.error(f"{a.swap} swaps what torch.compile runs: run it with --compile, without --decode")
    if a.swap == "peers":
        seconds = alternating(peers(shapes, dims, a.shape, dtype), a.pairs)
        print(header())
        print(f"train_bench's configurations, shape {a.shape} (V {shapes[a.shape]}), {dtype}, "
              f"{a.pairs} rounds after {WARMUP} warm-up, one process")
        print("\n".join(report(seconds, tb.name("lmforge", True))))
        return
    module_name, attr, before = {**SWAPS, **BUILD_SWAPS}[a.swap]
    module = importlib.import_module(module_name)
    fns = {"shipped": getattr(module, attr), "before": before}
    kernel = "eager" if a.swap == "causalblocks" else "auto"  # the swap is in the eager kernel
    r = tb.Run("lmforge", shapes[a.shape], a.compile, "cpu", dtype, attention=kernel, **dims)
    if a.swap in BUILD_SWAPS:
        seconds = built_apart(r, module, attr, fns, a.pairs)
    else:
        run_once = decode_once(r, 128) if a.decode else tb.training_step(r)
        seconds = paired(run_once, module, attr, fns, a.pairs)
    what = "decode, fp32" if a.decode else f"{'compiled' if a.compile else 'eager'}, {dtype}"
    print(header())
    print(f"{module_name}.{attr}: shipped vs before, shape {a.shape} (V {r.vocab}), {what}, "
          f"{a.pairs} pairs after {WARMUP} warm-up")
    print("\n".join(report(seconds, "shipped")))


if __name__ == "__main__":
    main()
