"""data_prep/safe_files.py, the one rule for every file lmforge opens, on each kind of file a path
can hold (tests/file_kinds.py): a regular file opens; a link, directory, FIFO, socket or device
is refused by its kind, a FIFO without waiting for a writer; a file to be written has one name; a
read is bounded by its format's limit; a write lands under a temporary name renamed into place,
and a full or read-only disk leaves nothing behind. The run directory's and the dataset's tests
show each of lmforge's files goes through this rule; these show the rule itself."""

from __future__ import annotations

import errno
import hashlib
import os
import re
from pathlib import Path

import pytest

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.safe_files import (
    UnsafeFile,
    atomic_write_bytes,
    check_dir,
    check_file,
    check_tree,
    check_writable,
    file_sha256,
    kind_of,
    open_fd,
    open_file,
    read_bytes,
    read_text,
)
from tests.file_kinds import (
    KINDS,
    LINKS,
    REFUSED_ON_READ,
    SECRET,
    SPECIAL,
    files_under,
    fill,
    plant,
    tmpfs,
    within,
)

# The words each refusal names its file by.
WORDS = {"link_to_file": "a symbolic link", "link_to_dir": "a symbolic link",
         "link_to_dev_zero": "a symbolic link", "fifo": "a FIFO", "dir": "a directory",
         "char_device": "a character device", "socket": "a socket",
         "hard_link": "a file with 2 names (hard links)"}
WRITE_MODES = ("wb", "w", "ab", "a+b", "r+b", "w+b")


@pytest.fixture
def outside(tmp_path) -> Path:
    """Where a planted link points: nothing under it may change."""
    return tmp_path / "outside"


def planted(tmp_path: Path, kind: str, outside: Path) -> tuple[Path, dict]:
    path = tmp_path / "file"
    plant(path, kind, outside)
    return path, files_under(outside)


# ---- opening: a regular file, and nothing else -------------------------------------------------


def test_a_regular_file_opens_for_reading_and_writing(tmp_path):
    path = tmp_path / "file"
    with open_file(path, "w") as f:
        f.write("héllo\n")
    with open_file(path, "ab") as f:
        f.write(b"more")
    with open_file(path, "r") as f:
        assert f.read() == "héllo\nmore"
    with open_file(path, "wb") as f:  # 'w' truncates (after the checks)
        f.write(b"x")
    assert path.read_bytes() == b"x"


@pytest.mark.parametrize("kind", REFUSED_ON_READ)
def test_every_kind_but_a_regular_file_is_refused_for_reading_by_its_kind(kind, tmp_path, outside):
    """Each refusal is an UnsafeFile naming the file, its role and its kind; a link is not
    followed, so /dev/zero's endless bytes and a directory's files are never reached."""
    path, before = planted(tmp_path, kind, outside)
    with within(10), pytest.raises(UnsafeFile, match=re.escape(f"shard {path} is {WORDS[kind]}; ")):
        open_file(path, "rb", what="shard")
    assert files_under(outside) == before


