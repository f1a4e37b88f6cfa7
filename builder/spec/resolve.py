"""EnvSpec -> Lock: run ``uv pip compile``, then prove the matching policy on the result.

The matching policy is checked twice: what can be known from the
spec alone (archs vs CUDA, a CUDA 12 wheel toolchain) before any resolver call, and the
rest on the resolved set. Every refusal happens before anything is installed and names both
sides.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import posixpath
import re
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from packaging.utils import canonicalize_name
from packaging.version import Version

from builder.core import cachefiles, indexview, platforms, proc, remote_cache, settings
from builder.core.cudaversion import CudaVersion
from builder.core.errors import BuildError, ResolveError, ToolMissing
from builder.core.paths import cache_dir
from builder.formats import tomlwriter
from builder.machine import archs, interpreters
from builder.spec import channels, policy, project
from builder.spec.envspec import EnvSpec
from builder.spec.lock import (
    LOCK_VERSION_LINE,
    Lock,
    LockedFile,
    LockedPackage,
    packages_from_json,
    packages_to_json,
    parse_packages,
)
from builder.spec.lock import read as read_lock

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger("cudaenv")


def platform_of(spec: EnvSpec) -> platforms.Platform:
    """The one platform a resolver call is for. :func:`resolve` narrows the spec's
    ``platforms`` to each in turn, so every uv call (and a test's stand-in for it) sees one."""
    if len(spec.platforms) != 1:
        raise ValueError(f"a resolver call is for one platform, not {spec.platforms}")
    return platforms.get(spec.platforms[0])


# --------------------------------------------------------------------------- policy


def spec_problems(spec: EnvSpec) -> list[str]:
    """What the spec alone already breaks, before any resolver call."""
    problems = archs.cuda_problems(spec.cuda_version, spec.archs)
    if spec.toolchain.source == "wheels" and not channels.has_pip_nvcc(spec.cuda_major):
        problems.append(
            f"CUDA {spec.cuda} has no nvcc on PyPI (nvidia-cuda-nvcc-cu12 ships only ptxas, "
            "NVIDIA/cuda-python#2100): use `toolchain: {source: system, path: /usr/local/cuda-"
            f"{spec.cuda}}}`"
        )
    return problems


def torch_cuda(packages: Sequence[LockedPackage]) -> tuple[str | None, str | None]:
    """(torch's CUDA major.minor, the pin that says so), read from the resolved set."""
    by: dict[str, LockedPackage] = {canonicalize_name(p.name): p for p in packages}
    for name in (
        "cuda-toolkit",
        "nvidia-cuda-runtime",
        "nvidia-cuda-runtime-cu12",
        "nvidia-cuda-runtime-cu11",
    ):
        if name in by:
            v = by[name].version
            cuda = CudaVersion.read(v)
            return (None if cuda is None else str(cuda)), f"{name}=={v}"
    return None, None


def policy_problems(
    spec: EnvSpec, packages: Sequence[LockedPackage], pins: dict[str, str]
) -> list[str]:
    """Rules 1-4 of the matching policy on a resolved set. ``pins``: the channel's exact component
    versions for the CUDA minor torch asks (empty when not known, e.g. CUDA 12)."""
    problems: list[str] = []
    by: dict[str, LockedPackage] = {canonicalize_name(p.name): p for p in packages}
    torch = by.get("torch")
    if torch is not None:
        tcuda, evidence = torch_cuda(packages)
        if tcuda is None:
            problems.append(
                f"torch {torch.version} pins no CUDA runtime (a CPU build?) but the spec asks "
                f"CUDA {spec.cuda}"
            )
        elif tcuda != spec.cuda:
            problems.append(
                f"torch {torch.version} is built for CUDA {tcuda} ({evidence}) but the spec asks "
                f"{spec.cuda}"
            )
    # Rule 2: every toolkit component at the version the channel pins for this CUDA minor.
    for name, want in sorted(pins.items()):
        got = by.get(canonicalize_name(name))
        if got is not None and got.version != want:
            problems.append(
                f"{got.name} {got.version} is not the CUDA {spec.cuda} build ({want}): mixed "
                "toolkit minors break JIT (flashinfer#3493)"
            )
    for name in channels.CUDA_VERSIONED:
        got = by.get(name)
        if got is None or name in pins:
            continue
        minor = CudaVersion.read(got.version)
        if minor is not None and minor != spec.cuda_version:
            problems.append(
                f"{got.name} {got.version} is CUDA {minor} but the spec asks {spec.cuda}"
            )
    # resolve() asks this of one platform's set, where each name is there once.
    versions = {p.name: p.version for p in packages}
    # Rule 3: one CUDA major, the spec's.
    split = policy.mixed_majors(versions, want=spec.cuda_major)
    if split is not None:
        # A wheel whose *version* is of another major was named above, by its minor.
        for wheel in split.others(spec.cuda_major):
            if wheel.by_name:
                problems.append(
                    f"{wheel.name} {wheel.version} is a CUDA {wheel.major} wheel in a CUDA "
                    f"{spec.cuda_major} env"
                )
            elif canonicalize_name(wheel.name) in channels.CUDA_BINDINGS:
                problems.append(
                    f"{wheel.name} {wheel.version} binds CUDA {wheel.major} in a CUDA "
                    f"{spec.cuda_major} env (it overwrites or pins the cuda-bindings torch "
                    "and FlashInfer import)"
                )
    # Rule 4: FlashInfer companions equal flashinfer-python.
    for found in policy.companion_mismatches(versions):
        if found.flashinfer is None:
            problems.append(
                f"{found.companion} {found.version} is installed without flashinfer-python"
            )
        else:
            problems.append(
                f"{found.companion} {found.version} does not match flashinfer-python "
                f"{found.flashinfer}"
            )
    return problems


# --------------------------------------------------------------------------- the resolver


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
    (:func:`preferences`): a re-lock's are the current lock's own, never a file of the cache.
    ``view``: the index as it stood then (indexview.py); None: as it is now."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cudaenv-resolve-") as tmp:
        d = Path(tmp)
        source = _request_file(d, spec, requirements)
        out = d / "pylock.resolved.toml"
        if seed is not None:
            # uv prefers the versions already in its output file (as `uv pip compile -o` on an
            # existing lock does): a re-lock keeps pins stable and resolves ~1.5x faster.
            out.write_bytes(seed)
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
        try:
            proc.run(argv, env=proc.uv_env(), timeout=1800)
        except proc.CommandFailed as exc:
            unreachable = index_unreachable(exc.output)
            if unreachable:
                raise ResolveError(
                    f"{spec.name}: the package index did not answer ({unreachable}); check the "
                    "network or proxy uv uses, or build from a wheelhouse: `cudaenv export` on a "
                    "connected machine, then `cudaenv build --offline --wheelhouse DIR`"
                ) from exc
            reqs = ", ".join(requirements)
            where = spec.platforms[0]
            hint = ""
            if "platform" in exc.output.lower() or "no wheels" in exc.output.lower():
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
                        if "upload date" in exc.output or "publish time" in exc.output
                        else ""
                    )
                    + ")"
                )
            raise ResolveError(
                f"{spec.name} ({spec.source}): uv could not resolve [{reqs}] for {where}:\n"
                + _uv_message(exc.output)
                + hint
            ) from exc
        raw = out.read_bytes()
    packages = _parsed(raw)
    return Resolution(packages=packages, seconds=time.monotonic() - started)


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


