import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.model import GPT, ModelConfig


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=100, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64)
    return ModelConfig(**(base | kw))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(d_model=30, n_head=4), "not divisible by model.n_head"),
        (dict(n_head=4, n_kv_head=3), "not divisible by model.n_kv_head"),
        (dict(d_model=36, n_head=12, n_kv_head=12), "odd"),
        (dict(mlp="relu"), "model.mlp"),
        (dict(n_layer=0), "n_layer must be positive"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(d_mlp=0), "d_mlp"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kw)


def test_config_dict_round_trip_and_unknown_key():
    cfg = tiny(mlp="gelu", tie_embeddings=False)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="'n_layers'"):
        ModelConfig.from_dict({"n_layers": 2})


def test_unset_vocab_is_an_error():
    with pytest.raises(ValueError, match="vocab_size"):
        GPT(ModelConfig())


def test_derived_sizes():
    cfg = tiny(vocab_size=100, d_model=96, n_head=4)
    assert cfg.padded_vocab_size == 128 and cfg.head_dim == 24
    assert cfg.mlp_hidden % 64 == 0 and 8 * 96 / 3 <= cfg.mlp_hidden < 8 * 96 / 3 + 64
    assert tiny(mlp="gelu", d_model=96).mlp_hidden == 4 * 96
    assert tiny(d_mlp=80).mlp_hidden == 80


def test_no_biases_tied_head_and_depth_scaled_init():
    torch.manual_seed(0)
    cfg = tiny(n_layer=8, d_model=128, n_head=4)
    model = GPT(cfg)
    assert not any("bias" in name for name, _ in model.named_parameters())
    assert model.lm_head.weight is model.tok_emb.weight
    std = cfg.init_std
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(std, rel=0.05)
    resid = model.blocks[0].mlp.down.weight.std().item()
    assert resid == pytest.approx(std / math.sqrt(2 * cfg.n_layer), rel=0.05)


def test_logits_shape_and_loss_matches_cross_entropy():
    torch.manual_seed(0)
    model = GPT(tiny())
    idx = torch.randint(0, 100, (3, 16))
    targets = torch.randint(0, 100, (3, 16))
    targets[0, :5] = -100
    logits = model(idx)
    assert logits.shape == (3, 16, 100)  # padded columns sliced off
    for reduction in ("mean", "sum", "none"):
        ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)
        got = model(idx, targets, reduction=reduction)
        torch.testing.assert_close(got, ref.view(got.shape))
    assert model(idx, targets, reduction="none").shape == (3, 16)
    assert model(idx, targets, reduction="none")[0, :5].eq(0).all()


def test_padded_columns_never_count_in_the_loss():
    torch.manual_seed(0)
    cfg = tiny()
    model = GPT(cfg)
    idx = torch.randint(0, 100, (2, 16))
    loss = model(idx, idx)
    with torch.no_grad():  # make the padding rows of the tied head dominate the logits
        model.tok_emb.weight[cfg.vocab_size :] = 50.0
    assert model(idx).shape[-1] == cfg.vocab_size
    model.zero_grad()
    loss_big = model(idx, idx)
    loss_big.backward()
    torch.testing.assert_close(loss_big, loss)
    assert model.tok_emb.weight.grad[cfg.vocab_size :].abs().max() == 0


def test_causality():
    torch.manual_seed(0)
    model = GPT(tiny())
    idx = torch.randint(0, 100, (1, 24))
    t = 10
    changed = idx.clone()
    changed[0, t] = (idx[0, t] + 1) % 100
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert (a[:, t:] - b[:, t:]).abs().amax(-1).min() > 0


@pytest.mark.parametrize("tie", [True, False])
def test_meta_build_to_empty_init_weights(tie):
    cfg = tiny(tie_embeddings=tie)
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.tok_emb.weight.is_meta
    assert not any("rope" in k for k in model.state_dict())  # non-persistent buffers
    model.to_empty(device="cpu")
    model.init_weights()
    assert (model.lm_head.weight is model.tok_emb.weight) == tie
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.testing.assert_close(model.rope_cos, ref.rope_cos)
    out = model(torch.randint(0, 100, (2, 8)))
    assert torch.isfinite(out).all()


def test_param_counts_and_flops():
    cfg = tiny(n_layer=3, d_model=64, n_head=4, n_kv_head=1)
    tied, untied = GPT(cfg), GPT(tiny(n_layer=3, d_model=64, n_head=4, n_kv_head=1, tie_embeddings=False))
    table = cfg.padded_vocab_size * cfg.d_model
    assert untied.num_params() - tied.num_params() == table
    assert tied.num_params(exclude_embeddings=True) == untied.num_params(exclude_embeddings=True)
    assert tied.num_params() - tied.num_params(exclude_embeddings=True) == table
    matmul = sum(m.weight.numel() for m in tied.modules() if isinstance(m, torch.nn.Linear))
    norms = sum(p.numel() for n, p in tied.named_parameters() if "norm" in n)
    T = 32
    attn = 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T
    assert tied.flops_per_token(T) == 6 * (matmul + norms) + attn
    assert untied.flops_per_token(T) == tied.flops_per_token(T)
    assert "\n" not in tied.summary() and "GQA" not in tied.summary() and "MQA" in tied.summary()


def test_bf16_loss_keeps_one_fp32_logits_copy():
    torch.manual_seed(0)
    cfg = tiny(vocab_size=1000, d_model=32)
    model = GPT(cfg)
    B, T = 4, 64
    idx = torch.randint(0, 1000, (B, T))
    saved: dict[int, int] = {}

    def pack(t):
        if t.numel() >= B * T * cfg.vocab_size:  # logits-sized (the weights are far smaller)
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, idx)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert sum(saved.values()) <= 4 * B * T * cfg.padded_vocab_size
