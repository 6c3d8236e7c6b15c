"""Weighted mixtures of prepared directories: the draws, the world-size independence, exact
resume across a smaller source's epoch boundary and a phase switch, per-source metrics, and
the bad inputs (one line, exit 2)."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lmforge.data_prep.shards import (
    FORMAT_VERSION,
    Manifest,
    ShardInfo,
    load_manifest,
    open_shard,
    shard_name,
    write_shard,
)
from lmforge.pipeline.checkpoint import format as ckpt
from lmforge.pipeline.data.loader import Phase, Source, TokenWindows, TrainLoader
from lmforge.pipeline.data.rows import StreamRows
from tests.harness import (
    ROOT,
    TINY_ARGS,
    env,
    kill_group,
    metrics,
    start,
    train,
    train_cmd,
    wait_for_step,
    wait_until,
)
from tests.test_data_loader import SEQ, VOCAB, make_data


def sources(tmp_path, sizes=((100, 37, 250, 1, 60), (90, 40))):
    out = []
    for i, train_sizes in enumerate(sizes):
        d = tmp_path / f"s{i}"
        d.mkdir()
        make_data(d, train_sizes=train_sizes)
        out.append(Source.keyed(f"s{i}", StreamRows(TokenWindows(d, "train", SEQ, VOCAB))))
    return out


def step_rows(srcs, phases, steps, world, accum, mbs=2, seed=0, state=None):
    """Per step: the (source, first token) of every global row, over ranks in rank order."""
    loaders = [TrainLoader(srcs, mbs, accum, r, world, seed, phases, max_steps=40)
               for r in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    out = []
    for _ in range(steps):
        rows = [loader.next_step() for loader in loaders]
        out.append([(n, int(w[0])) for r in rows for n, w in zip(r.sources, r.w, strict=True)])
    return out, loaders[0].state_dict()


def test_mixture_frequencies_within_binomial_noise(tmp_path):
    srcs = sources(tmp_path)
    steps, state = step_rows(srcs, [Phase(0, {"s0": 0.7, "s1": 0.3})], 300, 1, 4)
    n = 300 * 8
    count = Counter(name for step in steps for name, _ in step)
    assert abs(count["s0"] - 0.7 * n) < 4 * math.sqrt(n * 0.7 * 0.3), count
    # Both sources ran out many times over: each starts its own epochs, counted in the state.
    assert state["sources"]["s1"]["epoch"] > state["sources"]["s0"]["epoch"] >= 10


def test_rows_depend_only_on_the_global_batch_and_resume_anywhere(tmp_path):
    srcs = sources(tmp_path)
    phases = [Phase(0, {"s0": 0.7, "s1": 0.3}), Phase(0.5, {"s0": 0.2, "s1": 0.8})]
    full = step_rows(srcs, phases, 30, 1, 4)[0]
    assert step_rows(srcs, phases, 30, 2, 2)[0] == full == step_rows(srcs, phases, 30, 4, 1)[0]
    # A phase switch at step 20 and epoch boundaries of s1 (33 windows) lie after the resume.
    head, state = step_rows(srcs, phases, 12, 4, 1)
    json.dumps(state)  # plain JSON in meta.json
    assert head + step_rows(srcs, phases, 18, 2, 2, state=state)[0] == full
    assert Counter(n for n, _ in full[25]) != Counter(n for n, _ in full[5])


def test_checkpoint_of_another_mixture_is_refused(tmp_path):
    from lmforge.data_prep.errors import DataError

    srcs = sources(tmp_path)
    _, state = step_rows(srcs[:1], None, 2, 1, 1)
    with pytest.raises(DataError, match="does not match this run"):
        step_rows(srcs, [Phase(0, {"s0": 1, "s1": 1})], 1, 1, 1, state=state)


# ---- the trainer on a mixture, as processes ----------------------------------------------------


def small_source(big, out, tokens=2200):
    """A prepared directory of the first `tokens` train tokens of `big`, same tokenizer."""
    shutil.copytree(big / "tokenizer", out / "tokenizer")
    m = load_manifest(big)
    ids = np.asarray(open_shard(big / m.shards[0].file)[:tokens])
    name = shard_name("train", 0)
    sha = write_shard(out / name, ids, m.vocab_size)
    Manifest(version=FORMAT_VERSION, vocab_size=m.vocab_size, eot_id=m.eot_id,
             tokenizer=m.tokenizer, source="test", args={},
             shards=[ShardInfo(name, "train", tokens, 1, sha)]).save(out)
    return out


STEPS = 16


def mixture_args(big, small, run_dir):
    return [*TINY_ARGS, "--train.max_steps", str(STEPS), "--checkpoint.every", "4",
            "--eval.every", "8", "--log.out_dir", str(run_dir),
            "--data.mix", f"{big}:0.7,{small}:0.3",
            "--data.phases", f'[{{from_step = 0.5, sources = [{{path = "{small}", weight = 1}}, '
                             f'{{path = "{big}", weight = 1}}]}}]']


def test_two_processes_equal_one_and_kill_resume_on_another_world_size(tiny_data, tmp_path):
    small = small_source(tiny_data, tmp_path / "small")
    straight, pair, killed = tmp_path / "one", tmp_path / "two", tmp_path / "killed"
    train(mixture_args(tiny_data, small, straight))
    train(mixture_args(tiny_data, small, pair), nproc=2)
    proc = start(train_cmd(mixture_args(tiny_data, small, killed)))
    try:
        wait_for_step(proc, killed, 6)
        # checkpoint.async_save may still be writing step 4's checkpoint two steps later (seen
        # on a loaded machine): kill once one is complete, whichever step it is.
        wait_until(lambda: ckpt.list_complete(killed / "checkpoints"), proc, "a complete checkpoint")
    finally:
        kill_group(proc, signal.SIGKILL)
        proc.communicate()
    saved = [ckpt.read_meta(p).step for p in ckpt.list_complete(killed / "checkpoints")]
    assert saved and max(saved) < STEPS, saved
    train(mixture_args(tiny_data, small, killed) + ["--resume", "auto"], nproc=2)

    def by_step(run):
        return {r["step"]: r for r in metrics(run)}

    one, two, resumed = by_step(straight), by_step(pair), by_step(killed)
    for step in range(1, STEPS + 1):
        for other in (two, resumed):
            assert other[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-6, abs=1e-6)
            for key in ("tokens/pystdlib", "tokens/small", "epoch/small"):
                assert other[step][key] == one[step][key]
    last = one[STEPS]
    # The small source (33 rows) ran out and started again; every step's tokens are one of the two.
    assert last["epoch/small"] >= 1 and last["epoch/pystdlib"] == 0
    assert last["tokens/pystdlib"] + last["tokens/small"] == last["tokens"]
    # Per-source val where a source has a val split; the weighted val_loss of the sources that do.
    assert last["val_loss/pystdlib"] == pytest.approx(last["val_loss"])
    assert "val_loss/small" not in last and "val_bpb/pystdlib" in last
    log = (straight / "train.log").read_text()
    assert "data phase 1 starts" in log and "data source small starts epoch 1" in log


def lmforge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.launch.cli", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)


def test_dry_run_prints_the_mixture(tiny_data, tmp_path):
    small = small_source(tiny_data, tmp_path / "small")
    out = lmforge("train", "--dry-run", *mixture_args(tiny_data, small, tmp_path / "run"),
                  "--data.align", "doc")
    assert out.returncode == 0, out.stderr
    lines = {ln.split()[0]: ln for ln in out.stdout.splitlines() if "train tokens" in ln}
    assert set(lines) == {"pystdlib", "small"}
    # (8 steps at 0.3 + 8 at 0.5) x 512 tokens a step, over its 2,200 tokens: 1.49 epochs.
    assert "2,200 train tokens, weight 0.3/0.5, 1.49 epochs" in lines["small"]
    assert "% of doc rows padding" in lines["pystdlib"]
    assert "2 phase(s) from steps [0, 8]" in out.stdout
    assert not (tmp_path / "run").exists()  # a dry run starts nothing


def test_huge_weights_still_draw_from_every_source(tiny_data, tmp_path):
    """Weights whose sum overflows a float: half the rows from each source, in inspect and in
    train's plan, not all from one."""
    a, b = (Path(shutil.copytree(tiny_data, tmp_path / n)) for n in ("a", "b"))
    mix = f"{a}:1e308,{b}:1e308"
    proc = lmforge("inspect", str(a), "--rows", "64", "--mix", mix, "--seq-len", "64", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    drawn = [r["source"] for r in json.loads(proc.stdout)["rows"]]
    assert 16 < drawn.count("b") < 48, drawn  # half of 64, not none
    dry = lmforge("train", "--data.mix", mix, "--log.out_dir", str(tmp_path / "run"), *TINY_ARGS,
                  "--dry-run")
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert dry.stdout.count("weight 0.5, ") == 2, dry.stdout[-2000:]