def toolkit_pins(spec: EnvSpec, toolkit: str, compile_: Compiler) -> dict[str, str]:
    """The component versions that ``cuda-toolkit==toolkit`` pins exactly (its ``all`` extra).

    uv prints no specifiers, so a pin is told apart from a range by resolving twice, once
    for the highest and once for the lowest versions: an exact pin gives the same version
    both times (nvidia-nvjitlink floats within the major, on purpose: it links older code).
    Cached: a release on the index never changes.

    The pins are cuda-toolkit's own metadata, the same on every platform, so they are read
    where NVIDIA ships every component: linux-x86_64 (``cuda-toolkit[all]==13.0.2`` does not
    resolve for aarch64, which has no ``nvidia-cuda-opencl`` 13.0.85 wheel).
    """
    spec = replace(spec, platforms=("linux-x86_64",))
    key = f"cuda-toolkit-{toolkit}-{platform_of(spec).uv_tag}"
    cached = channels.read_cached_pins(key)
    if cached is not None:
        return cached
    request = [f"cuda-toolkit[all]=={toolkit}"]
    high = compile_(spec, request, (), ())
    low = compile_(spec, request, (), (), extra_args=("--resolution=lowest",))
    low_versions = {p.name: p.version for p in low.packages}
    pins = {
        p.name: p.version
        for p in high.packages
        if canonicalize_name(p.name).startswith("nvidia-") and low_versions.get(p.name) == p.version
    }
    channels.write_cached_pins(key, pins)
    return pins


