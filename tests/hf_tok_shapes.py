"""Hugging Face tokenizer.json files of the shapes released models ship, built with `tokenizers`
on the built-in corpus (the reference every test holds lmforge's ids against), and a corpus that
reaches every rule: unicode with combining marks the Unicode versions order differently, digit and
whitespace runs, control bytes, the bytes a vocabulary lacks, added tokens in text."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.hf_dirs import EOS, ODD_TEXTS, corpus

# SmolLM/SmolLM2's 49,152-id vocabulary has no token for these bytes.
SMOLLM_MISSING = [0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)]
# Qwen2's split: Llama 3's with one digit a piece.
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GAPS_PATTERN = r"\p{L}+|\p{N}+"  # leaves punctuation and spaces between its matches
TEXT_TOKENS = ["<think>", "</think>", "<tool_call>"]  # Qwen's, "special": false
NORMED_TOKEN = "<note>"  # not special, matched in the normalised text
SHAPES = ("smollm", "qwen", "gaps", "appended")


def _train(pre, normalizer=None, alphabet_skip=(), vocab: int = 640):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lmforge.data_prep.hf_tokenizer import bytes_to_unicode

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre, decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    skip = {bytes_to_unicode()[b] for b in alphabet_skip}
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=[c for c in pre_tokenizers.ByteLevel.alphabet()
                                                    if c not in skip])
    tok.train_from_iterator(corpus(), trainer)
    return tok


def make_shape(out: Path, shape: str) -> Path:
    """tokenizer.json + tokenizer_config.json of one shape in `out`:
    "smollm": Digits + ByteLevel, a vocabulary without SMOLLM_MISSING's single bytes;
    "qwen": NFC, Qwen's digit split, ByteLevel post-processor, Qwen's non-special added tokens;
    "gaps": a Split regex that leaves text between its matches;
    "appended": GPT-2's shape with merges appended to an extended vocabulary, some of which
    `tokenizers` can never apply (their parts never meet)."""
    from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers, processors

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=shape in ("smollm", "appended"))
    if shape == "smollm":
        tok = _train(pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
                     alphabet_skip=SMOLLM_MISSING)
    elif shape in ("qwen", "gaps"):
        split = pre_tokenizers.Split(Regex(QWEN_PATTERN if shape == "qwen" else GAPS_PATTERN),
                                     behavior="isolated")
        tok = _train(pre_tokenizers.Sequence([split, byte_level]),
                     normalizers.NFC() if shape == "qwen" else None)
    else:
        tok = _train(byte_level)
    if shape == "qwen":
        tok.add_special_tokens([AddedToken("<|im_start|>", special=True, normalized=False)])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS]
                       + [AddedToken(NORMED_TOKEN, special=False, normalized=True)])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    if shape == "appended":
        _append_merges(out / "tokenizer.json", tok)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return out


def appended_words(tok_dir: Path) -> list[str]:
    """The words of the tokens `make_shape("appended")` appended, as text."""
    return json.loads((tok_dir / "appended.json").read_text())


def _append_merges(path: Path, tok) -> None:
    """Extend the vocabulary by 8 tokens "Ġword" + "tail", each with its merge appended: four
    that `tokenizers` reaches (base BPE ends at the two parts), four it never does (base BPE
    ends at two other parts, which tiktoken, merging any two parts a token is made of, joins)."""
    from lmforge.data_prep.hf_tokenizer import bytes_to_unicode

    j = json.loads(path.read_text())
    vocab, merges = j["model"]["vocab"], j["model"]["merges"]
    heads = sorted(t for t in vocab if t[:1] == "Ġ" and t[1:].isalpha() and len(t) > 3)
    tails = sorted(t for t in vocab if t.isalpha() and t.islower() and len(t) > 2)
    picked: dict[bool, list] = {True: [], False: []}
    for a, b in ((a, b) for a in heads for b in tails if a + b not in vocab):
        parts = [t.value for t in tok.model.tokenize(a + b)]
        if len(parts) == 2 and len(picked[parts == [a, b]]) < 4:
            picked[parts == [a, b]].append((a, b))
        if len(picked[True]) == len(picked[False]) == 4:
            break
    pairs = picked[True] + picked[False]
    assert len(pairs) == 8
    for a, b in pairs:
        vocab[a + b] = len(vocab)
        merges.append([a, b] if isinstance(merges[0], list) else f"{a} {b}")
    path.write_text(json.dumps(j, ensure_ascii=False))
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    words = [bytes(to_byte[c] for c in a + b).decode() for a, b in pairs]
    (path.parent / "appended.json").write_text(json.dumps(words))


# Marks whose canonical combining class Python 3.11's Unicode 14 and `tokenizers`' tables
# disagree on (found by comparing the two NFCs), with marks of class 220 and 230 around them.
NFC_SPLITS = ["a\u0898\u0316", "e\u0301\u1ac1\u0316", "o\u0316\u1ac1", "\u0c3c\u0301x"]
PIECES = (["Hello", " world", "42", "１２３", " ", "  ", "\t", "\n\n", "\r\n", "'s", "'LL", ",", "...",
           "é", "e\u0301", "<\u0338", "日本", "🎉", "\u00a0", "\x0b", "\x1c", "\x1d", "\x04", "\x06",
           "\x13", "\x14", "\x16", "(", ")", "\U00040000", "\U0009ffff", EOS, "<|im_start|>",
           "<tool_call>", "x"] + TEXT_TOKENS + [NORMED_TOKEN] + NFC_SPLITS)


def random_texts(n: int, seed: int = 0) -> list[str]:
    """`n` texts of 1-40 random PIECES: every rule, next to every other."""
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def shape_corpus(extra: list[str] = ()) -> list[str]:
    """The corpus each shape is held to `tokenizers` on."""
    return (corpus(30, skip=160) + ODD_TEXTS + random_texts(300) + list(extra)
            + ["a(\x04)b", "a()b", "a\x04b", "ab", "x\x1d\x1dy", " \x04 ", "\x04"])
