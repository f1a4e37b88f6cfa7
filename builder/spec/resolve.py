"""EnvSpec -> Lock: run ``uv pip compile``, then prove the matching policy on the result.

The matching policy is checked twice: what can be known from the
spec alone (archs vs CUDA, a CUDA 12 wheel toolchain) before any resolver call, and the
rest on the resolved set. Every refusal happens before anything is installed and names both
sides.

The uv call itself is :mod:`builder.spec.uvcompile`'s; what a lock hands on to a re-lock (its
versions, its index view) is :mod:`builder.spec.relock`'s.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from packaging.utils import canonicalize_name
from packaging.version import Version

from builder.core import context, indexview, platforms, proc, remote_cache
from builder.core.cudaversion import CudaVersion
from builder.core.errors import ResolveError
from builder.machine import archs
from builder.spec import channels, policy, project
from builder.spec.envspec import EnvSpec
from builder.spec.lock import Lock, LockedFile, LockedPackage

# The uv call (uvcompile) and what a lock hands on (relock) live below this module; callers
# keep reading their names here.
from builder.spec.relock import choose_view as choose_view
from builder.spec.relock import fresh_view as fresh_view
from builder.spec.relock import moved as moved
from builder.spec.relock import preferences as preferences
from builder.spec.relock import previous_versions as previous_versions
from builder.spec.relock import recorded_view
from builder.spec.uvcompile import Compiler as Compiler
from builder.spec.uvcompile import Resolution as Resolution
from builder.spec.uvcompile import index_files as index_files
from builder.spec.uvcompile import index_unreachable as index_unreachable
from builder.spec.uvcompile import platform_of as platform_of
from builder.spec.uvcompile import spec_python
from builder.spec.uvcompile import uv_compile as uv_compile

log = logging.getLogger("cudaenv")


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


_T = TypeVar("_T")


def each_platform(ones: Mapping[str, EnvSpec], work: Callable[[EnvSpec], _T]) -> dict[str, _T]:
    """``work`` on each platform's spec (``ones``, by platform name), all at once: each is one
    ``uv pip compile`` or two, which use about one core and wait on the index and the cache in
    between, so the platforms of a re-lock take about as long as the slowest alone (2.6 s ->
    1.7 s for the default spec's two on 2 cores). The answers come back in the platforms'
    order; the first platform's error (in that order) is raised once every one has ended.

    Each resolution is bounded by uv's own timeout (uvcompile.uv_compile), so the joins are
    too. A uv process dies with the thread that started it (PR_SET_PDEATHSIG, proc.py): an
    interrupted lock leaves none running once cudaenv exits."""
    if len(ones) < 2:
        return {name: work(one) for name, one in ones.items()}
    done: dict[str, _T] = {}
    failed: dict[str, BaseException] = {}

    def one_platform(name: str, one: EnvSpec) -> None:
        try:
            done[name] = work(one)
        except BaseException as exc:  # handed to the caller's thread below
            failed[name] = exc

    threads = [
        threading.Thread(
            target=context.carried(one_platform), args=item, name=f"resolve-{item[0]}", daemon=True
        )
        for item in ones.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in ones:
        if name in failed:
            raise failed[name]
    return {name: done[name] for name in ones}


def _pass_one(
    spec: EnvSpec, ones: Mapping[str, EnvSpec], compile_: Compiler
) -> tuple[str | None, str | None]:
    """(the cuda-toolkit version, torch's CUDA) that pass 1 finds on every platform of
    ``ones`` (``spec`` narrowed to each), or ResolveError. Run on every platform before any
    full resolution: a CPU-only torch anywhere is refused first, naming the platform, and one
    lock holds one toolkit."""
    decided = each_platform(ones, lambda one: _torch_cuda_on(one, compile_))
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
    return toolkits.pop(), next(iter(decided.values())).tcuda


def _requirements(spec: EnvSpec, toolkit: str | None) -> list[str]:
    """What the full resolution asks of uv on every platform: the spec's torch and packages,
    and what cudaenv adds for the env to work (the Redis client, the toolkit torch pins)."""
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
    return requirements


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
        # Found once here, before the platforms resolve in threads (each_platform): uv's
        # find_uv_bin reads sysconfig, whose first read is not thread-safe (a thread saw
        # EXE as None: python/cpython#92452). A missing uv is said before anything runs.
        proc.uv_bin()
        py = spec_python(spec)
        compile_ = _uv_compiler(py, None, view=view)
        final_compile = _uv_compiler(
            py, previous_versions(previous, spec), upgrade_packages, view=view
        )
    else:
        final_compile = compile_

    ones = {name: replace(spec, platforms=(name,)) for name in spec.platforms}
    toolkit, tcuda = _pass_one(spec, ones, compile_)
    requirements = _requirements(spec, toolkit)
    # The toolkit's pins are its own metadata, read on linux-x86_64 whatever the platform
    # (toolkit_pins): once, before the platforms' resolutions start.
    pins = toolkit_pins(spec, toolkit, compile_) if toolkit is not None else {}
    constraints = [f"{n}=={version}" for n, version in sorted(pins.items())]
    constraints += policy.binding_constraints(spec.cuda_major)
    resolved = each_platform(
        ones,
        lambda one: pin_sources(
            one, final_compile(one, requirements, constraints, ()).packages, wheelhouse=wheelhouse
        ),
    )
    problems = [
        p
        for name, one in ones.items()
        for p in _on(name, policy_problems(one, resolved[name], pins))
    ]
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
    at, own = recorded_view(view, lock.packages, begun)
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
