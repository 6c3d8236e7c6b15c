"""Typed training configs: TOML file in, dotted command-line overrides, one validation point.

Precedence is CLI > file > defaults:

    cfg = load_config("configs/tiny.toml", ["--train.max_steps", "100", "--optim.lr=1e-3"])

Every section is a dataclass and each component receives only its own section. Enumerated
settings are `Literal` types, so parsing checks them and error messages list the allowed values.
Anything a user can get wrong raises `ConfigError` with one line naming the key, the value and
the fix. An Optional field is unset by omitting it (TOML has no null) or by `--key none`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import sys
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from model.model import ModelConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(Exception):
    """A bad config file, override or value; the message is one line naming the fix."""


@dataclass
class DataConfig:
    path: str = "data/pystdlib"
    """Directory written by `lmforge prepare` (manifest.json and the shards)."""
    seq_len: int = 256
    """Tokens per training sequence; the loader reads windows of seq_len + 1 tokens."""


@dataclass
class TrainConfig:
    seed: int = 1337
    """Seeds the weights, the data order and sampling."""
    global_batch_tokens: int = 16384
    """Tokens per optimizer step over all ranks and micro-steps; fixes the optimisation, so the
    same config trains the same way on any number of processes."""
    micro_batch_size: int = 8
    """Sequences per rank per micro-step (forward/backward); trades memory for accumulation."""
    max_steps: int = 200
    """Optimizer steps of the whole run."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype; master weights and optimizer state stay fp32 either way."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the model; auto = on for CUDA only (a cold compile costs ~30 s on CPU)."""
    parallel: Literal["auto", "none", "ddp", "fsdp"] = "auto"
    """Data parallelism; auto = ddp when the world size is above 1, else none."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when available, else cpu."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass: less memory, ~1/3 more compute."""
    max_bad_steps: int = 3
    """Consecutive non-finite losses (each update skipped) before the run stops."""


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate, reached at the end of the warmup."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    warmup_steps: int = 20
    """Linear warmup from 0 to the peak."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """cosine: decay from the peak to the floor after warmup; wsd: warmup-stable-decay."""
    decay_fraction: float = 0.2
    """wsd only: the final fraction of the steps that decays linearly to the floor."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not norms or biases)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    fused: Literal["auto", "on", "off"] = "auto"
    """Fused AdamW kernel; auto = on where the device supports it."""


@dataclass
class EvalConfig:
    every: int = 50
    """Evaluate every N steps (and at the end); 0 = only at the end."""
    tokens: int = 32768
    """Size of the fixed eval set: the first N tokens of the val split (whole windows, at least
    one), identical whatever the world size."""
    batch_size: int = 8
    """Sequences per forward pass during evaluation, per rank."""


@dataclass
class SampleConfig:
    every: int = 100
    """Generate samples every N steps (and at the end); 0 = only at the end."""
    prompts: list[str] = field(default_factory=lambda: ["def ", "import "])
    """Prompts continued by rank 0 and logged."""
    max_new_tokens: int = 48
    temperature: float = 0.8
    """0 = greedy."""
    top_k: int = 50
    """Sample among the k most likely tokens; 0 = no top-k filter."""
    top_p: float | None = None
    """Nucleus sampling threshold in (0, 1]; unset = off."""


@dataclass
class CheckpointConfig:
    every: int = 100
    """Save every N steps (and always at the end); 0 = only at the end."""
    keep: int = 2
    """Keep the newest K checkpoints."""
    resume: str = "none"
    """none = start fresh; auto = newest complete checkpoint in the run dir, if any; or a path."""


@dataclass
class LogConfig:
    out_dir: str = "runs/tiny"
    """Run directory: config, metrics.jsonl, train.log, checkpoints, loss plot."""
    run_name: str | None = None
    """Name shown in wandb; unset = the run directory's name."""
    log_every: int = 10
    """Write a log line / metrics record every N steps."""
    wandb: Literal["online", "offline", "disabled"] = "disabled"
    """online needs an account and network; offline writes a local run to sync later."""
    wandb_project: str = "lmforge"


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)


