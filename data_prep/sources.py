"""Where documents come from. `Source(spec, ...)` is an iterable of document strings in a fixed,
deterministic order, read in a streaming way (memory does not grow with the corpus, except for a
`.json` file holding one JSON array, which is loaded whole).

Source specs:
- `builtin:pystdlib` -- every .py file of the running Python's standard library, sorted by path,
  one document each (tens of MB, present on every machine);
- `hf:NAME[:CONFIG][@SPLIT]` -- `datasets.load_dataset(NAME, CONFIG, split=SPLIT or "train",
  streaming=True)`; NAME may be a hub id or a local directory of data files;
- a file, a directory (searched recursively, files sorted) or a glob of local files:
  `.txt` (one document per file, or per non-empty line with `lines=True`), `.jsonl` / `.json`
  (one record per line, or a single JSON array), `.parquet`, `.arrow`. `.txt/.jsonl/.json` may be
  compressed `.gz`, `.bz2` or `.xz` (stdlib); `.zst` is not supported by this Python.
Records take their text from `text_field`. Bytes that are not UTF-8 are replaced by U+FFFD and
counted in `Source.replaced`.
"""

from __future__ import annotations

import bz2
import functools
import glob
import gzip
import hashlib
import io
import json
import lzma
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.safe_files import kind_of

TEXT_EXTS = (".txt", ".jsonl", ".json")
RECORD_EXTS = (".jsonl", ".json")
TABLE_EXTS = (".parquet", ".arrow")
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
# What reading a damaged file raises: gzip.BadGzipFile and bz2's "Invalid data stream" are
# OSErrors, a truncated archive EOFError, a bad deflate block zlib.error.
UNREADABLE = (OSError, EOFError, lzma.LZMAError, zlib.error)


