"""The training loader: the rows (pipeline/data/rows.py) of one prepared split, or of a weighted
mixture of several, in a seeded global order that does not depend on the world size.

Each epoch is one permutation of a source's rows, seeded by (seed, epoch); every optimizer step
takes the next G = micro_batch_size * grad_accum_steps * world_size rows, of which rank r's
micro-step m is chunk r * grad_accum_steps + m. So 1 process with 2 accumulation steps and 2 with 1
see the same rows, and the state (global cursors) resumes on any world size. An epoch's tail of
fewer than G rows is dropped, so no row is read twice in an epoch. In a mixture each row of a step
is drawn from a source by the weights of the step's phase, from a generator seeded by (seed, step)
alone, and takes that source's next row; each source has its own epochs and permutations.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmforge.data_prep.errors import DataError
from lmforge.model.model import IGNORE_INDEX
from lmforge.pipeline.data.config import phase_start
from lmforge.pipeline.data.rows import StreamRows
from lmforge.pipeline.data.windows import TokenWindows
from lmforge.pipeline.metrics import get_logger

log = get_logger()


# Seeds the per-step source draws, apart from the permutations (which are seeded by (seed, epoch)).
_DRAW_STREAM = 0x6D6978
STATE_VERSION = 2


@dataclass(frozen=True)
class Source:
    """One source of a mixture: its name (in metrics), rows and the key of its permutations."""

    name: str
    rows: Any  # pipeline.data.rows.StreamRows | DocRows
    key: tuple[int, ...] = ()  # () for one directory: its permutations as before mixtures

    @staticmethod
    def keyed(name: str, rows: Any) -> Source:
        return Source(name, rows, (zlib.crc32(name.encode()),))


@dataclass(frozen=True)
class Phase:
    """From `from_step` (a fraction of max_steps below 1, else a step) on: these weights."""

    from_step: float
    weights: dict[str, float]


@dataclass
class StepRows:
    """This rank's rows of one step: tokens, tokens used per row, source and continuation."""

    w: np.ndarray  # (n, seq_len + 1) int64
    used: np.ndarray  # (n,)
    sources: list[str]
    continues: np.ndarray  # (n,) bool


def _split_xy(w: np.ndarray, used: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())
    y[torch.arange(y.shape[1]) >= torch.from_numpy(used - 1)[:, None]] = IGNORE_INDEX  # padding
    return x, y


def _counts(d: object, keys: tuple[str, ...]) -> bool:
    return isinstance(d, dict) and all(
        type(d.get(k)) is int and d[k] >= 0 for k in keys)  # type(): a bool is no count


def _checked_state(d: object) -> dict:
    """A loader state read from a checkpoint's meta.json, with the types and ranges the loader
    relies on; DataError otherwise (the file is damaged or hand-edited). Checkpoints of the
    loader's earlier state (before mixtures) are of checkpoint format 2, refused for resume."""
    sources = d.get("sources") if isinstance(d, dict) else None
    ok = _counts(d, ("version", "step")) and d["version"] == STATE_VERSION and \
        type(d.get("seed")) is int and isinstance(d.get("align"), str) and \
        isinstance(sources, dict) and all(_counts(c, ("epoch", "position", "tokens", "num_rows"))
                                          and c["position"] <= c["num_rows"]
                                          for c in sources.values())
    if not ok:
        raise DataError("the checkpoint's loader state (meta.json, \"loader\") is malformed; the "
                        "checkpoint is damaged: resume from another one or start a new run")
    return d


