"""The run directory's layout, defined here once (the checkpoint format inside it is
pipeline.checkpoint.format's):

    RUN/lock                             the one run writing here (pipeline.checkpoint.lock)
    RUN/config.toml                      the resolved config (pipeline.config.save_resolved)
    RUN/train.log                        rank 0's log (pipeline.metrics)
    RUN/metrics.jsonl, RUN/loss.png      one JSON line per logged step; the loss curve
    RUN/checkpoints/step_00000100/       training checkpoints (resumable)
    RUN/checkpoints/abandoned/TIME_.../  checkpoints a rollback moved aside
    RUN/final/                           the consolidated export for eval / sample / export
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def lock(self) -> Path:
        return self.root / "lock"

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def loss_plot(self) -> Path:
        return self.root / "loss.png"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def abandoned(self) -> Path:
        return self.checkpoints / "abandoned"

    @property
    def final(self) -> Path:
        return self.root / "final"
