"""Shared fixtures: the GPT-2 vocabulary from ../shared and one tiny prepared dataset per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPT2_TIKTOKEN = ROOT.parent / "shared" / "tokenizers" / "gpt2.tiktoken"

# Never let a test reach wandb's servers or wait on a login prompt.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def gpt2_tiktoken() -> Path:
    if not GPT2_TIKTOKEN.is_file():
        pytest.skip(f"GPT-2 vocabulary not found at {GPT2_TIKTOKEN} (../shared beside the checkout)")
    return GPT2_TIKTOKEN


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A small slice of the built-in corpus with a 512-id trained BPE (the demo's path, smaller)."""
    from launch.prepare import main as prepare

    out = tmp_path_factory.mktemp("data") / "pystdlib"
    rc = prepare([
        "--source", "builtin:pystdlib", "--tokenizer", "bpe:512", "--out", str(out),
        "--max-docs", "120", "--val-docs", "12", "--workers", "1",
    ])
    assert rc == 0
    return out