# ----------------------------------------------------------------------------- schema

def _sections() -> dict[str, type]:
    return typing.get_type_hints(JobConfig)


def _fields(section_cls: type) -> dict[str, Any]:
    """Field name -> resolved type (the annotations are strings under `from __future__`)."""
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _all_keys() -> list[str]:
    return [f"{s}.{k}" for s, cls in _sections().items() for k in _fields(cls)]


def _unknown(name: str, candidates: list[str]) -> ConfigError:
    # A right key in the wrong section ('train.lr' -> 'optim.lr') beats a near spelling.
    leaf = name.rsplit(".", 1)[-1]
    close = [c for c in candidates if c.rsplit(".", 1)[-1] == leaf and "." in c][:1]
    close = close or difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    hint = f" — did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown key '{name}'{hint}")


# ----------------------------------------------------------------------------- values

def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp)) if typing.get_origin(tp) is None else str(tp)


def _bad(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"bad value for '{key}': {value!r} (expected {expected})")


def _parse_text(key: str, text: str, tp: Any) -> Any:
    """Turn a command-line string into a value of the field's type (checked by `_check`)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and text.strip().lower() in ("none", "null"):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _parse_text(key, text, inner)
    if origin is list:
        try:  # TOML array syntax, which also covers JSON's: '["def ", "import "]'
            return tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            raise _bad(key, text, 'a list such as ["a", "b"]') from None
    if tp is bool:
        lowered = text.strip().lower()
        if lowered not in ("true", "false", "1", "0"):
            raise _bad(key, text, "true | false | 1 | 0")
        return lowered in ("true", "1")
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            raise _bad(key, text, tp.__name__) from None
    return text  # str and Literal[str]: `_check` validates the choice


def _check(key: str, value: Any, tp: Any) -> Any:
    """Return `value` if it has type `tp` (an int is accepted for a float), else raise."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise _bad(key, value, f"one of {_type_name(tp)}")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(key, value, inner)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise _bad(key, value, f"a list of {_type_name(item)}")
        return [_check(key, v, item) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # bool is a subclass of int: `max_steps = true` must not pass as 1.
    if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
        raise _bad(key, value, _type_name(tp))
    return value


# ----------------------------------------------------------------------------- building

def config_from_dict(d: dict[str, Any]) -> JobConfig:
    """Build and validate a JobConfig from nested section dicts (a TOML file, a checkpoint).

    Missing sections and keys take their defaults; unknown ones are errors.
    """
    sections = _sections()
    built = {}
    for name, values in d.items():
        if name not in sections:
            raise _unknown(name, list(sections) + _all_keys())
        if not isinstance(values, dict):
            raise ConfigError(f"'{name}' must be a section ([{name}] in TOML), got {values!r}")
    for name, cls in sections.items():
        types_ = _fields(cls)
        kwargs = {}
        for key, value in d.get(name, {}).items():
            if key not in types_:
                raise _unknown(f"{name}.{key}", _all_keys())
            kwargs[key] = _check(f"{name}.{key}", value, types_[key])
        try:
            built[name] = cls(**kwargs)
        except ValueError as e:  # ModelConfig checks its own shapes, naming the keys
            raise ConfigError(str(e)) from None
    cfg = JobConfig(**built)
    validate(cfg)
    return cfg


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    """Nested plain dicts (ints, floats, strs, lists, None): safe to embed in a checkpoint."""
    return dataclasses.asdict(cfg)


def parse_overrides(overrides: list[str]) -> list[tuple[str, str]]:
    """['--a.b', '1', '--c.d=x'] -> [('a.b', '1'), ('c.d', 'x')]."""
    pairs, i = [], 0
    while i < len(overrides):
        arg = overrides[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument '{arg}' — overrides look like --section.key value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(overrides):
            key, value = arg[2:], overrides[i + 1]
            i += 2
        else:
            raise ConfigError(f"missing value for '{arg}' — write {arg} VALUE")
        pairs.append((key, value))
    return pairs


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> JobConfig:
    """Defaults, then the TOML file at `path` (if given), then the dotted overrides; validated."""
    d: dict[str, Any] = {}
    if path is not None:
        try:
            d = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file '{path}' not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from None
    sections = _sections()
    for key, text in parse_overrides(list(overrides)):
        section, _, name = key.partition(".")
        types_ = _fields(sections[section]) if section in sections else {}
        if name not in types_:
            raise _unknown(key, _all_keys())
        d.setdefault(section, {})[name] = _parse_text(key, text, types_[name])
    return config_from_dict(d)


# ----------------------------------------------------------------------------- validation

def validate(cfg: JobConfig) -> None:
    """The one place where ranges and cross-field rules are checked (types are checked on input)."""

    def need(ok: bool, key: str, expected: str) -> None:
        section, name = key.split(".")
        if not ok:
            raise _bad(key, getattr(getattr(cfg, section), name), expected)

    m, d, t, o, e, s, c, lg = (cfg.model, cfg.data, cfg.train, cfg.optim, cfg.eval, cfg.sample,
                               cfg.checkpoint, cfg.log)
    need(d.path != "", "data.path", "the directory written by `lmforge prepare`")
    need(d.seq_len >= 1, "data.seq_len", ">= 1")
    need(d.seq_len <= m.max_seq_len, "data.seq_len", f"<= model.max_seq_len ({m.max_seq_len})")
    need(t.seed >= 0, "train.seed", ">= 0")
    need(t.global_batch_tokens >= 1, "train.global_batch_tokens", ">= 1")
    need(t.micro_batch_size >= 1, "train.micro_batch_size", ">= 1")
    need(t.max_steps >= 1, "train.max_steps", ">= 1")
    need(t.max_bad_steps >= 1, "train.max_bad_steps", ">= 1")
    need(o.lr > 0 and math.isfinite(o.lr), "optim.lr", "a finite number > 0")
    need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "between 0 and 1")
    need(o.warmup_steps >= 0, "optim.warmup_steps", ">= 0")
    need(0 < o.decay_fraction <= 1, "optim.decay_fraction", "in (0, 1]")
    need(0 <= o.weight_decay < math.inf, "optim.weight_decay", ">= 0")
    need(0 <= o.beta1 < 1, "optim.beta1", "in [0, 1)")
    need(0 <= o.beta2 < 1, "optim.beta2", "in [0, 1)")
    need(0 < o.eps < 1, "optim.eps", "a small number > 0, e.g. 1e-8")
    need(0 <= o.grad_clip < math.inf, "optim.grad_clip", ">= 0; 0 disables clipping")
    need(e.every >= 0, "eval.every", ">= 0; 0 = only at the end")
    need(e.tokens >= 1, "eval.tokens", ">= 1")
    need(e.batch_size >= 1, "eval.batch_size", ">= 1")
    need(s.every >= 0, "sample.every", ">= 0; 0 = only at the end")
    need(s.max_new_tokens >= 1, "sample.max_new_tokens", ">= 1")
    need(0 <= s.temperature < math.inf, "sample.temperature", ">= 0; 0 = greedy")
    need(s.top_k >= 0, "sample.top_k", ">= 0; 0 = off")
    need(s.top_p is None or 0 < s.top_p <= 1, "sample.top_p", "in (0, 1], or none")
    need(c.every >= 0, "checkpoint.every", ">= 0; 0 = only at the end")
    need(c.keep >= 1, "checkpoint.keep", ">= 1")
    need(c.resume != "", "checkpoint.resume", "none | auto | a checkpoint path")
    need(lg.out_dir != "", "log.out_dir", "a directory path")
    need(lg.log_every >= 1, "log.log_every", ">= 1")
    need(lg.wandb_project != "", "log.wandb_project", "a project name")


# ----------------------------------------------------------------------------- derived numbers

@dataclass(frozen=True)
class Derived:
    """Training quantities that follow from the config and the world size."""

    world_size: int
    tokens_per_micro_step: int  # per rank: micro_batch_size * seq_len
    grad_accum_steps: int  # micro-steps per optimizer step on each rank
    sequences_per_step: int  # over all ranks and micro-steps
    total_tokens: int  # max_steps * global_batch_tokens


def derive(cfg: JobConfig, world_size: int) -> Derived:
    """Gradient accumulation from the fixed global batch; an error if it does not divide."""
    t, seq_len = cfg.train, cfg.data.seq_len
    per_micro = t.micro_batch_size * seq_len
    per_round = per_micro * world_size  # tokens of one micro-step over all ranks
    if t.global_batch_tokens % per_round:
        lo = t.global_batch_tokens // per_round * per_round
        fits = [str(v) for v in (lo, lo + per_round) if v > 0]
        mbs = [str(b) for b in range(1, 4 * t.micro_batch_size + 1)
               if t.global_batch_tokens % (b * seq_len * world_size) == 0]
        raise ConfigError(
            f"train.global_batch_tokens={t.global_batch_tokens} is not divisible by "
            f"micro_batch_size*seq_len*world_size = {t.micro_batch_size}*{seq_len}*{world_size}"
            f" = {per_round}; set train.global_batch_tokens to {' or '.join(fits)}"
            + (f", or train.micro_batch_size to one of {', '.join(mbs)}" if mbs else "")
        )
    accum = t.global_batch_tokens // per_round
    return Derived(
        world_size=world_size,
        tokens_per_micro_step=per_micro,
        grad_accum_steps=accum,
        sequences_per_step=t.global_batch_tokens // seq_len,
        total_tokens=t.max_steps * t.global_batch_tokens,
    )


def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:g}"


