"""`cudaenv audit`: can every prebuilt CUDA binary of an env run on its target GPUs?

`verify` proves what cudaenv compiles; a server also runs the hundreds of binaries the env
ships (torch's libraries, sgl_kernel, vLLM's extensions, NVIDIA's libraries). For each ELF file
in the env that holds device code (site-packages, ``cuda-home/``, the env's JIT caches under
``var/``) the audit reads its SASS and PTX (builder/machine/fatbin.py, headers only) and judges each
target arch by the rules of archs.COMPATIBILITY: runs (SASS), runs through the driver's PTX
JIT, or has no code for it.

Which binaries matter on an arch is the packages' own choice, read from their loaders and
kept here as data (:data:`LOADERS`): torch loads its libraries at import; sgl_kernel's
``load_utils`` takes ``sm90/common_ops`` on CC 9.0 and ``sm100/common_ops`` on every other CC;
vLLM imports its ``_C`` extensions. Whatever a required binary links (DT_NEEDED, followed
through the env) is required too. A required binary with no code for a target fails, naming
package, file, what it holds and the arch (an ``sm_120a`` cubin on a CC 12.1 GPU:
sgl-project/sglang#29317); the others are listed. A binary that could not be read is never
counted as covered.

CUDA majors: the CUDA libraries each binary links, by major and by the package that brings
them, and (``probe``) what one process that imports the stack actually maps: two majors of
one CUDA library in one process break some libraries (NVIDIA/cudnn-frontend#211,
flashinfer#5145). Reading sonames, distributions of another major and the probe is
builder/audit/majors.py's; this module judges and reports.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from packaging.utils import canonicalize_name

from builder.audit.majors import CUDA_LIBRARIES as CUDA_LIBRARIES
from builder.audit.majors import PROBE_MODULES as PROBE_MODULES
from builder.audit.majors import Mapped as Mapped
from builder.audit.majors import OtherMajor as OtherMajor
from builder.audit.majors import cuda_major_of as cuda_major_of
from builder.audit.majors import import_names as import_names
from builder.audit.majors import other_majors as other_majors
from builder.audit.majors import probe_failure_note as probe_failure_note
from builder.audit.majors import probe_maps as probe_maps
from builder.core import cachefiles
from builder.core.cudaversion import CudaVersion
from builder.core.errors import UsageError
from builder.core.paths import cache_dir
from builder.env import manifest, recipes
from builder.env.installproof import record_rows
from builder.machine import fatbin
from builder.machine.archs import Arch, code_runs_on

Verdict = Literal["sass", "ptx", "none", "unreadable"]

# --------------------------------------------------------------------------- which binaries matter


@dataclass(frozen=True, kw_only=True)
class Loader:
    """Files a package loads (``pattern``, relative to site-packages) on the GPUs ``when``
    accepts, and where that choice is made."""

    package: str
    pattern: str
    why: str
    when: Callable[[tuple[int, int]], bool] = lambda _cc: True


def _is_hopper(cc: tuple[int, int]) -> bool:
    return cc == (9, 0)


LOADERS: tuple[Loader, ...] = (
    Loader(package="torch", pattern="torch/lib/*.so*", why="torch loads its libraries at import"),
    Loader(
        package="sgl-kernel",
        pattern="sgl_kernel/sm90/common_ops.*",
        why="sgl_kernel's load_utils takes sm90/common_ops on CC 9.0",
        when=_is_hopper,
    ),
    Loader(
        package="sgl-kernel",
        pattern="sgl_kernel/sm100/common_ops.*",
        why="sgl_kernel's load_utils takes sm100/common_ops on every CC but 9.0",
        when=lambda cc: not _is_hopper(cc),
    ),
    # DeepGEMM loads its _C at import; it holds host code only (its kernels are compiled at
    # run time through NVRTC), so it is judged by what it links. FlashMLA and sgl_kernel's
    # flash_ops / flashmla_ops are imported only by the attention backends that choose them
    # (Hopper, datacenter Blackwell), inside a try: they are listed, not required.
    Loader(package="sgl-deep-gemm", pattern="deep_gemm/_C.so", why="deep_gemm loads _C at import"),
    Loader(package="vllm", pattern="vllm/_C*.so", why="vllm imports its _C extensions"),
    Loader(package="vllm", pattern="vllm/_moe_C*.so", why="vllm imports its MoE extensions"),
)


# --------------------------------------------------------------------------- the env's binaries


@dataclass(frozen=True, kw_only=True)
class Binary:
    path: Path  # relative to the env
    package: str  # the distribution that installed it; "-" for files no RECORD names
    scan: fatbin.Scan

    @property
    def holds(self) -> str:
        """What it carries, as cuobjdump would list it: ``sm_80 sm_90a; ptx compute_90``."""
        sass = sorted({c.arch for c in self.scan.codes if c.kind == "sass"})
        ptx = sorted({c.arch for c in self.scan.codes if c.kind == "ptx"})
        parts = []
        if sass:
            parts.append(" ".join(f"sm_{a.code}" for a in sass))
        if ptx:
            parts.append("ptx " + " ".join(f"compute_{a.code}" for a in ptx))
        return "; ".join(parts) or "no device code"


def _owners(site: Path) -> dict[str, str]:
    """Relative path in site-packages -> the distribution whose RECORD lists it."""
    owners: dict[str, str] = {}
    for record in site.glob("*.dist-info/RECORD"):
        name = canonicalize_name(record.parent.name.removesuffix(".dist-info").rsplit("-", 1)[0])
        try:
            rows = record_rows(record)
        except OSError:
            continue
        for row in rows:
            owners[os.path.normpath(row[0])] = name
    return owners


def _walk(root: Path) -> Iterator[Path]:
    """The regular files under ``root`` whose names a shared library, object or fatbin has;
    symlinks are neither followed nor listed (cuda-home/ links into the wheels' prefix: those
    files are scanned where they live). os.scandir's entry types need no stat per file: an
    env holds ~75,000 files."""
    stack = [str(root)]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False) and _candidate(entry.name):
                        yield Path(entry.path)
        except OSError:
            continue  # a directory that vanished or cannot be read holds nothing to judge


def _candidate(name: str) -> bool:
    return name.endswith((".so", ".cubin", ".fatbin", ".o")) or ".so." in name


class ScanCache:
    """Scans by file identity (device, inode, size, mtime): a second audit of an unchanged env
    reads no binary again. Kept as JSON in cudaenv's cache under its trust rules (cachefiles:
    a forged scan could hide a missing arch); anything unreadable or refused there is ignored
    (a scan only informs a report, and is redone)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, object] = {}
        self.seen: list[str] = []  # every file scanned (or found unchanged) in this run
        self.dirty = False
        loaded = cachefiles.read_json(path) if path is not None else None
        if isinstance(loaded, dict):
            self.entries = loaded

    @classmethod
    def default(cls) -> ScanCache:
        """The machine-wide one, in cudaenv's cache directory."""
        return cls(cache_dir() / "audit" / "scans.json")

    @staticmethod
    def key(path: Path) -> str:
        """The file's identity and the reader's version: a scan the reader would now do
        differently (a layout it has learned since) is redone."""
        st = path.stat()
        return f"v{fatbin.READER_VERSION}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"

    def scan(self, path: Path) -> fatbin.Scan:
        key = self.key(path)
        self.seen.append(f"{path}={key}")
        found = self.entries.get(key)
        if isinstance(found, dict):
            cached = fatbin.Scan.from_json(found, path)
            if cached is not None:
                return cached
        result = fatbin.scan(path)
        self.entries[key] = result.to_json()
        self.dirty = True
        return result

    def probe(self, python: Path, modules: Sequence[str], env: Path, run: Callable[[], Mapped]
              ) -> Mapped:  # fmt: skip
        """What the import probe mapped, reused while no binary and no installed distribution
        of the env changed (the files scanned this run and every RECORD, by identity)."""
        records = sorted(
            f"{r}={self.key(r)}" for r in env.glob("lib/python3*/site-packages/*.dist-info/RECORD")
        )
        material = "\n".join([str(python), *modules, *sorted(self.seen), *records])
        key = "probe:" + hashlib.sha256(material.encode()).hexdigest()
        found = self.entries.get(key)
        if isinstance(found, dict):
            cached = Mapped.from_json(found)
            if cached is not None:
                return cached
        mapped = run()
        self.entries[key] = mapped.to_json()
        self.dirty = True
        return mapped

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        # A cache that cannot be written (or is refused) costs a rescan.
        cachefiles.write_text(self.path, json.dumps(self.entries))


