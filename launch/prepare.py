"""`lmforge prepare ...` and `lmforge inspect DIR`: the command lines of data_prep.

The prepare flags are PrepareConfig's fields (`--max-docs` for `max_docs`, help from the field's
metadata), parsed and type-checked by pipeline.typed_config like every other config; PrepareConfig
checks the ranges before anything is read or written.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.merge import merge
from lmforge.data_prep.prepare import DEFAULT_VAL_FRACTION, VAL_FLOOR_TOKENS, PrepareConfig, prepare
from lmforge.data_prep.shards import SPLITS, Manifest, load_manifest, open_shard, verify
from lmforge.data_prep.tokenizer import dataset_tokenizer, decode
from lmforge.launch.cli import ArgumentParser
from lmforge.pipeline.data.config import DataConfig
from lmforge.pipeline.typed_config import add_flags, from_flags, number

NOT_FLAGS = ("out", "progress")
ROWS_SEED = 1337  # train.seed's default (pipeline.config.TrainConfig; a test keeps them equal)  # --out is declared by hand (optional with --verify); --quiet


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="lmforge prepare",
        description="Tokenize a corpus into train/val shards + manifest.json "
                    "(see data_prep/shards.py for the format).")
    p.add_argument("--out", type=Path, help="output directory (required unless --verify)")
    p.add_argument("--verify", type=Path, metavar="DIR",
                   help="check every shard header and sha256 of a prepared DIR, then exit")
    p.add_argument("--merge", type=Path, nargs="+", metavar="DIR",
                   help="join the outputs of --part 1/N..N/N into --out")
    add_flags(p, PrepareConfig, skip=NOT_FLAGS)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    """`lmforge prepare ...`; a user mistake raises DataError/ConfigError (launch.cli: exit 2)."""
    args = build_parser().parse_args(argv)
    if args.verify:
        verify(args.verify)
        m = load_manifest(args.verify)
        print(f"ok: {len(m.shards)} shards, {m.num_tokens('train'):,} train + "
              f"{m.num_tokens('val'):,} val tokens verified in {args.verify}")
        return 0
    if args.out is None:
        raise DataError("--out DIR is required; e.g. lmforge prepare --out data/pystdlib")
    if args.merge:
        m = merge(args.merge, args.out)
    else:
        m = prepare(from_flags(PrepareConfig, args, out=args.out, progress=not args.quiet))
    print(summary(m))
    return 0


def summary(m: Manifest) -> str:
    tok = m.tokenizer
    lines = [f"dataset {m.data_dir}  (format v{m.version}, {m.dtype})",
             f"source    {m.source}",
             f"tokenizer {tok.get('name', '?')} ({tok.get('kind', '?')}), vocab {m.vocab_size:,}, "
             f"eot {m.eot_id}, sha256 {tok.get('sha256', '?')[:12]}"]
    for sp, t in m.totals().items():
        lines.append(f"{sp:<9} {t['tokens']:>14,} tokens {t['documents']:>10,} docs "
                     f"{t['shards']:>4} shards")
    lines += val_lines(m)
    if m.stats.get("replaced_chars"):
        lines.append(f"note      {m.stats['replaced_chars']:,} invalid UTF-8 bytes were replaced by U+FFFD")
    return "\n".join(lines)


def val_lines(m: Manifest) -> list[str]:
    """What the val split can evaluate, said where the default's floor raised it or where it
    holds fewer than VAL_FLOOR_TOKENS tokens (nothing for a split the user turned off)."""
    lines, n = [], m.num_tokens("val")
    if m.stats.get("val_floor"):
        lines.append(f"val floor the {DEFAULT_VAL_FRACTION:.0%} hash rule gave val fewer than "
                     f"{VAL_FLOOR_TOKENS:,} tokens or more than half the documents: val takes the "
                     f"documents with the smallest hashes up to {VAL_FLOOR_TOKENS:,} tokens, at "
                     "most half the documents (copies of one counted each)")
    if n < VAL_FLOOR_TOKENS and (m.stats.get("val_threshold") or m.stats.get("val_floor")):
        can = f"data.seq_len <= {n - 1:,} only" if n > 1 else "no data.seq_len"
        lines.append(f"note      val holds {n:,} tokens, fewer than {VAL_FLOOR_TOKENS:,} "
                     f"(2 x 1024 + 1): it can evaluate {can} (the gpt2_124m preset uses 1024); "
                     "prepare more text, or give a larger --val-fraction or --val-docs")
    return lines


def inspect_main(argv: list[str] | None = None) -> int:
    """`lmforge inspect DIR [--tokens N] [--seed S]`: manifest summary + a decoded random span;
    with --rows N: the first N rows of training step 1, as the trainer's loader gives them."""
    p = ArgumentParser(prog="lmforge inspect",
                       description="Summarise a prepared dataset and decode a sample, or show "
                                   "the rows the model trains on (--rows).")
    p.add_argument("dir", type=Path)
    p.add_argument("--tokens", type=number(int, 1), default=300,
                   help="tokens to decode (default 300)")
    p.add_argument("--seed", type=number(int, 0), default=None,
                   help="pick the same place every time; with --rows: train.seed (default "
                        f"{ROWS_SEED}, the trainer's)")
    p.add_argument("--split", default="train", choices=SPLITS)
    p.add_argument("--rows", type=number(int, 1), help="show the first N rows of step 1")
    p.add_argument("--seq-len", type=number(int, 1), default=DataConfig.seq_len,
                   help=f"with --rows: data.seq_len (default {DataConfig.seq_len})")
    p.add_argument("--align", choices=("doc", "stream"), default=DataConfig.align,
                   help=f"with --rows: data.align (default {DataConfig.align})")
    p.add_argument("--mix", default="", help="with --rows: data.mix, 'A:w,B:w' instead of DIR")
    p.add_argument("--json", action="store_true",
                   help='with --rows: print {"rows": [{"source", "ids", "continues"}, ...]}')
    args = p.parse_args(argv)
    if args.rows:
        return show_rows(args)
    m = load_manifest(args.dir)
    print(summary(m))
    paths = m.shard_paths(args.split)
    if not paths:
        print(f"({args.split} split is empty)")
        return 0
    rng = random.Random(args.seed)
    path = rng.choice(paths)
    tokens = open_shard(path)
    start = rng.randrange(max(1, len(tokens) - args.tokens))
    enc = dataset_tokenizer(m.data_dir)
    span = [int(t) for t in tokens[start:start + args.tokens]]
    print(f"--- {path.name} tokens [{start}, {start + len(span)}) ---")
    print(decode(enc, span))
    return 0


