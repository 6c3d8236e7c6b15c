"""`lmforge` — one command, one subcommand per thing a user does.

    lmforge prepare  corpus -> tokenized shards        (launch.prepare, data_prep)
    lmforge inspect  summary + decoded sample of shards (launch.prepare)
    lmforge train    train a model, torchrun on request (launch.train, pipeline)
    lmforge eval     perplexity / bits-per-byte         (launch.evaluate)
    lmforge sample   generate text from a checkpoint    (launch.sample)
    lmforge export   Hugging Face Llama format          (launch.export)
    lmforge demo     the whole pipeline, offline        (launch.demo)
    lmforge env      what this machine is and can do    (launch.envinfo)

Each subcommand lives in its own module with a `main(argv) -> int`; importing them lazily keeps
`lmforge --help` instant. User mistakes raise one of USER_ERRORS and become one `error:` line
and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

SUBCOMMANDS = {
    "prepare": ("lmforge.launch.prepare", "main", "tokenize a corpus into shards"),
    "inspect": ("lmforge.launch.prepare", "inspect_main", "summarise shards and decode a sample"),
    "train": ("lmforge.launch.train", "cli_main", "train (use --nproc N to start torchrun)"),
    "eval": ("lmforge.launch.evaluate", "main", "loss, perplexity and bits per byte of a checkpoint"),
    "sample": ("lmforge.launch.sample", "main", "generate text from a checkpoint"),
    "export": ("lmforge.launch.export", "main", "export a checkpoint to the Hugging Face Llama format"),
    "demo": ("lmforge.launch.demo", "main", "prepare -> train -> eval -> sample on the built-in corpus"),
    "env": ("lmforge.launch.envinfo", "main", "this machine: torch build, devices, dtype auto picks, peak"),
}


class _StoreOnce(argparse._StoreAction):
    """argparse's store, refusing a second value for one flag: plain argparse keeps the last and
    drops the others without a word (`--source a --source b` prepared b alone)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if self.dest in parser.given:
            parser.error(f"{'/'.join(self.option_strings)} is given twice; give it once")
        parser.given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes (a missing flag, a bad number or choice, a flag given twice) are
    one `error:` line and exit status 2 through `run_user_command`, like every other user error,
    not a usage block."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.given: set[str] = set()
        for name in (None, "store"):
            self.register("action", name, _StoreOnce)

    def parse_known_args(self, args=None, namespace=None):
        self.given = set()
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        from lmforge.pipeline.typed_config import ConfigError

        raise ConfigError(f"{message} (see {self.prog} --help)")


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean 'the user asked for something wrong', not 'a bug'."""
    from lmforge.data_prep.errors import DataError
    from lmforge.pipeline.errors import CheckpointError
    from lmforge.pipeline.typed_config import ConfigError

    return (DataError, CheckpointError, ConfigError)


def _usage() -> str:
    lines = ["usage: lmforge <command> [options]   (lmforge <command> --help for its options)", ""]
    lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


ERROR_DIR = "LMFORGE_ERROR_DIR"  # set by `lmforge train --nproc N` for the ranks it starts


def report_error(line: str) -> None:
    """A user error's one line: on stderr, or, in a rank that `lmforge train --nproc N` started,
    into the launcher's error directory (the launcher prints it once, for every rank)."""
    if ERROR_DIR in os.environ and "RANK" in os.environ:
        Path(os.environ[ERROR_DIR], f"rank{int(os.environ['RANK']):05d}").write_text(line)
    else:
        print(line, file=sys.stderr)


def run_user_command(fn, argv: list[str]) -> int:
    """Call a subcommand's main, turning user errors into one line on stderr and exit code 2."""
    errors = user_errors()
    try:
        rc = int(fn(argv) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return rc
    except errors as e:
        report_error(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`lmforge inspect DIR | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141  # what a shell reports for a command killed by SIGPIPE


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        import difflib

        close = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
        hint = f" — did you mean '{close[0]}'?" if close else ""
        print(f"error: unknown command '{name}'{hint} (see lmforge --help)", file=sys.stderr)
        return 2
    module, func, _ = SUBCOMMANDS[name]
    return run_user_command(getattr(importlib.import_module(module), func), rest)


if __name__ == "__main__":
    sys.exit(main())
