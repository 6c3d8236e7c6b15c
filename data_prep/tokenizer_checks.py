"""What a tokenizer must satisfy before it is used: checks on the figures a tokenizer file
declares (its ids), on its split pattern, and on a Hugging Face BPE's merges against tiktoken's
ranks, each refused in one line (DataError)."""

from __future__ import annotations

import os
import re

import tiktoken

from lmforge.data_prep.errors import DataError

# Text every split pattern is tried on when a tokenizer is built: one that matches the empty
# string, or backtracks without bound, makes tiktoken's Rust core panic on encoding, and a panic
# is no Python exception a caller can turn into one error line.
PROBE_TEXT = ("Hello, World! don't DON'T 12 3456789 x=1; a_b\n\t  \r\n é ü ß Ωμέγα 日本語 🎉 "
              "<|endoftext|> ." + "a" * 64 + " " * 64 + "1" * 64 + "\n" * 8 + ".,;!?" * 8)


def check_id_range(name: str, ids: set[int]) -> None:
    """The ids run from 0 to n_vocab - 1 with at most as many unused ids as used ones: n_vocab
    sizes the model's embedding and every per-id table, so one id of 2**32 in a 5 KB file
    would make them 16 GiB. (cl100k leaves 16 of 100,277 unused.)"""
    top = max(ids)
    if min(ids) < 0 or top + 1 > 2 * len(ids):
        raise DataError(f"tokenizer {name!r} gives ids up to {top:,} but has only {len(ids):,} "
                        "tokens: most of its vocabulary would be unused ids, sizing the model by "
                        "a figure the file does not hold; number its tokens from 0 without gaps")


