"""Command lines: `lmforge prepare ...` (`main`) and `lmforge inspect DIR` (`inspect_main`).
Both also run as `python -m data_prep [prepare|inspect] ...`."""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import fields
from pathlib import Path

from data_prep import shards as S
from data_prep.errors import DataError
from data_prep.prepare import PrepareConfig, merge, prepare
from data_prep.tokenizer import load_tokenizer_dir


def _doc(name: str) -> str:
    """The field docstring of PrepareConfig.NAME, so --help and the config say the same."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(PrepareConfig))
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and node.target.id == name and isinstance(nxt, ast.Expr):
            return nxt.value.value.replace("%", "%%")  # argparse formats help with %
    return ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmforge prepare",
        description="Tokenize a corpus into train/val shards + manifest.json "
                    "(see data_prep/shards.py for the format).")
    p.add_argument("--out", type=Path, help="output directory (required unless --verify)")
    p.add_argument("--verify", type=Path, metavar="DIR",
                   help="check every shard header and sha256 of a prepared DIR, then exit")
    p.add_argument("--merge", type=Path, nargs="+", metavar="DIR",
                   help="join the outputs of --part 1/N..N/N into --out")
    defaults = PrepareConfig(out=Path("."))
    for f in fields(PrepareConfig):
        if f.name in ("out", "progress"):
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=_doc(f.name))
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        shown = "" if default is None else f" (default: {default})"
        p.add_argument(flag, type=kind, default=default, help=_doc(f.name) + shown)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _run(args: argparse.Namespace) -> None:
    if args.verify:
        S.verify(args.verify)
        m = S.load_manifest(args.verify)
        print(f"ok: {len(m.shards)} shards, {m.num_tokens('train'):,} train + "
              f"{m.num_tokens('val'):,} val tokens verified in {args.verify}")
        return
    if args.out is None:
        raise DataError("--out DIR is required; e.g. lmforge prepare --out data/pystdlib")
    if args.merge:
        m = merge(args.merge, args.out)
    else:
        kwargs = {f.name: getattr(args, f.name) for f in fields(PrepareConfig)
                  if f.name not in ("out", "progress")}
        m = prepare(PrepareConfig(out=args.out, progress=not args.quiet, **kwargs))
    print(summary(m))


def main(argv: list[str] | None = None) -> int:
    """`lmforge prepare ...`; returns the exit code (2 on a DataError)."""
    args = build_parser().parse_args(argv)
    return _guard(_run, args)


def _guard(fn, *args) -> int:
    try:
        fn(*args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def summary(m: S.Manifest) -> str:
    tok = m.tokenizer
    lines = [f"dataset {m.data_dir}  (format v{m.version}, {m.dtype})",
             f"source    {m.source}",
             f"tokenizer {tok['name']} ({tok['kind']}), vocab {m.vocab_size:,}, eot {m.eot_id}, "
             f"sha256 {tok['sha256'][:12]}"]
    for sp, t in m.totals().items():
        lines.append(f"{sp:<9} {t['tokens']:>14,} tokens {t['documents']:>10,} docs "
                     f"{t['shards']:>4} shards")
    if m.stats.get("replaced_chars"):
        lines.append(f"note      {m.stats['replaced_chars']:,} invalid UTF-8 bytes were replaced by U+FFFD")
    return "\n".join(lines)


def inspect_main(argv: list[str] | None = None) -> int:
    """`lmforge inspect DIR [--tokens N] [--seed S]`: manifest summary + a decoded random span."""
    p = argparse.ArgumentParser(prog="lmforge inspect",
                                description="Summarise a prepared dataset and decode a sample.")
    p.add_argument("dir", type=Path)
    p.add_argument("--tokens", type=int, default=300, help="tokens to decode (default 300)")
    p.add_argument("--seed", type=int, default=None, help="pick the same place every time")
    p.add_argument("--split", default="train", choices=S.SPLITS)
    args = p.parse_args(argv)
    return _guard(_inspect, args)


def _inspect(args: argparse.Namespace) -> None:
    m = S.load_manifest(args.dir)
    print(summary(m))
    paths = m.shard_paths(args.split)
    if not paths:
        print(f"({args.split} split is empty)")
        return
    rng = random.Random(args.seed)
    path = rng.choice(paths)
    tokens = S.open_shard(path)
    start = rng.randrange(max(1, len(tokens) - args.tokens))
    enc = load_tokenizer_dir(m.data_dir / "tokenizer")
    span = [int(t) for t in tokens[start:start + args.tokens]]
    print(f"--- {path.name} tokens [{start}, {start + len(span)}) ---")
    print(enc.decode(span, errors="replace"))
