"""The on-disk format of a prepared dataset: token shards plus manifest.json. Defined here only.

Shard file (`train_000000.bin`, `val_000000.bin`, ...), little-endian, HEADER_BYTES = 32:

    offset  size  field
    0       8     magic  b"LMFSHARD"
    8       4     uint32 format version (FORMAT_VERSION)
    12      4     uint32 bytes per token: 2 (uint16) or 4 (uint32)
    16      8     uint64 number of tokens
    24      8     uint64 vocabulary size (n_vocab of the encoding, special tokens included)
    32      ...   the tokens, `count * itemsize` bytes, nothing after them

so `np.memmap(path, dtype, mode="r", offset=32, shape=(count,))` reads a shard. Tokens are uint16
when the vocabulary has at most 65536 ids, else uint32.

Document layout (the statement the loader relies on): every document is stored as
`[EOT, t_1, ..., t_n]` -- one end-of-text token *before* it -- and lies wholly inside one shard,
so every shard starts with EOT, and splitting a shard at its EOT positions gives back exactly its
documents, in input order. `t_i` equal tiktoken's `encode_ordinary(document)`.

Document index (`train_000000.idx` beside `train_000000.bin`, written by prepare with its shard;
absent in data prepared before it, then built once from the tokens by `load_doc_index`):

    offset  size  field
    0       8     magic  b"LMFDOCIX"
    8       4     uint32 index version (INDEX_VERSION)
    12      4     uint32 0 (reserved)
    16      8     uint64 number of entries n
    24      8     uint64 tokens of its shard
    32      8n    uint64 offset in the shard of each EOT, increasing

so that document boundaries are read without reading the tokens (start-up O(shards + documents),
not O(bytes)). Its sha256 is the manifest's `index_sha256` of its shard ("" in data prepared
before it was recorded: such an index is read, and checked against the tokens as every index is). The loader reads the offsets in stream coordinates, so a document that runs over
a shard boundary (a shard not starting with EOT) is read as one document.

manifest.json, written last (its presence means the dataset is complete):
`{"version", "vocab_size", "eot_id", "dtype", "tokenizer": {kind, name, vocab_size, eot_id,
sha256, pattern}, "source", "args", "stats", "shards": [{file, split, tokens, documents,
sha256, index_sha256 (optional)}], "totals": {split: {"tokens", "documents", "shards"}}}` where a shard's sha256 is over
the whole file, header included, a shard's file is named SPLIT_NNNNNN.bin, and "stats" holds only
_STATS_TYPES's keys. Every file here is opened by data_prep/safe_files.py's rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.safe_files import (
    atomic_write_bytes,
    check_tree,
    file_sha256,
    open_file,
    read_bytes,
    read_text,
)

FORMAT_VERSION = 1
MAGIC = b"LMFSHARD"
_HEADER = struct.Struct("<8sIIQQ")
HEADER_BYTES = _HEADER.size  # 32
INDEX_MAGIC = b"LMFDOCIX"
INDEX_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # ~250 bytes a shard: far past any dataset's shard list
SPLITS = ("train", "val")
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


class ShardError(DataError):
    """A shard or manifest on disk is damaged or does not match its manifest."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest token dtype that holds every id of a vocabulary of `vocab_size`."""
    if vocab_size <= 2**16:
        return _DTYPES[2]
    if vocab_size <= 2**32:
        return _DTYPES[4]
    raise DataError(f"vocabulary of {vocab_size} tokens does not fit uint32; use a smaller tokenizer")


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def _fix_hint(path: Path) -> str:
    return (f"delete {path.name} (and manifest.json) in {path.parent} and re-run `lmforge prepare` "
            "with the same arguments to rebuild it")


def check_dir_path(path: Path, flag: str) -> None:
    """DataError unless `path` is, or can be made, a directory: neither it nor a parent a file."""
    for at in (path, *path.parents):
        if at.exists():
            if not at.is_dir():
                raise DataError(f"{flag} {path}: {at} is a file, not a directory; give a "
                                "directory path")
            return