def probe_pattern(enc: tiktoken.Encoding) -> None:
    """Encode PROBE_TEXT with stderr closed to the Rust panic's message; a panic is refused."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    failure = None
    try:
        os.dup2(null, 2)
        enc.encode_ordinary(PROBE_TEXT)
    except BaseException as e:  # pyo3's PanicException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        failure = e
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
    if failure is not None:
        first = (str(failure).splitlines() or [""])[0][:120]
        raise DataError(f"tokenizer {enc.name!r}: its split pattern fails on plain text "
                        f"({type(failure).__name__}: {first}); a pattern must never match the "
                        "empty string nor backtrack without bound: fix its pattern") from None


# One alternative of a split pattern that matches wherever its character class does, whatever
# comes next: an optional first element, the class repeated, optional trailing elements.
_ELEM = r"(?:\\p\{\w+\}|\\.|\[(?:\\.|[^\]\\])*\]|[^\\()\[|?*+{])"
_COVERING = re.compile(rf"(?:{_ELEM}\?\+?)?(?P<cls>{_ELEM})(?:\+\+?|\{{1,\d*\}}\+?)?(?:{_ELEM}\*\+?)*")
# Every character is whitespace, a letter, a number, or none of these.
_CLASSES = {r"\s", r"\p{L}", r"\p{N}", r"[^\s\p{L}\p{N}]"}


def _alternatives(pattern: str) -> list[str]:
    """The top-level alternatives of a regex (split on | outside groups and classes)."""
    out, depth, start, i, in_class = [], 0, 0, 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 1
        elif in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c in "()":
            depth += 1 if c == "(" else -1
        elif c == "|" and depth == 0:
            out.append(pattern[start:i])
            start = i + 1
        i += 1
    return out + [pattern[start:]]


def keep_gaps(pattern: str) -> str:
    """A `tokenizers` Split regex (behavior Isolated) as a tiktoken pattern. `tokenizers` keeps
    the text between two matches as a piece of its own; tiktoken drops it (`\\p{L}+|\\p{N}+` on
    "Hello, world" would lose ", "). A pattern with an alternative for every kind of character
    leaves no such text and is kept as it is (Llama 3's, Qwen's); any other matches that text
    too, as the run of characters up to where the pattern next matches."""
    covered = {m["cls"] for alt in _alternatives(pattern) if (m := _COVERING.fullmatch(alt))}
    if _CLASSES <= covered:
        return pattern
    return rf"(?:{pattern})|(?:(?!(?:{pattern}))[\s\S])+"


def _same_steps(token: bytes, merges: dict, ranks: dict) -> bool:
    """Whether `tokenizers` (the pair listed first in `merges`) and tiktoken (the pair whose
    bytes rank lowest) merge the same pair at every step of encoding `token`'s bytes, ending
    with `token`."""
    syms = [token[i:i + 1] for i in range(len(token))]
    while len(syms) > 1:
        h_best = k_best = None
        h_at = k_at = -1
        for i in range(len(syms) - 1):
            h, k = merges.get((syms[i], syms[i + 1])), ranks.get(syms[i] + syms[i + 1])
            if h is not None and (h_best is None or h < h_best):
                h_best, h_at = h, i
            if k is not None and (k_best is None or k < k_best):
                k_best, k_at = k, i
        if h_at != k_at or h_at < 0:
            return False
        syms[h_at:h_at + 2] = [syms[h_at] + syms[h_at + 1]]
    return True


def _merged(token: bytes, priority) -> list[bytes]:
    """`token`'s bytes merged by `priority(a, b)` (lowest first, None: never)."""
    syms = [token[i:i + 1] for i in range(len(token))]
    while len(syms) > 1:
        found = [(p, i) for i in range(len(syms) - 1) if (p := priority(syms[i], syms[i + 1])) is not None]
        if not found:
            break
        i = min(found)[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    return syms


def _check_order(order: dict[tuple[bytes, bytes], int], vocab: dict[bytes, int], name: str) -> None:
    """tiktoken ranks a pair by the id of the token it makes, `tokenizers` by its place in
    `merges`: the two orders must be one (ties: the same token made by another pair)."""
    last = None
    for (a, b), n in sorted(order.items(), key=lambda kv: kv[1]):
        if last is not None and vocab[a + b] < vocab[last[0] + last[1]]:
            raise DataError(f"{name}: merge {n} ({a!r} {b!r}) makes id {vocab[a + b]}, below id "
                            f"{vocab[last[0] + last[1]]} that the earlier merge ({last[0]!r} "
                            f"{last[1]!r}) makes: `tokenizers` merges by merge order, tiktoken by "
                            "id, so the two would merge in another order; lmforge refuses it")
        last = (a, b)


def bpe_ranks(vocab: dict[bytes, int], merges: list[tuple[bytes, bytes]], ignore_merges: bool,
              name: str) -> dict[bytes, int]:
    """tiktoken ranks (ids) that give `tokenizers`' ids for a BPE of `vocab` and `merges`.

    The merge orders must agree (_check_order). Then every token is encoded from its own bytes
    both ways: where they take the same steps it is settled. Otherwise, without ignore_merges,
    a token `tokenizers` never makes from its bytes (a merge appended that its parts never meet,
    a token no merge makes, one holding a byte without a token) is left out of the ranks, so
    tiktoken cannot make it either; any token still encoded otherwise is refused, named."""
    order: dict[tuple[bytes, bytes], int] = {}
    for n, (a, b) in enumerate(merges):
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise DataError(f"{name}: merge {n} ({a!r} {b!r}) joins or makes a token the "
                            "vocabulary lacks; the file is malformed: download it again")
        order[(a, b)] = n  # a pair listed twice counts by its last place, as in `tokenizers`
    _check_order(order, vocab, name)
    bytes_missing = {b for b in range(256) if bytes([b]) not in vocab}
    suspects = sorted((t for t in vocab if len(t) > 1 and not _same_steps(t, order, vocab)), key=vocab.get)
    dropped = set()
    for t in suspects:
        lacks = bytes_missing.intersection(t)
        if ignore_merges and lacks:
            raise DataError(f"{name}: token {t!r} holds byte {min(lacks):#04x}, which has no token "
                            "of its own, and ignore_merges gives it whole; lmforge refuses it")
        if not ignore_merges and (lacks or _merged(t, lambda a, b: order.get((a, b))) != [t]):
            dropped.add(t)
    ranks = {t: i for t, i in vocab.items() if t not in dropped}
    for t in (t for t in suspects if t not in dropped):
        theirs = _merged(t, lambda a, b: order.get((a, b)))
        ours = _merged(t, lambda a, b: ranks.get(a + b))
        if theirs != ours:
            raise DataError(f"{name}: token {t!r} (id {vocab[t]}) is made from its bytes as "
                            f"{theirs} by `tokenizers`' merges but as {ours} by tiktoken's ranks "
                            "(ids); the two would encode text otherwise, so lmforge refuses it")
    return ranks