def _spec_python(spec: EnvSpec) -> Path | None:
    """The spec's interpreter for uv (to build an sdist's metadata), if this machine has one."""
    try:
        return interpreters.find(spec.python, allow_download=False).path
    except ToolMissing:
        return None  # uv resolves for --python-version alone when no sdist must be built


@dataclass(frozen=True, kw_only=True)
class Plan:
    lock: Lock
    requirements: tuple[str, ...]
    seconds: float


@dataclass(frozen=True, kw_only=True)
class _TorchCuda:
    """What torch (or the toolkit alone) decides on one platform."""

    tcuda: str | None = None
    toolkit: str | None = None
    problems: tuple[str, ...] = ()


def _torch_cuda_on(spec: EnvSpec, compile_: Compiler) -> _TorchCuda:
    """Pass 1 for the spec's one platform: torch alone, to read which CUDA it is built for
    (its cuda-toolkit pin). A release's metadata never changes, so the answer is cached: a
    re-lock is then one resolver call per platform, like raw ``uv pip compile``."""
    if spec.torch is None:
        if spec.toolchain.source != "wheels":
            return _TorchCuda()
        nxt = spec.cuda_version.next_minor()
        probe = compile_(spec, [f"cuda-toolkit>={spec.cuda},<{nxt}"], (), ())
        ct = next((p for p in probe.packages if p.name == "cuda-toolkit"), None)
        if ct is None:
            return _TorchCuda(problems=(f"the index has no cuda-toolkit for CUDA {spec.cuda}",))
        return _TorchCuda(toolkit=ct.version)
    key = f"torch-{spec.torch}-py{spec.python}-{platform_of(spec).uv_tag}"
    cached = channels.read_cached_pins(key)
    if cached is None:
        probe = compile_(spec, [f"torch=={spec.torch}"], (), ())
        found, found_evidence = torch_cuda(probe.packages)
        ct_pkg = next((p for p in probe.packages if p.name == "cuda-toolkit"), None)
        cached = {
            "cuda": found or "",
            "evidence": found_evidence or "",
            "toolkit": ct_pkg.version if ct_pkg else "",
        }
        if found:
            channels.write_cached_pins(key, cached)
    tcuda, evidence = (cached["cuda"] or None), (cached["evidence"] or None)
    if tcuda is None:
        # pytorch#168065, vllm#28129: aarch64 installs that silently end with a CPU torch.
        return _TorchCuda(
            problems=(
                f"torch {spec.torch} pins no CUDA runtime here (a CPU-only build) but the spec "
                f"asks CUDA {spec.cuda}",
            )
        )
    if tcuda != spec.cuda:
        return _TorchCuda(
            tcuda=tcuda,
            problems=(
                f"torch {spec.torch} is built for CUDA {tcuda} ({evidence}) but the spec asks "
                f"{spec.cuda}",
            ),
        )
    return _TorchCuda(tcuda=tcuda, toolkit=cached["toolkit"] or None)


def _on(name: str, problems: Sequence[str]) -> list[str]:
    return [f"on {name}: {p}" for p in problems]