@pytest.mark.parametrize("mode", WRITE_MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_but_a_regular_file_with_one_name_is_refused_for_writing(kind, mode, tmp_path,
                                                                            outside):
    """Nothing is written through the link, into the hard link's other name or the device, and
    no mode truncates the file before it is checked."""
    path, before = planted(tmp_path, kind, outside)
    words = re.escape(f"output {path} is {WORDS[kind]}; ")
    with within(10), pytest.raises(UnsafeFile, match=words):
        open_fd(path, mode, what="output")
    assert files_under(outside) == before


def test_a_hard_linked_file_is_read_as_the_file_it_is(tmp_path, outside):
    """A second name changes nothing a read sees (a checkpoint copied with `cp -al` resumes)."""
    path, _ = planted(tmp_path, "hard_link", outside)
    assert read_bytes(path, 100) == SECRET
    assert check_file(path) is True


@pytest.mark.parametrize("mode", ["rb", "wb"])
def test_a_fifo_is_refused_at_once_with_no_writer_or_reader_on_its_other_end(mode, tmp_path):
    """Opened the plain way a FIFO waits for its other end forever; here the open returns (the
    alarm would fail the test after 5 s) and the FIFO is named as one."""
    os.mkfifo(tmp_path / "fifo")
    with within(5), pytest.raises(UnsafeFile, match="is a FIFO"):
        open_fd(tmp_path / "fifo", mode)


def test_the_alarm_would_catch_a_blocking_fifo(tmp_path):
    """The check above can fail: a plain open of the FIFO blocks until the alarm."""
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(TimeoutError), within(1):
        open(tmp_path / "fifo", "rb")  # noqa: SIM115 - it never returns


@pytest.mark.parametrize("mode", ["rb", "wb"])
def test_a_device_is_refused_by_its_kind_without_a_byte_moved(mode):
    with within(5), pytest.raises(UnsafeFile, match="/dev/zero is a character device"):
        open_fd("/dev/zero", mode)


def test_a_link_above_the_file_is_followed_only_the_last_name_is_not(tmp_path, outside):
    """A path a user names may pass through a link (a run directory linked as `latest`); the file
    opened at its end may not be one."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "meta.json").write_text("{}")
    (tmp_path / "latest").symlink_to(tmp_path / "real")
    assert read_text(tmp_path / "latest" / "meta.json", 10) == "{}"
    plant(tmp_path / "real" / "meta.json", "link_to_file", outside)
    with pytest.raises(UnsafeFile, match="meta.json is a symbolic link"):
        read_text(tmp_path / "latest" / "meta.json", 10)


def test_a_missing_file_is_left_to_its_caller_to_word(tmp_path):
    """FileNotFoundError, not UnsafeFile: 'run prepare first' is the caller's to say."""
    with pytest.raises(FileNotFoundError):
        open_fd(tmp_path / "absent")


@pytest.mark.parametrize("kind", [*KINDS, "regular"])
def test_kind_of_names_every_kind_in_words(kind, tmp_path, outside):
    path = tmp_path / "file"
    plant(path, kind, outside) if kind != "regular" else path.write_bytes(b"")
    words = "a regular file" if kind in ("regular", "hard_link") else WORDS[kind]
    assert kind_of(os.lstat(path).st_mode) == words


# ---- checking without opening ------------------------------------------------------------------


@pytest.mark.parametrize("kind", REFUSED_ON_READ)
def test_check_file_refuses_every_kind_by_lstat_alone(kind, tmp_path, outside):
    """Nothing is opened (an open may act on a device), so a FIFO cannot block it."""
    path, _ = planted(tmp_path, kind, outside)
    with within(5), pytest.raises(UnsafeFile, match=re.escape(WORDS[kind])):
        check_file(path)


def test_check_file_says_absent_regular_and_refuses_a_second_name_before_a_write(tmp_path,
                                                                                 outside):
    assert check_file(tmp_path / "absent") is False
    path, _ = planted(tmp_path, "hard_link", outside)
    assert check_file(path) is True
    with pytest.raises(UnsafeFile, match="2 names"):
        check_file(path, writing=True)


def test_check_dir_takes_a_directory_and_refuses_a_link_to_one_or_a_file(tmp_path):
    (tmp_path / "d").mkdir()
    check_dir(tmp_path / "d")
    (tmp_path / "link").symlink_to(tmp_path / "d")
    (tmp_path / "f").write_text("x")
    for path, words in [("link", "a symbolic link, not a directory"),
                        ("f", "a regular file, not a directory")]:
        with pytest.raises(UnsafeFile, match=words):
            check_dir(tmp_path / path, what="checkpoint")
    with pytest.raises(FileNotFoundError):
        check_dir(tmp_path / "absent")


@pytest.mark.parametrize("kind", [*LINKS, *(k for k in SPECIAL if k != "dir")])
def test_check_tree_refuses_any_special_file_deep_inside_a_directory(kind, tmp_path, outside):
    tree = tmp_path / "ckpt"
    (tree / "tokenizer" / "extra").mkdir(parents=True)
    (tree / "meta.json").write_text("{}")
    check_tree(tree)
    plant(tree / "tokenizer" / "extra" / "notes", kind, outside)
    with within(5), pytest.raises(UnsafeFile, match=re.escape(f"extra/notes is {WORDS[kind]}, in "
                                                              f"checkpoint {tree}")):
        check_tree(tree, what="checkpoint")


# ---- bounded reads -----------------------------------------------------------------------------


def test_a_read_takes_a_file_at_its_limit_and_refuses_one_byte_more_unread(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"x" * 100)
    assert read_bytes(path, 100) == b"x" * 100
    with pytest.raises(UnsafeFile, match="holds 100 bytes, more than the 99 its format allows"):
        read_bytes(path, 99, what="manifest")


def test_text_that_is_not_utf8_is_refused_at_its_byte(tmp_path):
    (tmp_path / "f").write_bytes(b"ok\xff")
    with pytest.raises(UnsafeFile, match=r"not UTF-8 text \(byte 2\)"):
        read_text(tmp_path / "f", 10)


def sparse(path: Path, size: int) -> Path:
    """A file of `size` bytes that takes no disk (a crafted file need not be large on disk)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_file(path, "wb") as f:
        f.truncate(size)
    return path


def read_manifest(d: Path):
    from lmforge.data_prep.shards import load_manifest
    sparse(d / "manifest.json", (64 << 20) + 1)
    return load_manifest(d)


def read_index(d: Path):
    from lmforge.data_prep.shards import HEADER_BYTES, read_doc_index
    sparse(d / "train_000000.idx", HEADER_BYTES + 8 * 1000 + 1)
    return read_doc_index(d / "train_000000.bin", 1000)


def read_checkpoint_meta(d: Path):
    from lmforge.pipeline.checkpoint.format import read_meta
    return read_meta(sparse(d / "meta.json", (64 << 20) + 1).parent)


def read_vocabulary(d: Path):
    from lmforge.data_prep.tokenizer import load_tokenizer
    return load_tokenizer(str(sparse(d / "v.tiktoken", (256 << 20) + 1)))


def read_dcp_metadata(d: Path):
    from lmforge.pipeline.checkpoint.safe_dcp import SafeFileSystemReader
    sparse(d / ".metadata", (256 << 20) + 1)
    return SafeFileSystemReader(str(d)).read_metadata()


@pytest.mark.parametrize("read", [read_manifest, read_index, read_checkpoint_meta,
                                  read_vocabulary, read_dcp_metadata])
def test_each_format_refuses_a_file_one_byte_past_its_readme_limit_unread(read, tmp_path):
    """The README's limits (manifest and meta.json 64 MiB, a document index 8 bytes a token past
    its header, vocabulary and DCP .metadata 256 MiB), held by each format's own reader (the RNG
    state's 16 MiB needs a model: tests/test_run_dir.py)."""
    with pytest.raises(UnsafeFile, match="its format allows; it is corrupt or crafted"):
        read(tmp_path / "d")


