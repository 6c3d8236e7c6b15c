"""Start from a released model: a Hugging Face Llama / Qwen2 / Qwen3 directory (config.json and
safetensors, one model.safetensors or shards listed in model.safetensors.index.json) read into our
GPT through model/hf.py's conversion table, for `checkpoint.init_from` and `--ckpt hf:DIR`.

The directory is input, not code: the path named may be a link, nothing inside it is followed.
Only safetensors are read, by the library (`safetensors_file`: the one reader of the format) on
the descriptor safe_files opened; it refuses a header over 100 MB or nested too deep and byte
ranges that overlap, leave gaps or pass the end. Every stored shape is held against config.json's
model before anything it sizes is built (model.model.state_shapes) or allocated. Weights are
read tensor by tensor, each file mapped only while one is read: a process holds the model plus
one stored tensor (under FSDP2, one whole parameter beside its shards).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import tomllib
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from lmforge.data_prep.safe_files import (
    check_dir,
    check_file,
    file_sha256,
    open_fd,
    read_text,
    user_path,
)
from lmforge.data_prep.tokenizer import HF_PREFIX
from lmforge.model import GPT, ModelConfig
from lmforge.model.hf import CONFIG_FILE, WEIGHTS_FILE, config_from_hf, hf_shapes, weight_table
from lmforge.pipeline.checkpoint.run_dir import RunDir
from lmforge.pipeline.errors import CheckpointError, refusal
from lmforge.pipeline.parallel.materialize import copy_whole, materialize, meta_gpt
from lmforge.pipeline.typed_config import ConfigError, field_types, parse_overrides, parse_text

INDEX_FILE = "model.safetensors.index.json"
MAX_JSON_BYTES = 1 << 26
DTYPES = ("F32", "BF16", "F16")
# Stored beside the weights by some exports, and rebuilt by us: not a mismatch.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
AC_PREFIX = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper, in param names


def hf_dir(spec: str | Path) -> Path | None:
    """DIR of an `hf:DIR` checkpoint spec, None for any other."""
    spec = str(spec)
    return user_path(spec.removeprefix(HF_PREFIX)) if spec.startswith(HF_PREFIX) else None


def read_json(path: Path, what: str):
    """A JSON file of a Hugging Face directory; CheckpointError when it is not JSON."""
    try:
        return json.loads(read_text(path, MAX_JSON_BYTES, what=what))
    except (ValueError, RecursionError) as e:  # RecursionError: nested past Python's stack
        raise refusal(path, f"not a JSON file lmforge can read ({type(e).__name__})") from None


def read_config(directory: Path) -> ModelConfig:
    """Our ModelConfig of DIR/config.json (DIR resolved by the caller); CheckpointError naming
    what lmforge does not model."""
    try:
        check_dir(directory, what="Hugging Face model directory")
    except FileNotFoundError:
        raise CheckpointError(f"Hugging Face model directory {directory} not found; download it "
                              "first (huggingface-cli download NAME --local-dir DIR)") from None
    path = directory / CONFIG_FILE
    if not os.path.lexists(path):
        raise CheckpointError(f"{path} not found; give a Hugging Face model directory")
    try:
        return config_from_hf(read_json(path, "model config"))
    except ValueError as e:
        raise CheckpointError(f"cannot start from {directory}: {e}") from None


def _given(d: dict, pairs: list[tuple[str, str]], key: str):
    """`key` (section.name) as the overrides, else the config file, give it."""
    given, (section, name) = [v for k, v in pairs if k == key], key.split(".")
    table = d.get(section)  # a section that is no table: the typed config's error, not ours
    return given[-1] if given else table.get(name, "") if isinstance(table, dict) else ""


def init_from_model(d: dict, overrides: list[str]) -> tuple[dict, list[str]]:
    """The config dict and overrides with `checkpoint.init_from` applied: the [model] section is
    config.json's (a resume's, once the directory is gone, the run's own: `_resumed_model`); a
    --model.* override that disagrees with it is a ConfigError naming both."""
    pairs = parse_overrides(overrides)
    source = _given(d, pairs, "checkpoint.init_from")
    if not source or not isinstance(source, str):  # not a path: the typed config's error
        return d, overrides
    hf = _resumed_model(d, pairs, source)
    if hf is None:
        hf = open_weights(Path(source)).config  # weights checked too: a bad directory stops here
    types = field_types(ModelConfig)
    for key, text in pairs:
        name = key.removeprefix("model.")
        if key.startswith("model.") and name in types and \
                parse_text(key, text, types[name]) != getattr(hf, name):
            raise ConfigError(f"--{key} {text} disagrees with {source}/config.json, which gives "
                              f"{name} = {getattr(hf, name)}; drop the override (with "
                              "checkpoint.init_from the model is the checkpoint's)")
    kept = [a for k, v in pairs if not k.startswith("model.") for a in (f"--{k}", v)]
    return d | {"model": {f.name: getattr(hf, f.name) for f in fields(ModelConfig)}}, kept


def _resumed_model(d: dict, pairs: list[tuple[str, str]], source: str) -> ModelConfig | None:
    """Where `source` is gone and the run resumes (its checkpoints hold the weights): the model
    its run's config.toml holds, which format.read_resumable holds against the checkpoint's."""
    if os.path.lexists(source) or _given(d, pairs, "checkpoint.resume") in ("", "none"):
        return None
    saved = RunDir(_given(d, pairs, "log.out_dir") or "runs/tiny").config
    if not check_file(saved, what="run config"):
        return None
    try:
        return ModelConfig.from_dict(tomllib.loads(read_text(saved, MAX_JSON_BYTES, what="run config"))["model"])
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise refusal(saved, f"it holds no model lmforge can build ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class Stored:
    """One tensor of a safetensors file: which file, and its shape."""

    file: Path
    shape: tuple[int, ...]


@dataclass
class HFWeights:
    directory: Path
    config: ModelConfig
    tensors: dict[str, Stored]

    def sha256(self) -> dict[str, str]:
        """Each weights file's sha256 (what a run's meta.json records of its source)."""
        files = sorted({t.file for t in self.tensors.values()})
        return {path.name: file_sha256(path, what="safetensors file") for path in files}


@contextlib.contextmanager
def safetensors_file(path: Path) -> Iterator:
    """safetensors' safe_open of the regular file `path` (opened by safe_files, never through a
    link: the library reads the file behind that descriptor), its refusals one CheckpointError."""
    try:
        fd = open_fd(path, "rb", what="safetensors file")
    except FileNotFoundError:  # named by the index
        raise CheckpointError(f"{path} is missing; download the model again") from None
    try:
        with safe_open(f"/proc/self/fd/{fd}", framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise refusal(path, f"not a readable safetensors file ({e})") from None
    finally:
        os.close(fd)


def stored_tensors(path: Path) -> dict[str, Stored]:
    """Every tensor a safetensors file declares, from its header alone (no tensor data read)."""
    out = {}
    with safetensors_file(path) as f:
        for name in f.keys():
            info = f.get_slice(name)
            if info.get_dtype() not in DTYPES:
                raise refusal(path, f"tensor {name!r} is of dtype {info.get_dtype()}, not F32/BF16/F16")
            out[name] = Stored(path, tuple(info.get_shape()))
    return out


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of DIR: its index's shards, or model.safetensors."""
    index = directory / INDEX_FILE
    if os.path.lexists(index):  # a link or FIFO there: safe_files' refusal, naming it
        try:
            names = set(read_json(index, "index")["weight_map"].values())
        except (KeyError, TypeError, AttributeError) as e:
            raise refusal(index, f"not a safetensors index ({type(e).__name__})") from None
        if bad := [n for n in names if not isinstance(n, str) or Path(n).name != n
                   or n in (".", "..") or "\0" in n]:
            raise refusal(index, f"it names files outside its directory ({bad[0]!r})")
        return [directory / n for n in sorted(names)]
    if os.path.lexists(directory / WEIGHTS_FILE):
        return [directory / WEIGHTS_FILE]
    found = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    raise CheckpointError(f"{directory} holds no safetensors weights ({WEIGHTS_FILE} or "
                          f"{INDEX_FILE}){f'; {found[0]} is a pickle, which lmforge never loads' if found else ''}: "
                          "download the model's safetensors files")


