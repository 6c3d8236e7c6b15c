"""The training rows of one prepared split, as `data.align` chooses: seq_len + 1 tokens each, with
the number of tokens each really holds (the rest is padding, whose targets the loss ignores).

- `StreamRows` (stream): row i is the stream's window at i * seq_len (pipeline/data/windows.py).
- `DocRows` (doc): every row starts at a document start (the EOT before it) and holds whole
  documents, packed by best fit, longest first. A document longer than a row is cut at the
  stream's stride (each next-token pair once): its head is packed like a short document, the rest
  fills whole, unpadded *continuation rows*. The packing depends only on the data and seq_len;
  the loader permutes these rows per epoch as it permutes stream windows.
"""

from __future__ import annotations

import bisect

import numpy as np

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.shards import check_doc_index, map_tokens, read_doc_index, write_doc_index
from lmforge.pipeline.data.windows import TokenWindows
from lmforge.pipeline.metrics import get_logger

log = get_logger()


class StreamRows:
    """align = "stream": the windows of TokenWindows, all full."""

    align = "stream"

    def __init__(self, windows: TokenWindows):
        self.windows = windows
        self.num_rows = windows.num_windows
        self.padding = 0.0

    def read(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(w (n, seq_len + 1) int64, tokens used per row (n,))."""
        return self.windows.windows(indices), self.used_of(indices)

    def used_of(self, indices) -> np.ndarray:
        """Tokens used per row, without reading them."""
        return np.full(len(indices), self.windows.seq_len + 1, dtype=np.int64)

    def continues(self, indices) -> np.ndarray:
        """Whether each row continues a document from the row before (unknown here: False)."""
        return np.zeros(len(indices), dtype=bool)


def doc_starts(windows: TokenWindows) -> np.ndarray:
    """Stream positions of every EOT of the split, from the shards' document indexes (checked);
    a shard without one (prepared before the index) is scanned once and its index written."""
    parts, built = [], []
    for k, path in enumerate(windows.paths):
        n = int(windows.starts[k + 1] - windows.starts[k])
        offsets = read_doc_index(path, n, windows.index_sha256s[k])
        if offsets is not None:
            check_doc_index(path, offsets, map_tokens(path, windows.dtypes[k], n), windows.eot_id)
        else:
            offsets = np.flatnonzero(windows.tokens(int(windows.starts[k]),
                                                    int(windows.starts[k + 1])) == windows.eot_id)
            built.append(path)
            try:
                write_doc_index(path, offsets, n, per_process=True)
            except OSError as e:  # a read-only dataset: rebuilt on every start, and said so
                log.warning("cannot write the document index of %s (%s); it is rebuilt on every "
                            "start: re-run `lmforge prepare` into a writable directory", path,
                            e.strerror)
        parts.append(offsets + int(windows.starts[k]))
    if built:
        log.info("data.align = doc: built the document index of %d shard(s) of %s (prepared "
                 "before the index; written beside the shards, read from there next time)",
                 len(built), built[0].parent)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class DocRows:
    """align = "doc": rows packed from whole documents; see the module docstring."""

    align = "doc"

    def __init__(self, windows: TokenWindows):
        self.windows = windows
        T, R = windows.seq_len, windows.seq_len + 1
        starts = doc_starts(windows)
        if len(starts) == 0 or starts[0] != 0:  # a stream that does not open with EOT
            starts = np.concatenate([[0], starts]).astype(np.int64)
        lengths = np.diff(np.append(starts, windows.num_tokens))
        # A long document: its head (from its EOT, 2 to T + 1 tokens) is packed like a short
        # document, and the rest fills whole continuation rows at stride T, ending at its end.
        full = np.where(lengths > R, (lengths - 2) // T, 0)
        head = lengths - full * T
        doc_of_row = np.repeat(np.arange(len(starts)), full)
        k = np.arange(len(doc_of_row)) - np.repeat(np.cumsum(full) - full, full)
        cont_starts = starts[doc_of_row] + head[doc_of_row] - 1 + k * T
        keep = head >= 2  # a lone EOT has no target
        # A stream that does not open with EOT opens with a piece of a document: a continuation.
        cont = (np.arange(len(starts)) == 0) & bool(windows.tokens(0, 1)[0] != windows.eot_id)
        segments, row_ptr, row_cont = pack(starts[keep], head[keep], cont[keep], R)
        n_cont = len(cont_starts)
        self.seg_start = np.concatenate([cont_starts, segments[:, 0]]).astype(np.int64)
        self.seg_len = np.concatenate([np.full(n_cont, R), segments[:, 1]]).astype(np.int64)
        self.row_ptr = np.concatenate([np.arange(n_cont), row_ptr + n_cont]).astype(np.int64)
        self.row_cont = np.concatenate([np.ones(n_cont, dtype=bool), row_cont])
        self.num_rows = len(self.row_ptr) - 1
        used = np.add.reduceat(self.seg_len, self.row_ptr[:-1]) if self.num_rows else np.zeros(0)
        self.used = used.astype(np.int64)
        self.padding = float(1 - (self.used - 1).sum() / max(1, self.num_rows * T))
        if self.num_rows == 0:
            raise DataError(f"the {windows.split} split has no document of 2 tokens or more; "
                            "prepare more data or use data.align = stream")

    def read(self, indices) -> tuple[np.ndarray, np.ndarray]:
        w = np.full((len(indices), self.windows.seq_len + 1), self.windows.eot_id, dtype=np.int64)
        for row, i in enumerate(indices):
            pos = 0
            for s in range(self.row_ptr[i], self.row_ptr[i + 1]):
                n, start = int(self.seg_len[s]), int(self.seg_start[s])
                w[row, pos:pos + n] = self.windows.tokens(start, start + n)
                pos += n
        return w, self.used_of(indices)

    def used_of(self, indices) -> np.ndarray:
        return self.used[np.asarray(indices, dtype=np.int64)]

    def continues(self, indices) -> np.ndarray:
        return self.row_cont[np.asarray(indices, dtype=np.int64)]


class _Rooms:
    """Open rows by the room they have left: room -> row ids, and the rooms in order."""

    def __init__(self):
        self.by_room: dict[int, list[int]] = {}
        self.rooms: list[int] = []  # sorted keys of by_room with at least one row

    def add(self, rows: list[int], room: int) -> None:
        if room < 2 or not rows:  # no piece of a document is that short: those rows are full
            return
        if not self.by_room.get(room):
            self.by_room[room] = []
            bisect.insort(self.rooms, room)
        self.by_room[room].extend(rows)

    def take(self, need: int, k: int) -> tuple[int, list[int]]:
        """Up to k rows of the least room >= need, removed: (their room, rows); (0, []) if none."""
        j = bisect.bisect_left(self.rooms, need)
        if j == len(self.rooms):
            return 0, []
        room = self.rooms[j]
        bucket = self.by_room[room]
        taken = bucket[-k:]
        del bucket[-k:]
        if not bucket:
            self.rooms.pop(j)
        return room, taken


def pack(start: np.ndarray, length: np.ndarray, cont: np.ndarray,
         capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best-fit decreasing packing into rows of `capacity` tokens: each continuation piece opens
    its own row; then the documents, longest first, go into the open row with the least room that
    holds them, or new rows. Documents of one length move together, so the work grows with the
    distinct lengths and rooms, not the documents. Returns ((start, length) segments in row order,
    row_ptr (rows + 1), whether each row continues)."""
    row_of = np.empty(len(start), dtype=np.int64)
    pieces = np.flatnonzero(cont)
    row_of[pieces] = np.arange(len(pieces))
    open_rows = _Rooms()
    for room in np.unique(capacity - length[pieces]):
        open_rows.add(np.flatnonzero(capacity - length[pieces] == room).tolist(), int(room))
    n_rows = len(pieces)
    docs = np.flatnonzero(~cont)
    docs = docs[np.argsort(-length[docs], kind="stable")]
    bounds = np.flatnonzero(np.diff(length[docs])) + 1
    for group in np.split(docs, bounds) if len(docs) else []:
        n, done = int(length[group[0]]), 0
        while done < len(group):
            room, rows = open_rows.take(n, len(group) - done)
            if not rows:  # new rows, as many of these documents in each as fit
                per_row = capacity // n
                fresh = n_rows + np.arange(len(group) - done) // per_row
                row_of[group[done:]] = fresh
                counts = np.bincount(fresh - n_rows)
                for used in np.unique(counts):
                    open_rows.add((n_rows + np.flatnonzero(counts == used)).tolist(),
                                  capacity - int(used) * n)
                n_rows += len(counts)
                break
            row_of[group[done:done + len(rows)]] = rows
            done += len(rows)
            open_rows.add(rows, room - n)
    # Within a row: the continuation piece first, then documents in the order they were placed.
    placed = np.empty(len(start), dtype=np.int64)
    placed[pieces] = -1
    placed[docs] = np.arange(len(docs))
    order = np.lexsort((placed, row_of))
    row_ptr = np.searchsorted(row_of[order], np.arange(n_rows + 1))
    row_cont = np.arange(n_rows) < len(pieces)
    return np.stack([start[order], length[order]], axis=1), row_ptr, row_cont


def build_rows(windows: TokenWindows, align: str) -> StreamRows | DocRows:
    return DocRows(windows) if align == "doc" else StreamRows(windows)
