"""Every kind of file a path can hold, and the disks a write can meet: what the tests of
data_prep/safe_files.py plant where lmforge expects a regular file, in one place, so the unit tests
and the run-directory and dataset tests name each kind one way."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
from pathlib import Path

import pytest

# What each kind is when it stands where a regular file belongs.
LINKS = ("link_to_file", "link_to_dir", "link_to_dev_zero")
SPECIAL = ("fifo", "dir", "char_device", "socket")
KINDS = (*LINKS, *SPECIAL, "hard_link")
REFUSED_ON_READ = (*LINKS, *SPECIAL)  # a hard link is read as the file it is
SECRET = b"precious\n"


def plant(path: Path, kind: str, outside: Path) -> None:
    """Put a `kind` at `path`. The file it replaces (if any) goes to outside/secret, so a link
    followed would find the genuine bytes there (else outside/secret holds SECRET); a link to a
    directory names outside/folder, which holds outside/folder/inside."""
    secret, folder = outside / "secret", outside / "folder"
    folder.mkdir(parents=True)
    (folder / "inside").write_bytes(SECRET)
    if os.path.lexists(path):
        shutil.move(path, secret)
    else:
        secret.write_bytes(SECRET)
    if kind == "link_to_file":
        path.symlink_to(secret)
    elif kind == "link_to_dir":
        path.symlink_to(folder)
    elif kind == "link_to_dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    elif kind == "char_device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
        except PermissionError:
            pytest.skip("mknod needs CAP_MKNOD")
    elif kind == "socket":
        cwd = os.getcwd()  # bound by its short name: a socket's path is 107 bytes at most
        os.chdir(path.parent)
        try:
            with socket.socket(socket.AF_UNIX) as s:  # the name stays after the socket closes
                s.bind(path.name)
        finally:
            os.chdir(cwd)
    elif kind == "hard_link":
        os.link(secret, path)
    else:
        raise ValueError(f"no file kind {kind!r}; one of {KINDS}")


def files_under(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Each regular file under `directory` (links not followed): its bytes and mtime, to show a
    test's command neither wrote nor touched anything there."""
    return {p.relative_to(directory).as_posix(): (p.read_bytes(), p.lstat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file() and not p.is_symlink()}


@contextlib.contextmanager
def within(seconds: int):
    """TimeoutError if the block runs past `seconds`: a FIFO opened the blocking way waits for a
    writer forever, and the alarm interrupts that open (main thread only, as pytest runs tests)."""
    def expire(*_):
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def tmpfs(mnt: Path, size_bytes: int, options: str = ""):
    """A tmpfs of `size_bytes` at `mnt` (`options`, e.g. "ro", added to the mount's), unmounted
    after (the test skips where it cannot mount)."""
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(filter(None, [
        f"size={size_bytes}", options])), "tmpfs", str(mnt)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def fill(directory: Path) -> None:
    """Take every free byte of `directory`'s disk with one file, `filler`."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    with contextlib.suppress(OSError):
        while os.write(fd, b"\0" * 4096):
            pass
    os.close(fd)


@contextlib.contextmanager
def full_disk(mnt: Path, size_bytes: int = 256 << 10):
    """A tmpfs at `mnt` with every byte taken by one file, `filler`."""
    with tmpfs(mnt, size_bytes) as path:
        fill(path)
        yield path
