"""Training throughput and memory: lmforge (eager, compiled) vs a GPT-2-style reference and HF's
LlamaForCausalLM, at two shapes (a GPT-2-size vocabulary, where the head dominates, and a small
one), in the dtype train.dtype=auto picks on the device.

    python -m bench.train_bench               # 2 rounds, both shapes, memory (~25 min, 2 cores)
    python -m bench.train_bench --quick       # shape B only, 1 round, few steps
    python -m bench.train_bench --device cuda --shapes A --rounds 1 --no-memory   # gpu_check.sh
    python -m bench.train_bench --smoke       # tiny shapes, eager only: the code path (a test)

Every configuration runs in a fresh process (its peak memory its own, its compile warm from
inductor's disk cache: a cold compile is measured apart), interleaved round after round: on a
noisy machine only ratios measured in the same run mean anything, and the spread shows how
much; a configuration's tok/s is its best round (best_of), and the targets' speed ratios pair
each round's runs (paired: their median over rounds). A training step is the same for
all: forward + mean cross-entropy (under bf16 autocast when the dtype is bf16), backward,
gradient clipping at 1.0, AdamW. lmforge's step is the
pipeline's (parallelize and its loss, ParallelModel.loss: train.loss, auto unless --loss says
otherwise, in the compiled graph when compiled); the references are compiled whole (model +
loss). MFU is against the GPU's datasheet peak, or on CPU the matmul peak
measured in the run's dtype (bench/cpu_peak.py). Peak memory is the process's peak
RSS on CPU, torch.cuda.max_memory_allocated on CUDA. `faults` is the minor page faults of a step
(a fresh big tensor costs one per 4 KiB on CPU). `mm ms` is a step's matmul time from the
profiler and `other` the rest of the step, what fusion can cut: medians over PROFILED_PAIRS
pairs, after the timed steps, of an unprofiled step and the next one profiled
(bench.profile_ops.paired_matmul_ms). Each shape ends with the issue's targets, ok or MISSED
(bf16-native ones where the dtype is bf16, else an fp32 CPU's no-regression ones). Then the cold
compile (what train.compile=auto weighs) and memory at shape A (peak at batch 1 and 8, the
largest micro-batch lmforge fits in HF's peak).

Same FLOPs everywhere: lmforge's SwiGLU MLP with d_mlp 688 (3 matrices) = GPT-2's 4d GELU MLP
(2 matrices of 1024); the head is D x 50,304 (shape A, GPT-2 vocabulary padded) or 4,096 (B).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

from bench.common import ROOT, exit_on_sigterm, machine, memory_kind, memory_mb, minor_faults
from bench.peers import build_gpt2, build_hf


@dataclass(frozen=True)
class Run:
    """What one worker process builds and measures."""

    impl: str  # lmforge | gpt2 | hf
    vocab: int
    compiled: bool
    device: str
    dtype: str  # bf16 | fp32: what every implementation computes in
    steps: int = 6
    batch: int = 8
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 4
    seq_len: int = 256
    d_mlp: int = 688
    profile: bool = True  # time profiled steps' matmuls after the timed ones
    loss: str = "auto"  # lmforge: train.loss (auto | full | chunked)
    model_toml: str | None = None  # lmforge: the [model] of this config file (vocab and T: the run's)
    attention: str = "auto"  # lmforge: train.attention (auto | sdpa | eager)

    def model_config(self):
        """lmforge's model at this run's shape (every head its own K/V head, as the peers'), or
        model_toml's model at this run's vocabulary and sequence length."""
        from lmforge.model import ModelConfig

        if self.model_toml:
            from lmforge.pipeline.config import load_config

            m = load_config(self.model_toml, []).model
            return replace(m, vocab_size=self.vocab, max_seq_len=self.seq_len)
        return ModelConfig(vocab_size=self.vocab, n_layer=self.n_layer, n_head=self.n_head,
                           n_kv_head=self.n_head, d_model=self.d_model, d_mlp=self.d_mlp,
                           max_seq_len=self.seq_len)


FULL = dict(d_model=256, n_layer=4, n_head=4, seq_len=256, d_mlp=688)
SMOKE = dict(d_model=64, n_layer=2, n_head=4, seq_len=64, d_mlp=172)
SHAPES = {"A": 50257, "B": 4096}  # real vocabulary; the heads pad it to a multiple of 64
SMOKE_SHAPES = {"A": 2048, "B": 256}
PROFILED_PAIRS = 3
IMPLS = [("lmforge", False), ("lmforge", True), ("gpt2", True), ("hf", False), ("hf", True)]
SMOKE_IMPLS = [("lmforge", False), ("gpt2", False), ("hf", False)]


def build_lmforge(r: Run, device):
    from lmforge.model import GPT
    from lmforge.pipeline import attention
    from lmforge.pipeline.config import OptimConfig
    from lmforge.pipeline.hardware import DTYPES
    from lmforge.pipeline.loss import resolve_loss
    from lmforge.pipeline.optim.optimizers import build_optimizer
    from lmforge.pipeline.parallel.distributed import DistInfo
    from lmforge.pipeline.parallel.parallelize import Precision, parallelize

    info = DistInfo(0, 0, 1, device)
    model = GPT(r.model_config()).to(device)
    precision = Precision(DTYPES[r.dtype], device)
    choice = attention.resolve(r.attention, device, precision.dtype, r.seq_len)
    loss = resolve_loss(r.loss, device, model.cfg.padded_vocab_size, r.batch * r.seq_len)
    pm = parallelize(model, info, parallel="none", precision=precision, compile_model=r.compiled,
                     activation_checkpointing=False, loss=loss, attend=attention.kernel(choice))
    return model, pm.loss, build_optimizer(pm.module, OptimConfig(), device)  # the pipeline's loss


def training_step(r: Run):
    """The step every configuration runs, as a function of no arguments on a fixed random batch:
    forward + mean cross-entropy (in pipeline.parallel.parallelize.Precision's autocast: bf16 autocast
    over fp32 weights when r.dtype is bf16), backward, gradient clipping at 1.0, AdamW."""
    import torch

    from lmforge.pipeline.hardware import DTYPES, configure_cuda
    from lmforge.pipeline.parallel.parallelize import Precision

    device = torch.device(r.device)
    if device.type == "cuda":
        configure_cuda()  # what the pipeline sets (TF32 for fp32 matmuls), for every implementation
    torch.manual_seed(0)
    build = {"lmforge": build_lmforge, "gpt2": build_gpt2, "hf": build_hf}[r.impl]
    model, step, opt = build(r, device)
    x_BT, y_BT = torch.randint(0, r.vocab, (2, r.batch, r.seq_len), device=device)
    autocast = Precision(DTYPES[r.dtype], device).autocast(model)

    def one_step() -> torch.Tensor:
        with autocast:
            loss = step(x_BT, y_BT)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return loss.detach()

    return one_step


def check_loss(r: Run, losses: list[float]) -> None:
    """A step timed fast but computing something else must not pass as a figure: a cross-entropy
    is finite and above 0 (a compiled kernel built for another ISA gave -0.0: bench/README.md).
    The bound is loose on purpose: each implementation starts from its own init (the GPT-2
    reference's default one starts at 5-20 ln V) and memorises the bench's fixed batch quickly."""
    bad = [(i, loss) for i, loss in enumerate(losses) if not (math.isfinite(loss) and loss > 0)]
    if bad:
        i, loss = bad[0]
        raise SystemExit(f"error: {name(r.impl, r.compiled)}: loss {loss:.4f} at step {i}, not a "
                         f"cross-entropy (finite, above 0): this configuration computes something "
                         f"else; check it before reading its speed")


def worker(r: Run) -> dict:
    from bench.profile_ops import paired_matmul_ms

    one_step = training_step(r)
    base_mb = memory_mb(r.device, peak=False)
    times, faults, losses = [], [], []
    for _ in range(r.steps + 2):  # 2 warm-up steps: the compile, then the first compiled step
        f0, t0 = minor_faults(), time.perf_counter()
        loss = one_step()
        times.append(time.perf_counter() - t0)
        faults.append(minor_faults() - f0)
        losses.append(loss)
    check_loss(r, [loss.item() for loss in losses])
    peak_mb = memory_mb(r.device, peak=True)  # before the profiler's own allocations
    steady_s = statistics.median(times[2:])
    nan = float("nan")
    mm_ms, other_ms = paired_matmul_ms(one_step, PROFILED_PAIRS, r.device) if r.profile else (nan, nan)
    return {"tok_s": r.batch * r.seq_len / steady_s, "first_step_s": times[0],
            "steady_s": steady_s, "peak_mb": peak_mb,
            "base_mb": base_mb, "train_mb": peak_mb - base_mb,
            "faults_per_step": statistics.median(faults[2:]),
            "matmul_ms": mm_ms, "non_matmul_ms": other_ms}


def measure(r: Run, env=None) -> dict:
    cmd = [sys.executable, "-m", "bench.train_bench", "--worker", json.dumps(asdict(r))]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode != 0:
        errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        raise SystemExit("\n".join(errors) or f"error: {name(r.impl, r.compiled)} exited "
                         f"{res.returncode}:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def name(impl, comp):
    return f"{impl} {'compiled' if comp else 'eager'}"


# glibc keeps some freed blocks for reuse, so a process's peak RSS also depends on what the
# allocator held on to. A fixed mmap threshold hands every block >= 1 MiB back to the OS on free:
# RSS then follows the live tensors, for every implementation alike. (No effect on CUDA memory.)
LIVE_RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
MAX_SEARCH_RUNS = 8  # the largest-micro-batch search converges in 2-4 runs at the real shapes
SMOKE_SEARCH_RUNS = 2  # --smoke: the search's code path, not its answer


def memory_section(base: Run, impls: list[tuple[str, bool]], max_runs: int = MAX_SEARCH_RUNS) -> None:
    """Peak memory at batch 1 and base.batch per configuration (fresh process, 2 steps,
    LIVE_RSS_ENV). The budget is HF's lowest peak at base.batch; lmforge's largest micro-batch
    within it is estimated from its per-sequence slope, then run, and stepped down until it fits."""
    env = {**os.environ, **LIVE_RSS_ENV}
    B0 = base.batch
    configs = [c for c in impls if c[0] in ("lmforge", "hf")]
    print(f"\nmemory at shape A ({memory_kind(base.device)} of a fresh process, 2 steps, {LIVE_RSS_ENV}):")
    fit = {}

    def peak(impl, comp, batch):
        return measure(replace(base, impl=impl, compiled=comp, steps=2, batch=batch,
                               profile=False), env)

    for impl, comp in configs:
        small, big = peak(impl, comp, 1), peak(impl, comp, B0)
        slope = (big["peak_mb"] - small["peak_mb"]) / (B0 - 1)
        fit[impl, comp] = (small["peak_mb"] - slope, slope, big)
        print(f"  {name(impl, comp):18} peak {small['peak_mb']:6.0f} MB at batch 1, "
              f"{big['peak_mb']:6.0f} MB at batch {B0} ({big['train_mb']:5.0f} MB above the "
              f"built model), {slope:4.0f} MB per sequence of {base.seq_len}, {big['tok_s']:5.0f} tok/s")
    budget = min(v[2]["peak_mb"] for k, v in fit.items() if k[0] == "hf")
    print(f"  budget: HF's lowest peak at batch {B0}, {budget:.0f} MB")
    for (impl, comp), (start, slope, at_batch) in fit.items():
        if impl != "lmforge":
            continue
        print(f"  lmforge {name('', comp).strip()}: peak at batch {B0} = "
              f"{at_batch['peak_mb'] / budget:.2f}x HF's")
        batch, tried = int((budget - start) / slope) if slope > 0 else 4 * B0, {}
        while batch > B0 and batch not in tried and len(tried) < max_runs:
            tried[batch] = p = peak("lmforge", comp, batch)["peak_mb"]
            print(f"    batch {batch}: peak {p:.0f} MB ({'fits' if p <= budget else 'over'})")
            if p <= budget and batch + 1 in tried:
                break
            # Secant through batch B0 and this one (the small-batch slope can mislead), then
            # one step at a time around the crossing.
            slope = (p - at_batch["peak_mb"]) / (batch - B0)
            guess = B0 + int((budget - at_batch["peak_mb"]) / slope) if slope > 0 else batch + 1
            batch = guess if guess not in tried else batch + 1 if p <= budget else batch - 1
        batch = max((b for b, p in tried.items() if p <= budget), default=B0)
        cut = f" (search stopped after {max_runs} runs)" if len(tried) == max_runs else ""
        print(f"    largest micro-batch in HF's budget: {batch} = {batch / B0:.2f}x HF's {B0}{cut}")


def cold_compile(shapes: dict[str, int], base: Run, res: dict) -> None:
    """lmforge's first compiled step with an empty inductor cache, less a steady step, and what
    the measured gain repays it in (why train.compile = auto is off on CPU)."""
    print("\ncold compile of lmforge (empty inductor cache; first step - steady step):")
    for s, vocab in shapes.items():
        with tempfile.TemporaryDirectory() as cache:
            r = measure(replace(base, impl="lmforge", vocab=vocab, compiled=True, steps=2,
                                profile=False),
                        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
        gain = statistics.median(paired(res, (s, "lmforge", True), [(s, "lmforge", False)]))
        cold = r["first_step_s"] - r["steady_s"]
        saved = 1 - 1 / gain
        repaid = f"repaid after {cold / saved:.0f} s of eager training" if saved > 0 else "never repaid"
        print(f"  {s}: {cold:.1f} s; compiled/eager {gain:.2f}x -> {repaid}")


def describe(device, dtype_arg: str):
    """(the dtype every implementation computes in, one line saying on what and why)."""
    import torch

    from bench.cpu_peak import cpu_peak
    from lmforge.pipeline.hardware import DTYPES, auto_dtype, datasheet_peak, dtype_name

    dtype, why = auto_dtype(device) if dtype_arg == "auto" else (DTYPES[dtype_arg], "as requested")
    peak = cpu_peak(dtype) if device.type == "cpu" else datasheet_peak(device, dtype)[0]
    where = machine(device.type) + (f", {torch.get_num_threads()} threads"
                                     if device.type == "cpu" else "")
    peak_s = f"{peak / 1e9:,.0f} GFLOP/s" if peak else "unknown"
    return dtype, peak, (f"{where}; dtype {dtype_name(dtype)} ({dtype_arg}: {why}); "
                         f"{dtype_name(dtype)} matmul peak {peak_s}")


def best_of(runs: list[dict]) -> float:
    """A configuration's tok/s in the table: its best round (each round the median of its steady
    steps). A shared host's noise only ever slows a run, so the fastest round is the least
    disturbed one: the issue's protocol (best of interleaved rounds). The rounds are printed beside
    it."""
    return max(r["tok_s"] for r in runs)


def paired(res: dict, top, others) -> list[float]:
    """Per round, top's tok/s over the fastest of `others` in that same round. The targets take
    the median of these: one lucky round of one configuration (a 1.3x swing on a shared host)
    moves a best-of ratio as far, and a median of paired ratios not at all."""
    return [r["tok_s"] / max(res[k][i]["tok_s"] for k in others) for i, r in enumerate(res[top])]


def pct(mfu: float | None) -> str:
    return f"{mfu:6.1%}" if mfu is not None else f"{'n/a':>6}"


def summary(s: str, peak_mb: dict, res: dict, mfu: dict, native: bool) -> list[str]:
    """lmforge's best setting at one shape against the issue's targets (bf16-native CPU or GPU:
    `native`; else an fp32 CPU's no-regression targets), one line each, ok or MISSED."""
    def typical(k):
        return statistics.median(r["tok_s"] for r in res[k])

    best = max((k for k in res if k[0] == "lmforge"), key=typical)
    peers = [k for k in res if k[0] != "lmforge"]
    peer = max(peers, key=typical)
    nm = {k: statistics.median(r["non_matmul_ms"] for r in v) for k, v in res.items()}
    mm = {k: statistics.median(r["matmul_ms"] for r in v) for k, v in res.items()}
    hf_eager_mem = peak_mb.get(("hf", False), min(v for k, v in peak_mb.items() if k[0] == "hf"))

    def line(what, value, target, ok):
        return f"  {s}: {what} = {value} (target {target}) {'ok' if ok else 'MISSED'}"

    def ratio_line(what, ratios, target):
        value = statistics.median(ratios)
        rounds = f" (rounds {' / '.join(f'{x:.2f}' for x in ratios)})" if len(ratios) > 1 else ""
        return line(what, f"{value:.2f}x{rounds}", f">= {target:.2f}x" if target else "-",
                    value >= (target or 0))

    out = [f"{s}: lmforge's best is {name(*best)}, {typical(best):,.0f} tok/s (median round)",
           ratio_line(f"{name(*best)} / each round's fastest peer ({name(*peer)} by median)",
                      paired(res, best, peers), 1.10 if native else 1.05)]
    if s == "A" and native and mfu[best] is not None:
        out.append(line("MFU", pct(mfu[best]).strip(), ">= 18%", mfu[best] >= 0.18))
    if ("lmforge", True) in res and ("lmforge", False) in res:
        out.append(ratio_line("lmforge compiled / eager", paired(res, ("lmforge", True),
                              [("lmforge", False)]), 1.20 if native else None))
    ratio = (1e3 * statistics.median(r["steady_s"] for r in res[best])) / mm[best]
    out.append(line("step time / its matmuls' time", f"{ratio:.2f}x", "<= 2x", ratio <= 2))
    if ("gpt2", True) in nm:
        rel = nm[best] / nm["gpt2", True]
        out.append(line("non-matmul ms, lmforge's best / gpt2 compiled", f"{nm[best]:.0f} / "
                        f"{nm['gpt2', True]:.0f} ms = {rel:.2f}x", "<= 0.6x", rel <= 0.6))
    if s == "A":  # the memory target; at B the process's own baseline is most of a peak
        mem = peak_mb[best] / hf_eager_mem
        out.append(line("peak memory / HF eager's", f"{mem:.2f}x", "<= 0.5x", mem <= 0.5))
    return out


def table(shapes: dict[str, int], impls, res: dict, base: Run, peak: float | None, dtype) -> list[str]:
    """Print one row per shape and configuration; return the targets' lines."""
    import torch

    from lmforge.model import GPT

    print(f"{'shape':5} {'config':18} {'tok/s per round':>22} {'best':>7} {'MFU':>6} "
          f"{'peak MB':>7} {'faults':>7} {'mm ms':>6} {'other':>6} {'1st step':>8}")
    lines = []
    for s, vocab in shapes.items():
        with torch.device("meta"):
            fpt = GPT(replace(base, vocab=vocab).model_config()).flops_per_token(base.seq_len)
        here = {k[1:]: v for k, v in res.items() if k[0] == s}
        tok_s = {k: best_of(v) for k, v in here.items()}
        mem = {k: max(r["peak_mb"] for r in v) for k, v in here.items()}
        mfu = {k: fpt * tok_s[k] / peak if peak else None for k in here}
        for impl, comp in impls:
            runs = here[impl, comp]
            per_round = " / ".join(f"{r['tok_s']:.0f}" for r in runs)
            print(f"{s:5} {name(impl, comp):18} {per_round:>22} {tok_s[impl, comp]:7.0f} "
                  f"{pct(mfu[impl, comp])} {mem[impl, comp]:7.0f} "
                  f"{statistics.median(r['faults_per_step'] for r in runs):7.0f} "
                  f"{statistics.median(r['matmul_ms'] for r in runs):6.0f} "
                  f"{statistics.median(r['non_matmul_ms'] for r in runs):6.0f} "
                  f"{statistics.median(r['first_step_s'] for r in runs):7.1f}s")
        lines += summary(s, mem, here, mfu, native=dtype == torch.bfloat16)
    return lines


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, eager configurations only")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--no-memory", action="store_true", help="skip the micro-batch estimate")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-compile measurement")
    p.add_argument("--shapes", default="AB", help="which shapes to time (default: both, AB)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--loss", default="auto", choices=["auto", "full", "chunked"],
                   help="lmforge's train.loss")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    a = parse_args()
    exit_on_sigterm()
    if a.worker:
        print(json.dumps(worker(Run(**json.loads(a.worker)))))
        return

    import torch

    from bench.cpu_peak import cpu_peak
    from lmforge.pipeline import attention
    from lmforge.pipeline.hardware import dtype_name
    from lmforge.pipeline.loss import resolve_loss

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype, peak, line = describe(device, a.dtype)
    dims = SMOKE if a.smoke else FULL
    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    shapes = {s: v for s, v in shapes.items() if s in ("B" if a.quick else a.shapes.upper())}
    impls = SMOKE_IMPLS if a.smoke else IMPLS
    rounds, steps = (1, 2) if a.smoke else (1, 3) if a.quick else (a.rounds, a.steps)
    base = Run("lmforge", 0, False, str(device), dtype_name(dtype), steps, **dims)
    base = replace(base, loss=a.loss)
    print(line)
    print(f"lmforge: train.attention = auto -> "
          f"{attention.resolve('auto', device, dtype, base.seq_len)}; train.loss = {a.loss} -> "
          + ", ".join(f"{s} {resolve_loss(a.loss, device, -(-v // 64) * 64, base.batch * base.seq_len)}"
                      for s, v in shapes.items()))
    print(f"d_model {base.d_model}, {base.n_layer} layers, {base.n_head} heads, T {base.seq_len}, "
          f"batch {base.batch}; {rounds} interleaved rounds x {steps} steps after 2 warm-up steps "
          f"(median step per run, best round per configuration); memory: {memory_kind(base.device)}\n")
    res = {(s, impl, comp): [] for s in shapes for impl, comp in impls}
    for _ in range(rounds):
        for s, vocab in shapes.items():
            for impl, comp in impls:
                r = measure(replace(base, impl=impl, vocab=vocab, compiled=comp))
                res[s, impl, comp].append(r)
                print(f"  [{s} {name(impl, comp)}: {r['tok_s']:.0f} tok/s, {r['peak_mb']:.0f} MB]",
                      file=sys.stderr, flush=True)  # partial results survive an interrupted run
    if device.type == "cpu":
        # A shared CPU can be slow for the second or so the probe takes: the best of two probes,
        # before and after the rounds, is the peak MFU is read against.
        cpu_peak.cache_clear()
        again = cpu_peak(dtype)
        print(f"{dtype_name(dtype)} matmul peak measured again after the rounds: {again / 1e9:,.0f} GFLOP/s; "
              f"MFU below is against {max(peak, again) / 1e9:,.0f}")
        peak = max(peak, again)
    print("\n" + "\n".join(table(shapes, impls, res, base, peak, dtype)))
    if ("lmforge", True) in impls and device.type == "cpu" and not (a.quick or a.no_cold):
        cold_compile(shapes, base, res)
    if "A" in shapes and not (a.quick or a.no_memory):
        memory_section(replace(base, vocab=shapes["A"]), impls,
                       SMOKE_SEARCH_RUNS if a.smoke else MAX_SEARCH_RUNS)


if __name__ == "__main__":
    main()