def resolve(
    spec: EnvSpec,
    *,
    command: str = "",
    compile_: Compiler | None = None,
    previous: Path | None = None,
    upgrade_packages: Sequence[str] = (),
    view: indexview.View | None = None,
) -> Plan:
    """Resolve ``spec`` under the policy, once per platform, into one lock covering them
    all. With ``previous`` (the spec's current lock), every version it holds is preferred
    but those of ``upgrade_packages``. ``view``: the index as it stood then (every uv call
    sees it; :func:`choose_view`); None: as it is now. The lock records the view it saw.
    ``compile_`` replaces the uv call in unit tests."""
    started = time.monotonic()
    begun = indexview.now()
    view = view or indexview.View()
    problems = spec_problems(spec)
    if problems:
        raise ResolveError(_refusal(spec, problems))
    # Read before any resolver call: a mistyped setting must not cost a resolution.
    wheelhouse = project.settings_for(spec.source).lock_wheelhouse
    if compile_ is None:
        py = _spec_python(spec)
        compile_ = _uv_compiler(py, None, view=view)
        final_compile = _uv_compiler(
            py, previous_versions(previous, spec), upgrade_packages, view=view
        )
    else:
        final_compile = compile_

    ones = {name: replace(spec, platforms=(name,)) for name in spec.platforms}
    # Pass 1 on every platform before any full resolution: a CPU-only torch anywhere is
    # refused first, naming the platform.
    decided = {name: _torch_cuda_on(one, compile_) for name, one in ones.items()}
    problems = [p for name, d in decided.items() for p in _on(name, d.problems)]
    toolkits = {d.toolkit for d in decided.values()}
    if len(toolkits) > 1 and not problems:
        found = ", ".join(f"{d.toolkit or 'none'} on {name}" for name, d in decided.items())
        problems.append(
            f"torch {spec.torch} pins cuda-toolkit {found}: one lock holds one toolkit; "
            "narrow `platforms:`"
        )
    if problems:
        raise ResolveError(_refusal(spec, problems))
    toolkit = toolkits.pop()
    tcuda = next(iter(decided.values())).tcuda

    requirements: list[str] = []
    if spec.torch is not None:
        requirements.append(f"torch=={spec.torch}")
    requirements += list(spec.packages)
    if spec.remote_cache:
        # Triton and Inductor reach the shared cache through redis-py (remote_cache.py).
        requirements.append(remote_cache.CLIENT)
    if toolkit is not None and spec.toolchain.source == "wheels":
        # Pin the compiler to the version torch pins so the resolver cannot drift.
        requirements.append(
            f"cuda-toolkit[{channels.toolkit_extras(spec.toolchain.components)}]=={toolkit}"
        )
    resolved: dict[str, tuple[LockedPackage, ...]] = {}
    for name, one in ones.items():
        pins = toolkit_pins(one, toolkit, compile_) if toolkit is not None else {}
        constraints = [f"{n}=={version}" for n, version in sorted(pins.items())]
        constraints += policy.binding_constraints(spec.cuda_major)
        final = final_compile(one, requirements, constraints, ())
        packages = pin_sources(one, final.packages, wheelhouse=wheelhouse)
        problems += _on(name, policy_problems(one, packages, pins))
        resolved[name] = packages
    problems += wheel_gaps(resolved)
    if problems:
        raise ResolveError(_refusal(spec, problems))
    lock = Lock(
        spec_name=spec.name,
        fingerprint=spec.fingerprint(),
        python=spec.python,
        platforms=spec.platforms,
        cuda=spec.cuda,
        torch=spec.torch,
        torch_cuda=tcuda,
        toolkit=toolkit,
        packages=merge(resolved),
        command=command,
        notes=tuple(_notes(spec, resolved)),
    )
    at, own = _recorded_view(view, lock.packages, begun)
    lock = replace(lock, exclude_newer=at, exclude_newer_packages=own)
    return Plan(lock=lock, requirements=tuple(requirements), seconds=time.monotonic() - started)


