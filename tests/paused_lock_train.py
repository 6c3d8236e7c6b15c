"""`python -m tests.paused_lock_train ARGS`: launch.train that stops at two points of taking over
a stale run lock until the test lets it go on, so a test can start other runs in between
(tests/test_run_lock.py). $LMFORGE_LOCK_PAUSE is a directory: after the first read of a lock
whose holder is gone, this process writes `read` there and waits for `go1`; before it links a
lock it had moved aside back into place (what lmforge did before lock.break), it writes `aside`
and waits for `go2`. The product carries none of this: it wraps the lock module from outside."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from launch.cli import run_user_command
from launch.train import main
from pipeline.checkpoint import lock

PAUSE = Path(os.environ["LMFORGE_LOCK_PAUSE"])
_read, _link = lock._read, os.link


def _wait_for(name: str) -> None:
    deadline = time.monotonic() + 120
    while not (PAUSE / name).exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def paused_read(path: Path):
    found = _read(path)
    stale = found is not None and found[1] is not None and found[1].running() is False
    if path.name == "lock" and stale and not (PAUSE / "read").exists():
        (PAUSE / "read").touch()
        _wait_for("go1")
    return found


def paused_link(src, dst, *args, **kwargs):
    if ".stale." in str(src):
        (PAUSE / "aside").touch()
        _wait_for("go2")
    return _link(src, dst, *args, **kwargs)


lock._read = paused_read
os.link = paused_link

if __name__ == "__main__":
    sys.exit(run_user_command(main, sys.argv[1:]))
