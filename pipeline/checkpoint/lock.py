"""One writer per run directory: rank 0 holds an exclusive flock on RUN/lock (run_dir.py).

Two writers would interleave metrics.jsonl and delete each other's checkpoints by keep-K (a
`--resume auto` resuming a checkpoint that the other run's keep-K removes under it), so a second
`lmforge train` into a run directory in use is refused in one line. The kernel releases a flock
when its holder dies, so a killed run leaves no stale lock to judge; the file's text only names
the holder in that refusal. A filesystem without flock is refused: training there unguarded
would risk the above silently.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from data_prep.errors import DataError
from data_prep.shards import check_dir_path
from pipeline.checkpoint.run_dir import RunDir
from pipeline.typed_config import ConfigError


def _try_lock(path: Path, create: bool) -> int | None:
    """A descriptor holding path's flock (None: no such file and not `create`); ConfigError when
    another process holds it or the filesystem cannot lock."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ConfigError(f"cannot lock {path} ({e.strerror}): its filesystem does not "
                              "support file locks; set --log.out_dir to a directory on one "
                              "that does") from None
    try:
        who = path.read_text(errors="replace").strip().splitlines()[0][:200]
    except (OSError, IndexError):  # released meanwhile, or not yet named by its holder
        who = "its pid not yet written"
    raise ConfigError(f"{path.parent} is being written by another run ({who}); wait for it to "
                      "end or stop it, or train into another --log.out_dir")


def _acquire(path: Path) -> int:
    while True:
        fd = _try_lock(path, create=True)
        try:  # the lock of a file its holder unlinked (released) meanwhile guards nothing
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n".encode())
    return fd


def check_unlocked(run_dir: Path) -> None:
    """ConfigError when a run holds run_dir's lock (what a launcher checks before it starts
    workers; the lock itself is taken by rank 0)."""
    check_dir_path(run_dir, "log.out_dir")
    fd = _try_lock(RunDir(run_dir).lock, create=False)
    if fd is not None:
        os.close(fd)


@contextmanager
def run_lock(run_dir: Path, take: bool = True,
             any_failed: Callable[[bool], bool] = lambda failed: failed) -> Iterator[None]:
    """Hold run_dir's lock for the body (take=False: do nothing, as every rank but rank 0);
    ConfigError, before anything is written, when another run holds it. `any_failed` (a
    collective over the ranks) lets every rank stop with rank 0's refusal, not wait in its first
    collective for a rank that has gone."""
    path, fd, error = RunDir(run_dir).lock, None, None
    created = take and not run_dir.exists()
    try:
        if take:
            try:
                check_dir_path(run_dir, "log.out_dir")
                run_dir.mkdir(parents=True, exist_ok=True)
                fd = _acquire(path)
            except (ConfigError, DataError) as e:
                error = e
        if any_failed(error is not None):
            raise error or ConfigError(f"{run_dir}: rank 0 could not take the run's lock")
        yield
    except BaseException:
        # A start refused before it wrote anything leaves no directory.
        if created and run_dir.is_dir() and \
                {p.name for p in run_dir.iterdir()} <= {RunDir(run_dir).log.name, path.name}:
            shutil.rmtree(run_dir)
        raise
    finally:
        if fd is not None:  # unlinked before it is unlocked: see _acquire
            path.unlink(missing_ok=True)
            os.close(fd)
