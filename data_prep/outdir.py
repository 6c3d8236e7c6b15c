"""The output directory of `lmforge prepare`: its shards as they are written, and its resume state.

`ShardWriter` cuts a split's documents into shards (and their document indexes) and records each
finished one in the `Ledger`, OUT/.prepare_state.json, so that a killed prepare resumes after its
last finished shard; `resume_state` reads a directory back: fresh, resumable, finished, or someone
else's.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.safe_files import read_text
from lmforge.data_prep.shards import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    SPLITS,
    ShardError,
    ShardInfo,
    atomic_write_bytes,
    check_dir_path,
    check_shard,
    load_manifest,
    shard_infos_from_json,
    shard_name,
    write_doc_index,
    write_shard,
)
from lmforge.data_prep.tokenizer import read_tokenizer_meta

STATE_NAME = ".prepare_state.json"
TOKENIZER_DIR = "tokenizer"


class ShardWriter:
    """Appends documents of one split; writes a shard at the first document end at or past
    `shard_tokens` tokens (documents are never cut) and records it in the ledger at once, so a
    kill right after loses no finished shard. Numbering continues after the ledger's shards."""

    def __init__(self, split: str, ledger: Ledger, vocab_size: int, dtype: np.dtype,
                 shard_tokens: int):
        self.split, self.ledger, self.index = split, ledger, ledger.count(split)[0]
        self.vocab_size, self.dtype, self.shard_tokens = vocab_size, dtype, shard_tokens
        self.parts: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []  # of the buffered documents: the document index
        self.tokens = self.docs = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        ends = np.cumsum(lengths)
        while len(lengths):
            # first document whose end reaches the shard size, or all of them
            k = int(np.searchsorted(ends, self.shard_tokens - self.tokens)) + 1
            k = min(k, len(lengths))
            cut = int(ends[k - 1])
            self.parts.append(tokens[:cut])
            self.lengths.append(lengths[:k])
            self.tokens += cut
            self.docs += k
            if self.tokens >= self.shard_tokens:
                self.flush()
            tokens, lengths, ends = tokens[cut:], lengths[k:], ends[k:] - cut

    def flush(self) -> None:
        """Write what is buffered as a shard (nothing when empty)."""
        if not self.docs:
            return
        name = shard_name(self.split, self.index)
        sha = write_shard(self.ledger.out / name, self.parts, self.vocab_size, self.dtype)
        lengths = np.concatenate(self.lengths)
        index_sha = write_doc_index(self.ledger.out / name, np.cumsum(lengths) - lengths,
                                    self.tokens)
        self.ledger.record(ShardInfo(name, self.split, self.tokens, self.docs, sha, index_sha))
        self.parts, self.lengths, self.tokens, self.docs = [], [], 0, 0
        self.index += 1


# ---------------------------------------------------------------------------------------------
# the output directory: fresh, resumable, finished, or someone else's


def _read_state(path: Path) -> dict:
    """A prepare's resume state, its shapes checked (shard names confined to the directory)."""
    fix = f"delete {path.parent} and prepare again"
    try:
        d = json.loads(read_text(path, MAX_MANIFEST_BYTES, what="prepare's resume state"))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path} ({e}); {fix}") from None
    if not isinstance(d, dict) or not isinstance(d.get("args"), dict):
        raise DataError(f"{path} is not a prepare's resume state; {fix}")
    d["shards"] = shard_infos_from_json(d.get("shards"), path, fix)
    return d


def _check_args(out: Path, recorded: dict, identity: dict) -> None:
    if recorded != identity:
        diff = [f"{k}: {recorded.get(k)!r} -> {identity.get(k)!r}"
                for k in sorted(set(recorded) | set(identity)) if recorded.get(k) != identity.get(k)]
        raise DataError(f"{out} holds a prepare run with other arguments ({'; '.join(diff)}); "
                        "use a new --out directory or delete it")


def resume_state(out: Path, identity: dict,
                 source_files: str | None = None) -> tuple[bool, list[ShardInfo]]:
    """(finished?, finished shards to keep). DataError for a foreign directory, other args, or
    (resuming) source files changed since (`source_files`: Source.fingerprint, None = unknown).
    Shards whose checksum fails are deleted with every later shard of their split."""
    check_dir_path(out, "--out")
    if not out.exists() or not any(out.iterdir()):
        return False, []
    manifest, state = out / MANIFEST_NAME, out / STATE_NAME
    if os.path.lexists(manifest):  # a link or special file there is refused by the reader
        m = load_manifest(out)
        _check_args(out, m.args, identity)
        for info in m.shards:  # cheap header check; --verify does the checksums
            check_shard(out / info.file, info, m.vocab_size, False, m.dtype)
        if None not in (source_files, m.stats.get("source_files")) and \
                m.stats["source_files"] != source_files:
            print(f"note: the files of --source changed since {out} was prepared; its shards hold "
                  "the old text (delete it, or use a new --out, to prepare the new)", file=sys.stderr)
        return True, m.shards
    if not os.path.lexists(state):
        raise DataError(f"output directory {out} is not empty and not an lmforge prepare output; "
                        "choose an empty or new --out directory")
    d = _read_state(state)
    _check_args(out, d["args"], identity)
    if None not in (source_files, d.get("source_files")) and d["source_files"] != source_files:
        raise DataError(f"the files of --source changed (names, sizes or times) since the prepare "
                        f"into {out} stopped, so its finished shards hold other text; restore the "
                        "files, or delete it (or use a new --out) to prepare afresh")
    vocab = read_tokenizer_meta(out / TOKENIZER_DIR)["n_vocab"] if d["shards"] else 0
    keep, broken = [], set()
    for info in d["shards"]:
        if info.split not in broken:
            try:
                check_shard(out / info.file, info, vocab)
                keep.append(info)
                continue
            except ShardError as e:
                print(f"resume: rebuilding from {info.file} ({e})", file=sys.stderr)
                broken.add(info.split)
        (out / info.file).unlink(missing_ok=True)
    return False, keep


def sort_shards(infos: list[ShardInfo]) -> list[ShardInfo]:
    """train shards then val shards, each in index order (not in order of completion)."""
    return sorted(infos, key=lambda s: (SPLITS.index(s.split), s.file))


def save_state(out: Path, identity: dict, done: list[ShardInfo],
               source_files: str | None = None) -> None:
    text = json.dumps({"args": identity, "source_files": source_files,
                       "shards": [asdict(s) for s in sort_shards(done)]}, indent=1)
    atomic_write_bytes(out / STATE_NAME, [text.encode()])


class Ledger:
    """The finished shards of this output directory, saved to STATE_NAME each time one is added:
    what a resume keeps (and the fingerprint of the files they were read from)."""

    def __init__(self, out: Path, identity: dict, done: list[ShardInfo], source_files: str | None):
        self.out, self.identity, self.done = out, identity, list(done)
        self.source_files = source_files

    def record(self, info: ShardInfo) -> None:
        self.done.append(info)
        self.save()

    def save(self) -> None:
        save_state(self.out, self.identity, self.done, self.source_files)

    def count(self, split: str) -> tuple[int, int]:
        """(shards, documents) of `split` already finished."""
        infos = [s for s in self.done if s.split == split]
        return len(infos), sum(s.documents for s in infos)
