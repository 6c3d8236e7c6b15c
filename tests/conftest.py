"""Shared fixtures: a BPE vocabulary file trained by the project's own trainer and one tiny
prepared dataset per session (nothing outside the repository is needed: a fresh clone passes)."""

from __future__ import annotations

import base64
import fcntl
import itertools
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VOCAB_IDS = 1024  # the test vocabulary's ranks, <|endoftext|> then = VOCAB_IDS (inferred)

# Never let a test reach wandb's servers or wait on a login prompt.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """A directory `build` fills once per pytest session: under xdist, the first worker to ask
    builds it and the others wait on a lock, then read it (CI's two workers each trained the
    layout runs, a minute of two cores). What reads it never writes into it (copies where a test
    resumes)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        path = tmp_path_factory.mktemp(name)
        build(path)
        return path
    root = tmp_path_factory.getbasetemp().parent  # one per session, shared by its workers
    path, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)  # a worker that failed half-way
            path.mkdir()
            build(path)
            done.touch()
    return path


def _train_vocab(root: Path) -> None:
    from lmforge.data_prep.sources import Source
    from lmforge.data_prep.tokenizer import mergeable_ranks, train_bpe

    docs = itertools.islice((t for t in Source("builtin:pystdlib") if t), 300)
    ranks = sorted(mergeable_ranks(train_bpe(docs, VOCAB_IDS + 1)).items(), key=lambda kv: kv[1])
    assert len(ranks) == VOCAB_IDS, "the sample ran out of pairs to merge"
    (root / "bpe1024.tiktoken").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks))


@pytest.fixture(scope="session")
def vocab_tiktoken(tmp_path_factory) -> Path:
    """A .tiktoken file of VOCAB_IDS byte-level BPE ranks (the standard library's text), in the
    format of gpt2.tiktoken: what a test of a `--tokenizer FILE` needs, built by the tests."""
    return built_once(tmp_path_factory, "vocab", _train_vocab) / "bpe1024.tiktoken"


def _prepare_tiny(root: Path) -> None:
    from lmforge.launch.prepare import main as prepare

    rc = prepare([
        "--source", "builtin:pystdlib", "--tokenizer", "bpe:512", "--out", str(root / "pystdlib"),
        "--max-docs", "120", "--val-docs", "12", "--workers", "1",
    ])
    assert rc == 0


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A small slice of the built-in corpus with a 512-id trained BPE (the demo's path, smaller)."""
    return built_once(tmp_path_factory, "data", _prepare_tiny) / "pystdlib"


# The layouts a parity test compares: the same 1024-token global batch as 1 process x 4
# micro-steps, and as 2 ranks x 2 micro-steps under DDP and under FSDP2 (4 sequences x 64
# tokens each), AdamW, fp32, checkpoints every 4 steps.
LAYOUT_STEPS = 24


def layout_args(data, out, *extra: str) -> list[str]:
    from tests.harness import run_args

    return run_args(data, out, "--train.global_batch_tokens", "1024",
                    "--train.max_steps", str(LAYOUT_STEPS), "--checkpoint.every", "4",
                    "--checkpoint.keep", "10", *extra)


@pytest.fixture(scope="session")
def layout_runs(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """One run per layout ("none", "ddp", "fsdp"), each with its gradient collectives traced
    to RUN.trace.rankN (tests/traced_train.py): the baselines of the accumulation, parity,
    resume and resharding tests, trained once for all of them."""
    from tests.harness import train

    def build(root: Path) -> None:
        for parallel in ("none", "ddp", "fsdp"):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("LMFORGE_TRACE_GRAD_SYNC", str(root / f"{parallel}.trace"))
                train(layout_args(tiny_data, root / parallel, "--train.parallel", parallel),
                      nproc=1 if parallel == "none" else 2, module="tests.traced_train")

    root = built_once(tmp_path_factory, "layouts", build)
    return {parallel: root / parallel for parallel in ("none", "ddp", "fsdp")}
