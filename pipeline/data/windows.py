"""A split's shards as one token stream. Window i is the seq_len + 1 tokens from i * seq_len
(input w[:-1], target w[1:]): consecutive windows share one token, so every next-token pair of the
stream is trained once per epoch (a stride of seq_len + 1 would skip those across boundaries).
"""

from __future__ import annotations

import os

import numpy as np

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.shards import ShardError, check_shard, load_manifest, map_tokens
from lmforge.data_prep.tokenizer import fits_model


class TokenWindows:
    """The token stream of one split, read through np.memmap; never loaded into RAM."""

    def __init__(self, data_dir: str | os.PathLike, split: str, seq_len: int,
                 expected_vocab_size: int | None):
        """`expected_vocab_size`: the model's vocabulary; None or 0 skips the check."""
        manifest = load_manifest(data_dir)
        if expected_vocab_size and not fits_model(manifest.tokenizer | {"n_vocab": manifest.vocab_size},
                                                  expected_vocab_size):
            raise DataError(
                f"data vocab {manifest.vocab_size} vs model vocab {expected_vocab_size} in "
                f"{data_dir}; set model.vocab_size = {manifest.vocab_size} (or 0 to take it from "
                "the data), or re-prepare the data with the model's tokenizer")
        infos = [s for s in manifest.shards if s.split == split]
        # Start-up reads each shard's header and size, never its tokens (hashing 10B tokens on
        # every rank took minutes). A damaged payload is caught by the token-range check on every
        # read when it yields an id outside the vocabulary, and fully by `lmforge prepare --verify`.
        self.paths = [manifest.data_dir / s.file for s in infos]
        self.index_sha256s = [s.index_sha256 for s in infos]  # "" where not recorded
        # Kept so that a read maps a shard without reading its header again.
        self.dtypes = [check_shard(path, info, manifest.vocab_size, False, manifest.dtype)
                       for path, info in zip(self.paths, infos, strict=True)]
        self.vocab_size, self.eot_id = manifest.vocab_size, manifest.eot_id
        self.split, self.seq_len = split, seq_len
        # starts[k] = stream position of shard k's first token; starts[-1] = total tokens.
        self.starts = np.cumsum([0] + [s.tokens for s in infos])
        self.num_tokens = int(self.starts[-1])
        self.num_windows = max(0, (self.num_tokens - 1) // seq_len)
        if self.num_tokens == 0:
            how = " (lmforge prepare --val-fraction or --val-docs)" if split == "val" else ""
            raise DataError(f"the {split} split of {data_dir} is empty; prepare the data with "
                            f"a {split} split{how}")
        if self.num_windows == 0:
            raise DataError(
                f"the {split} split of {data_dir} has {self.num_tokens} tokens, fewer than "
                f"seq_len + 1 = {seq_len + 1}; use a shorter sequence (data.seq_len to train, "
                "--seq-len to eval) or prepare more data")

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split's stream as int64, across shard boundaries."""
        return self._read(start, stop, {})

    def windows(self, indices) -> np.ndarray:
        """int64 array (len(indices), seq_len + 1); a window may span shard boundaries."""
        # Fresh memmaps per call, dropped on return: a long-lived np.memmap keeps every page it
        # touched mapped, growing the process's memory over an epoch (nanoGPT's note).
        shards: dict[int, np.ndarray] = {}
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(indices):
            if not 0 <= i < self.num_windows:
                raise IndexError(f"window {i} out of range [0, {self.num_windows})")
            start = int(i) * self.seq_len
            out[row] = self._read(start, start + self.seq_len + 1, shards)
        return out

    def _read(self, start: int, stop: int, shards: dict[int, np.ndarray]) -> np.ndarray:
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) out of range [0, {self.num_tokens})")
        out, pos = np.empty(stop - start, dtype=np.int64), start
        while pos < stop:
            k = int(np.searchsorted(self.starts, pos, side="right")) - 1
            if k not in shards:
                shards[k] = map_tokens(self.paths[k], self.dtypes[k],
                                       int(self.starts[k + 1] - self.starts[k]))
            end = min(stop, int(self.starts[k + 1]))
            first = int(self.starts[k])
            out[pos - start:end - start] = shards[k][pos - first:end - first]
            self._check_ids(out[pos - start:end - start], k)
            pos = end
        return out

    def _check_ids(self, ids: np.ndarray, k: int) -> None:
        # An id past the vocabulary would index outside the embedding (on CUDA, an opaque
        # device-side assert): name the shard instead. Costs one max over tokens already read.
        if ids.size and (top := int(ids.max())) >= self.vocab_size:
            raise ShardError(
                f"shard {self.paths[k]} holds token id {top} >= vocab size {self.vocab_size} "
                f"(corrupted); run `lmforge prepare --verify {self.paths[k].parent}` and re-run "
                "`lmforge prepare` to rebuild the damaged shard")
