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
import io
import json
import lzma
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from data_prep.errors import DataError

TEXT_EXTS = (".txt", ".jsonl", ".json")
RECORD_EXTS = (".jsonl", ".json")
TABLE_EXTS = (".parquet", ".arrow")
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


@dataclass
class Source:
    spec: str
    text_field: str = "text"
    lines: bool = False
    replaced: int = 0  # U+FFFD characters substituted for invalid UTF-8, over all documents read
    total_docs: int | None = None  # known up front for file-per-document sources

    def __iter__(self) -> Iterator[str]:
        if self.spec == "builtin:pystdlib":
            return self._files(pystdlib_files())
        if self.spec.startswith("builtin:"):
            raise DataError(f"unknown builtin corpus {self.spec!r}; the only one is builtin:pystdlib")
        if self.spec.startswith("hf:"):
            return self._hf()
        return self._files(local_files(self.spec))

    def _decode(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", errors="replace")
            self.replaced += text.count("\ufffd") - raw.count("\ufffd".encode())
            return text

    def _files(self, files: list[Path]) -> Iterator[str]:
        if not self.lines and not any(_kind(f) in RECORD_EXTS for f in files):
            self.total_docs = len(files)
        for f in files:
            yield from self._file(f)

    def _file(self, path: Path) -> Iterator[str]:
        kind = _kind(path)
        if kind in TABLE_EXTS:
            yield from self._table(path)
            return
        opener = COMPRESSED.get(path.suffix, open)
        with opener(path, "rb") as f:
            if kind in RECORD_EXTS:
                yield from self._json(path, f)
            elif not self.lines:  # .txt, or .py for builtin:pystdlib
                yield self._decode(f.read())
            else:
                for raw in f:
                    if raw.strip():
                        yield self._decode(raw.rstrip(b"\r\n"))

    def _json(self, path: Path, f: io.BufferedIOBase) -> Iterator[str]:
        first = f.peek(64).lstrip()[:1] if hasattr(f, "peek") else b""
        if first == b"[":  # one JSON array: no way to stream it with the stdlib
            for i, rec in enumerate(json.loads(self._decode(f.read()))):
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
                reader = _open_arrow(path, pa)
                names, batches = reader.schema.names, iter(reader)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"cannot read {path} ({e}); check the file is {path.suffix}") from None
        if self.text_field not in names:
            raise DataError(f"{path} has no column {self.text_field!r} (it has {names}); "
                            "pass --text-field NAME")
        for batch in batches:
            for i, text in enumerate(batch.column(self.text_field).to_pylist()):
                yield self._field({self.text_field: text}, path, i + 1)

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


def _open_arrow(path: Path, pa):
    """Arrow IPC file or stream (datasets' save_to_disk writes streams)."""
    try:
        return pa.ipc.open_file(path)
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(path)


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """`hf:NAME[:CONFIG][@SPLIT]` -> (NAME, CONFIG or None, SPLIT or "train")."""
    rest, _, split = spec[3:].partition("@")
    name, _, config = rest.partition(":")
    if not name:
        raise DataError(f"bad source {spec!r}; write hf:NAME[:CONFIG][@SPLIT], e.g. hf:wikitext:wikitext-2-raw-v1@train")
    return name, config or None, split or "train"


def _kind(path: Path) -> str:
    """The format suffix of `path`, ignoring a compression suffix (`a.jsonl.gz` -> `.jsonl`)."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in COMPRESSED:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def _supported(path: Path) -> bool:
    return _kind(path) in TEXT_EXTS or (path.suffix in TABLE_EXTS)


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


def local_files(spec: str) -> list[Path]:
    """The sorted list of files named by a path, directory or glob (DataError if none)."""
    path = Path(spec)
    if path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.is_file() and _supported(p)),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise DataError(f"directory {spec} has no .txt/.jsonl/.json/.parquet/.arrow files; "
                            "point --source at the data")
        return files
    if any(c in spec for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"glob {spec!r} matches no files; check the pattern (quote it)")
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"source {spec!r} not found; give an existing file, directory, glob, "
                        "hf:NAME or builtin:pystdlib")
    if bad := [str(f) for f in files if not _supported(f)]:
        hint = " (.zst needs Python 3.14+; decompress first)" if any(b.endswith(".zst") for b in bad) else ""
        raise DataError(f"unsupported file type: {bad[0]}{hint}; use .txt, .jsonl, .json "
                        "(optionally .gz/.bz2/.xz), .parquet or .arrow")
    return files
