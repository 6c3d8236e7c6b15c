"""Logging for training runs: the "lmforge" logger (rank 0 speaks, the others only warn),
metrics.jsonl (and wandb), the progress bar and the end-of-run loss plot."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lmforge.data_prep.safe_files import check_file, open_file
from lmforge.pipeline.checkpoint.run_dir import RunDir

LOGGER_NAME = "lmforge"


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


class _TqdmHandler(logging.StreamHandler):
    """Writes through tqdm so that log lines appear above a live progress bar, not inside it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            # The stream of the moment, not the one at set-up: a caller (a test harness, a
            # notebook) may have replaced sys.stderr and closed the old one since.
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging must never take the run down
            self.handleError(record)


class _RunLogHandler(logging.FileHandler):
    """train.log, opened by safe_files' rule (never through a link); a failed write (a full
    disk) ends the run with the caller's one-line error, not a traceback per log line."""

    def _open(self):
        return open_file(self.baseFilename, self.mode, what="run file", encoding=self.encoding)

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], OSError):  # inside emit's except: the write's own
            raise  # noqa: PLE0704
        super().handleError(record)


def setup_logging(rank: int, run_dir: str | os.PathLike | None = None) -> logging.Logger:
    """Rank 0: INFO to stderr and to run_dir/train.log. Other ranks: WARNING to stderr, prefixed."""
    logger = get_logger()
    for handler in list(logger.handlers):  # idempotent: a second call replaces, never duplicates
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False  # a root handler set up by a library would print every line twice
    prefix = "" if rank == 0 else f"[rank {rank}] "
    stream = _TqdmHandler(sys.stderr)
    stream.setFormatter(logging.Formatter(f"{prefix}%(message)s"))
    logger.addHandler(stream)
    if rank == 0 and run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        file = _RunLogHandler(RunDir(run_dir).log)
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(file)
    return logger


def _plain(value: Any) -> Any:  # tensors and numpy scalars: their Python value
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot log {type(value).__name__} as a metric")


