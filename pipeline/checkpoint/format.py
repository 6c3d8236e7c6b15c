"""The checkpoint format: defined here once, versioned, validated on read.

A checkpoint (RUN/checkpoints/step_00000100/ of the run directory, pipeline.checkpoint.run_dir) holds:

    meta.json                 written last: CheckpointMeta (format, version, step, model, job
                              config, lineage, loader position, counters)
    .metadata, __*_*.distcp   model + optimizer, torch.distributed.checkpoint (DCP): sharded by
                              FSDP, reshardable to any number of ranks
    rng_rank00000.pt ...      each rank's RNG states
    tokenizer/                the vocabulary (data_prep's tokenizer directory)

and RUN/final/, the consolidated export for eval / sample / export, holds meta.json,
model.safetensors and tokenizer/.

A checkpoint is written into `NAME.tmp` and renamed to `NAME` only when every rank has finished
and meta.json is in place, so a crash mid-save never leaves a directory that looks complete.
Every checkpoint carries its tokenizer, so a single directory is enough to evaluate or sample.

"Newest" means newest of the run's current line of checkpoints: resuming from an older checkpoint
than the newest (a rollback) moves the newer ones, and a final/ export past that step, aside into
checkpoints/abandoned/, so keep-K, `--resume auto` and `--ckpt RUN` never pick the abandoned branch.
Opening someone else's checkpoint can neither run code nor read outside it: DCP is read through
pipeline.checkpoint.safe_dcp, tensors and RNG states with weights_only=True, meta.json as typed JSON, and
no file of a checkpoint is ever copied through a symbolic link.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from data_prep.shards import copy_plain_tree
from model import ModelConfig
from pipeline.checkpoint.run_dir import RunDir
from pipeline.checkpoint.safe_dcp import CheckpointError, load_into, refusal, single_process_ok
from pipeline.config import ConfigError, JobConfig, config_from_dict, config_to_dict
from pipeline.data.config import DataConfig, check_same_schedule
from pipeline.metrics import get_logger
from pipeline.parallel.distributed import DistInfo, barrier

FORMAT = "lmforge-checkpoint"
VERSION = 2  # 2: typed CheckpointMeta with lineage; the unread "parallel" key dropped
STEP_DIR = re.compile(r"^step_(\d{8})$")

log = get_logger()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# --------------------------------------------------------------------------------------------
# The metadata of every checkpoint


@dataclass
class CheckpointMeta:
    """meta.json, written last in every checkpoint: its presence means the checkpoint is complete."""

    step: int
    model: ModelConfig  # the model as built (vocabulary taken from the data)
    config: JobConfig  # the run's job config
    lineage: str  # id of the run the checkpoint descends from; kept across resumes and rollbacks
    parent_step: int | None = None  # the step this process resumed from; None: started fresh
    world_size: int = 1  # ranks that wrote it
    bad_steps: int = 0  # consecutive non-finite steps so far
    loader: dict | None = None  # the loader's state (pipeline.data.loader); None in a final/ export
    # The step's training record: the last step saves before logging it, so a kill in between
    # loses nothing (resume writes it back). Optional: checkpoints without it still read.
    record: dict | None = None

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "step": self.step,
                "model": self.model.to_dict(), "config": config_to_dict(self.config),
                "lineage": self.lineage, "parent_step": self.parent_step,
                "world_size": self.world_size, "bad_steps": self.bad_steps, "loader": self.loader,
                "record": self.record}

    @classmethod
    def from_json(cls, d: dict, where: Path) -> CheckpointMeta:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, dict) else d
            raise CheckpointError(f"{where} is not an lmforge checkpoint (format={found!r})")
        if d.get("version") != VERSION:
            raise CheckpointError(
                f"{where} has checkpoint format version {d.get('version')}, this lmforge reads "
                f"version {VERSION}; use the lmforge version that wrote it"
            )
        try:
            return cls(
                step=int(d["step"]), model=ModelConfig.from_dict(d["model"]),
                config=config_from_dict(d["config"]), lineage=str(d["lineage"]),
                parent_step=d["parent_step"], world_size=int(d["world_size"]),
                bad_steps=int(d["bad_steps"]), loader=d["loader"], record=d.get("record"),
            )
        except (KeyError, TypeError, ValueError, ConfigError) as e:
            raise CheckpointError(
                f"{where}/meta.json is invalid ({type(e).__name__}: {e}); use another checkpoint"
            ) from None


def new_lineage() -> str:
    return uuid.uuid4().hex[:12]


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


def read_meta(ckpt_dir: Path) -> CheckpointMeta:
    meta_path = ckpt_dir / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not a complete lmforge checkpoint (no meta.json); "
            "pass a run directory, a checkpoints/step_* directory or a final/ export"
        )
    try:
        d = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path} is corrupt ({e}); use another checkpoint") from None
    return CheckpointMeta.from_json(d, ckpt_dir)


def resolve(path: str | Path) -> Path:
    """A run directory, a step directory, a final/ directory or a model.safetensors file -> the
    checkpoint directory to read (for a run directory: the newest complete one, final/ on a tie;
    a rollback has moved any abandoned newer ones out of the way)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist; pass a run directory or a checkpoint")
    if p.is_file():
        p = p.parent
    if (p / "meta.json").is_file():
        return p
    candidates = list_complete(RunDir(p).checkpoints)
    final = RunDir(p).final
    if (final / "meta.json").is_file():
        candidates.append(final)
    if not candidates:
        raise CheckpointError(
            f"no complete checkpoint in {p} (expected meta.json, checkpoints/step_*/ or final/)"
        )
    return max(candidates, key=lambda c: (read_meta(c).step, c == final))


