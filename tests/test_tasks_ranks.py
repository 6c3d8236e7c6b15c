"""Tasks over several ranks and across a resume: an example that cannot be scored is every rank's
error before any collective (one `error:` line from `lmforge eval --nproc 2`; in training, the
task left out with a warning before step 1, never a deadlock), and a resume scores the tasks its
command line names, none with `--eval.tasks '[]'`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.harness import metrics, run, run_args, train, train_cmd

GOOD = {"context": "def f(x):\n", "choices": ["    return x", "    pass"], "gold": 0}
# Example 1 (rank 1's under 2 ranks): a choice longer than the model's 128-token context.
TOO_LONG = {"context": "x = ", "choices": ["1", " y" * 300], "gold": 0}


@pytest.fixture(scope="module")
def unscorable(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tasks") / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(TOO_LONG) + "\n")
    return path


@pytest.mark.dist
def test_eval_two_ranks_unscorable_example_is_one_error_line(tiny_data, unscorable, tmp_path):
    train(run_args(tiny_data, tmp_path / "run", "--train.max_steps", "1", "--eval.every", "0"))
    res = run([sys.executable, "-m", "lmforge.launch.cli", "eval", "--ckpt", str(tmp_path / "run"),
               "--tasks", str(unscorable), "--device", "cpu", "--nproc", "2"], timeout=180)
    # As every nproc mistake: the launcher's line once (torchrun's own log lines around it).
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("error: ")]
    assert res.returncode == 2 and "Traceback" not in res.stdout, res.stdout[-3000:]
    assert len(lines) == 1 and "task bad example 1" in lines[0], res.stdout[-3000:]


@pytest.mark.dist
def test_train_two_ranks_leaves_an_unscorable_task_out(tiny_data, unscorable, tmp_path):
    """It deadlocked: rank 1 raised in its stripe, rank 0 waited in the tasks' all_reduce."""
    out = tmp_path / "run"
    res = run(train_cmd(run_args(tiny_data, out, "--train.max_steps", "2", "--eval.every", "0",
                                 "--eval.tasks", json.dumps([str(unscorable)])), nproc=2),
              timeout=180, retries=0)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "bad.jsonl is left out" in res.stdout and "example 1" in res.stdout
    assert [r["step"] for r in metrics(out) if "loss" in r][-1] == 2


def test_resume_with_no_tasks_scores_none(tiny_data, tmp_path):
    tasks = tmp_path / "mine.jsonl"
    tasks.write_text(json.dumps(GOOD) + "\n")
    out = tmp_path / "run"
    train(run_args(tiny_data, out, "--train.max_steps", "2", "--eval.every", "0",
                   "--eval.tasks", json.dumps([str(tasks)])))
    assert any("downstream" in r for r in metrics(out))
    train(run_args(tiny_data, out, "--train.max_steps", "4", "--eval.every", "0", "--resume",
                   "auto", "--eval.tasks", "[]"))
    resumed = [r for r in metrics(out) if r.get("step", 0) > 2]
    assert resumed and not any("downstream" in r for r in resumed)
