"""What a tokenizer must satisfy before it is used: checks on the figures a tokenizer file
declares (its ids), and on its split pattern, each refused in one line (DataError)."""

from __future__ import annotations

import os

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
