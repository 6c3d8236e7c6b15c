"""`lmforge eval` against the val loss training logged for the same checkpoint: it computes in
the run's own dtype by default and says which; DDP reproduces the logged loss, FSDP with bf16
within the tolerance `lmforge eval` states (FSDP evaluates with bf16 parameters, norm gains
included, where autocast keeps the gains fp32)."""

from __future__ import annotations

import json
import sys

import pytest

from lmforge.launch.evaluate import FSDP_BF16_REL_TOL
from tests.harness import TINY_ARGS, metrics, run, train

STEPS = 5  # TINY_ARGS evaluate 512 tokens every 5 steps


def lmforge(*args):
    res = run([sys.executable, "-m", "lmforge.launch.cli", *map(str, args)], timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    return res.stdout


def trained(data, out, nproc=1, *extra):
    train(["--data.path", str(data), "--log.out_dir", str(out), *TINY_ARGS,
           "--train.max_steps", str(STEPS), "--checkpoint.every", "0", *extra], nproc=nproc)
    return next(r["val_loss"] for r in metrics(out) if r["step"] == STEPS and "val_loss" in r)


def evaluated(data, run_dir, *extra) -> tuple[float, str]:
    out = lmforge("eval", "--ckpt", run_dir, "--data", data, "--max-tokens", 512,
                  "--json", run_dir / "eval.json", *extra)
    # eval's own line, "dtype NAME (why)...": not the warning a forced-emulated bf16 CPU adds
    # ("dtype bf16 on a CPU without native bf16 ...").
    dtype_line = next(ln for ln in out.splitlines()
                      if ln.startswith("dtype ") and ln.split()[2].startswith("("))
    return json.loads((run_dir / "eval.json").read_text())["loss"], dtype_line


def test_eval_computes_in_the_runs_dtype_and_reproduces_its_val_loss(tiny_data, tmp_path):
    # An fp32 run (TINY_ARGS) on a CPU where auto means bf16 was evaluated in bf16 (4.4e-5 off).
    logged = trained(tiny_data, tmp_path / "run")
    loss, dtype_line = evaluated(tiny_data, tmp_path / "run")
    assert dtype_line.split()[1:] == ["fp32", "(the", "run's", "train.dtype", "=", "fp32)"]
    assert loss == pytest.approx(logged, rel=1e-12)  # the same batches, the same arithmetic
    _, dtype_line = evaluated(tiny_data, tmp_path / "run", "--dtype", "bf16")
    assert dtype_line.split()[1:] == ["bf16", "(--dtype", "bf16)"]


@pytest.mark.dist
def test_bf16_ddp_reproduces_and_fsdp_stays_within_the_stated_tolerance(tiny_data, tmp_path):
    bf16 = ["--train.dtype", "bf16"]
    rel = {}
    for parallel in ("ddp", "fsdp"):
        out = tmp_path / parallel
        logged = trained(tiny_data, out, 2, "--train.parallel", parallel, *bf16)
        loss, dtype_line = evaluated(tiny_data, out)
        assert dtype_line.split()[1] == "bf16"
        assert ("not exactly" in dtype_line) == (parallel == "fsdp"), dtype_line
        rel[parallel] = abs(loss - logged) / logged
    # 2 ranks sum their windows in other groups than 1 process does: fp32 sums, nothing more.
    assert rel["ddp"] < 1e-6, rel
    assert 0 < rel["fsdp"] < FSDP_BF16_REL_TOL, rel
