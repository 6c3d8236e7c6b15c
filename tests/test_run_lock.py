"""One writer per run directory, and no worker outlives its launcher.

A second `lmforge train` into a run directory in use is refused in one line (by the launcher
before torchrun starts, or by the trainer), a killed run's lock is released by the kernel (the
file's text is never parsed: a pid no process can have neither crashes nor blocks), a lock
that is a link, a directory or on a read-only disk is one line with its target untouched, a start
that loses the race deletes nothing of the winner's, and a SIGKILL of `lmforge train --nproc 2`'s
process group (torchrun starts its workers in sessions of their own) stops the workers as a
SIGTERM does: they checkpoint and exit within seconds."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.pipeline.checkpoint import format as ckpt
from lmforge.pipeline.checkpoint import lock as lock_module
from lmforge.pipeline.checkpoint.lock import check_unlocked, run_lock
from lmforge.pipeline.checkpoint.run_dir import RunDir
from lmforge.pipeline.config import ConfigError
from tests.errors import last_error_line, proc_error
from tests.file_kinds import tmpfs
from tests.harness import children, kill_group, run, run_args, start, wait_for_step
from tests.test_run_dir import copied_run, resume, snapshot, train, trained  # noqa: F401

LONG = ["--train.max_steps", "100000", "--eval.every", "0"]


def lmforge_train(*args) -> list[str]:
    return [sys.executable, "-m", "lmforge.launch.cli", "train", *map(str, args)]


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its new parent, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_a_second_writer_is_refused_and_a_killed_writers_lock_released(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    first = start(lmforge_train(*run_args(tiny_data, run_dir, *LONG, "--checkpoint.every", "0")))
    try:
        wait_for_step(first, run_dir, 1)
        assert RunDir(run_dir).lock.read_text().startswith(f"pid {first.pid} on ")
        for nproc in ("1", "2"):  # the trainer's own refusal, and the launcher's before torchrun
            res = run(lmforge_train("--nproc", nproc, *run_args(tiny_data, run_dir, "--resume",
                                                                "auto")), timeout=120)
            line = proc_error(res)
            assert f"is being written by another run (pid {first.pid} on " in line, line
    finally:
        kill_group(first)  # SIGKILL: the file stays behind, its flock released by the kernel
        first.communicate()
    assert (RunDir(run_dir).lock).is_file()
    res = run(lmforge_train(*run_args(tiny_data, run_dir, "--train.max_steps", "2",
                                      "--resume", "auto")), timeout=120)
    assert res.returncode == 0, res.stdout[-3000:]
    assert not (RunDir(run_dir).lock).exists()  # released at the end


def test_the_lock_is_held_for_the_body_and_a_leftover_file_is_no_lock(tmp_path):
    lock = RunDir(tmp_path).lock
    with run_lock(tmp_path):
        assert lock.read_text().startswith(f"pid {os.getpid()} on ")
        with pytest.raises(ConfigError, match="is being written by another run"), run_lock(tmp_path):
            pass
        with pytest.raises(ConfigError, match="is being written by another run"):
            check_unlocked(tmp_path)
        lock.write_text("whatever it says\nTraceback")  # only its first line is ever shown
        with pytest.raises(ConfigError, match=r"another run \(whatever it says\); wait"):
            check_unlocked(tmp_path)
        with run_lock(tmp_path, take=False):  # every rank but rank 0
            pass
    assert not lock.exists()
    check_unlocked(tmp_path)
    lock.write_text("left by a run that was killed\n")  # a file nobody holds locked
    check_unlocked(tmp_path)
    with run_lock(tmp_path):
        assert lock.read_text().startswith(f"pid {os.getpid()} on ")
    assert not lock.exists()


def test_a_lock_on_a_file_released_meanwhile_is_taken_again(tmp_path, monkeypatch):
    """Its holder unlinked the file between our open and our flock: that flock guards nothing."""
    real, taken = lock_module._try_lock, []

    def released_meanwhile(path, create):
        fd = real(path, create)
        if not taken:
            path.unlink()
        taken.append(fd)
        return fd

    monkeypatch.setattr(lock_module, "_try_lock", released_meanwhile)
    with run_lock(tmp_path):
        assert len(taken) == 2
        assert os.path.samestat(os.fstat(taken[1]), os.stat(RunDir(tmp_path).lock))


def test_a_filesystem_without_flock_is_refused_in_one_line(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(lock_module.fcntl, "flock", no_flock)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="does not support file locks"), run_lock(run_dir):
        pass
    assert not run_dir.exists()  # refused before anything was written
    run_dir.mkdir()
    RunDir(run_dir).lock.touch()
    with pytest.raises(ConfigError, match="does not support file locks"):
        check_unlocked(run_dir)


# ---- what stands at the lock's name, and a start that loses the race ----------------------------


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "resume"])
def test_a_lock_that_is_a_link_is_refused_and_its_target_untouched(fresh, run, tiny_data, tmp_path,
                                                                  capsys):
    run_dir = tmp_path / "new" if fresh else run
    run_dir.mkdir(exist_ok=True)
    secret = tmp_path / "secret.txt"
    secret.write_text("precious\n")
    before = snapshot(secret)
    RunDir(run_dir).lock.symlink_to(secret)
    rc, err = resume(capsys, tiny_data, run_dir)
    last_error_line(rc, err, "lock", "symbolic link")
    assert snapshot(secret) == before
    assert RunDir(run_dir).lock.is_symlink()  # not removed either: the refusal did not create it


@pytest.mark.parametrize("kind", ["dir", "readonly"])
def test_a_lock_that_cannot_be_opened_is_one_line(kind, run, tiny_data, tmp_path, capsys):
    if kind == "dir":
        RunDir(run).lock.mkdir()
        rc, err = resume(capsys, tiny_data, run)
        last_error_line(rc, err, "lock", "a directory")
        return
    with tmpfs(tmp_path / "ro", 16 << 20) as mnt:
        shutil.copytree(run, mnt / "run")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        rc, err = resume(capsys, tiny_data, mnt / "run")
        last_error_line(rc, err, "lock", "Read-only file system")


def test_a_start_refused_by_a_racing_winner_leaves_the_winners_directory(tiny_data, tmp_path,
                                                                        capsys, monkeypatch):
    """Two starts into one new directory: the winner takes the lock between the loser's look at
    the directory and its own lock; the loser's refusal must not remove the winner's directory."""
    run_dir = tmp_path / "run"
    real = lock_module.check_dir_path
    with contextlib.ExitStack() as winner:

        def winner_gets_there_first(path, flag):
            real(path, flag)
            if not winner._exit_callbacks:  # once (the winner's own start calls this too)
                winner.callback(lambda: None)
                winner.enter_context(run_lock(run_dir))

        monkeypatch.setattr(lock_module, "check_dir_path", winner_gets_there_first)
        rc, err = train(capsys, *run_args(tiny_data, run_dir, "--train.max_steps", "1"))
        last_error_line(rc, err, "is being written by another run")
        assert RunDir(run_dir).lock.read_text().startswith(f"pid {os.getpid()} on ")
        monkeypatch.setattr(lock_module, "check_dir_path", real)
        rc, err = train(capsys, *run_args(tiny_data, run_dir, "--train.max_steps", "1"))
        # a third start: still one writer
        last_error_line(rc, err, "is being written by another run")
    assert not RunDir(run_dir).lock.exists()  # the winner's own release


@pytest.mark.dist
def test_killing_the_launchers_group_stops_its_workers(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    launcher = start(lmforge_train("--nproc", "2", *run_args(
        tiny_data, run_dir, *LONG, "--train.parallel", "ddp", "--checkpoint.every", "2")))
    workers = []
    try:
        deadline = time.time() + 180
        while not ckpt.list_complete(run_dir / "checkpoints") and time.time() < deadline:
            assert launcher.poll() is None, launcher.stdout.read()[-3000:]
            time.sleep(0.05)
        workers = children(launcher.pid)  # lmforge train execs torchrun: its agent is the pid
        assert len(workers) == 2
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's group only, not the workers'
        launcher.wait(timeout=30)
        deadline = time.time() + 30
        while any(map(alive, workers)) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(map(alive, workers)), "the workers outlived their launcher"
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        kill_group(launcher)
    out = launcher.stdout.read()
    # They stopped as on preemption: a checkpoint of their last step, then the lock released.
    assert "stop requested (SIGTERM): checkpoint saved at step" in out, out[-3000:]
    stopped_at = int(out.split("checkpoint saved at step ")[1].split(",")[0])
    assert ckpt.read_meta(ckpt.list_complete(run_dir / "checkpoints")[-1]).step == stopped_at
    assert not (RunDir(run_dir).lock).exists()


def test_a_lock_file_naming_an_impossible_pid_neither_crashes_nor_blocks(tiny_data, tmp_path):
    """The lock is the file's flock, which no process holds here: its text is never parsed."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = RunDir(run_dir).lock
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": 2**70, "start_ticks": None,
                                "since": "then"}))
    res = run(lmforge_train(*run_args(tiny_data, run_dir, "--train.max_steps", "1")), timeout=120)
    assert res.returncode == 0 and "Traceback" not in res.stdout, res.stdout[-3000:]
    assert not lock.exists()  # taken, then released at the end
