"""Continued pretraining from a Hugging Face directory (`checkpoint.init_from`, `--ckpt hf:DIR`):
Llama (with Llama 3.1/3.2's rope scaling or without), Qwen2 (q/k/v biases) and Qwen3. The loaded
model is transformers' (logits, first loss, greedy tokens, eval loss), it exports back exactly, a
trained run exports the same architecture back, a resume resumes (its source directory gone too),
2 ranks (DDP, FSDP2) equal one process, and bad directories are one `error:` line with nothing
written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from lmforge.data_prep.tokenizer import load_tokenizer
from lmforge.launch.cli import main as lmforge_main
from lmforge.pipeline.checkpoint.hf_init import load_hf_model
from lmforge.pipeline.config import load_config
from lmforge.pipeline.data.windows import TokenWindows
from lmforge.pipeline.inference import load_for_inference
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.train import Trainer
from tests.conftest import ROOT, built_once
from tests.errors import cli_error, last_error
from tests.harness import env, losses, max_diff, train
from tests.hf_dirs import LLAMA3_ROPE, hf_encode, make_model, make_tokenizer, run_args

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
    # Llama 3.2 1B/3B's: tied, GQA, rope_scaling llama3 of factor 32
    "llama32_scaled": {"tie": True, "n_kv_head": 2, "rope": LLAMA3_ROPE},
    # Qwen2.5-0.5B's: tied, GQA, biases on q, k and v
    "qwen25_bias": {"arch": "qwen2", "tie": True, "n_kv_head": 2},
}
ARCH_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
             "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "tie_word_embeddings", "rms_norm_eps", "max_position_embeddings", "rope_parameters")


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


def test_llama3_scaling_is_not_plain_rope(hf_root):
    """Control: the same weights under plain RoPE give other logits (the scaling is applied)."""
    from dataclasses import replace

    from lmforge.model.model import rope_tables

    model, idx = load_hf_model(hf_root / "llama32_scaled"), torch.randint(0, 640, (2, 48))
    with torch.no_grad():
        scaled = model(idx)
        for buf, table in zip((model.rope_cos, model.rope_sin), rope_tables(replace(model.cfg, rope_scaling=""))):
            buf.copy_(table)
        assert (model(idx) - scaled).abs().max() > 100 * TOL


@pytest.mark.parametrize("name", ["llama_tied_mha", "qwen3_head_dim", "llama32_scaled", "qwen25_bias"])
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


@pytest.mark.parametrize("name", ["llama_gqa_sharded", "llama32_scaled", "qwen25_bias"])
def test_eval_and_greedy_sample_of_hf_dir_match_transformers(hf_root, tmp_path, name):
    d = hf_root / name
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


@pytest.mark.parametrize("name", ["llama32_scaled", "qwen25_bias"])
def test_hf_dir_exports_back_exactly(hf_root, tmp_path, name):
    src, out = hf_root / name, tmp_path / "hf"
    res = lmforge("export", "--ckpt", f"hf:{src}", "--hf", str(out))
    assert res.returncode == 0, res.stderr
    theirs, ours = json.loads((src / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert {k: ours.get(k) for k in ARCH_KEYS} == {k: theirs.get(k) for k in ARCH_KEYS}
    stored = {k: v for f in src.glob("*.safetensors") for k, v in load_file(f).items()}
    exported = load_file(out / "model.safetensors")
    assert exported.keys() == stored.keys() and all(torch.equal(exported[k], v) for k, v in stored.items())


@pytest.mark.parametrize("name", ["llama32_scaled", "qwen25_bias", "qwen3_head_dim"])
def test_train_mixture_resume_and_export_round_trip(hf_root, tmp_path, name):
    """... and the resume needs no source directory: the run's checkpoints hold its weights."""
    src, run, gone = hf_root / name, tmp_path / "run", tmp_path / "downloaded"
    shutil.copytree(src, gone)
    mix = f"{hf_root / 'data'}:0.7,{hf_root / 'data2'}:0.3"  # domain data beside replayed data
    args = run_args(mix, run, "--checkpoint.init_from", str(gone), "--eval.every", "0")
    train([*args, "--train.max_steps", "2", "--checkpoint.every", "1"])
    meta = json.loads((run / "final" / "meta.json").read_text())
    files = sorted(p.name for p in src.glob("*.safetensors"))
    assert meta["source"]["sha256"] == {
        f: hashlib.sha256((src / f).read_bytes()).hexdigest() for f in files}
    model = load_config(run / "config.toml").model  # the run's saved config: config.json's model
    config_json = json.loads((src / "config.json").read_text())
    assert model.d_model == 64 and model.vocab_size == config_json["vocab_size"]
    assert model.tie_embeddings == config_json["tie_word_embeddings"]
    shutil.rmtree(gone)
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
    src = hf_root / "qwen25_bias"  # its biases sharded and gathered too
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