def write_shard(path: Path | str, tokens: np.ndarray | list[np.ndarray], vocab_size: int,
                dtype: np.dtype | None = None) -> str:
    """Write one shard atomically; returns the sha256 (hex) of the whole file.

    `tokens` may be one array or a list of arrays (written back to back, never concatenated, so
    a shard costs no second copy in memory). `dtype` defaults to `dtype_for_vocab(vocab_size)`.
    """
    parts = [tokens] if isinstance(tokens, np.ndarray) else list(tokens)
    dtype = np.dtype(dtype or dtype_for_vocab(vocab_size)).newbyteorder("<")
    if vocab_size > np.iinfo(dtype).max + 1:
        raise DataError(f"vocabulary of {vocab_size} tokens does not fit {dtype.name}; "
                        "use uint32 (drop --dtype) or a smaller vocabulary")
    count = sum(len(p) for p in parts)
    for p in parts:
        if len(p) and int(p.max()) >= vocab_size:
            raise DataError(f"token id {int(p.max())} >= vocab size {vocab_size} writing {path}; "
                            "the tokenizer and vocab size disagree")
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, dtype.itemsize, count, vocab_size)
    sha = hashlib.sha256()
    atomic_write_bytes(Path(path), [header, *(np.ascontiguousarray(p, dtype=dtype).data
                                              for p in parts)], sha)
    return sha.hexdigest()


def read_header(path: Path | str) -> tuple[int, np.dtype, int, int]:
    """(version, dtype, count, vocab_size) of a shard, after checking magic, version and size."""
    path = Path(path)
    try:
        with open_file(path, "rb", what="shard") as f:  # a link, FIFO or device: refused
            size, raw = os.fstat(f.fileno()).st_size, f.read(HEADER_BYTES)
    except OSError as e:
        raise ShardError(f"cannot read shard {path}: {e.strerror}; {_fix_hint(path)}") from None
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"shard {path} is truncated ({size} bytes, no header); {_fix_hint(path)}")
    magic, version, itemsize, count, vocab_size = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise ShardError(f"{path} is not an lmforge shard (bad magic); {_fix_hint(path)}")
    if version != FORMAT_VERSION:
        raise ShardError(f"shard {path} has format version {version}, this lmforge reads "
                         f"{FORMAT_VERSION}; re-run `lmforge prepare` into a new directory")
    if itemsize not in _DTYPES:
        raise ShardError(f"shard {path} has bad token size {itemsize}; {_fix_hint(path)}")
    if size != HEADER_BYTES + count * itemsize:
        raise ShardError(f"shard {path} is {size} bytes, header says "
                         f"{HEADER_BYTES + count * itemsize}; {_fix_hint(path)}")
    return version, _DTYPES[itemsize], count, vocab_size


def index_path(shard: Path) -> Path:
    return Path(shard).with_suffix(".idx")


def write_doc_index(shard: Path | str, offsets: np.ndarray, shard_tokens: int,
                    per_process: bool = False) -> str:
    """Write the document index of `shard` (its EOT offsets) atomically beside it; returns its
    sha256. `per_process` when built at load, where every rank may write it at once."""
    header = _HEADER.pack(INDEX_MAGIC, INDEX_VERSION, 0, len(offsets), shard_tokens)
    sha = hashlib.sha256()
    atomic_write_bytes(index_path(Path(shard)), [header, np.ascontiguousarray(offsets, "<u8").data],
                       sha, per_process=per_process)
    return sha.hexdigest()