def open_weights(directory: Path) -> HFWeights:
    """config.json and every stored tensor's header, checked to be the model's (nothing allocated,
    nothing sized by config.json built before the stored tensors are counted)."""
    directory = Path(directory).resolve()  # the path named may be a link; nothing inside it is
    cfg = read_config(directory)
    tensors: dict[str, Stored] = {}
    for path in weight_files(directory):
        for name, t in stored_tensors(path).items():
            if name in tensors:
                raise refusal(path, f"it stores {name}, which {tensors[name].file.name} stores too")
            tensors[name] = t
    tensors = {k: v for k, v in tensors.items() if not k.endswith(IGNORED_SUFFIXES)}
    if cfg.tie_embeddings:  # a tied model saved with its head too: the embedding is the one read
        tensors.pop("lm_head.weight", None)
    if wrong := mismatch(hf_shapes(cfg, len(tensors)), {k: t.shape for k, t in tensors.items()}):
        raise CheckpointError(f"{directory}: its weights do not match its config.json ({wrong}); "
                              "download the model again")
    check_tables_fit(cfg, directory / CONFIG_FILE)
    return HFWeights(directory, cfg, tensors)


def mismatch(want: dict[str, tuple] | None, stored: dict[str, tuple], optional: tuple = ()) -> str:
    """How the stored shapes differ from those wanted ("" when they do not; `optional` may be
    missing; `want` None: state_shapes found more tensors wanted than stored, or larger)."""
    if want is None:
        return f"it describes more tensors, or larger ones, than the {len(stored)} stored"
    wrong = [f"{k} {stored[k]} vs {s}" for k, s in want.items() if k in stored and stored[k] != s]
    missing, unexpected = sorted(want.keys() - stored.keys() - set(optional)), sorted(stored.keys() - want.keys())
    return "; ".join([*wrong[:2], *(f"missing {k}" for k in missing[:2]),
                      *(f"unexpected {k}" for k in unexpected[:2])])


