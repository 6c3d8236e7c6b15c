"""What a DCP checkpoint's storage index may claim, checked before anything is built or read.

`.metadata` names, for every tensor, the chunks it is stored in and, for every chunk, a byte
range of a `__R_N.distcp` file. DCP trusts all of it: a checkpoint whose index declares a 600M-
parameter model over a 64-byte file made eval allocate the model (2.3 GiB) before the first read
failed, and a storage transform (`stream.zstd/1`) made DCP decompress an entry whole into memory.
So, before a model or any buffer is sized by the checkpoint:

- a storage entry has only the fields lmforge writes (path, offset, length: never a transform);
- its byte range lies within its file, and no two ranges of one file overlap;
- every tensor is covered by its chunks, each chunk inside the tensor, and each chunk's bytes
  (elements x element size) fit in the range that stores it.

Together: the bytes of every tensor the checkpoint declares are at most the bytes of its files,
so what lmforge allocates for a checkpoint is bounded by what is on disk, not by what it says.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from pipeline.errors import refusal

# The fields of the _StorageInfo entries lmforge writes (DCP leaves transform_descriptors unset).
STORAGE_FIELDS = {"relative_path", "offset", "length"}


def _is_count(v: object) -> bool:
    return type(v) is int and v >= 0


def check_storage_fields(index: MetadataIndex, info: _StorageInfo, where: Path) -> None:
    """Only path, offset and length: a transform (compression) is refused before any read."""
    extra = {k: v for k, v in vars(info).items() if k not in STORAGE_FIELDS and v}
    if extra:
        raise refusal(where, f"storage of {index.fqn!r} has fields lmforge never writes "
                             f"({', '.join(f'{k}={v!r}' for k, v in extra.items())}); a storage "
                             "transform would be decoded whole into memory before any check")
    if not (_is_count(info.offset) and _is_count(info.length)):
        raise refusal(where, f"storage of {index.fqn!r} has a bad offset or length")


def check_ranges(storage: dict, directory: Path, where: Path) -> None:
    """Every entry's byte range within its (regular) file; no two ranges of a file overlap."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        by_file.setdefault(info.relative_path, []).append(
            (info.offset, info.offset + info.length, index.fqn))
    for name, ranges in by_file.items():
        try:
            size = os.stat(directory / name).st_size
        except OSError:
            raise refusal(where, f"it stores tensors in {name}, which is missing") from None
        ranges.sort()
        end, last = 0, ""
        for start, stop, fqn in ranges:
            if stop > size:
                raise refusal(where, f"storage of {fqn!r} ends at byte {stop:,} of {name}, "
                                     f"which holds {size:,}")
            if start < end:
                raise refusal(where, f"storage of {fqn!r} overlaps that of {last!r} in {name}")
            end, last = stop, fqn


def _chunk_ok(chunk: object, size: tuple[int, ...]) -> bool:
    if not isinstance(chunk, ChunkStorageMetadata):
        return False
    offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
    return len(offsets) == len(sizes) == len(size) and all(
        _is_count(o) and _is_count(n) and o + n <= s for o, n, s in zip(offsets, sizes, size))


def check_tensor(key: str, entry: TensorStorageMetadata, storage: dict, where: Path) -> None:
    """The tensor `key` covered by its chunks, each chunk's bytes within its storage range."""
    size = tuple(entry.size)
    dtype = getattr(entry.properties, "dtype", None)
    if not (all(_is_count(s) for s in size) and isinstance(dtype, torch.dtype)
            and isinstance(entry.chunks, list) and all(_chunk_ok(c, size) for c in entry.chunks)):
        raise refusal(where, f"tensor {key!r} has a malformed shape, dtype or chunk list")
    covered = 0
    for chunk in entry.chunks:
        numel = math.prod(chunk.sizes)
        info = storage.get(MetadataIndex(key, chunk.offsets))
        if info is None:
            raise refusal(where, f"a chunk of tensor {key!r} has no storage entry")
        if numel * dtype.itemsize > info.length:
            raise refusal(where, f"tensor {key!r} {size} needs {numel * dtype.itemsize:,} bytes "
                                 f"of a chunk stored in {info.length:,}")
        covered += numel
    if covered < math.prod(size):
        raise refusal(where, f"the chunks of tensor {key!r} {size} cover {covered:,} of its "
                             f"{math.prod(size):,} elements")


def check_sizes(md: Metadata, directory: Path, where: Path) -> None:
    """Every storage range within its file, every tensor within its storage (module docstring);
    `md`'s storage entries already checked by check_storage_fields."""
    storage = md.storage_data
    check_ranges(storage, directory, where)
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            check_tensor(key, entry, storage, where)
