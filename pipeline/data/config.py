"""The [data] section of the job config: one prepared directory or a weighted mixture of them,
which may change during the run by phases (e.g. an annealing mix). pipeline.config re-exports
these types and calls `validate_data` from its one `validate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from lmforge.pipeline.typed_config import ConfigError
from lmforge.pipeline.typed_config import bad_value as _bad

DEFAULT_DATA = "data/pystdlib"


@dataclass
class SourceConfig:
    path: str = ""
    """Directory written by `lmforge prepare`."""
    weight: float = math.nan
    """Required: share of the training rows drawn from this source (> 0; normalised)."""
    name: str = ""
    """Name in the metrics (tokens/NAME, val_loss/NAME); empty = the directory's basename."""


@dataclass
class PhaseConfig:
    from_step: float = 0.0
    """First step of the phase: a fraction of train.max_steps when below 1, else a step number."""
    sources: list[SourceConfig] = field(default_factory=list)
    """The mixture from that step on (as data.sources)."""


@dataclass
class DataConfig:
    path: str = ""
    """One directory written by `lmforge prepare`; empty with no sources = data/pystdlib."""
    mix: str = ""
    """Shorthand for sources: 'data/web:0.7,data/code:0.3' (weights normalised)."""
    sources: list[SourceConfig] = field(default_factory=list)
    """A weighted mixture of prepared directories (same tokenizer), instead of path."""
    phases: list[PhaseConfig] = field(default_factory=list)
    """Later mixtures, e.g. an annealing phase: [[data.phases]] from_step = 0.9, sources = [...]."""
    align: Literal["doc", "stream"] = "stream"
    """doc: every row starts at a document start, filled with whole documents by best fit (a longer
    one continues in the next rows; the rest is padding, not trained); stream: consecutive windows
    of the concatenated documents. The presets use doc: bench/results/align_bench_zen4.txt."""
    seq_len: int = 256
    """Tokens per training sequence; the loader reads rows of seq_len + 1 tokens."""

    def mixture(self) -> list[SourceConfig]:
        """The first phase's sources, names filled in: path, mix or sources, whichever is set."""
        if self.sources:
            given = self.sources
        elif self.mix:
            given = [SourceConfig(*_mix_item(item)) for item in self.mix.split(",")]
        else:
            given = [SourceConfig(self.path or DEFAULT_DATA, 1.0)]
        return named(given)

    @property
    def first_path(self) -> str:
        """The directory whose tokenizer and vocabulary the run uses (all sources share them)."""
        return self.mixture()[0].path


def named(sources: list[SourceConfig]) -> list[SourceConfig]:
    return [replace(s, name=s.name or Path(s.path.rstrip("/")).name or s.path) for s in sources]


def weights(sources: list[SourceConfig]) -> dict[str, float]:
    """Each source's share, summing to 1; scaled by the largest first (1e308s would sum to inf)."""
    top = max(s.weight for s in sources)
    scaled = {s.name: s.weight / top for s in sources}
    total = sum(scaled.values())
    return {name: w / total for name, w in scaled.items()}


def schedule(d: DataConfig) -> list[tuple[float, dict[str, float]]]:
    """The run's data schedule: (from_step, normalised weights) of each phase, the first at 0."""
    return [(0.0, weights(d.mixture()))] + [(p.from_step, weights(named(p.sources)))
                                            for p in d.phases]


def check_same_schedule(theirs: DataConfig, ours: DataConfig, where: object) -> None:
    """A resume keeps the data schedule it was started with (ConfigError otherwise): another
    mixture or phase plan would change the data under the same run without a word. The sources'
    order counts: each row's source is drawn by the weights' cumulative sum in that order."""
    old, new = schedule(theirs), schedule(ours)
    if [(start, list(ws.items())) for start, ws in old] != \
            [(start, list(ws.items())) for start, ws in new]:
        show = lambda phases: "; ".join(
            f"from {start:g}: " + ", ".join(f"{n} {w:.4g}" for n, w in ws.items())
            for start, ws in phases)
        raise ConfigError(
            f"checkpoint {where} was trained on the data schedule {show(old)}, this run asks for "
            f"{show(new)} (the sources in order); resume with the data.mix / data.sources / "
            "data.phases it was started with, in that order, or train the new mixture as a new "
            "run in another --log.out_dir")


def _mix_item(item: str) -> tuple[str, float]:
    path, sep, weight = item.strip().rpartition(":")
    try:
        return (path, float(weight)) if sep and path else (item.strip(), math.nan)
    except ValueError:
        return path, math.nan


DATA_KEYS = ("path", "mix", "sources")  # the three ways of naming the data: one at a time


def phase_start(from_step: float, max_steps: int) -> int:
    """The step at which a phase begins: from_step below 1 is a fraction of max_steps."""
    return round(from_step * max_steps) if from_step < 1 else int(from_step)


def validate_data(d: DataConfig, max_steps: int) -> None:
    """The mixture rules: one way of naming the data, positive weights, phases in order."""
    given = [k for k in DATA_KEYS if getattr(d, k)]
    if len(given) > 1:
        raise ConfigError(f"data.{given[0]} and data.{given[1]} are both set; give the data one "
                          "way: data.path (one directory), data.mix or data.sources (a mixture)")
    paths: dict[str, str] = {}
    for where, sources in [("data.mix" if d.mix else "data.sources", d.mixture())] + [
            (f"data.phases[{i}].sources", named(p.sources)) for i, p in enumerate(d.phases)]:
        if not sources:
            raise ConfigError(f"{where} is empty; list at least one {{ path = DIR, weight = W }}")
        for s in sources:
            if s.path == "":
                raise ConfigError(f"{where}: a source without a path; give each one "
                                  "path = the directory written by `lmforge prepare`")
            if not (math.isfinite(s.weight) and s.weight > 0):
                raise _bad(f"{where} weight of {s.path}", s.weight,
                           "a finite number > 0, required: data/web:0.7 or weight = 0.7")
            if paths.setdefault(s.name, s.path) != s.path:
                raise ConfigError(f"{where}: the name '{s.name}' is given to {paths[s.name]} and "
                                  f"{s.path}; give each source its own name = ...")
        if len({s.name for s in sources}) < len(sources):
            raise ConfigError(f"{where} lists a source twice; merge the entries' weights")
    previous = 0
    for i, p in enumerate(d.phases):
        if not (math.isfinite(p.from_step) and (p.from_step < 1 or p.from_step.is_integer())):
            raise _bad(f"data.phases[{i}].from_step", p.from_step,
                       "a fraction of train.max_steps in [0, 1) or a whole step number")
        if (start := phase_start(p.from_step, max_steps)) <= previous:
            raise ConfigError(f"data.phases[{i}] starts at step {start}, not after the previous "
                              f"phase (step {previous}); give phases increasing from_step")
        previous = start
