"""The checkpoint format: defined here once, versioned, validated on read.

RUN/checkpoints/step_00000100/ (run_dir.py) holds meta.json (CheckpointMeta, written last),
the model and optimizer as torch.distributed.checkpoint (DCP: FSDP-sharded, reshardable to any
number of ranks), each rank's rng_rank*.pt and tokenizer/; RUN/final/, the consolidated export
for eval / sample / export, holds meta.json, model.safetensors and tokenizer/. Every checkpoint
carries its tokenizer, so one directory is enough to evaluate or sample.

A checkpoint is written as NAME.tmp and renamed once every rank is done and meta.json is in
place: a crash mid-save never leaves a directory that looks complete. Resuming from an older
checkpoint than the newest (a rollback) moves the newer ones aside into checkpoints/abandoned/,
so keep-K, `--resume auto` and `--ckpt RUN` never pick the abandoned branch. Opening someone
else's checkpoint can neither run code nor read outside it: DCP through safe_dcp, tensors and
RNG states with weights_only=True, meta.json as typed JSON, no file copied through a symlink.
"""

from __future__ import annotations

import io
import json
import os
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

from lmforge.data_prep.safe_files import check_dir, check_file, check_tree, read_bytes, read_text
from lmforge.data_prep.shards import copy_plain_tree
from lmforge.model import ModelConfig
from lmforge.pipeline.checkpoint.run_dir import RunDir
from lmforge.pipeline.checkpoint.safe_dcp import (
    CheckpointError,
    load_into,
    refusal,
    single_process_ok,
)
from lmforge.pipeline.config import (
    ConfigError,
    JobConfig,
    OptimConfig,
    config_from_dict,
    config_to_dict,
)
from lmforge.pipeline.data.config import DataConfig, check_same_schedule
from lmforge.pipeline.metrics import get_logger
from lmforge.pipeline.parallel.distributed import DistInfo, barrier

FORMAT = "lmforge-checkpoint"
# 2: typed CheckpointMeta with lineage; the unread "parallel" key dropped. 3: optim.lr is the
# matrices' lr under both optimizers, one optimizer group per lr group (pipeline/optim/lrs.py).
VERSION = 3
READS = (2, 3)  # a version 2 checkpoint evaluates, samples and exports; its resume is refused
# Config keys checkpoints hold that today's config lacks: not read (eval, sample and export never
# needed them; a resume runs by the config it is given). Version 2's optim section is of the old
# lr keys (optim.muon_lr): its resume is refused before it would be read.
UNREAD = {2: {"optim": None, "train": {"time_budget_s"}}, 3: {"train": {"time_budget_s"}}}
STEP_DIR = re.compile(r"^step_(\d{8})$")
MAX_META_BYTES = 1 << 26  # a meta.json is kilobytes: its config, loader cursors and last record
MAX_RNG_BYTES = 1 << 24  # torch's and each CUDA device's generator states

log = get_logger()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


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
    # The Hugging Face model the line started from (checkpoint.init_from): its path and each
    # weights file's sha256; None for a random start.
    source: dict | None = None
    version: int = VERSION  # the format it was read as; only VERSION is ever written

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "step": self.step,
                "model": self.model.to_dict(), "config": config_to_dict(self.config),
                "lineage": self.lineage, "parent_step": self.parent_step,
                "world_size": self.world_size, "bad_steps": self.bad_steps, "loader": self.loader,
                "record": self.record, "source": self.source}

    @classmethod
    def from_json(cls, d: dict, where: Path) -> CheckpointMeta:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, dict) else d
            raise CheckpointError(f"{where} is not an lmforge checkpoint (format={found!r})")
        if (version := d.get("version")) not in READS:
            raise CheckpointError(f"{where} has checkpoint format version {version}, "
                                  f"this lmforge reads versions {', '.join(map(str, READS))}; use the lmforge "
                                  "version that wrote it")
        try:
            config = _readable(_typed(d["config"], dict), UNREAD[version])
            return cls(
                step=_count(d["step"]), model=ModelConfig.from_dict(d["model"]),
                config=config_from_dict(config), lineage=_typed(d["lineage"], str),
                parent_step=None if d["parent_step"] is None else _count(d["parent_step"]),
                world_size=_count(d["world_size"]), bad_steps=_count(d["bad_steps"]),
                loader=_typed(d["loader"], dict | None), record=_record(d.get("record")),
                source=_typed(d.get("source"), dict | None), version=version,
            )
        except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as e:
            raise CheckpointError(f"{where}/meta.json is invalid ({type(e).__name__}: {e}); use "
                                  "another checkpoint") from None


