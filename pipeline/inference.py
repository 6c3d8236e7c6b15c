"""A checkpoint loaded for use (eval, sample, export): a plain GPT in eval mode.

A checkpoint may come from anyone, and its meta.json says what model to build: before any memory
is allocated or any weight read, the stored weights must have that model's shapes (a meta.json
naming a huge model beside small weights is refused, not allocated), its tables fit this machine
and its tokenizer's ids the model's vocabulary.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.tokenizer import (
    HF_PREFIX,
    fits_model,
    load_tokenizer,
    read_tokenizer_meta,
    save_tokenizer_dir,
)
from lmforge.model import GPT, ModelConfig
from lmforge.pipeline.checkpoint.format import CheckpointMeta, read_meta, resolve
from lmforge.pipeline.checkpoint.hf_init import hf_dir, load_hf_model
from lmforge.pipeline.checkpoint.safe_dcp import (
    SafeFileSystemReader,
    load_into,
    misfit,
    refusal,
    single_process_ok,
)
from lmforge.pipeline.config import JobConfig
from lmforge.pipeline.parallel.materialize import meta_gpt

WEIGHTS_FILE = "model.safetensors"


@dataclass
class LoadedCheckpoint:
    model: GPT
    path: Path
    tokenizer_dir: Path
    meta: CheckpointMeta
    scratch: tempfile.TemporaryDirectory | None = None  # holds tokenizer_dir of an hf:DIR

    @property
    def config(self) -> ModelConfig:
        return self.meta.model

    @property
    def step(self) -> int:
        return self.meta.step


def load_for_inference(path: str | Path, device: str | torch.device = "cpu") -> LoadedCheckpoint:
    """Any checkpoint the pipeline writes (an export, or DCP from any number of ranks) -> a
    plain GPT in eval mode on `device`; `hf:DIR` a Hugging Face model directory."""
    if (directory := hf_dir(path)) is not None:
        return load_hf(directory, device)
    ckpt = resolve(path)
    meta = read_meta(ckpt)
    check_tokenizer_fits(ckpt / "tokenizer", meta.model)
    check_tables_fit(meta.model, ckpt)
    weights = ckpt / WEIGHTS_FILE
    export = weights.is_file()
    stored = safetensors_shapes(weights) if export else dcp_shapes(ckpt)
    # meta_gpt: shapes only, what the stored weights must match before any is allocated.
    check_stored_shapes(stored, meta_gpt(meta.model), meta.model.tie_embeddings,
                        weights if export else ckpt)
    model = GPT(meta.model)
    if export:
        state = read_safetensors(weights)
    else:
        box = {"model": dict(model.state_dict())}
        with single_process_ok():
            load_into(box, ckpt, no_dist=True)
        state = box["model"]
    model.load_state_dict(state, strict=False)  # keys and shapes checked above; a tie holds
    model.to(device).eval()
    return LoadedCheckpoint(model=model, path=ckpt, tokenizer_dir=ckpt / "tokenizer", meta=meta)


def load_hf(directory: Path, device: str | torch.device) -> LoadedCheckpoint:
    """A Hugging Face directory as a checkpoint at step 0: its weights (hf_init's checks), and its
    tokenizer.json converted into a tokenizer directory of a scratch folder."""
    model = load_hf_model(directory, device)
    scratch = tempfile.TemporaryDirectory(prefix="lmforge-hf-tokenizer-")
    enc = load_tokenizer(f"{HF_PREFIX}{directory}")
    save_tokenizer_dir(enc, scratch.name, "hf", enc.name)
    check_tokenizer_fits(Path(scratch.name), model.cfg)
    meta = CheckpointMeta(step=0, model=model.cfg, config=JobConfig(model=model.cfg), lineage="hf")
    return LoadedCheckpoint(model, directory, Path(scratch.name), meta, scratch)


def check_tokenizer_fits(tokenizer_dir: Path, cfg: ModelConfig) -> None:
    """The checkpoint's tokenizer (when it has one) is the model's: the trainer builds the model
    with exactly its ids (pipeline.data.windows refuses data of any other vocabulary)."""
    if not tokenizer_dir.is_dir():
        return
    try:
        tok = read_tokenizer_meta(tokenizer_dir)
        n_vocab, eot = int(tok["n_vocab"]), int(tok["eot_id"])
    except (DataError, KeyError, TypeError, ValueError) as e:
        raise refusal(tokenizer_dir, f"its tokenizer is unreadable ({e})") from None
    if not (0 <= eot < n_vocab and fits_model(tok, cfg.vocab_size)):
        raise refusal(tokenizer_dir, f"its tokenizer has {n_vocab} ids (end-of-text {eot}) for a "
                                     f"model of vocabulary {cfg.vocab_size}; the tokenizer is not "
                                     "the one the model was trained with")


def check_tables_fit(cfg: ModelConfig, where: Path) -> None:
    """The RoPE tables (2 x max_seq_len x head_dim fp32), the one size meta.json sets that no
    stored weight confirms, within this machine's memory."""
    need = 2 * cfg.max_seq_len * cfg.head_dim * 4
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have // 4:
        raise refusal(where / "meta.json", f"its max_seq_len {cfg.max_seq_len:,} needs "
                                           f"{need / 2**30:,.1f} GiB of RoPE tables")


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from a safetensors header (no tensor data read)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise refusal(path, f"not a readable safetensors file ({e})") from None


def dcp_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """Each model tensor's shape from a DCP checkpoint's (safely read) metadata."""
    stored = SafeFileSystemReader(ckpt).read_metadata().state_dict_metadata
    return {k.removeprefix("model."): tuple(v.size) for k, v in stored.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise refusal(path, f"not a readable safetensors file ({e})") from None


def check_stored_shapes(stored: dict[str, tuple[int, ...]], skeleton: GPT, tied: bool,
                        where: Path) -> None:
    """Every weight of `skeleton` stored with its shape (a tied LM head may be absent), and
    nothing else stored."""
    ours = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    wrong = [f"{k}: {stored[k]} vs {ours[k]}" for k in ours if k in stored and stored[k] != ours[k]]
    missing = [k for k in ours if k not in stored and not (tied and k == "lm_head.weight")]
    unexpected = [k for k in stored if k not in ours]
    if wrong or missing or unexpected:
        raise misfit(where, "; ".join([*(f"shape {w}" for w in wrong[:2]),
                                       *(f"missing {k}" for k in missing[:2]),
                                       *(f"unexpected {k}" for k in unexpected[:2])]))

