"""How ranks leave the process group (pipeline.parallel.distributed.distributed), 2 processes on gloo.

A normal end holds every rank until the slowest is done, then destroys the group before the
interpreter exits; an exception leaves without any collective, so a failing rank cannot
deadlock on a peer that waits in another collective. This file is also the torchrun worker
(`python -m tests.test_process_group_exit MODE OUT_DIR`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.harness import run

pytestmark = pytest.mark.dist

LINGER_S = 3.0  # rank 0's extra work after the last collective (as when it writes samples)


def worker(mode: str, out_dir: Path) -> int:
    import torch
    import torch.distributed as dist

    from lmforge.pipeline.parallel.distributed import distributed

    record: dict = {}
    try:
        with distributed("cpu") as info:
            record["rank"] = info.rank
            dist.all_reduce(torch.ones(1))
            if mode == "raise" and info.rank == 1:
                raise RuntimeError("rank 1 fails")
            if mode == "raise":
                dist.all_reduce(torch.ones(1))  # rank 1 never joins this one
            if info.rank == 0:
                time.sleep(LINGER_S)
            record["body_end"] = time.time()
    except RuntimeError:
        record["raised"] = True
    record["left"] = time.time()
    record["initialized_after"] = dist.is_initialized()
    (out_dir / f"rank{record['rank']}.json").write_text(json.dumps(record))
    return 1 if record.get("raised") else 0


def launch(mode: str, out_dir: Path, timeout: float = 120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tests.test_process_group_exit", mode, str(out_dir)]
    t0 = time.time()
    res = run(cmd, timeout=timeout)
    ranks = {r: json.loads((out_dir / f"rank{r}.json").read_text())
             for r in (0, 1) if (out_dir / f"rank{r}.json").is_file()}
    return res, ranks, time.time() - t0


def test_normal_end_waits_for_the_slowest_rank_then_destroys_the_group(tmp_path):
    res, ranks, _ = launch("normal", tmp_path)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "terminate called" not in res.stdout
    # Rank 1 finished its work at once but left only after rank 0's lingering work ended.
    assert ranks[1]["body_end"] < ranks[0]["body_end"] - LINGER_S / 2
    assert ranks[1]["left"] >= ranks[0]["body_end"]
    assert not ranks[0]["initialized_after"] and not ranks[1]["initialized_after"]


def test_an_exception_skips_the_collective_teardown_and_ends_the_job(tmp_path):
    res, ranks, elapsed = launch("raise", tmp_path)
    assert res.returncode != 0
    assert ranks[1]["raised"] and ranks[1]["initialized_after"]  # no barrier, no destroy
    assert elapsed < 90  # rank 0, left waiting in a collective, was stopped: no 30-min timeout


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1], Path(sys.argv[2])))
