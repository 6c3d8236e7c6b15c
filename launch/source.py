"""What a checkpoint's tokenizer carries of the Hugging Face model it came from (`hf:DIR`, kept in
TOKENIZER/hf/ by data_prep/hf_tokenizer.py): its tokenizer-side files byte for byte, the
bos/eos/pad ids its config.json gave, and its chat template. `lmforge export` (both formats) and
`lmforge sample --chat` read them here; a tokenizer lmforge made itself has none of them, and its
ids follow the shards: every document starts with end-of-text (then the tokenizer's BOS)."""

from __future__ import annotations

import json
from pathlib import Path

import tiktoken

from lmforge.data_prep.safe_files import read_text
from lmforge.data_prep.tokenizer import HF_FILES, bos_id, eot_id
from lmforge.pipeline.config import ConfigError

SOURCE_CONFIG = "config.json"  # the source model's: its ids are read, the file is never copied
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE, TEMPLATE_JSON = "chat_template.jinja", "chat_template.json"
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
MAX_BYTES = 1 << 28


def source_dir(tokenizer_dir: Path) -> Path | None:
    """TOKENIZER/hf of a tokenizer converted from a Hugging Face model; None for lmforge's own."""
    hf = Path(tokenizer_dir) / HF_FILES
    return hf if hf.is_dir() else None


def _json(path: Path) -> dict:
    try:
        data = json.loads(read_text(path, MAX_BYTES, what="tokenizer file"))
    except ValueError as e:
        raise ConfigError(f"cannot parse {path} ({e}); prepare the data again from the model's "
                          "directory") from None
    return data if isinstance(data, dict) else {}


def copied_files(tokenizer_dir: Path) -> list[Path]:
    """The source's tokenizer-side files an export carries unchanged (tokenizer.json too)."""
    hf = source_dir(tokenizer_dir)
    return [] if hf is None else sorted(f for f in hf.iterdir() if f.name != SOURCE_CONFIG)


def token_ids(tokenizer_dir: Path, enc: tiktoken.Encoding) -> dict:
    """bos/eos(/pad) ids an export declares: the source config.json's where it gave them, else
    the shards' rule (bos: the tokenizer's BOS, else end-of-text; eos: end-of-text)."""
    ids = {"bos_token_id": eot_id(enc) if bos_id(enc) is None else bos_id(enc),
           "eos_token_id": eot_id(enc)}
    hf = source_dir(tokenizer_dir)
    if hf is not None and (hf / SOURCE_CONFIG).is_file():
        given = _json(hf / SOURCE_CONFIG)
        ids |= {k: given[k] for k in ID_KEYS if given.get(k) is not None}
    return ids


def first_id(value: int | list[int]) -> int:
    """One id of config.json's eos_token_id, which may list several (Llama 3.1): the first."""
    return value[0] if isinstance(value, list) else value


def chat_template(tokenizer_dir: Path) -> str | list | None:
    """The source's chat template (chat_template.jinja, chat_template.json, or
    tokenizer_config.json's `chat_template`: a string, or a list of named ones); None without."""
    hf = source_dir(tokenizer_dir)
    if hf is None:
        return None
    if (hf / TEMPLATE_FILE).is_file():
        return read_text(hf / TEMPLATE_FILE, MAX_BYTES, what="chat template")
    for name in (TEMPLATE_JSON, TOKENIZER_CONFIG):
        if (hf / name).is_file() and (template := _json(hf / name).get("chat_template")):
            return template
    return None


def render_chat(tokenizer_dir: Path, prompt: str, where: Path) -> str:
    """`prompt` as the user's turn of a conversation, rendered by the checkpoint's own chat
    template (through transformers, whose rendering the template was written for), ready for
    the assistant's answer."""
    if chat_template(tokenizer_dir) is None:
        raise ConfigError(f"{where} has no chat template (its tokenizer did not come from a Hugging "
                          "Face model that has one); drop --chat and give the prompt as text")
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise ConfigError("--chat renders the chat template with transformers, which is not "
                          "installed: pip install 'lmforge[hf]'") from None
    tok = PreTrainedTokenizerFast.from_pretrained(str(source_dir(tokenizer_dir)))
    messages = [{"role": "user", "content": prompt}]
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2's errors, and the template's own raise_exception
        raise ConfigError(f"the chat template of {where} fails on this prompt ({e})") from None
