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

import hashlib
import heapq
import itertools
import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import tiktoken
from tqdm import tqdm

from data_prep import shards as S
from data_prep import tokenizer as T
from data_prep.errors import DataError
from data_prep.sources import Source

STATE_NAME = ".prepare_state.json"
TOKENIZER_DIR = "tokenizer"
BATCH_CHARS = 1 << 20  # characters per encode task: large enough to amortise thread hand-off
DEFAULT_VAL_FRACTION = 0.01


@dataclass
class PrepareConfig:
    out: Path
    source: str = "builtin:pystdlib"
    """builtin:pystdlib | hf:NAME[:CONFIG][@SPLIT] | a file, directory or glob (see sources.py)"""
    tokenizer: str = "gpt2"
    """tiktoken name, .tiktoken file, tokenizer directory, or bpe:N to train one of N ids"""
    shard_tokens: int = 100_000_000
    """a shard is closed at the first document end at or past this many tokens"""
    val_fraction: float | None = None
    """documents whose hash falls below this fraction go to val (default 0.01)"""
    val_docs: int | None = None
    """instead: the N documents with the smallest hashes go to val (one extra pass over input)"""
    text_field: str = "text"
    """the field/column holding the text in .jsonl/.json/.parquet/.arrow/hf: records"""
    lines: bool = False
    """.txt sources: one document per non-empty line instead of per file"""
    max_docs: int | None = None
    """use only the first N (non-empty) documents of the source"""
    part: str | None = None
    """I/N (1 <= I <= N): keep documents whose index % N == I-1; join parts with --merge"""
    dtype: str = "auto"
    """auto | uint16 | uint32"""
    bpe_sample_chars: int = 50_000_000
    """bpe:N trains on the first this-many characters of the (train) documents"""
    workers: int = 0
    """encoding threads; 0 = every core available to this process"""
    progress: bool = True

    # Fields that do not change the output bytes, so a resume may change them.
    RUNTIME = ("out", "workers", "progress")

    def identity(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.RUNTIME}

    def validate(self) -> None:
        if self.shard_tokens < 1:
            raise DataError(f"--shard-tokens {self.shard_tokens} must be >= 1")
        if self.val_docs is not None and self.val_fraction is not None:
            raise DataError("give either --val-docs or --val-fraction, not both")
        if self.val_fraction is not None and not 0 <= self.val_fraction < 1:
            raise DataError(f"--val-fraction {self.val_fraction} must be in [0, 1)")
        if self.val_docs is not None and self.val_docs < 0:
            raise DataError(f"--val-docs {self.val_docs} must be >= 0")
        if self.val_docs is not None and self.part:
            raise DataError("--val-docs needs the whole corpus; use --val-fraction with --part")
        if self.max_docs is not None and self.max_docs < 1:
            raise DataError(f"--max-docs {self.max_docs} must be >= 1")
        if self.dtype not in ("auto", "uint16", "uint32"):
            raise DataError(f"--dtype {self.dtype!r}: use auto, uint16 or uint32")
        self.part_slice()

    def part_slice(self) -> tuple[int, int]:
        """(I-1, N) from --part I/N, (0, 1) without it."""
        if not self.part:
            return 0, 1
        try:
            i, n = (int(x) for x in self.part.split("/"))
        except ValueError:
            i = n = 0
        if not 1 <= i <= n:
            raise DataError(f"--part {self.part!r}: write I/N with 1 <= I <= N, e.g. --part 2/4")
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


def val_threshold(cfg: PrepareConfig) -> int:
    """Documents with doc_key < threshold go to val."""
    if cfg.val_docs is None:
        return int((DEFAULT_VAL_FRACTION if cfg.val_fraction is None else cfg.val_fraction) * 2**64)
    if cfg.val_docs == 0:
        return 0
    keys = heapq.nsmallest(cfg.val_docs, map(doc_key, documents(cfg, _source(cfg))))
    return keys[-1] + 1  # exact duplicates of the last one go to val too: none leak into train


def _source(cfg: PrepareConfig) -> Source:
    return Source(cfg.source, text_field=cfg.text_field, lines=cfg.lines)


# ---------------------------------------------------------------------------------------------
# encoding


def encode_ordinary(enc: tiktoken.Encoding, text: str) -> np.ndarray:
    """tiktoken's encode_ordinary as a uint32 array, without building a Python list."""
    try:
        return enc.encode_to_numpy(text, disallowed_special=())
    except UnicodeEncodeError:  # lone surrogates: encode_ordinary has tiktoken's fallback
        return np.asarray(enc.encode_ordinary(text), dtype=np.uint32)


