"""Every subcommand speaks one way: a mistake is one `error:` line and exit 2, and `lmforge train
--help` lists every config key with its type, default and docstring."""

from __future__ import annotations

import pytest

from lmforge.launch.cli import SUBCOMMANDS
from lmforge.launch.cli import main as lmforge
from lmforge.pipeline.config import JobConfig
from lmforge.pipeline.typed_config import field_docs, field_types, keys_help, section_keys


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_a_bad_flag_is_one_error_line_for_every_subcommand(command, capsys):
    rc = lmforge([command, "--no-such-flag", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (command, err)


def test_train_help_lists_every_config_key_with_its_docstring(capsys):
    with pytest.raises(SystemExit) as stop:
        lmforge(["train", "--help"])
    shown = capsys.readouterr().out
    assert stop.value.code == 0
    undocumented = [f"{s}.{k}" for s, cls in field_types(JobConfig).items()
                    for k in field_types(cls) if not field_docs(cls).get(k)]
    assert not undocumented, f"config keys without a docstring: {undocumented}"
    for key in section_keys(JobConfig):
        assert f"--{key} " in shown, key
    assert "--train.max_steps int = 200" in shown
    assert "Optimizer steps of the whole run" in keys_help(JobConfig)
