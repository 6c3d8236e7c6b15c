"""The one exception type of data_prep: a user mistake with a one-line message naming the fix.

The CLI catches it and prints `error: <message>` (exit 2) instead of a traceback.
"""

import errno


class DataError(Exception):
    """Bad input to data_prep (missing files, bad spec, foreign output dir, corrupt shard, ...)."""


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC anywhere in `e`, its rank failures or their causes (torch's stream writer reports
    it as a RuntimeError naming the failed write, safetensors as a SafetensorError)."""
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


# The errors of a write that the user, not the code, must fix: a full disk or quota, a file too
# large for its filesystem, a read-only or forbidden path.
_UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


def output_error(e: BaseException, where: object, fix: str) -> DataError | None:
    """The one line of a failed write to the output path `where` (`fix`: what to do then), or
    None for any other failure (a bug keeps its traceback)."""
    if is_disk_full(e):
        why = "No space left on device"
    elif isinstance(e, OSError) and e.errno in _UNWRITABLE:
        why = e.strerror
    else:
        return None
    return DataError(f"cannot write {getattr(e, 'filename', None) or where} ({why}); {fix}")
