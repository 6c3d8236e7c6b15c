"""bench/lr_sweep.py's planning, which decides the runs its reported optima rest on: each wider
width's grid is centred on the narrower width's optimum, an optimum at a grid's edge walks on, and
the vertex is that of the parabola through the best point and its neighbours, evenly spaced or not.
On a ledger of made-up losses: no training runs."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from bench import lr_sweep, optimum

SEEDS = [2001, 2002]


def sweep_args(tmp_path) -> argparse.Namespace:
    return argparse.Namespace(widths=[128, 256, 512], seeds=SEEDS, span=[-1, 0, 1], optimizer="muon",
                              untied=False, centre=lr_sweep.CENTRE["muon"], family="muon",
                              coords=["matrix", "embed+scalar"], ledger=tmp_path / "runs.jsonl",
                              out_runs=tmp_path / "runs", rule=0, ref_width=256, data=tmp_path, batch=1, steps=200)


def record(args, width: int, coord: str, k: int, loss: float, seeds=SEEDS) -> None:
    """A finished run in the ledger, as final_loss writes one."""
    with args.ledger.open("a") as f:
        for seed in seeds:
            f.write(json.dumps({"run": lr_sweep.run_name(args.family, width, seed, coord, k),
                                "val_loss": loss, "lrs": (lrs := lr_sweep.lrs_of(args.centre, coord, k)),
                                "model_lrs": lr_sweep.model_lrs(args, width, lrs)}) + "\n")


def bowl(best_k: float):
    """Losses of a parabola in k with its minimum at best_k."""
    return lambda k: 4.0 + 0.05 * (k - best_k) ** 2


@pytest.mark.parametrize("ks", [(-1, 0, 1, 2), (-3, 0, 2), (-1, 1, 4)])
def test_the_vertex_is_the_parabolas_minimum_on_an_uneven_grid_too(ks):
    loss = bowl(0.6)
    points = [(0.02 * 2.0 ** k, loss(k), []) for k in ks]
    assert math.log2(optimum.vertex(points) / 0.02) == pytest.approx(0.6)


def test_an_edge_point_is_its_own_optimum():
    points = [(0.02 * 2.0 ** k, 5.0 - k, []) for k in (0, 1, 2)]
    assert optimum.vertex(points) == pytest.approx(0.08)


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


def test_a_rule_costs_nothing_where_it_carries_the_optimum_and_its_miss_where_it_does_not(tmp_path):
    """Optima that halve per doubling of width (exponent -1): muP's rule costs ~0; the others' cost
    is read off each width's parabola, the worst width's reported."""
    args = sweep_args(tmp_path)
    args.coords, args.ref_width = ["matrix"], 256
    best = {128: 1.3, 256: 0.3, 512: -0.7}  # the optimum's k at each width
    for width, k0 in best.items():
        for k in range(-2, 3):
            record(args, width, "matrix", k, bowl(k0)(k))
    found = lr_sweep.curves(args)
    optima = {("matrix", w): optimum.vertex(optimum.means(found["matrix", w])) for w in best}
    costs = dict(part.split(": ") for part in lr_sweep.rule_costs(args, found, optima, "matrix")
                 .split(" (")[0].split(", "))
    assert costs["-1"] == "+0.000 nats"
    assert costs["-0.5"] == f"+{0.05 * 0.5 ** 2:.3f} nats"  # one width misses by half a step
    # d512's rule lr (k 0.3) is past its parabola's points (k -2..0): at most the worse grid point
    # around it (k 1, 1.7 steps from the optimum)
    assert costs["0"] == f"<=+{0.05 * 1.7 ** 2:.3f} nats"


@pytest.mark.parametrize("rule", [0, 256])
def test_the_reported_lr_is_the_one_the_run_trains_with_whatever_tiny_toml_says(tmp_path, rule):
    """A run's lr_ref_width is the sweep's (tiny.toml's once scaled runs labelled unscaled): the
    lr a run's command gives the trainer, resolved as the trainer resolves it, is the lr curves()
    reports for it."""
    from lmforge.pipeline.config import load_config
    from lmforge.pipeline.optim.lrs import peak_lrs

    args = sweep_args(tmp_path)
    args.untied, args.coords, args.rule = True, ["head"], rule
    for width in (128, 512):
        record(args, width, "head", 1, 4.0)
        cmd = lr_sweep.run_cmd(args, tmp_path / "run", width, 2001, "head", 1)
        flags = cmd[cmd.index("--config") + 2:]
        cfg = load_config(lr_sweep.ROOT / "configs" / "tiny.toml", flags)
        (reported, _, _), = lr_sweep.curves(args)["head", width]
        assert peak_lrs(cfg.optim, width)["head"] == pytest.approx(reported)
        given = lr_sweep.lrs_of(args.centre, "head", 1)["head"]
        assert reported == pytest.approx(given * ((width / 256) ** -0.5 if rule else 1))


def test_a_batch_sweep_trains_the_tokens_asked_and_names_its_runs_apart(tmp_path):
    """--batch 4: each run takes 4x tiny.toml's tokens a step, for a quarter of its steps (the
    same tokens) or for --steps; the warmup stays 10 % of the steps; each shape has names of its own."""
    from lmforge.pipeline.config import load_config

    tiny = load_config(lr_sweep.ROOT / "configs" / "tiny.toml", [])
    args = sweep_args(tmp_path)
    for steps, family in ((50, "adamw-rule256-batch4"), (200, "adamw-rule256-batch4-steps200")):
        args.batch, args.steps = 4, steps
        cmd = lr_sweep.run_cmd(args, tmp_path / "run", 128, 2001, "matrix", 0)
        cfg = load_config(lr_sweep.ROOT / "configs" / "tiny.toml", cmd[cmd.index("--config") + 2:])
        assert cfg.train.global_batch_tokens == 4 * tiny.train.global_batch_tokens
        assert (cfg.train.max_steps, cfg.optim.warmup_steps) == (steps, steps // 10)
        assert lr_sweep.family("adamw", False, lr_sweep.CENTRE["adamw"], 256, 4, steps) == family
    assert tiny.optim.warmup_steps * 10 == tiny.train.max_steps == lr_sweep.STEPS
    assert lr_sweep.family("adamw", False, lr_sweep.CENTRE["adamw"], 256) == "adamw-rule256"
