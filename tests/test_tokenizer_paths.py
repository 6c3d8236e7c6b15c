"""`--tokenizer PATH` where PATH, as the user names it, is a symbolic link: the
README says a path you name may be a link; what is inside it is still never followed."""

from __future__ import annotations

import os
import subprocess
import sys

from lmforge.data_prep.shards import load_manifest
from tests.conftest import ROOT


def prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.launch.cli", "prepare", "--source",
                           "builtin:pystdlib", "--max-docs", "4", "--val-docs", "1", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_tokenizer_named_through_a_link(vocab_tiktoken, tmp_path):
    link = tmp_path / "mine.tiktoken"
    os.symlink(vocab_tiktoken, link)
    res = prepare("--tokenizer", str(link), "--out", str(tmp_path / "a"))
    assert res.returncode == 0, res.stderr[-1500:]
    direct = prepare("--tokenizer", str(vocab_tiktoken), "--out", str(tmp_path / "b"))
    assert direct.returncode == 0, direct.stderr[-1500:]
    assert load_manifest(tmp_path / "a").tokenizer["sha256"] == load_manifest(tmp_path / "b").tokenizer["sha256"]
    # a prepared tokenizer directory named through a link too; a link inside it is refused
    dir_link = tmp_path / "tok"
    os.symlink(tmp_path / "a" / "tokenizer", dir_link)
    res = prepare("--tokenizer", str(dir_link), "--out", str(tmp_path / "c"))
    assert res.returncode == 0, res.stderr[-1500:]
    vocab = tmp_path / "b" / "tokenizer" / "vocab.tiktoken"
    vocab.rename(tmp_path / "elsewhere.tiktoken")
    os.symlink(tmp_path / "elsewhere.tiktoken", vocab)
    res = prepare("--tokenizer", str(tmp_path / "b" / "tokenizer"), "--out", str(tmp_path / "d"))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "symbolic link" in lines[0], res.stderr
