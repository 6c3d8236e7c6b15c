"""A multiple-choice example as lm-evaluation-harness scores it, and our JSONL task format.

lm-eval (0.4.13, `ConfigurableTask.construct_requests` / `process_results`) turns choice i of a
question into one log-likelihood request (context_i, continuation_i): most tasks share one
context and put the choices in the continuations (after a target delimiter, " " by default);
WinoGrande puts each choice in its own context and shares the continuation. `acc` takes the
choice of the highest summed log-likelihood, `acc_norm` the highest divided by the length in
characters of the choice *as the task lists it* (without the delimiter).

Our file format, one example a line:  {"context": str, "choices": [str, ...], "gold": int}
(optional "id"). Each choice is scored as the continuation exactly as given: no delimiter is
added, so a task that wants a space before its answers writes it into each choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.safe_files import read_bytes

MAX_TASK_BYTES = 1 << 30  # a task file larger than this is refused unread
FORMAT_HINT = 'one JSON object a line: {"context": str, "choices": [str, ...], "gold": int}'


@dataclass(frozen=True)
class Example:
    requests: tuple[tuple[str, str], ...]  # (context, continuation) of each choice
    norm_chars: tuple[int, ...]  # acc_norm's divisor of each choice: its length in characters
    gold: int

    @classmethod
    def of(cls, context: str, choices: list[str], gold: int, delimiter: str = "") -> Example:
        """The usual shape: one context, each choice its continuation after `delimiter`."""
        return cls(tuple((context, delimiter + c) for c in choices),
                   tuple(len(c) for c in choices), gold)

    @property
    def chance(self) -> float:
        return 1.0 / len(self.requests)


def _line_error(path: Path, n: int, problem: str) -> DataError:
    return DataError(f"task file {path} line {n}: {problem}; expected {FORMAT_HINT}")


def parse_example(obj: object, path: Path, n: int) -> Example:
    """One decoded line, checked field by field."""
    if not isinstance(obj, dict):
        raise _line_error(path, n, f"a JSON {type(obj).__name__}, not an object")
    if unknown := sorted(set(obj) - {"context", "choices", "gold", "id"}):
        raise _line_error(path, n, f"unknown key {unknown[0]!r}")
    context, choices, gold = obj.get("context"), obj.get("choices"), obj.get("gold")
    if not isinstance(context, str):
        raise _line_error(path, n, '"context" missing or not a string')
    if context and not context.strip():
        raise _line_error(path, n, '"context" is only whitespace (use "" for no context)')
    if not isinstance(choices, list) or len(choices) < 2:
        raise _line_error(path, n, f'"choices" must list at least 2 strings, got {choices!r:.60}')
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise _line_error(path, n, f"choice {i} is {c!r:.40}, not a non-empty string")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise _line_error(path, n, f'"gold" is {gold!r:.20}, not an index into the '
                                   f"{len(choices)} choices (0 to {len(choices) - 1})")
    return Example.of(context, choices, gold)


def load_jsonl(path: Path) -> list[Example]:
    """Every example of a task file; any bad line is one DataError naming it and the fix."""
    data = read_bytes(path, MAX_TASK_BYTES, what="task file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"task file {path} is not UTF-8 text (byte {e.start}); save it as "
                        "UTF-8") from None
    lines = text.split("\n")
    examples = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            last = n == len(lines)  # no newline after it: the file may have been cut short
            why = "is cut short (the file looks truncated)" if last else f"is not JSON ({e.msg})"
            raise _line_error(path, n, why) from None
        except ValueError as e:  # a number past Python's 4,300 digits
            raise _line_error(path, n, f"is not JSON we read ({str(e)[:80]})") from None
        except RecursionError:
            raise _line_error(path, n, "nests its values too deeply to be read") from None
        examples.append(parse_example(obj, path, n))
    if not examples:
        raise DataError(f"task file {path} holds no example; expected {FORMAT_HINT}")
    return examples
