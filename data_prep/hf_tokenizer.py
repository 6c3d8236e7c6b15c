"""`--tokenizer hf:DIR`: a Hugging Face tokenizer.json of byte-level BPE (GPT-2, Llama 3, Qwen2/3,
SmolLM2) as tiktoken ranks + split pattern + special tokens, so that the shards hold the ids the
`tokenizers` library gives each document. What makes the two agree, each checked here:

- Ranks: a vocabulary token's bytes are its characters through GPT-2's bytes_to_unicode inverted,
  its rank is its id. tiktoken merges the adjacent pair whose joined bytes rank lowest,
  `tokenizers` the pair listed first in `merges`; data_prep/tokenizer_checks.py's bpe_ranks holds
  the two against each other. A single byte the vocabulary lacks is dropped (encoding.py).
- The split: ByteLevel's own regex (GPT-2's), the regex of a Split before a ByteLevel without
  one (Llama 3, Qwen), or Digits(individual_digits) before ByteLevel (SmolLM2), as one pattern;
  a Split regex that leaves text between its matches keeps that text as pieces of its own.
- A normaliser: none, or NFC (Qwen), applied by data_prep.encoding.Encoding.
- Special added tokens are never matched inside a document's text (as `tokenizers` with
  `encode_special_tokens = True`): a document cannot forge an end-of-text. Added tokens that are
  not special are found in text, as `tokenizers` finds them (encoding.py).
- EOS: tokenizer_config.json's eos_token, else config.json / generation_config.json's
  eos_token_id. BOS: the special token the post-processor puts before every text, if any.
Anything else, or a field of another type than the format's, is one DataError naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.safe_files import read_bytes, read_text
from lmforge.data_prep.tokenizer_checks import bpe_ranks, keep_gaps

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


def _typed(value, kind: type, where: str, path: Path):
    """`value` if it is a `kind` (a bool is no int), else DataError naming the field."""
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise DataError(f"{path}: {where} is {type(value).__name__} {str(value)[:40]!r}, not "
                    f"{kind.__name__}; the file is malformed: download it again")


def _loads(text: str, path: Path):
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: a file nested 100,000 deep
        raise DataError(f"cannot parse {path} ({str(e)[:80]}); download it again") from None


def _json(path: Path, what: str) -> dict:
    return _typed(_loads(read_text(path, MAX_JSON_BYTES, what=what), path), dict, "the file", path)


def _steps(obj, key: str, where: str, path: Path) -> list[dict]:
    """The steps of a (possibly Sequence) normalizer / pre-tokenizer / post-processor."""
    if obj is None:
        return []
    _typed(obj, dict, where, path)
    if obj.get("type") != "Sequence":
        return [obj]
    steps = _typed(obj.get(key), list, f"{where}.{key}", path)
    return [_typed(s, dict, f"{where}.{key}[{n}]", path) for n, s in enumerate(steps)]


def split_pattern(pre: dict | None, directory: Path) -> str:
    """The one regex doing what the pre-tokenizer does (ByteLevel must come last)."""
    path = directory / TOKENIZER_FILE
    steps = _steps(pre, "pretokenizers", "pre_tokenizer", path) or [{}]
    kinds = [s.get("type") for s in steps]
    last = steps[-1]
    if kinds[-1] != "ByteLevel" or last.get("add_prefix_space", False) is not False:
        raise _refuse(directory, f"pre-tokenizer {kinds} is not byte-level (add_prefix_space off)")
    regex = _typed(last.get("use_regex", True), bool, "pre_tokenizer's ByteLevel.use_regex", path)
    if kinds == ["ByteLevel"] and regex:
        return BYTE_LEVEL_PATTERN
    if kinds == ["Digits", "ByteLevel"] and regex and steps[0].get("individual_digits") is True:
        return DIGITS_BYTE_LEVEL_PATTERN
    split = steps[0] if kinds == ["Split", "ByteLevel"] and not regex else {}
    pattern = split.get("pattern")
    if split.get("behavior") == "Isolated" and split.get("invert") is False and isinstance(pattern, dict) \
            and "Regex" in pattern:
        return keep_gaps(_typed(pattern["Regex"], str, "pre_tokenizer's Split.pattern.Regex", path))
    raise _refuse(directory, f"pre-tokenizer {kinds} {split or ''} is not supported (a Split "
                             "regex is supported with behavior Isolated, invert false)")


def _normalizer(norm: dict | None, directory: Path) -> str | None:
    kinds = [s.get("type") for s in _steps(norm, "normalizers", "normalizer",
                                           directory / TOKENIZER_FILE)]
    if kinds in ([], ["NFC"]):
        return kinds[0] if kinds else None
    raise _refuse(directory, f"normalizer {kinds} is not supported (none or NFC)")


def _added(tok: dict, path: Path) -> tuple[dict[str, int], dict[str, list]]:
    """(every added token -> id, those matched in text -> [id, normalized])."""
    added, text = {}, {}
    for n, t in enumerate(_typed(tok.get("added_tokens") or [], list, "added_tokens", path)):
        where = f"added_tokens[{n}]"
        t = _typed(t, dict, where, path)
        content = _typed(t.get("content"), str, f"{where}.content", path)
        added[content] = _typed(t.get("id"), int, f"{where}.id", path)
        if content == "" or added[content] < 0:
            raise DataError(f"{path}: {where} is empty or has a negative id; download it again")
        if _typed(t.get("special", False), bool, f"{where}.special", path):
            continue
        flags = [k for k in ("lstrip", "rstrip", "single_word") if _typed(t.get(k, False), bool,
                                                                           f"{where}.{k}", path)]
        if flags:
            raise _refuse(path.parent, f"added token {content!r} is matched in text with "
                                       f"{'/'.join(flags)}, which lmforge does not reproduce")
        text[content] = [added[content], _typed(t.get("normalized", True), bool,
                                                f"{where}.normalized", path)]
    return added, text


def _vocab_bytes(model: dict, added: dict[str, int], directory: Path):
    """(vocabulary bytes -> id without the added tokens, merges as byte pairs)."""
    path = directory / TOKENIZER_FILE
    odd = {k: model.get(k) for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix")
           if model.get(k)} | ({"byte_fallback": True} if model.get("byte_fallback") else {})
    if model.get("type") != "BPE" or odd:
        raise _refuse(directory, f"model {model.get('type')} {odd or ''} is not byte-level BPE")
    vocab = _typed(model.get("vocab", {}), dict, "model.vocab", path)
    for t, i in vocab.items():
        _typed(i, int, f"model.vocab[{t!r}]", path)
    if "" in vocab:
        raise DataError(f"{path}: model.vocab holds an empty token; the file is malformed: "
                        "download it again")
    if clash := [t for t, i in added.items() if t in vocab and vocab[t] != i]:
        raise _refuse(directory, f"added token {clash[0]!r} has another id in the vocabulary")
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    try:
        ranks = {bytes(to_byte[c] for c in tok): i for tok, i in vocab.items() if tok not in added}
        merges = []
        for n, merge in enumerate(_typed(model.get("merges", []), list, "model.merges", path)):
            pair = merge.split(" ", 1) if isinstance(merge, str) else merge
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
                raise DataError(f"{path}: model.merges[{n}] is {str(merge)[:40]!r}, not two tokens; "
                                "the file is malformed: download it again")
            merges.append(tuple(bytes(to_byte[c] for c in p) for p in pair))
    except KeyError as e:
        raise _refuse(directory, f"vocabulary character {e} is not one of byte-level BPE's") from None
    return ranks, merges


def _bos(post: dict | None, directory: Path) -> str | None:
    """The special token the post-processor puts before every text (None: none)."""
    path = directory / TOKENIZER_FILE
    steps = _steps(post, "processors", "post_processor", path)
    template = [s for s in steps if s.get("type") != "ByteLevel"]
    if not template:
        return None
    single = template[0].get("single") if template[0].get("type") == "TemplateProcessing" else None
    items = [_typed(i, dict, "post_processor's single[]", path) for i in
             _typed(single, list, "post_processor's TemplateProcessing.single", path)] \
        if single is not None else []
    if len(template) == 1 and items and "Sequence" in items[-1]:
        if len(items) == 1:
            return None
        if len(items) == 2 and isinstance(items[0].get("SpecialToken"), dict):
            return _typed(items[0]["SpecialToken"].get("id"), str, "post_processor's SpecialToken.id", path)
    raise _refuse(directory, f"post-processor {[s.get('type') for s in steps]} {single or ''} adds "
                             "tokens other than one BOS before the text")


def _eos(directory: Path, added: dict[str, int]) -> str:
    cfg_path = directory / CONFIG_FILE
    cfg = _json(cfg_path, "tokenizer config") if cfg_path.is_file() else {}
    eos = cfg.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    for name in ("generation_config.json", "config.json"):
        if eos is None and (directory / name).is_file():
            ids = _json(directory / name, "model config").get("eos_token_id")
            first = ids[0] if isinstance(ids, list) and ids else ids
            eos = next((t for t, i in added.items() if i == first), None)
    if not isinstance(eos, str) or eos not in added:
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
    text_tokens: dict[str, list]
    files: dict[str, bytes] = field(default_factory=dict)  # kept for `lmforge export`


def read_hf_tokenizer(directory: Path) -> HFTokenizer:
    """The tiktoken form of DIR/tokenizer.json giving `tokenizers`' ids (DataError if none can)."""
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"{path} not found; give hf:DIR of a Hugging Face model directory holding "
                        "tokenizer.json (a tokenizer.model of SentencePiece is not supported)")
    text = read_text(path, MAX_JSON_BYTES, what="Hugging Face tokenizer")
    tok = _typed(_loads(text, path), dict, "the file", path)
    model = _typed(tok.get("model"), dict, "model", path)
    added, text_tokens = _added(tok, path)
    pattern = split_pattern(tok.get("pre_tokenizer"), directory)
    normalizer = _normalizer(tok.get("normalizer"), directory)
    vocab, merges = _vocab_bytes(model, added, directory)
    ignore = _typed(model.get("ignore_merges", False), bool, "model.ignore_merges", path)
    ranks = bpe_ranks(vocab, merges, ignore, str(path))
    spec = HFTokenizer(directory.resolve().name, pattern, ranks, added, _eos(directory, added),
                       _bos(tok.get("post_processor"), directory), normalizer, text_tokens,
                       {TOKENIZER_FILE: text.encode()})
    for name in SOURCE_FILES:
        if (directory / name).is_file():
            spec.files[name] = read_bytes(directory / name, MAX_JSON_BYTES, what="tokenizer file")
    return spec
