"""Peak memory of loading a sharded Hugging Face checkpoint (`checkpoint.init_from`, `--ckpt hf:DIR`)
into lmforge's model on one process, against the model's own bytes and against transformers'
`from_pretrained` of the same directory (the reference, measured in the same run).

    python -m bench.hf_load_memory                 # SmolLM2-135M's shape, bf16 safetensors, 3 shards
    python -m bench.hf_load_memory --small         # a 4-layer model, for a quick look

A random model of the shape is written once with save_pretrained (bf16, sharded by
--shard-size), beside a 1-layer model of a small vocabulary. Each load then runs in a fresh
process: it loads the 1-layer model first (imports and one-time set-up, ~30 MB for either loader,
are not the checkpoint's), resets its peak RSS (/proc/self/clear_refs), loads the model, and
reports the peak (VmHWM) minus the RSS before that load.
lmforge's model is fp32 (the trainer's master weights), as is transformers' load here (dtype
float32), so both hold 4 bytes a parameter; the aim is a peak <= 1.3x those bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, emit, header

MB = 2**20
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
SMALL = SMOLLM2_135M | dict(num_hidden_layers=4, vocab_size=8192)
WARM_UP = SMOLLM2_135M | dict(num_hidden_layers=1, vocab_size=256)


def write_model(out: Path, shape: dict, shard_size: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size=shard_size)


def rss_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    raise RuntimeError(key)


def measure(loader: str, directory: Path) -> dict:
    """In this (fresh) process: load DIR/warm_up, then DIR/model with `loader`; the second load's
    peak and its model's bytes in MB."""
    import torch
    import transformers

    from lmforge.pipeline.checkpoint.hf_init import load_hf_model

    load = {"lmforge": load_hf_model,
            "transformers": lambda d: transformers.AutoModelForCausalLM.from_pretrained(
                d, dtype=torch.float32)}[loader]
    load(directory / "warm_up")  # dropped at once
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here
    before = rss_mb("VmRSS:")
    model = load(directory / "model")
    peak = rss_mb("VmHWM:") - before
    held = sum(t.numel() * t.element_size() for t in {id(t): t for t in
               [*model.parameters(), *model.buffers()]}.values())
    return {"peak_mb": peak, "model_mb": held / MB}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="a 4-layer, 8k-vocabulary model")
    p.add_argument("--shard-size", default="100MB", help="save_pretrained's max_shard_size")
    p.add_argument("--out", type=Path, help="also write the table to this file")
    p.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # loader, directory (child)
    a = p.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure[0], Path(a.measure[1]))))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        write_model(d / "model", SMALL if a.small else SMOLLM2_135M, a.shard_size)
        write_model(d / "warm_up", WARM_UP, a.shard_size)
        files = sorted((d / "model").glob("*.safetensors"))
        stored = sum(f.stat().st_size for f in files) / MB
        lines = [header(), f"model: {'small' if a.small else 'SmolLM2-135M'} shape, bf16 safetensors "
                 f"{stored:,.1f} MB in {len(files)} files (max_shard_size {a.shard_size}); fp32 in memory",
                 "", f"{'loader':<14}{'model MB':>10}{'peak MB':>10}{'peak/model':>12}"]
        results = {}
        for loader in ("transformers", "lmforge"):
            res = subprocess.run([sys.executable, "-m", "bench.hf_load_memory", "--measure", loader,
                                  str(d)], cwd=ROOT, capture_output=True, text=True, check=True)
            r = results[loader] = json.loads(res.stdout.strip().splitlines()[-1])
            lines.append(f"{loader:<14}{r['model_mb']:>10,.1f}{r['peak_mb']:>10,.1f}"
                         f"{r['peak_mb'] / r['model_mb']:>12.2f}x")
        ours, ref = results["lmforge"], results["transformers"]
        ratio = ours["peak_mb"] / ours["model_mb"]
        lines += ["", f"lmforge peak / its model's bytes: {ratio:.2f}x (aim <= 1.3x: "
                  f"{'ok' if ratio <= 1.3 else 'MISSED'}); lmforge peak / transformers' peak: "
                  f"{ours['peak_mb'] / ref['peak_mb']:.2f}x"]
    emit(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
