"""A checkpoint loaded for use (eval, sample, export): a plain GPT in eval mode.

A checkpoint may come from anyone, and its meta.json says what model to build: before any memory
is allocated or any weight read, the stored weights must have that model's shapes (a meta.json
naming a huge model beside small weights is refused, not allocated), its tables fit this machine
and its tokenizer's ids the model's vocabulary.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
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
from lmforge.model.model import state_shapes
from lmforge.pipeline.checkpoint.format import CheckpointMeta, read_meta, resolve
from lmforge.pipeline.checkpoint.hf_init import (
    check_tables_fit,
    hf_dir,
    load_hf_model,
    mismatch,
    safetensors_file,
    stored_tensors,
)
from lmforge.pipeline.checkpoint.safe_dcp import (
    SafeFileSystemReader,
    load_into,
    misfit,
    refusal,
    single_process_ok,
)
from lmforge.pipeline.config import JobConfig

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
    check_tables_fit(meta.model, ckpt / "meta.json")
    weights = ckpt / WEIGHTS_FILE
    export = weights.is_file()
    stored = {k: t.shape for k, t in stored_tensors(weights).items()} if export else dcp_shapes(ckpt)
    check_stored_shapes(stored, meta.model, weights if export else ckpt)
    model = GPT(meta.model)
    if export:
        with safetensors_file(weights) as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
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


def dcp_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """Each model tensor's shape from a DCP checkpoint's (safely read) metadata."""
    stored = SafeFileSystemReader(ckpt).read_metadata().state_dict_metadata
    return {k.removeprefix("model."): tuple(v.size) for k, v in stored.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


def check_stored_shapes(stored: dict[str, tuple[int, ...]], cfg: ModelConfig, where: Path) -> None:
    """Every weight of meta.json's model stored with its shape (a tied LM head may be absent),
    nothing else; counted before anything sized by meta.json is built (state_shapes)."""
    tied = cfg.tie_embeddings
    if wrong := mismatch(state_shapes(cfg, len(stored) + tied), stored, ("lm_head.weight",) if tied else ()):
        raise misfit(where, wrong)
