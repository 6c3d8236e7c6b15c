"""What a DCP checkpoint's `.metadata` may claim, checked before anything is built or read.

DCP trusts its index: every storage path is joined to the directory as it is, every byte range
and tensor size is believed, a storage transform is decoded whole. A crafted index declaring a
600M-parameter model over a 64-byte file made eval allocate the model (2.3 GiB) before the first
read failed, and `stream.zstd/1` made DCP decompress an entry whole into memory. So:

- every entry is a tensor, or bytes for an optimizer's param-group settings (all lmforge writes);
- every storage entry is a path, offset and length (never a transform) naming a byte range of a
  regular `__R_N.distcp` file in the directory, and no two ranges of one file overlap;
- every tensor is covered by its chunks exactly once (no chunk listed twice, no two meeting),
  each inside the tensor, each chunk's bytes (elements x element size) within the range that
  stores it.

Together: what lmforge allocates for a checkpoint is bounded by the bytes on disk.
"""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from lmforge.data_prep.safe_files import kind_of
from lmforge.pipeline.errors import refusal

STORAGE_FILE = re.compile(r"^__\d+_\d+\.distcp$")
BYTES_KEY = re.compile(r"^optim\.param_groups\.\d+\.\w+$")  # lr, betas, its params' names, ...
STORAGE_FIELDS = {"relative_path", "offset", "length"}  # DCP leaves transform_descriptors unset


def _is_count(v: object) -> bool:
    return type(v) is int and v >= 0


def check_metadata(md: object, directory: Path, where: Path) -> None:
    """A refusal naming the first claim of `md` (the module docstring's) that does not hold."""
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise refusal(where, "it does not hold DCP Metadata")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(entry, TensorStorageMetadata | BytesStorageMetadata):
            raise refusal(where, f"entry {key!r} is neither a tensor nor bytes")
        if isinstance(entry, BytesStorageMetadata) and not BYTES_KEY.match(key):
            raise refusal(where, f"it stores {key!r} as pickled bytes; lmforge writes bytes only "
                                 "for optimizer param-group settings")
    if not isinstance(md.storage_data, dict):
        raise refusal(where, "it has no storage index")
    _check_storage(md.storage_data, directory, where)
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor(key, entry, md.storage_data, where)


def _check_storage(storage: dict, directory: Path, where: Path) -> None:
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise refusal(where, "its storage index holds foreign objects")
        name = info.relative_path
        if not isinstance(name, str) or not STORAGE_FILE.match(name):
            raise refusal(where, f"it points {index.fqn!r} at {name!r}; only DCP's own "
                                 "__R_N.distcp files inside the checkpoint are read")
        if extra := {k: v for k, v in vars(info).items() if k not in STORAGE_FIELDS and v}:
            shown = ", ".join(f"{k}={v!r}" for k, v in extra.items())
            raise refusal(where, f"storage of {index.fqn!r} has fields lmforge never writes "
                                 f"({shown}); a storage transform would be decoded whole into "
                                 "memory before any check")
        if not (_is_count(info.offset) and _is_count(info.length)):
            raise refusal(where, f"storage of {index.fqn!r} has a bad offset or length")
        by_file.setdefault(name, []).append((info.offset, info.offset + info.length, index.fqn))
    for name, ranges in by_file.items():
        try:
            st = os.lstat(directory / name)
        except OSError:
            raise refusal(where, f"it stores tensors in {name}, which is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise refusal(where, f"{directory / name} is {kind_of(st.st_mode)}; checkpoint "
                                 "files must be regular files")
        end, last = 0, ""
        for start, stop, fqn in sorted(ranges):
            if stop > st.st_size:
                raise refusal(where, f"storage of {fqn!r} ends at byte {stop:,} of {name}, "
                                     f"which holds {st.st_size:,}")
            if start < end:
                raise refusal(where, f"storage of {fqn!r} overlaps that of {last!r} in {name}")
            end, last = stop, fqn


def _chunk_ok(chunk: object, size: tuple[int, ...]) -> bool:
    if not isinstance(chunk, ChunkStorageMetadata):
        return False
    offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
    return len(offsets) == len(sizes) == len(size) and all(
        _is_count(o) and _is_count(n) and o + n <= s for o, n, s in zip(offsets, sizes, size))


def _check_tensor(key: str, entry: TensorStorageMetadata, storage: dict, where: Path) -> None:
    size = tuple(entry.size)
    dtype = getattr(entry.properties, "dtype", None)
    if not (all(_is_count(s) for s in size) and isinstance(dtype, torch.dtype)
            and isinstance(entry.chunks, list) and all(_chunk_ok(c, size) for c in entry.chunks)):
        raise refusal(where, f"tensor {key!r} has a malformed shape, dtype or chunk list")
    covered, seen = 0, set()
    for chunk in entry.chunks:
        numel, offsets = math.prod(chunk.sizes), tuple(chunk.offsets)
        if offsets in seen:  # one chunk listed twice would count its elements twice
            raise refusal(where, f"tensor {key!r} lists its chunk at {offsets} twice")
        seen.add(offsets)
        info = storage.get(MetadataIndex(key, chunk.offsets))
        if info is None:
            raise refusal(where, f"a chunk of tensor {key!r} has no storage entry")
        if numel * dtype.itemsize > info.length:
            raise refusal(where, f"tensor {key!r} {size} needs {numel * dtype.itemsize:,} bytes "
                                 f"of a chunk stored in {info.length:,}")
        covered += numel
    if covered != math.prod(size) or not _disjoint(entry.chunks):
        raise refusal(where, f"the chunks of tensor {key!r} {size} cover {covered:,} of its "
                             f"{math.prod(size):,} elements, some of them twice or not at all; "
                             "each must be stored exactly once (an unstored row would keep its "
                             "random initialisation)")


def _disjoint(chunks: list[ChunkStorageMetadata]) -> bool:
    """No element in two chunks: a sweep along dim 0, each chunk compared only with those whose
    dim-0 range it meets (the row slabs FSDP writes meet none)."""
    boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks if math.prod(c.sizes))
    if not boxes or not boxes[0][0]:  # a 0-dim tensor: one chunk (duplicates refused above)
        return len(boxes) <= 1
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for off, n in boxes:
        active = [(o, m) for o, m in active if o[0] + m[0] > off[0]]
        if any(all(a < b + k and b < a + m_ for a, m_, b, k in zip(o, m, off, n))
               for o, m in active):
            return False
        active.append((off, n))
    return True