def encode_docs(enc: tiktoken.Encoding, eot: int, dtype: np.dtype,
                texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """[EOT, doc_1..., EOT, doc_2..., ...] and the length of each document's slice (EOT incl.)."""
    if not texts:
        return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int64)
    eot_arr = np.array([eot], dtype=np.uint32)
    parts = [a for t in texts for a in (eot_arr, encode_ordinary(enc, t))]
    lengths = np.array([len(p) + 1 for p in parts[1::2]], dtype=np.int64)
    return np.concatenate(parts).astype(dtype), lengths


class ShardWriter:
    """Appends documents of one split; writes a shard at the first document end at or past
    `shard_tokens` tokens (documents are never cut), and calls `on_shard(ShardInfo)`."""

    def __init__(self, out: Path, split: str, index: int, vocab_size: int, dtype: np.dtype,
                 shard_tokens: int, on_shard):
        self.out, self.split, self.index = out, split, index
        self.vocab_size, self.dtype, self.shard_tokens = vocab_size, dtype, shard_tokens
        self.on_shard = on_shard
        self.parts: list[np.ndarray] = []
        self.tokens = self.docs = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        ends = np.cumsum(lengths)
        while len(lengths):
            # first document whose end reaches the shard size, or all of them
            k = int(np.searchsorted(ends, self.shard_tokens - self.tokens)) + 1
            k = min(k, len(lengths))
            cut = int(ends[k - 1])
            self.parts.append(tokens[:cut])
            self.tokens += cut
            self.docs += k
            if self.tokens >= self.shard_tokens:
                self.flush()
            tokens, lengths, ends = tokens[cut:], lengths[k:], ends[k:] - cut

    def flush(self) -> None:
        if not self.docs:
            return
        name = S.shard_name(self.split, self.index)
        sha = S.write_shard(self.out / name, self.parts, self.vocab_size, self.dtype)
        self.on_shard(S.ShardInfo(name, self.split, self.tokens, self.docs, sha))
        self.parts, self.tokens, self.docs = [], 0, 0
        self.index += 1


# ---------------------------------------------------------------------------------------------
# the output directory: fresh, resumable, finished, or someone else's


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path} ({e}); delete {path.parent} and prepare again") from None


def _check_args(out: Path, recorded: dict, identity: dict) -> None:
    if recorded != identity:
        diff = [f"{k}: {recorded.get(k)!r} -> {identity.get(k)!r}"
                for k in sorted(set(recorded) | set(identity)) if recorded.get(k) != identity.get(k)]
        raise DataError(f"{out} holds a prepare run with other arguments ({'; '.join(diff)}); "
                        "use a new --out directory or delete it")


def resume_state(out: Path, identity: dict) -> tuple[bool, list[S.ShardInfo]]:
    """(finished?, finished shards to keep). DataError for a foreign directory or other args.
    Shards whose checksum fails are deleted with every later shard of their split."""
    if not out.exists() or not any(out.iterdir()):
        return False, []
    manifest, state = out / S.MANIFEST_NAME, out / STATE_NAME
    if manifest.is_file():
        m = S.load_manifest(out)
        _check_args(out, m.args, identity)
        for info in m.shards:  # cheap header check; --verify does the checksums
            S.check_shard(out / info.file, info, m.vocab_size, checksum=False)
        return True, m.shards
    if not state.is_file():
        raise DataError(f"output directory {out} is not empty and not an lmforge prepare output; "
                        "choose an empty or new --out directory")
    d = _read_json(state)
    _check_args(out, d.get("args"), identity)
    vocab = T.read_tokenizer_meta(out / TOKENIZER_DIR)["n_vocab"] if d["shards"] else 0
    keep, broken = [], set()
    for info in map(lambda s: S.ShardInfo(**s), d["shards"]):
        if info.split not in broken:
            try:
                S.check_shard(out / info.file, info, vocab)
                keep.append(info)
                continue
            except S.ShardError as e:
                print(f"resume: rebuilding from {info.file} ({e})", file=sys.stderr)
                broken.add(info.split)
        (out / info.file).unlink(missing_ok=True)
    return False, keep


def sort_shards(infos: list[S.ShardInfo]) -> list[S.ShardInfo]:
    """train shards then val shards, each in index order (not in order of completion)."""
    return sorted(infos, key=lambda s: (S.SPLITS.index(s.split), s.file))