def header_of(path):
    n = int.from_bytes(path.read_bytes()[:8], "little")
    return json.loads(path.read_bytes()[8:8 + n]), path.read_bytes()[8 + n:]


def write_safetensors(path, header, data: bytes, raw: str | None = None) -> None:
    text = (raw or json.dumps(header)).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def every_layer_is_layer_0(d, n_layer):
    """The file rewritten with one block's bytes, and n_layer blocks' entries all pointing at
    them (n_layer = 1: a well-formed 1-layer file)."""
    header, data = header_of(d / "model.safetensors")
    kept, out = {}, b""
    for k, v in header.items():
        if k != "__metadata__" and not k.startswith("model.layers.") or k.startswith("model.layers.0."):
            begin, end = v["data_offsets"]
            kept[k] = v | {"data_offsets": [len(out), len(out) + end - begin]}
            out += data[begin:end]
    block = {k: v for k, v in kept.items() if k.startswith("model.layers.0.")}
    for i in range(1, n_layer):
        kept |= {k.replace("layers.0.", f"layers.{i}."): v for k, v in block.items()}
    write_safetensors(d / "model.safetensors", kept, out)
    return {"num_hidden_layers": n_layer}


def in_two_shards(d):
    first, second = sorted(d.glob("model-*.safetensors"))[:2]
    (h1, d1), (h2, d2) = header_of(first), header_of(second)
    name = next(k for k in h1 if k != "__metadata__")
    begin, end = h1[name]["data_offsets"]
    h2[name] = h1[name] | {"data_offsets": [len(d2), len(d2) + end - begin]}
    write_safetensors(second, h2, d2 + d1[begin:end])


def nested_header(d):
    header, data = header_of(d / "model.safetensors")
    header.pop("__metadata__", None)
    raw = json.dumps(header)[:-1] + ', "__metadata__": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    write_safetensors(d / "model.safetensors", header, data, raw)


def index_naming(d, name):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = name
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def linked(d, name):
    """DIR/name replaced by a link to the same bytes outside DIR."""
    (d / name).rename(d.parent / f"outside_{name}")
    (d / name).symlink_to(d.parent / f"outside_{name}")


