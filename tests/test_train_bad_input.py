"""`lmforge train` given a mistake: one `error:` line and exit 2, before anything is written,
on one process and under `--nproc 2` alike. Each case once ended in a traceback, in a
schedule that silently was not the configured one, or in a finished run overwritten."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.tokenizer import dataset_tokenizer, save_tokenizer_dir, train_bpe
from lmforge.pipeline.checkpoint import format as ckpt
from lmforge.pipeline.checkpoint.lock import run_lock
from lmforge.pipeline.checkpoint.run_dir import RunDir
from lmforge.pipeline.config import ConfigError, derive, describe, load_config
from lmforge.pipeline.metrics import trim_metrics
from lmforge.pipeline.optim.optimizers import lr_multiplier
from tests.errors import cli_error
from tests.harness import run, run_args, train_cmd


def test_a_config_path_that_is_no_toml_file_is_one_error(tmp_path, capsys):
    cli_error(capsys, ["train", "--config", str(tmp_path)], "config file", "is a directory")
    (tmp_path / "binary.toml").write_bytes(bytes(range(128, 256)))
    cli_error(capsys, ["train", "--config", str(tmp_path / "binary.toml")], "config file",
              "is not UTF-8")


def test_a_context_past_the_models_limit_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="model.max_seq_len"):
        load_config(None, ["--log.out_dir", str(tmp_path), "--model.max_seq_len", "100000000"])


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_wsd_decays_after_the_warmup_never_jumping(fraction):
    """A decay window that would reach into the warmup starts where the warmup ends: the lr
    rises to its peak, then only falls (it used to drop from a peak it never reached)."""
    o = load_config(None, ["--optim.schedule", "wsd", "--optim.warmup_steps", "6",
                           "--optim.decay_fraction", str(fraction)]).optim
    lrs = [lr_multiplier(step, 10, o) for step in range(10)]
    assert lrs[5] == 1.0 and lrs[-1] == pytest.approx(o.min_lr_ratio)
    assert all(a >= b for a, b in zip(lrs[5:], lrs[6:])), lrs
    assert all(a < b for a, b in zip(lrs[:5], lrs[1:6])), lrs


def test_a_warmup_longer_than_the_run_is_said_in_the_summary(tmp_path):
    cfg = load_config(None, ["--optim.warmup_steps", "50", "--train.max_steps", "10"])
    assert "warmup longer than the run: it ends at 20% of the peak" in describe(cfg, derive(cfg, 1), 10)


def test_out_dir_that_is_a_file_is_one_error(tiny_data, tmp_path, capsys):
    (tmp_path / "afile").write_text("keep")
    for out in ("afile", "afile/sub"):
        cli_error(capsys, ["train", *run_args(tiny_data, tmp_path / out)], "is a file")
    assert (tmp_path / "afile").read_text() == "keep"


@pytest.mark.parametrize("resume", ["none", "auto"])
def test_a_fresh_start_does_not_overwrite_a_finished_run(tmp_path, resume):
    run_dir = RunDir(tmp_path)
    run_dir.final.mkdir()
    (run_dir.final / "meta.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds a finished run"):
        ckpt.find_resume(resume, tmp_path)
    shutil.rmtree(run_dir.final)
    assert ckpt.find_resume(resume, tmp_path) is None


def test_metrics_a_start_left_past_its_checkpoint_are_dropped_and_said(tmp_path, caplog):
    path = RunDir(tmp_path).metrics
    path.write_text("".join(json.dumps({"step": s, "loss": 5.0}) + "\n" for s in (1, 2, 3)))
    assert trim_metrics(path, 0) == 0 and path.read_text() == ""
    assert "dropped 3 record(s) past step 0" in caplog.text


def test_every_rank_stops_with_rank_0s_lock_refusal(tmp_path):
    with run_lock(tmp_path):
        with pytest.raises(ConfigError, match="being written by another run"), run_lock(tmp_path):
            pass
        with pytest.raises(ConfigError, match="rank 0 could not take"), \
                run_lock(tmp_path, take=False, any_failed=lambda failed: True):
            pass


def test_a_tokenizer_copied_over_a_datasets_is_refused(tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    shutil.rmtree(data / "tokenizer")
    save_tokenizer_dir(train_bpe(["other text " * 40], 300), data / "tokenizer", "bpe", "other")
    with pytest.raises(DataError, match="is not the tokenizer .* was prepared with"):
        dataset_tokenizer(data)


@pytest.mark.parametrize("mistake", [["--train.global_batch_tokens", "768"],
                                     ["--model.vocab_size", "100"]])
def test_a_mistake_under_nproc_2_is_one_error_line(tiny_data, tmp_path, mistake):
    """Found inside the ranks (not by the launcher's own checks): the launcher prints the line
    once, not each rank's under torchrun's ChildFailedError traceback."""
    args = run_args(tiny_data, tmp_path / "run", *mistake)
    res = run([sys.executable, "-m", "lmforge.launch.cli", "train", "--nproc", "2", *args], timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("error: ")]
    assert res.returncode == 2 and "Traceback" not in res.stdout, res.stdout[-3000:]
    assert len(lines) == 1 and mistake[0].lstrip("-") in lines[0], res.stdout[-3000:]
    assert not Path(tmp_path / "run" / "checkpoints").exists()


def test_a_start_refused_before_it_wrote_anything_leaves_no_directory(tiny_data, tmp_path):
    res = run(train_cmd(run_args(tiny_data, tmp_path / "new", "--model.vocab_size", "100")))
    assert res.returncode == 2 and "data vocab" in res.stdout, res.stdout[-3000:]
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()  # a directory the user made stays, whatever happens in it
    res = run(train_cmd(run_args(tiny_data, tmp_path / "old", "--model.vocab_size", "100")))
    assert res.returncode == 2 and (tmp_path / "old").is_dir()
