"""The doctor's rule about the compiled torch extensions of an env: one built by another CUDA
than torch's (flash-attn compiled with /usr/local/cuda 12.8 beside a cu130 torch).

Read statically, torch never imported: a shared object that an installed distribution's RECORD
names and that links torch (DT_NEEDED ``libc10.so``, ``libtorch*.so``) is a torch extension.
Which CUDA compiled it shows in the CUDA libraries it links (``libcudart.so.12``: the major)
and in the ISA of any PTX it carries (:data:`builder.machine.archs.PTX_ISA_CUDA`: ISA 8.7 is
CUDA 12.8's). Another major than torch's is an error: the import fails for the other runtime,
or the process maps two. PTX of a newer minor than torch's says a newer nvcc made it: a driver
of torch's CUDA cannot compile that PTX. An older minor of torch's major is fine.

Every file is untrusted: only RECORD paths that stay inside site-packages are read, no symlink
is followed, every read is bounded (builder/machine/fatbin.py); a file that cannot be read is
passed over (the install proof and ``cudaenv audit`` name those), never a traceback.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

from builder.audit.majors import cuda_major_of
from builder.audit.scan import ScanCache
from builder.core.cudaversion import CudaVersion
from builder.doctor.facts import ERROR, INFO, Facts, Finding
from builder.doctor.toolkit_rules import install_command
from builder.env import manifest, recordscan
from builder.machine import driver, fatbin
from builder.machine.archs import PTX_ISA_CUDA

PAGE = "docs/troubleshooting/cuda-version-mismatch.md"
# torch's own libraries as an extension links them; named whole, since torchcodec's
# libtorchcodec_core.so starts with "libtorch" too (torch 1.x split libtorch_cuda in two).
_TORCH_LIBRARY = re.compile(
    r"lib(?:c10|c10_cuda|torch|torch_cpu|torch_cuda|torch_cuda_cu|torch_cuda_cpp|torch_python"
    r"|torch_global_deps)\.so"
)
# A library auditwheel vendored has a hash in its name: torchvision's image_stable.so links
# libcudart.3eda8113.so.13, torchcodec's libnvjpeg-1a359ba7.so.13.0.1.86.
_VENDORED = re.compile(r"(lib[\w+]+?)[.-][0-9a-f]{8}(\.so\.\d.*)")
# Not judged: torch's libraries are its CUDA by definition; NVIDIA's wheels link no torch and
# hold most of an env's shared objects.
_NOT_EXTENSIONS = ("torch",)
_NVIDIA = "nvidia-"
# RECORDs are untrusted: a bound on what one is read of and on the files read per env (a
# 207-package env's RECORDs name ~650 shared objects besides torch's and NVIDIA's).
MAX_RECORD_BYTES = 64 << 20
MAX_FILES = 20_000
_EVIDENCE_LINES = 8


@dataclass(frozen=True, kw_only=True)
class Extension:
    """A torch extension of the env, and what says which CUDA compiled it."""

    package: str  # the distribution whose RECORD names it
    version: str
    path: str  # relative to site-packages
    links: tuple[tuple[str, int], ...]  # each CUDA library it links (as named) and its major
    ptx: tuple[tuple[int, int], ...]  # the ISA of each PTX it carries, oldest first


def torch_extensions(
    site: Path, first: Sequence[str] = (), cache: ScanCache | None = None
) -> list[Extension]:
    """The torch extensions ``site`` holds, those of the distributions in ``first`` first.
    Only their device code is scanned (through ``cache`` where given); of every other shared
    object only the dynamic section is read."""
    site_real = os.path.realpath(site)
    inside: dict[str, bool] = {}
    found: list[Extension] = []
    for count, (package, version, rel) in enumerate(_shared_objects(site, first)):
        if count >= MAX_FILES:
            break
        path = site / rel
        parent = str(path.parent)
        if parent not in inside:
            # A directory symlinked out of the env (the final name is never followed).
            real = os.path.realpath(parent)
            inside[parent] = real == site_real or real.startswith(site_real + os.sep)
        if not inside[parent]:
            continue
        linked = fatbin.needed(path)
        if linked.error is not None or not any(map(_TORCH_LIBRARY.fullmatch, linked.needed)):
            continue
        try:
            scan = cache.scan(path) if cache is not None else fatbin.scan(path)
        except OSError:  # gone since: nothing to judge
            continue
        links = tuple((n, m) for n in linked.needed if (m := _cuda_major(n)) is not None)
        isas = sorted({c.ptx_isa for c in scan.codes if c.kind == "ptx" and c.ptx_isa})
        found.append(Extension(package=package, version=version, path=rel, links=links,
                               ptx=tuple(isas)))  # fmt: skip
    return found


def _shared_objects(site: Path, first: Sequence[str]) -> Iterator[tuple[str, str, str]]:
    """(distribution, version, path relative to ``site``) of every shared object a RECORD
    names there and that stays inside it; the distributions in ``first`` first."""
    records: list[tuple[bool, str, str, Path]] = []
    for record in site.glob("*.dist-info/RECORD"):
        name, dash, version = record.parent.name.removesuffix(".dist-info").rpartition("-")
        package = canonicalize_name(name)
        if dash and package not in _NOT_EXTENSIONS and not package.startswith(_NVIDIA):
            records.append((package not in first, package, version, record))
    for _, dist, dist_version, record in sorted(records):
        for row in recordscan.shared_objects(record, MAX_RECORD_BYTES):
            rel = os.path.normpath(row)
            # Absolute, or climbing out (a RECORD names the env's scripts as ../../../bin/x).
            if rel != os.pardir and not rel.startswith((os.sep, os.pardir + os.sep)):
                yield dist, dist_version, rel


def _cuda_major(soname: str) -> int | None:
    """The CUDA major of a CUDA library ``soname`` names (``libcudart.so.12`` -> 12), a
    vendored copy's included; None for any other library."""
    m = _VENDORED.fullmatch(soname)
    lib = cuda_major_of(m.group(1) + m.group(2) if m else soname)
    return lib[1] if lib is not None else None