@dataclass
class Source:
    spec: str
    text_field: str = "text"
    lines: bool = False
    replaced: int = 0  # U+FFFD characters substituted for invalid UTF-8, over all documents read
    total_docs: int | None = None  # known up front for file-per-document sources
    exclude: Path | None = None  # prepare's --out: never read as documents, when inside the spec

    def __iter__(self) -> Iterator[str]:
        files = self._spec_files()
        return self._hf() if files is None else self._files(files)

    def _spec_files(self) -> list[Path] | None:
        """The files the spec names, in reading order; None for a hf: dataset."""
        if self.spec == "builtin:pystdlib":
            return list(pystdlib_files())
        if self.spec.startswith("builtin:"):
            raise DataError(f"unknown builtin corpus {self.spec!r}; the only one is builtin:pystdlib")
        if self.spec.startswith("hf:"):
            name = Path(parse_hf_spec(self.spec)[0])
            if self.exclude is not None and name.is_dir() and _inside(self.exclude, name):
                raise DataError(f"--out {self.exclude} lies inside the dataset directory {name}, "
                                "whose files datasets reads whole (the output's own among them); "
                                "give an --out outside it")
            return None
        return local_files(self.spec, self.exclude)

    def fingerprint(self) -> str | None:
        """A digest of the names, sizes and modification times of the files read (for hf:, those
        of a local dataset directory; None for a hub dataset): a resumed prepare checks that it
        reads the files it started on."""
        files = self._spec_files()
        if files is None:
            name = Path(parse_hf_spec(self.spec)[0])
            if not name.exists():  # a hub id: its files are not known before they are loaded
                return None
            files = sorted(p for p in name.rglob("*") if p.is_file()) if name.is_dir() else [name]
        sha = hashlib.sha256()
        for f in files:
            st = f.stat()
            sha.update(f"{f}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
        return sha.hexdigest()

    def _decode(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", errors="replace")
            self.replaced += text.count("\ufffd") - raw.count("\ufffd".encode())
            return text

    def _files(self, files: list[Path]) -> Iterator[str]:
        if not self.lines and not any(format_suffix(f) in RECORD_EXTS for f in files):
            self.total_docs = len(files)
        for f in files:
            yield from self._file(f)

    def _file(self, path: Path) -> Iterator[str]:
        kind = format_suffix(path)
        if kind in TABLE_EXTS:
            yield from self._table(path)
            return
        opener = COMPRESSED.get(path.suffix, open)
        try:
            with opener(path, "rb") as f:
                if kind in RECORD_EXTS:
                    yield from self._json(path, f)
                elif not self.lines:  # .txt, or .py for builtin:pystdlib
                    yield self._decode(f.read())
                else:
                    for raw in f:
                        if raw.strip():
                            yield self._decode(raw.rstrip(b"\r\n"))
        except UNREADABLE as e:  # a corrupt or truncated archive surfaces on the read, not the open
            raise DataError(f"cannot read {path} ({type(e).__name__}: {e}); the file is corrupt "
                            "or truncated: replace it or leave it out of --source") from None

    def _json(self, path: Path, f: io.BufferedIOBase) -> Iterator[str]:
        first = f.peek(64).lstrip()[:1] if hasattr(f, "peek") else b""
        if first == b"[":  # one JSON array: no way to stream it with the stdlib
            try:
                records = json.loads(self._decode(f.read()))
            except ValueError as e:
                raise DataError(f"{path} is not valid JSON ({e}); fix the file, or write one "
                                "record per line (.jsonl)") from None
            for i, rec in enumerate(records):
                yield self._field(rec, path, i + 1)
            return
        for i, raw in enumerate(f):
            if raw.strip():
                try:
                    rec = json.loads(self._decode(raw))
                except ValueError as e:
                    raise DataError(f"{path} line {i + 1} is not JSON ({e.args[0]}); fix the "
                                    "file or pass a .txt source") from None
                yield self._field(rec, path, i + 1)

    def _field(self, rec, where, n: int) -> str:
        if not isinstance(rec, dict) or self.text_field not in rec:
            fields = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
            raise DataError(f"record {n} of {where} has no field {self.text_field!r} (it has "
                            f"{fields}); pass --text-field NAME")
        text = rec[self.text_field]
        if not isinstance(text, str):
            raise DataError(f"record {n} of {where}: field {self.text_field!r} is "
                            f"{type(text).__name__}, not text; pass the right --text-field")
        return text

    def _table(self, path: Path) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            if path.suffix == ".parquet":
                pf = pq.ParquetFile(path)
                names, batches = pf.schema_arrow.names, pf.iter_batches(batch_size=1024)
            else:
                names, batches = _arrow_batches(path, pa)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"cannot read {path} ({e}); check the file is {path.suffix}") from None
        if self.text_field not in names:
            raise DataError(f"{path} has no column {self.text_field!r} (it has {names}); "
                            "pass --text-field NAME")
        n = 0  # records are numbered through the file, not per batch
        for batch in batches:
            for text in batch.column(self.text_field).to_pylist():
                n += 1
                yield self._field({self.text_field: text}, path, n)

    def _hf(self) -> Iterator[str]:
        import datasets

        name, config, split = parse_hf_spec(self.spec)
        try:
            ds = datasets.load_dataset(name, config, split=split, streaming=True)
        except Exception as e:  # datasets raises many types (FileNotFound, ConnectionError, ...)
            raise DataError(f"cannot load Hugging Face dataset {self.spec!r} "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                            "check the name/config/split and the network or HF cache") from None
        for i, rec in enumerate(ds):
            yield self._field(rec, self.spec, i + 1)


def _arrow_batches(path: Path, pa) -> tuple[list[str], Iterator]:
    """(column names, record batches) of an Arrow IPC file or stream (datasets' save_to_disk
    writes streams). A file's reader is read by index, a stream's by iterating it."""
    try:
        reader = pa.ipc.open_file(path)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        reader = pa.ipc.open_stream(path)
        batches = iter(reader)
    return reader.schema.names, batches


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """`hf:NAME[:CONFIG][@SPLIT]` -> (NAME, CONFIG or None, SPLIT or "train")."""
    rest, _, split = spec[3:].partition("@")
    name, _, config = rest.partition(":")
    if not name:
        raise DataError(f"bad source {spec!r}; write hf:NAME[:CONFIG][@SPLIT], e.g. hf:wikitext:wikitext-2-raw-v1@train")
    return name, config or None, split or "train"


def format_suffix(path: Path) -> str:
    """The format suffix of `path`, ignoring a compression suffix (`a.jsonl.gz` -> `.jsonl`)."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in COMPRESSED:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def _inside(path: Path, directory: Path | None) -> bool:
    """Whether `path` is `directory` or lies under it (both resolved: a link or `..` in either
    does not hide it)."""
    if directory is None:
        return False
    path, directory = path.resolve(), Path(directory).resolve()
    return path == directory or directory in path.parents


def _supported(path: Path) -> bool:
    return format_suffix(path) in TEXT_EXTS or (path.suffix in TABLE_EXTS)


@functools.lru_cache(maxsize=1)
def pystdlib_files() -> tuple[Path, ...]:
    """The standard library's .py files, sorted by path relative to the stdlib root (listed once
    a process: prepare walks the source up to three times)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    # os.walk with pruning: site-packages often lives under the stdlib root and can hold ten
    # times more files than the stdlib itself.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def local_files(spec: str, exclude: Path | None = None) -> list[Path]:
    """The sorted list of files named by a path, directory or glob (DataError if none), none
    of them in `exclude` (prepare's output, read as documents it would change the input)."""
    path = Path(spec)
    if _inside(path, exclude):
        raise DataError(f"--source {spec} lies inside --out {exclude}, whose files prepare "
                        "writes; give a --source outside it")
    if path.is_dir():
        files = sorted((p for p in path.rglob("*")
                        if p.is_file() and _supported(p) and not _inside(p, exclude)),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise DataError(f"directory {spec} has no .txt/.jsonl/.json/.parquet/.arrow files; "
                            "point --source at the data")
        return files
    if any(c in spec for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True)
                       if Path(p).is_file() and not _inside(Path(p), exclude))
        if not files:
            raise DataError(f"glob {spec!r} matches no files; check the pattern (quote it)")
    elif path.is_file():
        files = [path]
    elif path.exists():  # never opened: a FIFO would wait for a writer, a device never end
        raise DataError(f"--source {spec} is {kind_of(path.stat().st_mode)}; give a regular "
                        "file, a directory or a glob")
    else:
        raise DataError(f"source {spec!r} not found; give an existing file, directory, glob, "
                        "hf:NAME or builtin:pystdlib")
    if bad := [str(f) for f in files if not _supported(f)]:
        hint = " (.zst needs Python 3.14+; decompress first)" if any(b.endswith(".zst") for b in bad) else ""
        raise DataError(f"unsupported file type: {bad[0]}{hint}; use .txt, .jsonl, .json "
                        "(optionally .gz/.bz2/.xz), .parquet or .arrow")
    return files