def read_doc_index(shard: Path | str, shard_tokens: int, sha256: str = "") -> np.ndarray | None:
    """The EOT offsets of `shard` as int64, validated (its `sha256` when the manifest records
    one, header, size, order, range); None when the shard has no index (prepared before the
    index existed). That each offset is an EOT is `check_doc_index`'s, which reads the tokens."""
    path = index_path(Path(shard))
    try:  # bounded: an index holds at most one offset per token of its shard
        raw = read_bytes(path, HEADER_BYTES + 8 * shard_tokens, what="document index")
    except FileNotFoundError:
        if sha256:
            raise ShardError(f"document index {path} is missing; {_fix_hint(Path(shard))}") from None
        return None
    fix = (_fix_hint(Path(shard)) if sha256 else
           f"delete {path} (it is rebuilt from its shard on the next start)")
    if sha256 and hashlib.sha256(raw).hexdigest() != sha256:
        raise ShardError(f"document index {path} fails its sha256 checksum (corrupted); {fix}")
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"document index {path} is truncated; {fix}")
    magic, version, _, count, tokens = _HEADER.unpack(raw[:HEADER_BYTES])
    if magic != INDEX_MAGIC or version != INDEX_VERSION:
        raise ShardError(f"{path} is not a version-{INDEX_VERSION} lmforge document index; {fix}")
    if tokens != shard_tokens or len(raw) != HEADER_BYTES + 8 * count:
        raise ShardError(f"document index {path} does not match its shard ({tokens} vs "
                         f"{shard_tokens} tokens, {len(raw)} bytes); {fix}")
    offsets = np.frombuffer(raw, "<u8", offset=HEADER_BYTES)
    if count and (offsets.max() >= tokens or (np.diff(offsets.astype(np.int64)) <= 0).any()):
        raise ShardError(f"document index {path} is not increasing within its shard's "
                         f"{tokens} tokens; {fix}")
    return offsets.astype(np.int64)


def check_doc_index(shard: Path, offsets: np.ndarray, tokens: np.ndarray, eot_id: int) -> None:
    """Every offset of `shard`'s index points at an EOT of its `tokens` (one token read per
    document): an index shifted within its range would start every row mid-document."""
    if len(offsets) and (bad := np.flatnonzero(tokens[offsets] != eot_id)).size:
        raise ShardError(f"document index {index_path(shard)} points at {bad.size} token(s) that "
                         f"are not end-of-text (first: entry {bad[0]}, offset {offsets[bad[0]]}); "
                         f"{_fix_hint(shard)}")


def open_shard(path: Path | str) -> np.ndarray:
    """The tokens of a shard as a read-only np.memmap (header and file size validated)."""
    _, dtype, count, _ = read_header(path)
    return map_tokens(path, dtype, count)


def map_tokens(path: Path | str, dtype: np.dtype, count: int) -> np.ndarray:
    """The tokens of a shard whose header was already validated, as a read-only np.memmap of the
    file opened by the rule (its size checked again on the descriptor mapped: a file replaced or
    cut since its header was read would map other bytes, or fault on a read past its end)."""
    with open_file(path, "rb", what="shard") as f:
        if os.fstat(f.fileno()).st_size != HEADER_BYTES + count * dtype.itemsize:
            raise ShardError(f"shard {path} changed size since its header was read; "
                             f"{_fix_hint(Path(path))}")
        if count == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(f, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


def copy_plain_tree(src: Path, dst: Path, dirs_exist_ok: bool = False) -> None:
    """Copy a tokenizer or data directory of directories and regular files only: following a
    link would put a file from outside (a user's secret, say) into a checkpoint or an export, and
    a FIFO would hang the copy."""
    check_tree(src, what="directory to copy")
    if dirs_exist_ok and os.path.lexists(dst):  # a copy over one: never written through a link
        check_tree(dst, what="directory copied into")
    # symlinks=True: a link made after the check above is copied as a link, never followed.
    shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=dirs_exist_ok)


@dataclass
class ShardInfo:
    file: str  # name relative to the dataset directory
    split: str  # "train" or "val"
    tokens: int
    documents: int
    sha256: str
    index_sha256: str = ""  # of its document index; "" in data prepared before it was recorded


@dataclass
class Manifest:
    version: int
    vocab_size: int  # n_vocab of the encoding, special tokens included
    eot_id: int
    tokenizer: dict[str, Any]  # kind, name, vocab_size, eot_id, sha256, pattern
    source: str
    args: dict[str, Any]
    shards: list[ShardInfo]
    stats: dict[str, Any] = field(default_factory=dict)
    dtype: str = ""  # "uint16" / "uint32"; filled from vocab_size when empty
    data_dir: Path = field(default=Path("."), compare=False)  # not stored; set by load_manifest

    def __post_init__(self) -> None:
        self.dtype = self.dtype or dtype_for_vocab(self.vocab_size).name.replace("<", "")

    def shard_paths(self, split: str) -> list[Path]:
        """Paths of the shards of `split`, in order."""
        return [self.data_dir / s.file for s in self.shards if s.split == split]

    def num_tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.shards if s.split == split)

    def num_documents(self, split: str) -> int:
        return sum(s.documents for s in self.shards if s.split == split)

    def totals(self) -> dict[str, dict[str, int]]:
        return {sp: {"tokens": self.num_tokens(sp), "documents": self.num_documents(sp),
                     "shards": len(self.shard_paths(sp))} for sp in SPLITS}

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["data_dir"]
        d["totals"] = self.totals()
        return d

    def save(self, data_dir: Path | str) -> None:
        text = json.dumps(self.to_json(), indent=2) + "\n"
        atomic_write_bytes(Path(data_dir) / MANIFEST_NAME, [text.encode()])