# --------------------------------------------------------------------------- the verdicts


def _isa(isa: tuple[int, int]) -> str:
    return f"PTX ISA {isa[0]}.{isa[1]}"


def _other_major(ext: Extension, torch: CudaVersion) -> list[str]:
    """What says ``ext`` was built by another CUDA major than ``torch``, one line a fact."""
    lines = [
        f"{ext.path}: links {soname} (CUDA {major})"
        for soname, major in ext.links
        if major != torch.major
    ]
    for isa, by in _made_by(ext):
        if by.major != torch.major:
            lines.append(f"{ext.path}: carries {_isa(isa)}, made by CUDA {by}")
    return lines


def _made_by(ext: Extension) -> list[tuple[tuple[int, int], CudaVersion]]:
    """Each PTX ISA of ``ext`` that cudaenv knows and the CUDA release that made it."""
    return [(isa, PTX_ISA_CUDA[isa]) for isa in ext.ptx if isa in PTX_ISA_CUDA]


# A PTX newer than torch's CUDA: its ISA, the evidence line, the CUDA that made it.
_Newer = tuple[tuple[int, int], str, str]


def _newer_ptx(ext: Extension, torch: CudaVersion) -> list[_Newer]:
    """The PTX of ``ext`` made by a newer CUDA of torch's major than torch's own, or of an ISA
    newer than every CUDA cudaenv knows."""
    newest_known = max(PTX_ISA_CUDA)
    found = [
        (isa, f"{ext.path}: carries {_isa(isa)}, made by CUDA {by}", f"CUDA {by} ({_isa(isa)})")
        for isa, by in _made_by(ext)
        if by.major == torch.major and by > torch
    ]
    unknown = "newer than every CUDA cudaenv knows"
    found += [
        (isa, f"{ext.path}: carries {_isa(isa)}, {unknown}", f"{_isa(isa)} ({unknown})")
        for isa in ext.ptx
        if isa > newest_known
    ]
    return found


def _rebuild_fixes(facts: Facts, package: str, version: str) -> tuple[str, ...]:
    """How to compile ``package`` again with torch's matched nvcc, in the env diagnosed."""
    pinned = f"{package}=={version}" if version else package
    built = facts.manifest
    if built is not None and built.spec != manifest.ADOPTED_SPEC:
        first = (
            f"rebuild it with this env's matched nvcc: `cudaenv add {shlex.quote(pinned)} "
            f"--spec {shlex.quote(built.spec)}`"
        )
    else:
        name = shlex.quote(package)
        verb = (
            f"install --no-build-isolation --no-deps --force-reinstall --no-binary {name}"
            if "pip" in facts.dists
            else f"install --no-build-isolation --no-deps --reinstall-package {name} "
            f"--no-binary {name}"
        )
        again = f"`{install_command(facts, verb, pinned)}`"
        python = shlex.quote(facts.python or "ENV/bin/python")
        rebuild = f"`cudaenv adopt --python {python} --rebuild {name}`"
        if built is not None:
            first = (
                f"rebuild it from its sdist with the toolkit cudaenv adopt gave this env: {rebuild}"
            )
            by_hand = f"or by hand (not undone by `cudaenv adopt --undo`): {again}"
        else:
            first = f"give this env torch's matched nvcc and rebuild it against that: {rebuild}"
            by_hand = f"or adopt first, then rebuild it by hand: {again}"
        return first, by_hand, f"what this is and why: {PAGE}"
    return first, f"what this is and why: {PAGE}"


