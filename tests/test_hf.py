import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import GPT, ModelConfig
from model.hf import export_hf, hf_config_dict, import_hf

transformers = pytest.importorskip("transformers")

VOCAB = 203  # not a multiple of 64: the padding rows must be dropped and restored
TOL = 1e-4


def make_model(n_kv_head: int, tie: bool = True) -> GPT:
    torch.manual_seed(n_kv_head)
    cfg = ModelConfig(
        vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=n_kv_head, d_model=64,
        max_seq_len=64, rope_theta=500.0, norm_eps=1e-6, tie_embeddings=tie,
    )
    model = GPT(cfg)
    # Weights large enough that attention is far from uniform, so a RoPE or head-layout mistake
    # moves the logits well past the tolerance (see test_wrong_rope_layout_is_caught).
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3 if p.dim() == 2 else 1.0)
    return model


def hf_logits(out_dir, idx):
    hf = transformers.LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(idx).logits


@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_export_matches_transformers(tmp_path, n_kv_head, tie):
    model = make_model(n_kv_head, tie)
    export_hf(model, model.cfg, tmp_path)
    idx = torch.randint(0, VOCAB, (2, 33))
    with torch.no_grad():
        ours = model(idx)
    theirs = hf_logits(tmp_path, idx)
    assert theirs.shape == ours.shape == (2, 33, VOCAB)
    assert ours.std() > 1  # logits far from flat: the comparison has something to compare
    assert (ours - theirs).abs().max() < TOL
    with torch.no_grad():
        back = import_hf(tmp_path)(idx)
    assert (back - ours).abs().max() < TOL


def test_wrong_rope_layout_is_caught(tmp_path):
    """Control: permute the exported q/k rows the way an interleaved-pairs converter would
    (the Meta → HF permutation, wrongly applied to our half-split layout); parity must break."""
    model = make_model(2)
    export_hf(model, model.cfg, tmp_path)
    K = model.cfg.head_dim
    to_interleaved = torch.stack([torch.arange(K // 2), torch.arange(K // 2, K)], dim=1).flatten()
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    for name, w in tensors.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = w.view(-1, K, w.shape[1])[:, to_interleaved].reshape(w.shape).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    idx = torch.randint(0, VOCAB, (1, 33))
    with torch.no_grad():
        ours = model(idx)
    assert (ours - hf_logits(tmp_path, idx)).abs().max() > 100 * TOL


@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_import_of_hf_initialised_llama(tmp_path, n_kv_head):
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=150, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=n_kv_head, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = import_hf(tmp_path)
    assert ours.cfg.n_kv_head == n_kv_head and ours.cfg.mlp_hidden == 96
    idx = torch.randint(0, 150, (2, 40))
    with torch.no_grad():
        theirs, mine = hf(idx).logits, ours(idx)
    assert mine.shape == theirs.shape
    assert (mine - theirs).abs().max() < TOL


def test_config_json_and_gelu_refused(tmp_path):
    model = make_model(2)
    export_hf(model, model.cfg, tmp_path, dtype=torch.bfloat16)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written == hf_config_dict(model.cfg, torch.bfloat16)
    assert written["vocab_size"] == VOCAB and written["dtype"] == "bfloat16"
    gelu = ModelConfig(vocab_size=VOCAB, mlp="gelu")
    with pytest.raises(ValueError, match="swiglu"):
        export_hf(GPT(gelu), gelu, tmp_path / "gelu")
    assert not (tmp_path / "gelu").exists()


def test_import_refuses_unsupported_variants(tmp_path):
    model = make_model(2)
    export_hf(model, model.cfg, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type"):
        import_hf(tmp_path)
