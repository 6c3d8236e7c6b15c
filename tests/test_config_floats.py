"""Every float of every config section is checked: NaN and +-inf are refused
with one `error:` line naming the key, as is a negative value (no float setting has a meaning
below zero). The fields are found by reflection, so a new float field is covered the day it is
added."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from lmforge.launch.cli import main as lmforge
from lmforge.pipeline.config import ConfigError, JobConfig, load_config


def float_keys() -> list[str]:
    """'section.key' of every field annotated float or float | None."""
    keys = []
    for section, section_cls in typing.get_type_hints(JobConfig).items():
        for name, tp in typing.get_type_hints(section_cls).items():
            if tp is float or float in typing.get_args(tp):
                keys.append(f"{section}.{name}")
    return keys


FLOAT_KEYS = float_keys()


def test_the_reflection_finds_the_known_float_fields():
    assert {"model.rope_theta", "model.norm_eps", "model.init_std", "optim.lr", "optim.eps",
            "sample.temperature", "sample.top_p"} <= set(FLOAT_KEYS)
    assert all(dataclasses.is_dataclass(cls) for cls in typing.get_type_hints(JobConfig).values())


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_non_finite_or_negative_float_is_one_error_line(key, value, capsys):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        load_config(None, [f"--{key}", value])
    assert "\n" not in str(err.value)
    # The same through the command line: exit 2, one line, no traceback, nothing started.
    assert lmforge(["train", "--dry-run", f"--{key}", value]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], out.err
    assert out.out == ""


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("key", ["model.rope_theta", "model.norm_eps", "model.init_std"])
def test_model_config_refuses_non_finite_directly(key, value):
    """A ModelConfig also comes from checkpoints and Hugging Face configs, not only TOML."""
    from lmforge.model import ModelConfig

    with pytest.raises(ValueError, match=key.split(".")[1]):
        ModelConfig(vocab_size=10, **{key.split(".")[1]: value})


def test_defaults_pass():
    load_config(None, [])
