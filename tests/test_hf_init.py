"""Continued pretraining from a Hugging Face directory (`checkpoint.init_from`, `--ckpt hf:DIR`):
the loaded model is transformers' (logits, first loss, greedy tokens, eval loss), a trained run
exports the same architecture back, a resume resumes, 2 ranks (DDP, FSDP2) equal one process, and
bad directories are one `error:` line with nothing written."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch

from bench.runs import env, losses, max_diff, train
from lmforge.data_prep.tokenizer import load_tokenizer
from lmforge.pipeline.checkpoint.hf_init import load_hf_model
from lmforge.pipeline.config import load_config
from lmforge.pipeline.data.windows import TokenWindows
from lmforge.pipeline.errors import CheckpointError
from lmforge.pipeline.inference import load_for_inference
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.train import Trainer
from tests.conftest import ROOT, built_once
from tests.hf_dirs import hf_encode, make_model, make_tokenizer, run_args

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TOL = 1e-4
CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
MODELS = {  # name: make_model's arguments
    "llama_tied_mha": {"tie": True, "n_kv_head": 4, "shard": None},
    "llama_gqa_sharded": {"tie": False, "n_kv_head": 2},
    # Qwen3-0.6B's shape in small: head_dim apart from d_model / n_head, and an embedding table
    # padded past the tokenizer's ids (151,936 rows for 151,669 ids there)
    "qwen3_head_dim": {"arch": "qwen3", "tie": False, "n_kv_head": 2, "head_dim": 32, "vocab": 700},
}
ARCH_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
             "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "tie_word_embeddings", "rms_norm_eps", "max_position_embeddings")


@pytest.fixture(scope="session")
def hf_root(tmp_path_factory):
    def build(root):
        tok = make_tokenizer(root / "tok")
        for i, (name, kw) in enumerate(MODELS.items()):
            make_model(root / name, seed=i, tok_dir=tok, **kw)
        for name, skip in (("data", 0), ("data2", 150)):
            res = lmforge("prepare", "--source", "builtin:pystdlib", "--max-docs", str(120 + skip),
                          "--val-docs", "12", "--tokenizer", f"hf:{tok}", "--out", str(root / name),
                          "--workers", "1")
            assert res.returncode == 0, res.stderr
    return built_once(tmp_path_factory, "hf_init", build)


def lmforge(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.launch.cli", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=timeout)


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(hf_root, name):
    idx = torch.randint(0, 640, (2, 48))
    with torch.no_grad():
        ours, theirs = load_hf_model(hf_root / name)(idx), hf_model(hf_root / name)(idx).logits
    assert ours.std() > 1  # far from flat: a wrong mapping could not hide in the tolerance
    assert (ours - theirs).abs().max() < TOL


@pytest.mark.parametrize("name", ["llama_tied_mha", "qwen3_head_dim"])
def test_first_step_loss_matches_transformers(hf_root, tmp_path, name):
    cfg = load_config(None, run_args(hf_root / "data", tmp_path / "run", "--checkpoint.init_from",
                                     str(hf_root / name), "--data.align", "stream",
                                     "--train.attention", "sdpa"))
    trainer = Trainer(cfg, CPU)
    state = trainer.data.loader.state_dict()
    batches = trainer.data.loader.next_micro_batches()
    trainer.data.loader.load_state_dict(state)
    ours, _, _ = trainer.train_step()
    hf, total, count = hf_model(hf_root / name), 0.0, 0
    with torch.no_grad():
        for x_BT, y_BT in batches:
            logits = hf(x_BT).logits
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y_BT.flatten(),
                                                       reduction="sum").item()
            count += y_BT.numel()
    assert abs(ours - total / count) < TOL * max(1.0, abs(ours)), (ours, total / count)


def test_eval_and_greedy_sample_of_hf_dir_match_transformers(hf_root, tmp_path):
    d = hf_root / "llama_gqa_sharded"
    out = tmp_path / "eval.json"
    res = lmforge("eval", "--ckpt", f"hf:{d}", "--data", str(hf_root / "data"), "--seq-len", "64",
                  "--max-tokens", "640", "--dtype", "fp32", "--json", str(out))
    assert res.returncode == 0, res.stderr
    tokens = torch.from_numpy(TokenWindows(hf_root / "data", "val", 64, None).tokens(0, 641)).long()
    x, y = tokens[:-1].view(10, 64), tokens[1:].view(10, 64)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(hf_model(d)(x).logits.flatten(0, 1), y.flatten())
    assert abs(json.loads(out.read_text())["loss"] - expected.item()) < TOL

    prompt = "def main(args):\n    "
    res = lmforge("sample", "--ckpt", f"hf:{d}", "--prompt", prompt, "--temperature", "0",
                  "--max-new-tokens", "12", "--dtype", "fp32", "--seed", "0")
    assert res.returncode == 0, res.stderr
    ids = torch.tensor([[0, *hf_encode(d, prompt)]])  # documents (and prompts) open with EOS
    new = hf_model(d).generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    new = new[:new.index(0)] if 0 in new else new
    assert res.stdout.rstrip("\n") == prompt + load_tokenizer(f"hf:{d}").decode(new)


@pytest.mark.parametrize("name", ["llama_gqa_sharded", "qwen3_head_dim"])
def test_train_mixture_resume_and_export_round_trip(hf_root, tmp_path, name):
    src, run = hf_root / name, tmp_path / "run"
    mix = f"{hf_root / 'data'}:0.7,{hf_root / 'data2'}:0.3"  # domain data beside replayed data
    args = run_args(mix, run, "--checkpoint.init_from", str(src),
                    "--eval.every", "0")
    train([*args, "--train.max_steps", "2", "--checkpoint.every", "1"])
    meta = json.loads((run / "final" / "meta.json").read_text())
    files = sorted(p.name for p in src.glob("*.safetensors"))
    assert meta["source"]["sha256"] == {
        f: hashlib.sha256((src / f).read_bytes()).hexdigest() for f in files}
    model = load_config(run / "config.toml").model  # the run's saved config: config.json's model
    assert model.d_model == 64 and model.vocab_size == json.loads((src / "config.json").read_text())[
        "vocab_size"] and model.tie_embeddings is False
    res = train([*args, "--train.max_steps", "3", "--resume", "auto"])
    assert "resumed from" in res.stdout and sorted(losses(run)) == [1, 2, 3]

    out = tmp_path / "hf"
    assert lmforge("export", "--ckpt", str(run), "--hf", str(out)).returncode == 0
    theirs, ours = json.loads((src / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert {k: ours.get(k) for k in ARCH_KEYS} == {k: theirs.get(k) for k in ARCH_KEYS}
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    idx = torch.randint(0, 640, (2, 40))
    with torch.no_grad():
        trained = load_for_inference(run).model(idx)
        exported = hf_model(out)(idx).logits
        start = hf_model(src)(idx).logits
    assert (trained - exported).abs().max() < TOL
    assert (trained - start).abs().max() > 100 * TOL  # it trained: the export is not the source


def test_two_ranks_ddp_and_fsdp_equal_one_process(hf_root, tmp_path):
    src = hf_root / "llama_gqa_sharded"
    runs = {}
    for parallel, nproc in (("none", 1), ("ddp", 2), ("fsdp", 2)):
        runs[parallel] = tmp_path / parallel
        train(run_args(hf_root / "data", runs[parallel], "--checkpoint.init_from", str(src),
                       "--train.parallel", parallel, "--train.max_steps", "3",
                       "--eval.every", "0"), nproc=nproc, timeout=300)
    one = losses(runs["none"])
    assert max_diff(losses(runs["ddp"]), one) < 1e-5
    assert max_diff(losses(runs["fsdp"]), one) < 1e-5


def bad_dir(hf_root, tmp_path, kind):
    d = tmp_path / kind
    shutil.copytree(hf_root / "llama_tied_mha", d)
    cfg = json.loads((d / "config.json").read_text())
    if kind == "pickle_only":
        (d / "model.safetensors").rename(d / "pytorch_model.bin")
    elif kind == "mistral":
        cfg["model_type"], cfg["architectures"] = "mistral", ["MistralForCausalLM"]
    elif kind == "attention_bias":
        cfg["attention_bias"] = True
    elif kind == "weights_mismatch":
        cfg["intermediate_size"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("kind,named", [
    ("pickle_only", "pytorch_model.bin is a pickle"), ("mistral", "model_type = \"mistral\""),
    ("attention_bias", "attention_bias = true"), ("weights_mismatch", "do not match its config.json"),
])
def test_bad_hf_dir_is_one_line_and_writes_nothing(hf_root, tmp_path, kind, named):
    d, run = bad_dir(hf_root, tmp_path, kind), tmp_path / "run"
    for res in (lmforge("train", *run_args(hf_root / "data", run, "--checkpoint.init_from", str(d))),
                lmforge("sample", "--ckpt", f"hf:{d}", "--prompt", "x", "--max-new-tokens", "2")):
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), res.stderr
        assert named in lines[0], lines[0]
    assert not run.exists()


def test_model_override_disagreeing_with_config_json_is_refused(hf_root, tmp_path):
    run = tmp_path / "run"
    res = lmforge("train", *run_args(hf_root / "data", run, "--checkpoint.init_from",
                                     str(hf_root / "llama_tied_mha"), "--model.d_model", "128"))
    assert res.returncode == 2 and "--model.d_model 128" in res.stderr and "d_model = 64" in res.stderr
    assert not run.exists()


def test_header_shapes_are_checked_before_allocation(hf_root, tmp_path):
    """A header declaring a tensor past the file's end is refused before anything is read."""
    d = bad_dir(hf_root, tmp_path, "truncated")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="does not lie within the file"):
        load_hf_model(d)
