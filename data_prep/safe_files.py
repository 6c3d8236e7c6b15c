"""The one rule for every file lmforge opens inside a run directory, a dataset, a checkpoint or an
output path: it is opened as what it must be and no further.

- A file is opened with O_NOFOLLOW and checked on its descriptor (fstat, so nothing can swap it
  between the check and the use): a regular file, never a symbolic link, directory, device, FIFO
  or socket. O_NONBLOCK is set for the open alone, so a FIFO is refused instead of hanging.
- A file opened for writing must also have no other name (st_nlink == 1): a hard link would carry
  the write to a file outside. It is never truncated before those checks.
- A read is bounded: `read_bytes` refuses a file larger than its format can declare, so no
  figure in a file sizes memory before it is held against its neighbours.
- A directory is checked with lstat: a directory, not a link to one. `check_tree` walks one and
  refuses any symbolic link or special file in it.

Each refusal is an UnsafeFile (a DataError: one `error:` line, exit 2) naming the file and what it
is. Callers name the file's role (`what`), so the line says which input is wrong.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from lmforge.data_prep.errors import DataError


class UnsafeFile(DataError):
    """A file or directory that is not what lmforge's format says it must be."""


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def kind_of(mode: int) -> str:
    """What a st_mode is, in words ('a regular file', 'a symbolic link', ...)."""
    return next((name for test, name in _KINDS if test(mode)), "a regular file")


def _refuse(path: Path, is_: str, what: str) -> UnsafeFile:
    return UnsafeFile(f"{what} {path} is {is_}; lmforge reads and writes only regular files "
                      "there (replace it with a regular file, or use another path)")


_FLAGS = {"rb": os.O_RDONLY, "r": os.O_RDONLY, "wb": os.O_WRONLY | os.O_CREAT,
          "w": os.O_WRONLY | os.O_CREAT, "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "a+b": os.O_RDWR | os.O_CREAT | os.O_APPEND,
          "r+b": os.O_RDWR,
          "w+b": os.O_RDWR | os.O_CREAT}


def user_path(path: str | os.PathLike) -> Path:
    """A path as the user named it on the command line or in a config: it may be a link (README,
    "Trust"), resolved once, here; nothing inside it, nor beside it, is followed."""
    return Path(os.path.realpath(path))


def open_fd(path: str | Path, mode: str = "rb", *, what: str = "file") -> int:
    """A descriptor on `path` opened by the rule above ('w' modes truncate after the checks)."""
    path = Path(path)
    flags = _FLAGS[mode] | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link", what) from None
        if e.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV):
            try:
                is_ = kind_of(os.lstat(path).st_mode)
            except OSError:
                is_ = "not a regular file"
            raise _refuse(path, is_, what) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, kind_of(st.st_mode), what)
        writing = mode[0] in "wa" or "+" in mode
        if writing and st.st_nlink > 1:
            raise _refuse(path, f"a file with {st.st_nlink} names (hard links)", what)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        if mode[0] == "w":
            os.ftruncate(fd, 0)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_file(path: str | Path, mode: str = "rb", *, what: str = "file",
              encoding: str | None = "utf-8") -> IO:
    """`open()` by the rule above: a file object on a regular file, never through a link."""
    fd = open_fd(path, mode, what=what)
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding}))


def read_bytes(path: str | Path, max_bytes: int, *, what: str = "file") -> bytes:
    """The whole of a regular file of at most `max_bytes` (a larger one is refused unread)."""
    with open_file(path, "rb", what=what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise UnsafeFile(f"{what} {path} holds {size:,} bytes, more than the {max_bytes:,} "
                             "its format allows; it is corrupt or crafted")
        return f.read(max_bytes + 1)[:max_bytes]


def read_text(path: str | Path, max_bytes: int, *, what: str = "file") -> str:
    data = read_bytes(path, max_bytes, what=what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnsafeFile(f"{what} {path} is not UTF-8 text (byte {e.start}); it is corrupt or "
                         "not the file lmforge wrote") from None


def check_file(path: str | Path, *, what: str = "file", writing: bool = False) -> bool:
    """By lstat alone, nothing opened (an open may act on a device: a tape rewinds): False when
    `path` is absent, True for a regular file (with one name, when it is to be `writing`), else
    UnsafeFile. For a check before anything is written; the open itself is still open_fd's."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(Path(path), kind_of(st.st_mode), what)
    if writing and st.st_nlink > 1:
        raise _refuse(Path(path), f"a file with {st.st_nlink} names (hard links)", what)
    return True


def check_dir(path: str | Path, *, what: str = "directory") -> None:
    """UnsafeFile unless `path` is a directory itself (not a link to one); FileNotFoundError
    when it is missing, for the caller to word."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise UnsafeFile(f"{what} {path} is {kind_of(mode)}, not a directory; give a directory "
                         "(a symbolic link to one is not followed)")


def check_tree(directory: str | Path, *, what: str = "directory") -> None:
    """`directory` and everything in it: directories and regular files only, no symbolic link,
    device, FIFO or socket (each would carry a read or write outside, or hang it)."""
    directory = Path(directory)
    check_dir(directory, what=what)
    for root, dirs, files in os.walk(directory, followlinks=False):
        for name in (*dirs, *files):
            mode = os.lstat(Path(root, name)).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise UnsafeFile(f"{Path(root, name)} is {kind_of(mode)}, in {what} "
                                 f"{directory}; lmforge takes only regular files and "
                                 "directories there (remove it or replace it with the file)")


def file_sha256(path: str | Path, *, what: str = "file") -> str:
    sha = hashlib.sha256()
    with open_file(path, "rb", what=what) as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
    return sha.hexdigest()


def atomic_write_bytes(path: str | Path, chunks: Iterable, sha=None, per_process: bool = False,
                       *, what: str = "file") -> None:
    """Write `chunks` (bytes-likes) to `path` via a temp name + rename, so a crash never leaves a
    half-written file under the final name, and the rename replaces a link at `path` instead of
    writing through it. Feeds each chunk to `sha` if given. `per_process`: a temp name of this
    process's own, for a file that several processes may write at once."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp" if per_process else f".{path.name}.tmp")
    with open_file(tmp, "wb", what=what) as f:  # a link or special file planted there: refused
        try:
            for chunk in chunks:
                f.write(chunk)
                if sha is not None:
                    sha.update(chunk)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk keeps none of its space
            raise
    try:
        os.replace(tmp, path)
    except BaseException:  # `path` a directory, say: the temp file is not left behind
        tmp.unlink(missing_ok=True)
        raise


def check_writable(directory: str | Path, *, what: str = "output") -> None:
    """DataError unless a file can be created in `directory` (or, where it does not exist yet, in
    its nearest existing parent): said before any work, not after it. Creates and removes one
    temp file there (the only sure test: permissions, a read-only mount, root's rights)."""
    directory = Path(os.path.abspath(directory))
    at = next(p for p in (directory, *directory.parents) if os.path.lexists(p))
    try:
        fd, probe = tempfile.mkstemp(prefix=".lmforge-probe.", dir=at)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise DataError(f"cannot write {what} {directory}: {at} is not writable ({e.strerror}); "
                        "give a path in a writable directory") from None