def _readable(config: dict, unread: dict) -> dict:
    """`config` without the sections (None) and keys `unread` names."""
    return {name: {k: v for k, v in section.items() if k not in unread[name]}
            if name in unread and isinstance(section, dict) else section
            for name, section in config.items() if name not in unread or unread[name] is not None}


def _typed(value, kind):
    if not isinstance(value, kind):
        raise TypeError(f"{value!r:.60} where the format has {kind}")
    return value


def _count(value) -> int:
    if type(value) is not int or value < 0:
        raise TypeError(f"{value!r:.60} where the format has a count (an int >= 0)")
    return value


def _record(record):
    """A step's training record: names (never `step` or `time`, which the metrics line adds) of
    numbers, strings, null or lists of them."""
    scalar = int | float | str | None
    for key, value in _typed(record, dict | None).items() if record else ():
        if key in ("step", "time") or not isinstance(value, scalar | list) or \
                isinstance(value, list) and not all(isinstance(v, scalar) for v in value):
            raise TypeError(f"record entry {key!r}: {value!r:.60}")
    return record


def new_lineage() -> str:
    return uuid.uuid4().hex[:12]


def list_complete(ckpt_root: Path) -> list[Path]:
    """Complete step checkpoints under RUN/checkpoints, oldest first; safe_files.UnsafeFile for a
    step directory or meta.json that is a link or not what the format says (never skipped: a
    skipped one would make `--resume auto` start over)."""
    if not ckpt_root.is_dir():
        return []
    steps = [p for p in ckpt_root.iterdir() if STEP_DIR.match(p.name)]
    for p in steps:
        check_dir(p, what="checkpoint")
    return sorted(p for p in steps if check_file(p / "meta.json", what="checkpoint meta.json"))


