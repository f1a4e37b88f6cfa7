"""One ``uv pip compile`` for one platform, and its PEP 751 output parsed: the request file
uv reads (index pins included), the command line, uv's refusals turned into ResolveError with
uv's own words, and the parse memo that makes an unchanged re-lock as fast as raw uv.

What is asked of uv, and what is made of its answers under the matching policy, is
:mod:`builder.spec.resolve`'s.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from builder.core import cachefiles, indexview, platforms, proc
from builder.core.errors import ResolveError, ToolMissing
from builder.core.paths import cache_dir
from builder.machine import interpreters
from builder.spec import uvconfig
from builder.spec.envspec import EnvSpec
from builder.spec.lock import (
    LockedPackage,
    packages_from_json,
    packages_to_json,
    parse_packages,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def platform_of(spec: EnvSpec) -> platforms.Platform:
    """The one platform a resolver call is for. :func:`resolve.resolve` narrows the spec's
    ``platforms`` to each in turn, so every uv call (and a test's stand-in for it) sees one."""
    if len(spec.platforms) != 1:
        raise ValueError(f"a resolver call is for one platform, not {spec.platforms}")
    return platforms.get(spec.platforms[0])


@dataclass(frozen=True, kw_only=True)
class Resolution:
    packages: tuple[LockedPackage, ...]
    seconds: float


class Compiler(Protocol):
    """What resolves a request for one platform: :func:`uv_compile`, or a test's recorded
    answers. ``extra_args`` are uv flags (``--no-deps``, ``--resolution=lowest``)."""

    def __call__(
        self,
        spec: EnvSpec,
        requirements: Sequence[str],
        constraints: Sequence[str],
        overrides: Sequence[str],
        /,
        *,
        extra_args: Sequence[str] = (),
    ) -> Resolution: ...


def uv_compile(
    spec: EnvSpec,
    requirements: Sequence[str],
    constraints: Sequence[str] = (),
    overrides: Sequence[str] = (),
    *,
    extra_args: Sequence[str] = (),
    python: Path | None = None,
    seed: bytes | None = None,
    view: indexview.View | None = None,
) -> Resolution:
    """One ``uv pip compile`` to a PEP 751 file, parsed. Raises ResolveError with uv's words.
    ``extra_args``: more uv flags. ``seed``: a PEP 751 file of preferred versions
    (:func:`relock.preferences`): a re-lock's are the current lock's own, never a file of the
    cache. ``view``: the index as it stood then (indexview.py); None: as it is now."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cudaenv-resolve-") as tmp:
        d = Path(tmp)
        source = _request_file(d, spec, requirements)
        out = d / "pylock.resolved.toml"
        if seed is not None:
            # uv prefers the versions already in its output file (as `uv pip compile -o` on an
            # existing lock does): a re-lock keeps pins stable and resolves ~1.5x faster.
            out.write_bytes(seed)
        argv = _uv_argv(
            d,
            spec,
            source,
            out,
            constraints,
            overrides,
            extra_args=extra_args,
            python=python,
            view=view,
        )
        # A package whose metadata only its setup.py computes is told to uv from
        # uvconfig.SUPPLIED: resolving never runs a release's build (which imports torch in an
        # isolated env, installing the newest torch there first).
        cwd = uvconfig.supplied_config(d, spec)
        try:
            proc.run(argv, env=proc.uv_env(), timeout=1800, cwd=cwd)
        except proc.CommandFailed as exc:
            raise _compile_error(spec, requirements, view, exc.output) from exc
        raw = out.read_bytes()
    packages = _parsed(raw)
    return Resolution(packages=packages, seconds=time.monotonic() - started)


def _uv_argv(
    d: Path,
    spec: EnvSpec,
    source: Path,
    out: Path,
    constraints: Sequence[str],
    overrides: Sequence[str],
    *,
    extra_args: Sequence[str],
    python: Path | None,
    view: indexview.View | None,
) -> list[str]:
    """The ``uv pip compile`` command line for ``spec``'s one platform, from the request file
    ``source`` to ``out``. uv takes constraints and overrides only as files: they are written
    to ``d`` (the call's temporary directory) as the flags naming them are added."""
    argv: list[str] = [
        proc.uv_bin(),
        "pip",
        "compile",
        str(source),
        "--python-version",
        spec.python,
        "--python-platform",
        platform_of(spec).uv_tag,
        "--output-file",
        str(out),
        "--no-header",
        "--quiet",
    ]
    if python is not None:
        argv += ["--python", str(python)]
    if constraints:
        (d / "constraints.txt").write_text("\n".join(constraints) + "\n")
        argv += ["--constraints", str(d / "constraints.txt")]
    argv += extra_args
    if view is not None:
        argv += view.uv_args()
    if overrides:
        (d / "overrides.txt").write_text("\n".join(overrides) + "\n")
        argv += ["--overrides", str(d / "overrides.txt")]
    return argv


def _compile_error(
    spec: EnvSpec, requirements: Sequence[str], view: indexview.View | None, output: str
) -> ResolveError:
    """What a failed ``uv pip compile`` (``output``: its words) tells the user: an index that
    did not answer is a network problem, not a resolution; anything else is uv's own message,
    with a hint where a platform's missing wheel or the index view is the likely cause."""
    unreachable = index_unreachable(output)
    if unreachable:
        return ResolveError(
            f"{spec.name}: the package index did not answer ({unreachable}); check the "
            "network or proxy uv uses, or build from a wheelhouse: `cudaenv export` on a "
            "connected machine, then `cudaenv build --offline --wheelhouse DIR`"
        )
    reqs = ", ".join(requirements)
    where = spec.platforms[0]
    hint = ""
    if "platform" in output.lower() or "no wheels" in output.lower():
        hint = (
            f"\n(a package without a {where} wheel: narrow `platforms:` in "
            f"{spec.source} to where the stack exists)"
        )
    if view is not None and view.at is not None:
        hint += (
            f"\n(resolved against the index as it stood at {view.describe()}: a "
            "release uploaded since is not seen; `cudaenv lock --upgrade` moves the "
            "view to now, `--upgrade-package NAME` one package"
            + (
                "; files without an upload time are never seen under a view"
                if "upload date" in output or "publish time" in output
                else ""
            )
            + ")"
        )
    return ResolveError(
        f"{spec.name} ({spec.source}): uv could not resolve [{reqs}] for {where}:\n"
        + _uv_message(output)
        + hint
    )


# What a memo of a parse holds changes with the parser: v2 = read by packaging.pylock (file
# names from URLs unquoted, file paths kept); v3 = entries carry their platforms.
_MEMO = "v3"


def _parsed(raw: bytes) -> tuple[LockedPackage, ...]:
    """uv's PEP 751 output, parsed; memoised by content (TOML in pure Python costs ~40 ms for
    the default stack, JSON ~3 ms), so an unchanged re-lock is as fast as raw uv."""
    memo = cache_dir() / "resolutions" / f"{hashlib.sha256(raw).hexdigest()}.{_MEMO}.json"
    # The lock takes its URLs and hashes from here: a memo is used only under the cache's
    # trust rules, and only where every URL, path and hash it names is in uv's output.
    doc = cachefiles.read_json(memo)
    try:
        kept = packages_from_json(doc) if isinstance(doc, list) else None
    except (ValueError, TypeError, KeyError, AttributeError):
        kept = None
    if kept is not None and _from_output(kept, raw):
        return kept
    packages = parse_packages(tomllib.loads(raw.decode()), "uv pip compile output")
    cachefiles.write_text(memo, json.dumps(packages_to_json(packages)))
    return packages


def _from_output(packages: Sequence[LockedPackage], raw: bytes) -> bool:
    """Every URL, path and sha256 of ``packages`` is a string of uv's output ``raw`` (a
    memo can leave out nothing a lock needs without failing elsewhere, but could add them)."""
    quoted = set(_TOML_STRING.findall(raw))
    for p in packages:
        for f in p.files:
            for text in (f.url, f.path, f.sha256):
                if text is not None and (not isinstance(text, str) or text.encode() not in quoted):
                    return False
    return True


# A basic TOML string without escapes: uv writes URLs, paths and hashes so.
_TOML_STRING = re.compile(rb'"([^"\\\n]*)"')


_NETWORK_MARKERS = (
    "error sending request",
    "Failed to fetch",
    "operation timed out",
    "dns error",
    "Connection refused",
    "tcp connect error",
    "network is unreachable",
)


def index_unreachable(output: str) -> str | None:
    """The first line of uv's output that says the index could not be reached, if any."""
    for line in output.splitlines():
        if any(m.lower() in line.lower() for m in _NETWORK_MARKERS):
            return line.strip().removeprefix("error:").removeprefix("Caused by:").strip()[:200]
    return None


def _request_file(d: Path, spec: EnvSpec, requirements: Sequence[str]) -> Path:
    """requirements.in, or a pyproject.toml when the spec pins packages to indexes: uv honours
    per-package index pins (explicit indexes + tool.uv.sources) only there."""
    if not spec.indexes:
        path = d / "requirements.in"
        path.write_text("\n".join(requirements) + "\n")
        return path
    urls = sorted({url for _, url in spec.indexes})
    names = {url: f"pinned-{i}" for i, url in enumerate(urls)}
    lines = [
        "[project]",
        'name = "cudaenv-resolve"',
        'version = "0"',
        f"dependencies = {json.dumps(list(requirements))}",
    ]
    for url in urls:
        lines += [
            "",
            "[[tool.uv.index]]",
            f"name = {json.dumps(names[url])}",
            f"url = {json.dumps(url)}",
            "explicit = true",
        ]
    lines += ["", "[tool.uv.sources]"]
    lines += [
        f"{json.dumps(pkg)} = {{ index = {json.dumps(names[url])} }}"
        for pkg, url in sorted(spec.indexes)
    ]
    path = d / "pyproject.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _uv_message(output: str) -> str:
    lines = [
        ln for ln in output.strip().splitlines() if ln.strip() and not ln.startswith("warning:")
    ]
    return "\n".join(lines[-25:])


def spec_python(spec: EnvSpec) -> Path | None:
    """The spec's interpreter for uv (to build an sdist's metadata), if this machine has one."""
    try:
        return interpreters.find(spec.python, allow_download=False).path
    except ToolMissing:
        return None  # uv resolves for --python-version alone when no sdist must be built


def index_files(spec: EnvSpec, packages: Sequence[LockedPackage]) -> tuple[LockedPackage, ...]:
    """Each of ``packages`` (exact versions) as the index this machine is configured with
    serves it: every file with its URL and hash, from ``uv pip compile --no-deps`` of the
    exact pins for the lock's Python and platform. Nothing is re-resolved."""
    if not packages:
        return ()
    # The spec's `indexes:` are left out: a package pinned to an index keeps its own URL and
    # is not looked up here (the caller passes only the others).
    return uv_compile(
        replace(spec, indexes=()),
        [f"{p.name}=={p.version}" for p in packages],
        extra_args=("--no-deps",),
        python=spec_python(spec),
    ).packages
