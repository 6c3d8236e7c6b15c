import dataclasses
import re
import typing
from pathlib import Path

import pytest
import torch

from lmforge.pipeline.config import (
    ConfigError,
    JobConfig,
    config_from_dict,
    config_to_dict,
    derive,
    describe,
    load_config,
    save_resolved,
    to_toml,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_defaults_without_file():
    assert load_config(None, []) == JobConfig()


def test_precedence_cli_over_file_over_defaults(tmp_path):
    path = write(tmp_path, "[train]\nmax_steps = 50\nseed = 7\n[optim]\nlr = 1\n")
    cfg = load_config(path, ["--train.max_steps", "100", "--optim.warmup_steps=5"])
    assert cfg.train.max_steps == 100  # CLI beats file
    assert cfg.train.seed == 7  # file beats default
    assert cfg.optim.warmup_steps == 5
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)  # TOML int for a float field
    assert cfg.train.micro_batch_size == JobConfig().train.micro_batch_size


@pytest.mark.parametrize("text,expected", [("true", True), ("1", True), ("False", False), ("0", False)])
def test_bool_override(text, expected):
    cfg = load_config(None, ["--train.activation_checkpointing", text])
    assert cfg.train.activation_checkpointing is expected


def test_list_optional_and_float_overrides():
    cfg = load_config(None, ["--sample.prompts", '["a", "b c"]', "--sample.top_p", "0.9",
                             "--model.d_mlp", "512", "--optim.lr", "3e-4"])
    assert cfg.sample.prompts == ["a", "b c"]
    assert cfg.sample.top_p == 0.9 and cfg.model.d_mlp == 512 and cfg.optim.lr == 3e-4
    assert load_config(None, ["--sample.top_p", "none"]).sample.top_p is None


@pytest.mark.parametrize("args,key,suggestion", [
    (["--train.max_step", "1"], "train.max_step", "train.max_steps"),
    (["--trian.seed", "1"], "trian.seed", "train.seed"),
    (["--train.lr", "1"], "train.lr", "optim.lr"),
])
def test_unknown_override_suggests(args, key, suggestion):
    with pytest.raises(ConfigError, match=f"unknown key '{key}' — did you mean '{suggestion}'"):
        load_config(None, args)


@pytest.mark.parametrize("text,key,suggestion", [
    ("[train]\nmax_step = 1\n", "train.max_step", "train.max_steps"),
    ("[optimizer]\nlr = 1\n", "optimizer", "optim"),
    ("seed = 1\n", "seed", "train.seed"),
])
def test_unknown_file_key_suggests(tmp_path, text, key, suggestion):
    with pytest.raises(ConfigError, match=f"unknown key '{key}' — did you mean '{suggestion}'"):
        load_config(write(tmp_path, text), [])


