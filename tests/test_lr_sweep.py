"""bench/lr_sweep.py's planning, which decides the runs its reported optima rest on: each wider
width's grid is centred on the narrower width's optimum, an optimum at a grid's edge walks on, and
the vertex is that of the parabola through the best point and its neighbours, evenly spaced or not.
On a ledger of made-up losses: no training runs."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from bench import lr_sweep

SEEDS = [2001, 2002]


def sweep_args(tmp_path) -> argparse.Namespace:
    return argparse.Namespace(widths=[128, 256, 512], seeds=SEEDS, span=[-1, 0, 1], optimizer="muon",
                              untied=False, centre=lr_sweep.CENTRE["muon"], family="muon",
                              coords=["matrix", "embed+scalar"], ledger=tmp_path / "runs.jsonl",
                              out_runs=tmp_path / "runs")


def record(args, width: int, coord: str, k: int, loss: float, seeds=SEEDS) -> None:
    """A finished run in the ledger, as final_loss writes one."""
    with args.ledger.open("a") as f:
        for seed in seeds:
            f.write(json.dumps({"run": lr_sweep.run_name(args.family, width, seed, coord, k),
                                "val_loss": loss, "lrs": lr_sweep.lrs_of(args.centre, coord, k)}) + "\n")


def bowl(best_k: float):
    """Losses of a parabola in k with its minimum at best_k."""
    return lambda k: 4.0 + 0.05 * (k - best_k) ** 2


@pytest.mark.parametrize("ks", [(-1, 0, 1, 2), (-3, 0, 2), (-1, 1, 4)])
def test_the_vertex_is_the_parabolas_minimum_on_an_uneven_grid_too(ks):
    loss = bowl(0.6)
    points = [(0.02 * 2.0 ** k, loss(k), []) for k in ks]
    assert math.log2(lr_sweep.vertex(points) / 0.02) == pytest.approx(0.6)


def test_an_edge_point_is_its_own_optimum():
    points = [(0.02 * 2.0 ** k, 5.0 - k, []) for k in (0, 1, 2)]
    assert lr_sweep.vertex(points) == pytest.approx(0.08)


def test_a_wider_width_is_swept_around_the_narrower_ones_optimum(tmp_path):
    args = sweep_args(tmp_path)
    for coord, best in (("matrix", 0.8), ("embed+scalar", 2.6)):
        for k in range(-1, 5):
            record(args, 128, coord, k, bowl(best)(k))
    assert lr_sweep.span(args, 128, "matrix") == [0, 1, -1]
    assert lr_sweep.settled(args, 128, "matrix") and lr_sweep.settled(args, 128, "embed+scalar")
    assert lr_sweep.span(args, 256, "matrix") == [1, 2, 0]
    assert lr_sweep.span(args, 256, "embed+scalar") == [3, 4, 2]
    assert lr_sweep.span(args, 512, "matrix") is None  # d256 has no optimum yet
    # Seed by seed: the first seed's whole bracket, the matrices' then the tables', first.
    tried, order = set(), []
    while (key := lr_sweep.next_run(args, tried)) is not None:
        tried.add(key)
        order.append(key[1:])
    assert order[:3] == [(256, 2001, "matrix", 1), (256, 2001, "matrix", 2), (256, 2001, "matrix", 0)]
    assert order[3:6] == [(256, 2001, "embed+scalar", k) for k in (3, 4, 2)]
    assert [o[1] for o in order[6:]] == [2002] * 6


def test_an_optimum_at_the_grids_edge_walks_on_until_bracketed(tmp_path):
    args = sweep_args(tmp_path)
    args.coords = ["matrix"]
    loss = bowl(2.2)
    for k in (-1, 0, 1):
        record(args, 128, "matrix", k, loss(k))
    assert lr_sweep.extension(args, 128, "matrix") == 2
    assert lr_sweep.next_run(args, set())[1:] == (128, 2001, "matrix", 2)
    assert lr_sweep.span(args, 256, "matrix") is None  # not settled: no start for the next width
    record(args, 128, "matrix", 2, loss(2), seeds=[2001])
    assert lr_sweep.extension(args, 128, "matrix") == 2  # the other seed has not run it yet
    record(args, 128, "matrix", 2, loss(2), seeds=[2002])
    assert lr_sweep.extension(args, 128, "matrix") == 3
    record(args, 128, "matrix", 3, loss(3))
    assert lr_sweep.extension(args, 128, "matrix") is None
    assert lr_sweep.span(args, 256, "matrix") == [2, 3, 1]


def test_an_untied_or_recentred_sweep_never_reads_the_tied_sweeps_runs(tmp_path):
    """Its runs differ (an LM head of its own, another centre) though their lrs may not: they
    get names, so run directories and ledger lines, of their own."""
    tied = sweep_args(tmp_path)
    record(tied, 128, "matrix", 0, 4.2)
    assert lr_sweep.final_loss(tied, "muon", 128, 2001, "matrix", 0) == 4.2
    recentred = lr_sweep.CENTRE["muon"] | {"head": 0.005, "embed": 0.2}
    for untied, centre, family in ((True, lr_sweep.CENTRE["muon"], "muon-untied"),
                                   (True, recentred, "muon-untied-embed0.2-head0.005")):
        assert lr_sweep.family("muon", untied, centre) == family
        other = sweep_args(tmp_path)
        other.untied, other.centre, other.family = untied, centre, family
        assert lr_sweep.final_loss(other, family, 128, 2001, "matrix", 0) is None
        assert lr_sweep.run_name(family, 128, 2001, "head", -1) == f"{family}_d128_s2001_head-1"
