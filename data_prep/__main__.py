"""`python -m data_prep [prepare] ARGS` or `python -m data_prep inspect DIR`."""

import sys

from data_prep.cli import inspect_main, main

argv = sys.argv[1:]
if argv[:1] == ["inspect"]:
    sys.exit(inspect_main(argv[1:]))
sys.exit(main(argv[1:] if argv[:1] == ["prepare"] else argv))