LLAMA3 = {"rope_parameters": LLAMA3_ROPE}
CRAFTED = {  # kind: (what it does to a copy of a tiny model's directory, what the error names)
    "heads_0": (lambda d: {"num_attention_heads": 0}, "num_attention_heads = 0 is not a positive"),
    "rope_parameters_list": (lambda d: {"rope_parameters": [1, 2]}, "rope_parameters = [1, 2] is not an object"),
    "rope_scaling_list": (lambda d: {"rope_scaling": ["llama3"]}, "rope_scaling = [\"llama3\"] is not"),
    "vocab_0": (lambda d: {"vocab_size": 0}, "vocab_size = 0 is not a positive"),
    "layers_float": (lambda d: {"num_hidden_layers": 2.5}, "num_hidden_layers = 2.5 is not a positive"),
    "tied_string": (lambda d: {"tie_word_embeddings": "no"}, "tie_word_embeddings = \"no\""),
    "hidden_2_40": (lambda d: {"hidden_size": 2**40}, "(640, 64) vs (640, 1099511627776)"),
    "layers_25000": (lambda d: every_layer_is_layer_0(d, 1) | {"num_hidden_layers": 25_000},
                     "describes more tensors, or larger ones, than the"),
    "overlap_96_layers": (lambda d: every_layer_is_layer_0(d, 96), "not a readable safetensors file"),
    "config_nested": (lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000),
                      "not a JSON file lmforge can read"),
    "header_nested": (nested_header, "not a readable safetensors file"),
    "weights_fifo": (lambda d: (d / "model.safetensors").unlink() or os.mkfifo(d / "model.safetensors"),
                     "model.safetensors is a FIFO"),
    "truncated": (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-1000]),
                  "not a readable safetensors file"),
    "index_nested": (lambda d: (d / "model.safetensors.index.json").write_text(
        '{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}"), "not a JSON file lmforge can read"),
    "index_nul": (lambda d: index_naming(d, "model\0.safetensors"), "names files outside its directory"),
    "index_dotdot": (lambda d: index_naming(d, ".."), "names files outside its directory"),
    "tensor_in_two_shards": (in_two_shards, "which model-00001-of-"),
    "qwen2_sliding": (lambda d: {"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window = true"),
    "qwen2_biases_missing": (lambda d: {"model_type": "qwen2"}, "missing model.layers.0.self_attn.k_proj.bias"),
    "rope_yarn_4x_key": (lambda d: {"rope_scaling": {"type": "yarn", "factor": 4.0},
                                     "rope_parameters": None}, "rope_type = \"yarn\""),
    "rope_keys_disagree": (lambda d: {"rope_scaling": {"type": "yarn", "factor": 4.0}},
                           "and rope_parameters disagree"),
    "llama3_no_factor": (lambda d: {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e2}},
                         "lacks 'factor'"),
    "llama3_low_is_high": (lambda d: {"rope_parameters": LLAMA3_ROPE | {"low_freq_factor": 4.0}},
                           "rope_high_freq_factor must be above"),
    "partial_rotary": (lambda d: LLAMA3 | {"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
    "config_link": (lambda d: linked(d, "config.json"), "symbolic link"),
    "weights_link": (lambda d: linked(d, "model.safetensors"), "symbolic link"),
}
SHARDED = ("index_nul", "index_dotdot", "index_nested", "tensor_in_two_shards")


@pytest.mark.parametrize("kind", CRAFTED)
def test_crafted_hf_dir_is_one_error_line_before_anything_is_built(hf_root, tmp_path, capsys,
                                                                    monkeypatch, kind):
    """Each refused before a model sized by config.json is built (no GPT of more than the one
    block state_shapes reads its shapes off): a 1-layer file claiming 25,000 layers took 30 s and
    700 MiB, 10^6 layers 28 GB; 96 layers sharing one layer's bytes loaded as 96 copies."""
    from lmforge.model.model import GPT

    d = tmp_path / "d" / kind
    shutil.copytree(hf_root / ("llama_gqa_sharded" if kind in SHARDED else "llama_tied_mha"), d)
    edit, named = CRAFTED[kind]
    if isinstance(changes := edit(d), dict):
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(cfg | changes))
    built, init = [], GPT.__init__
    monkeypatch.setattr(GPT, "__init__", lambda self, cfg: built.append(cfg.n_layer) or init(self, cfg))
    cli_error(capsys, ["sample", "--ckpt", f"hf:{d}", "--prompt", "x", "--max-new-tokens", "2"], named)
    assert max(built, default=1) == 1, built


def test_a_named_link_to_an_hf_dir_is_followed(hf_root, tmp_path, capsys):
    """The README's rule: the path named may be a link (nothing inside it is followed)."""
    link = tmp_path / "link"
    link.symlink_to(hf_root / "llama_tied_mha")
    assert lmforge_main(["sample", "--ckpt", f"hf:{link}", "--prompt", "x", "--max-new-tokens", "2",
                         "--temperature", "0"]) == 0, capsys.readouterr().err
    cfg = load_config(None, run_args(hf_root / "data", tmp_path / "run", "--checkpoint.init_from", str(link)))
    assert cfg.model.d_model == 64 and cfg.checkpoint.init_from == str(link)


def test_a_fresh_start_from_a_missing_dir_is_refused(hf_root, tmp_path):
    run = tmp_path / "run"
    res = lmforge("train", *run_args(hf_root / "data", run, "--checkpoint.init_from",
                                     str(tmp_path / "gone"), "--resume", "auto"))
    assert res.returncode == 2 and res.stderr.startswith("error:") and "not found" in res.stderr, res.stderr
    assert not run.exists()


def test_an_lmforge_export_continues_on_the_data_it_was_trained_on(tiny_data, hf_root, tmp_path):
    """Pretrain, `export --hf`, continue from the export on shards of the tokenizer it trained
    with: the export writes tiktoken's possessive `{1,3}+` as `{1,3}` (Oniguruma's dialect), the
    same split, so the data is the model's. Shards of another tokenizer are still refused."""
    from tests.harness import run_args as tiny_run_args

    pretrained, out = tmp_path / "pretrained", tmp_path / "hf"
    train(tiny_run_args(tiny_data, pretrained, "--train.max_steps", "1"))
    assert lmforge("export", "--ckpt", str(pretrained), "--hf", str(out)).returncode == 0
    assert "{1,3}+" in json.loads((tiny_data / "tokenizer" / "tokenizer.json").read_text())["pattern"]
    run = tmp_path / "continued"
    res = lmforge("train", *run_args(tiny_data, run, "--checkpoint.init_from", str(out),
                                     "--train.max_steps", "1", "--eval.every", "0"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "init:      " in res.stderr and "optim.lr_ref_width" in res.stderr
    res = lmforge("train", *run_args(hf_root / "data", tmp_path / "other", "--checkpoint.init_from",
                                     str(out), "--train.max_steps", "1"))
    last_error(res, "tokenizer")  # another vocabulary: refused before its ids are read