def describe(cfg: JobConfig, derived: Derived, n_params: int) -> str:
    """The start-of-run summary: why each training number is what it is."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    vocab = m.vocab_size or "from data"
    if o.schedule == "cosine":
        decay = f"cosine to {o.lr * o.min_lr_ratio:.3g}"
    else:
        decay_steps = round(o.decay_fraction * t.max_steps)
        decay = f"stable, then linear decay over the last {decay_steps} steps to {o.lr * o.min_lr_ratio:.3g}"
    return "\n".join([
        f"model:     {_human(n_params)} params ({m.n_layer} layers, d_model {m.d_model}, "
        f"{m.n_head} heads / {m.n_kv_head} kv heads, vocab {vocab}, context {m.max_seq_len})",
        f"batch:     {t.global_batch_tokens:,} tokens/step = {t.micro_batch_size} seqs x "
        f"{cfg.data.seq_len} tokens x {derived.world_size} ranks x {derived.grad_accum_steps} "
        f"accumulation steps ({derived.sequences_per_step} sequences/step)",
        f"training:  {t.max_steps:,} steps x {t.global_batch_tokens:,} tokens = "
        f"{_human(derived.total_tokens)} tokens ({derived.total_tokens / max(n_params, 1):.2f} "
        f"tokens/param; Chinchilla-optimal is ~20)",
        f"lr:        peak {o.lr:g} after {o.warmup_steps} warmup steps, {decay}",
        f"numerics:  {t.dtype} compute (fp32 master weights), compile {t.compile}, "
        f"parallel {t.parallel}, device {t.device}",
    ])


# ----------------------------------------------------------------------------- writing

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr round-trips floats exactly and is valid TOML
    if isinstance(value, str):
        # A JSON string is a TOML basic string except for DEL, which TOML wants escaped.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML that `load_config` reads back to an equal JobConfig."""
    lines = ["# Resolved lmforge config (defaults < file < overrides). Reload with --config."]
    for section, values in config_to_dict(cfg).items():
        lines += ["", f"[{section}]"]
        for key, value in values.items():
            # TOML has no null; every Optional field defaults to None, so omitting it round-trips.
            lines.append(f"# {key} unset" if value is None else f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def save_resolved(cfg: JobConfig, run_dir: str | os.PathLike) -> Path:
    """Write run_dir/config.toml (via a temporary file, so a crash never leaves half of one)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path, tmp = run_dir / "config.toml", run_dir / "config.toml.tmp"
    tmp.write_text(to_toml(cfg))
    tmp.replace(path)
    return path
