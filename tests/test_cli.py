"""The command line's contract: every subcommand speaks one way (a mistake is one `error:` line
and exit 2), `lmforge train --help` lists every config key with its type, default and docstring,
and every numeric option of prepare, inspect, eval and export, given the mistakes a new user makes
(negative, zero, nan, inf, 1e99, not a number, too big for the machine), is refused naming the
flag, with no traceback and nothing written, before any work starts.

Run through the real `lmforge` entry (launch.cli.main) in-process. The numbers' checks must come
before the command touches its inputs: the paths given there do not exist, so an error about them
instead of about the flag means the number was not checked first."""

from __future__ import annotations

import pytest

from lmforge.launch.cli import SUBCOMMANDS
from lmforge.launch.cli import main as lmforge
from lmforge.pipeline.config import JobConfig
from lmforge.pipeline.typed_config import field_docs, field_types, keys_help, section_keys
from tests.errors import one_error_line


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_a_bad_flag_is_one_error_line_for_every_subcommand(command, capsys):
    rc = lmforge([command, "--no-such-flag", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (command, err)


def test_train_help_lists_every_config_key_with_its_docstring(capsys):
    with pytest.raises(SystemExit) as stop:
        lmforge(["train", "--help"])
    shown = capsys.readouterr().out
    assert stop.value.code == 0
    undocumented = [f"{s}.{k}" for s, cls in field_types(JobConfig).items()
                    for k in field_types(cls) if not field_docs(cls).get(k)]
    assert not undocumented, f"config keys without a docstring: {undocumented}"
    for key in section_keys(JobConfig):
        assert f"--{key} " in shown, key
    assert "--train.max_steps int = 200" in shown
    assert "Optimizer steps of the whole run" in keys_help(JobConfig)


# ---- numeric options -----------------------------------------------------------------------

BAD_INT = ["-1", "nan", "inf", "1e99", "x", "2.5", ""]


def cases(flag: str, values: list[str]) -> list:
    return [pytest.param(flag, v, id=f"{flag}={v}") for v in values]


def run(capsys, argv: list[str]) -> tuple[object, str]:
    """(exit status or the exception a user would see as a traceback, stderr)."""
    try:
        rc = lmforge(argv)
    except SystemExit as e:  # argparse's own exit
        rc = e.code
    except Exception as e:  # noqa: BLE001 - a traceback is what this test exists to catch
        rc = f"traceback: {type(e).__name__}: {e}"
    return rc, capsys.readouterr().err


PREPARE = (
    cases("--shard-tokens", BAD_INT + ["0", str(2**80)])
    + cases("--val-fraction", ["-1", "1", "nan", "inf", "-inf", "1e99", "x", ""])
    + cases("--val-docs", BAD_INT)
    + cases("--max-docs", BAD_INT + ["0", str(2**80)])
    + cases("--bpe-sample-chars", BAD_INT + ["0"])
    + cases("--workers", BAD_INT + ["1000000"])
    + cases("--tokenizer", ["bpe:-1", "bpe:0", "bpe:257", "bpe:1e99", "bpe:x", "bpe:99999999999"])
)


@pytest.mark.parametrize("flag,value", PREPARE)
def test_prepare_numbers(tmp_path, capsys, flag, value):
    out = tmp_path / "out"
    rc, err = run(capsys, ["prepare", "--source", str(tmp_path / "missing.jsonl"), "--out",
                           str(out), "--quiet", f"{flag}={value}"])
    one_error_line(rc, err, "bpe:" if flag == "--tokenizer" else flag)
    assert not out.exists()


@pytest.mark.parametrize("flag,value", [("--workers", "-1"), ("--bpe-sample-chars", "0"),
                                        ("--max-docs", str(2**80)), ("--shard-tokens", str(2**80))])
def test_prepare_numbers_with_a_real_source(tmp_path, capsys, flag, value):
    """The same with a source that exists, so a missed check runs into the work (before the fix,
    --workers -1 ended in a ValueError traceback from the thread pool after OUT was written)."""
    src = tmp_path / "docs.txt"
    src.write_text("one small document\n\nand another one\n")
    out = tmp_path / "out"
    rc, err = run(capsys, ["prepare", "--source", str(src), "--lines", "--tokenizer", "bpe:300",
                           "--out", str(out), "--quiet", flag, value])
    one_error_line(rc, err, flag)
    assert not out.exists()


@pytest.mark.parametrize("flag,value", cases("--tokens", BAD_INT + ["0"]) + cases("--seed", BAD_INT))
def test_inspect_numbers(tmp_path, capsys, flag, value):
    rc, err = run(capsys, ["inspect", str(tmp_path / "missing"), f"{flag}={value}"])
    one_error_line(rc, err, flag)


EVAL = (
    cases("--max-tokens", BAD_INT + ["0"])
    + cases("--batch-size", BAD_INT + ["0", str(2**40)])
    + cases("--seq-len", BAD_INT + ["0"])
)


@pytest.mark.parametrize("flag,value", EVAL)
def test_eval_numbers(tmp_path, capsys, flag, value):
    report = tmp_path / "eval.json"
    rc, err = run(capsys, ["eval", "--ckpt", str(tmp_path / "run"), "--data", str(tmp_path / "data"),
                           "--json", str(report), "--device", "cpu", f"{flag}={value}"])
    one_error_line(rc, err, flag)
    assert not report.exists()


@pytest.mark.parametrize("argv,names", [
    (["eval", "--data", "d"], "--ckpt"),
    (["export", "--ckpt", "runs/x"], "--hf"),
    (["inspect"], "dir"),
    (["prepare", "--out", "o", "--max-docs"], "--max-docs"),
])
def test_missing_values_are_one_line(capsys, argv, names):
    """A missing flag or value: one line that names it (and --help), not argparse's usage block."""
    rc, err = run(capsys, argv)
    one_error_line(rc, err, names)
    assert "--help" in err
