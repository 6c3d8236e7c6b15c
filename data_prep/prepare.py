"""`lmforge prepare`: documents -> tiktoken tokens -> train/val shards + manifest.json.

The pipeline, in one process:
  Source (main thread, streaming) -> split by document hash -> batches of ~1M characters ->
  a thread pool encodes them (tiktoken releases the GIL, so `workers` threads use `workers`
  cores) -> results consumed in submission order -> one ShardWriter per split.
Output bytes depend only on the document sequence, never on `workers` or timing. At most
2*workers batches are in flight and a shard's tokens are the only other buffer, so peak memory is
bounded by --shard-tokens, not by the corpus size.

Resume: OUT/.prepare_state.json (written before anything else, updated after each finished
shard) records the arguments and the finished shards. A re-run with the same arguments checks
those shards' checksums, re-reads the input, skips (without encoding) the documents they already
hold -- counted per split, so shard boundaries come out the same -- and continues. manifest.json is
written last; its presence makes a re-run a no-op.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import heapq
import itertools
import math
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import tiktoken
from tqdm import tqdm

from lmforge.data_prep.errors import DataError, is_disk_full
from lmforge.data_prep.outdir import TOKENIZER_DIR, Ledger, ShardWriter, resume_state, sort_shards
from lmforge.data_prep.safe_files import check_writable
from lmforge.data_prep.shards import (
    FORMAT_VERSION,
    SPLITS,
    Manifest,
    dtype_for_vocab,
    load_manifest,
)
from lmforge.data_prep.sources import Source
from lmforge.data_prep.tokenizer import (
    HF_PREFIX,
    META_FILE,
    NAMED,
    bpe_size,
    doc_start,
    eot_id,
    load_tokenizer,
    load_tokenizer_dir,
    read_tokenizer_meta,
    save_tokenizer_dir,
    train_bpe,
)

BATCH_CHARS = 1 << 20  # characters per encode task: large enough to amortise thread hand-off
DEFAULT_VAL_FRACTION = 0.01
MAX_WORKERS = 1024  # 2*workers batches are in flight: more threads than cores only costs memory
MAX_SHARD_TOKENS = 1 << 36  # a shard is buffered in memory before it is written
# The default split's floor, in val tokens (EOT included): two eval windows at the gpt2_124m
# preset's data.seq_len 1024 and one at llama_350m's 2048, so a small corpus prepared with the
# defaults can be evaluated by every preset (tests/test_val_floor.py holds it to configs/).
VAL_FLOOR_TOKENS = 2 * 1024 + 1


@dataclass
class PrepareConfig:
    out: Path
    source: str = field(default="builtin:pystdlib", metadata={"help":
        "builtin:pystdlib | hf:NAME[:CONFIG][@SPLIT] | a file, directory or glob (see sources.py)"})
    tokenizer: str = field(default="gpt2", metadata={"help":
        "tiktoken name, .tiktoken file, tokenizer directory, or bpe:N to train one of N ids"})
    shard_tokens: int = field(default=100_000_000, metadata={"help":
        "a shard is closed at the first document end at or past this many tokens"})
    val_fraction: float | None = field(default=None, metadata={"help":
        f"documents whose hash falls below this fraction go to val (default {DEFAULT_VAL_FRACTION}, "
        f"and then at least {VAL_FLOOR_TOKENS} tokens if the corpus has them, from the smallest "
        "hashes, at most half the documents)"})
    val_docs: int | None = field(default=None, metadata={"help":
        "instead: the N documents with the smallest hashes go to val (one extra pass over input)"})
    text_field: str = field(default="text", metadata={"help":
        "the field/column holding the text in .jsonl/.json/.parquet/.arrow/hf: records"})
    lines: bool = field(default=False, metadata={"help":
        ".txt sources: one document per non-empty line instead of per file"})
    max_docs: int | None = field(default=None, metadata={"help":
        "use only the first N (non-empty) documents of the source"})
    part: str | None = field(default=None, metadata={"help":
        "I/N (1 <= I <= N): keep documents whose index % N == I-1; join parts with --merge"})
    dtype: str = field(default="auto", metadata={"help": "auto | uint16 | uint32"})
    bpe_sample_chars: int = field(default=50_000_000, metadata={"help":
        "bpe:N trains on the first this-many characters of the (train) documents"})
    workers: int = field(default=0, metadata={"help":
        "encoding threads; 0 = every core available to this process"})
    progress: bool = True
    # Help text lives in each field's metadata (launch.prepare makes the flags from it): a field
    # docstring is invisible at run time.

    # Fields that do not change the output bytes, so a resume may change them.
    RUNTIME = ("out", "workers", "progress")

    def identity(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.RUNTIME}

    def validate(self) -> None:
        """Every range and combination, before anything is read or written."""
        for name in ("source", "tokenizer", "text_field"):
            if not getattr(self, name).strip():  # Path("") is the working directory
                raise DataError(f"--{name.replace('_', '-')} is empty; give a value (see "
                                "lmforge prepare --help)")
        _need(1 <= self.shard_tokens <= MAX_SHARD_TOKENS, "shard_tokens", self.shard_tokens,
              f"in [1, {MAX_SHARD_TOKENS}]")
        if self.val_docs is not None and self.val_fraction is not None:
            raise DataError("give either --val-docs or --val-fraction, not both")
        if self.val_fraction is not None:
            _need(0 <= self.val_fraction < 1, "val_fraction", self.val_fraction, "in [0, 1)")
        if self.val_docs is not None:
            _need(self.val_docs >= 0, "val_docs", self.val_docs, ">= 0")
            if self.part:
                raise DataError("--val-docs needs the whole corpus; use --val-fraction with --part")
        if self.max_docs is not None:  # islice's limit
            _need(1 <= self.max_docs <= sys.maxsize, "max_docs", self.max_docs,
                  f"in [1, {sys.maxsize}]")
        if self.dtype not in ("auto", "uint16", "uint32"):
            raise DataError(f"--dtype {self.dtype!r}: use auto, uint16 or uint32")
        _need(self.bpe_sample_chars >= 1, "bpe_sample_chars", self.bpe_sample_chars, ">= 1")
        _need(0 <= self.workers <= MAX_WORKERS, "workers", self.workers,
              f"in [0, {MAX_WORKERS}]; 0 = every core")
        bpe_size(self.tokenizer)
        part_slice(self.part)


def _need(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise DataError(f"--{name.replace('_', '-')} {value} must be {expected}")


def part_slice(part: str | None) -> tuple[int, int]:
    """(I-1, N) from --part I/N, (0, 1) without it."""
    if not part:
        return 0, 1
    try:
        i, n = (int(x) for x in part.split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise DataError(f"--part {part!r}: write I/N with 1 <= I <= N, e.g. --part 2/4")
    return i - 1, n


# ---------------------------------------------------------------------------------------------
# documents and the train/val split


def documents(cfg: PrepareConfig, source: Source) -> Iterator[str]:
    """The document sequence every decision is made on: non-empty documents of the source, the
    first --max-docs of them. (--part is applied after, so parts partition this sequence.)"""
    docs = (t for t in source if t)
    return itertools.islice(docs, cfg.max_docs) if cfg.max_docs else docs


def doc_key(text: str) -> int:
    """A 64-bit hash of a document: its train/val assignment, independent of position."""
    data = text.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def split_threshold(cfg: PrepareConfig) -> int:
    """Documents with doc_key < threshold go to val, by --val-fraction or --val-docs alone."""
    if cfg.val_docs is None:
        return int((DEFAULT_VAL_FRACTION if cfg.val_fraction is None else cfg.val_fraction) * 2**64)
    if cfg.val_docs == 0:
        return 0
    keys = heapq.nsmallest(cfg.val_docs, map(doc_key, documents(cfg, _source(cfg))))
    return keys[-1] + 1  # exact duplicates of the last one go to val too: none leak into train


def val_threshold(cfg: PrepareConfig, enc: tiktoken.Encoding, base: int) -> int:
    """The split's threshold: `base` as given, or -- neither --val-fraction nor --val-docs given --
    raised to the floor. The whole input is read (not the --part slice): every part splits alike."""
    if cfg.val_docs is not None or cfg.val_fraction is not None:
        return base
    return floor_threshold(documents(cfg, _source(cfg)), enc, base)


def floor_threshold(docs: Iterable[str], enc: tiktoken.Encoding, base: int,
                    floor: int = VAL_FLOOR_TOKENS) -> int:
    """`base`, or -- when the documents under it hold fewer than `floor` tokens -- the threshold
    that also takes the documents with the next smallest keys until val holds `floor` tokens. At
    most half the documents go to val, copies counted one by one (copies share a key, so they
    all go to one side): where even `base` sends more, val takes fewer, down to none."""
    below = held = n = 0  # tokens under `base`; tokens in `groups`; documents read
    # The fewest smallest keys holding `floor` tokens: key -> [copies, tokens each], and a heap
    # of their -keys (the largest on top, dropped while the rest still hold `floor`).
    groups: dict[int, list[int]] = {}
    heap: list[int] = []
    for text in docs:
        n += 1
        key = doc_key(text)
        if key >= base and held >= floor and key > -heap[0]:
            continue  # neither val by the hash rule nor among the smallest keys: not encoded
        group = groups.get(key)
        tokens = group[1] if group else len(encode_ordinary(enc, text)) + len(doc_start(enc))
        if key < base:
            below += tokens
            if below >= floor:  # the usual case past a few hundred thousand tokens of input
                return base
        if group:
            group[0] += 1
        else:
            groups[key] = [1, tokens]
            heapq.heappush(heap, -key)
        held += tokens
        while held - math.prod(groups[-heap[0]]) >= floor:
            held -= math.prod(groups.pop(-heapq.heappop(heap)))
    cut = taken = 0  # the largest threshold that sends at most half the documents to val
    for key in sorted(groups):
        taken += groups[key][0]
        if taken > n // 2:
            break
        cut = key + 1
    over = sum(c for k, (c, _) in groups.items() if k < base) > n // 2  # groups under base stay
    return cut if over else max(base, cut)


def _source(cfg: PrepareConfig) -> Source:
    return Source(cfg.source, text_field=cfg.text_field, lines=cfg.lines, exclude=Path(cfg.out))


# ---------------------------------------------------------------------------------------------
# encoding


def encode_ordinary(enc: tiktoken.Encoding, text: str) -> np.ndarray:
    """tiktoken's encode_ordinary as a uint32 array, without building a Python list."""
    try:
        return enc.encode_to_numpy(text, disallowed_special=())
    except UnicodeEncodeError:  # lone surrogates: encode_ordinary has tiktoken's fallback
        return np.asarray(enc.encode_ordinary(text), dtype=np.uint32)


