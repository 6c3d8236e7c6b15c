"""The whole pipeline through the real `lmforge` command, one subprocess per stage:
prepare -> train (2 processes, torchrun) -> eval (1 process and torchrun) -> sample -> export,
then the numbers that tie the stages together."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import TINY_ARGS, metrics, run

pytestmark = pytest.mark.dist

MAX_STEPS, EVAL_TOKENS = 10, 512  # TINY_ARGS evaluate 512 tokens every 5 steps


def lmforge(*args: str | Path, timeout: float = 120):
    return run([sys.executable, "-m", "lmforge.launch.cli", *map(str, args)], timeout=timeout)


def ok(res) -> str:
    assert res.returncode == 0, f"exit {res.returncode}: {' '.join(res.args)}\n{res.stdout[-3000:]}"
    return res.stdout


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e")
    data, run_dir = root / "data", root / "run"
    prepare = ["prepare", "--source", "builtin:pystdlib", "--tokenizer", "bpe:400", "--out", data,
               "--max-docs", "60", "--val-docs", "6", "--workers", "1", "--quiet"]
    ok(lmforge(*prepare))
    assert "already prepared" in ok(lmforge(*prepare))  # a second run reuses the first
    ok(lmforge("train", "--nproc", "2", *TINY_ARGS, "--data.path", data, "--log.out_dir", run_dir,
               "--train.max_steps", MAX_STEPS, "--checkpoint.every", 5, "--checkpoint.keep", 2,
               timeout=240))
    return {"root": root, "data": data, "run": run_dir}


def logged_val_loss(run_dir: Path, step: int) -> float:
    return next(r["val_loss"] for r in metrics(run_dir) if r["step"] == step and "val_loss" in r)


@pytest.fixture(scope="module")
def final_eval(pipeline_run) -> dict:
    return eval_json(pipeline_run, pipeline_run["run"], "final.json")


def eval_json(p: dict[str, Path], ckpt: Path, name: str, *launcher: str) -> dict:
    out = p["root"] / name
    args = ["--ckpt", ckpt, "--data", p["data"], "--max-tokens", EVAL_TOKENS, "--json", out]
    if launcher:
        ok(run([*launcher, *map(str, args)], timeout=120))
    else:
        ok(lmforge("eval", *args))
    return json.loads(out.read_text())


def test_eval_perplexity_is_exp_of_logged_val_loss(pipeline_run, final_eval):
    p, final = pipeline_run, final_eval
    assert final["step"] == MAX_STEPS and final["tokens"] == EVAL_TOKENS
    assert final["perplexity"] == pytest.approx(math.exp(logged_val_loss(p["run"], MAX_STEPS)), rel=1e-5)
    # The step-5 checkpoint is DCP-sharded by 2 ranks; evaluate it under torchrun with 2 ranks.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "-m", "lmforge.launch.evaluate"]
    mid = eval_json(p, p["run"] / "checkpoints" / "step_00000005", "mid.json", *torchrun)
    assert mid["step"] == 5 and mid["tokens"] == EVAL_TOKENS
    assert mid["perplexity"] == pytest.approx(math.exp(logged_val_loss(p["run"], 5)), rel=1e-5)
    assert final["loss"] < mid["loss"]  # training went somewhere


def test_export_gives_the_same_loss_in_transformers(pipeline_run, final_eval):
    transformers = pytest.importorskip("transformers")
    from lmforge.pipeline.data.loader import IGNORE_INDEX, TokenWindows
    from lmforge.pipeline.evaluate import eval_batches

    p, ours = pipeline_run, final_eval
    out = p["root"] / "hf"
    ok(lmforge("export", "--ckpt", p["run"], "--hf", out))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    windows = TokenWindows(p["data"], "val", ours["seq_len"], None)
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for x, y in eval_batches(windows, 4, 0, 1, EVAL_TOKENS):
            logits = model(x).logits
            loss_sum += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum").item()
            count += int((y != IGNORE_INDEX).sum())
    assert count == ours["tokens"]
    assert abs(loss_sum / count - ours["loss"]) / ours["loss"] < 1e-4


def test_sample_is_reproducible_with_a_seed(pipeline_run):
    args = ["sample", "--ckpt", pipeline_run["run"], "--prompt", "def ", "--max-new-tokens", 40,
            "--seed", 11]
    # The text alone: the notes (dtype, seed) go to stderr, which run() merges into stdout.
    first, second = ("".join(ln for ln in ok(lmforge(*args)).splitlines(keepends=True)
                             if not ln.startswith("note: ")) for _ in range(2))
    assert first == second
    assert first.startswith("def ") and len(first.strip()) > len("def")


def test_resume_with_another_model_shape_is_one_line(pipeline_run, capsys):
    # In-process (the CLI's own entry point): only the message matters here. The other user
    # mistakes are covered on a random checkpoint in tests/test_eval_sample_export.py.
    from lmforge.launch.cli import main as cli

    p = pipeline_run
    rc = cli(["train", *TINY_ARGS, "--model.d_model", "32", "--data.path", str(p["data"]),
              "--log.out_dir", str(p["run"]), "--resume", "auto", "--train.max_steps", "15"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "another model" in err and "d_model" in err
    assert max(r["step"] for r in metrics(p["run"])) == MAX_STEPS  # the run is untouched