def binaries(env: Path, cache: ScanCache) -> list[Binary]:
    """Every ELF with device code (or that could not be read) in the env."""
    sites = sorted(env.glob("lib/python3*/site-packages"))
    roots = [*sites, env / "cuda-home", env / "var"]
    owners: dict[Path, dict[str, str]] = {site: _owners(site) for site in sites}
    found: list[Binary] = []
    for root in roots:
        if not root.is_dir() or root.is_symlink():
            continue
        for path in _walk(root):
            if not fatbin.is_elf(path):
                continue
            scan = cache.scan(path)
            if not scan.codes and scan.error is None and not scan.needed:
                continue
            package = "-"
            if root in owners:
                package = owners[root].get(os.path.normpath(path.relative_to(root)), "-")
            found.append(Binary(path=path.relative_to(env), package=package, scan=scan))
    return found


# --------------------------------------------------------------------------- judging


@dataclass(frozen=True, kw_only=True)
class Judgement:
    binary: Binary
    arch: Arch
    verdict: Verdict
    required: str | None  # why it is needed on this arch; None: optional

    @property
    def covered(self) -> bool:
        return self.verdict in ("sass", "ptx")


def verdict(scan: fatbin.Scan, arch: Arch, driver_cuda: CudaVersion | None) -> Verdict:
    if scan.error is not None:
        return "unreadable"
    cc = arch.capability
    if any(c.kind == "sass" and code_runs_on("sass", c.arch, cc) for c in scan.codes):
        return "sass"
    if any(
        c.kind == "ptx"
        and code_runs_on("ptx", c.arch, cc, ptx_isa=c.ptx_isa, driver_cuda=driver_cuda)
        for c in scan.codes
    ):
        return "ptx"
    return "none"