def save_state(out: Path, identity: dict, done: list[S.ShardInfo]) -> None:
    text = json.dumps({"args": identity, "shards": [asdict(s) for s in sort_shards(done)]}, indent=1)
    S.atomic_write_bytes(out / STATE_NAME, [text.encode()])


# ---------------------------------------------------------------------------------------------
# tokenizer


def setup_tokenizer(cfg: PrepareConfig, out: Path, threshold: int) -> tuple[tiktoken.Encoding, str, str]:
    """(encoding, kind, name): OUT/tokenizer when resuming, else loaded or trained (bpe:N)."""
    tok_dir = out / TOKENIZER_DIR
    if (tok_dir / T.META_FILE).is_file():
        meta = T.read_tokenizer_meta(tok_dir)
        return T.load_tokenizer_dir(tok_dir), meta["kind"], meta["name"]
    spec = cfg.tokenizer
    if spec.startswith("bpe:"):
        try:
            n = int(spec[4:])
        except ValueError:
            raise DataError(f"bad tokenizer {spec!r}; write bpe:N, e.g. bpe:4096") from None
        return T.train_bpe(bpe_sample(cfg, threshold), n, f"bpe{n}"), "bpe", f"bpe{n}"
    enc = T.load_tokenizer(spec)
    return enc, "tiktoken" if spec in T.NAMED else "dir" if Path(spec).is_dir() else "file", enc.name


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


def prepare(cfg: PrepareConfig) -> S.Manifest:
    cfg.validate()
    out, identity = Path(cfg.out), cfg.identity()
    finished, done = resume_state(out, identity)
    if finished:
        print(f"{out} is already prepared with these arguments; nothing to do", file=sys.stderr)
        return S.load_manifest(out)
    if next(iter(documents(cfg, _source(cfg))), None) is None:  # before anything is written
        raise DataError(f"source {cfg.source!r} has no documents (empty files, or --text-field "
                        "empty everywhere); point --source at real text")
    threshold = val_threshold(cfg)
    enc, kind, name = setup_tokenizer(cfg, out, threshold)
    dtype = S.dtype_for_vocab(enc.n_vocab) if cfg.dtype == "auto" else np.dtype(cfg.dtype)
    if enc.n_vocab > np.iinfo(dtype).max + 1:
        raise DataError(f"vocabulary of {enc.n_vocab} tokens does not fit --dtype {cfg.dtype}; "
                        "use --dtype uint32 or auto")
    out.mkdir(parents=True, exist_ok=True)
    save_state(out, identity, done)  # first, so a crash from here on leaves a resumable dir
    tok_meta = T.save_tokenizer_dir(enc, out / TOKENIZER_DIR, kind, name)
    stats = run_pipeline(cfg, _source(cfg), enc, dtype, threshold, done,
                         on_shard=lambda: save_state(out, identity, done))
    m = S.Manifest(
        version=S.FORMAT_VERSION, vocab_size=enc.n_vocab, eot_id=T.eot_id(enc),
        tokenizer={k: tok_meta[k] for k in ("kind", "name", "vocab_size", "eot_id", "sha256",
                                            "pattern")} | {"spec": cfg.tokenizer},
        source=cfg.source, args=identity, stats=stats, dtype=dtype.name,
        shards=sort_shards(done), data_dir=out)
    if not m.num_tokens("train"):
        raise DataError("every document went to val; lower --val-fraction/--val-docs")
    m.save(out)
    return m