# The JSON type of each manifest field, checked on read: a hand-edited or damaged manifest is
# named as such, never a TypeError deep in whatever reads the field first.
_MANIFEST_TYPES = {"version": int, "vocab_size": int, "eot_id": int, "tokenizer": dict,
                   "source": str, "args": dict, "shards": list, "stats": dict, "dtype": str}
_SHARD_TYPES = {"file": str, "split": str, "tokens": int, "documents": int, "sha256": str,
                "index_sha256": str}
_TOKENIZER_KEYS = ("kind", "name", "sha256")  # optional: a synthetic dataset has none
# The stats prepare writes (all optional; a count is an int >= 0): what `inspect` prints and
# `--merge` adds up. Any other key is refused, as a typo in a config is.
_STATS_TYPES = {"documents": int, "train_documents": int, "val_documents": int,
                "replaced_chars": int, "val_threshold": int, "val_floor": (int, type(None)),
                "source_files": (str, type(None))}


def _typed(d: dict, types: dict[str, type]) -> list[str]:
    """The keys of `d` whose value is not of its JSON type (a bool is no int here)."""
    return [k for k, tp in types.items() if k in d and (
        not isinstance(d[k], tp) or isinstance(d[k], bool))]


def shard_infos_from_json(items: Any, where: Path, fix: str) -> list[ShardInfo]:
    """The shard list of a manifest or of a prepare's resume state, validated: each entry has the
    fields of ShardInfo with their types, a known split, counts >= 0, and names a file of the
    dataset directory itself (a path such as "../x" or "/etc/x" would read or delete outside it)."""
    if not isinstance(items, list) or not all(isinstance(s, dict) for s in items):
        raise ShardError(f"{where}: its shard list is not a list of objects; {fix}")
    for s in items:
        if not (_SHARD_TYPES.keys() - {"index_sha256"} <= s.keys() <= _SHARD_TYPES.keys()) \
                or _typed(s, _SHARD_TYPES):
            raise ShardError(f"{where}: shard entry {s!r} does not have the fields "
                             f"{list(_SHARD_TYPES)} with their types; {fix}")
    infos = [ShardInfo(**s) for s in items]
    if bad := [s.file for s in infos if s.split not in SPLITS]:
        raise ShardError(f"{where} lists shards of unknown split: {bad}; {fix}")
    if bad := [s.file for s in infos if s.tokens < 0 or s.documents < 0]:
        raise ShardError(f"{where} gives negative counts for shards {bad[:2]}; {fix}")
    # Only names prepare gives (split_NNNNNN.bin): a path such as "../x" or "/etc/x" would read
    # or delete outside the directory, "manifest.json" another file of it.
    if bad := [s.file for s in infos if not re.fullmatch(rf"{s.split}_\d{{6,}}\.bin", s.file)]:
        raise ShardError(f"{where} names shards outside its directory, or not as its shard "
                         f"files (SPLIT_NNNNNN.bin): {bad[:2]}; {fix}")
    return infos