@pytest.mark.parametrize("args,fragment", [
    (["--train.dtype", "fp16"], "'train.dtype': 'fp16' (expected one of 'auto' | 'bf16' | 'fp32')"),
    (["--train.max_steps", "ten"], "'train.max_steps': 'ten' (expected int)"),
    (["--train.max_steps", "0"], "'train.max_steps': 0 (expected >= 1)"),
    (["--optim.lr", "nan"], "'optim.lr': nan"),
    (["--train.compile", "yes"], "expected one of 'auto' | 'on' | 'off'"),
    (["--train.activation_checkpointing", "yes"], "expected true | false | 1 | 0"),
    (["--sample.prompts", "def"], "'sample.prompts'"),
    (["--sample.top_p", "1.5"], "'sample.top_p': 1.5"),
    (["--data.seq_len", "4096"], "<= model.max_seq_len"),
    (["--model.d_model", "250"], "model.d_model=250"),
    (["--train.max_steps"], "missing value for '--train.max_steps'"),
    (["train.max_steps", "3"], "overrides look like --section.key value"),
])
def test_bad_override_values(args, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text,fragment", [
    ('[train]\nmax_steps = "100"\n', "'train.max_steps': '100' (expected int)"),
    ("[train]\nmax_steps = true\n", "'train.max_steps': True (expected int)"),
    ("[sample]\nprompts = [1, 2]\n", "'sample.prompts': 1 (expected str)"),
    ("train = 3\n", "'train' must be a section"),
    ("[train\n", "not valid TOML"),
])
def test_bad_file_values(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(write(tmp_path, text), [])


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/x.toml", [])


def test_optional_fields_default_to_none():
    # to_toml omits None (TOML has no null); that round-trips only if None is the default.
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if type(None) in typing.get_args(hints[f.name]):
                assert getattr(cls(), f.name) is None, f"{section.name}.{f.name}"


def test_toml_round_trip(tmp_path):
    cfg = load_config(None, [
        "--sample.prompts", '["say \\"hi\\"\\n", "tab\\there", "ü→😀", "back\\\\slash", "\\u007f"]',
        "--optim.lr", "0.1", "--optim.eps", "1e-10", "--log.run_name", "r1",
        "--sample.top_p", "0.95", "--model.d_mlp", "640", "--train.dtype", "fp32",
    ])
    assert cfg.sample.prompts[3] == "back\\slash"
    path = save_resolved(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.toml"
    assert load_config(path, []) == cfg
    assert load_config(write(tmp_path, to_toml(JobConfig())), []) == JobConfig()


def test_dict_round_trip_through_checkpoint(tmp_path):
    cfg = load_config(None, ["--train.seed", "3", "--sample.top_p", "0.5"])
    torch.save({"config": config_to_dict(cfg)}, tmp_path / "ck.pt")
    d = torch.load(tmp_path / "ck.pt", weights_only=True)["config"]
    assert config_from_dict(d) == cfg
    d["train"]["max_step"] = 1
    with pytest.raises(ConfigError, match="did you mean 'train.max_steps'"):
        config_from_dict(d)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_derive(world):
    cfg = load_config(None, ["--train.global_batch_tokens", "16384", "--train.micro_batch_size", "4",
                             "--data.seq_len", "128", "--train.max_steps", "10"])
    d = derive(cfg, world)
    assert d.tokens_per_micro_step == 4 * 128
    assert d.grad_accum_steps * 4 * 128 * world == 16384
    assert d.sequences_per_step == 16384 // 128
    assert d.total_tokens == 10 * 16384
    text = describe(cfg, d, n_params=1_000_000)
    assert "16,384 tokens/step" in text and f"{d.grad_accum_steps} accumulation" in text


def test_derive_error_names_values_that_divide():
    cfg = load_config(None, ["--train.global_batch_tokens", "16384", "--train.micro_batch_size", "8",
                             "--data.seq_len", "256"])
    with pytest.raises(ConfigError) as e:
        derive(cfg, 3)
    msg = str(e.value)
    assert "global_batch_tokens=16384" in msg and "8*256*3" in msg
    suggested = re.search(r"global_batch_tokens to (\d+) or (\d+)", msg).groups()
    for tokens in suggested:  # every suggestion must actually work
        derive(load_config(None, ["--train.global_batch_tokens", tokens]), 3)
    cfg = load_config(None, ["--train.global_batch_tokens", "12288", "--train.micro_batch_size", "16"])
    with pytest.raises(ConfigError, match="micro_batch_size to one of") as e:
        derive(cfg, 2)
    for mbs in re.search(r"one of ([\d, ]+)", str(e.value)).group(1).split(", "):
        derive(load_config(None, ["--train.global_batch_tokens", "12288",
                                  "--train.micro_batch_size", mbs]), 2)


@pytest.mark.parametrize("name", ["tiny", "gpt2_124m", "llama_350m", "tiny_modern", "gpt2_124m_modern"])
def test_presets_load_and_derive(name):
    cfg = load_config(CONFIGS / f"{name}.toml", [])
    for world in (1, 2) if name.startswith("tiny") else (1, 2, 8):  # tiny is for CPUs, not 8 GPUs
        d = derive(cfg, world)
        assert d.grad_accum_steps >= 1
        assert d.sequences_per_step * cfg.data.seq_len == cfg.train.global_batch_tokens