def _notes(spec: EnvSpec, resolved: Mapping[str, Sequence[LockedPackage]]) -> list[str]:
    """What the lock should tell its reader, once however many platforms say it."""
    notes: list[str] = []
    for packages in resolved.values():
        names = {canonicalize_name(p.name) for p in packages}
        if (
            spec.toolchain.source == "wheels"
            and "flashinfer-python" in names
            and "nvidia-curand" not in names
        ):
            notes.append(
                "FlashInfer's sampling kernels include <curand.h> but no nvidia-curand is in "
                "the set: add 'curand' to toolchain.components (torch 2.15 no longer pulls it)"
            )
        for pkg in packages:
            major = channels.major_suffix(pkg.name)
            if major is not None and major != spec.cuda_major:
                notes.append(f"{pkg.name} kept: ships one build per CUDA major by design")
    return list(dict.fromkeys(notes))


def wheel_gaps(resolved: Mapping[str, Sequence[LockedPackage]]) -> list[str]:
    """A package that has wheels on one platform and only an sdist on another would be
    compiled from source at install there (a CUDA extension, usually failing): refused,
    naming it and the platform."""
    if len(resolved) < 2:
        return []
    with_wheels = {
        (name, p.name) for name, packages in resolved.items() for p in packages if p.wheels
    }
    problems = []
    for name, packages in resolved.items():
        others = [o for o in resolved if o != name]
        for p in packages:
            if p.wheels or not any((o, p.name) in with_wheels for o in others):
                continue
            problems.append(
                f"on {name}: {p.name} {p.version} has no {name} wheel, only an sdist that "
                f"would be compiled at install time: narrow `platforms:` to {', '.join(others)}"
            )
    return problems


def merge(resolved: Mapping[str, Sequence[LockedPackage]]) -> tuple[LockedPackage, ...]:
    """One PEP 751 package list for every platform's resolution.

    An entry (name, version) that every platform resolved keeps uv's marker and holds each
    platform's files (uv lists only the target's wheels); one that some platforms resolved
    (another version elsewhere, or a platform-only dependency) is marked with those platforms'
    ``platform_machine`` and lists them in ``[packages.tool.cudaenv]``, so any installer
    picks exactly one entry per platform.
    """
    names = list(resolved)
    if len(names) == 1:
        return tuple(resolved[names[0]])
    groups: dict[tuple[str, str], dict[str, LockedPackage]] = {}
    for name, packages in resolved.items():
        for p in packages:
            groups.setdefault((p.name, p.version), {})[name] = p
    out = []
    for by in groups.values():
        first = next(iter(by.values()))
        files: dict[str, LockedFile] = {}
        for p in by.values():
            for f in p.wheels:
                files.setdefault(f.name, f)
        on = tuple(n for n in names if n in by)
        markers = {n: by[n].marker for n in on}
        where: tuple[str, ...] = ()
        if len(on) == len(names) and len(set(markers.values())) == 1:
            marker = first.marker
        else:
            marker = _any_of([(markers[n], platforms.get(n).machine) for n in on])
            if len(on) < len(names):
                where = on
        out.append(
            replace(
                first,
                wheels=tuple(files.values()),
                sdist=next((p.sdist for p in by.values() if p.sdist), None),
                marker=marker,
                platforms=where,
            )
        )
    return tuple(sorted(out, key=lambda p: (p.name, Version(p.version))))


def _any_of(parts: Sequence[tuple[str | None, str]]) -> str:
    """``(m1) and platform_machine == 'x86_64' or ...``: ``and`` binds tighter than ``or``
    (PEP 508), each marker of uv's is parenthesised whole."""
    terms = [
        f"platform_machine == '{machine}'"
        if marker is None
        else f"({marker}) and platform_machine == '{machine}'"
        for marker, machine in parts
    ]
    return " or ".join(terms)


