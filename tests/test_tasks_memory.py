"""Task scoring's memory is bounded by neither the vocabulary nor an example's choice count: the
largest logits any scoring batch holds, at GPT-2's padded vocabulary (50,304 ids), stay within
score.LOGITS_ELEMS, and an example of thousands of choices takes rows of at most ROW_TOKENS,
each choice's log-likelihood what it is scored alone. Measured on `lmforge eval
--tasks` over real files, every tensor an operator makes seen by a dispatch mode."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lmforge.data_prep.tokenizer import load_tokenizer_dir
from lmforge.launch.evaluate import main as eval_main
from lmforge.launch.prepare import main as prepare
from lmforge.pipeline.inference import load_for_inference
from lmforge.pipeline.parallel.parallelize import Precision
from lmforge.pipeline.tasks.evaluate import encode_task, load_task
from lmforge.pipeline.tasks.score import (
    LOGITS_ELEMS,
    MASK_ELEMS,
    ROW_TOKENS,
    Encoded,
    choice_loglikelihoods,
)
from tests.harness import run_args, train

VOCAB = 50257  # GPT-2's ids, padded to 50,304 in the model
CONTEXT = 32  # the model's context: every choice fits


class Largest(TorchDispatchMode):
    """The most elements of any tensor an operator returns whose last dimension spans the
    vocabulary (logits), and of any (.., T, T) one (attention masks and weights)."""

    def __init__(self):
        super().__init__()
        self.logits = self.square = self.longest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                if t.shape[-1] >= VOCAB:
                    self.logits = max(self.logits, t.numel())
                if t.dim() == 4 and t.shape[-1] == t.shape[-2]:
                    self.square = max(self.square, t.numel())
                    self.longest = max(self.longest, t.shape[-1])
        return out


@pytest.fixture(scope="module")
def big_vocab_run(tmp_path_factory) -> Path:
    """A 1-step run on data tokenized with GPT-2's number of ids: a .tiktoken file of the 256
    bytes then byte pairs (each a merge of two bytes: valid BPE ranks), and the end-of-text id."""
    root = tmp_path_factory.mktemp("vocab")
    ranks = [bytes([b]) for b in range(256)]
    ranks += [bytes([a, b]) for a in range(32, 256) for b in range(256)][:VOCAB - 1 - 256]
    (root / "pairs.tiktoken").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    assert prepare(["--source", "builtin:pystdlib", "--tokenizer", str(root / "pairs.tiktoken"),
                    "--out", str(root / "data"), "--max-docs", "40", "--val-docs", "6",
                    "--workers", "1", "--quiet"]) == 0
    out = root / "run"
    train(run_args(root / "data", out, "--model.max_seq_len", str(CONTEXT), "--data.seq_len",
                   str(CONTEXT), "--train.max_steps", "1", "--eval.every", "0",
                   "--eval.tasks", "[]", "--checkpoint.every", "0"))
    return out


def write(path: Path, examples: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


def scored(run: Path, task: Path) -> Largest:
    with Largest() as seen:
        assert eval_main(["--ckpt", str(run), "--tasks", str(task), "--device", "cpu"]) == 0
    return seen


def test_logits_within_the_budget_at_gpt2_vocab(big_vocab_run, tmp_path):
    """12 examples x 3 choices of ~10 scored tokens in one batch: ~360 x 50,304 logits (18 M)
    were computed at once; now chunks of at most LOGITS_ELEMS."""
    lines = [{"context": f"def f{i}(x):\n", "choices": [
        f"    return x + {i} * y - z / w", f"    print(x, {i}, 'abc', 'def')",
        f"    raise ValueError({i}) from err"], "gold": i % 3} for i in range(12)]
    seen = scored(big_vocab_run, write(tmp_path / "long.jsonl", lines))
    assert 0 < seen.logits <= LOGITS_ELEMS["cpu"], seen.logits


def test_many_choices_split_across_rows(big_vocab_run, tmp_path):
    """2,500 choices in one line made one row of ~7,000 tokens and a 7,000^2 mask; now rows of at
    most ROW_TOKENS, and a batch's masks hold at most MASK_ELEMS."""
    choices = [f"x{i}" for i in range(2500)]
    task = write(tmp_path / "wide.jsonl", [{"context": "y = ", "choices": choices, "gold": 7}])
    seen = scored(big_vocab_run, task)
    n_head = 4  # run_args' model: a (B, H, T, T) attention weight may be materialised
    assert 0 < seen.longest <= ROW_TOKENS and seen.square <= n_head * MASK_ELEMS, seen.longest
    # Each choice as if scored alone: in a row of its own (the prefix, then the choice).
    ckpt = load_for_inference(big_vocab_run)
    enc = load_tokenizer_dir(ckpt.tokenizer_dir)
    e = encode_task(load_task(str(task), None), enc, CONTEXT).encoded[0]
    precision = Precision.resolve("fp32", torch.device("cpu"))
    together = choice_loglikelihoods(ckpt.model, [e], precision)[0]
    alone = choice_loglikelihoods(ckpt.model, [Encoded(e.prefix, [s], [t]) for s, t in
                                               zip(e.suffixes[:40], e.targets[:40])], precision)
    assert together[:40] == pytest.approx([a[0] for a in alone], abs=1e-5)
