"""The CUDA majors of an env, apart from its binaries: which CUDA library (and major) a
soname names, the distributions installed for another CUDA major than the env's and what
requires them, and the import probe: what one process that imports the stack actually maps.
Which majors the env's binaries link is ``scan``'s, from its ELF reading.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from builder.core import proc
from builder.core.errors import ReportError, UsageError
from builder.formats import codec
from builder.machine import driver

# --------------------------------------------------------------------------- sonames

# CUDA's libraries whose soname major is the CUDA major (libcudart.so.13 is CUDA 13's).
# cuFFT, cuRAND, cuSPARSE and cuSOLVER number their own majors (CUDA 13 ships
# libcufft.so.12 and libcurand.so.10), so their sonames say nothing about the CUDA major.
CUDA_LIBRARIES = ("libcudart", "libcublas", "libcublasLt", "libnvrtc", "libnvJitLink", "libcupti")
_SONAME_RE = re.compile(r"^(lib[\w+-]+?)\.so\.(\d+)")


def cuda_major_of(soname: str) -> tuple[str, int] | None:
    """``libcudart.so.13`` -> (libcudart, 13); None for a library that is not CUDA's."""
    m = _SONAME_RE.match(soname)
    if m is None or m.group(1) not in CUDA_LIBRARIES:
        return None
    return m.group(1), int(m.group(2))


# --------------------------------------------------------------------------- other majors


@dataclass(frozen=True, kw_only=True)
class OtherMajor:
    """A distribution built for another CUDA major than the env's (``-cu12`` in a CUDA 13
    env), and the distributions that require it."""

    package: str
    version: str
    major: int
    required_by: tuple[str, ...]


_CU_SUFFIX = re.compile(r"-cu(\d{2})$")


def _metadata(site: Path) -> dict[str, tuple[str, set[str]]]:
    """name -> (version, names it requires), from each dist-info's METADATA headers."""
    out: dict[str, tuple[str, set[str]]] = {}
    for meta in site.glob("*.dist-info/METADATA"):
        name = version = ""
        requires: set[str] = set()
        try:
            with meta.open(errors="replace") as fh:
                for line in fh:
                    if not line.strip():
                        break  # the headers end at the first blank line
                    key, _, value = line.partition(":")
                    if key == "Name":
                        name = canonicalize_name(value.strip())
                    elif key == "Version":
                        version = value.strip()
                    elif key == "Requires-Dist":
                        try:
                            req = Requirement(value.strip())
                        except InvalidRequirement:
                            continue
                        # A requirement of an extra holds only when the extra is asked for.
                        if req.marker is None or "extra" not in str(req.marker):
                            requires.add(canonicalize_name(req.name))
        except OSError:
            continue
        if name:
            out[name] = (version, requires)
    return out


def other_majors(env: Path, major: int) -> list[OtherMajor]:
    """The env's distributions named for another CUDA major than ``major``, with what
    requires each (nvidia-cutlass-dsl 4.8.0 requires its cu12 libraries unconditionally)."""
    found: list[OtherMajor] = []
    for site in sorted(env.glob("lib/python3*/site-packages")):
        dists = _metadata(site)
        for name, (version, _) in sorted(dists.items()):
            m = _CU_SUFFIX.search(name)
            if m is None or int(m.group(1)) == major:
                continue
            by = tuple(sorted(other for other, (_, req) in dists.items() if name in req))
            found.append(
                OtherMajor(package=name, version=version, major=int(m.group(1)), required_by=by)
            )
    return found


# --------------------------------------------------------------------------- the import probe

# A child that imports the stack and reports the CUDA libraries its process maps; no GPU is
# needed to import (libcuda is opened lazily by the runtime).
_MAPS_PROBE = r"""
import importlib, json, sys
errors = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:  # a package that fails to import is reported, not fatal
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        first = lines[0] if lines else ""
        # sgl_kernel's loader puts the cause (a library dlopen could not find) lines below.
        cause = next((ln for ln in lines[1:] if "cannot open shared object file" in ln), "")
        errors[name] = (f"{type(exc).__name__}: {first}" + (f" ({cause})" if cause else ""))[:500]
maps = set()
with open("/proc/self/maps") as fh:
    for line in fh:
        parts = line.split()
        if len(parts) >= 6 and ".so" in parts[-1]:
            maps.add(parts[-1])
print(json.dumps({"maps": sorted(maps), "errors": errors}))
"""


# The stack's CUDA users, imported by the probe where the env has them: torch first (the
# others import it), then what loads prebuilt kernels or CUDA libraries of its own.
PROBE_MODULES = ("torch", "flashinfer", "sgl_kernel", "vllm")


def probe_failure_note(name: str, why: str) -> str:
    """Whether a failed import of the probe is what this machine explains. sgl_kernel's
    common_ops links libcuda.so.1, the NVIDIA driver's library: where no driver is installed
    its loader raises "Could not load any common_ops library!" (sgl_kernel/load_utils.py),
    which says nothing about the GPU machine the env is for."""
    expected = (
        "; expected on a machine without the NVIDIA driver ({what} links libcuda.so.1, which "
        "the driver installs): import it on the GPU machine to judge it"
    )
    if "libcuda.so" in why and "cannot open shared object file" in why:
        return expected.format(what=name)
    if name == "sgl_kernel" and "common_ops" in why:
        if not driver.PROC_VERSION.exists():
            return expected.format(what="sgl_kernel's common_ops")
        return (
            "; not expected: this machine has the NVIDIA driver, so sgl_kernel's common_ops "
            "should load even without a GPU (`python -c 'import sgl_kernel'` in the env says why)"
        )
    return ""


def import_names(env: Path) -> list[str]:
    """Which of :data:`PROBE_MODULES` the env holds."""
    sites = sorted(env.glob("lib/python3*/site-packages"))
    return [m for m in PROBE_MODULES if any((site / m).is_dir() for site in sites)]


@dataclass(frozen=True, kw_only=True)
class Mapped:
    imported: tuple[str, ...]
    libraries: tuple[tuple[str, int, str], ...]  # (library, major, path) mapped
    errors: tuple[tuple[str, str], ...]  # packages that failed to import, and why

    def to_json(self) -> dict[str, object]:
        return codec.to_json(self)

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> Mapped | None:
        """None for what this release did not write (the scan cache's entry is redone)."""
        try:
            return codec.from_json(cls, doc, "the scan cache")
        except ReportError:
            return None

    def two_majors(self) -> dict[str, list[int]]:
        majors: dict[str, set[int]] = {}
        for lib, major, _ in self.libraries:
            majors.setdefault(lib, set()).add(major)
        return {lib: sorted(m) for lib, m in majors.items() if len(m) > 1}


def probe_maps(
    python: Path, modules: Sequence[str], *, env: dict[str, str] | None = None
) -> Mapped:
    done = proc.run([python, "-c", _MAPS_PROBE, *modules], env=env, check=False, timeout=300)
    try:
        doc = json.loads(done.stdout.strip().splitlines()[-1])
        maps = [str(m) for m in doc["maps"]]
        errors = {str(k): str(v) for k, v in dict(doc["errors"]).items()}
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise UsageError(
            f"{python}: the import probe printed no report (exit {done.returncode}): "
            + (done.stderr.strip().splitlines() or [str(exc)])[-1]
        ) from exc
    libraries = []
    for path in maps:
        lib = cuda_major_of(Path(path).name)
        if lib is not None:
            libraries.append((lib[0], lib[1], path))
    return Mapped(
        imported=tuple(modules),
        libraries=tuple(sorted(set(libraries))),
        errors=tuple(sorted(errors.items())),
    )