def check_tables_fit(cfg: ModelConfig, where: Path) -> None:
    """The RoPE tables (2 x max_seq_len x head_dim fp32), the one size meta.json or config.json
    sets that no stored weight confirms, within this machine's memory."""
    need = 2 * cfg.max_seq_len * cfg.head_dim * 4
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have // 4:
        raise refusal(where, f"its max_seq_len {cfg.max_seq_len:,} needs "
                             f"{need / 2**30:,.1f} GiB of RoPE tables")


def _fill(dst: torch.Tensor, parts: list[tuple[str, Stored]]) -> None:
    """`dst` (plain, CPU) from the stored tensors stacked by rows, the padding rows zero; each
    file mapped only while its tensor is copied out (the dtype converted by the copy)."""
    row = 0
    for name, t in parts:
        with safetensors_file(t.file) as f:
            dst[row:row + t.shape[0]].copy_(f.get_tensor(name))
        row += t.shape[0]
    dst[row:].zero_()


@torch.no_grad()
def load_weights(model: nn.Module, weights: HFWeights) -> None:
    """Every weight of `model` (a GPT: plain, or with FSDP2's DTensor shards, compiled or not)
    from `weights`, one tensor at a time; its buffers (RoPE tables) are left as built."""
    params = {k.replace(AC_PREFIX, ""): p for k, p in model.named_parameters()}
    for ours, parts in weight_table(weights.config).items():
        p, stored = params[ours], [(name, weights.tensors[name]) for name, _ in parts]
        if type(p.data) is torch.Tensor and p.device.type == "cpu":
            _fill(p.data, stored)
        else:  # a shard or a device tensor: whole on the CPU, then this rank's part
            whole = torch.empty(p.shape, dtype=p.dtype)
            _fill(whole, stored)
            copy_whole(p.data, whole)


def load_hf_model(directory: Path, device: str | torch.device = "cpu") -> GPT:
    """A plain GPT (fp32) holding the Hugging Face directory's weights, in eval mode."""
    weights = open_weights(directory)
    model = meta_gpt(weights.config)
    materialize(model, torch.device(device), seed=0)  # RoPE tables; every weight is overwritten
    load_weights(model, weights)
    return model.eval()


def start_from(model: nn.Module, directory: Path) -> dict:
    """Load the weights of `directory` into the trainer's freshly built `model`; returns what a
    checkpoint's meta.json records of the source (path and each weights file's sha256)."""
    weights = open_weights(directory)
    load_weights(model, weights)
    return {"path": str(weights.directory), "sha256": weights.sha256()}
