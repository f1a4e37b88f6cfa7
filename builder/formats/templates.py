"""The jinja environment the env's scripts are rendered with (its quoting filters for each
shell), and :func:`render`, which memoises a rendered template under the cache's trust rules.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from builder.core import cachefiles
from builder.core.paths import cache_dir

if TYPE_CHECKING:
    import jinja2


def templates() -> jinja2.Environment:
    # Imported here, not at the top: it costs ~20 ms and `cudaenv lock` imports this module
    # (through matrix and report) without rendering anything.
    import jinja2

    loader = jinja2.FunctionLoader(_load_template)
    env = jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined,  # a missing value is an error, never an empty string
        # Shell and Python, not HTML: every value goes through shquote / pyrepr below.
        autoescape=False,  # noqa: S701
        keep_trailing_newline=True,
    )
    env.filters["shquote"] = lambda v: shlex.quote(str(v))
    # json.dumps of a str is a valid Python string literal with every control char escaped.
    env.filters["pyrepr"] = lambda v: json.dumps(str(v))
    env.filters["pyrepr_list"] = lambda v: "[" + ", ".join(json.dumps(str(x)) for x in v) + "]"
    # fish: inside single quotes only \\ and \' are escapes.
    env.filters["fishquote"] = lambda v: (
        "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"
    )
    env.filters["nuquote"] = _nuquote
    env.filters["cshquote"] = _cshquote
    env.filters["psquote"] = _psquote
    return env


def _cshquote(value: object) -> str:
    """A csh word: single quotes, where history's ! and a newline still need a backslash and
    a quote is closed, escaped and reopened."""
    text = str(value).replace("'", "'\\''").replace("!", "\\!").replace("\n", "\\\n")
    return f"'{text}'"


def _nuquote(value: object) -> str:
    """A nushell literal: single quotes have no escapes; a value holding one becomes a raw
    string r#'...'# with more #s than any run after a quote in it."""
    text = str(value)
    if "'" not in text:
        return f"'{text}'"
    hashes = "#"
    while "'" + hashes in text:
        hashes += "#"
    return f"r{hashes}'{text}'{hashes}"


# PowerShell takes the typographic single quotes as quotes too; each is escaped by doubling.
_PS_QUOTES = "'\u2018\u2019\u201a\u201b"


def _psquote(value: object) -> str:
    return "'" + "".join(c + c if c in _PS_QUOTES else c for c in str(value)) + "'"


def _load_template(name: str) -> str:
    try:
        return resources.files("builder.templates").joinpath(name).read_text()
    except ModuleNotFoundError:
        # Run from a source tree on PYTHONPATH (not installed): templates/ sits beside builder/.
        return (Path(__file__).resolve().parents[2] / "templates" / name).read_text()


def render(name: str, values: Mapping[str, object]) -> str:
    """Template ``name`` rendered with ``values``, memoised by what decides the text: the
    template's source, this module's source (the filters and Environment options) and the
    values. A warm build then neither imports jinja2 nor compiles a template (~35 ms). Only a
    successful render is stored, so a template error is raised every time."""
    try:
        material = json.dumps(
            [name, _load_template(name), Path(__file__).read_text(), values], sort_keys=True
        )
    except OSError:  # no source beside the module (a .pyc-only install): no memo
        return templates().get_template(name).render(values)
    memo = cache_dir() / "rendered" / f"{hashlib.sha256(material.encode()).hexdigest()}.txt"
    # The hook runs in every interpreter start of the env, as whoever starts it: a memo is
    # taken only under the cache's trust rules (cachefiles), else rendered afresh.
    kept = cachefiles.read_text(memo)
    if kept is not None:
        return kept
    text = templates().get_template(name).render(values)
    cachefiles.write_text(memo, text)
    return text
