"""The run directory's layout, defined here once (the checkpoint format inside it is
pipeline.checkpoint.format's)."""

from __future__ import annotations

from pathlib import Path


class RunDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.lock = self.root / "lock"  # the one run writing here (pipeline.checkpoint.lock)
        self.config = self.root / "config.toml"  # the resolved config (config.save_resolved)
        self.log = self.root / "train.log"  # rank 0's log (pipeline.metrics)
        self.metrics = self.root / "metrics.jsonl"  # one JSON line per logged step
        self.loss_plot = self.root / "loss.png"
        self.checkpoints = self.root / "checkpoints"  # step_00000100/: resumable checkpoints
        self.abandoned = self.checkpoints / "abandoned"  # TIME_.../: what a rollback moved aside
        self.final = self.root / "final"  # the consolidated export for eval / sample / export
