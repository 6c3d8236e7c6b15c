"""`--tokenizer hf:DIR`: a Hugging Face tokenizer.json of byte-level BPE (GPT-2, Llama 3, Qwen2/3,
SmolLM2) as tiktoken ranks + split pattern + special tokens, so that the shards hold the ids the
`tokenizers` library gives each document. What makes the two agree, each checked here:

- Ranks: a vocabulary token's bytes are its characters through GPT-2's bytes_to_unicode inverted,
  its rank is its id. tiktoken merges the adjacent pair whose joined bytes rank lowest,
  `tokenizers` the pair listed first in `merges`: the same choice when every merge makes a token
  ranked above its parts and no lower than the merge before it, and every token of more than one
  byte is some merge's result (so tiktoken cannot reach a token `tokenizers` never makes).
- The split: ByteLevel's own regex (GPT-2's), the regex of a Split before a ByteLevel without
  one (Llama 3, Qwen), or Digits(individual_digits) before ByteLevel (SmolLM2), as one pattern.
- A normaliser: none, or NFC (Qwen), applied by data_prep.tokenizer.Encoding.
- Added tokens are special tokens, never matched inside a document's text (as `tokenizers` with
  `encode_special_tokens = True`): a document cannot forge an end-of-text.
- EOS: tokenizer_config.json's eos_token, else config.json / generation_config.json's
  eos_token_id. BOS: the special token the post-processor puts before every text, if any.
Anything else is one DataError naming what is unsupported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.safe_files import read_bytes, read_text

TOKENIZER_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
MAX_JSON_BYTES = 1 << 28  # Qwen's tokenizer.json is ~11 MB, Llama 3's ~9 MB
# Kept byte for byte beside tokenizer.json, for `lmforge export` and `sample --chat`: the files
# that say how the source's tokens are used (config.json for its bos/eos/pad ids alone).
SOURCE_FILES = (CONFIG_FILE, "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                "generation_config.json", "config.json")

# tokenizers' ByteLevel regex (GPT-2's), as ByteLevel(use_regex=True) splits with it.
BYTE_LEVEL_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Digits(individual_digits=True), then that regex inside each piece between digits: a digit is a
# token of its own, and whitespace before a digit ends its piece (as at the end of the text).
DIGITS_BYTE_LEVEL_PATTERN = (r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+"""
                             r"""|\s+(?![^\s\p{N}])|\s+""")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _refuse(directory: Path, what: str) -> DataError:
    return DataError(f"{directory / TOKENIZER_FILE}: {what}; lmforge converts byte-level BPE "
                     "tokenizers exactly (GPT-2, Llama 3, Qwen2/3, SmolLM2 style) and no others")


def _json(path: Path, what: str):
    try:
        return json.loads(read_text(path, MAX_JSON_BYTES, what=what))
    except ValueError as e:
        raise DataError(f"cannot parse {path} ({e}); download it again") from None


def split_pattern(pre: dict | None, directory: Path) -> str:
    """The one regex doing what the pre-tokenizer does (ByteLevel must come last)."""
    steps = (pre or {}).get("pretokenizers", [pre]) if (pre or {}).get("type") == "Sequence" else [pre]
    kinds = [s.get("type") if isinstance(s, dict) else None for s in steps]
    last = steps[-1] if isinstance(steps[-1], dict) else {}
    if kinds[-1] != "ByteLevel" or last.get("add_prefix_space", False):
        raise _refuse(directory, f"pre-tokenizer {kinds} is not byte-level (add_prefix_space off)")
    regex = last.get("use_regex", True)
    if kinds == ["ByteLevel"] and regex:
        return BYTE_LEVEL_PATTERN
    if kinds == ["Digits", "ByteLevel"] and regex and steps[0].get("individual_digits"):
        return DIGITS_BYTE_LEVEL_PATTERN
    split = steps[0] if kinds == ["Split", "ByteLevel"] and not regex else {}
    if split.get("behavior") == "Isolated" and not split.get("invert") and "Regex" in split.get("pattern", {}):
        return split["pattern"]["Regex"]
    raise _refuse(directory, f"pre-tokenizer {kinds} is not supported")


def _normalizer(norm: dict | None, directory: Path) -> str | None:
    steps = norm.get("normalizers", []) if norm and norm.get("type") == "Sequence" else [norm] if norm else []
    kinds = [s.get("type") for s in steps]
    if kinds in ([], ["NFC"]):
        return kinds[0] if kinds else None
    raise _refuse(directory, f"normalizer {kinds} is not supported (none or NFC)")


