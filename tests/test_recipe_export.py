"""Export of the recipe options: QK-norm maps to Hugging Face Qwen3 with the logits of our model
(as the Llama export in tests/test_hf.py); an option no Hugging Face model holds is refused by
name, by `export_hf` and by `lmforge export` (one error line, nothing written)."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.launch.cli import main as lmforge
from lmforge.model import GPT, ModelConfig
from lmforge.model.hf import export_hf, hf_config_dict
from lmforge.pipeline.checkpoint.format import CheckpointMeta, save_consolidated
from lmforge.pipeline.checkpoint.hf_init import load_hf_model
from lmforge.pipeline.config import config_from_dict
from tests.errors import cli_error
from tests.test_hf import TOL, VOCAB, with_large_weights

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3ForCausalLM"):
    pytest.skip("Qwen3 needs transformers >= 4.51", allow_module_level=True)

REFUSED = [
    (dict(mlp="relu2"), "model.mlp='relu2'"),
    (dict(mlp="gelu"), "model.mlp='gelu'"),
    (dict(logit_softcap=15.0), "model.logit_softcap=15.0"),
    (dict(value_embeds=True), "model.value_embeds=true"),
]


def qk_model(n_kv_head: int, tie: bool) -> GPT:
    torch.manual_seed(n_kv_head + 10 * tie)
    cfg = ModelConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=n_kv_head, d_model=64,
                      max_seq_len=64, rope_theta=500.0, norm_eps=1e-6, tie_embeddings=tie,
                      qk_norm=True, zero_init=True)
    return with_large_weights(GPT(cfg))


@pytest.mark.parametrize("n_kv_head", [4, 2], ids=["MHA", "GQA"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_qk_norm_exports_as_qwen3_with_the_same_logits(tmp_path, n_kv_head, tie):
    model = qk_model(n_kv_head, tie)
    export_hf(model, model.cfg, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "qwen3" and written["tie_word_embeddings"] == tie
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    idx = torch.randint(0, VOCAB, (2, 33))
    with torch.no_grad():
        ours, theirs, back = model(idx), hf(idx).logits, load_hf_model(tmp_path)(idx)
    assert ours.std() > 1
    assert (ours - theirs).abs().max() < TOL
    assert (back - ours).abs().max() < TOL
    # Control: the q/k gains matter, so a Llama reading of the same weights is off.
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q_norm.weight.fill_(1.0)
            block.attn.k_norm.weight.fill_(1.0)
        assert (model(idx) - theirs).abs().max() > 100 * TOL


def test_default_model_still_exports_as_llama():
    assert hf_config_dict(ModelConfig(vocab_size=VOCAB))["model_type"] == "llama"
    assert hf_config_dict(ModelConfig(vocab_size=VOCAB, zero_init=True))["model_type"] == "llama"


@pytest.mark.parametrize("option, needle", REFUSED, ids=[n for _, n in REFUSED])
def test_options_without_a_counterpart_are_refused_by_name(tmp_path, option, needle):
    cfg = ModelConfig(vocab_size=VOCAB, n_layer=2, d_model=32, max_seq_len=32, **option)
    with pytest.raises(ValueError, match="no Hugging Face counterpart") as info:
        export_hf(GPT(cfg), cfg, tmp_path / "out")
    assert needle in str(info.value)
    assert not (tmp_path / "out").exists()


def test_lmforge_export_refuses_in_one_line(tiny_data, tmp_path, capsys):
    vocab = json.loads((tiny_data / "manifest.json").read_text())["vocab_size"]
    cfg = ModelConfig(vocab_size=vocab, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                      max_seq_len=64, qk_norm=True, mlp="relu2")
    meta = CheckpointMeta(step=1, model=cfg, config=config_from_dict({"data": {"seq_len": 32}}),
                          lineage="test")
    ckpt = save_consolidated(tmp_path / "final", GPT(cfg).state_dict(), meta, tiny_data / "tokenizer")
    out = tmp_path / "hf"
    err = cli_error(capsys, ["export", "--ckpt", str(ckpt), "--hf", str(out)], "model.mlp='relu2'",
                    "model.mlp='swiglu'")
    assert "Traceback" not in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["final"]
    # The same model without relu2 (QK-norm alone) exports, as Qwen3.
    cfg_ok = ModelConfig(**{**cfg.to_dict(), "mlp": "swiglu"})
    meta_ok = CheckpointMeta(step=1, model=cfg_ok, config=meta.config, lineage="test")
    ok = save_consolidated(tmp_path / "ok", GPT(cfg_ok).state_dict(), meta_ok, tiny_data / "tokenizer")
    assert lmforge(["export", "--ckpt", str(ok), "--hf", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