def manifest_from_json(d: Any, where: Path) -> Manifest:
    """Build a Manifest from its JSON dict, checking version, fields and their types
    (ShardError if bad)."""
    fix = f"re-run `lmforge prepare` into {where.parent}"
    if not isinstance(d, dict):
        raise ShardError(f"{where} is not a JSON object; {fix}")
    if d.get("version") != FORMAT_VERSION:
        raise ShardError(f"{where} has format version {d.get('version')!r}, this lmforge reads "
                         f"{FORMAT_VERSION}; {fix}")
    names = {f.name for f in dataclasses.fields(Manifest)} - {"data_dir"}
    required = names - {"stats", "dtype"}
    if missing := sorted(required - d.keys()):
        raise ShardError(f"{where} lacks fields {missing}; {fix}")
    if bad := _typed(d, _MANIFEST_TYPES):
        raise ShardError(f"{where} is malformed: {', '.join(bad)} not of type "
                         f"{', '.join(_MANIFEST_TYPES[k].__name__ for k in bad)}; {fix}")
    if bad := [k for k in _TOKENIZER_KEYS if not isinstance(d["tokenizer"].get(k, ""), str)]:
        raise ShardError(f"{where}: its tokenizer's {bad} are not text; {fix}")
    stats = d.get("stats", {})
    if bad := sorted(set(stats) - _STATS_TYPES.keys()) + _typed(stats, _STATS_TYPES) + \
            [k for k, v in stats.items() if isinstance(v, int) and v < 0]:
        raise ShardError(f"{where}: its stats {bad} are unknown keys or values of the wrong type "
                         f"(counts are integers >= 0); {fix}")
    dtype = d.get("dtype") or ("uint16" if d["vocab_size"] <= 2**16 else "uint32")
    if not 0 <= d["eot_id"] < d["vocab_size"] or dtype not in ("uint16", "uint32") or \
            d["vocab_size"] > np.iinfo(dtype).max + 1:
        raise ShardError(f"{where} is malformed (eot_id {d['eot_id']}, vocab_size "
                         f"{d['vocab_size']}, dtype {d.get('dtype')!r}); {fix}")
    kwargs = {k: d[k] for k in names if k in d}
    kwargs["shards"] = shard_infos_from_json(d["shards"], where, fix)
    return Manifest(**kwargs)


def load_manifest(data_dir: Path | str) -> Manifest:
    """Read and validate DIR/manifest.json. Missing → DataError telling the user to prepare."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST_NAME
    try:
        text = read_text(path, MAX_MANIFEST_BYTES, what="manifest")
    except (FileNotFoundError, NotADirectoryError):
        what = "does not exist" if not data_dir.exists() else "has no manifest.json (not prepared, or unfinished)"
        raise DataError(f"dataset directory {data_dir} {what}; run `lmforge prepare --out "
                        f"{data_dir} ...` first") from None
    except OSError as e:
        raise ShardError(f"cannot read {path} ({e.strerror}); check its permissions") from None
    try:
        d = json.loads(text)
    except ValueError as e:
        raise ShardError(f"cannot parse {path} ({e}); re-run `lmforge prepare`") from None
    m = manifest_from_json(d, path)
    m.data_dir = data_dir
    return m


def check_shard(path: Path, info: ShardInfo, vocab_size: int, checksum: bool = True,
                dtype_name: str = "") -> np.dtype:
    """Raise ShardError if the shard at `path` does not match its manifest entry (and the
    manifest's token dtype, where given); else return its token dtype."""
    _, dtype, count, vocab = read_header(path)
    if count != info.tokens or vocab != vocab_size or dtype_name not in ("", dtype.name):
        raise ShardError(f"shard {path} holds {count} tokens / vocab {vocab} / {dtype.name}, "
                         f"manifest says {info.tokens} / {vocab_size} / {dtype_name or 'any'}; "
                         f"{_fix_hint(path)}")
    if checksum and file_sha256(path) != info.sha256:
        raise ShardError(f"shard {path} fails its sha256 checksum (corrupted); {_fix_hint(path)}")
    return dtype


def verify(data_dir: Path | str) -> None:
    """Check every shard's header, size and sha256 against the manifest, and its document index
    (where it has one) against its tokens; one ShardError that lists every problem found."""
    m = load_manifest(data_dir)
    problems = []
    for info in m.shards:
        path = m.data_dir / info.file
        try:
            dtype = check_shard(path, info, m.vocab_size, dtype_name=m.dtype)
            offsets = read_doc_index(path, info.tokens, info.index_sha256)
            if offsets is not None:
                check_doc_index(path, offsets, map_tokens(path, dtype, info.tokens), m.eot_id)
        except ShardError as e:
            problems.append(str(e))
    if problems:
        raise ShardError(f"{len(problems)} bad shard(s) in {m.data_dir}: " + " | ".join(problems))