class TrainLoader:
    """This rank's micro-batches of each step. `sources`: a TokenWindows (one stream) or a
    mixture's Sources with its `phases`; `max_steps` resolves phases given as fractions."""

    def __init__(self, sources: TokenWindows | list[Source], micro_batch_size: int,
                 grad_accum_steps: int, rank: int, world_size: int, seed: int,
                 phases: list[Phase] | None = None, max_steps: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        if isinstance(sources, TokenWindows):
            sources = [Source("train", StreamRows(sources))]
        self.sources = {s.name: s for s in sources}
        self.phases = phases or [Phase(0.0, {s.name: 1.0 for s in sources})]
        self.max_steps = max_steps
        self.micro_batch_size, self.grad_accum_steps = micro_batch_size, grad_accum_steps
        self.rank, self.seed = rank, seed
        self.windows_per_step = micro_batch_size * grad_accum_steps * world_size
        for s in sources:
            if self.windows_per_step > s.rows.num_rows:
                w = s.rows.windows
                raise DataError(
                    f"one step needs {self.windows_per_step} windows of {w.seq_len + 1} tokens, "
                    f"the {w.split} split of {s.name} has only {s.rows.num_rows}; lower "
                    "train.global_batch_tokens or data.seq_len, or prepare more data")
        self.step = 0  # steps drawn
        self.step_targets = 0  # targets (non-padding) of the last step, over all ranks
        self.cursors = {name: {"epoch": 0, "position": 0, "tokens": 0} for name in self.sources}
        self._orders: dict[str, tuple[int, np.ndarray]] = {}

    @property
    def epoch(self) -> int:
        """The first source's epoch (of one directory: the epoch)."""
        return self.cursors[next(iter(self.sources))]["epoch"]

    @property
    def steps_per_epoch(self) -> int:
        return next(iter(self.sources.values())).rows.num_rows // self.windows_per_step

    def _order_of(self, name: str, epoch: int) -> np.ndarray:
        if self._orders.get(name, (-1,))[0] != epoch:
            source = self.sources[name]
            rng = np.random.default_rng([self.seed, epoch, *source.key])
            self._orders[name] = (epoch, rng.permutation(source.rows.num_rows))
        return self._orders[name][1]

    def phase(self, step: int) -> Phase:
        """The phase of the step after `step` completed steps."""
        started = [p for p in self.phases if phase_start(p.from_step, self.max_steps) <= step]
        return started[-1]

    def draw(self, step: int) -> list[str]:
        """Each of the step's global rows' source, by the phase's weights, from (seed, step)."""
        names = list(self.phase(step).weights)
        weights = np.array([self.phase(step).weights[n] for n in names], dtype=np.float64)
        if len(names) == 1:
            return names * self.windows_per_step
        u = np.random.default_rng([self.seed, step, _DRAW_STREAM]).random(self.windows_per_step)
        picks = np.searchsorted(np.cumsum(weights / weights.sum()), u, side="right")
        return [names[min(i, len(names) - 1)] for i in picks]

    def _plan(self) -> list[tuple[str, int]]:
        """(source, row) of each global row of the next step; advances every cursor."""
        drawn = self.draw(self.step)
        if self.step > 0 and self.phase(self.step) is not self.phase(self.step - 1):
            log.info("step %d: data phase %d starts: %s", self.step + 1,
                     self.phases.index(self.phase(self.step)), self.phase(self.step).weights)
        taken: dict[str, np.ndarray] = {}
        for name in dict.fromkeys(drawn):
            c, n = self.cursors[name], drawn.count(name)
            if c["position"] + n > self.sources[name].rows.num_rows:  # drop the partial tail
                c["epoch"], c["position"] = c["epoch"] + 1, 0
                log.info("step %d: data source %s starts epoch %d", self.step + 1, name,
                         c["epoch"])
            taken[name] = self._order_of(name, c["epoch"])[c["position"]:c["position"] + n]
            c["position"] += n
        its = {name: iter(rows) for name, rows in taken.items()}
        plan = [(name, int(next(its[name]))) for name in drawn]
        for name, rows in taken.items():
            self.cursors[name]["tokens"] += int((self.sources[name].rows.used_of(rows) - 1).sum())
        self.step_targets = sum(int(self.sources[n].rows.used_of([i])[0]) - 1 for n, i in plan)
        self.step += 1
        return plan

    def next_step(self) -> StepRows:
        """This rank's rows of the next step, with their sources."""
        per_rank = self.micro_batch_size * self.grad_accum_steps
        mine = self._plan()[self.rank * per_rank:(self.rank + 1) * per_rank]
        T1 = next(iter(self.sources.values())).rows.windows.seq_len + 1
        w, used = np.empty((len(mine), T1), dtype=np.int64), np.empty(len(mine), dtype=np.int64)
        cont = np.zeros(len(mine), dtype=bool)
        for name in dict.fromkeys(n for n, _ in mine):
            at = [j for j, (n, _) in enumerate(mine) if n == name]
            rows = [mine[j][1] for j in at]
            w[at], used[at] = self.sources[name].rows.read(rows)
            cont[at] = self.sources[name].rows.continues(rows)
        return StepRows(w, used, [n for n, _ in mine], cont)

    def next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """grad_accum_steps (x_BT, y_BT) int64 CPU tensors: this rank's share of the next step
        (padding targets are IGNORE_INDEX; `step_targets` counts the others over all ranks)."""
        rows, b = self.next_step(), self.micro_batch_size
        return [_split_xy(rows.w[m:m + b], rows.used[m:m + b])
                for m in range(0, len(rows.used), b)]

    def state_dict(self) -> dict:
        """The global cursors: the same on every rank, valid for any world size."""
        align = next(iter(self.sources.values())).rows.align
        return {"version": STATE_VERSION, "seed": self.seed, "align": align, "step": self.step,
                "sources": {name: dict(c, num_rows=self.sources[name].rows.num_rows)
                            for name, c in self.cursors.items()}}

    def load_state_dict(self, d: dict) -> None:
        d = _checked_state(d)
        ours = {n: s.rows.num_rows for n, s in self.sources.items()}
        theirs = {n: c["num_rows"] for n, c in d["sources"].items()}
        align = next(iter(self.sources.values())).rows.align
        if theirs != ours or d["seed"] != self.seed or d["align"] != align:
            raise DataError(
                f"the checkpoint's data order (seed {d['seed']}, align {d['align']}, rows "
                f"{theirs}) does not match this run's (seed {self.seed}, align {align}, rows "
                f"{ours}); resume with the same data.path, data.sources, data.align, "
                "data.seq_len and train.seed")
        self.step = int(d["step"])
        self.cursors = {n: {k: int(c[k]) for k in ("epoch", "position", "tokens")}
                        for n, c in d["sources"].items()}
