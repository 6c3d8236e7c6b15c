"""The tests' harness: training runs as real processes (python, torchrun, accelerate) under a
timeout, the tiny run's flags, and readers of a run's metrics (bench/gpu_check.py uses it too).

About 1 in 50 torchrun launches hangs at exit on the CI machines: a launch that times out is
killed with its whole process group and started once more.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# A 2-layer model on 64-token windows: a step takes milliseconds, so a test runs dozens of them.
TINY_ARGS = [
    "--data.seq_len", "64",
    "--model.n_layer", "2", "--model.d_model", "64", "--model.n_head", "4",
    "--model.n_kv_head", "2", "--model.max_seq_len", "128",
    "--train.global_batch_tokens", "512", "--train.micro_batch_size", "4",
    "--train.dtype", "fp32", "--train.compile", "off",
    # Fixed, as the dtype and compile are: auto's timing would pick per run. Eager is what auto
    # picks where bf16 is native on CPU; the model's own tests cover SDPA.
    "--train.attention", "eager",
    "--optim.warmup_steps", "2", "--optim.lr", "3e-3",
    "--eval.every", "5", "--eval.tokens", "512", "--eval.batch_size", "4",
    "--sample.every", "0", "--sample.max_new_tokens", "8",
    "--log.log_every", "1",
]


def run_args(data, out, *extra: str) -> list[str]:
    """A tiny run's flags: its data, its run directory, TINY_ARGS, then `extra` (later flags win)."""
    return ["--data.path", str(data), "--log.out_dir", str(out), *TINY_ARGS, *extra]


def run_config(data, out, *extra: str):
    """The JobConfig of those flags, for a Trainer built in the test's own process."""
    from lmforge.pipeline.config import load_config

    return load_config(None, run_args(data, out, *extra))


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
             PYTHONPATH=str(ROOT) + os.pathsep + e.get("PYTHONPATH", ""))
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(args: list[str], nproc: int = 1, launcher: str = "torchrun",
              module: str = "lmforge.launch.train") -> list[str]:
    """The command that trains with `args` (`module`: launch.train, or a test's wrapper of it)."""
    py = sys.executable
    if nproc == 1 and launcher == "torchrun":
        return [py, "-m", module, *args]
    if launcher == "torchrun":
        return [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "-m", module, *args]
    if launcher == "accelerate":
        return [py, "-m", "accelerate.commands.launch", "--multi_gpu",
                "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", "--main_process_port", str(free_port()),
                "-m", module, *args]
    raise ValueError(launcher)


def start(cmd: list[str], extra_env: dict[str, str] | None = None,
          cwd: Path = ROOT) -> subprocess.Popen:
    """Start `cmd` in `cwd` (the repository root) with env() (and extra_env over it)."""
    return subprocess.Popen(cmd, cwd=cwd, env={**env(), **(extra_env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def children(pid: int) -> list[int]:
    """Direct children of a process (torchrun starts its workers in sessions of their own)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            kids.append(int(stat.parent.name))
    return kids


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the launcher's process group and every descendant, wherever its session."""
    pids, todo = [], [proc.pid]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children(pid)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def run(cmd: list[str], timeout: float = 240, retries: int = 1,
        extra_env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    for attempt in range(retries + 1):
        proc = start(cmd, extra_env, cwd)
        try:
            out, _ = proc.communicate(timeout=timeout)
            return subprocess.CompletedProcess(cmd, proc.returncode, out, "")
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, _ = proc.communicate()
            if attempt == retries:
                raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-3000:]}") from None
    raise AssertionError("unreachable")


def train(args: list[str], nproc: int = 1, launcher: str = "torchrun", timeout: float = 240,
          extra_env: dict[str, str] | None = None, module: str = "lmforge.launch.train"):
    """Run to completion and assert success; returns the CompletedProcess."""
    res = run(train_cmd(args, nproc, launcher, module), timeout=timeout, extra_env=extra_env)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-4000:]}"
    return res


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.is_file() else []


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir)}


def max_diff(a: dict[int, float], b: dict[int, float], steps=None) -> float:
    """The largest |a - b| over `steps` (default: b's), inf when a curve lacks one of them: the
    parity check of every "same losses under another layout" test."""
    steps = sorted(b) if steps is None else steps
    if not all(s in a and s in b for s in steps):
        return float("inf")
    return max(abs(a[s] - b[s]) for s in steps)


def wait_until(done, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    """Poll `done()` every 5 ms until it is true; AssertionError (with the run's output) when
    `proc` ends first, or after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if done():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended (exit {proc.returncode}) before {what}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.005)
    raise AssertionError(f"{what} not reached in {timeout}s")


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 180) -> int:
    """Poll metrics.jsonl until `step` is reached; returns the last step seen."""
    wait_until(lambda: max(losses(run_dir), default=0) >= step, proc, f"step {step}", timeout)
    return max(losses(run_dir))
