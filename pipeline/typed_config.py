"""Typed dataclass configs from TOML and the command line: the generic, schema-free half.

Field annotations are the contract: int, float, bool, str, `Literal[...]`, `X | None` (unset by
omitting it in TOML or by `none` on the command line) and `list[X]`; a value that breaks one is a
one-line `ConfigError`. Used by `pipeline.config` (nested sections, `--section.key` overrides) and
`launch.prepare` (flat `--kebab-case` flags, help from a field's `metadata={"help": ...}`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import math
import sys
import textwrap
import types
import typing
from typing import Any, Literal, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(Exception):
    """A bad config file, override or value; the message is one line naming the fix."""


# ----------------------------------------------------------------------------- schema

def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type (the annotations are strings under `from __future__`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def section_keys(root: type) -> list[str]:
    """Every 'section.key' of a root dataclass whose fields are section dataclasses."""
    return [f"{s}.{k}" for s, cls in field_types(root).items() for k in field_types(cls)]


def unknown_key(name: str, candidates: list[str]) -> ConfigError:
    # A right key in the wrong section ('train.lr' -> 'optim.lr') beats a near spelling.
    leaf = name.rsplit(".", 1)[-1]
    close = [c for c in candidates if c.rsplit(".", 1)[-1] == leaf and "." in c][:1]
    close = close or difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    hint = f" — did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown key '{name}'{hint}")


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring: the string literal right after the field in the class body
    (the form the config classes are written in; Python keeps none of it at run time)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {node.target.id: " ".join(nxt.value.value.split())
            for node, nxt in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)}


def keys_help(root: type) -> str:
    """Every `--section.key` of `root` with its type, default and docstring, for --help."""
    lines = []
    for section, cls in field_types(root).items():
        docs, defaults = field_docs(cls), cls()
        lines.append(f"[{section}]")
        for name, tp in field_types(cls).items():
            lines.append(f"  --{section}.{name} {type_name(tp)} = {getattr(defaults, name)!r}")
            lines += textwrap.wrap(docs.get(name, ""), 96, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- values

def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp)) if typing.get_origin(tp) is None else str(tp)


def bad_value(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"bad value for '{key}': {value!r} (expected {expected})")


def _optional(tp: Any) -> Any:
    """X of an `X | None` annotation, None of any other."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner
    return None


def parse_text(key: str, text: str, tp: Any) -> Any:
    """Turn a command-line string into a value of the field's type (checked by `check`)."""
    if (inner := _optional(tp)) is not None:
        return None if text.strip().lower() in ("none", "null") else parse_text(key, text, inner)
    if typing.get_origin(tp) is list:
        try:  # TOML array syntax, which also covers JSON's: '["def ", "import "]'
            return tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            raise bad_value(key, text, 'a list such as ["a", "b"]') from None
    if tp is bool:
        lowered = text.strip().lower()
        if lowered not in ("true", "false", "1", "0"):
            raise bad_value(key, text, "true | false | 1 | 0")
        return lowered in ("true", "1")
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            raise bad_value(key, text, tp.__name__) from None
    return text  # str and Literal[str]: `check` validates the choice


def check(key: str, value: Any, tp: Any) -> Any:
    """Return `value` if it has type `tp` (an int is accepted for a float), else raise."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise bad_value(key, value, f"one of {type_name(tp)}")
        return value
    if (inner := _optional(tp)) is not None:
        return None if value is None else check(key, value, inner)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise bad_value(key, value, f"a list of {type_name(item)}")
        # A table in a list is named by its index, where its own keys follow (data.sources[1].x).
        index = dataclasses.is_dataclass(item)
        return [check(f"{key}[{i}]" if index else key, v, item) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad_value(key, value, f"a table of {', '.join(field_types(tp))}")
        return build(tp, key, value, [f"{key}.{k}" for k in field_types(tp)])
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # bool is a subclass of int: `max_steps = true` must not pass as 1.
    if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
        raise bad_value(key, value, type_name(tp))
    return value


# ----------------------------------------------------------------------------- nested sections

def from_dict(root: type, d: dict[str, Any]) -> Any:
    """A `root` from nested section dicts: missing keys default, unknown ones are errors."""
    sections = field_types(root)
    for name, values in d.items():
        if name not in sections:
            raise unknown_key(name, list(sections) + section_keys(root))
        if not isinstance(values, dict):
            raise ConfigError(f"'{name}' must be a section ([{name}] in TOML), got {values!r}")
    return root(**{name: build(cls, name, d.get(name, {}), section_keys(root))
                   for name, cls in sections.items()})


def build(cls: type, where: str, values: dict[str, Any], candidates: list[str]) -> Any:
    """A `cls` from a dict (a section, or a table in a list such as data.sources)."""
    types_ = field_types(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in types_:
            raise unknown_key(f"{where}.{key}", candidates)
        kwargs[key] = check(f"{where}.{key}", value, types_[key])
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section that checks its own shapes (ModelConfig)
        raise ConfigError(str(e)) from None


def parse_overrides(overrides: list[str]) -> list[tuple[str, str]]:
    """['--a.b', '1', '--c.d=x'] -> [('a.b', '1'), ('c.d', 'x')]."""
    pairs, i = [], 0
    while i < len(overrides):
        arg = overrides[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument '{arg}' — overrides look like --section.key value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(overrides):
            key, value = arg[2:], overrides[i + 1]
            i += 2
        else:
            raise ConfigError(f"missing value for '{arg}' — write {arg} VALUE")
        pairs.append((key, value))
    return pairs


def apply_overrides(root: type, d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `--section.key value` of `overrides` in the nested dict `d`, parsed to its type."""
    sections = field_types(root)
    for key, text in parse_overrides(overrides):
        section, _, name = key.partition(".")
        types_ = field_types(sections[section]) if section in sections else {}
        if name not in types_:
            raise unknown_key(key, section_keys(root))
        d.setdefault(section, {})[name] = parse_text(key, text, types_[name])
    return d


# ----------------------------------------------------------------------------- flat flags

def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One `--kebab-case` flag per field of the flat dataclass `cls`: a bool is a switch, any other
    value type-checked (a bad one raises ConfigError, which argparse lets through)."""
    types_ = field_types(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag, tp = "--" + f.name.replace("_", "-"), types_[f.name]
        help_ = f.metadata.get("help", "")
        if tp is bool:
            parser.add_argument(flag, action="store_true", help=help_)
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(flag, type=_converter(flag, tp), default=default,
                            help=(help_ + shown).replace("%", "%%"))  # argparse %-formats help


def _converter(flag: str, tp: Any):
    def convert(text: str) -> Any:
        return check(flag, parse_text(flag, text, tp), tp)

    convert.__name__ = type_name(tp)  # what argparse names in its own messages
    return convert


def from_flags(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """A `cls` instance from the flags `add_flags` made, and `given` for the skipped fields."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in given}
    return cls(**values, **given)


def number(tp: type, lo: float, hi: float | None = None):
    """An argparse `type` for a numeric flag that is not a config field: a finite int or float
    >= lo (and <= hi if given). argparse names the flag in the error."""
    expected = ("an int" if tp is int else "a finite number") + (
        f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}")

    def convert(text: str):
        try:
            value = tp(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= lo and (hi is None or value <= hi)):
            raise argparse.ArgumentTypeError(f"{text!r} is not {expected}")
        return value

    convert.__name__ = tp.__name__
    return convert
