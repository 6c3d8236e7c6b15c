"""The user-error contract, checked one way everywhere: exit status 2 and one `error: ...` line
naming the problem (and its fix), never a traceback."""

from __future__ import annotations

import subprocess


def one_error_line(rc: int, err: str, *needles: str) -> str:
    """`err` is exactly one `error:` line containing every needle; returns it."""
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err[-3000:])
    assert all(n in lines[0] for n in needles), f"the error does not name {needles}: {lines[0]}"
    return lines[0]


def proc_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The same for a finished process: its stderr (or its stdout, where tests.harness merged them)."""
    return one_error_line(proc.returncode, proc.stderr or proc.stdout, *needles)


def cli_error(capsys, argv: list[str], *needles: str) -> str:
    """The same for `lmforge ARGV` run in this process."""
    from lmforge.launch.cli import main as lmforge

    rc = lmforge(argv)
    return one_error_line(rc, capsys.readouterr().err, *needles)


def last_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """For a training process, whose log lines come first: its only `error:` line is its last."""
    return last_error_line(proc.returncode, proc.stderr, *needles)


def last_error_line(rc: int, err: str, *needles: str) -> str:
    """The same for an exit status and stderr (a training run in this process, say)."""
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err and "Logging error" not in err, (rc, err[-3000:])
    assert [ln for ln in lines if ln.startswith("error: ")] == lines[-1:], err[-3000:]
    assert all(n in lines[-1] for n in needles), f"the error does not name {needles}: {lines[-1]}"
    return lines[-1]
