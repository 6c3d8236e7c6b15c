"""The Encoding every tokenizer encodes through: tiktoken's, plus what a Hugging Face tokenizer
does around its BPE that tiktoken has no word for, each as the `tokenizers` library does it:

- A normaliser (Qwen's NFC), applied by `tokenizers`' own: Python's unicodedata is another Unicode
  version (51 combining marks order differently), so a text would split otherwise.
- Added tokens that are not special (Qwen's `<think>`, `<tool_call>`): found in the text,
  leftmost-longest, before anything else splits it; `normalized: false` ones in the raw text,
  `normalized: true` ones in each normalised piece. Special tokens are never found in text.
- Single bytes the vocabulary lacks (SmolLM2 has no token for 21): `tokenizers` splits the text
  first, then drops such a byte inside its piece, whose other bytes then merge as if it were not
  there (`"a(\\x04)b"` is `"a()b"`, but `"a\\x04b"` is not `"ab"`). tiktoken panics on one, so a
  text holding one is split here by the same pattern (the `regex` module, as tiktoken's own
  `_encode_only_native_bpe`) and each piece is BPE-encoded without the missing bytes.
A tokenizer with none of these encodes through tiktoken alone.
"""

from __future__ import annotations

import re

import numpy as np
import regex
import tiktoken

from lmforge.data_prep.errors import DataError

EOT = "<|endoftext|>"


def nfc_normalizer():
    """`tokenizers`' NFC as a str -> str function, or DataError where it is not installed."""
    try:
        from tokenizers.normalizers import NFC
    except ImportError:
        raise DataError("this tokenizer normalises text to NFC, which lmforge applies exactly "
                        "through the `tokenizers` package (Python's own Unicode tables differ): "
                        "pip install tokenizers") from None
    return NFC().normalize_str


def _replaced(text: str) -> str:
    """`text` with lone surrogates (no UTF-8 has them) as U+FFFD, as tiktoken's encode_ordinary
    replaces them."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _finder(tokens: list[str]) -> re.Pattern | None:
    """A pattern finding `tokens` leftmost-longest (the longest first among equal starts)."""
    if not tokens:
        return None
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")")


def _split_on(finder: re.Pattern | None, text: str) -> list[str]:
    """`text` cut around the tokens `finder` finds: text, token, text, ... (odd items are tokens)."""
    return [text] if finder is None else finder.split(text)


class Encoding(tiktoken.Encoding):
    """tiktoken's Encoding, plus what opens every document in the shards (the end-of-text token,
    then the tokenizer's own BOS where it adds one, as Llama 3's does) and what the module
    docstring lists. `text_tokens`: added tokens found in text, content -> [id, normalized]."""

    def __init__(self, name: str, pat_str: str, mergeable_ranks: dict[bytes, int],
                 special_tokens: dict[str, int], eot: str = EOT, bos: str | None = None,
                 normalizer: str | None = None, text_tokens: dict[str, list] | None = None):
        super().__init__(name=name, pat_str=pat_str, mergeable_ranks=mergeable_ranks,
                         special_tokens=special_tokens)
        self.eot_name, self.bos_name, self.normalizer = eot, bos, normalizer
        self.text_tokens = dict(text_tokens or {})
        self.hf_files: dict[str, bytes] = {}  # hf:DIR's tokenizer files, saved under HF_FILES
        self._normal = nfc_normalizer() if normalizer == "NFC" else None
        self._raw = _finder([t for t, (_, normed) in self.text_tokens.items() if not normed])
        self._normed = _finder([t for t, (_, normed) in self.text_tokens.items() if normed])
        self._missing = bytes(b for b in range(256) if bytes([b]) not in mergeable_ranks)
        self._splitter = regex.compile(pat_str) if self._missing else None
        self._plain = not (self._normal or self.text_tokens or self._missing)

    def __getstate__(self) -> dict:  # tiktoken's pickles only its own four fields
        return {"name": self.name, "pat_str": self._pat_str, "mergeable_ranks": self._mergeable_ranks,
                "special_tokens": self._special_tokens, "eot": self.eot_name, "bos": self.bos_name,
                "normalizer": self.normalizer, "text_tokens": self.text_tokens}

    def encode_ordinary(self, text: str) -> list[int]:
        return super().encode_ordinary(text) if self._plain else self._exact(text)

    def encode_to_numpy(self, text: str, **kwargs) -> np.ndarray:
        if self._plain:
            return super().encode_to_numpy(text, **kwargs)
        return np.asarray(self._exact(text), dtype=np.uint32)

    def _exact(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, raw in enumerate(_split_on(self._raw, text)):
            if i % 2:
                ids.append(self.text_tokens[raw][0])
                continue
            # ASCII text is its own NFC (no ASCII character decomposes or composes)
            normal = raw if self._normal is None or raw.isascii() else self._nfc(raw)
            for j, part in enumerate(_split_on(self._normed, normal)):
                ids += [self.text_tokens[part][0]] if j % 2 else self._bpe(part)
        return ids

    def _nfc(self, text: str) -> str:
        try:
            return self._normal(text)
        except UnicodeEncodeError:  # lone surrogates, which `tokenizers` cannot take
            return self._normal(_replaced(text))

    def _bpe(self, text: str) -> list[int]:
        if not text:
            return []
        try:
            data = text.encode()
        except UnicodeEncodeError:
            text = _replaced(text)
            data = text.encode()
        if not self._missing or len(data.translate(None, self._missing)) == len(data):
            return super().encode_ordinary(text)
        ids: list[int] = []
        for piece in self._splitter.finditer(text):
            kept = piece.group().encode().translate(None, self._missing)
            if kept:
                ids += self._core_bpe.encode_single_piece(kept)
        return ids
