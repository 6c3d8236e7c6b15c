"""The one exception type of data_prep: a user mistake with a one-line message naming the fix.

The CLI catches it and prints `error: <message>` (exit 2) instead of a traceback.
"""


class DataError(Exception):
    """Bad input to data_prep (missing files, bad spec, foreign output dir, corrupt shard, ...)."""