# ---- writes: a temporary name renamed into place -----------------------------------------------


def test_a_write_lands_under_a_temporary_name_and_is_renamed_into_place(tmp_path):
    """While the chunks are written the final name still holds the old bytes; after, the new
    ones, and no temporary file is left. `sha` sees every chunk."""
    path, seen = tmp_path / "manifest.json", []
    path.write_bytes(b"old")

    def chunks():
        for chunk in (b"new ", b"bytes"):
            seen.append((path.read_bytes(), sorted(p.name for p in tmp_path.iterdir())))
            yield chunk

    sha = hashlib.sha256()
    atomic_write_bytes(path, chunks(), sha)
    assert seen == [(b"old", [".manifest.json.tmp", "manifest.json"])] * 2
    assert path.read_bytes() == b"new bytes" and sha.hexdigest() == file_sha256(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_a_write_by_one_of_several_processes_takes_a_temporary_name_of_its_own(tmp_path):
    path = tmp_path / "x.idx"

    def chunks():
        assert (tmp_path / f".x.idx.{os.getpid()}.tmp").exists()
        yield b"1"

    atomic_write_bytes(path, chunks(), per_process=True)
    assert path.read_bytes() == b"1"


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_one(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")

    def chunks():
        yield b"half"
        raise KeyboardInterrupt  # a kill mid-write, say

    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(path, chunks())
    assert path.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("kind", ["link_to_file", "hard_link", "link_to_dev_zero"])
def test_a_write_replaces_a_link_at_its_name_instead_of_writing_through_it(kind, tmp_path,
                                                                           outside):
    path, before = planted(tmp_path, kind, outside)
    atomic_write_bytes(path, [b"mine"])
    assert not path.is_symlink() and path.read_bytes() == b"mine"
    assert files_under(outside) == before


@pytest.mark.parametrize("kind", ["link_to_file", "hard_link", "fifo"])
def test_a_link_or_fifo_planted_at_the_temporary_name_is_refused(kind, tmp_path, outside):
    path = tmp_path / "f"
    plant(tmp_path / ".f.tmp", kind, outside)
    before = files_under(outside)
    with within(5), pytest.raises(UnsafeFile, match=".f.tmp is a"):
        atomic_write_bytes(path, [b"mine"])
    assert files_under(outside) == before and not path.exists()


def test_a_write_onto_a_directory_leaves_no_temporary_file(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(OSError):
        atomic_write_bytes(tmp_path / "d", [b"x"])
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_a_write_that_fills_the_disk_keeps_none_of_its_space(tmp_path):
    """ENOSPC from the write or its fsync; the temporary file is removed, so the old file and the
    disk's space are as they were."""
    with tmpfs(tmp_path / "mnt", 256 << 10) as disk:
        atomic_write_bytes(disk / "f", [b"old"])
        fill(disk)
        with pytest.raises(OSError) as e:
            atomic_write_bytes(disk / "f", [b"new" * 100_000])
        assert e.value.errno == errno.ENOSPC
        assert (disk / "f").read_bytes() == b"old"
        assert sorted(p.name for p in disk.iterdir()) == ["f", "filler"]


def test_an_unwritable_directory_is_said_before_any_work(tmp_path):
    """check_writable probes the directory, or its nearest existing parent where it is not made
    yet, with one temporary file it removes."""
    check_writable(tmp_path / "not" / "yet")
    assert list(tmp_path.iterdir()) == []
    with tmpfs(tmp_path / "ro", 1 << 20, "ro") as ro:
        with pytest.raises(DataError, match=f"cannot write output {ro}/run: {ro} is not "
                                            "writable \\(Read-only file system\\)"):
            check_writable(ro / "run")
