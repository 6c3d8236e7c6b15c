"""Reading a DCP checkpoint without trusting its files.

A checkpoint may come from anyone (a download, a shared drive), so nothing in it may run code,
make us read outside its directory or size our memory. DCP trusts its files in three places:

- `.metadata` is a pickle: read through an unpickler that admits only the classes DCP writes,
  then checked (pipeline.checkpoint.dcp_checks): every storage file one of DCP's own, a regular
  file in the directory, and every size it declares bounded by the bytes of its files.
- Non-tensor entries ("bytes") are unpickled by `DefaultLoadPlanner.load_bytes` with
  `weights_only=False`: `SafeLoadPlanner` loads them with `weights_only=True`, and `check_against`
  refuses, before DCP reads a byte, a bytes entry where the model or optimizer holds a tensor.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)

from lmforge.data_prep.safe_files import UnsafeFile, read_bytes
from lmforge.pipeline.checkpoint.dcp_checks import check_metadata
from lmforge.pipeline.errors import CheckpointError, refusal

# DCP warns on every save and load in one process (no_dist), which for us is a normal, intended
# case: a one-process run, or a sharded checkpoint read whole.
SINGLE_PROCESS_WARNING = "torch.distributed is .*single process"
# An index of chunks and byte ranges: ~100 bytes per tensor per rank, megabytes at most.
MAX_METADATA_BYTES = 1 << 28


@contextlib.contextmanager
def single_process_ok():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        yield


# Every global a DCP .metadata pickle names (torch 2.x): its dataclasses, torch.Size, dtypes,
# layouts (rebuilt by name) and the checkpoint path. Anything else is refused.
_DCP_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _DCP_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP never writes")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's FileSystemReader: .metadata through the allow-list unpickler, then checked."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            data = read_bytes(path, MAX_METADATA_BYTES, what="checkpoint .metadata")
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except UnsafeFile:
            raise
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing; the checkpoint is incomplete, use another") from None
        except Exception as e:  # any malformed pickle: one line, never a traceback
            raise refusal(path, f"not DCP metadata lmforge can read safely ({e})") from None
        check_metadata(metadata, Path(self.path), path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries are unpickled with weights_only=True: plain
    containers, numbers and strings load, anything that names other code is refused."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes does, minus its pickle
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def check_against(state: dict, metadata: Metadata, where: Path) -> None:
    """Before DCP reads anything into `state`: every key we load is in the checkpoint, as a
    tensor of the same shape where we hold a tensor, and as bytes only where we hold a value."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=True)
    stored = metadata.state_dict_metadata
    missing, shapes = [], []
    for key, ours in planner.state_dict.items():
        entry = stored.get(key)
        if entry is None:
            missing.append(key)
        elif isinstance(ours, torch.Tensor) and not isinstance(entry, TensorStorageMetadata):
            raise refusal(where, f"it stores {key} as pickled bytes where lmforge expects a tensor")
        elif not isinstance(ours, torch.Tensor) and not isinstance(entry, BytesStorageMetadata):
            raise refusal(where, f"it stores {key} as a tensor where lmforge expects a value")
        elif isinstance(ours, torch.Tensor) and tuple(entry.size) != tuple(ours.shape):
            shapes.append(f"{key}: {tuple(entry.size)} vs {tuple(ours.shape)}")
    if missing or shapes:
        raise misfit(where, "; ".join([*(f"shape {s}" for s in shapes[:2]),
                                       *(f"missing {k}" for k in missing[:2])]))


def misfit(where: Path, detail: str) -> CheckpointError:
    return CheckpointError(
        f"weights in {where} do not fit the model described by its meta.json ({detail}); "
        "the checkpoint is corrupt or was assembled from two runs"
    )


def load_into(state: dict, checkpoint_dir: Path, no_dist: bool) -> None:
    """dcp.load of `state` from `checkpoint_dir`, with every check above; any failure inside DCP
    (a crafted payload, a truncated file) is one CheckpointError."""
    reader = SafeFileSystemReader(checkpoint_dir)
    check_against(state, reader.read_metadata(), checkpoint_dir)
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as e:  # a BaseException: DCP wraps each rank's failure in it
        cause = next((exc for exc, _ in e.failures.values()), e)
        first_line = (str(cause).strip().splitlines() or [""])[0]
        raise refusal(checkpoint_dir, f"DCP could not read it ({type(cause).__name__}: "
                                      f"{first_line})") from None