def _ranks(model: dict, added: dict[str, int], directory: Path) -> dict[bytes, int]:
    """tiktoken's mergeable ranks from a BPE model's vocab, the merges checked to agree with them."""
    odd = {k: model.get(k) for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix")
           if model.get(k)} | ({"byte_fallback": True} if model.get("byte_fallback") else {})
    if model.get("type") != "BPE" or odd:
        raise _refuse(directory, f"model {model.get('type')} {odd or ''} is not byte-level BPE")
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    vocab = model.get("vocab", {})
    if clash := [t for t, i in added.items() if t in vocab and vocab[t] != i]:
        raise _refuse(directory, f"added token {clash[0]!r} has another id in the vocabulary")
    try:
        ranks = {bytes(to_byte[c] for c in tok): i for tok, i in vocab.items() if tok not in added}
    except KeyError as e:
        raise _refuse(directory, f"vocabulary character {e} is not one of byte-level BPE's") from None
    made, last = set(), -1
    for n, merge in enumerate(model.get("merges", [])):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        i, ia, ib = vocab.get(a + b), vocab.get(a), vocab.get(b)
        if i is None or ia is None or ib is None or not (max(ia, ib) < i and i >= last):
            raise _refuse(directory, f"merge {n} ({a!r} {b!r}) does not agree with the vocabulary's "
                                     "ids as ranks (tiktoken would merge in another order)")
        made.add(i)
        last = i
    if stray := [t for t, i in ranks.items() if len(t) > 1 and i not in made]:
        raise _refuse(directory, f"vocabulary token {stray[0]!r} is made by no merge")
    return ranks


def _bos(post: dict | None, directory: Path) -> str | None:
    """The special token the post-processor puts before every text (None: none)."""
    steps = post.get("processors", []) if post and post.get("type") == "Sequence" else [post] if post else []
    template = [s for s in steps if s.get("type") != "ByteLevel"]
    if not template:
        return None
    single = template[0].get("single", []) if template[0].get("type") == "TemplateProcessing" else None
    if len(template) == 1 and single and "Sequence" in single[-1]:
        if len(single) == 1:
            return None
        if len(single) == 2 and "SpecialToken" in single[0]:
            return single[0]["SpecialToken"]["id"]
    raise _refuse(directory, f"post-processor {[s.get('type') for s in steps]} {single or ''} adds "
                             "tokens other than one BOS before the text")


def _eos(directory: Path, added: dict[str, int]) -> str:
    cfg_path = directory / CONFIG_FILE
    eos = _json(cfg_path, "tokenizer config").get("eos_token") if cfg_path.is_file() else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    for name in ("generation_config.json", "config.json"):
        if eos is None and (directory / name).is_file():
            ids = _json(directory / name, "model config").get("eos_token_id")
            first = ids[0] if isinstance(ids, list) and ids else ids
            eos = next((t for t, i in added.items() if i == first), None)
    if eos not in added:
        raise DataError(f"{directory}: no end-of-text token found (tokenizer_config.json's "
                        "eos_token, or config.json's eos_token_id, naming an added token); "
                        "lmforge separates documents with it")
    return eos


@dataclass
class HFTokenizer:
    """What data_prep.tokenizer builds the Encoding of (make_encoding's arguments)."""

    name: str
    pattern: str
    ranks: dict[bytes, int]
    special: dict[str, int]
    eot: str
    bos: str | None
    normalizer: str | None
    files: dict[str, bytes] = field(default_factory=dict)  # kept for `lmforge export`


def read_hf_tokenizer(directory: Path) -> HFTokenizer:
    """The tiktoken form of DIR/tokenizer.json giving `tokenizers`' ids (DataError if none can)."""
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"{path} not found; give hf:DIR of a Hugging Face model directory holding "
                        "tokenizer.json (a tokenizer.model of SentencePiece is not supported)")
    text = read_text(path, MAX_JSON_BYTES, what="Hugging Face tokenizer")
    try:
        tok = json.loads(text)
    except ValueError as e:
        raise DataError(f"cannot parse {path} ({e}); download it again") from None
    if not isinstance(tok, dict) or not isinstance(tok.get("model"), dict):
        raise _refuse(directory, "no tokenizer model in it")
    added = {t["content"]: t["id"] for t in tok.get("added_tokens") or []}
    pattern = split_pattern(tok.get("pre_tokenizer"), directory)
    normalizer = _normalizer(tok.get("normalizer"), directory)
    spec = HFTokenizer(directory.resolve().name, pattern, _ranks(tok["model"], added, directory),
                       added, _eos(directory, added), _bos(tok.get("post_processor"), directory),
                       normalizer, {TOKENIZER_FILE: text.encode()})
    for name in SOURCE_FILES:
        if (directory / name).is_file():
            spec.files[name] = read_bytes(directory / name, MAX_JSON_BYTES, what="tokenizer file")
    return spec

