"""Quality per token on text the presets were not tuned on (issue #65). Each recipe trains at the
demo's shape (d_model 256, 4 layers, seq 256, 8,192 tokens a step) on the tuning corpus
(builtin:pystdlib) and on judging corpora of prose from Debian packages (`fortunes`, a document a
fortune, 0.75M train tokens: the demo's horizon; `kerneldoc`, the Linux kernel's documentation, a
document a file, 6.66M: one epoch at 4x it), each with a 4,096-id BPE of its own; one scorer gives
every model's mean next-token cross-entropy (nats, from its logits) over the first --tokens of the
val split, in `lmforge eval`'s windows. The peer: nanochat's own recipe from a checkout (its GPT,
MuonAdamW, schedules and lr/wd scaling, as scripts/base_train.py computes them), fed the rows
lmforge's loader gives a run of that seed.

    nice -n 10 python -m bench.quality --nanochat DIR --out bench/results/quality_avx2.txt
    python -m bench.quality --steps 800 --corpora kerneldoc --recipes tiny nanochat --nanochat DIR

A recipe: tiny, modern, nanochat, or NAME=CONFIG.toml[:--dotted.key value ...]. Each run's loss goes
to --ledger (JSON lines); a run already there is not run again, so recipes and seeds add up, and
--report prints the table of what the ledger holds (for --corpora) without training.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import ROOT, emit, exit_on_sigterm, header, machine
from lmforge.data_prep.shards import load_manifest
from lmforge.data_prep.sources import COMPRESSED, format_suffix
from lmforge.model.model import IGNORE_INDEX
from lmforge.pipeline.data.loader import Source, TrainLoader
from lmforge.pipeline.data.rows import build_rows
from lmforge.pipeline.data.windows import TokenWindows
from lmforge.pipeline.evaluate import eval_batches

PRESETS = {"tiny": "configs/tiny.toml", "modern": "configs/tiny_modern.toml"}
SEQ, ROWS = 256, 32  # the demo's step: 32 rows of 256 tokens
# In-loop eval, tasks and samples cut to nothing: the bench scores the final checkpoint itself.
QUIET = ["--eval.every", "0", "--eval.tokens", "256", "--eval.tasks", "[]", "--sample.every", "0",
         "--sample.max_new_tokens", "1", "--checkpoint.every", "0", "--log.log_every", "50",
         "--train.dtype", "fp32"]  # as the peer, on every CPU kind: the ledger spans machines


def fail(msg: str):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def fortunes_docs(directory: Path) -> list[str]:
    """Each fortune (text between lines of '%') of the UTF-8 text files directly in `directory`:
    not the .dat indexes, the .u8 links, subdirectories (off/) or binary files."""
    docs = []
    for f in sorted(directory.iterdir()):
        if f.is_symlink() or not f.is_file() or f.suffix in (".dat", ".u8"):
            continue
        try:
            text = f.read_bytes().decode()
        except UnicodeDecodeError:
            continue
        if "\0" not in text:
            docs += [d.strip("\n") for d in ("\n" + text.replace("\r\n", "\n")).split("\n%\n")]
    return [d for d in docs if d.strip() and d.strip() != "%"]


def kerneldoc_docs(directory: Path) -> list[str]:
    """Each reStructuredText or plain-text file (compressed, as Debian gzips them, or not) under
    `directory`, a document a file: not the translations (other languages) or devicetree/ (YAML
    bindings), not scripts or images."""
    docs = []
    for f in sorted(directory.rglob("*")):
        parts = f.relative_to(directory).parts
        if f.is_file() and format_suffix(f) in (".rst", ".txt") and not {"translations",
                                                                         "devicetree"} & set(parts):
            with COMPRESSED.get(f.suffix, open)(f, "rb") as h:
                docs.append(h.read().decode(errors="replace").replace("\r\n", "\n"))
    return [d for d in docs if d.strip()]


@dataclass(frozen=True)
class Judge:
    """A judging corpus: text an installed Debian package holds."""
    docs: Callable[[Path], list[str]]
    directory: Path
    package: str
    val_fraction: float  # of documents: enough for --tokens of val (fortunes' 1 % held < 65k)


JUDGES = {"fortunes": Judge(fortunes_docs, Path("/usr/share/games/fortunes"), "fortunes", 0.1),
          "kerneldoc": Judge(kerneldoc_docs, Path("/usr/share/doc/linux-doc-6.1/Documentation"),
                             "linux-doc-6.1", 0.02)}
CORPORA = ("pystdlib", *JUDGES)


def prepare(work: Path, corpus: str, directory: Path | None) -> Path:
    """The corpus prepared with a 4,096-id BPE of its own (once; reused after)."""
    out, source, extra = work / "data" / corpus, "builtin:pystdlib", []
    if (out / "manifest.json").is_file():
        return out
    if judge := JUDGES.get(corpus):
        source, extra = str(work / f"{corpus}.jsonl"), ["--val-fraction", str(judge.val_fraction)]
        work.mkdir(parents=True, exist_ok=True)
        Path(source).write_text("".join(json.dumps({"text": d}) + "\n"
                                        for d in judge.docs(directory)))
    child([sys.executable, "-m", "lmforge.launch.cli", "prepare", "--source", source, "--tokenizer",
           "bpe:4096", "--out", str(out), "--quiet", *extra], 3600, f"preparing {out}")
    return out


def parse_recipe(spec: str) -> tuple[str, str | None, list[str]]:
    """A --recipes entry -> (name, config or None for nanochat, overrides)."""
    if spec in PRESETS or spec == "nanochat":
        return spec, PRESETS.get(spec), []
    name, eq, rest = spec.partition("=")
    config, _, overrides = rest.partition(":")
    if not (eq and name and config.endswith(".toml")):
        fail(f"recipe {spec!r} is not tiny, modern, nanochat or NAME=CONFIG.toml[:--key value "
             "...]; e.g. 'wd=configs/tiny.toml:--optim.weight_decay 0.1'")
    return name, config, overrides.split()


def child(cmd: list[str], timeout: float, what: str, env: dict | None = None) -> None:
    """A run in its own process, under a timeout; a failure in one error line."""
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                             env=None if env is None else os.environ | env)
    except subprocess.TimeoutExpired:
        fail(f"{what} ran past --timeout {timeout:.0f} s; raise it")
    if res.returncode:
        fail(f"{what} failed ({res.returncode}): {(res.stderr.strip().splitlines() or ['?'])[-1]}")


def nanochat_config(nanochat: Path, vocab: int, depth: int = 4):
    """nanochat's GPTConfig as base_train.py builds it for --depth DEPTH --aspect-ratio 64
    --head-dim 64 (runs/runcpu.sh's) --window-pattern L --max-seq-len 256: d_model 256, 4 heads."""
    sys.path.insert(0, str(nanochat))
    os.environ.setdefault("NANOCHAT_DTYPE", "float32")
    from nanochat.gpt import GPTConfig

    return GPTConfig(sequence_len=SEQ, vocab_size=vocab, n_layer=depth, n_head=depth,
                     n_kv_head=depth, n_embd=depth * 64, window_pattern="L")


def train_nanochat(nanochat: Path, data: Path, out: Path, steps: int, seed: int) -> None:
    """base_train.py's optimizer, lr/wd scaling and schedules, one 32-row step a micro-batch."""
    vocab = load_manifest(data).vocab_size
    cfg = nanochat_config(nanochat, vocab)
    from nanochat.gpt import GPT

    def scaling_params(c):  # base_train.get_scaling_params
        with torch.device("meta"):
            counts = GPT(c).num_scaling_params()
        return counts["transformer_matrices"] + counts["lm_head"]

    B, B_REF, RATIO = SEQ * ROWS, 2**19, 12  # --total-batch-size; the d12 batch; data:param
    d_ref = RATIO * scaling_params(nanochat_config(nanochat, vocab, 12))
    lr_scale = (B / B_REF) ** 0.5
    wd = 0.28 * lr_scale * d_ref / int(RATIO * scaling_params(cfg))
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu").init_weights()
    opt = model.setup_optimizer(unembedding_lr=0.008 * lr_scale, embedding_lr=0.3 * lr_scale,
                                scalar_lr=0.5 * lr_scale, matrix_lr=0.02 * lr_scale, weight_decay=wd)
    down = round(0.65 * steps)  # warmup 40 steps, warmdown 65 % to 5 %; momentum 0.85-0.97-0.90
    lr_mult = lambda it: ((it + 1) / 40 if it < 40 else 1.0 if it <= steps - down
                          else (steps - it) / down * 0.95 + 0.05)
    momentum = lambda it: (0.85 + it / 400 * 0.12 if it < 400 else 0.97 if it < steps - down
                           else 0.97 - (it - steps + down) / down * 0.07)
    loader = TrainLoader([Source("train", build_rows(TokenWindows(data, "train", SEQ, vocab),
                                                     "doc"))], ROWS, 1, 0, 1, seed)
    for it in range(steps):
        ((x_BT, y_BT),) = loader.next_micro_batches()
        model(x_BT, y_BT.masked_fill(y_BT == IGNORE_INDEX, -1)).backward()  # its ignore_index
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lr_mult(it)
            if group["kind"] == "muon":
                group["momentum"] = momentum(it)
                group["weight_decay"] = wd * 0.5 * (1 + math.cos(math.pi * it / steps))
        opt.step()
        model.zero_grad(set_to_none=True)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"vocab": vocab, "state": model.state_dict()}, out / "model.pt")