def read_meta(ckpt_dir: Path) -> CheckpointMeta:
    """The meta of a checkpoint whose every file is a regular file or directory (check_tree)."""
    meta_path = ckpt_dir / "meta.json"
    if not meta_path.exists() and not meta_path.is_symlink():
        raise CheckpointError(f"{ckpt_dir} is not a complete lmforge checkpoint (no meta.json); "
                              "pass a run directory, a checkpoints/step_* directory or a final/ "
                              "export")
    check_tree(ckpt_dir, what="checkpoint")
    try:
        d = json.loads(read_text(meta_path, MAX_META_BYTES, what="checkpoint meta.json"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path} is corrupt ({e}); use another checkpoint") from None
    return CheckpointMeta.from_json(d, ckpt_dir)


def _has_meta(ckpt_dir: Path) -> bool:
    """A meta.json of any kind is there (read_meta refuses one that is not a regular file)."""
    return os.path.lexists(ckpt_dir / "meta.json")


def resolve(path: str | Path) -> Path:
    """A run directory, a step directory, a final/ directory or a model.safetensors file -> the
    checkpoint directory to read (for a run directory: the newest complete one, final/ on a tie;
    a rollback has moved any abandoned newer ones out of the way)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist; pass a run directory or a checkpoint")
    p = p.resolve()  # the path the user named may be a link; nothing inside it is followed
    if p.is_file():
        p = p.parent
    if _has_meta(p):
        return p
    candidates = list_complete(RunDir(p).checkpoints)
    final = RunDir(p).final
    if _has_meta(final):
        candidates.append(final)
    if not candidates:
        raise CheckpointError(f"no complete checkpoint in {p} (expected meta.json, "
                              "checkpoints/step_*/ or final/)")
    return max(candidates, key=lambda c: (read_meta(c).step, c == final))


def find_resume(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint a run into `run_dir` starts from, by `checkpoint.resume`: none (and the
    directory holds no checkpoint: a run never silently restarts over another), auto (the
    newest complete one, if any) or a path (a step checkpoint, or a run directory's newest one:
    final/ holds no optimizer state)."""
    existing = list_complete(RunDir(run_dir).checkpoints)
    if resume == "none" and existing:
        raise ConfigError(f"{run_dir} already holds checkpoints (newest {existing[-1].name}); "
                          "pass --resume auto to continue that run, or set --log.out_dir to a "
                          "new directory")
    if resume in ("none", "auto") and not existing:
        # Nor over the final/ model of an earlier run whose checkpoints are gone (the metrics of
        # a start killed before its first checkpoint are dropped, logged, by trim_metrics).
        if RunDir(run_dir).final.exists():
            raise ConfigError(f"{run_dir} holds a finished run (final/) and no checkpoint to "
                              "resume from; set --log.out_dir to a new directory, or delete it "
                              "to start over")
        return None
    if resume == "auto":
        return existing[-1]
    steps = list_complete(RunDir(resume).checkpoints)
    ckpt = steps[-1] if steps and not _has_meta(Path(resume)) else resolve(resume)
    if not check_file(ckpt / ".metadata", what="checkpoint .metadata"):
        raise CheckpointError(f"{ckpt} is an export without optimizer state and cannot be "
                              "resumed; pass a checkpoints/step_* directory")
    return ckpt


def _meta_or_none(ckpt_dir: Path) -> CheckpointMeta | None:
    try:
        return read_meta(ckpt_dir)
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
    final_meta = _meta_or_none(final)
    if final_meta is not None and (foreign or final_meta.step > step):
        moved.insert(0, final)  # first: a crash mid-move must not leave final/ as the newest
    if not moved:
        return None
    dest = _move_aside(run_dir, step, moved)
    log.warning("resuming from %s (step %d), not the newest checkpoint of this run: moved %s to %s",
                resumed, step, ", ".join(c.name for c in moved), dest)
    return dest


def abandon_history(run_dir: Path) -> Path | None:
    """Rank 0, at a fresh start (nothing resumed) into a directory whose metrics.jsonl holds an
    earlier start's records (killed before its first checkpoint: nothing continues them): that
    file and its config.toml moved aside like an abandoned branch (logged, never deleted), so a
    fresh start never writes over a run, and `--resume auto` after such a kill still starts."""
    run = RunDir(run_dir)
    if not check_file(run.metrics, what="run file", writing=True) or not run.metrics.stat().st_size:
        return None
    moved = [p for p in (run.metrics, run.config) if p.exists()]
    dest = _move_aside(run_dir, 0, moved)
    log.warning("%s holds the records of an earlier start that left no checkpoint; this is a "
                "fresh start: moved %s to %s", run_dir, ", ".join(p.name for p in moved), dest)
    return dest


def _move_aside(run_dir: Path, step: int, paths: list[Path]) -> Path:
    """`paths` renamed into a new checkpoints/abandoned/TIME_after_step_N/."""
    name = f"{time.strftime('%Y%m%d-%H%M%S')}_after_{step_dir_name(step)}"
    dest, n = RunDir(run_dir).abandoned / name, 1
    while dest.exists():
        dest, n = dest.with_name(f"{name}_{n}"), n + 1
    dest.mkdir(parents=True)
    for p in paths:
        p.rename(dest / p.name)
    return dest


def save_training(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                  meta: CheckpointMeta, tokenizer_dir: Path, info: DistInfo, keep: int) -> Path:
    """Collective: the checkpoint of meta.step; returns its directory. (async_writer.py runs the
    same three phases with the write in the background.)"""
    tmp, final = begin_save(run_dir, meta.step, info)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with single_process_ok():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                 no_dist=not info.is_distributed)
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
    # Only torch's generators: the loader and sampler use their own seeded generators, and
    # tensors alone keep the file loadable with weights_only=True.
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / f"rng_rank{info.rank:05d}.pt")
    return tmp, final


def finish_save(tmp: Path, final: Path, meta: CheckpointMeta, tokenizer_dir: Path,
                keep: int) -> None:
    """Rank 0, once every rank's part of `tmp` is written: complete it, then keep-K."""
    _complete(tmp, final, meta, tokenizer_dir)
    _drop_oldest(final.parent, meta.lineage, keep)