def _site_relative(binary: Binary) -> str | None:
    parts = binary.path.parts
    if len(parts) > 3 and parts[0] == "lib" and parts[2] == "site-packages":
        return "/".join(parts[3:])
    return None


# Why a binary of a package the env built from its sdist is required (builder/env/
# sourcebuild.py): it was compiled for this env's archs alone, which is what is judged.
BUILT_HERE = "built from its sdist for this env's archs (cudaenv.json source_builds)"


def required_on(
    found: Sequence[Binary], cc: tuple[int, int], built: frozenset[str] = frozenset()
) -> dict[Path, str]:
    """The binaries the stack loads on a GPU of ``cc``: the loaders' choices and every binary
    of the packages ``built`` from their sdists (canonical names), then whatever they link,
    followed through the env by soname."""
    by_name: dict[str, list[Binary]] = {}
    for b in found:
        by_name.setdefault(b.path.name, []).append(b)
    need: dict[Path, str] = {}
    queue: list[Binary] = []
    for b in found:
        rel = _site_relative(b)
        if rel is None:
            continue
        if canonicalize_name(b.package) in built:
            need.setdefault(b.path, BUILT_HERE)
            queue.append(b)
        for loader in LOADERS:
            if loader.when(cc) and fnmatch.fnmatch(rel, loader.pattern):
                need.setdefault(b.path, loader.why)
                queue.append(b)
    while queue:
        b = queue.pop()
        for soname in b.scan.needed:
            for dep in by_name.get(soname, []):
                # NVIDIA's CUDA libraries pick or generate their kernels at run time (cuFFT
                # ships sm_75 helpers and compiles its FFT kernels through NVRTC): what their
                # fatbins hold is no verdict on a GPU, so they are listed, not required.
                if dep.package.startswith("nvidia-"):
                    continue
                if dep.path not in need:
                    need[dep.path] = f"linked by {b.path.name}"
                    queue.append(dep)
    return need


def built_without_cuda(found: Sequence[Binary], built: frozenset[str]) -> frozenset[Path]:
    """The extension modules of each package the env ``built`` from its sdist that link torch
    while no module of that package holds device code: a CUDA package's CPU build (its
    setup.py chose a CppExtension where the build saw no GPU, or DeepSpeed's cpu accelerator).
    Judged as holding no code for each arch, never skipped as host code; the modules a recipe
    names as host code by design (DeepSpeed's CPU Adam) are not such a build."""
    by_package: dict[str, list[Binary]] = {}
    for b in found:
        if canonicalize_name(b.package) in built:
            by_package.setdefault(canonicalize_name(b.package), []).append(b)
    return frozenset(
        b.path
        for package, modules in by_package.items()
        if not any(m.scan.codes or m.scan.error for m in modules)
        for b in modules
        if b.scan.links_torch and not recipes.host_module(package, b.path.name)
    )


