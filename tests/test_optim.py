"""Optimizers and schedules, in one process: the schedules' first, peak and last values, the
Muon/AdamW parameter split, Muon's fp32 step against torch's, config checks, decoupled weight
decay on the matrices only. The lr groups: tests/test_lr_groups.py; a resume's optimizer state
and retuned lrs: tests/test_resume.py."""

from __future__ import annotations

import pytest
import torch

from lmforge.model import GPT, ModelConfig
from lmforge.pipeline.config import ConfigError, OptimConfig, derive, describe, load_config
from lmforge.pipeline.optim.optimizers import (
    Muon,
    Optimizers,
    apply_schedule,
    build_optimizer,
    lr_multiplier,
    muon_momentum_at,
)
from tests.schedule import lr_at


def test_cosine_peaks_for_one_step_and_ends_at_the_floor():
    cos = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=4, schedule="cosine")
    lrs = [lr_at(s, 10, cos) for s in range(10)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # first 1/warmup, peak at step 3
    assert lrs[4] < 1.0  # the peak lasts one step, not two
    assert lrs[-1] == pytest.approx(0.1)  # the last update runs at the floor
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:]))
    # half-way between the peak (step 3) and the last step (9): the mean of peak and floor
    assert lr_at(6, 10, cos) == pytest.approx(0.55)
    no_warmup = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=0)
    assert lr_at(0, 10, no_warmup) == 1.0 and lr_at(9, 10, no_warmup) == pytest.approx(0.1)


def test_wsd_first_peak_and_last():
    wsd = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=4, schedule="wsd", decay_fraction=0.2)
    lrs = [lr_at(s, 20, wsd) for s in range(20)]
    assert lrs[0] == pytest.approx(0.25) and lrs[3] == 1.0
    assert lrs[15] == 1.0 and lrs[16] < 1.0  # stable until the last 4 steps
    assert lrs[-1] == pytest.approx(0.1)


def test_each_group_follows_its_own_peak_and_muon_momentum_warms_up(tiny_model):
    cfg = OptimConfig(name="muon", lr=0.05, embed_lr=3e-3, scalar_lr=3e-3, warmup_steps=4,
                      muon_momentum_start=0.85, muon_momentum=0.95, muon_momentum_warmup_steps=10)
    opt = build_optimizer(tiny_model, cfg, torch.device("cpu"))
    logged = apply_schedule(opt, 1, 100, cfg, tiny_model.cfg.d_model)
    m = lr_multiplier(1, 100, cfg)
    assert logged == pytest.approx(0.05 * m)  # the matrices' lr: Muon's
    muon_groups = list(opt)[1].param_groups
    adam_groups = list(opt)[0].param_groups
    assert [g["kind"] for g in muon_groups] == ["matrix"]
    assert all(g["lr"] == pytest.approx(0.05 * m) for g in muon_groups)
    assert all(g["lr"] == pytest.approx(3e-3 * m) for g in adam_groups)
    assert muon_groups[0]["momentum"] == pytest.approx(0.86)
    assert muon_momentum_at(0, cfg) == 0.85 and muon_momentum_at(10, cfg) == 0.95


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=128, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                           max_seq_len=32))


def test_muon_gets_the_block_matrices_and_adamw_the_rest(tiny_model):
    opt = build_optimizer(tiny_model, OptimConfig(name="muon"), torch.device("cpu"))
    adamw, muon = list(opt)
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, torch.optim.Muon)
    names = {id(p): n for n, p in tiny_model.named_parameters()}
    muon_names = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    assert muon_names == {n for n, p in tiny_model.named_parameters()
                          if n.startswith("blocks.") and p.ndim == 2}
    embed, scalar = adamw.param_groups
    assert [names[id(p)] for p in embed["params"]] == ["tok_emb.weight"]  # = the tied LM head
    assert (embed["kind"], scalar["kind"]) == ("embed", "scalar")
    assert embed["weight_decay"] == 0.1 and scalar["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("norm.weight") or names[id(p)] == "norm_f.weight"
               for p in scalar["params"])
    assert isinstance(build_optimizer(tiny_model, OptimConfig(), torch.device("cpu")),
                      torch.optim.AdamW)


def _three_steps(opt_cls, **kw) -> torch.Tensor:
    """How far three steps move a 48x24 matrix (momentum accumulates over them)."""
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(48, 24))
    start = w.detach().clone()
    opt = opt_cls([w], lr=0.02, momentum=0.9, weight_decay=0.1, **kw)
    for _ in range(3):  # a new gradient each step, so Nesterov and plain momentum differ
        w.grad = torch.randn(48, 24)
        opt.step()
    return w.detach() - start


def test_muon_fp32_step_is_torchs_update_and_bf16_is_torchs_step():
    reference = _three_steps(torch.optim.Muon)
    assert torch.equal(_three_steps(Muon, ns_dtype=torch.bfloat16), reference)
    fp32 = _three_steps(Muon, ns_dtype=torch.float32)
    # Only the precision of the orthogonalisation differs (bf16 keeps 8 mantissa bits).
    assert (fp32 - reference).abs().max() <= 2e-2 * reference.abs().max()
    assert not torch.equal(fp32, reference)


def test_optimizers_step_and_zero_grad_all(tiny_model):
    opt = build_optimizer(tiny_model, OptimConfig(name="muon"), torch.device("cpu"))
    assert isinstance(opt, Optimizers)
    before = [p.detach().clone() for p in tiny_model.parameters()]
    tiny_model(torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))).backward()
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, tiny_model.parameters()))
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in tiny_model.parameters())


@pytest.mark.parametrize("override, key", [
    (["--optim.muon_lr", "0.02"], "'optim.muon_lr' is gone: Muon's lr is optim.lr"),
    (["--optim.scalar_lr", "inf"], "optim.scalar_lr"),
    (["--optim.lr_ref_width", "-1"], "optim.lr_ref_width"),
    (["--optim.muon_momentum", "1.0"], "optim.muon_momentum"),
    (["--optim.muon_momentum_start", "-0.1"], "optim.muon_momentum_start"),
    (["--optim.muon_momentum_warmup_steps", "-1"], "optim.muon_momentum_warmup_steps"),
    (["--optim.muon_weight_decay", "nan"], "optim.muon_weight_decay"),
    (["--optim.name", "sgd"], "optim.name"),
])
def test_bad_muon_settings_are_one_line_errors(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("'", ".")) as e:
        load_config(None, override)
    assert "\n" not in str(e.value)


def test_describe_names_the_optimizer():
    cfg = load_config(None, ["--optim.name", "muon", "--optim.lr", "0.02"])
    text = describe(cfg, derive(cfg, 1), 1000)
    assert "optimizer: Muon for the block matrices (peak lr 0.02" in text
    assert "optimizer: AdamW" in describe(load_config(None, []), derive(cfg, 1), 1000)


def test_weight_decay_on_matrices_only():
    """One AdamW step with zero gradients moves a parameter by its decoupled weight decay only:
    every matrix shrinks by (1 - lr * weight_decay), the norm gains stay exactly 1."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=100, n_layer=2, n_head=4, n_kv_head=2, d_model=64))
    cfg = OptimConfig(lr=0.1, weight_decay=0.5)
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    gains = [n for n, p in model.named_parameters() if p.ndim == 1]
    assert len(gains) == 2 * 2 + 1  # two norms per block, the final norm
    for name, p in model.named_parameters():
        expected = before[name] * (1 - cfg.lr * cfg.weight_decay) if p.ndim >= 2 else before[name]
        assert torch.allclose(p.detach(), expected, rtol=1e-6, atol=0), name
