"""Eval batches hold at most as many rows as the most windows any rank has: a --batch-size far
above the split's windows costs no padding rows (computed and thrown away), and the numbers do
not change with it."""

from __future__ import annotations

import json

import pytest

from lmforge.launch.cli import main as lmforge
from lmforge.pipeline.data.loader import IGNORE_INDEX, TokenWindows
from lmforge.pipeline.evaluate import eval_batches
from tests.test_eval_sample_export import SEQ_LEN, make_checkpoint


@pytest.mark.parametrize("world", [1, 3])
def test_rows_never_exceed_the_most_windows_a_rank_has(tiny_data, world):
    windows = TokenWindows(tiny_data, "val", SEQ_LEN, None)
    n = -(-(windows.num_tokens - 1) // SEQ_LEN)
    most = -(-n // world)
    for rank in range(world):
        (x_BT, y_BT), = eval_batches(windows, 65_536, rank, world)
        assert x_BT.shape == y_BT.shape == (most, SEQ_LEN)
        assert (y_BT != IGNORE_INDEX).any(dim=1).sum() == len(range(rank, n, world))
    # Below the windows, the batch size is kept: ceil(most / 7) batches of 7 rows.
    batches = eval_batches(windows, 7, 0, world)
    assert len(batches) == -(-most // 7) and {x.shape[0] for x, _ in batches} == {7}


def test_a_huge_batch_size_gives_the_same_loss(tiny_data, tmp_path, capsys):
    ckpt = str(make_checkpoint(tmp_path / "final", tiny_data))
    results = []
    for batch_size in ("3", "65536"):
        out = tmp_path / f"b{batch_size}.json"
        assert lmforge(["eval", "--ckpt", ckpt, "--data", str(tiny_data), "--batch-size",
                        batch_size, "--max-tokens", "2000", "--json", str(out)]) == 0
        results.append(json.loads(out.read_text()))
    capsys.readouterr()
    assert results[0]["tokens"] == results[1]["tokens"] == 2000
    assert results[1]["loss"] == pytest.approx(results[0]["loss"], rel=1e-6)
