"""The model's recipe options (model.qk_norm, mlp = "relu2", logit_softcap, zero_init,
value_embeds): each against a hand-written forward, their sizes and FLOPs, the optimizer they go
to, and KV-cache generation with all of them on."""

import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.model import GPT, ModelConfig, generate
from lmforge.model.model import cross_entropy
from lmforge.pipeline.config import OptimConfig
from lmforge.pipeline.optim.optimizers import build_optimizer, is_muon_matrix
from tests.test_generate import PROMPTS, greedy, greedy_reference, one_thread  # noqa: F401

VOCAB = 97
ALL_ON = dict(qk_norm=True, mlp="relu2", logit_softcap=3.0, zero_init=True, value_embeds=True,
              tie_embeddings=False)


def make(seed: int = 0, **kw) -> GPT:
    """Weights drawn large (zero_init's zeros included), so every option moves the logits."""
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**dict(vocab_size=VOCAB, n_layer=3, n_head=4, n_kv_head=2, d_model=32,
                                max_seq_len=64), **kw})
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return model


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x_BHTK, theta):
    """Rotation of the pairs (x[i], x[i + K/2]) by t / theta^(2i/K), written out."""
    K, T = x_BHTK.shape[-1], x_BHTK.shape[-2]
    angle = torch.arange(T)[:, None] / theta ** (torch.arange(K // 2) * 2 / K)[None]
    a, b = x_BHTK[..., : K // 2], x_BHTK[..., K // 2 :]
    return torch.cat((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), -1)


def reference_logits(model: GPT, idx_BT: torch.Tensor) -> torch.Tensor:
    """The forward of an all-options model from its state dict, op by op: per-head RMSNorm of q
    and k before RoPE, value embeddings added to the values of layers L-1, L-3, ..., relu(x)²
    MLP, untied head, c·tanh(logits / c)."""
    cfg, sd = model.cfg, model.state_dict()
    H, G, K, eps = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.norm_eps
    B, T = idx_BT.shape
    x = sd["tok_emb.weight"][idx_BT]
    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        h = rms(x, sd[p + "attn_norm.weight"], eps)
        q, k, v = (h @ sd[p + "attn.qkv.weight"].T).split([H * K, G * K, G * K], -1)
        q = rms(q.view(B, T, H, K), sd[p + "attn.q_norm.weight"], eps).transpose(1, 2)
        k = rms(k.view(B, T, G, K), sd[p + "attn.k_norm.weight"], eps).transpose(1, 2)
        if (cfg.n_layer - 1 - i) % 2 == 0:
            v = v + sd[f"value_embeds.{i}.weight"][idx_BT]
        v = v.view(B, T, G, K).transpose(1, 2)
        q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
        k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(K)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + (att @ v).transpose(1, 2).reshape(B, T, H * K) @ sd[p + "attn.proj.weight"].T
        h = rms(x, sd[p + "mlp_norm.weight"], eps)
        x = x + F.relu(h @ sd[p + "mlp.up.weight"].T).pow(2) @ sd[p + "mlp.down.weight"].T
    logits = (rms(x, sd["norm_f.weight"], eps) @ sd["lm_head.weight"].T)[..., : cfg.vocab_size]
    return cfg.logit_softcap * torch.tanh(logits / cfg.logit_softcap)


def test_all_options_match_a_hand_written_forward():
    model = make(**ALL_ON)
    idx = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        ours, ref = model(idx), reference_logits(model, idx)
        loss = model(idx, idx)
    assert ours.abs().max() < ALL_ON["logit_softcap"] and ours.std() > 0.5
    assert (ours - ref).abs().max() < 1e-4
    assert loss.item() == pytest.approx(F.cross_entropy(ref.flatten(0, 1), idx.flatten()).item(), abs=1e-5)
    # Control: each option the reference writes out is really in play.
    for off in (dict(qk_norm=False), dict(value_embeds=False), dict(mlp="gelu", d_mlp=192),
                dict(logit_softcap=0.0)):
        other = make(**{**ALL_ON, **off})
        other.load_state_dict(model.state_dict(), strict=False)
        with torch.no_grad():
            assert (other(idx) - ref).abs().max() > 1e-2, off


def test_config_checks_and_relu2_width():
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="model.logit_softcap"):
            ModelConfig(vocab_size=VOCAB, logit_softcap=bad)
    swiglu, relu2 = make(), make(mlp="relu2")
    mlp_params = [sum(p.numel() for p in m.blocks[0].mlp.parameters()) for m in (swiglu, relu2)]
    assert mlp_params[0] == mlp_params[1]  # two matrices 3/2 as wide as SwiGLU's three
    assert ModelConfig(mlp="relu2", d_mlp=80).mlp_hidden == 80
    assert ModelConfig.from_dict(make(**ALL_ON).cfg.to_dict()) == make(**ALL_ON).cfg


def test_zero_init_zeroes_residual_outputs_and_an_untied_head():
    torch.manual_seed(0)
    untied = GPT(ModelConfig(vocab_size=VOCAB, d_model=32, n_layer=2, zero_init=True, tie_embeddings=False))
    for block in untied.blocks:
        assert not block.attn.proj.weight.any() and not block.mlp.down.weight.any()
        assert block.attn.qkv.weight.std() > 0.01
    assert not untied.lm_head.weight.any()
    idx = torch.randint(0, VOCAB, (2, 10))
    assert untied(idx, idx).item() == pytest.approx(math.log(VOCAB))  # uniform logits
    tied = GPT(ModelConfig(vocab_size=VOCAB, d_model=32, n_layer=2, zero_init=True))
    assert tied.tok_emb.weight.std() > 0.01  # the head is the embedding: not zeroed


def test_softcap_reaches_the_loss_only_when_set():
    idx = torch.randint(0, VOCAB, (2, 12))

    def plain_loss(h_BTD, w_VD, targets_BT, vocab_size, reduction="mean", ignore_index=-100):
        return cross_entropy(h_BTD, w_VD, targets_BT, vocab_size, reduction, ignore_index)

    uncapped = make()
    assert uncapped(idx, idx, loss_fn=plain_loss) == uncapped(idx, idx)  # no softcap keyword sent
    capped = make(logit_softcap=2.0)
    with pytest.raises(TypeError, match="softcap"):
        capped(idx, idx, loss_fn=plain_loss)
    with torch.no_grad():
        logits = capped(idx)
        raw = capped.lm_head(capped.hidden(idx))[..., :VOCAB]
    assert (logits - 2.0 * torch.tanh(raw / 2.0)).abs().max() < 1e-6 and raw.abs().max() > 2.5
    per_token = capped(idx, idx, reduction="none")
    assert (per_token - F.cross_entropy(logits.flatten(0, 1), idx.flatten(), reduction="none")
            .view(2, 12)).abs().max() < 1e-5


def test_value_embeddings_count_as_embeddings():
    plain, ve, qk = make(), make(value_embeds=True), make(qk_norm=True)
    assert list(ve.value_embeds) == ["0", "2"]  # every other layer, the last included
    table = ve.value_embeds["0"].weight
    assert table.shape == (ve.cfg.padded_vocab_size, ve.cfg.n_kv_head * ve.cfg.head_dim)
    assert ve.num_params() == plain.num_params() + 2 * table.numel()
    assert ve.num_params(exclude_embeddings=True) == plain.num_params(exclude_embeddings=True)
    assert ve.flops_per_token(64) == plain.flops_per_token(64)  # lookups: no FLOPs
    extra = 2 * qk.cfg.n_layer * qk.cfg.head_dim  # a q and a k gain per layer
    assert qk.num_params(exclude_embeddings=True) == plain.num_params(exclude_embeddings=True) + extra
    assert qk.flops_per_token(64) == plain.flops_per_token(64) + 6 * extra


def test_muon_gets_only_block_matrices():
    model = make(**ALL_ON)
    opt = build_optimizer(model, OptimConfig(name="muon"), torch.device("cpu"))
    adamw, muon = opt.optimizers
    by_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    by_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[i] for i in by_muon} == {n for n, p in model.named_parameters() if is_muon_matrix(n, p)}
    for table in model.value_embeds.values():
        assert id(table.weight) in by_adamw  # embeddings, like tok_emb
    for block in model.blocks:
        assert id(block.attn.q_norm.weight) in by_adamw and id(block.attn.k_norm.weight) in by_adamw
        assert id(block.mlp.up.weight) in by_muon
    assert by_adamw | by_muon == set(names) and not by_adamw & by_muon


def test_cache_equals_full_recompute_with_every_option():
    model = make(**ALL_ON)
    n = 40
    with torch.no_grad():
        ref = [greedy_reference(model, p, n) for p in PROMPTS]
    assert len({tuple(r) for r in ref}) == len(PROMPTS)
    assert generate(model, PROMPTS, greedy(n)) == ref
    assert generate(model, PROMPTS, greedy(n), use_cache=False) == ref


def test_compiled_equals_eager_with_every_option():
    """torch.compile of the whole model, as training compiles it (fullgraph): the same loss and
    gradients as eager with every option on."""
    model = make(**ALL_ON)
    idx = torch.randint(0, VOCAB, (2, 24))
    eager = model(idx, idx)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)(idx, idx)
    compiled.backward()
    assert compiled.item() == pytest.approx(eager.item(), abs=1e-5)
    worst = max((p.grad - grads[n]).abs().max().item() for n, p in model.named_parameters())
    assert worst < 1e-4 and all(g.any() for g in grads.values())