def pin_sources(
    spec: EnvSpec, packages: Sequence[LockedPackage], *, wheelhouse: str | None = None
) -> tuple[LockedPackage, ...]:
    """Where a PEP 751 reader gets each file of the lock. A package the spec pins to an index
    keeps its file URLs (that host is the spec's own choice); one that did not come from its
    index is refused. Every other file keeps the URL uv resolved it to, or, with
    ``wheelhouse`` (an index-neutral project, project.py), gets ``path = "<wheelhouse>/<file
    name>"`` relative to the lock file's directory and no URL, so no index host is written."""
    pinned = dict(spec.indexes)
    out = []
    for pkg in packages:
        index = pinned.get(canonicalize_name(pkg.name))
        if index is None:
            if wheelhouse is None:
                out.append(replace(pkg, index=None))
                continue
            out.append(
                replace(
                    pkg,
                    index=None,
                    wheels=tuple(_in_wheelhouse(f, wheelhouse) for f in pkg.wheels),
                    sdist=_in_wheelhouse(pkg.sdist, wheelhouse) if pkg.sdist else None,
                )
            )
            continue
        urls = [f.url for f in pkg.files if f.url]
        if not urls or not all(
            u.startswith(index + "/") or u.startswith(index.rsplit("/simple", 1)[0]) for u in urls
        ):
            raise ResolveError(
                f"{spec.name}: {pkg.name} must come from {index} but resolved to {urls or 'no file URL'}"
            )
        out.append(replace(pkg, index=index))
    return tuple(out)


def _in_wheelhouse(f: LockedFile, wheelhouse: str) -> LockedFile:
    return replace(f, url=None, path=posixpath.normpath(posixpath.join(wheelhouse, f.name)))


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
        python=_spec_python(spec),
    ).packages


def preferences(previous: Lock, platform: str) -> bytes:
    """The versions ``previous`` installs on ``platform``, as the PEP 751 file uv reads back
    as its preferences when it is the output file (names and versions are all uv takes from
    it). One platform's entries only: where a lock holds two versions of a package, one per
    platform, uv would prefer whichever came last."""
    lines = [LOCK_VERSION_LINE, tomlwriter.pair("created-by", "cudaenv")]
    for p in previous.packages:
        if p.on(platform):
            lines += ["", "[[packages]]", tomlwriter.pair("name", p.name)]
            lines.append(tomlwriter.pair("version", p.version))
    return ("\n".join(lines) + "\n").encode()


def previous_versions(previous: Path | None, spec: EnvSpec) -> Lock | None:
    """The lock a re-lock keeps the versions of: ``previous`` when it exists and parses (a
    lock that does not parse holds no versions worth keeping; the re-lock replaces it)."""
    if previous is None or not previous.is_file():
        return None
    try:
        return read_lock(previous, spec=spec)
    except BuildError:
        return None


def _uv_compiler(
    python: Path | None,
    previous: Lock | None,
    upgrade_packages: Sequence[str] = (),
    *,
    view: indexview.View | None = None,
) -> Compiler:
    """:func:`uv_compile` with the spec's Python; with ``previous`` (a re-lock), seeded with
    that lock's versions for the platform at hand, every one preferred (transitive ones too)
    but those named in ``upgrade_packages``."""

    def compile_(
        s: EnvSpec,
        r: Sequence[str],
        c: Sequence[str],
        o: Sequence[str],
        /,
        *,
        extra_args: Sequence[str] = (),
    ) -> Resolution:
        seed = preferences(previous, s.platforms[0]) if previous is not None else None
        upgrade = [a for name in upgrade_packages for a in ("--upgrade-package", name)]
        return uv_compile(
            s, r, c, o, extra_args=[*extra_args, *upgrade], python=python, seed=seed, view=view
        )

    return compile_


def _refusal(spec: EnvSpec, problems: Sequence[str]) -> str:
    head = f"{spec.name} ({spec.source}): refused by the matching policy, nothing was installed:"
    return head + "".join(f"\n  - {p}" for p in problems)


# --------------------------------------------------------------------------- the index view


