"""One writer per run directory: RUN/lock (pipeline.checkpoint.run_dir) names the process training into it.

A second `lmforge train` into a run directory whose writer still runs is refused in one line:
two writers would interleave metrics.jsonl and delete each other's checkpoints by keep-K (a
`--resume auto` resuming a checkpoint that the other run's keep-K removes under it). The lock
holds its holder's host, pid and process start time (so a reused pid is not taken for the
holder). A lock whose holder is gone on this host is stale: a later start takes it over (logged).
A lock from another host cannot be checked from here: it is refused, naming the file to delete
once that run is known to be over.

Under torchrun only rank 0 takes the lock, and it is created atomically (written aside, then
hard-linked into place: also on NFS), so two starts cannot both hold it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from data_prep.errors import DataError
from data_prep.shards import check_dir_path
from pipeline.checkpoint.run_dir import RunDir
from pipeline.metrics import get_logger
from pipeline.typed_config import ConfigError


def _start_ticks(pid: int) -> int | None:
    """When a process started (clock ticks since boot, Linux's /proc); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    start_ticks: int | None
    since: str  # when it took the lock, for the message

    @classmethod
    def this_process(cls) -> Holder:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _start_ticks(pid),
                   time.strftime("%Y-%m-%d %H:%M:%S %Z"))

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self)) + "\n").encode()

    def running(self) -> bool | None:
        """Whether the holder still runs; None when it cannot be told (another host)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: it exists
            pass
        ticks = _start_ticks(self.pid)
        return self.start_ticks is None or ticks is None or ticks == self.start_ticks


def _read(path: Path) -> tuple[bytes, Holder | None] | None:
    """The lock's bytes and holder (None: unreadable); None when there is no lock."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        holder = Holder(**json.loads(raw))
    except (ValueError, TypeError):
        return raw, None
    ok = isinstance(holder.host, str) and type(holder.pid) is int and 1 <= holder.pid <= _pid_max()
    return raw, holder if ok else None


def _pid_max() -> int:
    """The largest pid this host gives (a lock naming another is no lock lmforge wrote: pid 0 or
    -1 is a process group to os.kill, and 2**64 overflows it)."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 2**22  # Linux's largest


def _refusal(path: Path, holder: Holder | None, running: bool | None) -> ConfigError:
    where = path.parent
    if holder is None:
        return ConfigError(f"{path} is not a lock lmforge wrote; if no run is writing to "
                           f"{where}, delete it and start again")
    who = f"pid {holder.pid} on {holder.host}, since {holder.since}"
    if running is None:
        return ConfigError(f"{where} is locked by a run on another host ({who}), which cannot be "
                           f"checked from here; if that run is over, delete {path}, or train "
                           "into another --log.out_dir")
    return ConfigError(f"{where} is being written by another run ({who}); wait for it to end or "
                       "stop it, or train into another --log.out_dir")


def check_unlocked(run_dir: Path) -> None:
    """ConfigError when a live run holds run_dir's lock (what a launcher checks before it starts
    workers; the lock itself is taken by rank 0)."""
    check_dir_path(run_dir, "log.out_dir")
    path = RunDir(run_dir).lock
    found = _read(path)
    if found is not None:
        holder = found[1]
        running = None if holder is None else holder.running()
        if running is not False:
            raise _refusal(path, holder, running)


def _break_stale(path: Path, stale: bytes) -> None:
    """Remove a stale lock unless another start replaced it meanwhile."""
    aside = path.with_name(f"{path.name}.stale.{socket.gethostname()}.{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another start broke it first
    if aside.read_bytes() != stale:  # a fresh lock, taken since it was read: put it back
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    aside.unlink()


def _acquire(path: Path, me: Holder) -> None:
    staged = path.with_name(f"{path.name}.{me.host}.{me.pid}.tmp")
    staged.write_bytes(me.to_bytes())
    try:
        for _ in range(3):
            try:
                os.link(staged, path)
                return
            except FileExistsError:
                pass
            found = _read(path)
            if found is None:
                continue  # released meanwhile
            raw, holder = found
            running = None if holder is None else holder.running()
            if running is not False:
                raise _refusal(path, holder, running)
            get_logger().warning("%s: taking over the lock of pid %d on %s, which is gone",
                                 path, holder.pid, holder.host)
            _break_stale(path, raw)
        raise ConfigError(f"{path}: could not take the lock (other runs keep starting in "
                          f"{path.parent}); start one run at a time")
    finally:
        staged.unlink(missing_ok=True)


@contextmanager
def run_lock(run_dir: Path, take: bool = True,
             any_failed: Callable[[bool], bool] = lambda failed: failed) -> Iterator[None]:
    """Hold run_dir's lock for the body (take=False: do nothing, as every rank but rank 0);
    ConfigError, before anything is written, when a live run holds it. `any_failed` (a
    collective over the ranks) lets every rank stop with rank 0's refusal, not wait in its first
    collective for a rank that has gone."""
    error, created = None, take and not run_dir.exists()
    if take:
        try:
            check_dir_path(run_dir, "log.out_dir")
            run_dir.mkdir(parents=True, exist_ok=True)
            path, me = RunDir(run_dir).lock, Holder.this_process()
            _acquire(path, me)
        except (ConfigError, DataError) as e:
            error = e
    if any_failed(error is not None):
        raise error or ConfigError(f"{run_dir}: rank 0 could not take the run's lock")
    if not take:
        yield
        return
    try:
        yield
    except BaseException:
        _release(path, me)
        if created and {p.name for p in run_dir.iterdir()} <= {RunDir(run_dir).log.name}:
            shutil.rmtree(run_dir)  # a start refused before it wrote anything leaves no directory
        raise
    _release(path, me)


def _release(path: Path, me: Holder) -> None:
    found = _read(path)
    if found is not None and found[0] == me.to_bytes():
        path.unlink()
