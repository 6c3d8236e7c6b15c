"""Typed training configs: TOML file in, dotted command-line overrides (CLI > file > defaults),
one validation point. Each component receives only its own section (a dataclass):

    cfg = load_config("configs/tiny.toml", ["--train.max_steps", "100", "--optim.lr=1e-3"])
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lmforge.data_prep.safe_files import read_text, user_path
from lmforge.data_prep.shards import atomic_write_bytes
from lmforge.model.generate import SamplingError, SamplingParams
from lmforge.model.model import ModelConfig
from lmforge.pipeline.checkpoint.hf_init import init_from_model
from lmforge.pipeline.checkpoint.run_dir import RunDir
from lmforge.pipeline.data.config import DATA_KEYS, DataConfig, validate_data
from lmforge.pipeline.optim.lrs import GROUPS, check_lrs_given, peak_lrs, width_factor
from lmforge.pipeline.typed_config import ConfigError, apply_overrides, from_dict, parse_overrides
from lmforge.pipeline.typed_config import bad_value as _bad

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

@dataclass
class TrainConfig:
    seed: int = 1337
    """Seeds the weights, the data order and sampling: 0 <= seed < 2^64 (torch's generators)."""
    global_batch_tokens: int = 16384
    """Tokens per optimizer step over all ranks and micro-steps, whatever the process count."""
    micro_batch_size: int = 8
    """Sequences per rank per micro-step (forward/backward); trades memory for accumulation."""
    max_steps: int = 200
    """Optimizer steps of the whole run."""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype (weights and optimizer state stay fp32). auto = bf16 on GPUs with bf16 tensor
    cores and CPUs with AVX512-BF16/AMX (LMFORGE_CPU_BF16=native|emulated overrides), else fp32."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the forward with its loss; auto = on for CUDA, off for CPU (a cold CPU
    compile costs more than a demo-sized run gains). Kept on resume, as attention and loss."""
    attention: Literal["auto", "sdpa", "eager"] = "auto"
    """sdpa (flash, O(T) memory) or eager (matmul, softmax, matmul by causal query blocks). auto =
    sdpa, except eager on a CPU in bf16 at data.seq_len <= 512, where CPU flash is slow."""
    loss: Literal["auto", "full", "chunked"] = "auto"
    """LM-head loss: full (whole logits + F.cross_entropy) or chunked (memory O(chunk x vocab)).
    auto = full on CUDA unless a micro-batch's logits pass 2^30 elements, chunked on CPU."""
    parallel: Literal["auto", "none", "ddp", "fsdp"] = "auto"
    """Data parallelism; auto = ddp when the world size is above 1, else none."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when available, else cpu."""
    ddp_bucket_mb: float = 25.0
    """DDP's gradient bucket in MiB (torch's default): each bucket's all-reduce overlaps the rest
    of the backward; compiled, the model is split into one graph region per bucket."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass: less memory, ~1/3 more compute."""
    max_bad_steps: int = 3
    """Consecutive non-finite losses (each update skipped) before the run stops."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW for every parameter. muon: Muon for the blocks' weight matrices, AdamW for the
    embedding table(s), the LM head and the norms' gains. Each group's lr has one key, the same
    under both: lr (matrices), embed_lr, head_lr, scalar_lr (README "Learning rates")."""
    lr: float = 3e-3
    """Peak lr of the weight matrices (Muon's under muon, AdamW's under adamw), reached at the end
    of the warmup; Muon's optimum is ~0.03 at d_model 128-512 (configs/tiny.toml), AdamW's 3e-3
    the default (not swept)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    warmup_steps: int = 20
    """Linear warmup from 0 to the peak."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """cosine: decay from the peak to the floor after warmup; wsd: warmup-stable-decay."""
    decay_fraction: float = 0.2
    """wsd only: the final fraction of the steps that decays linearly to the floor."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay: of the tables and the head, and under adamw also of the
    matrices (never of the norms' gains; Muon's matrices have muon_weight_decay)."""
    embed_lr: float = 0.0
    """Peak lr of the token (tied: also the head's) and value embedding tables, AdamW; 0 = lr. A
    lookup table takes a far larger lr than an untied head (nanochat, modded-nanogpt)."""
    head_lr: float = 0.0
    """Peak lr of an untied LM head, AdamW; 0 = lr. Needs model.tie_embeddings = false."""
    scalar_lr: float = 0.0
    """Peak lr of the 1-D gains (the RMSNorm weights), AdamW, no weight decay; 0 = lr."""
    lr_ref_width: int = 0
    """0 = every lr as given. Else the lrs are given at d_model = lr_ref_width and each group's is
    scaled to the model's width by (d_model / lr_ref_width) ** its exponent (pipeline/optim/lrs.py:
    measured from d_model 128 to 512: under Muon matrices 0, tables, an untied head and gains -0.5;
    under AdamW muP's: matrices and an untied head -1, tables and gains 0)."""
    beta1: float = 0.9
    """AdamW's first-moment decay (the momentum of the update)."""
    beta2: float = 0.95
    """AdamW's second-moment decay; 0.95 rather than 0.999 keeps the large-batch LM runs stable."""
    eps: float = 1e-8
    """AdamW's denominator floor."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    fused: Literal["auto", "on", "off"] = "auto"
    """Fused AdamW kernel (one pass per parameter); auto = on CUDA and CPU, where torch has it."""
    muon_momentum: float = 0.95
    """muon: momentum after its warmup (Muon's, modded-nanogpt's and nanochat's 0.95)."""
    muon_momentum_start: float = 0.85
    """muon: momentum at step 0, raised linearly to muon_momentum (modded-nanogpt, nanochat)."""
    muon_momentum_warmup_steps: int = 50
    """muon: steps of the momentum warmup; 0 = muon_momentum from the start."""
    muon_nesterov: bool = True
    """muon: Nesterov momentum (the Muon default)."""
    muon_weight_decay: float = 0.0
    """muon: decoupled weight decay of the matrices (as in modded-nanogpt and nanochat's short runs)."""


@dataclass
class EvalConfig:
    every: int = 50
    """Evaluate every N steps (and at the end); 0 = only at the end."""
    tokens: int = 32768
    """Size of the fixed eval set: the first N tokens of the val split (whole windows, at least
    one), identical whatever the world size."""
    batch_size: int = 8
    """Sequences per forward pass during evaluation, per rank."""
    tasks: list[str] = field(default_factory=list)
    """Downstream multiple-choice tasks scored during training (as `lmforge eval --tasks`: named
    ones like hellaswag, nextline from data.path's val split, or FILE.jsonl); [] = none."""
    tasks_every: int = 0
    """Score eval.tasks every N steps (and at the end); 0 = only at the end."""
    tasks_max_examples: int = 500
    """Examples of each task scored in the loop (its first N); 0 = all of them."""


@dataclass
class SampleConfig:
    every: int = 100
    """Generate samples every N steps (and at the end); 0 = only at the end."""
    prompts: list[str] = field(default_factory=lambda: ["def ", "import "])
    """Prompts continued by rank 0 and logged; [] = no samples. Each must leave room for new
    tokens in model.max_seq_len (checked before step 1)."""
    max_new_tokens: int = 48
    """At most this many tokens per sample (cut to what the longest prompt leaves)."""
    # Defaults and ranges of these three are SamplingParams' (model/generate.py).
    temperature: float = SamplingParams.temperature
    """0 = greedy."""
    top_k: int = SamplingParams.top_k
    """Sample among the k most likely tokens; 0 = no top-k filter."""
    top_p: float | None = SamplingParams.top_p
    """Nucleus sampling threshold in (0, 1]; unset = off."""

    def params(self, seed: int | None = None) -> SamplingParams:
        """This section as validated SamplingParams (SamplingError names a bad field)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, seed=seed)


@dataclass
class CheckpointConfig:
    every: int = 100
    """Save every N steps (and always at the end); 0 = only at the end."""
    keep: int = 2
    """Keep the newest K checkpoints."""
    resume: str = "none"
    """none = start fresh; auto = newest complete checkpoint in the run dir, if any; or a path."""
    init_from: str = ""
    """A Hugging Face Llama / Qwen3 directory (config.json + safetensors) to start from: the
    model is config.json's (it replaces [model]), its weights load at step 0 with a fresh
    optimizer. "" = random initialisation."""
    async_save: bool = True
    """Write checkpoints in the background: the saving step only copies the state to host memory
    (it stalls less: bench/results/checkpoint_stall_avx512.txt); the checkpoint completes (renamed,
    meta.json) at a later step, and the last step and SIGTERM wait for it."""


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
    """The wandb project the run is logged to (with log.wandb on)."""


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


# ----------------------------------------------------------------------------- building

def config_from_dict(d: dict[str, Any]) -> JobConfig:
    """A validated JobConfig from nested section dicts (a TOML file, a checkpoint)."""
    cfg = from_dict(JobConfig, d)
    validate(cfg)
    return cfg


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    """Nested plain dicts (ints, floats, strs, lists, None): safe to embed in a checkpoint."""
    return dataclasses.asdict(cfg)


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> JobConfig:
    """Defaults, then the TOML file at `path` (if given), then the dotted overrides; validated."""
    d: dict[str, Any] = {}
    if path is not None:
        try:
            d = tomllib.loads(read_text(user_path(path), MAX_CONFIG_BYTES, what="config file"))
        except FileNotFoundError:
            raise ConfigError(f"config file '{path}' not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from None
        except (OSError, UnicodeDecodeError) as e:  # a directory, a permission, binary bytes
            raise ConfigError(f"cannot read config file '{path}' ({e}); give a TOML file") from None
    _refuse_gone_keys(d, overrides)
    from_dict(JobConfig, d)  # the file's types first: init_from and the data keys are read below
    named = dict(parse_overrides(list(overrides)))
    # The data named on the command line replaces the file's, whichever way each names it.
    if named.keys() & {f"data.{k}" for k in DATA_KEYS}:
        for key in DATA_KEYS:
            if f"data.{key}" not in named:
                d.get("data", {}).pop(key, None)
    file_optim = dict(d.get("optim", {}))
    d, overrides = init_from_model(d, list(overrides))  # [model] from its config.json
    cfg = config_from_dict(apply_overrides(JobConfig, d, overrides))
    check_lrs_given(cfg.optim, file_optim, named, path, OptimConfig.name)
    return cfg


# Keys a past lmforge read: nothing translates them, the error names what says the same today.
MAX_CONFIG_BYTES = 1 << 24  # a TOML of settings; a larger file is not a config

GONE_KEYS = {
    "optim.muon_lr": "Muon's lr is optim.lr under optim.name = muon (optim.lr is the matrices' lr "
                     "under both optimizers); the AdamW groups' are optim.embed_lr, head_lr, scalar_lr",
    "train.time_budget_s": "set the run's length with train.max_steps (`lmforge demo --minutes M` "
                           "times a few steps first and passes it)",
}


def _refuse_gone_keys(d: dict[str, Any], overrides: Sequence[str]) -> None:
    given = [f"{s}.{k}" for s, section in d.items() if isinstance(section, dict) for k in section]
    for key in [*given, *(k for k, _ in parse_overrides(list(overrides)))]:
        if key in GONE_KEYS:
            raise ConfigError(f"'{key}' is gone: {GONE_KEYS[key]}")


def wsd_decay_steps(max_steps: int, o: OptimConfig) -> int:
    """WSD's decay window: the last decay_fraction of the run (one step at least), after the
    warmup: a window reaching into the warmup would drop the lr from a peak never reached."""
    return min(max(1, round(o.decay_fraction * max_steps)), max(0, max_steps - o.warmup_steps))


# ----------------------------------------------------------------------------- validation

def validate(cfg: JobConfig) -> None:
    """The one place where ranges and cross-field rules are checked (types are checked on input)."""
    flat = {f"{name}.{k}": v for name, section in dataclasses.asdict(cfg).items()
            for k, v in section.items()}

    def need(ok: bool, key: str, expected: str) -> None:
        if not ok:
            raise _bad(key, flat[key], expected)

    # Every float is finite first: a NaN fails no `<`, and no range below need exclude inf.
    for key, value in flat.items():
        need(not isinstance(value, float) or math.isfinite(value), key, "a finite number")
    m, d, t, o = cfg.model, cfg.data, cfg.train, cfg.optim
    validate_data(d, t.max_steps)
    for key, least in {"data.seq_len": 1, "train.seed": 0, "train.global_batch_tokens": 1,
                       "train.micro_batch_size": 1, "train.max_steps": 1, "train.max_bad_steps": 1,
                       "optim.warmup_steps": 0, "optim.weight_decay": 0,
                       "optim.muon_momentum_warmup_steps": 0, "optim.muon_weight_decay": 0,
                       "eval.tokens": 1, "eval.batch_size": 1, "eval.tasks_max_examples": 0,
                       "checkpoint.keep": 1,
                       "log.log_every": 1}.items():
        need(flat[key] >= least, key, f">= {least}")
    need(t.seed < 2**64, "train.seed", "< 2^64, the range torch's generators take")
    for key in ("optim.beta1", "optim.beta2", "optim.muon_momentum", "optim.muon_momentum_start"):
        need(0 <= flat[key] < 1, key, "in [0, 1)")
    for key in ("eval.every", "eval.tasks_every", "sample.every", "checkpoint.every"):
        need(flat[key] >= 0, key, ">= 0; 0 = only at the end")
    for key, expected in (("checkpoint.resume", "none | auto | a checkpoint path"),
                          ("log.out_dir", "a directory path"),
                          ("log.wandb_project", "a project name")):
        need(flat[key] != "", key, expected)
    need(d.seq_len <= m.max_seq_len, "data.seq_len", f"<= model.max_seq_len ({m.max_seq_len})")
    need(t.ddp_bucket_mb >= 1, "train.ddp_bucket_mb", "MiB >= 1 (compiled DDP's least)")
    need(o.lr > 0, "optim.lr", "a finite number > 0")
    need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "between 0 and 1")
    need(0 < o.decay_fraction <= 1, "optim.decay_fraction", "in (0, 1]")
    need(0 < o.eps < 1, "optim.eps", "a small number > 0, e.g. 1e-8")
    need(o.grad_clip >= 0, "optim.grad_clip", ">= 0; 0 disables clipping")
    for key in ("optim.embed_lr", "optim.head_lr", "optim.scalar_lr", "optim.lr_ref_width"):
        need(flat[key] >= 0, key, ">= 0; 0 = " + ("off" if key == "optim.lr_ref_width" else "optim.lr"))
    need(o.head_lr == 0 or not m.tie_embeddings, "optim.head_lr", "0 while model.tie_embeddings = "
         "true (the tied table is the head, at optim.embed_lr); set model.tie_embeddings = false "
         "for an lr of its own")
    try:
        cfg.sample.params()
    except SamplingError as err:
        raise _bad(f"sample.{err.field}", err.value, err.expected) from None


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


def _describe_optimizer(o: OptimConfig, m: ModelConfig) -> str:
    lrs = peak_lrs(o, m.d_model)
    tables = (f"AdamW for the embedding table(s) at peak lr {lrs['embed']:g}"
              + ("" if m.tie_embeddings else f", the head at {lrs['head']:g}")
              + f", the norms' gains at {lrs['scalar']:g}"
              + (f" (lrs given at d_model {o.lr_ref_width}, scaled to {m.d_model})" if o.lr_ref_width else ""))
    if o.name == "adamw":
        return (f"AdamW (betas {o.beta1:g}/{o.beta2:g}) for the matrices at peak lr "
                f"{lrs['matrix']:g}, weight decay {o.weight_decay:g} on matrices and tables; {tables}")
    momentum = (f"{o.muon_momentum_start:g}->{o.muon_momentum:g} over "
                f"{o.muon_momentum_warmup_steps} steps" if o.muon_momentum_warmup_steps
                else f"{o.muon_momentum:g}")
    return (f"Muon for the block matrices (peak lr {lrs['matrix']:g}, momentum {momentum}, weight "
            f"decay {o.muon_weight_decay:g}); {tables}")


def _describe_init(cfg: JobConfig) -> list[str]:
    """A run from pretrained weights: what the width rule does to its lrs, which were measured as
    a fraction of a from-scratch run's (README "Continue pretraining a released model")."""
    o, m = cfg.optim, cfg.model
    if not cfg.checkpoint.init_from:
        return []
    groups = [g for g in GROUPS if g != "head" or not m.tie_embeddings]
    rule = ("the lrs as given (optim.lr_ref_width 0)" if not o.lr_ref_width else
            f"optim.lr_ref_width {o.lr_ref_width} scales the given lrs to d_model {m.d_model}: "
            + ", ".join(f"{g} x{width_factor(o, g, m.d_model):.3g}" for g in groups))
    return [f"init:      {cfg.checkpoint.init_from} at step 0, a fresh optimizer; {rule}"]


def describe(cfg: JobConfig, derived: Derived, n_params: int) -> str:
    """The start-of-run summary: why each training number is what it is."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    vocab = m.vocab_size or "from data"
    if o.warmup_steps > t.max_steps:
        decay = (f"warmup longer than the run: it ends at {t.max_steps / o.warmup_steps:.0%} of the "
                 "peak (lower optim.warmup_steps to reach it)")
    elif o.schedule == "cosine":
        decay = f"cosine to {o.min_lr_ratio:g} x the peak"
    else:
        decay = (f"stable, then linear decay over the last {wsd_decay_steps(t.max_steps, o)} steps "
                 f"to {o.min_lr_ratio:g} x the peak")
    return "\n".join([
        f"model:     {_human(n_params)} params ({m.n_layer} layers, d_model {m.d_model}, "
        f"{m.n_head} heads / {m.n_kv_head} kv heads, vocab {vocab}, context {m.max_seq_len})",
        f"batch:     {t.global_batch_tokens:,} tokens/step = {t.micro_batch_size} seqs x "
        f"{cfg.data.seq_len} tokens x {derived.world_size} ranks x {derived.grad_accum_steps} "
        f"accumulation steps ({derived.sequences_per_step} sequences/step)",
        f"training:  {t.max_steps:,} steps x "
        f"{t.global_batch_tokens:,} tokens = "
        f"{_human(derived.total_tokens)} tokens ({derived.total_tokens / max(n_params, 1):.2f} "
        f"tokens/param; Chinchilla-optimal is ~20)",
        f"lr:        each group's peak after {o.warmup_steps} warmup steps, {decay}",
        f"optimizer: {_describe_optimizer(o, m)}",
        f"numerics:  dtype {t.dtype} (fp32 master weights), compile {t.compile}, attention "
        f"{t.attention}, loss {t.loss}, parallel {t.parallel}, device {t.device}",
        *_describe_init(cfg),
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
    if isinstance(value, dict):  # a table in a list (data.sources): an inline table
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
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
    path = RunDir(run_dir).config
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, [to_toml(cfg).encode()])
    return path