def show_rows(args: argparse.Namespace) -> int:
    """The first --rows rows of step 1: the trainer's loader on one process with a global batch
    of that many rows (the draws and each source's order do not depend on the batch size)."""
    # Here, not at the top: the trainer's modules import torch, which costs `lmforge prepare`
    # seconds of start-up (bench/prepare_bench.py's fixed cost) that it never needs.
    from lmforge.pipeline.data.config import validate_data
    from lmforge.pipeline.data.loader import TrainLoader
    from lmforge.pipeline.data.mixture import train_sources
    d = DataConfig(path="" if args.mix else str(args.dir), mix=args.mix, align=args.align,
                   seq_len=args.seq_len)
    validate_data(d, max_steps=1)
    sources, phases = train_sources(d, None)
    seed = ROWS_SEED if args.seed is None else args.seed
    step = TrainLoader(sources, args.rows, 1, 0, 1, seed, phases).next_step()
    rows = [{"source": name, "ids": w[:n].tolist(), "continues": bool(c)}
            for name, w, n, c in zip(step.sources, step.w, step.used, step.continues, strict=True)]
    if args.json:
        print(json.dumps({"rows": rows}))
        return 0
    enc = dataset_tokenizer(d.first_path)
    eot = load_manifest(d.first_path).eot_id
    for i, row in enumerate(rows):
        ids = row["ids"]
        # A row that opens with EOT starts a document; the loader knows a continuation only
        # where rows are cut at documents (align = doc), so any other row is mid-document.
        start = ("starts at a document start" if ids[:1] == [eot] else
                 "continues a document" if row["continues"] else "starts mid-document")
        print(f"--- row {i} from {row['source']}: {len(ids)} tokens, {start} ---")
        eots = [j for j, t in enumerate(ids) if t == eot]
        print(f"(document starts, EOT at positions: {' '.join(map(str, eots)) or 'none'})")
        # Decoded piece by piece between the EOT tokens themselves: a document's own text
        # "<|endoftext|>" (encoded as ordinary tokens) is not a boundary.
        cuts = [0, *eots, len(ids)]
        pieces = [ids[a + (a in eots):b] for a, b in itertools.pairwise(cuts)]
        print("\n<|doc|>".join(decode(enc, piece) for piece in pieces))
    return 0
