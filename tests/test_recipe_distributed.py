"""The recipe preset (configs/tiny_modern.toml's model options and table lrs, with Muon) under real 2-process
runs on CPU: DDP on 2 ranks == 1 process with accumulation, FSDP2 == DDP, and an FSDP2 run
resumed from its checkpoint continues exactly as the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from lmforge.model.model import RECIPE_OPTIONS
from tests.conftest import layout_args
from tests.harness import losses, max_diff, train
from tests.test_distributed import resume_copy

pytestmark = pytest.mark.dist

STEPS = 8
PRESET = Path(__file__).resolve().parents[1] / "configs" / "tiny_modern.toml"


def preset_flags() -> list[str]:
    """The preset's model options and its lrs as flags (the shape stays the tiny
    test model's)."""
    preset = tomllib.loads(PRESET.read_text())
    model, optim = preset["model"], preset["optim"]
    keys = [k for k in model if k in (*RECIPE_OPTIONS, "mlp", "tie_embeddings")]
    lrs = ("lr", "embed_lr", "head_lr", "scalar_lr")
    assert {"mlp", "tie_embeddings"} <= set(keys) and set(lrs) <= set(optim), keys
    return [f for k in keys for f in (f"--model.{k}", str(model[k]).lower())] + [
        f for k in lrs for f in (f"--optim.{k}", str(optim[k]))]


def preset_args(data, out, *extra: str) -> list[str]:
    return layout_args(data, out, "--train.max_steps", str(STEPS), "--optim.name", "muon",
                       *preset_flags(), *extra)


@pytest.fixture(scope="module")
def preset_runs(tiny_data, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("preset")
    for parallel in ("none", "ddp", "fsdp"):
        train(preset_args(tiny_data, root / parallel, "--train.parallel", parallel),
              nproc=1 if parallel == "none" else 2)
    return {p: root / p for p in ("none", "ddp", "fsdp")}


def test_preset_ddp_two_ranks_equals_one_process(preset_runs):
    single, ddp = losses(preset_runs["none"]), losses(preset_runs["ddp"])
    assert sorted(single) == list(range(1, STEPS + 1))
    assert single[STEPS] < single[1] - 0.3  # it learns: the comparison compares something
    assert max_diff(ddp, single) <= 1e-4, (single, ddp)
    assert max_diff(losses(preset_runs["fsdp"]), ddp) <= 1e-4


def test_preset_fsdp_resume_is_exact(preset_runs, tiny_data, tmp_path):
    resume_copy(preset_runs["fsdp"], 4, tmp_path / "r")
    train(preset_args(tiny_data, tmp_path / "r", "--train.parallel", "fsdp", "--resume", "auto"), nproc=2)
    resumed, baseline = losses(tmp_path / "r"), losses(preset_runs["fsdp"])
    assert sorted(resumed) == list(range(5, STEPS + 1))
    assert all(resumed[s] == baseline[s] for s in resumed), (resumed, baseline)


ALL_OPTIONS = ["--model.qk_norm", "true", "--model.mlp", "relu2", "--model.logit_softcap", "15",
               "--model.zero_init", "true", "--model.value_embeds", "true",
               "--model.tie_embeddings", "false"]


def test_every_option_with_adamw_fsdp_equals_one_process(tiny_data, tmp_path):
    """The options outside the preset too (value embeddings and the untied head live beside the
    FSDP2-wrapped blocks, QK-norm gains inside them), under AdamW."""
    curves = {}
    for parallel, nproc in (("none", 1), ("fsdp", 2)):
        train(layout_args(tiny_data, tmp_path / parallel, "--train.max_steps", str(STEPS),
                          *ALL_OPTIONS, "--train.parallel", parallel), nproc=nproc)
        curves[parallel] = losses(tmp_path / parallel)
    assert sorted(curves["none"]) == list(range(1, STEPS + 1))
    assert curves["none"][STEPS] < curves["none"][1] - 0.3
    assert max_diff(curves["fsdp"], curves["none"]) <= 1e-4, curves
