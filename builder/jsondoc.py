"""Reading cudaenv's own JSON files (manifest, verify and matrix reports) into typed models.

As packaging's ``pylock.py`` does: each getter names the key path in its error
("in 'cells[2].columns'"), and the ``schema_version`` is checked before anything else, so a
file from another cudaenv is a clear one-line error, never a KeyError.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from builder.archs import Arch
from builder.errors import ReportError

# One of a closed set of strings (a Literal alias: a status, a severity, a toolchain source).
Choice = TypeVar("Choice", bound=str)


def load(path: Path, what: str) -> object:
    """The JSON of ``path``; ReportError naming the file and ``what`` it should be."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ReportError(f"{path}: cannot read the {what} ({exc.strerror})") from exc
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ReportError(f"{path}: the {what} is not JSON ({exc})") from exc


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

    def opt_choice(self, key: str, allowed: tuple[Choice, ...]) -> Choice | None:
        value = self.opt_text(key)
        return None if value is None else self._choice(value, allowed, key)

    def choice_map(self, key: str, allowed: tuple[Choice, ...], noun: str) -> dict[str, Choice]:
        """An object whose every value is one of ``allowed`` (a ``noun``, for the error)."""
        return {
            k: self._choice(v, allowed, f"{key}.{k}", noun) for k, v in self.text_map(key).items()
        }

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

    def flag(self, key: str) -> bool:
        return bool(self._get(key, bool, "true or false", required=True))

    def opt_flag(self, key: str) -> bool:
        """A flag a document written by an older cudaenv lacks: false then."""
        return bool(self._get(key, bool, "true or false", required=False))

    def items(self, key: str, *, required: bool = True) -> list[Any]:
        value = self._get(key, list, "a list", required=required)
        return list(value) if value is not None else []

    def texts(self, key: str, *, required: bool = True) -> tuple[str, ...]:
        items = self.items(key, required=required)
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise self.error(f"expected a string, got {type(item).__name__}", f"{key}[{i}]")
        return tuple(items)

    def opt_text_map(self, key: str) -> dict[str, str] | None:
        """An object of strings, or None where the key is absent or null."""
        if self.doc.get(key) is None:
            return None
        return self.text_map(key)

    def text_map(self, key: str, *, required: bool = True) -> dict[str, str]:
        value = self._get(key, dict, "an object", required=required) or {}
        for k, v in value.items():
            if not isinstance(v, str):
                raise self.error(f"expected a string, got {type(v).__name__}", f"{key}.{k}")
        return dict(value)

    def nullable_text_map(self, key: str) -> dict[str, str | None]:
        """An object whose values are strings or null (an unset variable, a missing file)."""
        value = self._get(key, dict, "an object", required=True)
        for k, v in value.items():
            if v is not None and not isinstance(v, str):
                raise self.error(f"expected a string or null, got {type(v).__name__}", f"{key}.{k}")
        return dict(value)

    def archs(self, key: str) -> tuple[Arch, ...]:
        out = []
        for i, text in enumerate(self.texts(key)):
            try:
                out.append(Arch.parse(text))
            except ValueError as exc:
                raise self.error(str(exc), f"{key}[{i}]") from exc
        return tuple(out)

    def sub(self, key: str) -> Reader:
        return Reader(self._get(key, dict, "an object", required=True), self.where, self.what,
                      path=self._at(key))  # fmt: skip

    def opt_sub(self, key: str) -> Reader | None:
        value = self._get(key, dict, "an object or null", required=False)
        return None if value is None else Reader(value, self.where, self.what, path=self._at(key))

    def subs(self, key: str) -> list[Reader]:
        return [
            Reader(item, self.where, self.what, path=f"{self._at(key)}[{i}]")
            for i, item in enumerate(self.items(key))
        ]

    def raw_map(self, key: str) -> Mapping[str, Any]:
        return dict(self._get(key, dict, "an object", required=True))