def rule_extension_cuda(facts: Facts) -> list[Finding]:
    """A compiled torch extension built by another CUDA major than torch's (an error), or
    carrying PTX of a newer CUDA than torch's (a note: a driver of torch's CUDA cannot compile
    it). The packages cudaenv built from their sdists come first."""
    torch = CudaVersion.read(facts.torch_cuda)
    if torch is None or not facts.prefix:
        return []
    built = facts.manifest
    source_built = [canonicalize_name(b[0]) for b in built.source_builds] if built else []
    cache = ScanCache.default()
    extensions = [
        ext
        for site in sorted(Path(facts.prefix).glob("lib/python3*/site-packages"))
        for ext in torch_extensions(site, source_built, cache)
    ]
    cache.save()
    by_package: dict[str, list[Extension]] = {}
    for ext in extensions:
        by_package.setdefault(ext.package, []).append(ext)
    out: list[Finding] = []
    for package, exts in by_package.items():  # source builds first, as read
        wrong = [(ext, lines) for ext in exts if (lines := _other_major(ext, torch))]
        if wrong:
            out.append(_other_major_finding(facts, torch, package, wrong, package in source_built))
            continue
        newer = [line for ext in exts for line in _newer_ptx(ext, torch)]
        if newer and not _driver_runs_newer(facts, torch):
            out.append(_newer_ptx_finding(facts, package, exts[0].version, newer))
    return out


def _other_major_finding(
    facts: Facts,
    torch: CudaVersion,
    package: str,
    wrong: Sequence[tuple[Extension, list[str]]],
    source_built: bool,
) -> Finding:
    first = wrong[0][0]
    # The most precise CUDA the evidence names: the release a PTX's ISA says, else the major
    # of the runtime it links.
    runtime = next(((n, m) for n, m in first.links if m != torch.major), None)
    made = [by for _, by in _made_by(first) if by.major != torch.major]
    said = str(max(made)) if made else str(runtime[1]) if runtime else "another major"
    effect = (
        f'importing it fails ("{runtime[0]}: cannot open shared object file"), or maps a '
        "second CUDA runtime beside torch's where another toolkit's libraries are on the "
        "loader's path"
        if runtime is not None
        else "it was compiled against another CUDA's headers than torch's"
    )
    more = f" and {len(wrong) - 1} more of its files" if len(wrong) > 1 else ""
    lines = [line for _, found in wrong for line in found]
    evidence = lines[:_EVIDENCE_LINES]
    if len(lines) > _EVIDENCE_LINES:
        evidence.append(f"... and {len(lines) - _EVIDENCE_LINES} more")
    evidence.append(f"torch {facts.torch_version} (CUDA {facts.torch_cuda})")
    if source_built:
        evidence.append(f"{package} was built from its sdist by cudaenv (this env's manifest)")
    return Finding(
        code="extension-built-for-other-cuda",
        severity=ERROR,
        cause=f"{package} {first.version}: {first.path}{more} is a torch extension built by CUDA "
        f"{said}, but torch {facts.torch_version} is CUDA {facts.torch_cuda}: {effect}",
        evidence=tuple(evidence),
        fix=_rebuild_fixes(facts, package, first.version),
    )


def _driver_runs_newer(facts: Facts, torch: CudaVersion) -> bool:
    """Whether this box's driver runs a newer CUDA major than torch's, and so every minor of
    torch's (a driver version says its majors, not which minors)."""
    if facts.driver is None:
        return False
    try:
        newest = driver.newest_cuda_major(facts.driver)
    except ValueError:  # not dotted numbers: no judgement
        return False
    return newest is not None and newest > torch.major


def _newer_ptx_finding(facts: Facts, package: str, version: str, found: list[_Newer]) -> Finding:
    made = max(found)[2]  # the newest ISA's
    torch = f"torch {facts.torch_version} (CUDA {facts.torch_cuda})"
    return Finding(
        code="extension-ptx-newer-than-torch",
        severity=INFO,
        cause=f"{package} {version} carries PTX made by {made}, newer than the CUDA of {torch}: "
        'a driver older than that CUDA cannot compile it ("the provided PTX was compiled with '
        'an unsupported toolchain"); it is used only on a GPU the file holds no SASS for',
        evidence=(*(line for _, line, _ in found[:_EVIDENCE_LINES]), torch),
        fix=(
            f"`cudaenv audit --python {shlex.quote(facts.python or 'ENV/bin/python')} --archs "
            "ARCHS` says which GPUs run it from SASS and which need this PTX",
            f"what this is and why: {PAGE}",
        ),
    )
