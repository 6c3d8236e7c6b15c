"""Which peak lr each parameter takes: one key per group, the same meaning under both optimizers,
and the width rule that carries lrs given at a reference width to the model's.

    matrix  the 2-D weight matrices (attention, MLP): optim.lr (Muon's under muon, else AdamW's)
    embed   the token table (tied: also the head) and the value-embedding tables: optim.embed_lr
    head    an untied LM head: optim.head_lr
    scalar  the 1-D gains (RMSNorm weights): optim.scalar_lr
The last three are AdamW's under both optimizers; 0 means optim.lr. Every group that has
parameters is a group of the optimizer's state, whatever the lrs, so a resume retunes any lr.
"""

from __future__ import annotations

from typing import Protocol

from lmforge.pipeline.typed_config import ConfigError


class LrKeys(Protocol):
    """What these rules read of pipeline.config.OptimConfig (which imports this module)."""

    name: str
    lr: float
    embed_lr: float
    head_lr: float
    scalar_lr: float
    lr_ref_width: int

GROUPS = ("matrix", "embed", "head", "scalar")

# optim.lr_ref_width's rule: a group's lr at d_model = its lr at the reference width times
# (d_model / lr_ref_width) ** exponent, the exponent under which each optimum moved least from
# d_model 128 to 512 (bench/results/lr_sweep_*zen4.txt; Muon's tied table + gains re-checked on
# prose, bench/results/quality_zen4_width.txt: no other exponent wins on both corpora at both
# widths). Muon: the matrices 0, as Muon's orthogonalised update, of fixed spectral norm whatever
# the width, predicts; every AdamW group -0.5, nanochat's rule: the tied table with the gains, and
# an untied head (flat; muP's -1 moved it 1.3 steps). AdamW: muP's (Tensor Programs V, Table 3),
# each measured: the matrices -1, the tied table with the gains 0, an untied head -1.
WIDTH_EXPONENTS = {
    "muon": {"matrix": 0.0, "embed": -0.5, "head": -0.5, "scalar": -0.5},
    "adamw": {"matrix": -1.0, "embed": 0.0, "head": -1.0, "scalar": 0.0},
}


def group_of(name: str, ndim: int) -> str:
    """The lr group of the parameter named `name` with `ndim` dimensions."""
    parts = name.split(".")
    if "tok_emb" in parts or "value_embeds" in parts:
        return "embed"
    return "head" if "lm_head" in parts else "matrix" if ndim >= 2 else "scalar"


def given_lrs(o: LrKeys) -> dict[str, float]:
    """Each group's peak lr as the config gives it (at lr_ref_width when that is set)."""
    return {"matrix": o.lr, "embed": o.embed_lr or o.lr, "head": o.head_lr or o.lr,
            "scalar": o.scalar_lr or o.lr}


def width_factor(o: LrKeys, group: str, d_model: int) -> float:
    """What optim.lr_ref_width's rule multiplies `group`'s given lr by at `d_model` (1 when off)."""
    if not o.lr_ref_width:
        return 1.0
    return (d_model / o.lr_ref_width) ** WIDTH_EXPONENTS[o.name][group]


def peak_lrs(o: LrKeys, d_model: int) -> dict[str, float]:
    """Each group's peak lr for a model of width `d_model`: the given lr, width rule applied."""
    return {g: lr * width_factor(o, g, d_model) for g, lr in given_lrs(o).items()}


def check_lrs_given(o: LrKeys, file_optim: dict, named: dict[str, str], path,
                    default_name: str) -> None:
    """The lrs read are the ones meant. A file for muon names its AdamW groups' lrs: one that does
    not was written when optim.lr was their lr (and muon_lr, default 0.02, the matrices'). An
    optimizer switched on the command line (`named`: its overrides) takes its own optim.lr: the
    file's (or the default's, of `default_name`) is the other's."""
    if o.name == "muon" and file_optim.get("name") == "muon" and "scalar_lr" not in file_optim:
        raise ConfigError(
            f"config file '{path}' sets optim.name = \"muon\" without optim.scalar_lr: under muon "
            "optim.lr is Muon's (the matrices'), the AdamW groups' are optim.embed_lr, "
            "optim.scalar_lr (and optim.head_lr when untied); name them in the file (a file "
            "written before they existed gave them as optim.lr: configs/tiny.toml shows today's)")
    if "optim.name" in named and o.name != file_optim.get("name", default_name) \
            and "optim.lr" not in named:
        raise ConfigError(
            f"--optim.name {o.name} without --optim.lr: the lr {o.lr:g} is "
            f"{'the file' if path else 'the default'}'s for {file_optim.get('name', default_name)}; "
            "set --optim.lr to the matrices' peak lr under " + o.name + " (AdamW's ~3e-3, "
            "Muon's ~0.03 at d_model 256), and check optim.embed_lr, scalar_lr, head_lr")
