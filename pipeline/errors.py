"""The checkpoint's user-error type, in a module without torch: the CLI catches it around every
subcommand, and `lmforge prepare` must not pay torch's seconds of import to do so."""


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, from another format version, or from another model."""