def model_of(run: Path, nanochat: Path | None):
    """A trained model, logits out: lmforge's inference loader, or nanochat's GPT."""
    if nanochat is None:
        from lmforge.pipeline.inference import load_for_inference

        return load_for_inference(run).model
    saved = torch.load(run / "model.pt", map_location="cpu")
    cfg = nanochat_config(nanochat, saved["vocab"])  # puts nanochat on the path
    from nanochat.gpt import GPT

    model = GPT(cfg)
    model.load_state_dict(saved["state"])
    return model.eval()


@torch.no_grad()
def score(model, data: Path, tokens: int) -> float:
    """Mean next-token cross-entropy (nats) over the first `tokens` val targets."""
    total, n = 0.0, 0
    for x_BT, y_BT in eval_batches(TokenWindows(data, "val", SEQ, None), 8, 0, 1, tokens):
        logits_BTV = model(x_BT).float()
        total += F.cross_entropy(logits_BTV.flatten(0, 1), y_BT.flatten(), reduction="sum",
                                 ignore_index=IGNORE_INDEX).item()
        n += int((y_BT != IGNORE_INDEX).sum())
    return total / n


def run_one(a, recipe: tuple, corpus: str, seed: int, data: Path) -> dict:
    """Train one recipe on one corpus and score it: the ledger's record."""
    spec, name, config, overrides = recipe
    run, t0 = a.work / "runs" / f"{name}_{corpus}_s{a.steps}_seed{seed}", time.time()
    shutil.rmtree(run, ignore_errors=True)  # not in the ledger: a killed run's, or another spec's
    if config is None:  # nanochat's optimizer steps eager: the same arithmetic, no cold compile
        child([sys.executable, "-m", "bench.quality", "--peer", str(run), "--data", str(data),
               "--nanochat", str(a.nanochat), "--steps", str(a.steps), "--seed", str(seed)],
              a.timeout, run.name, {"TORCHDYNAMO_DISABLE": "1"})
    else:
        child([sys.executable, "-m", "lmforge.launch.cli", "train", "--config", config,
               "--data.path", str(data), "--log.out_dir", str(run), "--train.max_steps",
               str(a.steps), "--train.seed", str(seed), *QUIET, *overrides], a.timeout, run.name)
    loss = score(model_of(run, a.nanochat if config is None else None), data, a.tokens)
    return {"spec": spec, "corpus": corpus, "steps": a.steps, "seed": seed, "tokens": a.tokens,
            "loss": loss, "train_s": round(time.time() - t0, 1), "date": time.strftime("%F %R"),
            "machine": machine()}


