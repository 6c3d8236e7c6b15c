"""Training loader start-up against the number of shards: header reads, not bytes hashed.

    python -m bench.startup_bench [--shards 10 1000] [--shard-tokens 131072 13107200] [--rounds 3]

Two axes: the bytes of 10 shards grown 100x, and the number of shards grown 100x at a fixed
shard size. For each dataset it times what a rank does before its
first steps: open the split (TokenWindows: every shard's header and size), build the loader and
read rank 0's micro-batches of the first STEPS steps (world size 8, so a step's windows fall
across most shards, as with a real global random order). The reference, measured in the same run
and interleaved round by round, is the previous behaviour: each shard's sha256 on its first read.
Prints the median (and min-max) per dataset and, per axis, how start-up grew: flat in bytes for
the loader (it reads headers, O(shards): ~0.1 ms each), growing with the bytes for the reference. The page cache holds the shards, so the
reference's figure is hashing alone, a lower bound of its cost on a shared filesystem.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from lmforge.data_prep import shards as S
from lmforge.pipeline.data.loader import TokenWindows, TrainLoader

VOCAB, SEQ_LEN, MICRO, ACCUM, WORLD, STEPS = 50257, 1024, 8, 4, 8, 4


class HashingWindows(TokenWindows):
    """The previous loader: a shard's sha256 checked the first time this process reads it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._infos = [s for s in S.load_manifest(args[0]).shards if s.split == self.split]
        self._hashed: set[int] = set()

    def _read(self, start, stop, shards):
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        last = int(np.searchsorted(self.starts, stop - 1, side="right")) - 1
        for k in range(first, last + 1):
            if k not in self._hashed:
                S.check_shard(self.paths[k], self._infos[k], self.vocab_size, checksum=True)
                self._hashed.add(k)
        return super()._read(start, stop, shards)


def make_dataset(root: Path, n: int, shard_tokens: int) -> Path:
    root.mkdir(parents=True)
    rng = np.random.default_rng(n)
    infos = []
    for k in range(n):
        name = S.shard_name("train", k)
        sha = S.write_shard(root / name, rng.integers(0, VOCAB, shard_tokens, dtype=np.uint16), VOCAB)
        infos.append(S.ShardInfo(file=name, split="train", tokens=shard_tokens, documents=1, sha256=sha))
    S.Manifest(version=S.FORMAT_VERSION, vocab_size=VOCAB, eot_id=0, tokenizer={}, source="bench",
               args={}, shards=infos).save(root)
    return root


def start_up(data: Path, windows_cls: type[TokenWindows]) -> float:
    t0 = time.perf_counter()
    loader = TrainLoader(windows_cls(data, "train", SEQ_LEN, VOCAB), MICRO, ACCUM, 0, WORLD, seed=0)
    for _ in range(STEPS):
        loader.next_micro_batches()
    return time.perf_counter() - t0


def layouts(args) -> list[tuple[int, int]]:
    """(shards, tokens per shard): the byte axis at the smallest shard count, then the count axis."""
    lo = min(args.shards)
    return [(lo, t) for t in args.shard_tokens] + [(n, args.shard_tokens[0]) for n in args.shards if n != lo]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, nargs="+", default=[10, 1000])
    p.add_argument("--shard-tokens", type=int, nargs="+", default=[131072, 13107200],
                   help="tokens per shard; the first is used on the shard-count axis")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    grid = layouts(args)
    with tempfile.TemporaryDirectory() as tmp:
        data = {(n, t): make_dataset(Path(tmp) / f"n{n}_t{t}", n, t) for n, t in grid}
        times = {(kind, key): [] for kind in ("loader", "reference") for key in grid}
        for _ in range(args.rounds):  # interleaved: load drifts hit both alike
            for key in grid:
                times["loader", key].append(start_up(data[key], TokenWindows))
                times["reference", key].append(start_up(data[key], HashingWindows))
    print(f"start-up = open split + rank 0 of {WORLD}'s first {STEPS} steps; median (min-max) of "
          f"{args.rounds} rounds, page cache warm")
    print(f"{'shards':>7} {'MiB':>8} | {'header + size check (now)':>28} | "
          f"{'sha256 on first read (before)':>30} | before/now")
    med = {k: statistics.median(v) for k, v in times.items()}
    for key in grid:
        n, t = key
        cells = [f"{med[kind, key] * 1e3:9.1f} ms ({min(times[kind, key]) * 1e3:.0f}-"
                 f"{max(times[kind, key]) * 1e3:.0f})" for kind in ("loader", "reference")]
        print(f"{n:>7} {n * t * 2 / 2**20:8.1f} | {cells[0]:>28} | {cells[1]:>30} | "
              f"x{med['reference', key] / med['loader', key]:.2f}")
    big = grid[len(args.shard_tokens) - 1]
    for axis, a, b in ((f"bytes x{big[1] // grid[0][1]}", grid[0], big),
                       (f"shards x{grid[-1][0] // grid[0][0]}", grid[0], grid[-1])):
        print(f"{axis:>16}: now x{med['loader', b] / med['loader', a]:.2f}, "
              f"before x{med['reference', b] / med['reference', a]:.2f}")


if __name__ == "__main__":
    main()
