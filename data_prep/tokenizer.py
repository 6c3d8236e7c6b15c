"""Tokenizers: everything encodes through tiktoken.

Specs accepted by `load_tokenizer`:
- a tiktoken name: `gpt2`, `r50k_base`, `cl100k_base`, `o200k_base` (tiktoken downloads/caches);
- a path to a `.tiktoken` file (mergeable ranks, tiktoken's base64 format). The split pattern and
  special tokens are inferred for the known OpenAI vocabulary sizes; otherwise the GPT-4
  (cl100k) pattern with `<|endoftext|>` = len(ranks). A sidecar `FILE.tiktoken.json` with any of
  `name`, `pattern`, `special_tokens` overrides the inference;
- a tokenizer directory written by `save_tokenizer_dir` (what prepare leaves in OUT/tokenizer/);
- `hf:DIR`, a Hugging Face byte-level BPE tokenizer.json converted exactly (data_prep/hf_tokenizer.py).
`bpe:N` (train a vocabulary of N ids on the corpus) is handled by `train_bpe`, called by prepare.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import tiktoken

from lmforge.data_prep.encoding import EOT, Encoding
from lmforge.data_prep.errors import DataError
from lmforge.data_prep.hf_tokenizer import read_hf_tokenizer
from lmforge.data_prep.safe_files import (
    atomic_write_bytes,
    check_dir,
    check_tree,
    file_sha256,
    read_bytes,
    user_path,
)
from lmforge.data_prep.shards import load_manifest
from lmforge.data_prep.tokenizer_checks import check_id_range, probe_pattern

NAMED = ("gpt2", "r50k_base", "cl100k_base", "o200k_base")
HF_PREFIX = "hf:"
VOCAB_FILE = "vocab.tiktoken"
META_FILE = "tokenizer.json"
MAX_VOCAB_BYTES = 1 << 28  # o200k's file is 3.6 MB; 2**24 ids of ~16 bytes a line fit
MAX_META_BYTES = 16 << 20  # tokenizer.json and a .tiktoken sidecar: a pattern, special tokens
REPLACEMENT = "\ufffd".encode()  # the text of an id that has no bytes (a gap between ranks)
HF_FILES = "hf"  # a Hugging Face tokenizer's own files, kept for `lmforge export`

# Split patterns of tiktoken_ext.openai_public, copied because the module only exposes them
# inside functions that download the vocabulary.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
CL100K_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Number of mergeable ranks -> (name, pattern, special tokens) of the OpenAI vocabularies.
KNOWN_VOCABS: dict[int, tuple[str, str, dict[str, int]]] = {
    50256: ("gpt2", GPT2_PATTERN, {EOT: 50256}),
    100256: ("cl100k_base", CL100K_PATTERN, {
        EOT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
        "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}),
    199998: ("o200k_base", O200K_PATTERN, {EOT: 199999, "<|endofprompt|>": 200018}),
}


def load_tokenizer(spec: str) -> Encoding:
    """An Encoding from a name, a `.tiktoken` path, a tokenizer directory or `hf:DIR`."""
    if spec.startswith(HF_PREFIX):
        hf = read_hf_tokenizer(Path(spec.removeprefix(HF_PREFIX)))
        enc = make_encoding(hf.name, hf.pattern, check_ranks(hf.ranks, Path(spec), True), hf.special,
                            hf.eot, hf.bos, hf.normalizer, hf.text_tokens)
        enc.hf_files = hf.files
        return enc
    path = user_path(spec)
    if path.is_dir():
        return load_tokenizer_dir(path)
    if os.path.lexists(path):  # a link or special file is refused by the reader, by its kind
        return _from_tiktoken_file(path)
    if spec in NAMED:
        try:
            e = tiktoken.get_encoding(spec)
            return Encoding(e.name, e._pat_str, e._mergeable_ranks, e._special_tokens)
        except Exception as e:  # tiktoken raises assorted network errors when offline
            raise DataError(f"cannot load tiktoken encoding {spec!r} ({type(e).__name__}); "
                            "give a path to its .tiktoken file instead (no network here?)") from None
    if spec.startswith("bpe:"):
        raise DataError(f"tokenizer {spec!r} is trained by `lmforge prepare`; pass the prepared "
                        "OUT/tokenizer directory to reuse it")
    raise DataError(f"unknown tokenizer {spec!r}; use one of {', '.join(NAMED)}, a .tiktoken "
                    "file, a tokenizer directory, hf:DIR (a Hugging Face model directory), or bpe:N")


def _parse_ranks(data: bytes, path: Path, byte_gaps: bool = False) -> dict[bytes, int]:
    """tiktoken's "base64 rank" lines, parsed from bytes already read (and, for a tokenizer
    directory, already hashed). Never through `load_tiktoken_bpe`: it caches files by the sha1 of
    their path string in a shared temp folder, so another vocabulary prepared at the same
    relative path would be decoded in place of the one just verified."""
    ranks = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise DataError(f"{path} is not a .tiktoken vocabulary (line {n}: {e}); give a "
                            "tiktoken base64-ranks file") from None
    return check_ranks(ranks, path, byte_gaps)


def check_ranks(ranks: dict[bytes, int], path: Path, byte_gaps: bool = False) -> dict[bytes, int]:
    """`ranks`, refused unless every text can be encoded with them. `byte_gaps`: a single byte
    without a token is dropped from its piece, as `tokenizers` does (a Hugging Face tokenizer's
    vocabulary, data_prep/encoding.py); elsewhere it is refused."""
    if not ranks:
        raise DataError(f"{path} holds no tokens; give a non-empty .tiktoken file")
    # Checked here because tiktoken's Rust core panics (an exception `except Exception` misses)
    # on a rank given twice, and on encoding a byte that has no token of its own.
    if len(set(ranks.values())) != len(ranks):
        raise DataError(f"{path} gives two tokens the same rank; give each token its own rank")
    if (missing := [b for b in range(256) if bytes([b]) not in ranks]) and not byte_gaps:
        raise DataError(f"{path} lacks {len(missing)} of the 256 single-byte tokens (byte "
                        f"{missing[0]:#04x} first), so some text cannot be encoded; a byte-level "
                        "BPE vocabulary has all of them")
    return ranks


def next_id(ranks: dict[bytes, int]) -> int:
    """The first id after every rank: `<|endoftext|>`'s when nothing says otherwise (len(ranks)
    would collide with a rank where the ranks leave a gap)."""
    return max(ranks.values()) + 1


def _read_bytes(path: Path, max_bytes: int = MAX_VOCAB_BYTES) -> bytes:
    """A tokenizer file, opened by the rule of data_prep/safe_files.py (a regular file, not
    through a link, bounded)."""
    try:
        return read_bytes(path, max_bytes, what="tokenizer file")
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror}); check the path") from None


def _read_json(path: Path, fix: str):
    try:
        return json.loads(_read_bytes(path, MAX_META_BYTES))
    except ValueError as e:
        raise DataError(f"cannot parse {path} ({e}); {fix}") from None


def _from_tiktoken_file(path: Path) -> tiktoken.Encoding:
    ranks = _parse_ranks(_read_bytes(path), path)
    name, pattern, special = KNOWN_VOCABS.get(
        len(ranks), (path.stem, CL100K_PATTERN, {EOT: next_id(ranks)}))
    sidecar = path.with_name(path.name + ".json")
    if os.path.lexists(sidecar):
        over = _read_json(sidecar, "fix or delete it")
        if not isinstance(over, dict):
            raise DataError(f"{sidecar} is not a JSON object; write {{\"name\": ..., "
                            "\"pattern\": ..., \"special_tokens\": {...}} or delete it")
        name = over.get("name", name)
        pattern = over.get("pattern", pattern)
        special = over.get("special_tokens", special)
    return make_encoding(name, pattern, ranks, special)


def make_encoding(name: str, pattern: str, ranks: dict[bytes, int], special: dict[str, int],
              eot: str = EOT, bos: str | None = None, normalizer: str | None = None,
              text_tokens: dict[str, list] | None = None) -> Encoding:
    if not isinstance(special, dict) or eot not in special or (bos is not None and bos not in special):
        raise DataError(f"tokenizer {name!r} has no {eot} special token; add it to the "
                        "special_tokens of its sidecar/tokenizer.json")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in special.values()):
        raise DataError(f"tokenizer {name!r}: its special token ids are not all integers >= 0; "
                        "fix the special_tokens of its sidecar/tokenizer.json")
    if normalizer not in (None, "NFC"):
        raise DataError(f"tokenizer {name!r}: normalizer {normalizer!r} is not supported (NFC is)")
    ids = set(ranks.values())
    if clash := sorted(str(t) for t, i in special.items() if i in ids):
        raise DataError(f"tokenizer {name!r}: special token {clash[0]} has the id of a "
                        "mergeable token; give special tokens ids past the ranks")
    check_id_range(name, ids | set(special.values()))
    text_tokens = text_tokens or {}
    if not isinstance(text_tokens, dict) or not all(
            isinstance(v, list) and len(v) == 2 and isinstance(v[1], bool) and special.get(t) == v[0]
            for t, v in text_tokens.items()):
        raise DataError(f"tokenizer {name!r}: its text tokens are not among its special tokens "
                        "with the same ids; re-run `lmforge prepare`")
    try:
        enc = Encoding(name, pattern, ranks, special, eot, bos, normalizer, text_tokens)
    except DataError:
        raise
    except Exception as e:  # tiktoken's Rust core raises on bad patterns or clashing ids
        raise DataError(f"tokenizer {name!r} is inconsistent ({e}); check its pattern and "
                        "special token ids") from None
    probe_pattern(enc)
    return enc


def fits_model(meta: dict, model_vocab: int) -> bool:
    """Whether a tokenizer (its tokenizer.json or manifest record) is a model's: the same number of
    ids, or for a Hugging Face tokenizer no more (Qwen pads its table past its tokenizer's ids)."""
    n_vocab = meta.get("n_vocab", meta.get("vocab_size"))
    return n_vocab == model_vocab or (meta.get("kind") == "hf" and n_vocab < model_vocab)


def eot_id(enc: tiktoken.Encoding) -> int:
    """The id of the end-of-text token (`<|endoftext|>`, or a Hugging Face tokenizer's EOS),
    the token that separates documents."""
    name = getattr(enc, "eot_name", EOT)  # a plain tiktoken Encoding: `<|endoftext|>`
    try:
        return enc._special_tokens[name]  # tiktoken's only accessor, `eot_token`, is the same
    except KeyError:
        raise DataError(f"tokenizer {enc.name!r} has no {name} token; use one that does") from None


def bos_id(enc: tiktoken.Encoding) -> int | None:
    """The id of the BOS the tokenizer puts before every text (Llama 3's), None without one."""
    name = getattr(enc, "bos_name", None)
    return None if name is None else enc._special_tokens[name]


def doc_start(enc: tiktoken.Encoding) -> list[int]:
    """The ids before every document in the shards: end-of-text, then the BOS if any."""
    return [eot_id(enc)] + ([] if bos_id(enc) is None else [bos_id(enc)])


def encode_prompt(enc: tiktoken.Encoding, text: str) -> list[int]:
    """`text` as the beginning of a document: every document in the shards starts with
    `doc_start`, so a prompt does too (what the trainer's samples and `lmforge sample` feed)."""
    try:
        return [*doc_start(enc), *enc.encode_ordinary(text)]
    except BaseException as e:  # a panic tokenizer_checks' probe did not provoke
        if isinstance(e, (Exception, KeyboardInterrupt, SystemExit)):
            raise
        raise DataError(f"tokenizer {enc.name!r} failed on this prompt ({e}); its split pattern "
                        "is broken: use another tokenizer") from None


def token_bytes(enc: tiktoken.Encoding, token: int) -> bytes:
    """The bytes of one id; U+FFFD for an id no token has (cl100k leaves gaps below its special
    tokens). The model has a row for every id below n_vocab, so a sampler may draw one: it is
    shown as unreadable text, as bytes that are not UTF-8 are, rather than hidden by a sampler
    that would have to know the tokenizer."""
    try:
        return enc.decode_single_token_bytes(token)
    except KeyError:
        return REPLACEMENT


def decode(enc: tiktoken.Encoding, ids: list[int]) -> str:
    """The text of `ids`, invalid UTF-8 and ids without bytes as U+FFFD (see token_bytes)."""
    return b"".join(token_bytes(enc, t) for t in ids).decode("utf-8", errors="replace")


def mergeable_ranks(enc: tiktoken.Encoding) -> dict[bytes, int]:
    """The byte-level ranks of `enc` (every id that is not a special token and not a gap), read
    from the Encoding's own table: never by looping over n_vocab."""
    return dict(enc._mergeable_ranks)


def token_byte_lengths(enc: tiktoken.Encoding) -> np.ndarray:
    """int32[n_vocab]: UTF-8 bytes of each token, 0 for special tokens and unused ids.
    Bits-per-byte = sum(loss) / ln 2 / sum(lengths[targets])."""
    out = np.zeros(enc.n_vocab, dtype=np.int32)
    for token, i in mergeable_ranks(enc).items():
        out[i] = len(token)
    for text, (i, _) in getattr(enc, "text_tokens", {}).items():  # found in text: its bytes
        out[i] = len(text.encode())
    return out


def _vocab_bytes(enc: tiktoken.Encoding) -> bytes:
    """vocab.tiktoken's bytes: one "base64 rank" a line, by rank (tiktoken's own
    dump_tiktoken_bpe needs blobfile)."""
    ranks = sorted(mergeable_ranks(enc).items(), key=lambda kv: kv[1])
    return b"".join(f"{base64.b64encode(tok).decode()} {rank}\n".encode() for tok, rank in ranks)


def identity(enc: tiktoken.Encoding) -> dict:
    """What makes two tokenizers one: the same ids for every text, and the same ids around it."""
    return {"sha256": hashlib.sha256(_vocab_bytes(enc)).hexdigest(), "pattern": enc._pat_str,
            "special_tokens": dict(enc._special_tokens), "eot_id": eot_id(enc), "bos_id": bos_id(enc),
            "normalizer": getattr(enc, "normalizer", None),
            "text_tokens": getattr(enc, "text_tokens", {})}


def save_tokenizer_dir(enc: tiktoken.Encoding, directory: Path | str, kind: str,
                       name: str) -> dict:
    """Write DIR/vocab.tiktoken and DIR/tokenizer.json; returns the tokenizer.json dict.
    `kind` says where it came from: "tiktoken" (a name), "file" (a .tiktoken path), "bpe" or
    "hf" (a Hugging Face tokenizer.json)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    check_dir(directory, what="tokenizer directory")  # a link to one elsewhere is not written
    atomic_write_bytes(directory / VOCAB_FILE, [_vocab_bytes(enc)])
    meta = {"name": name, "kind": kind, **identity(enc), "n_vocab": enc.n_vocab,
            "vocab_size": enc.n_vocab, "sha256": file_sha256(directory / VOCAB_FILE)}
    atomic_write_bytes(directory / META_FILE, [(json.dumps(meta, indent=2) + "\n").encode()])
    for file, data in getattr(enc, "hf_files", {}).items():
        (directory / HF_FILES).mkdir(exist_ok=True)
        atomic_write_bytes(directory / HF_FILES / file, [data])
    return meta


def hf_pattern(pattern: str) -> str:
    """tiktoken's split pattern in the dialect of the `tokenizers` regex engine (Oniguruma).

    tiktoken's `\\p{N}{1,3}+` is possessive; Oniguruma reads `{1,3}+` as "one or more runs of
    1-3 digits", which splits 4+ digit numbers differently. Dropping the `+` changes nothing
    there: the quantifier ends its alternative, so there is nothing to backtrack into."""
    return re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", pattern)


def check_tokenizer_is(tokenizer_dir: Path | str, hf_dir: Path | str) -> None:
    """DataError unless a dataset's tokenizer (OUT/tokenizer) is the one in the Hugging Face
    directory `hf_dir` (its tokenizer.json; none there: nothing to hold it against). `init_from
    DIR` trains DIR's weights, which read each id as DIR's tokenizer means it: a dataset of
    another tokenizer with as many ids would train them on text they do not mean."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "tokenizer.json").is_file():
        return
    # Patterns compared in the `tokenizers` dialect: an export writes ours in it, splitting alike.
    ours, theirs = (json.loads(json.dumps(t | {"pattern": hf_pattern(t.get("pattern", ""))}))
                    for t in (read_tokenizer_meta(tokenizer_dir),
                              identity(load_tokenizer(f"{HF_PREFIX}{hf_dir}"))))
    if diff := [k for k, v in theirs.items() if ours.get(k, {} if k == "text_tokens" else None) != v]:
        raise DataError(f"{Path(tokenizer_dir).parent} was prepared with another tokenizer than "
                        f"{hf_dir}'s ({', '.join(diff)} differ), so its ids mean other text to "
                        f"that model; prepare the data with --tokenizer hf:{hf_dir}")


def read_tokenizer_meta(directory: Path | str) -> dict:
    """tokenizer.json of a tokenizer directory, with vocab.tiktoken's sha256 checked."""
    return _read_verified(Path(directory))[0]


def _read_verified(directory: Path) -> tuple[dict, bytes]:
    """(tokenizer.json, the vocabulary's bytes): the bytes returned are the bytes hashed, so
    nothing can swap the file between the check and the parse."""
    meta_path, vocab_path = directory / META_FILE, directory / VOCAB_FILE
    try:  # every checkpoint copies this directory: a link or special file in it is refused
        check_tree(directory, what="tokenizer directory")
    except FileNotFoundError:
        raise DataError(f"tokenizer directory {directory} does not exist; point at OUT/tokenizer "
                        "of a prepared dataset") from None
    if not os.path.lexists(meta_path) or not os.path.lexists(vocab_path):
        raise DataError(f"{directory} is not a tokenizer directory (needs {META_FILE} and "
                        f"{VOCAB_FILE}); point at OUT/tokenizer of a prepared dataset")
    meta = _read_json(meta_path, "re-run `lmforge prepare`")
    vocab = _read_bytes(vocab_path)
    if not isinstance(meta, dict) or hashlib.sha256(vocab).hexdigest() != meta.get("sha256"):
        raise DataError(f"{vocab_path} does not match the sha256 in {META_FILE} (modified or "
                        "corrupted); copy the tokenizer directory again from the dataset")
    return meta, vocab


def load_tokenizer_dir(directory: Path | str) -> tiktoken.Encoding:
    """The Encoding saved by `save_tokenizer_dir` (vocabulary sha256 validated)."""
    directory = Path(directory)
    meta, vocab = _read_verified(directory)
    try:
        name, pattern, special, n_vocab = (meta["name"], meta["pattern"], meta["special_tokens"],
                                           meta["n_vocab"])
    except KeyError as e:
        raise DataError(f"{directory / META_FILE} lacks {e}; re-run `lmforge prepare`") from None
    names = {i: t for t, i in special.items()} if isinstance(special, dict) else {}
    eot, bos = names.get(meta.get("eot_id"), EOT), names.get(meta.get("bos_id"))
    ranks = _parse_ranks(vocab, directory / VOCAB_FILE, meta.get("kind") == "hf")
    enc = make_encoding(name, pattern, ranks, special, eot, bos, meta.get("normalizer"),
                        meta.get("text_tokens"))
    if enc.n_vocab != n_vocab:
        raise DataError(f"{directory}: n_vocab {enc.n_vocab} != {n_vocab} in {META_FILE}; "
                        "copy the tokenizer directory again from the dataset")
    return enc


def dataset_tokenizer_meta(data_dir: Path | str) -> dict:
    """tokenizer.json of DIR/tokenizer (its vocabulary's sha256 checked), held against DIR's
    manifest: the sha256 it records (none in data prepared before it was recorded: then the
    directory's own), its vocab_size and eot_id. One copied over it would decode, and bound the
    model's ids, by another vocabulary; one of more ids would size the model by them."""
    m, tok_dir = load_manifest(data_dir), Path(data_dir) / "tokenizer"
    meta = read_tokenizer_meta(tok_dir)
    recorded, found = m.tokenizer.get("sha256"), meta["sha256"]
    if recorded not in (None, found):
        raise DataError(f"{tok_dir} is not the tokenizer {data_dir} was prepared with (sha256 "
                        f"{found[:12]}, its manifest says {recorded[:12]}); copy the dataset "
                        "again, or prepare it again")
    if (meta.get("n_vocab"), meta.get("eot_id")) != (m.vocab_size, m.eot_id):
        raise DataError(f"{tok_dir} has {meta.get('n_vocab')!r} ids (end-of-text "
                        f"{meta.get('eot_id')!r}), {data_dir}'s manifest {m.vocab_size} "
                        f"({m.eot_id}): they are not one dataset; copy the dataset again, or "
                        "prepare it again")
    return meta


def dataset_tokenizer(data_dir: Path | str) -> tiktoken.Encoding:
    """DIR/tokenizer of a prepared dataset, held against its manifest (dataset_tokenizer_meta)."""
    dataset_tokenizer_meta(data_dir)
    return load_tokenizer_dir(Path(data_dir) / "tokenizer")


def train_bpe(texts: Iterable[str], vocab_size: int, name: str | None = None) -> tiktoken.Encoding:
    """Train a byte-level BPE with `vocab_size` ids in all: vocab_size - 1 mergeable ranks (256
    bytes + merges, GPT-4 split pattern) then `<|endoftext|>` = vocab_size - 1; fewer when the
    texts run out of pairs to merge. Named `name`, by default bpeN for its N ids.

    rustbpe (nanochat's trainer) rather than HF tokenizers: it exports tiktoken mergeable ranks
    directly, so the tiktoken encoding reproduces training exactly, and it trains faster on the
    same sample (bench/prepare_bench.py --bpe measures both).
    """
    import rustbpe

    _check_bpe_size(vocab_size)
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(iter(texts), vocab_size - 1, pattern=CL100K_PATTERN)
    ranks = {bytes(b): r for b, r in tok.get_mergeable_ranks()}
    return make_encoding(name or f"bpe{next_id(ranks) + 1}", CL100K_PATTERN, ranks, {EOT: next_id(ranks)})


def bpe_size(spec: str) -> int | None:
    """N of a `bpe:N` tokenizer spec, None for any other spec; DataError for a bad N."""
    if not spec.startswith("bpe:"):
        return None
    try:
        n = int(spec[4:])
    except ValueError:
        raise DataError(f"bad tokenizer {spec!r}; write bpe:N, e.g. bpe:4096") from None
    _check_bpe_size(n)
    return n


def _check_bpe_size(n: int) -> None:
    # 256 byte tokens + at least one merge + <|endoftext|>; 2**20 ids is far past any use here.
    if not 257 < n <= 2**20:
        raise DataError(f"bpe:{n} is out of range; use bpe:N with 258 <= N <= {2**20}")