def run_pipeline(cfg: PrepareConfig, source: Source, enc: tiktoken.Encoding, dtype: np.dtype,
                 threshold: int, done: list[S.ShardInfo], on_shard) -> dict:
    """Encode the document sequence into shards, appending each new ShardInfo to `done`."""
    part, nparts = cfg.part_slice()
    skip = {sp: sum(s.documents for s in done if s.split == sp) for sp in S.SPLITS}
    next_index = {sp: sum(s.split == sp for s in done) for sp in S.SPLITS}

    def finished(info: S.ShardInfo) -> None:
        done.append(info)
        on_shard()

    writers = {sp: ShardWriter(Path(cfg.out), sp, next_index[sp], enc.n_vocab, dtype,
                               cfg.shard_tokens, finished) for sp in S.SPLITS}
    counts = {"documents": 0, "train_documents": 0, "val_documents": 0}
    workers = cfg.workers or len(os.sched_getaffinity(0))
    total = cfg.max_docs or source.total_docs
    bar = tqdm(total=total and -(-total // nparts), unit="doc", disable=not cfg.progress,
               mininterval=1.0, dynamic_ncols=True)
    tokens, t0 = 0, time.perf_counter()

    def batches() -> Iterator[tuple[int, dict[str, list[str]]]]:
        batch, size, n = {sp: [] for sp in S.SPLITS}, 0, 0
        for i, text in enumerate(documents(cfg, source)):
            if i % nparts != part:
                continue
            split = "val" if doc_key(text) < threshold else "train"
            counts["documents"] += 1
            counts[f"{split}_documents"] += 1
            n += 1
            if counts[f"{split}_documents"] <= skip[split]:
                continue  # already in a finished shard
            batch[split].append(text)
            size += len(text)
            if size >= BATCH_CHARS:
                yield n, batch
                batch, size, n = {sp: [] for sp in S.SPLITS}, 0, 0
        yield n, batch

    def consume(n: int, result: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        nonlocal tokens
        for sp, (toks, lengths) in result.items():
            writers[sp].add(toks, lengths)
            tokens += len(toks)
        bar.update(n)
        bar.set_postfix(tokens=f"{tokens:,}", tok_s=f"{tokens / (time.perf_counter() - t0):,.0f}",
                        refresh=False)

    eot = T.eot_id(enc)

    def encode(batch: dict[str, list[str]]):
        return {sp: encode_docs(enc, eot, dtype, texts) for sp, texts in batch.items()}

    with ThreadPoolExecutor(workers) as pool:
        pending: deque = deque()
        for n, batch in batches():
            pending.append((n, pool.submit(encode, batch)))
            if len(pending) >= 2 * workers:
                n0, fut = pending.popleft()
                consume(n0, fut.result())
        while pending:
            n0, fut = pending.popleft()
            consume(n0, fut.result())
    for w in writers.values():
        w.flush()
    bar.close()
    return counts | {"replaced_chars": source.replaced, "val_threshold": threshold}


# ---------------------------------------------------------------------------------------------
# --merge


def merge(dirs: list[Path], out: Path) -> S.Manifest:
    """Join the outputs of `--part 1/N ... N/N` (same other arguments) into `out`: shards
    renumbered part by part (hard links where possible), one manifest."""
    parts = [S.load_manifest(d) for d in dirs]
    base = {k: v for k, v in parts[0].args.items() if k != "part"}
    slices = []
    for m in parts:
        if {k: v for k, v in m.args.items() if k != "part"} != base or m.tokenizer != parts[0].tokenizer:
            raise DataError(f"{m.data_dir} was prepared with other arguments or tokenizer than "
                            f"{parts[0].data_dir}; merge only parts of one prepare run")
        slices.append(PrepareConfig(out=out, part=m.args.get("part")).part_slice())
    n = slices[0][1]
    if sorted(slices) != [(i, n) for i in range(n)]:
        have = ", ".join(str(m.args.get("part")) for m in parts)
        raise DataError(f"--merge needs each of parts 1/{n}..{n}/{n} exactly once, got {have}")
    identity = base | {"part": None, "merged_parts": n}
    finished, _ = resume_state(out, identity)
    if finished:
        return S.load_manifest(out)
    out.mkdir(parents=True, exist_ok=True)
    save_state(out, identity, [])
    shutil.copytree(parts[0].data_dir / TOKENIZER_DIR, out / TOKENIZER_DIR, dirs_exist_ok=True)
    ordered = [m for _, m in sorted(zip(slices, parts, strict=True), key=lambda x: x[0])]
    shard_list = []
    for sp in S.SPLITS:
        infos = [(m, s) for m in ordered for s in m.shards if s.split == sp]
        for i, (m, s) in enumerate(infos):
            name = S.shard_name(sp, i)
            _link_or_copy(m.data_dir / s.file, out / name)
            shard_list.append(S.ShardInfo(name, sp, s.tokens, s.documents, s.sha256))
    stats = {k: sum(m.stats.get(k, 0) for m in parts) for k in parts[0].stats if k != "val_threshold"}
    m0 = parts[0]
    merged = S.Manifest(version=S.FORMAT_VERSION, vocab_size=m0.vocab_size, eot_id=m0.eot_id,
                        tokenizer=m0.tokenizer, source=m0.source, args=identity,
                        stats=stats | {"val_threshold": m0.stats.get("val_threshold")},
                        dtype=m0.dtype, shards=shard_list, data_dir=out)
    merged.save(out)
    return merged


def _link_or_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # another filesystem
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