def resolve_resumable(path: str | Path) -> Path:
    """--resume PATH: a step checkpoint, or a run directory's newest one (final/ holds no
    optimizer state)."""
    p = Path(path)
    if p.is_dir() and not (p / "meta.json").is_file() and list_complete(RunDir(p).checkpoints):
        return list_complete(RunDir(p).checkpoints)[-1]
    ckpt = resolve(p)
    if not (ckpt / ".metadata").is_file():
        raise CheckpointError(
            f"{ckpt} is an export without optimizer state and cannot be resumed; pass a "
            "checkpoints/step_* directory"
        )
    return ckpt


def find_resume(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint a run into `run_dir` starts from, by `checkpoint.resume`: none (and the
    directory holds no checkpoint: a run never silently restarts over another), auto (the
    newest complete one, if any) or a path."""
    existing = list_complete(RunDir(run_dir).checkpoints)
    if resume == "none" and existing:
        raise ConfigError(
            f"{run_dir} already holds checkpoints (newest {existing[-1].name}); pass "
            "--resume auto to continue that run, or set --log.out_dir to a new directory"
        )
    if resume in ("none", "auto") and not existing:
        check_nothing_to_overwrite(RunDir(run_dir))
        return None
    return existing[-1] if resume == "auto" else resolve_resumable(resume)


def check_nothing_to_overwrite(run: RunDir) -> None:
    """A fresh start may not write over the final/ model of an earlier run whose checkpoints are
    gone. (A start killed before its first checkpoint left only metrics: those are dropped,
    logged, by trim_metrics.)"""
    if run.final.exists():
        raise ConfigError(f"{run.root} holds a finished run ({run.final.name}/) and no checkpoint "
                          "to resume from; set --log.out_dir to a new directory, or delete it to "
                          "start over")


def _step_or_none(ckpt_dir: Path) -> int | None:
    try:
        return read_meta(ckpt_dir).step
    except CheckpointError:
        return None


def abandon_newer(run_dir: Path, step: int, resumed: Path) -> Path | None:
    """Rank 0, before a run resumed from `resumed` (at `step`) writes anything: move aside, to
    checkpoints/abandoned/TIME_after_step_N/ (logged, never deleted), whatever the continued line
    would otherwise replace or mix with: the step checkpoints newer than `step` and a final/
    export past it. When `resumed` is not this run's own checkpoints/step_N (another branch's
    abandoned copy, another run's checkpoint), this run's step_N and its final/ belong to a
    different branch: they are moved aside too, so `--resume auto` and `--ckpt RUN` agree."""
    root = RunDir(run_dir).checkpoints
    own = root / step_dir_name(step)
    foreign = not own.is_dir() or own.resolve() != Path(resumed).resolve()
    moved = [c for c in list_complete(root)
             if int(STEP_DIR.match(c.name)[1]) > step - (1 if foreign else 0)]
    final = RunDir(run_dir).final
    final_step = _step_or_none(final) if (final / "meta.json").is_file() else None
    if final_step is not None and (foreign or final_step > step):
        moved.insert(0, final)  # first: a crash mid-move must not leave final/ as the newest
    if not moved:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = RunDir(run_dir).abandoned / f"{stamp}_after_{step_dir_name(step)}"
    n = 1
    while dest.exists():
        dest, n = dest.with_name(f"{stamp}_after_{step_dir_name(step)}_{n}"), n + 1
    dest.mkdir(parents=True)
    for c in moved:
        c.rename(dest / c.name)
    log.warning("resuming from %s (step %d), not the newest checkpoint of this run: moved %s to %s",
                resumed, step, ", ".join(c.name for c in moved), dest)
    return dest


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
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: CheckpointMeta,
    tokenizer_dir: Path,
    info: DistInfo,
    keep: int,
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory.
    (pipeline/checkpoint/async_writer.py runs the same three phases with the write in the background.)"""
    tmp, final = begin_save(run_dir, meta.step, info)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with single_process_ok():
        dcp.save(
            {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=not info.is_distributed
        )
    barrier(info)
    if info.is_main:
        finish_save(tmp, final, meta, tokenizer_dir, keep)
    barrier(info)
    return final


def begin_save(run_dir: Path, step: int, info: DistInfo) -> tuple[Path, Path]:
    """Collective: an empty NAME.tmp for the checkpoint of `step`, each rank's RNG states in it.
    Returns (tmp, final)."""
    root = RunDir(run_dir).checkpoints
    final = root / step_dir_name(step)
    tmp = root / (final.name + ".tmp")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(info)
    torch.save(_rng_state(), tmp / f"rng_rank{info.rank:05d}.pt")
    return tmp, final


def finish_save(tmp: Path, final: Path, meta: CheckpointMeta, tokenizer_dir: Path, keep: int) -> None:
    """Rank 0, once every rank's part of `tmp` is written: tokenizer, meta.json last, the rename
    that makes it complete, keep-K."""
    copy_plain_tree(tokenizer_dir, tmp / "tokenizer")
    _write_json(tmp / "meta.json", meta.to_json())
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _drop_oldest(final.parent, meta.lineage, keep)


def _drop_oldest(root: Path, lineage: str, keep: int) -> None:
    """keep-K over this run's line only: a checkpoint of another lineage (or unreadable) stays."""
    ours = [c for c in list_complete(root) if _lineage_or_none(c) == lineage]
    for old in ours[:-keep] if keep > 0 else []:
        # Renamed first, so a crash mid-delete never leaves a half-deleted step_* that looks complete.
        doomed = old.with_name(old.name + ".deleting")
        old.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def _lineage_or_none(ckpt_dir: Path) -> str | None:
    try:
        return read_meta(ckpt_dir).lineage
    except CheckpointError:
        return None


def check_same_model(meta: CheckpointMeta, model_cfg: ModelConfig, where: Path) -> None:
    theirs, ours = meta.model.to_dict(), model_cfg.to_dict()
    diff = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
    if diff:
        shown = ", ".join(f"{k}: checkpoint {a} vs config {b}" for k, (a, b) in sorted(diff.items()))
        raise CheckpointError(
            f"checkpoint {where} is from another model ({shown}); "
            "use the config it was trained with or start a new run directory"
        )


def read_resumable(ckpt_dir: Path, model_cfg: ModelConfig, optim_name: str,
                   data: DataConfig) -> CheckpointMeta:
    """The meta of a checkpoint to resume `model_cfg` from, refused with one line if it is of
    another model or data schedule (mixture weights, phases), holds another optimizer's state or
    none. Read before anything is built, so a refused resume costs nothing."""
    meta = read_meta(ckpt_dir)
    check_same_model(meta, model_cfg, ckpt_dir)
    check_same_schedule(meta.config.data, data, ckpt_dir)
    if meta.loader is None:
        raise CheckpointError(f"{ckpt_dir} holds no training state (an export); "
                              "resume from a checkpoints/step_* directory")
    if (theirs := meta.config.optim.name) != optim_name:
        raise CheckpointError(f"checkpoint {ckpt_dir} holds {theirs} optimizer state, this run "
                              f"asks for optim.name = {optim_name}; resume with --optim.name "
                              f"{theirs}, or start a new run directory")
    return meta


def load_training(
    ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo
) -> None:
    """Collective: restore model + optimizer (resharding as needed) and this rank's RNG from a
    checkpoint accepted by `read_resumable`."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with single_process_ok():
        load_into(state, ckpt_dir, no_dist=not info.is_distributed)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    rng_file = ckpt_dir / f"rng_rank{info.rank:05d}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than wrote the checkpoint
        try:
            _set_rng_state(torch.load(rng_file, weights_only=True))
        except Exception as e:  # weights_only refuses code; a wrong layout is just as bad
            raise refusal(rng_file, f"not an RNG state ({type(e).__name__})") from None


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
    out_dir: Path, state: dict[str, torch.Tensor], meta: CheckpointMeta, tokenizer_dir: Path
) -> Path:
    """Rank 0 only: write OUT/{model.safetensors, meta.json, tokenizer/} atomically."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.contiguous() for k, v in _drop_tied(state, meta.model).items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": FORMAT})
    copy_plain_tree(tokenizer_dir, tmp / "tokenizer")
    _write_json(tmp / "meta.json", meta.to_json())
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
