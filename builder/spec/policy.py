"""The matching rules that hold for any set of distributions, as typed findings.

One reading of each rule over a name -> version mapping, whoever holds the set: ``resolve``
applies them to a resolved set before anything is installed, ``doctor`` to what an
interpreter has installed. Each phrases its own message from the finding; nothing here
prints or raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from builder.core.cudaversion import CudaVersion
from builder.spec import channels


@dataclass(frozen=True, kw_only=True)
class MajorWheel:
    """A distribution that belongs to one CUDA major."""

    name: str  # as the set spells it
    version: str
    major: int
    # True: the name says it (nvidia-cublas-cu12); False: the version of a package whose
    # version is its CUDA's does (nvidia-cuda-runtime 13.0.96).
    by_name: bool


@dataclass(frozen=True, kw_only=True)
class MixedMajors:
    """Rule "one CUDA major": wheels of another major load a second libcudart/libcublas
    generation into the process."""

    rule: ClassVar[str] = "one-cuda-major"
    wheels: tuple[MajorWheel, ...]  # every wheel of a known major, in the set's order
    want: int | None  # the major the env is for, where one was asked

    @property
    def majors(self) -> tuple[int, ...]:
        return tuple(sorted({w.major for w in self.wheels}))

    def others(self, major: int) -> tuple[MajorWheel, ...]:
        """The wheels not of ``major``."""
        return tuple(w for w in self.wheels if w.major != major)


@dataclass(frozen=True, kw_only=True)
class CompanionMismatch:
    """Rule "FlashInfer companions": flashinfer-cubin and flashinfer-jit-cache hold kernels
    built for one flashinfer-python release and must be at its version (local labels such
    as ``+cu130`` aside)."""

    rule: ClassVar[str] = "flashinfer-companions"
    companion: str
    version: str
    flashinfer: str | None  # flashinfer-python's version; None: it is not in the set


def major_of(name: str, version: str) -> int | None:
    """The CUDA major a distribution belongs to: what its name declares, else, for a package
    whose version is its CUDA's, that version's major; None for everything else."""
    major = channels.major_suffix(name)
    if major is not None:
        return major
    if canonicalize_name(name) in (*channels.CUDA_VERSIONED, *channels.CUDA_BINDINGS):
        cuda = CudaVersion.read(version)
        return cuda.major if cuda is not None else None
    return None


def mixed_majors(dists: Mapping[str, str], want: int | None = None) -> MixedMajors | None:
    """A finding when ``dists`` holds wheels of more than one CUDA major, or (``want`` given)
    any of another major than ``want``. Packages that ship one build per major side by side
    (``channels.MULTI_MAJOR_BY_DESIGN``) are not counted."""
    wheels: list[MajorWheel] = []
    for name, version in dists.items():
        if channels.multi_major_by_design(name):
            continue
        major = major_of(name, version)
        if major is not None:
            by_name = channels.major_suffix(name) is not None
            wheels.append(MajorWheel(name=name, version=version, major=major, by_name=by_name))
    majors = {w.major for w in wheels}
    if len(majors) > 1 or (want is not None and majors - {want}):
        return MixedMajors(wheels=tuple(wheels), want=want)
    return None


def binding_mismatches(dists: Mapping[str, str], want: int) -> tuple[MajorWheel, ...]:
    """Each of NVIDIA's CUDA Python bindings in ``dists`` (``channels.CUDA_BINDINGS``) that
    binds another CUDA major than ``want`` (torch's)."""
    out = []
    for name, version in dists.items():
        if canonicalize_name(name) in channels.CUDA_BINDINGS:
            major = major_of(name, version)
            if major is not None and major != want:
                out.append(MajorWheel(name=name, version=version, major=major, by_name=False))
    return tuple(out)


def binding_repair(dists: Mapping[str, str], major: int) -> tuple[str, ...]:
    """The requirements that put the bindings ``dists`` holds back at ``major`` (cuda-bindings
    always: removing a cuda-python below 12.8 removes files they share); empty when none is
    of another major. Ranges, not the installed versions: the newest cuda-bindings (what
    torch's >=13.0.3 picked) may have no cuda-python of its minor yet, which is how a
    cuda-python of the older major came in (cuda-bindings 13.5.0, cuda-python 12.6.2.post1)."""
    if not binding_mismatches(dists, major):
        return ()
    names = {canonicalize_name(n) for n in dists}
    return tuple(
        c
        for name, c in zip(channels.CUDA_BINDINGS, binding_constraints(major), strict=True)
        if name in names or name == "cuda-bindings"
    )


def binding_constraints(major: int) -> tuple[str, ...]:
    """Resolver constraints that keep the bindings at ``major`` where anything pulls them in
    (a constraint adds no package): uv otherwise satisfies flashinfer-python's
    ``cuda-python>=12.0`` with 12.6.2.post1 beside torch's cuda-bindings 13."""
    return tuple(f"{name}>={major},<{major + 1}" for name in channels.CUDA_BINDINGS)


def companion_mismatches(dists: Mapping[str, str]) -> tuple[CompanionMismatch, ...]:
    """Each FlashInfer companion in ``dists`` that is not at flashinfer-python's version
    (or is there without it), in ``channels.FLASHINFER_COMPANIONS`` order."""
    by: dict[str, str] = {canonicalize_name(name): version for name, version in dists.items()}
    fi = by.get("flashinfer-python")
    out = []
    for name in channels.FLASHINFER_COMPANIONS:
        version = by.get(name)
        if version and (fi is None or _public(version) != _public(fi)):
            out.append(CompanionMismatch(companion=name, version=version, flashinfer=fi))
    return tuple(out)


def _public(version: str) -> str:
    """The version without its local label; an unreadable one is compared as it is written
    (an installed set may hold anything)."""
    try:
        return Version(version).public
    except InvalidVersion:
        return version
