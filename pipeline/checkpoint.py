"""The checkpoint format: defined here once, versioned, validated on read.

A run directory holds:

    RUN/config.toml                      resolved config of the run
    RUN/metrics.jsonl, RUN/loss.png      metrics (pipeline.metrics)
    RUN/checkpoints/step_00000100/       a training checkpoint (resumable)
        meta.json                        written last: format, version, step, model config,
                                         job config, loader position, counters
        .metadata, __*_*.distcp          model + optimizer, torch.distributed.checkpoint (DCP):
                                         sharded by FSDP, reshardable to any number of ranks
        rng_rank00000.pt ...             each rank's RNG states
        tokenizer/                       the vocabulary (data_prep's tokenizer directory)
    RUN/final/                           the consolidated export for eval / sample / export
        meta.json, model.safetensors, tokenizer/

A checkpoint is written into `NAME.tmp` and renamed to `NAME` only when every rank has finished
and meta.json is in place, so a crash mid-save never leaves a directory that looks complete.
Every checkpoint carries its tokenizer, so a single directory is enough to evaluate or sample.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from model import GPT, ModelConfig
from pipeline.distributed import DistInfo, barrier

FORMAT = "lmforge-checkpoint"
VERSION = 1
STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, from another format version, or from another model."""


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns on every single-process save/load, which for us is a normal, intended case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# --------------------------------------------------------------------------------------------
# Finding checkpoints


def list_complete(ckpt_root: Path) -> list[Path]:
    """Complete step checkpoints under RUN/checkpoints, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [
        p for p in ckpt_root.iterdir()
        if p.is_dir() and STEP_DIR.match(p.name) and (p / "meta.json").is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def read_meta(ckpt_dir: Path) -> dict:
    meta_path = ckpt_dir / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not a complete lmforge checkpoint (no meta.json); "
            "pass a run directory, a checkpoints/step_* directory or a final/ export"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path} is corrupt ({e}); use another checkpoint") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt_dir} is not an lmforge checkpoint (format={meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"{ckpt_dir} has checkpoint format version {meta.get('version')}, this lmforge reads "
            f"version {VERSION}; use the lmforge version that wrote it"
        )
    return meta


def resolve(path: str | Path) -> Path:
    """A run directory, a step directory, a final/ directory or a model.safetensors file -> the
    checkpoint directory to read (for a run directory: the newest complete one)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist; pass a run directory or a checkpoint")
    if p.is_file():
        p = p.parent
    if (p / "meta.json").is_file():
        return p
    candidates = list_complete(p / "checkpoints")
    final = p / "final"
    if (final / "meta.json").is_file():
        candidates.append(final)
    if not candidates:
        raise CheckpointError(
            f"no complete checkpoint in {p} (expected meta.json, checkpoints/step_*/ or final/)"
        )
    return max(candidates, key=lambda c: (read_meta(c)["step"], c.name == "final"))


# --------------------------------------------------------------------------------------------
# Training checkpoints (resumable)


def _rng_state() -> dict:
    # Only torch's generators: the loader and sampler use their own seeded generators, and
    # tensors alone keep the file loadable with weights_only=True.
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training(
    run_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict,
    tokenizer_dir: Path,
    info: DistInfo,
    keep: int,
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory."""
    root = run_dir / "checkpoints"
    final = root / step_dir_name(step)
    tmp = root / (final.name + ".tmp")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(info)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _single_process_ok():
        dcp.save(
            {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=not info.is_distributed
        )
    torch.save(_rng_state(), tmp / f"rng_rank{info.rank:05d}.pt")
    barrier(info)
    if info.is_main:
        shutil.copytree(tokenizer_dir, tmp / "tokenizer")
        full = {"format": FORMAT, "version": VERSION, "step": step, "world_size": info.world_size}
        _write_json(tmp / "meta.json", full | meta)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in list_complete(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier(info)
    return final


def check_same_model(meta: dict, model_cfg: ModelConfig, where: Path) -> None:
    theirs = meta["model"]
    ours = model_cfg.to_dict()
    diff = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
    if diff:
        shown = ", ".join(f"{k}: checkpoint {a} vs config {b}" for k, (a, b) in sorted(diff.items()))
        raise CheckpointError(
            f"checkpoint {where} is from another model ({shown}); "
            "use the config it was trained with or start a new run directory"
        )


def load_training(
    ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo
) -> dict:
    """Collective: restore model + optimizer (resharding as needed) and this rank's RNG; return meta."""
    meta = read_meta(ckpt_dir)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _single_process_ok():
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=not info.is_distributed)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    rng_file = ckpt_dir / f"rng_rank{info.rank:05d}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than wrote the checkpoint
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return meta


