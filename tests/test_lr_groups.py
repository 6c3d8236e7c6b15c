"""One meaning per lr key under both optimizers, the width rule (optim.lr_ref_width) group by
group, and runs of the old lr keys: their checkpoints refused for resume in one line (still
evaluated), their resolved configs read with their old lrs."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from bench.common import ROOT
from bench.runs import env, losses, run_args, train, train_cmd
from lmforge.model import GPT, ModelConfig
from lmforge.pipeline.config import OptimConfig, load_config
from lmforge.pipeline.optim.optimizers import apply_schedule, build_optimizer, lr_multiplier
from tests.errors import cli_error, last_error

# The width rule as README "Learning rates" and OptimConfig.lr_ref_width document it: a group's lr
# is multiplied by (d_model / lr_ref_width) ** exponent.
DOCUMENTED_EXPONENTS = {
    "muon": {"matrix": 0, "embed": -0.5, "head": -0.5, "scalar": -0.5},
    "adamw": {"matrix": -1, "embed": 0, "head": -1, "scalar": 0},
}
GIVEN = {"matrix": 0.02, "embed": 0.1, "head": 0.004, "scalar": 0.05}


def _lrs_by_group(name: str, d_model: int, ref_width: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=128, n_layer=2, n_head=2, n_kv_head=1, d_model=d_model,
                            max_seq_len=32, tie_embeddings=False))
    cfg = OptimConfig(name=name, lr=GIVEN["matrix"], embed_lr=GIVEN["embed"], head_lr=GIVEN["head"],
                      scalar_lr=GIVEN["scalar"], lr_ref_width=ref_width, warmup_steps=4)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    logged = apply_schedule(opt, 3, 100, cfg, d_model)  # step 3: the peak
    assert lr_multiplier(3, 100, cfg) == 1.0
    by_group = {g["kind"]: g["lr"] for g in opt.param_groups}
    assert logged == by_group["matrix"]  # the logged lr is the matrices'
    return by_group


@pytest.mark.parametrize("name", ["muon", "adamw"])
@pytest.mark.parametrize("d_model", [32, 128, 512])
def test_the_width_rule_scales_each_group_as_documented(name, d_model):
    ref = 128
    scaled = _lrs_by_group(name, d_model, ref)
    assert set(scaled) == set(GIVEN)
    for group, lr in GIVEN.items():
        expected = lr * (d_model / ref) ** DOCUMENTED_EXPONENTS[name][group]
        assert scaled[group] == pytest.approx(expected, rel=1e-12), group
    assert _lrs_by_group(name, d_model, 0) == pytest.approx(GIVEN)  # 0 = off: as given


def test_a_resume_keeps_the_rules_lrs(tiny_data, tmp_path):
    """A run under the rule stopped at step 4 and resumed from its checkpoint logs the straight
    run's losses and scaled lrs from there (TINY_ARGS' d_model 64, given at 256: the head x4)."""
    rule = ["--optim.name", "adamw", "--optim.lr_ref_width", "256", "--model.tie_embeddings", "false",
            "--optim.head_lr", "1e-3", "--train.max_steps", "8", "--checkpoint.every", "4"]
    train(run_args(tiny_data, tmp_path / "straight", *rule))
    records = [json.loads(ln) for ln in (tmp_path / "straight" / "metrics.jsonl").open()]
    lrs = {r["step"]: r["lr"] for r in records if "lr" in r}
    cfg = load_config(None, run_args(tiny_data, tmp_path / "x", *rule))
    assert lrs[4] == pytest.approx(3e-3 * 4 * lr_multiplier(3, 8, cfg.optim))  # matrices: x (256/64)
    run_dir = tmp_path / "resumed"
    step4 = run_dir / "checkpoints" / "step_00000004"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / step4.name, step4)
    train(run_args(tiny_data, run_dir, *rule, "--checkpoint.resume", "auto"))
    after = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").open()]
    assert {r["step"]: r["lr"] for r in after if "lr" in r} == {s: lrs[s] for s in range(5, 9)}
    assert losses(run_dir) == {s: losses(tmp_path / "straight")[s] for s in range(5, 9)}


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(args), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)


def test_retuning_lr_to_equal_embed_lr_resumes(tiny_data, tmp_path):
    """Issue 51 #15: a run with optim.embed_lr of its own, resumed with optim.lr set to the same
    value, was refused (its group would vanish), and so was the resume the refusal proposed."""
    own = ["--optim.name", "muon", "--model.tie_embeddings", "false", "--optim.embed_lr", "0.05",
           "--checkpoint.every", "2"]
    train(run_args(tiny_data, tmp_path / "r", *own, "--train.max_steps", "2"))
    res = _run(run_args(tiny_data, tmp_path / "r", *own, "--train.max_steps", "4", "--optim.lr", "0.05",
                        "--checkpoint.resume", "auto"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(losses(tmp_path / "r")) == [1, 2, 3, 4]


def _as_old_format(step_dir, adamw_lr: float) -> None:
    """Rewrite a checkpoint's meta.json as lmforge wrote it before this change (format 2): the
    old optim keys, optim.lr the AdamW groups' under muon and optim.muon_lr the matrices'."""
    meta = json.loads((step_dir / "meta.json").read_text())
    optim = meta["config"]["optim"]
    optim["muon_lr"] = optim["lr"]
    optim["lr"] = adamw_lr
    for key in ("scalar_lr", "lr_ref_width"):
        del optim[key]
    optim["embed_lr"] = 0.0
    meta["version"] = 2
    (step_dir / "meta.json").write_text(json.dumps(meta))


def test_an_old_format_run_is_refused_for_resume_in_one_line_but_still_evaluates(tiny_data, tmp_path):
    muon = ["--optim.name", "muon", "--optim.lr", "0.02", "--optim.embed_lr", "3e-3",
            "--optim.scalar_lr", "3e-3", "--checkpoint.every", "2"]
    run_dir = tmp_path / "old"
    train(run_args(tiny_data, run_dir, *muon, "--train.max_steps", "2"))
    step2 = run_dir / "checkpoints" / "step_00000002"
    _as_old_format(step2, adamw_lr=3e-3)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    res = _run(run_args(tiny_data, run_dir, *muon, "--train.max_steps", "4", "--checkpoint.resume", "auto"))
    last_error(res, "is of format 2", "cannot be resumed here", "start a new run directory")
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    # eval reads it, its lrs in today's keys
    out = tmp_path / "eval.json"
    ev = subprocess.run([*train_cmd([], module="lmforge.launch.cli"), "eval", "--ckpt", str(step2),
                         "--data", str(tiny_data), "--json", str(out)],
                        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
    assert ev.returncode == 0 and json.loads(out.read_text())["loss"] > 0, ev.stderr[-3000:]
    from lmforge.pipeline.checkpoint.format import read_meta

    o = read_meta(step2).config.optim
    assert (o.lr, o.embed_lr, o.head_lr, o.scalar_lr) == (0.02, 3e-3, 0.0, 3e-3)


@pytest.mark.parametrize("tied", [True, False])
def test_an_old_config_file_keeps_its_lrs(tmp_path, tied):
    """A config written for the old keys (it names optim.muon_lr, as every resolved config.toml
    of such a run does) trains each group at the lr it meant; adamw's meaning is unchanged."""
    old = tmp_path / "config.toml"
    head = "" if tied else "head_lr = 0.0\n"
    old.write_text(f"[model]\ntie_embeddings = {str(tied).lower()}\n\n[optim]\nname = \"muon\"\n"
                   f"lr = 0.003\nmuon_lr = 0.05\nembed_lr = {0.0 if tied else 0.1}\n{head}")
    o = load_config(old).optim
    assert (o.lr, o.embed_lr, o.scalar_lr) == (0.05, 0.003 if tied else 0.1, 0.003)
    assert o.head_lr == (0.0 if tied else 0.003)
    old.write_text("[optim]\nname = \"adamw\"\nlr = 0.001\nmuon_lr = 0.05\n")
    o = load_config(old).optim
    assert (o.lr, o.embed_lr, o.head_lr, o.scalar_lr) == (0.001, 0.0, 0.0, 0.0)  # 0 = lr, as before


@pytest.mark.parametrize("text, section", [("optim = 3\n", "optim"),
                                           ("model = 3\n[optim]\nname = \"muon\"\nmuon_lr = 0.02\n", "model")])
def test_an_old_config_file_with_a_section_that_is_not_one_is_one_line(tmp_path, capsys, text, section):
    """The old keys' reading looks into [optim] and [model] before their types are checked: a file
    where either is a value is still one error line naming the section, exit 2."""
    bad = tmp_path / "config.toml"
    bad.write_text(text)
    cli_error(capsys, ["train", "--config", str(bad)], f"'{section}' must be a section")
