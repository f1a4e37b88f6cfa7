"""One declaration per argument: a command's arguments are a frozen dataclass (commands/args.py)
whose fields say how each is given, and everything else is derived from those fields — the
argparse arguments (:func:`add_arguments`), the typed value filled from what argparse read
(:func:`fill`), and the command line that makes a value again (:meth:`Command.argv`, what a
matrix cell runs and what ``init`` notes in the spec it writes). nox declares its options the
same way: once, with the parser, the environment and ``to_argv`` read from that.

A field's name is its argument's ``dest``; its type says the rest: a ``bool`` is a switch, a
``tuple`` a repeatable option (or several positionals), a ``Path`` is made from the text given.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

KEY = "cudaenv.option"


@dataclass(frozen=True)
class Option:
    """How one field is given on the command line: its flags (none for a positional) and what
    argparse is told beyond what the field's name, type and default say."""

    flags: tuple[str, ...]
    help: str | None
    argparse: dict[str, Any]


def _field(default: Any, flags: tuple[str, ...], help: str | None, kw: dict[str, Any]) -> Any:
    option = Option(flags, help, kw)
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata={KEY: option})
    return dataclasses.field(default=default, metadata={KEY: option})


def flag(*flags: str, help: str | None) -> Any:
    """A switch: False unless given."""
    return _field(False, flags, help, {"action": "store_true"})


def option(*flags: str, help: str | None, default: Any = None, **kw: Any) -> Any:
    """An option that takes one value (or ``nargs`` of them), ``default`` where not given."""
    return _field(default, flags, help, {"default": default, **kw})


def many(*flags: str, help: str | None, **kw: Any) -> Any:
    """A repeatable option: each value given, in order, as a tuple (empty where none is)."""
    kw.setdefault("action", "append")
    return _field((), flags, help, {"default": [], **kw})


def positional(*, help: str | None = None, **kw: Any) -> Any:
    """A positional argument; required unless ``nargs`` lets it be left out."""
    nargs = kw.get("nargs")
    default: Any = dataclasses.MISSING
    if nargs == "?":
        default = None
    elif nargs in ("*", argparse.REMAINDER):
        default = ()
    return _field(default, (), help, kw)


def options(kind: type[Command]) -> list[tuple[dataclasses.Field[Any], Option]]:
    """Each field of ``kind`` with how it is given, in declaration order."""
    return [(f, f.metadata[KEY]) for f in dataclasses.fields(kind) if KEY in f.metadata]


@dataclass(frozen=True, kw_only=True)
class Command:
    """What every command's arguments are."""

    def picks_env(self) -> bool:
        """Whether the command may pick an env in the project's .envs/ for the user (the
        CLI then names the project root where it is not the current directory)."""
        return False

    def argv(self) -> list[str]:
        """The arguments that make this value again, options first (``--name=value``, so a
        value that starts with ``-`` stays a value), then ``--`` and the positionals. What is
        at its default is left out."""
        out: list[str] = []
        tail: list[str] = []
        for f, opt in options(type(self)):
            value = getattr(self, f.name)
            if value is None or value == f.default:
                continue
            if not opt.flags:
                tail += [str(v) for v in value] if isinstance(value, tuple) else [str(value)]
                continue
            name = opt.flags[-1]
            if value is True:
                out.append(name)
            elif isinstance(value, tuple) and opt.argparse.get("action") in ("append", "extend"):
                out += [f"{name}={v}" for v in value]
            elif isinstance(value, tuple):
                # A fixed number of values (--compare A B): given apart, so none of them may
                # look like an option; argparse has no spelling that joins them.
                out += [name, *map(str, value)]
            else:
                out.append(f"{name}={value}")
        return [*out, "--", *tail] if tail else out


C = TypeVar("C", bound=Command)


def add_arguments(parser: argparse.ArgumentParser, kind: type[Command]) -> None:
    """``parser``'s arguments from ``kind``'s fields, and ``args_type`` set to ``kind``."""
    for f, opt in options(kind):
        kw = {"help": opt.help, **opt.argparse}
        if opt.flags:
            parser.add_argument(*opt.flags, dest=f.name, **kw)
        else:
            parser.add_argument(f.name, **kw)
    parser.set_defaults(args_type=kind)


def _is_path(hint: Any) -> bool:
    args = typing.get_args(hint)
    return hint is Path or Path in args or (bool(args) and _is_path(args[0]))


def fill(kind: type[C], parsed: argparse.Namespace) -> C:
    """``kind`` from the parsed arguments: each field from the ``dest`` of its name, lists
    (``nargs``, ``append``) as tuples, a text as a Path where the field holds one."""
    hints = typing.get_type_hints(kind)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(kind):
        value = getattr(parsed, f.name)
        path = _is_path(hints[f.name])
        if isinstance(value, list):
            value = tuple(Path(v) if path and isinstance(v, str) else v for v in value)
        elif isinstance(value, str) and path:
            value = Path(value)
        values[f.name] = value
    return kind(**values)
