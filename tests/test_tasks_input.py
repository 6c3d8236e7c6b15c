"""Bad task input through `lmforge eval --tasks` on real files is one `error:` line, exit 2, or
no error at all: a JSONL line nested too deep or with a number too long for Python, a task path
that is a FIFO, a directory or a link, named-task data of another layout (Arrow files under
LMFORGE_TASKS_DIR), and the built-in `nextline`'s questions too long for the model (dropped)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest

from lmforge.launch.evaluate import main as eval_main
from lmforge.pipeline.tasks import named
from lmforge.pipeline.tasks.evaluate import load_task
from tests.errors import cli_error
from tests.harness import run_args, train

CONTEXT = 16  # short: some of nextline's lines do not fit


@pytest.fixture(scope="module")
def short_run(tiny_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("short") / "run"
    train(run_args(tiny_data, out, "--model.max_seq_len", str(CONTEXT), "--data.seq_len",
                   str(CONTEXT), "--train.max_steps", "1", "--eval.every", "0",
                   "--eval.tasks", "[]", "--checkpoint.every", "0"))
    return out


def test_nextline_drops_the_questions_too_long_for_the_model(short_run, tiny_data, tmp_path):
    every = load_task("nextline", tiny_data).examples
    out = tmp_path / "r.json"
    assert eval_main(["--ckpt", str(short_run), "--tasks", "nextline", "--json", str(out)]) == 0
    n = json.loads(out.read_text())["tasks"]["nextline"]["n"]
    assert 0 < n < len(every)


DEEP = '{"context": "a", "choices": ["b", "c"], "gold": 0, "id": ' + "[" * 100_000 + "]" * 100_000 + "}"
LINES = {
    "deep.jsonl": (DEEP, "line 1", "nests"),
    "digits.jsonl": ('{"context": "a", "choices": ["b", "c"], "gold": ' + "1" * 5000 + "}",
                     "line 1"),
}


@pytest.mark.parametrize("name", sorted(LINES))
def test_jsonl_lines_python_cannot_read(short_run, tmp_path, capsys, name):
    text, *needles = LINES[name]
    (tmp_path / name).write_text(text + "\n")
    cli_error(capsys, ["eval", "--ckpt", str(short_run), "--tasks", str(tmp_path / name)],
              name, *needles)


def test_task_path_that_is_not_a_file(short_run, tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    for name, kind in [("fifo", "a FIFO"), ("dir", "a directory"), ("zero", "a character device")]:
        line = cli_error(capsys, ["eval", "--ckpt", str(short_run), "--tasks",
                                  str(tmp_path / f"{name}.jsonl")], kind)
        assert "does not exist" not in line, line


def test_a_task_file_named_through_a_link_is_read(short_run, tmp_path, capsys):
    """The README: a path you name may be a link (nothing inside it is followed)."""
    task = tmp_path / "mine.jsonl"
    task.write_text(json.dumps({"context": "def", "choices": [" f", " g"], "gold": 0}) + "\n")
    (tmp_path / "link.jsonl").symlink_to(task)
    from lmforge.launch.cli import main as lmforge

    assert lmforge(["eval", "--ckpt", str(short_run), "--tasks", str(tmp_path / "link.jsonl")]) == 0
    assert "link" in capsys.readouterr().out


def arrow_task(root: Path, task: str, rows: list[dict] | pa.Table) -> None:
    where = root / named.TASKS[task].offline / named.SPLIT
    where.mkdir(parents=True, exist_ok=True)
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows)
    with pa.ipc.new_stream(str(where / "data-00000-of-00001.arrow"), table.schema,
                           options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(table)


PIQA = {"goal": "g", "sol1": "a", "sol2": "b", "label": 0}
SCIQ = {"question": "q", "distractor1": "a", "distractor2": "b", "distractor3": "c",
        "correct_answer": "d", "support": "s"}
HELLASWAG = {"activity_label": "x", "ctx_a": "a", "ctx_b": "b", "endings": ["c", "d"], "label": "0"}
ARC = {"question": "q", "choices": {"text": ["a"], "label": ["A"]}, "answerKey": "A"}
NAMED = {  # task, its rows, what the error names
    "int_ctx_b": ("hellaswag", [HELLASWAG | {"ctx_b": 3}], "row 0"),
    "null_support": ("sciq", [SCIQ | {"support": None}], "row 0"),
    "one_choice": ("arc_easy", [ARC, ARC], "1 choices"),
    "label_out_of_range": ("piqa", [PIQA, PIQA | {"label": 5}], "row 1"),
    "zero_rows": ("piqa", pa.Table.from_pylist([PIQA]).slice(0, 0), "no row"),
    # Refused from the batches' metadata, before decoding: 8 M null rows in a few hundred bytes
    # (1.6 GB as Python rows), 300 MB of text in a few hundred kB of zstd.
    "null_rows": ("piqa", pa.table({"goal": pa.nulls(8_000_000)}), "8,000,000+ rows"),
    "zstd_bomb": ("piqa", pa.table({"goal": ["x" * 3_000_000] * 100}), "more than a task holds"),
}


@pytest.mark.parametrize("case", sorted(NAMED))
def test_named_task_data_of_another_layout(short_run, tmp_path, capsys, monkeypatch, case):
    task, rows, needle = NAMED[case]
    arrow_task(tmp_path, task, rows)
    monkeypatch.setenv(named.TASKS_DIR_ENV, str(tmp_path))
    cli_error(capsys, ["eval", "--ckpt", str(short_run), "--tasks", task], task, needle)
