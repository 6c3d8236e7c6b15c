"""Start from a released model: a Hugging Face Llama / Qwen3 directory (config.json and safetensors,
one model.safetensors or shards listed in model.safetensors.index.json) read into our GPT through
model/hf.py's conversion table, for `checkpoint.init_from` and `--ckpt hf:DIR`.

The directory is input, not code. Only safetensors are read (a pickled pytorch_model.bin is
refused; nothing of config.json is run: model_type must be llama or qwen3); every file is opened by
data_prep/safe_files.py; each safetensors header is parsed here, bounded, and every tensor's dtype,
shape and byte range checked against the model config.json describes before any memory is
allocated. Weights are read tensor by tensor with pread (no mmap, no second copy of the model): a
process holds the model plus one stored tensor, and under FSDP2 one whole parameter beside its
shards (as pipeline/parallel/materialize.py initialises).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from lmforge.data_prep.safe_files import check_dir, file_sha256, open_fd, read_text
from lmforge.data_prep.tokenizer import HF_PREFIX
from lmforge.model import GPT, ModelConfig
from lmforge.model.hf import CONFIG_FILE, WEIGHTS_FILE, config_from_hf, hf_shapes, weight_table
from lmforge.pipeline.errors import CheckpointError, refusal
from lmforge.pipeline.parallel.materialize import copy_whole, materialize, meta_gpt
from lmforge.pipeline.typed_config import ConfigError, field_types, parse_overrides, parse_text

INDEX_FILE = "model.safetensors.index.json"
MAX_JSON_BYTES = 1 << 26
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Stored beside the weights by some exports, and rebuilt by us: not a mismatch.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
AC_PREFIX = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper, in param names


def hf_dir(spec: str | Path) -> Path | None:
    """DIR of an `hf:DIR` checkpoint spec, None for any other."""
    spec = str(spec)
    return Path(spec.removeprefix(HF_PREFIX)) if spec.startswith(HF_PREFIX) else None


def read_config(directory: Path) -> ModelConfig:
    """Our ModelConfig of DIR/config.json; CheckpointError naming what lmforge does not model."""
    try:
        check_dir(directory, what="Hugging Face model directory")
    except FileNotFoundError:
        raise CheckpointError(f"Hugging Face model directory {directory} not found; download it "
                              "first (huggingface-cli download NAME --local-dir DIR)") from None
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found; give a Hugging Face model directory")
    try:
        return config_from_hf(json.loads(read_text(path, MAX_JSON_BYTES, what="model config")))
    except ValueError as e:
        raise CheckpointError(f"cannot start from {directory}: {e}") from None


def init_from_model(d: dict, overrides: list[str]) -> tuple[dict, list[str]]:
    """The config dict and overrides with `checkpoint.init_from` applied: the [model] section is
    config.json's; a --model.* override that disagrees with it is a ConfigError naming both."""
    pairs = parse_overrides(overrides)
    given = [v for k, v in pairs if k == "checkpoint.init_from"]
    source = given[-1] if given else d.get("checkpoint", {}).get("init_from", "")
    if not source:
        return d, overrides
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