def encode_docs(enc: tiktoken.Encoding, start: list[int], dtype: np.dtype,
                texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """[EOT, doc_1..., EOT, doc_2..., ...] and the length of each document's slice (EOT incl.);
    `start` is EOT, or EOT and the BOS of a tokenizer that adds one (tokenizer.doc_start)."""
    if not texts:
        return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int64)
    start_arr = np.array(start, dtype=np.uint32)
    parts = [a for t in texts for a in (start_arr, encode_ordinary(enc, t))]
    lengths = np.array([len(p) + len(start) for p in parts[1::2]], dtype=np.int64)
    return np.concatenate(parts).astype(dtype), lengths


def encode_batch(enc: tiktoken.Encoding, start: list[int], dtype: np.dtype,
                 batch: Batch) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`encode_docs` of each split of a batch (one thread-pool task)."""
    return {sp: encode_docs(enc, start, dtype, texts) for sp, texts in batch.texts.items()}


# ---------------------------------------------------------------------------------------------
# tokenizer


def setup_tokenizer(cfg: PrepareConfig, out: Path, threshold: int) -> tuple[tiktoken.Encoding, str, str]:
    """(encoding, kind, name): OUT/tokenizer when resuming, else loaded or trained (bpe:N)."""
    tok_dir = out / TOKENIZER_DIR
    if (tok_dir / META_FILE).is_file():
        meta = read_tokenizer_meta(tok_dir)
        return load_tokenizer_dir(tok_dir), meta["kind"], meta["name"]
    n = bpe_size(cfg.tokenizer)
    if n is not None:
        enc = train_bpe(bpe_sample(cfg, threshold), n)
        if enc.n_vocab < n:  # rustbpe stops when no pair of tokens occurs twice
            print(f"note: {cfg.tokenizer} trained {enc.n_vocab:,} ids, not {n:,}: its sample "
                  f"({cfg.bpe_sample_chars:,} characters at most) has no more pairs to merge; "
                  "more text gives more ids", file=sys.stderr)
        return enc, "bpe", enc.name
    spec = cfg.tokenizer
    enc = load_tokenizer(spec)
    kind = "tiktoken" if spec in NAMED else "hf" if spec.startswith(HF_PREFIX) else \
        "dir" if Path(spec).is_dir() else "file"
    return enc, kind, enc.name


def bpe_sample(cfg: PrepareConfig, threshold: int) -> Iterator[str]:
    """The first bpe_sample_chars characters of train documents of the whole input (not the
    part slice, so every --part trains the same vocabulary)."""
    budget = cfg.bpe_sample_chars
    for text in documents(cfg, _source(cfg)):
        if budget <= 0:
            return
        if doc_key(text) >= threshold:
            yield text[:budget]
            budget -= len(text)


# ---------------------------------------------------------------------------------------------
# the run


def prepare(cfg: PrepareConfig) -> Manifest:
    cfg.validate()
    out, identity = Path(cfg.out), cfg.identity()
    source_files = _source(cfg).fingerprint()
    finished, done = resume_state(out, identity, source_files)
    if finished:
        print(f"{out} is already prepared with these arguments; nothing to do", file=sys.stderr)
        return load_manifest(out)
    check_writable(out, what="--out")  # before the source is read or a tokenizer trained
    if next(iter(documents(cfg, _source(cfg))), None) is None:  # before anything is written
        raise DataError(f"source {cfg.source!r} has no documents (empty files, or --text-field "
                        "empty everywhere); point --source at real text")
    base = split_threshold(cfg)
    # bpe:N trains on the train documents of `base`: the floor needs token counts, so it comes
    # after, and a document it moves to val may have been in the tokenizer's sample.
    enc, kind, name = setup_tokenizer(cfg, out, base)
    threshold = val_threshold(cfg, enc, base)
    dtype = dtype_for_vocab(enc.n_vocab) if cfg.dtype == "auto" else np.dtype(cfg.dtype)
    if enc.n_vocab > np.iinfo(dtype).max + 1:
        raise DataError(f"vocabulary of {enc.n_vocab} tokens does not fit --dtype {cfg.dtype}; "
                        "use --dtype uint32 or auto")
    ledger = Ledger(out, identity, done, source_files)
    with write_errors(out, ledger.done):
        out.mkdir(parents=True, exist_ok=True)
        ledger.save()  # first, so a crash from here on leaves a resumable dir
        tok_meta = save_tokenizer_dir(enc, out / TOKENIZER_DIR, kind, name)
        stats = run_pipeline(cfg, _source(cfg), enc, dtype, threshold, ledger)
    stats["val_floor"] = VAL_FLOOR_TOKENS if threshold != base else None  # the summary says it
    m = Manifest(
        version=FORMAT_VERSION, vocab_size=enc.n_vocab, eot_id=eot_id(enc),
        tokenizer={k: tok_meta[k] for k in ("kind", "name", "vocab_size", "eot_id", "bos_id",
                                            "sha256", "pattern")} | {"spec": cfg.tokenizer},
        source=cfg.source, args=identity, stats=stats, dtype=dtype.name,
        shards=sort_shards(ledger.done), data_dir=out)
    if not m.num_tokens("train"):
        raise DataError("every document went to val; lower --val-fraction/--val-docs")
    with write_errors(out, ledger.done):
        m.save(out)
    return m


@contextlib.contextmanager
def write_errors(out: Path, done: list) -> Iterator[None]:
    """A write into OUT that fails is one line; the `done` shards stay, for a resume."""
    try:
        yield
    except OSError as e:
        if is_disk_full(e):
            raise DataError(f"no space left on device writing {out} (free "
                            f"{shutil.disk_usage(out).free / 2**20:,.1f} MB, {len(done)} "
                            "shards finished and kept); free space, then run the same command: "
                            "it resumes after them") from None
        raise DataError(f"cannot write {e.filename or out} ({e.strerror}); {len(done)} "
                        "shards finished and kept: make it writable, then run the same command "
                        "to resume") from None


@dataclass
class Batch:
    """New documents of each split, ~BATCH_CHARS characters in all, and how many documents of
    this part (new or already in a finished shard) were read to fill it."""

    texts: dict[str, list[str]] = field(default_factory=lambda: {sp: [] for sp in SPLITS})
    read: int = 0
    chars: int = 0


def batches(docs: Iterable[str], threshold: int, skip: dict[str, int],
            counts: dict[str, int]) -> Iterator[Batch]:
    """`docs` routed to their split, the first `skip[split]` of each split dropped (they are in
    finished shards), cut into batches; `counts` tallies every document read, per split."""
    batch = Batch()
    for text in docs:
        split = "val" if doc_key(text) < threshold else "train"
        counts["documents"] += 1
        counts[f"{split}_documents"] += 1
        batch.read += 1
        if counts[f"{split}_documents"] > skip[split]:
            batch.texts[split].append(text)
            batch.chars += len(text)
        if batch.chars >= BATCH_CHARS:
            yield batch
            batch = Batch()
    yield batch


def in_order(pool: Executor, fn: Callable, items: Iterable, depth: int) -> Iterator[tuple]:
    """(item, fn(item)) in the order of `items`, with up to `depth` calls running in `pool`."""
    pending: deque = deque()
    for item in items:
        pending.append((item, pool.submit(fn, item)))
        if len(pending) >= depth:
            item0, fut = pending.popleft()
            yield item0, fut.result()
    while pending:
        item0, fut = pending.popleft()
        yield item0, fut.result()


def run_pipeline(cfg: PrepareConfig, source: Source, enc: tiktoken.Encoding, dtype: np.dtype,
                 threshold: int, ledger: Ledger) -> dict:
    """Encode this part's documents into shards, recording each finished one in `ledger`;
    returns the document counts for the manifest's stats."""
    part, nparts = part_slice(cfg.part)
    docs = itertools.islice(documents(cfg, source), part, None, nparts)
    writers = {sp: ShardWriter(sp, ledger, enc.n_vocab, dtype, cfg.shard_tokens) for sp in SPLITS}
    counts = {"documents": 0, "train_documents": 0, "val_documents": 0}
    todo = batches(docs, threshold, {sp: ledger.count(sp)[1] for sp in SPLITS}, counts)
    encode = functools.partial(encode_batch, enc, doc_start(enc), dtype)
    workers = cfg.workers or len(os.sched_getaffinity(0))
    bar = ProgressBar(cfg, source, nparts)
    with ThreadPoolExecutor(workers) as pool:
        for batch, encoded in in_order(pool, encode, todo, 2 * workers):
            for sp, (tokens, lengths) in encoded.items():
                writers[sp].add(tokens, lengths)
            bar.update(batch.read, sum(len(tokens) for tokens, _ in encoded.values()))
    for w in writers.values():
        w.flush()
    bar.close()
    return counts | {"replaced_chars": source.replaced, "val_threshold": threshold,
                     "source_files": ledger.source_files}


class ProgressBar:
    """Documents of this part read, and tokens/s since the start (tqdm, off with --quiet)."""

    def __init__(self, cfg: PrepareConfig, source: Source, nparts: int):
        total = cfg.max_docs or source.total_docs
        self.bar = tqdm(total=total and -(-total // nparts), unit="doc", disable=not cfg.progress,
                        mininterval=1.0, dynamic_ncols=True)
        self.tokens, self.t0 = 0, time.perf_counter()

    def update(self, docs: int, tokens: int) -> None:
        self.bar.update(docs)
        self.tokens += tokens
        tok_s = self.tokens / (time.perf_counter() - self.t0)
        self.bar.set_postfix(tokens=f"{self.tokens:,}", tok_s=f"{tok_s:,.0f}", refresh=False)

    def close(self) -> None:
        self.bar.close()