class MetricsLogger:
    """metrics.jsonl (appended, one flushed line per call) and optionally wandb; rank 0 only."""

    def __init__(self, run_dir: str | os.PathLike, cfg_dict: dict[str, Any], mode: str,
                 project: str, run_name: str | None, is_main: bool):
        self._file = self._wandb_run = None
        if not is_main:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run continues the same file (plot_losses keeps the last record of a
        # step logged twice).
        self._file = open_file(RunDir(run_dir).metrics, "a", what="run file")
        # WANDB_MODE in the environment wins over the config, so a cluster or CI can silence it;
        # a config of "disabled" never imports wandb at all.
        mode = mode if mode == "disabled" else os.environ.get("WANDB_MODE", mode)
        if mode != "disabled":
            self._wandb_run = self._init_wandb(run_dir, cfg_dict, mode, project,
                                               run_name or run_dir.name)

    @staticmethod
    def _init_wandb(run_dir: Path, cfg_dict, mode, project, name):
        try:
            import wandb

            settings = wandb.Settings(init_timeout=30, login_timeout=10, silent=True)
            return wandb.init(project=project, name=name, config=cfg_dict, dir=run_dir,
                              mode=mode, settings=settings)
        except Exception as e:  # no account, no network, bad mode: JSONL still works
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            get_logger().warning(f"wandb {mode} unavailable ({msg}); logging to metrics.jsonl only")
            return None

    def log(self, step: int, **metrics: Any) -> None:
        if self._file is None:
            return
        record = {"step": step, **metrics, "time": round(time.time(), 3)}
        self._file.write(json.dumps(record, default=_plain) + "\n")
        self._file.flush()  # a crashed run keeps every line it logged
        if self._wandb_run is not None:
            self._wandb_run.log(json.loads(json.dumps(metrics, default=_plain)), step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def _record_step(line: bytes) -> int | None:
    """A metrics.jsonl line's step; None for a torn one (a crash or a full disk mid-write)."""
    try:
        record = json.loads(line.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    step = record.get("step", 0) if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


MAX_RECORD_BYTES = 1 << 24  # a record is a line of numbers (and a step's samples)


def trim_metrics(path: Path, last_step: int) -> int:
    """On resume, drop the records a crashed run wrote after the checkpoint it resumes from, and
    the torn lines it may have left (logged): a partial line must not block every resume.
    Streamed line by line (each read bounded) into a temporary file renamed over it, so neither
    the file's size nor a crash mid-trim costs a record. Returns the last step still recorded."""
    if not check_file(path, what="run file", writing=True):
        return 0
    torn, dropped, last = [], 0, 0
    tmp = path.with_name(f".{path.name}.tmp")
    with open_file(path, "rb", what="run file") as src, \
            open_file(tmp, "wb", what="temporary file") as dst:
        for n, line in enumerate(iter(lambda: src.readline(MAX_RECORD_BYTES), b""), 1):
            step = _record_step(line)
            if step is None:
                torn.append(n)
            elif step > last_step:
                dropped += 1
            else:
                dst.write(line.rstrip(b"\n") + b"\n")
                last = max(last, step)
    os.replace(tmp, path)
    if torn:
        get_logger().warning("%s: dropped %d torn line(s) (line %s), written by a run that stopped "
                             "mid-write", path, len(torn), ", ".join(map(str, torn[:10])))
    if dropped:
        get_logger().warning("%s: dropped %d record(s) past step %d, written by a run that stopped "
                             "before checkpointing them", path, dropped, last_step)
    return last


def _fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """The rank-0 progress bar (shown only on a terminal) plus a log line every log_every steps."""

    def __init__(self, total_steps: int, log_every: int, is_main: bool, start_step: int = 0):
        self.total_steps = total_steps
        self.log_every = log_every
        self.is_main = is_main
        self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                         disable=not (is_main and sys.stderr.isatty()), file=sys.stderr)
        # ETA from the first update on: the first step pays for compilation and warm-up.
        self._t0, self._step0 = None, start_step

    def _eta(self, step: int) -> str:
        now = time.perf_counter()
        if self._t0 is None:
            self._t0, self._step0 = now, step
        done = step - self._step0
        return _fmt_duration((self.total_steps - step) * (now - self._t0) / done) if done else "?"

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float,
               mfu: float | None) -> None:
        if not self.is_main:
            return
        mfu_text = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
        stats = f"loss {loss:.4f} | lr {lr:.2e} | {tokens_per_s:,.0f} tok/s | MFU {mfu_text}"
        eta = self._eta(step)
        self._bar.set_postfix_str(stats, refresh=False)
        self._bar.update(step - self._bar.n)
        if step % self.log_every == 0 or step == self.total_steps:
            get_logger().info(f"step {step:>{len(str(self.total_steps))}}/{self.total_steps} | "
                              f"{stats} | ETA {eta}")

    def close(self) -> None:
        self._bar.close()


def read_records(metrics_jsonl: str | os.PathLike) -> Iterator[dict]:
    """metrics.jsonl's records, each line read bounded (a run directory is input)."""
    with open_file(metrics_jsonl, "rb", what="run file") as f:
        for line in iter(lambda: f.readline(MAX_RECORD_BYTES), b""):
            yield json.loads(line)


def _read_losses(metrics_jsonl: Path, key: str) -> tuple[list[int], list[float]]:
    by_step: dict[int, float] = {}
    for record in read_records(metrics_jsonl):
        if isinstance(record.get(key), (int, float)) and math.isfinite(record[key]):
            by_step[record["step"]] = record[key]  # a resumed run re-logs: the last wins
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_losses(metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike) -> Path:
    """Train (`loss`) and validation (`val_loss`) loss against step, as a PNG; beside it, when
    the run scored downstream tasks (eval.tasks), `downstream` against tokens trained."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot's import
    import matplotlib.pyplot as plt

    metrics_jsonl, out_png = Path(metrics_jsonl), Path(out_png)
    task_steps, scores = _read_losses(metrics_jsonl, "downstream")
    fig, axes = plt.subplots(1, 2 if task_steps else 1, figsize=(14 if task_steps else 8, 5),
                             squeeze=False)
    ax = axes[0][0]
    for key, label, style in (("loss", "train", "-"), ("val_loss", "val", "o-")):
        steps, values = _read_losses(metrics_jsonl, key)
        if steps:
            ax.plot(steps, values, style, label=label, markersize=4)
    ax.set_title(f"Loss — {metrics_jsonl.parent.name}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    if task_steps:
        token_steps, tokens = _read_losses(metrics_jsonl, "tokens")
        at = dict(zip(token_steps, tokens))
        pairs = [(at[s], v) for s, v in zip(task_steps, scores) if s in at]
        ax = axes[0][1]
        ax.plot([t for t, _ in pairs], [v for _, v in pairs], "o-", markersize=4)
        ax.axhline(0.0, color="grey", lw=0.8)  # chance: centered accuracy 0
        ax.set_title("Downstream (mean centered acc_norm; 0 = chance)")
        ax.set_xlabel("tokens trained")
        ax.set_ylabel("downstream")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    with open_file(out_png, "wb", what="run file") as f:
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)
    return out_png