def _complete(tmp: Path, final: Path, meta: CheckpointMeta, tokenizer_dir: Path) -> None:
    """The tokenizer, meta.json last, then the rename that makes `final` complete."""
    copy_plain_tree(tokenizer_dir, tmp / "tokenizer")
    (tmp / "meta.json").write_text(json.dumps(meta.to_json(), indent=2, sort_keys=True) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def _drop_oldest(root: Path, lineage: str, keep: int) -> None:
    """keep-K over this run's line only: a checkpoint of another lineage (or unreadable) stays."""
    ours = [c for c in list_complete(root) if (m := _meta_or_none(c)) and m.lineage == lineage]
    for old in ours[:-keep] if keep > 0 else []:
        # Renamed first, so a crash mid-delete never leaves a half-deleted step_* that looks complete.
        doomed = old.with_name(old.name + ".deleting")
        old.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def read_resumable(ckpt_dir: Path, model_cfg: ModelConfig, optim: OptimConfig,
                   data: DataConfig) -> CheckpointMeta:
    """The meta of a checkpoint to resume `model_cfg` from, refused with one line if it is of
    another model or data schedule (mixture weights, phases), holds another optimizer's state or
    none. Read before anything is built, so a refused resume costs nothing."""
    meta = read_meta(ckpt_dir)
    if meta.version != VERSION:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} is of format {meta.version}, written when optim.lr meant the "
            "AdamW groups' lr under muon: its optimizer state has other groups than this lmforge "
            "builds, so it cannot be resumed here; finish the run with the lmforge that started "
            "it, or start a new run directory (eval, sample and export still read it)")
    theirs, ours = meta.model.to_dict(), model_cfg.to_dict()
    if diff := sorted(k for k, v in ours.items() if theirs.get(k) != v):
        shown = ", ".join(f"{k}: checkpoint {theirs.get(k)} vs config {ours[k]}" for k in diff)
        raise CheckpointError(f"checkpoint {ckpt_dir} is from another model ({shown}); use the "
                              "config it was trained with or start a new run directory")
    check_same_schedule(meta.config.data, data, ckpt_dir)
    if meta.loader is None:
        raise CheckpointError(f"{ckpt_dir} holds no training state (an export); "
                              "resume from a checkpoints/step_* directory")
    if (theirs := meta.config.optim.name) != optim.name:
        raise CheckpointError(f"checkpoint {ckpt_dir} holds {theirs} optimizer state, this run "
                              f"asks for optim.name = {optim.name}; resume with --optim.name "
                              f"{theirs}, or start a new run directory")
    return meta


def load_training(ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                  info: DistInfo) -> None:
    """Collective: restore model + optimizer (resharding as needed) and this rank's RNG from a
    checkpoint accepted by `read_resumable`. Every rank that wrote it saved its RNG state: one
    missing is refused before any weight is read (a rank beyond them draws afresh)."""
    rng_file = ckpt_dir / f"rng_rank{info.rank:05d}.pt"
    if not check_file(rng_file, what="checkpoint RNG state") and \
            info.rank < read_meta(ckpt_dir).world_size:
        raise refusal(rng_file, "it is missing, and every rank that wrote the checkpoint saved "
                                "one")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with single_process_ok():
        load_into(state, ckpt_dir, no_dist=not info.is_distributed)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    if rng_file.exists():
        data = read_bytes(rng_file, MAX_RNG_BYTES, what="checkpoint RNG state")
        try:
            rng = torch.load(io.BytesIO(data), weights_only=True)
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        except Exception as e:  # weights_only refuses code; a wrong layout is just as bad
            raise refusal(rng_file, f"not an RNG state ({type(e).__name__})") from None


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded fp32 weights on CPU (meaningful on rank 0)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def save_consolidated(out_dir: Path, state: dict[str, torch.Tensor], meta: CheckpointMeta,
                      tokenizer_dir: Path) -> Path:
    """Rank 0 only: write OUT/{model.safetensors, meta.json, tokenizer/} atomically."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # safetensors refuses aliased tensors; the tied head is rebuilt from the embedding on load.
    tied = meta.model.tie_embeddings
    tensors = {k: v.contiguous() for k, v in state.items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": FORMAT})
    _complete(tmp, out_dir, meta, tokenizer_dir)
    return out_dir
