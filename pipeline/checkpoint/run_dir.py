"""The run directory's layout, defined here once (the checkpoint format inside it is
pipeline.checkpoint.format's), and what each of its paths must be before a run writes there."""

from __future__ import annotations

from pathlib import Path

from lmforge.data_prep.safe_files import check_dir, check_file, check_tree


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
        self.wandb = self.root / "wandb"  # wandb's own files (log.wandb), written by wandb


def check_run_dir(root: str | Path) -> None:
    """Rank 0, holding the lock, before it writes anything: each file lmforge writes in the run
    directory absent or a regular file with one name, and checkpoints/, final/ and final.tmp/
    (a crashed export's) absent or directories of directories and regular files
    (safe_files.UnsafeFile otherwise), and wandb/ absent or a directory. A link there would carry
    a write (metrics.jsonl appended, loss.png rewritten, wandb's files) or a read outside; a FIFO
    would hang the run."""
    run = RunDir(root)
    for path in (run.config, run.log, run.metrics, run.loss_plot):
        check_file(path, what="run file", writing=True)
    for tree, what in ((run.checkpoints, "checkpoint directory"), (run.final, "final export"),
                       (run.final.with_name("final.tmp"), "final export")):
        if tree.exists() or tree.is_symlink():
            check_tree(tree, what=what)
    if run.abandoned.exists():  # where a rollback moves checkpoints to
        check_dir(run.abandoned, what="checkpoint directory")
    if run.wandb.exists() or run.wandb.is_symlink():  # wandb writes in it, through any link
        check_dir(run.wandb, what="wandb directory")
