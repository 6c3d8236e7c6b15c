"""The training loader: fixed-length windows of a prepared split, in a seeded global order.

A split's shards are read as one concatenated token stream. Window i is the seq_len + 1 tokens
starting at i * seq_len (input = w[:-1], target = w[1:]); the stride is seq_len, so consecutive
windows share one token and every next-token pair of the stream is trained exactly once per epoch
(a stride of seq_len + 1 would never train the pair across each window boundary).

The order is global, not per rank: each epoch is one permutation of all windows, seeded by
(seed, epoch), and every optimizer step consumes the next G = micro_batch_size *
grad_accum_steps * world_size windows of it. Within a step, the G windows form G / micro_batch_size
chunks of micro_batch_size windows; rank r's micro-step m is chunk r * grad_accum_steps + m. So the
windows of a step -- and each chunk -- depend only on the global batch, never on how it is split
over processes: 1 process with 2 accumulation steps and 2 processes with 1 see the same windows,
and the loader state (epoch, windows consumed) resumes on any world size. When fewer than G
windows are left in an epoch, that tail is dropped and the next epoch starts (its permutation puts
those windows elsewhere), so no window is read twice within an epoch.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from data_prep.errors import DataError
from data_prep.shards import ShardError, check_shard, load_manifest, map_tokens
from model.model import IGNORE_INDEX  # noqa: F401 - re-exported: the target eval padding rows carry


class TokenWindows:
    """The token stream of one split, read through np.memmap; never loaded into RAM."""

    def __init__(self, data_dir: str | os.PathLike, split: str, seq_len: int,
                 expected_vocab_size: int | None):
        """`expected_vocab_size`: the model's vocabulary; None or 0 (= take it from the data)
        skips the check."""
        manifest = load_manifest(data_dir)
        if expected_vocab_size and manifest.vocab_size != expected_vocab_size:
            raise DataError(
                f"data vocab {manifest.vocab_size} vs model vocab {expected_vocab_size} in "
                f"{data_dir}; set model.vocab_size = {manifest.vocab_size} (or 0 to take it from "
                "the data), or re-prepare the data with the model's tokenizer")
        infos = [s for s in manifest.shards if s.split == split]
        # Start-up reads each shard's 32-byte header and size, never its tokens: O(shards), not
        # O(bytes) (hashing 10B tokens on every rank took minutes). A truncated or mismatched
        # shard fails here; a damaged payload is caught by the token-range check on every read
        # when it yields an id outside the vocabulary, and fully by `lmforge prepare --verify`.
        self.paths = [manifest.data_dir / s.file for s in infos]
        # Kept so that a read maps a shard without reading its header again.
        self.dtypes = [check_shard(path, info, manifest.vocab_size, checksum=False)
                       for path, info in zip(self.paths, infos, strict=True)]
        self.vocab_size = manifest.vocab_size
        self.eot_id = manifest.eot_id
        self.split = split
        self.seq_len = seq_len
        # starts[k] = stream position of shard k's first token; starts[-1] = total tokens.
        self.starts = np.cumsum([0] + [s.tokens for s in infos])
        self.num_tokens = int(self.starts[-1])
        self.num_windows = max(0, (self.num_tokens - 1) // seq_len)
        if self.num_windows == 0:
            raise DataError(
                f"the {split} split of {data_dir} has {self.num_tokens} tokens, fewer than "
                f"seq_len + 1 = {seq_len + 1}; lower data.seq_len or prepare more data")

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


def _split_xy(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())


class TrainLoader:
    """This rank's micro-batches of each optimizer step; see the module docstring for the order."""

    def __init__(self, windows: TokenWindows, micro_batch_size: int, grad_accum_steps: int,
                 rank: int, world_size: int, seed: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.windows = windows
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.rank = rank
        self.seed = seed
        self.windows_per_step = micro_batch_size * grad_accum_steps * world_size
        if self.windows_per_step > windows.num_windows:
            raise DataError(
                f"one step needs {self.windows_per_step} windows of {windows.seq_len + 1} tokens, "
                f"the {windows.split} split has only {windows.num_windows}; lower "
                "train.global_batch_tokens or data.seq_len, or prepare more data")
        self._epoch = 0
        self._position = 0  # windows of this epoch's order consumed, over all ranks
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.windows.num_windows // self.windows_per_step

    def _order_of(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = rng.permutation(self.windows.num_windows)
            self._order_epoch = epoch
        return self._order

    def next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """grad_accum_steps (x_BT, y_BT) int64 CPU tensors: this rank's share of the next step."""
        if self._position + self.windows_per_step > self.windows.num_windows:
            self._epoch, self._position = self._epoch + 1, 0  # drop the partial tail
        step = self._order_of(self._epoch)[self._position:self._position + self.windows_per_step]
        self._position += self.windows_per_step
        per_rank = self.micro_batch_size * self.grad_accum_steps
        mine = step[self.rank * per_rank:(self.rank + 1) * per_rank]
        return [_split_xy(self.windows.windows(mine[m:m + self.micro_batch_size]))
                for m in range(0, per_rank, self.micro_batch_size)]

    def state_dict(self) -> dict[str, int]:
        """The global cursor: the same on every rank, valid for any world size."""
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed,
                "num_windows": self.windows.num_windows}

    def load_state_dict(self, d: dict[str, int]) -> None:
        if d["num_windows"] != self.windows.num_windows or d["seed"] != self.seed:
            raise DataError(
                f"the checkpoint's data order (seed {d['seed']}, {d['num_windows']} windows) does "
                f"not match this run's (seed {self.seed}, {self.windows.num_windows} windows); "
                "resume with the same data.path, data.seq_len and train.seed")
        self._epoch, self._position = int(d["epoch"]), int(d["position"])
