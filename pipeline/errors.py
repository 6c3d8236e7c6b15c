"""The checkpoint's user-error type, in a module without torch: the CLI catches it around every
subcommand, and `lmforge prepare` must not pay torch's seconds of import to do so."""

import errno


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, from another format version, or from another model."""


def refusal(where: object, why: str) -> CheckpointError:
    """A checkpoint file that is not what lmforge writes: one line naming the file and why."""
    return CheckpointError(f"refusing to load {where}: {why}; the checkpoint is corrupt or "
                           "crafted, use a checkpoint you trust")


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC anywhere in `e`, its rank failures or their causes (torch's stream writer reports
    it as a RuntimeError naming the failed write)."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if getattr(x, "errno", None) == errno.ENOSPC or "No space left" in str(x):
            return True
        todo += [x.__cause__, x.__context__, *(f for f, _ in getattr(x, "failures", {}).values())]
    return False