@dataclass(frozen=True)
class Stored:
    """One tensor of a safetensors file: where its bytes are and what they hold."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int


@dataclass
class HFWeights:
    directory: Path
    config: ModelConfig
    tensors: dict[str, Stored]

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})

    def sha256(self) -> dict[str, str]:
        """Each weights file's sha256 (what a run's meta.json records of its source)."""
        return {path.name: file_sha256(path, what="safetensors file") for path in self.files}


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of DIR: its index's shards, or model.safetensors."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            names = set(json.loads(read_text(index, MAX_JSON_BYTES, what="index"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise refusal(index, f"not a safetensors index ({type(e).__name__})") from None
        if bad := [n for n in names if not isinstance(n, str) or Path(n).name != n or n in (".", "..")]:
            raise refusal(index, f"it names files outside its directory ({bad[0]!r})")
        return [directory / n for n in sorted(names)]
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE]
    found = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    raise CheckpointError(f"{directory} holds no safetensors weights ({WEIGHTS_FILE} or "
                          f"{INDEX_FILE}){f'; {found[0]} is a pickle, which lmforge never loads' if found else ''}: "
                          "download the model's safetensors files")


def read_header(path: Path) -> dict[str, Stored]:
    """Every tensor a safetensors file declares, each checked to lie within the file."""
    fd = open_fd(path, "rb", what="safetensors file")
    try:
        size = os.fstat(fd).st_size
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        if size < 8 or n > min(MAX_HEADER_BYTES, size - 8):
            raise refusal(path, "not a safetensors file (its header length is out of range)")
        header = json.loads(os.pread(fd, n, 8))
    except ValueError as e:
        raise refusal(path, f"not a safetensors file ({e})") from None
    finally:
        os.close(fd)
    out = {}
    for name, e in header.items() if isinstance(header, dict) else ():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
            ok = all(isinstance(x, int) and x >= 0 for x in (*shape, begin, end))
        except (KeyError, TypeError, ValueError):
            raise refusal(path, f"tensor {name!r}: dtype {e.get('dtype') if isinstance(e, dict) else e!r} "
                                "is not F32/BF16/F16, or its entry is malformed") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if not ok or end - begin != nbytes or 8 + n + end > size:
            raise refusal(path, f"tensor {name!r} does not lie within the file as declared")
        out[name] = Stored(path, dtype, shape, 8 + n + begin, nbytes)
    return out


def open_weights(directory: Path) -> HFWeights:
    """config.json and every stored tensor's header, checked to be the model's (nothing allocated)."""
    cfg = read_config(directory)
    tensors = {}
    for path in weight_files(directory):
        tensors |= read_header(path)
    tensors = {k: v for k, v in tensors.items() if not k.endswith(IGNORED_SUFFIXES)}
    want = hf_shapes(cfg)
    if cfg.tie_embeddings:  # a tied model saved with its head too: the embedding is the one read
        tensors.pop("lm_head.weight", None)
    wrong = [f"{k} {tensors[k].shape} vs {s} by config.json" for k, s in want.items()
             if k in tensors and tensors[k].shape != s]
    missing, unexpected = sorted(want.keys() - tensors.keys()), sorted(tensors.keys() - want.keys())
    if wrong or missing or unexpected:
        raise CheckpointError(f"{directory}: its weights do not match its config.json ("
                              + "; ".join([*wrong[:2], *(f"missing {k}" for k in missing[:2]),
                                           *(f"unexpected {k}" for k in unexpected[:2])])
                              + "); download the model again")
    return HFWeights(directory, cfg, tensors)


def _read_into(fd: int, t: Stored, out: torch.Tensor) -> None:
    """The stored bytes of `t` into `out` (contiguous, of its dtype and shape)."""
    view, done = memoryview(out.view(torch.uint8).reshape(-1).numpy()), 0
    while done < t.nbytes:
        n = os.preadv(fd, [view[done:]], t.start + done)
        if n == 0:
            raise refusal(t.file, "it ends before its tensors do")
        done += n


def _fill(dst: torch.Tensor, parts: list[Stored], fds: dict[Path, int]) -> None:
    """`dst` (plain, CPU) from the stored tensors stacked by rows, the padding rows zero."""
    row = 0
    for t in parts:
        target = dst[row:row + t.shape[0]]
        if t.dtype == dst.dtype:
            _read_into(fds[t.file], t, target)
        else:  # one stored tensor in its own dtype, converted by the copy
            buf = torch.empty(t.shape, dtype=t.dtype)
            _read_into(fds[t.file], t, buf)
            target.copy_(buf)
        row += t.shape[0]
    dst[row:].zero_()


@torch.no_grad()
def load_weights(model: nn.Module, weights: HFWeights) -> None:
    """Every weight of `model` (a GPT: plain, or with FSDP2's DTensor shards, compiled or not)
    from `weights`, one tensor at a time; its buffers (RoPE tables) are left as built."""
    params = {k.replace(AC_PREFIX, ""): p for k, p in model.named_parameters()}
    fds = {path: open_fd(path, "rb", what="safetensors file") for path in weights.files}
    try:
        for ours, parts in weight_table(weights.config).items():
            p, stored = params[ours], [weights.tensors[name] for name, _ in parts]
            if type(p.data) is torch.Tensor and p.device.type == "cpu":
                _fill(p.data, stored, fds)
            else:  # a shard or a device tensor: whole on the CPU, then this rank's part
                whole = torch.empty(p.shape, dtype=p.dtype)
                _fill(whole, stored, fds)
                copy_whole(p.data, whole)
    finally:
        for fd in fds.values():
            os.close(fd)


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
    return {"path": str(directory.resolve()), "sha256": weights.sha256()}
