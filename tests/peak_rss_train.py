"""`python -m tests.peak_rss_train ARGS` (under torchrun too): lmforge.launch.train, then this
process's peak RSS (VmHWM) as a line "peak_rss_mb RANK MB" on stdout, for tests/test_fsdp_memory.py.
The product carries none of this."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    from lmforge.launch.cli import run_user_command
    from lmforge.launch.train import main

    rc = run_user_command(main, sys.argv[1:])
    hwm = next(ln for ln in Path("/proc/self/status").read_text().splitlines()
               if ln.startswith("VmHWM:"))
    print(f"peak_rss_mb {os.environ.get('RANK', '0')} {int(hwm.split()[1]) / 1024:.0f}", flush=True)
    sys.exit(rc)