def key(r: dict) -> tuple:
    return r["spec"], r["corpus"], r["steps"], r["seed"], r["tokens"]


def table(a, recipes: list, records: list[dict]) -> list[str]:
    """recipe x corpus: mean +- sd over seeds, the difference to the baseline's mean, each seed."""
    by = {key(r): r["loss"] for r in records}
    got = {(r[1], c): [by[k] for s in range(1, a.seeds + 1) if (k := (r[0], c, a.steps, s, a.tokens))
                       in by] for r in recipes for c in a.corpora}
    lines = [header(), f"# {a.steps} steps of {SEQ * ROWS} tokens (d_model 256, 4 layers, seq {SEQ},"
             f" unless a recipe's overrides say otherwise), seeds 1..{a.seeds}; val loss (nats)"
             f" over the first {a.tokens} val tokens of each corpus, one scorer; diff = mean -"
             f" {a.baseline}'s mean",
             f"{'recipe':<12}"
             + "".join(f"{c + ' mean +- sd (n)':>28}{'diff':>9}" for c in a.corpora)
             + "   per seed"]
    for _, name, *_ in recipes:
        row, seeds = f"{name:<12}", []
        for c in a.corpora:
            xs, base = got[name, c], got[a.baseline, c]
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            row += f"{f'{statistics.mean(xs):.4f} +- {sd:.4f} ({len(xs)})' if xs else '-':>28}"
            row += f"{f'{statistics.mean(xs) - statistics.mean(base):+.4f}' if xs and base else '-':>9}"
            seeds.append(c[:4] + " " + " ".join(f"{x:.4f}" for x in xs))
        lines.append(row + "   " + "; ".join(seeds))
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=["tiny", "modern", "nanochat"])
    p.add_argument("--baseline", default="tiny", help="a recipe's name")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, default=2, help="seeds 1..N")
    p.add_argument("--tokens", type=int, default=65536, help="val tokens scored per corpus")
    p.add_argument("--corpora", nargs="+", choices=CORPORA, default=list(CORPORA[:2]),
                   help="the corpora to train on, or to report (--report): the table's columns")
    p.add_argument("--nanochat", type=Path, help="a nanochat checkout (the peer; skipped without)")
    for name, judge in JUDGES.items():
        p.add_argument(f"--{name}", type=Path, default=judge.directory,
                       help=f"the {name} corpus's directory (Debian's {judge.package})")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "quality")
    p.add_argument("--ledger", type=Path, help="runs' JSON lines (default WORK/runs.jsonl)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per training run")
    p.add_argument("--out", type=Path, help="also write the table here (bench/results/...)")
    p.add_argument("--report", action="store_true", help="the ledger's table only: train nothing")
    for hidden in ("--peer", "--data", "--seed"):  # the nanochat child's
        p.add_argument(hidden, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    exit_on_sigterm()
    if a.peer:
        return train_nanochat(a.nanochat, Path(a.data), Path(a.peer), a.steps, int(a.seed))
    for name in [] if a.report else set(a.corpora) & set(JUDGES):
        if not getattr(a, name).is_dir():
            fail(f"no {name} directory {getattr(a, name)}: install Debian's (apt-get install -y "
                 f"{JUDGES[name].package}) or pass --{name} DIR")
    if a.nanochat and not (a.nanochat / "nanochat" / "gpt.py").is_file():
        fail(f"--nanochat {a.nanochat} has no nanochat/gpt.py; pass a nanochat checkout")
    a.work, a.nanochat = a.work.resolve(), a.nanochat and a.nanochat.resolve()  # children: cwd ROOT
    recipes = [(s, *parse_recipe(s)) for s in a.recipes]
    if a.baseline not in [r[1] for r in recipes]:
        fail(f"--baseline {a.baseline} is not among --recipes; add it there")
    if not (a.report or a.nanochat) and any(r[2] is None for r in recipes):
        print("nanochat's recipe skipped: no --nanochat DIR (a nanochat checkout)")
        recipes = [r for r in recipes if r[2] is not None]
    ledger = a.ledger or a.work / "runs.jsonl"
    records = [json.loads(s) for s in ledger.read_text().splitlines()] if ledger.exists() else []
    done = set(map(key, records))
    for corpus in [] if a.report else a.corpora:
        data = prepare(a.work, corpus, getattr(a, corpus, None))
        for seed in range(1, a.seeds + 1):  # every recipe's seed 1 first: a cut-short run compares
            for recipe in recipes:
                if (recipe[0], corpus, a.steps, seed, a.tokens) in done:
                    continue
                records.append(r := run_one(a, recipe, corpus, seed, data))
                print(json.dumps(r), flush=True)
                ledger.parent.mkdir(parents=True, exist_ok=True)
                with ledger.open("a") as f:
                    f.write(json.dumps(r) + "\n")
    emit(table(a, recipes, records), a.out)


if __name__ == "__main__":
    main()
