"""Time and peak memory of `lmforge export --gguf` at the 124M shape (configs/gpt2_124m.toml's
model, the GPT-2 vocabulary, random init, fp32 on the CPU), against `lmforge export --hf` of the
same checkpoint measured in the same run (the reference: the same weights, written once).

    python -m bench.gguf_export [--out bench/results/gguf_export_avx2.txt]

Each export runs in a fresh process (`lmforge export` as a user runs it: loading the checkpoint
included) reporting its wall time and peak RSS (VmHWM); the model's fp32 bytes are the scale.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.common import GPT2_VOCAB, ROOT, emit, header, memory_mb

MB = 2**20
EXPORTS = {"--hf (reference)": ["--hf", "{out}/hf"], "--gguf f32": ["--gguf", "{out}/m.gguf"],
           "--gguf f16": ["--gguf", "{out}/m16.gguf", "--gguf-dtype", "f16"]}


def write_checkpoint(out: Path) -> int:
    """final/ of a random 124M-shaped model with the GPT-2 tokenizer; returns its fp32 bytes."""
    import torch

    from lmforge.data_prep.tokenizer import load_tokenizer, save_tokenizer_dir
    from lmforge.model import GPT
    from lmforge.pipeline.checkpoint.format import CheckpointMeta, save_consolidated
    from lmforge.pipeline.config import config_from_dict, load_config

    enc = load_tokenizer(str(GPT2_VOCAB))
    save_tokenizer_dir(enc, out / "tokenizer", "file", "gpt2")
    cfg = replace(load_config(ROOT / "configs" / "gpt2_124m.toml").model, vocab_size=enc.n_vocab)
    torch.manual_seed(0)
    model = GPT(cfg)
    meta = CheckpointMeta(step=0, model=cfg, config=config_from_dict({}), lineage="bench")
    save_consolidated(out / "final", model.state_dict(), meta, out / "tokenizer")
    return sum(t.numel() * 4 for t in model.state_dict().values())


def measure(argv: list[str]) -> dict:
    """In this (fresh) process: `lmforge export ARGV`, its wall time and the process's peak RSS."""
    from lmforge.launch.cli import main as lmforge

    start = time.perf_counter()
    assert lmforge(["export", *argv]) == 0
    return {"seconds": time.perf_counter() - start, "peak_mb": memory_mb("cpu", peak=True)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="also write the table to this file")
    p.add_argument("--measure", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # the child
    a = p.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model_mb = write_checkpoint(d) / MB
        lines = [header(), f"model: configs/gpt2_124m.toml's shape, vocabulary 50,257 (GPT-2), "
                 f"random init, fp32 {model_mb:,.1f} MB", "",
                 f"{'export':<18}{'seconds':>9}{'peak MB':>10}{'peak/model':>12}{'file MB':>10}"]
        results = {}
        for name, args in EXPORTS.items():
            argv = ["--ckpt", str(d / "final"), *(x.format(out=d) for x in args)]
            res = subprocess.run([sys.executable, "-m", "bench.gguf_export", "--measure", *argv],
                                 cwd=ROOT, capture_output=True, text=True, check=True)
            r = results[name] = json.loads(res.stdout.strip().splitlines()[-1])
            target = Path(argv[3])
            size = sum(f.stat().st_size for f in ([target] if target.is_file() else target.iterdir())
                       if f.is_file()) / MB
            lines.append(f"{name:<18}{r['seconds']:>9.1f}{r['peak_mb']:>10,.1f}"
                         f"{r['peak_mb'] / model_mb:>11.2f}x{size:>10,.1f}")
        ref = results["--hf (reference)"]
        lines.append("")
        for name in ("--gguf f32", "--gguf f16"):
            r = results[name]
            lines.append(f"{name} / --hf: time {r['seconds'] / ref['seconds']:.2f}x, "
                         f"peak {r['peak_mb'] / ref['peak_mb']:.2f}x")
    emit(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
