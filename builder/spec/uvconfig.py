"""The uv settings a resolve runs under when cudaenv supplies a package's metadata.

Some sdists compute their requirements in ``setup.py`` (causal-conv1d leaves
``Requires-Dist`` dynamic in PKG-INFO from 1.6.0 on, and 1.4.0 to 1.5.x write Metadata-Version
2.1, which uv does not trust), so uv would build each one to learn them: in an isolated env,
where ``import torch`` fails, or after installing the newest torch there. A table here names
what each such package's ``setup.py`` lists in ``install_requires``, and uv is handed it as
``[[dependency-metadata]]``: resolving never runs a release's build.

uv reads that setting from a ``uv.toml`` it discovers, and ``--config-file`` would replace the
project's own settings rather than add to them, so uv runs in a directory of ours whose
``uv.toml`` holds the project's settings followed by ours.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from builder.core import paths
from builder.core.errors import ResolveError
from builder.formats import tomlwriter
from builder.spec import project
from builder.spec.envspec import EnvSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

# name -> the requirements its setup.py passes as install_requires.
SUPPLIED: dict[str, tuple[str, ...]] = {
    # setup.py: install_requires=["torch", "packaging", "ninja"] (1.4.0 to 1.7.0).
    "causal-conv1d": ("torch", "packaging", "ninja"),
    # setup.py: install_requires=["torch", "packaging", "ninja"] (1.0.4.post1, 1.1.0).
    "fast-hadamard-transform": ("torch", "packaging", "ninja"),
}


def supplied_metadata(requirements: Sequence[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(name, requires) of each of ``requirements`` (a spec's ``packages:``) whose metadata
    cudaenv supplies: what the resolver is told instead of running its setup.py."""
    out: dict[str, tuple[str, ...]] = {}
    for text in requirements:
        try:
            name = canonicalize_name(Requirement(text).name)
        except InvalidRequirement:
            continue
        if name in SUPPLIED:
            out[name] = SUPPLIED[name]
    return tuple(sorted(out.items()))


def supplied_config(d: Path, spec: EnvSpec) -> Path | None:
    """A directory for uv to run in whose ``uv.toml`` hands it the metadata of the spec's
    packages that cudaenv supplies (``[[dependency-metadata]]``, :mod:`builder.env.recipes`),
    after the project's own uv settings (its root's ``uv.toml``, or the ``[tool.uv]`` table of
    its ``pyproject.toml``), which uv would read from there; None when nothing is supplied
    (uv then runs where cudaenv was started, as ever)."""
    supplied = supplied_metadata(spec.packages)
    if not supplied:
        return None
    own = _project_uv_config(spec)
    # The project's own entry for a package wins: uv takes one per name.
    theirs = {
        canonicalize_name(str(e.get("name", "")))
        for e in tomllib.loads(own).get("dependency-metadata", [])
        if isinstance(e, dict)
    }
    parts = [own]
    for name, requires in supplied:
        if name in theirs:
            continue
        parts.append(
            "[[dependency-metadata]]\n"
            f"{tomlwriter.pair('name', name)}\n{tomlwriter.pair('requires-dist', list(requires))}\n"
        )
    where = d / "uv-config"
    where.mkdir()
    (where / "uv.toml").write_text("\n".join(p for p in parts if p))
    return where


def _project_uv_config(spec: EnvSpec) -> str:
    """The uv settings of the spec's project root as ``uv.toml`` text: uv reads the nearest
    ``uv.toml`` (else a ``pyproject.toml`` with ``[tool.uv]``), and a run elsewhere must not
    lose them. Only a file no other user can write is read (:func:`project.find_pyproject`)."""
    found = project.find_pyproject(Path(spec.source)) if spec.source else None
    if found is None:
        return ""
    root = found.parent
    own = root / "uv.toml"
    if paths.project_file(own):
        return own.read_text(encoding="utf-8") + "\n"
    pyproject = root / "pyproject.toml"
    if not paths.project_file(pyproject):
        return ""
    try:
        table = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("tool", {}).get("uv")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return ""
    if not isinstance(table, dict):
        return ""
    try:
        return _toml_table(table, ())
    except (TypeError, ValueError) as exc:
        raise ResolveError(
            f"{pyproject}: [tool.uv] holds a value cudaenv cannot hand to uv ({exc})"
        ) from exc


def _toml_table(table: dict[str, object], at: tuple[str, ...]) -> str:
    """``table`` as TOML text: its plain keys first, then its sub-tables and arrays of them."""
    head = f"[{'.'.join(tomlwriter.key(k) for k in at)}]\n" if at else ""
    out = head + "".join(
        tomlwriter.pair(k, v) + "\n"
        for k, v in table.items()
        if not isinstance(v, dict) and not _tables(v)
    )
    for k, v in table.items():
        if isinstance(v, dict):
            out += "\n" + _toml_table(v, (*at, k))
        elif isinstance(v, list) and _tables(v):
            name = ".".join(tomlwriter.key(p) for p in (*at, k))
            for item in v:
                out += f"\n[[{name}]]\n" + "".join(
                    tomlwriter.pair(a, b) + "\n" for a, b in item.items()
                )
    return out


def _tables(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, dict) for x in value)