def choose_view(
    previous: Lock | None,
    spec: EnvSpec,
    *,
    upgrade: bool = False,
    upgrade_packages: Sequence[str] = (),
    given: str | None = None,
) -> indexview.View:
    """The index view a (re-)lock of ``spec`` resolves against.

    - ``given`` (``--exclude-newer``): that time.
    - a fresh lock, or ``upgrade``: CUDAENV_EXCLUDE_NEWER where it is set, else the index as
      it is now (the lock then records when that was).
    - a re-lock: the view of ``previous`` (``Lock.view``): a release uploaded since is not
      seen. A package of ``upgrade_packages``, and one the spec's ``packages:`` name that
      ``previous`` does not hold (what `cudaenv add` writes), is seen as it is now and gets
      a view of its own in the new lock.

    A package the spec pins to a ``file://`` index is exempt: a directory has no upload times
    (PEP 700 is an HTTP API's), and uv excludes a file without one under any cut-off."""
    own = {canonicalize_name(n) for n, url in spec.indexes if url.startswith("file:")}
    exempt = tuple(sorted(own.union(previous.view().exempt if previous is not None else ())))
    kept = previous.view() if previous is not None and not upgrade else indexview.View()
    if given is not None or kept.at is None:
        return replace(fresh_view(given), exempt=exempt)
    assert previous is not None
    held = {canonicalize_name(p.name) for p in previous.packages}
    named = {canonicalize_name(_requirement_name(r)) for r in spec.packages}
    moving = {canonicalize_name(n) for n in upgrade_packages} | (named - held)
    return replace(
        kept,
        packages=tuple((n, w) for n, w in kept.packages if n not in moving),
        exempt=exempt,
        moving=tuple(sorted(moving)),
    )


def fresh_view(given: str | None = None) -> indexview.View:
    """The view of a resolution that keeps none: ``given`` (``--exclude-newer``), else
    CUDAENV_EXCLUDE_NEWER, else the index as it is now."""
    if given is not None:
        return indexview.View(at=indexview.canonical(given), origin="given by --exclude-newer")
    found = settings.current().exclude_newer
    if found is not None:
        return indexview.View(at=indexview.canonical(found), origin="CUDAENV_EXCLUDE_NEWER")
    return indexview.View(origin=f"the index as it is now, {indexview.spell(indexview.now())}")


def _requirement_name(text: str) -> str:
    """The project name a PEP 508 requirement of the spec names (the spec has checked it)."""
    return re.split(r"[\s\[<>=!~;@(]", text.strip(), maxsplit=1)[0]


def _recorded_view(
    view: indexview.View, packages: Sequence[LockedPackage], begun: dt.datetime
) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """What the new lock records of ``view`` (its cut-off, the packages' own): its cut-off, or, where the index was seen as it
    is now, the moment the resolution began, moved past every upload time it found (a file
    uploaded while uv ran is in the lock, so the view must hold it). Nothing where no file
    carries an upload time (an index without PEP 700: no cut-off could see its files)."""

    def stamp(files: Sequence[LockedFile]) -> str | None:
        times = [f.upload_time for f in files if f.upload_time]
        if not times:
            return None
        latest = indexview.after(times)
        start = indexview.spell(begun)
        return max(start, latest) if latest is not None else start

    everything = [f for p in packages for f in p.files]
    at = view.at if view.at is not None else stamp(everything)
    own = dict(view.packages)
    for name in view.moving:
        mine = stamp([f for p in packages if canonicalize_name(p.name) == name for f in p.files])
        if mine is not None and at is not None and mine > at:
            own[name] = mine
    return at, (tuple(sorted(own.items())) if at is not None else ())


def moved(before: Lock, after: Lock) -> list[str]:
    """What a re-lock changed, one line per package: ``vllm 0.33.0 -> 0.34.0``, ``new: x 1.0``,
    ``gone: y 2.0`` (each platform's versions, named with the platform where they differ)."""
    lines: list[str] = []
    platforms_ = list(dict.fromkeys([*after.platforms, *before.platforms]))
    changes: dict[str, list[str]] = {}
    for platform in platforms_:
        old = (
            {p.name: p.version for p in before.packages_on(platform)}
            if platform in before.platforms
            else {}
        )
        new = (
            {p.name: p.version for p in after.packages_on(platform)}
            if platform in after.platforms
            else {}
        )
        for name in sorted(old.keys() | new.keys()):
            if old.get(name) == new.get(name):
                continue
            if name not in old:
                said = f"new: {name} {new[name]}"
            elif name not in new:
                said = f"gone: {name} {old[name]}"
            else:
                said = f"{name} {old[name]} -> {new[name]}"
            changes.setdefault(said, []).append(platform)
    for said, where in changes.items():
        lines.append(said if len(where) == len(platforms_) else f"{said} (on {', '.join(where)})")
    return lines