def judge(
    found: Sequence[Binary],
    archs: Sequence[Arch],
    driver_cuda: CudaVersion | None,
    built: frozenset[str] = frozenset(),
) -> list[Judgement]:
    out: list[Judgement] = []
    cpu_builds = built_without_cuda(found, built)
    for arch in archs:
        need = required_on(found, arch.capability, built)
        for b in found:
            if not b.scan.codes and b.scan.error is None and b.path not in cpu_builds:
                continue  # host code only: nothing to judge for a GPU
            out.append(
                Judgement(
                    binary=b,
                    arch=arch,
                    verdict=verdict(b.scan, arch, driver_cuda),
                    required=need.get(b.path),
                )
            )
    return out


# --------------------------------------------------------------------------- CUDA majors


@dataclass(frozen=True, kw_only=True)
class Linked:
    library: str  # libcudart
    major: int
    by: tuple[tuple[str, str], ...]  # (package, file) that link it


def linked_majors(found: Sequence[Binary]) -> list[Linked]:
    seen: dict[tuple[str, int], set[tuple[str, str]]] = {}
    for b in found:
        for soname in b.scan.needed:
            lib = cuda_major_of(soname)
            if lib is not None:
                seen.setdefault(lib, set()).add((b.package, str(b.path)))
    return [
        Linked(library=lib, major=major, by=tuple(sorted(by)))
        for (lib, major), by in sorted(seen.items())
    ]


# --------------------------------------------------------------------------- the audit


@dataclass(frozen=True, kw_only=True)
class Audit:
    env: Path
    archs: tuple[Arch, ...]
    driver_cuda: CudaVersion | None
    binaries: tuple[Binary, ...]
    judgements: tuple[Judgement, ...]
    linked: tuple[Linked, ...]
    other_majors: tuple[OtherMajor, ...]
    major: int | None  # the env's CUDA major
    mapped: Mapped | None
    seconds: float

    @property
    def with_code(self) -> list[Binary]:
        return [b for b in self.binaries if b.scan.codes or b.scan.error]

    @property
    def failures(self) -> list[str]:
        out = []
        for j in self.judgements:
            if j.required is not None and not j.covered:
                what = (
                    f"could not be read ({j.binary.scan.error})"
                    if j.verdict == "unreadable"
                    else f"holds {j.binary.holds}"
                )
                out.append(
                    f"{j.binary.package}: {j.binary.path} {what}: no code for {j.arch} "
                    f"(needed there: {j.required})"
                )
        if self.mapped is not None:
            for lib, majors in self.mapped.two_majors().items():
                out.append(
                    f"one process maps {lib} of CUDA "
                    + " and ".join(str(m) for m in majors)
                    + f" after importing {', '.join(self.mapped.imported)}"
                )
        return out

    @property
    def warnings(self) -> list[str]:
        out = []
        majors = sorted({ln.major for ln in self.linked})
        if len(majors) > 1:
            for ln in self.linked:
                if ln.major == self.major:
                    continue
                packages = sorted({p for p, _ in ln.by})
                out.append(
                    f"{ln.library}.so.{ln.major} (CUDA {ln.major}) is linked by "
                    f"{', '.join(packages)} ({len(ln.by)} file(s)); the env's CUDA is "
                    f"{self.major if self.major is not None else 'not known'}"
                )
        for om in self.other_majors:
            by = (
                f"required by {', '.join(om.required_by)}"
                if om.required_by
                else "which nothing installed requires"
            )
            out.append(
                f"{om.package} {om.version} (CUDA {om.major}) is installed, {by}; a process "
                f"that loads it maps a second CUDA major"
            )
        for j in self.judgements:
            if j.required is None and j.verdict == "unreadable":
                out.append(f"{j.binary.path} could not be read: {j.binary.scan.error}")
        if self.mapped is not None:
            for name, why in self.mapped.errors:
                note = probe_failure_note(name, why)
                out.append(f"import {name} failed in the probe: {why}{note}")
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "env": str(self.env),
            "archs": [str(a) for a in self.archs],
            "driver_cuda": str(self.driver_cuda) if self.driver_cuda else None,
            "seconds": round(self.seconds, 2),
            "status": "failed" if self.failures else "passed",
            "failures": self.failures,
            "warnings": self.warnings,
            "other_majors": [
                {
                    "package": o.package,
                    "version": o.version,
                    "major": o.major,
                    "required_by": list(o.required_by),
                }
                for o in self.other_majors
            ],
            "binaries": [
                {
                    "path": str(b.path),
                    "package": b.package,
                    "holds": b.holds,
                    "error": b.scan.error,
                    "needed": list(b.scan.needed),
                    "targets": {
                        str(j.arch): {"verdict": j.verdict, "required": j.required}
                        for j in self.judgements
                        if j.binary is b
                    },
                }
                for b in self.with_code
            ],
            "linked": [
                {"library": ln.library, "major": ln.major, "by": [list(x) for x in ln.by]}
                for ln in self.linked
            ],
            "mapped": None if self.mapped is None else self.mapped.to_json(),
        }


