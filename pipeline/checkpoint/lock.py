"""One writer per run directory: rank 0 holds an exclusive flock on RUN/lock (run_dir.py).

Two writers would interleave metrics.jsonl and delete each other's checkpoints by keep-K (a
`--resume auto` resuming a checkpoint that the other run's keep-K removes under it), so a second
`lmforge train` into a run directory in use is refused in one line. The kernel releases a flock
when its holder dies, so a killed run leaves no stale lock to judge; the file's text only names
the holder in that refusal. A filesystem without flock is refused: training there unguarded
would risk the above silently.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.safe_files import check_file, open_fd
from lmforge.data_prep.shards import check_dir_path
from lmforge.pipeline.checkpoint.run_dir import RunDir, check_run_dir
from lmforge.pipeline.typed_config import ConfigError


def _try_lock(path: Path, create: bool) -> int | None:
    """A descriptor holding path's flock (None: no such file and not `create`); ConfigError when
    another process holds it, the filesystem cannot lock or the file cannot be opened, and
    UnsafeFile when it is not a regular file with one name (its pid line would be written
    through a link, or a FIFO would hang the start), before anything is written to it."""
    existed = check_file(path, what="run lock", writing=True)
    if not (existed or create):
        return None
    try:
        fd = open_fd(path, "a+b", what="run lock")  # never truncated before the flock
    except OSError as e:
        if isinstance(e, FileNotFoundError) and not create:  # released meanwhile
            return None
        raise _unwritable(path, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError as e:
        held = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
        who = os.pread(fd, 512, 0).decode(errors="replace").strip().splitlines()[:1] if held else []
        os.close(fd)
        if not held:
            if not existed:  # ours alone, and nobody can lock it: a refusal leaves nothing
                path.unlink(missing_ok=True)
            raise ConfigError(f"cannot lock {path} ({e.strerror}): its filesystem does not "
                              "support file locks; set --log.out_dir to a directory on one "
                              "that does") from None
    who = who[0][:200] if who else "its pid not yet written"  # released meanwhile, or unnamed yet
    raise ConfigError(f"{path.parent} is being written by another run ({who}); wait for it to "
                      "end or stop it, or train into another --log.out_dir")


def _unwritable(path: Path, e: OSError) -> ConfigError:
    return ConfigError(f"cannot write {path} ({e.strerror}); make --log.out_dir writable (or "
                       "free space on its disk), or set it to another directory")


def _acquire(path: Path) -> int:
    while True:
        fd = _try_lock(path, create=True)
        try:  # the lock of a file its holder unlinked (released) meanwhile guards nothing
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n".encode())
    except OSError as e:
        _release(path, fd)
        raise _unwritable(path, e) from None
    return fd


def _release(path: Path, fd: int) -> None:
    """Unlinked before it is unlocked (see _acquire), and only if the name is still ours."""
    try:
        if os.path.samestat(os.fstat(fd), os.lstat(path)):
            path.unlink()
    except FileNotFoundError:
        pass
    os.close(fd)


def _make_dir(run_dir: Path) -> bool:
    """run_dir made a directory; True when this call created it."""
    try:
        run_dir.mkdir(parents=True)
        return True
    except FileExistsError:  # a directory (check_dir_path), or a link the user named to one
        return False
    except OSError as e:
        raise _unwritable(run_dir, e) from None


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
    ConfigError, before anything is written, when another run holds it or a file of the run
    directory is not what lmforge writes there (run_dir.check_run_dir). `any_failed` (a
    collective over the ranks) lets every rank stop with rank 0's refusal, not wait in its first
    collective for a rank that has gone."""
    path, fd, error, made = RunDir(run_dir).lock, None, None, False
    try:
        if take:
            try:
                check_dir_path(run_dir, "log.out_dir")
                made = _make_dir(run_dir)
                fd = _acquire(path)
                check_run_dir(run_dir)
            except (ConfigError, DataError) as e:
                error = e
        if any_failed(error is not None):
            raise error or ConfigError(f"{run_dir}: rank 0 could not take the run's lock")
        yield
    except BaseException:
        # A start that fails in the directory it created leaves none. It removes only what it
        # wrote there itself: its log, while it holds the lock (so no other run wrote one), and
        # the directory if then empty; never a racing winner's directory or lock.
        if made and fd is not None and \
                {p.name for p in run_dir.iterdir()} <= {RunDir(run_dir).log.name, path.name}:
            RunDir(run_dir).log.unlink(missing_ok=True)
            _release(path, fd)
            fd = None
        if made:
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise
    finally:
        if fd is not None:
            _release(path, fd)
