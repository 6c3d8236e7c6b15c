"""One meaning per lr key under both optimizers (each lr group a group of its own; a head lr only
for an untied head), the width rule (optim.lr_ref_width) group by
group, and what a user holds from before the lr keys changed: a checkpoint (refused for resume in
one line, still evaluated), a config file (refused in one line, never read with another meaning).
An optimizer switched on the command line takes its own lr."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from lmforge.launch.cli import main as cli
from lmforge.model import GPT, ModelConfig
from lmforge.pipeline.config import ConfigError, OptimConfig, derive, describe, load_config
from lmforge.pipeline.optim.optimizers import apply_schedule, build_optimizer, lr_multiplier
from tests.errors import cli_error, last_error
from tests.harness import ROOT, env, losses, run_args, train, train_cmd

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


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_each_lr_group_is_a_group_of_its_own_under_both_optimizers(name):
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=128, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                            max_seq_len=32, tie_embeddings=False, value_embeds=True))
    cfg = OptimConfig(name=name, lr=3e-3, embed_lr=0.3, head_lr=0.01, warmup_steps=4)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    apply_schedule(opt, 2, 100, cfg, 64)
    m = lr_multiplier(2, 100, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    by_kind = {g["kind"]: g for g in opt.param_groups}
    assert len(by_kind) == len(opt.param_groups) == 4
    assert sorted(names[id(p)] for p in by_kind["embed"]["params"]) == sorted(
        ["tok_emb.weight", *(f"value_embeds.{i}.weight" for i in model.cfg.value_embed_layers())])
    assert [names[id(p)] for p in by_kind["head"]["params"]] == ["lm_head.weight"]
    assert {names[id(p)] for p in by_kind["matrix"]["params"]} == {
        n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2}
    assert by_kind["embed"]["lr"] == pytest.approx(0.3 * m) and by_kind["head"]["lr"] == pytest.approx(0.01 * m)
    # 0 = optim.lr: the gains follow the matrices' lr, Muon's under muon as AdamW's under adamw
    assert by_kind["matrix"]["lr"] == by_kind["scalar"]["lr"] == pytest.approx(3e-3 * m)
    grouped = [p for g in opt.param_groups for p in g["params"]]
    assert len(grouped) == len({id(p) for p in grouped}) == len(list(model.parameters()))


def test_a_head_lr_needs_an_untied_head_and_a_tied_table_takes_embed_lr():
    with pytest.raises(ConfigError, match=r"optim[.]head_lr.*tie_embeddings = false") as e:
        load_config(None, ["--optim.head_lr", "0.1"])
    assert "\n" not in str(e.value)
    tied = load_config(None, ["--optim.embed_lr", "0.1", "--optim.name", "muon", "--optim.lr", "3e-3"])
    assert "embedding table(s) at peak lr 0.1, the norms' gains at 0.003" in describe(tied, derive(tied, 1), 1000)
    cfg = load_config(None, ["--optim.head_lr", "0.1", "--model.tie_embeddings", "false"])
    assert "at peak lr 0.003, the head at 0.1" in describe(cfg, derive(cfg, 1), 1000)


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
    meta["config"]["train"]["time_budget_s"] = 0.0
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
    # eval reads it (its optim section, of the old keys, unread)
    out = tmp_path / "eval.json"
    ev = subprocess.run([*train_cmd([], module="lmforge.launch.cli"), "eval", "--ckpt", str(step2),
                         "--data", str(tiny_data), "--json", str(out)],
                        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
    assert ev.returncode == 0 and json.loads(out.read_text())["loss"] > 0, ev.stderr[-3000:]


OLD_CONFIGS = ROOT / "tests" / "data" / "configs_before_lr_keys"


@pytest.mark.parametrize("preset", ["tiny.toml", "gpt2_124m_modern.toml"])
def test_a_preset_from_before_the_lr_keys_changed_is_refused_in_one_line(tmp_path, capsys, preset):
    """The old tiny.toml (name = "muon", lr = 3e-3: the AdamW groups', Muon's the
    default muon_lr 0.02) was read as Muon at 3e-3; the old gpt2_124m_modern as Muon at 6e-4 (33x
    lower). A muon file that does not name optim.scalar_lr is such a file: refused, whatever the
    command line adds, and nothing trains."""
    old = OLD_CONFIGS / preset
    for extra in ([], ["--optim.scalar_lr", "0.1", "--optim.lr", "0.02"]):
        cli_error(capsys, ["train", "--config", str(old), "--log.out_dir", str(tmp_path / "r"),
                           *extra], "without optim.scalar_lr", "optim.embed_lr")
        assert not (tmp_path / "r").exists()
    copy = tmp_path / preset  # the same file with today's keys named is read
    copy.write_text(old.read_text().replace("[optim]\n", "[optim]\nscalar_lr = 3e-3\n"))
    assert load_config(copy).optim.name == "muon"


@pytest.mark.parametrize("text, key, needles", [
    ('[optim]\nname = "muon"\nlr = 3e-3\nmuon_lr = 0.05\nscalar_lr = 3e-3\n', "optim.muon_lr",
     ("optim.lr under optim.name = muon", "optim.embed_lr, head_lr, scalar_lr")),
    ("[train]\ntime_budget_s = 300.0\n", "train.time_budget_s",
     ("train.max_steps", "lmforge demo --minutes")),
])
def test_a_config_naming_a_gone_key_is_one_line_naming_todays(tmp_path, capsys, text, key, needles):
    """A resolved config.toml of an earlier lmforge names keys that are gone: nothing translates
    them; the error names what says the same today (a file or the command line)."""
    old = tmp_path / "config.toml"
    old.write_text(text)
    cli_error(capsys, ["train", "--config", str(old)], f"'{key}' is gone", *needles)
    cli_error(capsys, ["train", f"--{key}", "1"], f"'{key}' is gone", *needles)
    old.write_text('[optim]\nname = "adamw"\nlr = 0.001\n')  # adamw's keys meant what they mean
    o = load_config(old).optim
    assert (o.lr, o.embed_lr, o.head_lr, o.scalar_lr) == (0.001, 0.0, 0.0, 0.0)


def test_switching_a_presets_optimizer_needs_its_own_lr(tiny_data, capsys):
    """--optim.name adamw on tiny.toml trained AdamW's matrices at Muon's 0.03 (0.12
    at d_model 64 through the width rule) and the loss climbed without a word. Refused in one
    line naming --optim.lr; with it, the run is what it asks for. Keeping the preset's optimizer
    needs nothing."""
    base = ["train", "--config", str(ROOT / "configs" / "tiny.toml"), "--data.path",
            str(tiny_data), "--dry-run"]
    cli_error(capsys, [*base, "--optim.name=adamw", "--model.d_model", "64"],
              "--optim.name adamw without --optim.lr", "the file's for muon", "set --optim.lr")
    cli_error(capsys, ["train", "--optim.name", "muon"], "--optim.name muon without --optim.lr",
              "the default's for adamw")
    for ok in (["--optim.name", "adamw", "--optim.lr", "3e-3"], ["--optim.name", "muon"]):
        assert cli([*base, *ok]) == 0, capsys.readouterr().err
    capsys.readouterr()


@pytest.mark.parametrize("text, needle", [
    ("checkpoint = 3\n", "'checkpoint' must be a section"),
    ("optim = 3\n", "'optim' must be a section"),
    ("[checkpoint]\ninit_from = 5\n", "'checkpoint.init_from': 5 (expected str)"),
    ('[checkpoint]\ninit_from = ["a"]\n', "'checkpoint.init_from': ['a'] (expected str)"),
    ("data = 3\n", "'data' must be a section"),
])
def test_a_config_file_of_the_wrong_types_is_one_line(tmp_path, capsys, text, needle):
    """[checkpoint] and [data] were read (init_from, the data keys) before the
    file's types were checked: an AttributeError / TypeError traceback. Now one line, exit 2."""
    bad = tmp_path / "config.toml"
    bad.write_text(text)
    cli_error(capsys, ["train", "--config", str(bad)], needle)
