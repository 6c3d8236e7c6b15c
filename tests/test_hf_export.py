"""Export to Hugging Face (lmforge.model.hf), read back by transformers with our model's logits:
Llama (MHA, GQA, MQA, tied or not), QK-norm as Qwen3, Llama 3.1's rope scaling and Qwen2's biases,
on the oldest transformers pyproject allows and the installed one; the import of what it writes;
and an option no Hugging Face model holds, refused by name by `export_hf` and by `lmforge export`
(one error line, nothing written)."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.launch.cli import main as lmforge
from lmforge.model import GPT, ModelConfig
from lmforge.model.hf import export_hf, hf_config_dict
from lmforge.pipeline.checkpoint.format import CheckpointMeta, save_consolidated
from lmforge.pipeline.checkpoint.hf_init import load_hf_model
from lmforge.pipeline.config import config_from_dict
from lmforge.pipeline.errors import CheckpointError
from tests.errors import cli_error

transformers = pytest.importorskip("transformers")

VOCAB = 203  # not a multiple of 64: the padding rows must be dropped and restored
TOL = 1e-4
ROOT = Path(__file__).resolve().parents[1]


def make_model(n_kv_head: int, tie: bool = True) -> GPT:
    torch.manual_seed(n_kv_head)
    cfg = ModelConfig(
        vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=n_kv_head, d_model=64,
        max_seq_len=64, rope_theta=500.0, norm_eps=1e-6, tie_embeddings=tie,
    )
    return with_large_weights(GPT(cfg))


def with_large_weights(model: GPT) -> GPT:
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
        back = load_hf_model(tmp_path)(idx)
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
    ours = load_hf_model(tmp_path)
    assert ours.cfg.n_kv_head == n_kv_head and ours.cfg.mlp_hidden == 96
    idx = torch.randint(0, 150, (2, 40))
    with torch.no_grad():
        theirs, mine = hf(idx).logits, ours(idx)
    assert mine.shape == theirs.shape
    assert (mine - theirs).abs().max() < TOL


def test_config_json_is_hf_config_dict(tmp_path):
    model = make_model(2)
    export_hf(model, model.cfg, tmp_path, dtype=torch.bfloat16)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written == hf_config_dict(model.cfg, torch.bfloat16)
    assert written["vocab_size"] == VOCAB and written["dtype"] == "bfloat16"


def test_import_refuses_unsupported_variants(tmp_path):
    model = make_model(2)
    export_hf(model, model.cfg, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match='rope_type = "linear"'):
        load_hf_model(tmp_path)


# --------------------------------------------------------------------------------------------
# QK-norm exports as Qwen3; an option no Hugging Face model holds is refused by name.

needs_qwen3 = pytest.mark.skipif(not hasattr(transformers, "Qwen3ForCausalLM"),
                                 reason="Qwen3 needs transformers >= 4.51")
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


@needs_qwen3
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


@needs_qwen3
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


# --------------------------------------------------------------------------------------------
# The export read by the oldest transformers pyproject allows (>= 4.45) as well as the installed
# one: 4.x reads a top-level rope_theta (and defaults to 10000 without it) and needs eos in
# config.json / generation_config.json to stop generating at end-of-text.

OLDEST_TRANSFORMERS = ["transformers==4.45.2", "tokenizers==0.20.3", "huggingface_hub==0.36.2"]
OLD_CACHE = Path(sys.prefix) / "lmforge-test-cache" / "-".join(OLDEST_TRANSFORMERS).replace("=", "")
LONG_ROPE_THETA = 500_000.0


def hf_check(out_dirs: list[Path], io: dict) -> list[dict]:
    """What the transformers on sys.path makes of each exported directory. Runs in this process
    for the installed version, in a fresh one (`python -m tests.test_hf_export`) for the oldest."""
    results = []
    for out_dir in out_dirs:
        model = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
        tok = transformers.AutoTokenizer.from_pretrained(out_dir)
        prompt = io["prompt"]
        with torch.no_grad():
            logits = model(io["idx"]).logits
            gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8)
        results.append({
            "version": transformers.__version__,
            "max_diff": (logits - io["logits"]).abs().max().item(),
            "generated": gen[0, prompt.shape[1]:].tolist(),
            "config_eos": model.config.eos_token_id,
            "generation_eos": model.generation_config.eos_token_id,
            "tokenizer_eos": tok.eos_token_id,
            "encoded": tok.encode(io["text"], add_special_tokens=False),
        })
    return results


def oldest_transformers() -> Path:
    """The oldest allowed transformers, pip-installed once into the environment's cache."""
    if OLD_CACHE.is_dir():
        return OLD_CACHE
    tmp = OLD_CACHE.with_name(OLD_CACHE.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    # --no-deps: torch, safetensors, numpy, regex, requests... come from the environment.
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                          "--disable-pip-version-check", "--target", str(tmp), *OLDEST_TRANSFORMERS],
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        reason = f"cannot pip-install {OLDEST_TRANSFORMERS}: {res.stderr.strip()[-500:]}"
        if os.environ.get("CI"):
            pytest.fail(reason)  # CI has PyPI: a missing old version must not pass silently
        pytest.skip(reason)
    tmp.rename(OLD_CACHE)
    return OLD_CACHE