# --------------------------------------------------------------------------------------------
# The consolidated export and inference loading


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded fp32 weights on CPU (meaningful on rank 0)."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _drop_tied(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    # safetensors refuses aliased tensors; the tied head is rebuilt from the embedding on load.
    return {k: v for k, v in state.items() if not (cfg.tie_embeddings and k == "lm_head.weight")}


def save_consolidated(
    out_dir: Path, state: dict[str, torch.Tensor], meta: dict, tokenizer_dir: Path, cfg: ModelConfig
) -> Path:
    """Rank 0 only: write OUT/{model.safetensors, meta.json, tokenizer/} atomically."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.contiguous() for k, v in _drop_tied(state, cfg).items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": FORMAT})
    shutil.copytree(tokenizer_dir, tmp / "tokenizer")
    _write_json(tmp / "meta.json", {"format": FORMAT, "version": VERSION} | meta)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


@dataclass
class LoadedCheckpoint:
    model: GPT
    config: ModelConfig
    step: int
    path: Path
    tokenizer_dir: Path
    meta: dict


def load_for_inference(path: str | Path, device: str | torch.device = "cpu") -> LoadedCheckpoint:
    """Any checkpoint the pipeline writes -> a plain GPT in eval mode on `device`.

    Reads a consolidated export (model.safetensors) directly, and a training checkpoint written
    by any number of ranks through DCP in this single process.
    """
    ckpt = resolve(path)
    meta = read_meta(ckpt)
    try:
        cfg = ModelConfig.from_dict(meta["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{ckpt}/meta.json has an invalid model config: {e}") from None
    model = GPT(cfg)
    weights = ckpt / "model.safetensors"
    if weights.is_file():
        state = load_file(str(weights))
    else:
        _check_dcp_shapes(ckpt, model, cfg)
        state = dict(model.state_dict())
        box = {"model": state}
        with _single_process_ok():
            dcp.load(box, checkpoint_id=str(ckpt), no_dist=True)
        state = box["model"]
    _load_strict(model, state, cfg, ckpt)
    model.to(device).eval()
    return LoadedCheckpoint(
        model=model, config=cfg, step=int(meta["step"]), path=ckpt,
        tokenizer_dir=ckpt / "tokenizer", meta=meta,
    )


def _misfit(where: Path, detail: str) -> CheckpointError:
    return CheckpointError(
        f"weights in {where} do not fit the model described by its meta.json ({detail}); "
        "the checkpoint is corrupt or was assembled from two runs"
    )


def _check_shapes(expected: dict[str, torch.Size], found: dict[str, torch.Size], where: Path) -> None:
    wrong = [f"{k}: {tuple(found[k])} vs {tuple(v)}" for k, v in expected.items() if k in found and found[k] != v]
    if wrong:
        raise _misfit(where, "shape " + "; ".join(wrong[:2]))


def _check_dcp_shapes(ckpt: Path, model: GPT, cfg: ModelConfig) -> None:
    stored = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    found = {k.removeprefix("model."): v.size for k, v in stored.items()
             if k.startswith("model.") and hasattr(v, "size")}
    _check_shapes({k: v.shape for k, v in model.state_dict().items()}, found, ckpt)


def _load_strict(model: GPT, state: dict, cfg: ModelConfig, where: Path) -> None:
    _check_shapes({k: v.shape for k, v in model.state_dict().items()},
                  {k: v.shape for k, v in state.items()}, where)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied_ok = {"lm_head.weight"} if cfg.tie_embeddings else set()
    missing = [k for k in missing if k not in tied_ok]
    if missing or unexpected:
        raise _misfit(where, f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
