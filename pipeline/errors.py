"""The checkpoint's user-error type, in a module without torch: the CLI catches it around every
subcommand, and `lmforge prepare` must not pay torch's seconds of import to do so."""


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, from another format version, or from another model."""


def refusal(where: object, why: str) -> CheckpointError:
    """A checkpoint file that is not what lmforge writes: one line naming the file and why."""
    return CheckpointError(f"refusing to load {where}: {why}; the checkpoint is corrupt or "
                           "crafted, use a checkpoint you trust")