def hf_check_oldest(out_dirs: list[Path], io: dict) -> list[dict]:
    io_path = out_dirs[0].parent / "io.pt"
    torch.save(io, io_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(oldest_transformers()), str(ROOT)])
    res = subprocess.run([sys.executable, "-m", "tests.test_hf_export", str(io_path), *map(str, out_dirs)],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def greedy(model: GPT, prompt: list[int], n: int) -> list[int]:
    """Reference greedy decoding: the full forward at every step, no cache."""
    idx = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            idx = torch.cat([idx, model(idx)[:, -1:].argmax(-1)], dim=1)
    return idx[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def long_rope_export(tiny_data, tmp_path_factory):
    """`lmforge export` of a GPT with rope_theta = 500000 on the tiny dataset's tokenizer, and
    the inputs/outputs the transformers side must reproduce."""
    from lmforge.data_prep.tokenizer import eot_id, load_tokenizer_dir
    from lmforge.launch.cli import main as lmforge
    from lmforge.pipeline.checkpoint.format import CheckpointMeta, save_consolidated
    from lmforge.pipeline.config import JobConfig

    enc = load_tokenizer_dir(tiny_data / "tokenizer")
    cfg = ModelConfig(vocab_size=enc.n_vocab, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                      max_seq_len=64, rope_theta=LONG_ROPE_THETA)
    torch.manual_seed(0)
    model = with_large_weights(GPT(cfg))
    root = tmp_path_factory.mktemp("export")
    meta = CheckpointMeta(step=1, model=cfg, config=JobConfig(), lineage="test")
    save_consolidated(root / "final", model.state_dict(), meta, tiny_data / "tokenizer")
    assert lmforge(["export", "--ckpt", str(root / "final"), "--hf", str(root / "hf")]) == 0
    torch.manual_seed(1)
    idx = torch.randint(0, enc.n_vocab, (2, 40))
    with torch.no_grad():
        logits = model(idx)
    # The stop token: the first greedy token not produced before it, so the expected output is
    # exactly the greedy tokens up to and including it.
    prompt = [eot_id(enc), *enc.encode_ordinary("def main(")]
    ours = greedy(model, prompt, 8)
    stop_at = next(i for i in range(2, 8) if ours[i] not in ours[:i])
    text = "import os\nx = 12345 + y  # héllo"
    io = {"idx": idx, "logits": logits, "prompt": torch.tensor([prompt]), "text": text}
    return model, root / "hf", io, ours[: stop_at + 1], enc.encode_ordinary(text), eot_id(enc)


@pytest.mark.parametrize("which", ["installed", "oldest"])
def test_export_parity_and_eos_on_oldest_and_newest_transformers(long_rope_export, which):
    model, out_dir, io, expected, encoded, eot = long_rope_export
    written = json.loads((out_dir / "config.json").read_text())
    assert written["rope_theta"] == written["rope_parameters"]["rope_theta"] == LONG_ROPE_THETA
    generation = json.loads((out_dir / "generation_config.json").read_text())
    assert written["eos_token_id"] == generation["eos_token_id"] == eot
    # The stop token is forced to be the model's 3rd..8th greedy token: re-export with it as eos.
    stop_dir = out_dir.parent / f"stop_{which}"
    export_hf(model, model.cfg, stop_dir, eos_token_id=expected[-1])
    shutil.copy(out_dir / "tokenizer.json", stop_dir)
    shutil.copy(out_dir / "tokenizer_config.json", stop_dir)
    check = hf_check_oldest if which == "oldest" else hf_check
    stopped, exported = check([stop_dir, out_dir], io)
    if which == "oldest":
        assert stopped["version"] == OLDEST_TRANSFORMERS[0].split("==")[1]
    assert stopped["max_diff"] < TOL, stopped
    assert stopped["generated"] == expected, "generate() must stop right after the eos token"
    # The lmforge export itself: eos is end-of-text, in the config and the tokenizer alike.
    assert exported["max_diff"] < TOL
    assert exported["config_eos"] == exported["generation_eos"] == exported["tokenizer_eos"] == eot
    assert exported["encoded"] == encoded


@pytest.mark.parametrize("which", ["installed", "oldest"])
def test_rope_scaling_and_qkv_bias_exports_on_oldest_and_newest_transformers(long_rope_export, which):
    """Llama 3.1's rope scaling (config.json's rope_scaling for 4.x, rope_parameters for 5.x) and
    Qwen2's biases, read back by both transformers with the model's logits."""
    model, out_dir, io, _, _, eot = long_rope_export
    options = {"llama3": {"rope_scaling": "llama3", "rope_scaling_factor": 32.0, "rope_original_max_len": 64},
               "qwen2": {"qkv_bias": True}}
    check = hf_check_oldest if which == "oldest" else hf_check
    for name, option in options.items():
        torch.manual_seed(0)
        cfg = replace(model.cfg, **option)
        scaled = with_large_weights(GPT(cfg))
        d = out_dir.parent / f"{name}_{which}"
        export_hf(scaled, cfg, d, eos_token_id=eot)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(out_dir / f, d)
        with torch.no_grad():
            logits = scaled(io["idx"])
        (result,) = check([d], io | {"logits": logits})
        assert result["max_diff"] < TOL, (name, result)
        assert json.loads((d / "config.json").read_text())["model_type"] == {"llama3": "llama"}.get(name, name)


if __name__ == "__main__":  # hf_check_oldest's subprocess: IO_PATH OUT_DIR...
    print(json.dumps(hf_check([Path(d) for d in sys.argv[2:]], torch.load(sys.argv[1]))))
