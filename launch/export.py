"""`lmforge export`: a checkpoint -> a Hugging Face Llama (Qwen3 with model.qk_norm) directory
that `transformers` loads, or with --gguf one GGUF file that llama.cpp and ollama run
(launch/export_gguf.py); a model option neither holds is refused in one error line.

    lmforge export --ckpt runs/tiny --hf out/tiny-hf
    lmforge export --ckpt runs/tiny --gguf out/tiny.gguf [--gguf-dtype f16]
    python -c "from transformers import AutoModelForCausalLM, AutoTokenizer as T; \
               m = AutoModelForCausalLM.from_pretrained('out/tiny-hf'); t = T.from_pretrained('out/tiny-hf')"

OUT holds config.json + generation_config.json + model.safetensors (model.hf.export_hf; bos/eos
(/pad) ids the source model's, else eos = bos = the end-of-text id: launch/source.py), the
tokenizer-side files of a Hugging Face source byte for byte, else the tokenizer as a `tokenizers`
tokenizer.json + tokenizer_config.json (converted from the tiktoken vocabulary by transformers'
TikTokenConverter; `<|endoftext|>` is the eos token), and lmforge_tokenizer/, the original
tiktoken vocabulary, exact. OUT is written beside itself and renamed into place, and only a
previous export (it carries EXPORT_MARKER) is ever replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from lmforge.data_prep.errors import is_disk_full
from lmforge.data_prep.safe_files import check_writable
from lmforge.data_prep.shards import check_dir_path, copy_plain_tree
from lmforge.data_prep.tokenizer import (
    EOT,
    VOCAB_FILE,
    Encoding,
    hf_pattern,
    load_tokenizer_dir,
    read_tokenizer_meta,
)
from lmforge.launch.cli import ArgumentParser
from lmforge.launch.export_gguf import GGUF_DTYPES, export_gguf
from lmforge.launch.source import copied_files, token_ids
from lmforge.model.hf import CONFIG_FILE, export_hf, hf_config_dict
from lmforge.pipeline.config import ConfigError
from lmforge.pipeline.inference import LoadedCheckpoint, load_for_inference

EXPORT_MARKER = "lmforge_export.json"
TOKENIZER_COPY = "lmforge_tokenizer"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="lmforge export",
                                description="Export a checkpoint to the Hugging Face Llama format "
                                            "(Qwen3 with model.qk_norm), or to GGUF.")
    p.add_argument("--ckpt", required=True,
                   help="run directory (newest checkpoint), checkpoints/step_* or final/")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--hf", type=Path, metavar="OUT", help="output directory (Hugging Face)")
    out.add_argument("--gguf", type=Path, metavar="FILE",
                     help="output file for llama.cpp / ollama (GGUF: arch llama, qwen2 or qwen3)")
    p.add_argument("--gguf-dtype", default="f32", choices=sorted(GGUF_DTYPES),
                   help="the GGUF's matrices in this type (norms stay f32, as llama.cpp's own)")
    return p


def check_replaceable(out: Path) -> None:
    """OUT may be new, empty, or a previous export; never a file, a link, or the directory the
    export runs in (it is replaced whole)."""
    check_dir_path(out, "--hf")
    if out.is_symlink():
        raise ConfigError(f"--hf {out} is a symbolic link; give the directory it points to")
    if out == Path.cwd() or out in Path.cwd().parents:
        raise ConfigError(f"--hf {out} holds the working directory, and an export replaces its "
                          "directory whole; give a directory by name, outside it")
    if out.is_dir() and any(out.iterdir()) and not (out / EXPORT_MARKER).is_file():
        raise ConfigError(f"--hf {out} is not empty and not an lmforge export; "
                          "give a new or empty directory")


def save_hf_tokenizer(tokenizer_dir: Path, out: Path, context: int) -> None:
    """tokenizer.json + tokenizer_config.json for AutoTokenizer, with the same ids as tiktoken."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    meta = read_tokenizer_meta(tokenizer_dir)
    special = meta["special_tokens"]
    tok = TikTokenConverter(vocab_file=str(tokenizer_dir / VOCAB_FILE),
                            pattern=hf_pattern(meta["pattern"])).converted()
    # Added here rather than through the converter, whose argument for them was renamed in
    # transformers 5 (additional_special_tokens -> extra_special_tokens).
    tok.add_special_tokens([AddedToken(name, normalized=False, special=True) for name in special])
    # The converter appends the special tokens after the vocabulary; a vocabulary with unused ids
    # before them (cl100k) would get other ids than tiktoken's, so refuse rather than mis-encode.
    wrong = {name: i for name, i in special.items() if tok.token_to_id(name) != i}
    if wrong:
        raise ConfigError(f"cannot express the tokenizer {meta['name']} for Hugging Face (special "
                          f"token ids {wrong} would move); use a vocabulary without id gaps")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token=EOT,
                                 unk_token=None, model_max_length=context, clean_up_tokenization_spaces=False)
    hf.save_pretrained(out)
    # transformers 5 names its class TokenizersBackend, unknown to 4.x; the 4.x name loads in both.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def export(ckpt_path: str | Path, out: Path) -> Path:
    out = Path(os.path.abspath(out))  # "." and "a/.." by their own names
    check_replaceable(out)
    check_writable(out.parent, what="--hf")  # the export is written beside OUT, then renamed
    ckpt = load_for_inference(ckpt_path, "cpu")
    try:  # a model Llama or Qwen3 cannot hold is refused before anything is written
        hf_config_dict(ckpt.config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    enc = load_tokenizer_dir(ckpt.tokenizer_dir)
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # A directory of this process's own beside OUT: nothing of the user's is ever in the way.
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        write_export(ckpt, enc, tmp)
        if out.is_dir():  # empty, or a previous export (check_replaceable)
            shutil.rmtree(out)
        tmp.rename(out)
    except Exception as e:  # safetensors reports ENOSPC as its own SafetensorError
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # first: the free space said is then true
        if is_disk_full(e):
            raise disk_full(out, ckpt) from None
        if isinstance(e, OSError):  # unwritable since the check, or a read-only mount
            raise ConfigError(f"cannot write the export {out} ({e.strerror}); nothing was "
                              "replaced: give --hf in a writable directory") from None
        raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def disk_full(out: Path, ckpt: LoadedCheckpoint) -> ConfigError:
    """The one line of an export that filled its disk (a previous export at OUT is untouched:
    it is replaced only once the new one is complete)."""
    where = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(where).free
    weights = 4 * sum(t.numel() for t in ckpt.model.state_dict().values())  # fp32, as written
    return ConfigError(f"no space left on device writing the export {out} (free "
                       f"{free / 2**20:,.1f} MB; its fp32 weights alone need {weights / 2**20:,.1f} "
                       "MB); nothing was replaced: free space, or give --hf on another disk")


def write_export(ckpt: LoadedCheckpoint, enc: Encoding, tmp: Path) -> None:
    copy_plain_tree(ckpt.tokenizer_dir, tmp / TOKENIZER_COPY)  # first: it refuses symlinks
    ids = token_ids(ckpt.tokenizer_dir, enc)
    export_hf(ckpt.model, ckpt.config, tmp, eos_token_id=ids["eos_token_id"],
              bos_token_id=ids["bos_token_id"])
    if "pad_token_id" in ids:  # the source's; without one, generation_config pads with eos
        config = json.loads((tmp / CONFIG_FILE).read_text())
        (tmp / CONFIG_FILE).write_text(json.dumps(config | ids, indent=2) + "\n")
    if copied := copied_files(tmp / TOKENIZER_COPY):  # from hf:DIR: its own files, as given
        for f in copied:
            shutil.copyfile(f, tmp / f.name)
    else:
        try:
            save_hf_tokenizer(ckpt.tokenizer_dir, tmp, ckpt.config.max_seq_len)
        except ImportError:  # transformers converts the vocabulary; the weights need only safetensors
            print("note: transformers is not installed, so no tokenizer.json was written (pip "
                  "install 'lmforge[hf]'); the vocabulary is in lmforge_tokenizer/", file=sys.stderr)
    marker = {"checkpoint": str(ckpt.path.resolve()), "step": ckpt.step, "model": ckpt.config.to_dict()}
    (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.gguf is not None:
        out = export_gguf(args.ckpt, args.gguf, args.gguf_dtype)
        print(f"exported to {out} ({args.gguf_dtype}); run it: llama-cli -m {out}")
        return 0
    out = export(args.ckpt, args.hf)
    files = ["config.json", "generation_config.json", "model.safetensors"] + ["tokenizer.json"] * (out / "tokenizer.json").is_file()
    print(f"exported to {out}: {', '.join(files)} "
          f"(+ {TOKENIZER_COPY}/, the exact tiktoken vocabulary)")
    print(f"load it: AutoModelForCausalLM.from_pretrained({str(out)!r}), "
          f"AutoTokenizer.from_pretrained({str(out)!r})")
    return 0
