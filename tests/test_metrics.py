import json
import logging
import os
import subprocess
import sys
import textwrap

import torch

from lmforge.pipeline.metrics import MetricsLogger, Progress, plot_losses, setup_logging


def test_jsonl_written_by_rank_0_only(tmp_path):
    main = MetricsLogger(tmp_path / "a", {"x": 1}, "disabled", "p", None, is_main=True)
    other = MetricsLogger(tmp_path / "b", {"x": 1}, "disabled", "p", None, is_main=False)
    for step in (1, 2):
        for logger in (main, other):
            logger.log(step, loss=torch.tensor(2.5 / step), lr=1e-3, note="ok")
    main.close()
    other.close()
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["lr"], r["note"]) for r in records] == [
        (1, 2.5, 1e-3, "ok"), (2, 1.25, 1e-3, "ok")]
    assert not (tmp_path / "b").exists()


def test_wandb_enabled_never_breaks_or_hangs(tmp_path):
    """Offline wandb writes a local run; online without an account warns and falls back to
    JSONL. Each in a subprocess under a timeout, since wandb starts a service process."""
    script = textwrap.dedent(f"""
        import sys
        from lmforge.pipeline.metrics import MetricsLogger, setup_logging
        setup_logging(0, None)
        run_dir = {str(tmp_path)!r} + "/" + sys.argv[1]
        m = MetricsLogger(run_dir, {{"lr": 1}}, sys.argv[1], "lmforge-test", "t", is_main=True)
        m.log(1, loss=3.0)
        m.close()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_DIR=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "cfg"),
               WANDB_CACHE_DIR=str(tmp_path / "cache"), NETRC=str(tmp_path / "netrc"))
    for mode in ("offline", "online"):
        out = subprocess.run([sys.executable, "-c", script, mode], env=env, timeout=120,
                             capture_output=True, text=True, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        assert json.loads((tmp_path / mode / "metrics.jsonl").read_text())["loss"] == 3.0
        if mode == "offline":
            assert list((tmp_path / mode / "wandb").glob("offline-run-*"))
        else:
            assert "wandb online unavailable" in out.stderr


def test_wandb_mode_env_overrides_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    m = MetricsLogger(tmp_path, {}, "online", "p", None, is_main=True)
    assert m._wandb_run is None
    m.close()


def test_setup_logging(tmp_path, capsys):
    logger = setup_logging(1, tmp_path)
    logger.info("quiet")
    logger.warning("loud")
    assert not (tmp_path / "train.log").exists()
    logger = setup_logging(0, tmp_path)
    logger.info("hello")
    assert len(logger.handlers) == 2  # stderr + file, not duplicated by the second call
    err = capsys.readouterr().err
    assert "quiet" not in err and "[rank 1] loud" in err and "hello" in err
    assert "hello" in (tmp_path / "train.log").read_text()


def test_progress_logs_every_n_steps(caplog):
    setup_logging(0, None)
    logger = logging.getLogger("lmforge")
    logger.addHandler(caplog.handler)
    try:
        progress = Progress(total_steps=7, log_every=3, is_main=True)
        for step in range(1, 8):
            progress.update(step, loss=2.0, lr=1e-3, tokens_per_s=1234.5, mfu=0.125 if step > 1 else None)
        progress.close()
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step")]
    assert [line.split(" |")[0] for line in lines] == ["step 3/7", "step 6/7", "step 7/7"]
    assert "1,234 tok/s" in lines[0] and "MFU 12.5%" in lines[0] and "ETA" in lines[0]


def test_plot_losses_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s, "loss": 5.0 / s} for s in range(1, 30)]
    records += [{"step": s, "val_loss": 4.0 / s} for s in (10, 20)]
    records += [{"step": 20, "loss": float("nan")}]  # a skipped non-finite step is not plotted
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = plot_losses(path, tmp_path / "loss.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 5000
