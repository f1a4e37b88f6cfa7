"""TOML 1.0 values as text: strings, integers, booleans, datetimes, arrays, inline tables.

What a lock is written with (lock.py lays out its tables and comments itself; a generic
document writer was a third of a re-lock's overhead). Every value read back by ``tomllib``
is the value written (tests/test_lock.py holds it to that with hypothesis); what TOML cannot
hold is a ValueError or TypeError here, never a file a reader refuses.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}
# TOML 1.0 basic strings: '"', '\' and every control character but tab must be escaped, DEL
# (U+007F) included, which JSON's escapes leave raw (tomllib then rejects the file).
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f\x7f\ud800-\udfff]')
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_MINUTE = dt.timedelta(minutes=1)


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    if "\ud800" <= c <= "\udfff":
        # A lone surrogate has no UTF-8 form and TOML no escape for it.
        raise ValueError(f"{c!r} cannot be written to TOML: surrogates not allowed")
    return _ESCAPES.get(c) or f"\\u{ord(c):04X}"


def string(value: str) -> str:
    """``value`` as a TOML basic string; ValueError for a lone surrogate."""
    return '"' + _NEEDS_ESCAPE.sub(_escape, value) + '"'


@functools.lru_cache(maxsize=256)
def key(name: str) -> str:
    """A key: bare where TOML allows it, else quoted."""
    return name if _BARE_KEY.fullmatch(name) else string(name)


def datetime(value: dt.datetime) -> str:
    """An offset or local date-time (RFC 3339). An offset TOML cannot spell (seconds in it):
    ValueError."""
    offset = value.utcoffset()
    if offset and offset % _MINUTE:
        raise ValueError(f"{value!r}: TOML offsets are whole minutes")
    return value.isoformat()


def value(v: object) -> str:
    """Any value this writer knows; TypeError for one it does not (a float, None)."""
    write = _BY_TYPE.get(type(v))
    if write is not None:
        return write(v)
    if isinstance(v, str):
        return string(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, dt.datetime):
        return datetime(v)
    if isinstance(v, Mapping):
        return inline_table(v.items())
    if isinstance(v, (list, tuple)):
        return array(v)
    raise TypeError(f"no TOML value for {type(v).__name__}")


def array(items: Iterable[object]) -> str:
    """``[a, b]`` on one line."""
    return "[" + ", ".join([value(v) for v in items]) + "]"


def inline_table(items: Iterable[tuple[str, object]]) -> str:
    """``{ k = v, ... }`` (``{}`` when empty), as uv writes a lock's file entries."""
    parts = [f"{key(k)} = {_BY_TYPE.get(type(v), value)(v)}" for k, v in items]
    return "{ " + ", ".join(parts) + " }" if parts else "{}"


# The exact types a lock holds, found without a chain of isinstance (a lock writes ~3000
# values); subclasses take value()'s slower path.
_BY_TYPE: dict[type, Callable[[Any], str]] = {
    str: string,
    bool: lambda v: "true" if v else "false",
    int: str,
    dt.datetime: datetime,
    dict: lambda v: inline_table(v.items()),
    list: array,
    tuple: array,
}


def pair(name: str, v: object) -> str:
    """A ``key = value`` line."""
    return f"{key(name)} = {value(v)}"


def array_lines(name: str, items: Iterable[object]) -> list[str]:
    """``name = [`` then one indented item per line, each with a trailing comma, then ``]``."""
    return [f"{key(name)} = [", *(f"    {value(v)}," for v in items), "]"]
