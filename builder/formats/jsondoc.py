"""Reading cudaenv's own JSON files (manifest, verify and matrix reports) into typed models.

As packaging's ``pylock.py`` does: each getter names the key path in its error
("in 'cells[2].columns'"), and the ``schema_version`` is checked before anything else, so a
file from another cudaenv is a clear one-line error, never a KeyError. The models are read
through builder/formats/codec.py, which drives this reader from their fields' type hints.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from builder.core.errors import ReportError
from builder.formats.yamldoc import Unreadable, read_input

# One of a closed set of strings (a Literal alias: a status, a severity, a toolchain source).
Choice = TypeVar("Choice", bound=str)


# cudaenv's largest JSON files are matrix reports of many cells: a few MiB.
MAX_BYTES = 64 << 20


def load(path: Path, what: str) -> object:
    """The JSON of ``path``; ReportError naming the file and ``what`` it should be. Read as
    every input file is (yamldoc.read_input): a regular file under a size cap, never a FIFO,
    a device or a directory; bytes that are not UTF-8 and nesting past the parser's depth are
    one line each, and no text of the file is shown."""
    try:
        raw = read_input(path, MAX_BYTES, what)
    except Unreadable as exc:
        raise ReportError(f"{path}: cannot read the {what} ({exc})") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReportError(
            f"{path}: the {what} is not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        ) from None
    try:
        return json.loads(text)
    except RecursionError:
        raise ReportError(f"{path}: the {what} is nested too deep to be one") from None
    except ValueError as exc:
        # The position only: json's message quotes no text, but say so by construction.
        at = (
            f"line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        )
        raise ReportError(f"{path}: the {what} is not JSON ({at or 'unreadable'})") from None


class Reader:
    """Typed access to one JSON object at ``path`` (``"cells[2]"``) inside ``where``."""

    def __init__(
        self,
        doc: object,
        where: str,
        what: str,
        schema_version: int | None = None,
        path: str = "",
    ) -> None:
        self.where, self.what, self.path = where, what, path
        if not isinstance(doc, dict):
            article = "an" if what[:1] in ("a", "e", "i", "o", "u") else "a"
            raise self.error(f"{article} {what} is a JSON object, got {type(doc).__name__}")
        self.doc: dict[str, Any] = doc
        if schema_version is not None:
            found = doc.get("schema_version")
            if found != schema_version:
                raise ReportError(
                    f"{where}: not a cudaenv {what} of schema version {schema_version} "
                    f"(schema_version is {found!r}); it was written by another cudaenv or "
                    "another tool"
                )

    def error(self, message: str, key: str | None = None) -> ReportError:
        at = self._at(key) if key is not None else self.path
        return ReportError(
            f"{self.where}: {self.what}: " + (f"in '{at}': " if at else "") + message
        )

    def _at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def child(self, value: dict[str, Any], key: str) -> Reader:
        """A reader of the object ``value`` found at ``key`` (``"cells[2]"``) below this one."""
        return Reader(value, self.where, self.what, path=self._at(key))

    def _get(self, key: str, kind: type | tuple[type, ...], name: str, *, required: bool) -> Any:
        if key not in self.doc:
            if required:
                raise self.error(f"missing key '{key}'", None)
            return None
        value = self.doc[key]
        if value is None and not required:
            return None
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise self.error(f"expected {name}, got {type(value).__name__}", key)
        return value

    def text(self, key: str) -> str:
        return str(self._get(key, str, "a string", required=True))

    def opt_text(self, key: str) -> str | None:
        value = self._get(key, str, "a string or null", required=False)
        return None if value is None else str(value)

    def choice(self, key: str, allowed: tuple[Choice, ...]) -> Choice:
        """The string at ``key``, which must be one of ``allowed`` (a Literal's values)."""
        return self._choice(self.text(key), allowed, key)

    def _choice(
        self, value: str, allowed: tuple[Choice, ...], key: str, noun: str | None = None
    ) -> Choice:
        for known in allowed:
            if value == known:
                return known
        raise self.error(
            f"unknown {noun or key} {value!r}; expected one of: {', '.join(allowed)}", key
        )

    def num(self, key: str, default: float | None = None) -> float:
        value = self._get(key, (int, float), "a number", required=default is None)
        if value is None:
            assert default is not None  # required=True raised otherwise
            return default
        return float(value)

    def opt_num(self, key: str) -> float | None:
        value = self._get(key, (int, float), "a number", required=False)
        return None if value is None else float(value)

    def items(self, key: str, *, required: bool = True) -> list[Any]:
        value = self._get(key, list, "a list", required=required)
        return list(value) if value is not None else []

    def texts(self, key: str, *, required: bool = True) -> tuple[str, ...]:
        items = self.items(key, required=required)
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise self.error(f"expected a string, got {type(item).__name__}", f"{key}[{i}]")
        return tuple(items)

    def subs(self, key: str) -> list[Reader]:
        return [
            Reader(item, self.where, self.what, path=f"{self._at(key)}[{i}]")
            for i, item in enumerate(self.items(key))
        ]

    def raw_map(self, key: str) -> Mapping[str, Any]:
        return dict(self._get(key, dict, "an object", required=True))