def run(
    env: Path,
    archs: Sequence[Arch],
    *,
    driver_cuda: CudaVersion | None,
    cache: ScanCache,
    major: int | None = None,
    probe: tuple[Path, Sequence[str], dict[str, str] | None] | None = None,
) -> Audit:
    """Audit the env at ``env`` for ``archs``; with ``probe`` (python, modules, environment),
    also import the modules there and read what the process maps."""
    if not archs:
        raise UsageError("audit needs at least one target arch (--archs, or a visible GPU)")
    started = time.monotonic()
    found = binaries(env, cache)
    mapped = None
    if probe is not None:
        python, modules, environ = probe
        mapped = cache.probe(python, modules, env, lambda: probe_maps(python, modules, env=environ))
    cache.save()
    linked = linked_majors(found)
    if major is None:
        # The env's CUDA: the major of the runtime most of its binaries link.
        runtimes = [ln for ln in linked if ln.library == "libcudart"]
        major = max(runtimes, key=lambda ln: len(ln.by)).major if runtimes else None
    return Audit(
        env=env,
        archs=tuple(archs),
        driver_cuda=driver_cuda,
        binaries=tuple(found),
        judgements=tuple(judge(found, archs, driver_cuda, manifest.source_built(env))),
        linked=tuple(linked),
        other_majors=tuple(other_majors(env, major)) if major is not None else (),
        major=major,
        mapped=mapped,
        seconds=time.monotonic() - started,
    )


def render(audit: Audit) -> str:
    """The terminal report: the verdict, the required binaries per arch, failures, warnings."""
    lines = [
        f"audit {audit.env}: {'FAILED' if audit.failures else 'PASSED'} for "
        f"{', '.join(str(a) for a in audit.archs)} ({len(audit.with_code)} binaries with "
        f"device code, {audit.seconds:.1f} s)"
    ]
    for arch in audit.archs:
        mine = [j for j in audit.judgements if j.arch == arch]
        required = [j for j in mine if j.required is not None]
        missing = [j for j in mine if not j.covered]
        lines.append(
            f"  {arch}: {sum(j.covered for j in required)}/{len(required)} required binaries "
            f"run ({sum(j.verdict == 'ptx' for j in required)} through PTX); "
            f"{len(missing)} binaries in all have no code for it"
        )
        for j in missing:
            if j.required is None:
                lines.append(f"    optional, no code: {j.binary.package}: {j.binary.path} "
                             f"({j.binary.holds})")  # fmt: skip
    for f in audit.failures:
        lines.append(f"  FAIL {f}")
    for w in audit.warnings:
        lines.append(f"  warning: {w}")
    return "\n".join(lines)


def markdown(audit: Audit) -> str:
    head = f"# cudaenv audit: {'FAILED' if audit.failures else 'PASSED'}\n\n"
    rows = ["| binary | package | holds | " + " | ".join(str(a) for a in audit.archs) + " |"]
    rows.append("|---|---|---|" + "---|" * len(audit.archs))
    for b in audit.with_code:
        cells = []
        for arch in audit.archs:
            j = next(x for x in audit.judgements if x.binary is b and x.arch == arch)
            mark = {"sass": "yes", "ptx": "PTX", "none": "**no**", "unreadable": "unreadable"}
            cells.append(mark[j.verdict] + (" (required)" if j.required else ""))
        rows.append(f"| `{b.path}` | {b.package} | {b.holds} | " + " | ".join(cells) + " |")
    body = "\n".join(rows)
    notes = "".join(f"- FAIL {f}\n" for f in audit.failures) + "".join(
        f"- warning: {w}\n" for w in audit.warnings
    )
    return head + (notes + "\n" if notes else "") + body + "\n"
