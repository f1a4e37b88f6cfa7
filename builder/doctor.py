"""Rules over the facts of any interpreter -> Findings (cause, evidence, fix), root cause first.

The facts come from ``builder/probe/doctor_probe.py`` run inside the target interpreter
(standard library only, no ``import torch`` unless ``--deep``). Every rule is one function
over :class:`Facts`; the ordering puts the root cause first and groups the symptoms it
explains under it.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Final, Literal

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from builder import archs, caches, channels, driver, manifest, policy, proc, variables
from builder.cudaversion import CudaVersion
from builder.errors import CudaenvError
from builder.manifest import Manifest

Severity = Literal["error", "warning", "info"]
ERROR: Final = "error"
WARNING: Final = "warning"
INFO: Final = "info"
SEVERITY_ORDER: dict[Severity, int] = {ERROR: 0, WARNING: 1, INFO: 2}
PROBE_TIMEOUT = 60.0
DEEP_TIMEOUT = 600.0
PYTHON_FIX = "check that this is a working Python 3.9+"
HANG_FIX = "run with --debug and look at what hangs"
# FlashInfer's own gate: "Failed to get device capability: SM 12.x requires CUDA >= 12.9".
SM12_MIN_CUDA = CudaVersion(major=12, minor=9)
# Bumped from 1 when "facts" became typed values instead of the report's display strings.
JSON_SCHEMA_VERSION = 2


# --------------------------------------------------------------------------- facts


@dataclass(frozen=True, kw_only=True)
class CudaHome:
    source: str
    path: str
    nvcc: str
    exists: bool
    release: str | None = None
    error: str | None = None
    max_gcc: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "path": self.path,
            "nvcc": self.nvcc,
            "exists": self.exists,
            "release": self.release,
            "error": self.error,
            "max_gcc": self.max_gcc,
        }


@dataclass(frozen=True, kw_only=True)
class JitEntry:
    version: str
    archs: str
    op: str
    cuda_home: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "archs": self.archs,
            "op": self.op,
            "cuda_home": self.cuda_home,
        }


@dataclass(frozen=True, kw_only=True)
class Facts:
    python: str
    python_version: str
    prefix: str
    glibc: str
    env: Mapping[str, str | None]
    torch_installed: bool
    torch_version: str | None
    torch_cuda: str | None
    torch_error: str | None
    dists: Mapping[str, str]
    cuda_homes: tuple[CudaHome, ...]
    toolkits: tuple[CudaHome, ...]
    driver: str | None
    gpus: tuple[archs.Gpu, ...]  # listed by cudaenv (archs.visible_gpus), not by the probe
    gpus_note: str | None  # why no GPU is listed, when none is
    jit_root: str
    jit_entries: tuple[JitEntry, ...]
    cxx: str | None
    cxx_banner: str
    cxx_error: str | None
    gcc_major: int | None
    deep: Mapping[str, Any] | None
    errors: Mapping[str, str]
    manifest: Manifest | None
    seconds: float
    # The archs the env is for, as `cudaenv doctor --archs` was told (the box may have no GPU).
    target_archs: tuple[archs.Arch, ...] = ()

    @property
    def jit_home(self) -> CudaHome | None:
        """The CUDA_HOME FlashInfer's get_cuda_path() (and torch's) picks: the first candidate."""
        return self.cuda_homes[0] if self.cuda_homes else None

    @property
    def flashinfer(self) -> str | None:
        return self.dists.get("flashinfer-python")

    @classmethod
    def from_json(
        cls,
        doc: Mapping[str, Any],
        manifest: Manifest | None,
        *,
        gpus: Sequence[archs.Gpu] = (),
        gpus_note: str | None = None,
        target_archs: Sequence[archs.Arch] = (),
    ) -> Facts:
        """The probe's JSON (from a foreign interpreter: every key may be missing) plus what
        cudaenv itself knows: the env's manifest and the visible GPUs."""

        def sub(key: str) -> Mapping[str, Any]:
            v = doc.get(key)
            return v if isinstance(v, dict) else {}

        def homes(items: Any) -> tuple[CudaHome, ...]:
            out = []
            for c in items if isinstance(items, list) else []:
                if isinstance(c, dict):
                    out.append(
                        CudaHome(
                            source=str(c.get("source", "")),
                            path=str(c.get("path", "")),
                            nvcc=str(c.get("nvcc", "")),
                            exists=bool(c.get("exists")),
                            release=c.get("release"),
                            error=c.get("error"),
                            max_gcc=c.get("max_gcc") if isinstance(c.get("max_gcc"), int) else None,
                        )
                    )
            return tuple(out)

        py, plat, torch, drv, jit, cxx = (
            sub(k) for k in ("python", "platform", "torch", "driver", "jit_cache", "host_compiler")
        )
        entries = tuple(
            JitEntry(
                version=str(e.get("version")),
                archs=str(e.get("archs")),
                op=str(e.get("op")),
                cuda_home=e.get("cuda_home"),
            )
            for e in jit.get("entries", [])
            if isinstance(e, dict)
        )
        dists = doc.get("distributions")
        deep = doc.get("deep")
        errors = dict(sub("errors"))
        if torch.get("error"):
            errors.setdefault("torch", str(torch["error"]))
        return cls(
            python=str(py.get("executable", "")),
            python_version=str(py.get("version", "")),
            prefix=str(py.get("prefix", "")),
            glibc=str(plat.get("glibc", "")),
            env={str(k): (None if v is None else str(v)) for k, v in sub("env").items()},
            torch_installed=bool(torch.get("installed")),
            torch_version=torch.get("version"),
            torch_cuda=torch.get("cuda"),
            torch_error=torch.get("error"),
            dists={str(k): str(v) for k, v in dists.items()} if isinstance(dists, dict) else {},
            cuda_homes=homes(doc.get("cuda_homes")),
            toolkits=homes(doc.get("toolkits")),
            driver=drv.get("version"),
            gpus=tuple(gpus),
            gpus_note=gpus_note,
            jit_root=str(jit.get("root", "")),
            jit_entries=entries,
            cxx=cxx.get("path"),
            cxx_banner=str(cxx.get("banner", "")),
            cxx_error=None if cxx.get("error") is None else str(cxx["error"]),
            gcc_major=cxx.get("gcc_major") if isinstance(cxx.get("gcc_major"), int) else None,
            deep=deep if isinstance(deep, dict) else None,
            errors={str(k): str(v) for k, v in errors.items()},
            manifest=manifest,
            seconds=float(doc.get("seconds", 0.0) or 0.0),
            target_archs=tuple(target_archs),
        )

    def to_json(self) -> dict[str, Any]:
        """Typed values for ``doctor --json``; lists keep the lookup order (``cuda_homes[0]``
        is the toolkit FlashInfer's and torch's JIT use)."""
        return {
            "python": {
                "executable": self.python,
                "version": self.python_version,
                "prefix": self.prefix,
            },
            "glibc": self.glibc or None,
            "torch": {
                "installed": self.torch_installed,
                "version": self.torch_version,
                "cuda": self.torch_cuda,
                "error": self.torch_error,
            },
            "flashinfer": self.flashinfer,
            "distributions": dict(sorted(self.dists.items())),
            "cuda_homes": [h.to_json() for h in self.cuda_homes],
            "toolkits": [h.to_json() for h in self.toolkits],
            "env": dict(self.env),
            "driver": self.driver,
            "gpus": [
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "name": g.name,
                    "capability": g.capability_text if g.capability else None,
                }
                for g in self.gpus
            ],
            "gpus_note": self.gpus_note,
            "jit_cache": {
                "root": self.jit_root,
                "entries": [e.to_json() for e in self.jit_entries],
            },
            "host_compiler": {
                "path": self.cxx,
                "banner": self.cxx_banner or None,
                "gcc_major": self.gcc_major,
                "error": self.cxx_error,
            },
            "manifest": self.manifest.to_json() if self.manifest is not None else None,
            "deep": dict(self.deep) if self.deep is not None else None,
            "errors": dict(self.errors),
            "probe_seconds": round(self.seconds, 3),
        }


# --------------------------------------------------------------------------- findings


@dataclass(frozen=True, kw_only=True)
class Finding:
    code: str
    severity: Severity
    cause: str
    evidence: tuple[str, ...] = ()
    fix: tuple[str, ...] = ()
    symptoms: tuple[Finding, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity,
            "cause": self.cause,
            "evidence": list(self.evidence),
            "fix": list(self.fix),
            "symptoms": [s.to_json() for s in self.symptoms],
        }


def _home_text(home: CudaHome) -> str:
    if home.source.startswith("$"):
        return f"{home.source[1:]}={home.path}"
    return f"{home.path}, from {home.source}"


def _adopt_fix(facts: Facts) -> str | None:
    """The first fix for an env cudaenv did not build: repair it where it stands."""
    if facts.manifest is not None and facts.manifest.spec != manifest.ADOPTED_SPEC:
        return None
    python = facts.python or "PATH"
    if facts.manifest is not None:
        return (
            f"adopt it again: `cudaenv adopt --undo --python {python}`, then "
            f"`cudaenv adopt --python {python}`"
        )
    return (
        f"repair this env in place: `cudaenv adopt --python {python}` (installs torch's "
        "matched toolkit, wires CUDA_HOME; `--dry-run` first, `--undo` reverts)"
    )


def install_command(facts: Facts, verb: str, *requirements: str) -> str:
    """``pip install X`` as it works in the env diagnosed: through its own pip where it has
    one, else through uv (a uv venv has no pip, and a bare ``pip`` is some other env's)."""
    args = " ".join(shlex.quote(r) for r in requirements)
    if "pip" in facts.dists:
        return f"{shlex.quote(facts.python)} -m pip {verb} {args}"
    return f"uv pip {verb} --python {shlex.quote(facts.python)} {args}"


def _matched_fixes(facts: Facts, want: str | None) -> tuple[str, ...]:
    """The exact ways to give the JIT the toolkit of torch's CUDA."""
    fixes: list[str] = []
    adopt_fix = _adopt_fix(facts)
    if adopt_fix is not None and want:
        fixes.append(adopt_fix)
    if want:
        for tk in facts.toolkits:
            if tk.release == want:
                fixes.append(f"export CUDA_HOME={tk.path}")
                break
    if facts.manifest is not None and adopt_fix is None:
        fixes.append(
            f"this env was built by cudaenv: run its own python without CUDAENV_NO_HOOK, or "
            f"rebuild it: `cudaenv build {facts.manifest.spec}`"
        )
    elif want and facts.manifest is None:
        pin = facts.dists.get("cuda-toolkit")
        if pin and CudaVersion.read(pin) == CudaVersion.read(want):
            fixes.append(
                f"install the matched compiler into this env: "
                f"`{install_command(facts, 'install', f'cuda-toolkit[nvcc,cudart,crt,nvvm,cccl]=={pin}')}`"
                ", then build an env "
                'that wires it as CUDA_HOME: `cudaenv build SPEC` with cuda: "' + want + '"'
            )
        else:
            fixes.append(f'the cudaenv way: a spec with cuda: "{want}" and `cudaenv build SPEC`')
    return tuple(fixes)


def rule_nvcc(facts: Facts) -> list[Finding]:
    """No nvcc / a broken nvcc / a JIT toolkit that is not torch's CUDA / SM 12.x too old."""
    home = facts.jit_home
    torch_cuda = facts.torch_cuda
    out: list[Finding] = []
    if home is None:
        if facts.flashinfer or facts.torch_installed:
            out.append(
                Finding(
                    code="no-nvcc",
                    severity=ERROR if facts.flashinfer else WARNING,
                    cause="no nvcc reachable: no CUDA_HOME, CUDA_PATH, nvcc on PATH or /usr/local/cuda"
                    + (
                        f"; FlashInfer silently falls back to torch's CUDA {torch_cuda} and every JIT "
                        "compile fails"
                        if facts.flashinfer
                        else ""
                    ),
                    fix=_matched_fixes(facts, torch_cuda),
                )
            )
        return out
    where = _home_text(home)
    if not home.exists:
        if facts.flashinfer or facts.torch_installed:
            out.append(
                Finding(
                    code="no-nvcc",
                    severity=ERROR if facts.flashinfer else WARNING,
                    cause=f"no nvcc at {home.nvcc} ({where})"
                    + (
                        f": FlashInfer's get_cuda_version() silently falls back to torch's CUDA "
                        f"{torch_cuda}, and its JIT compiles fail"
                        if facts.flashinfer
                        else ""
                    ),
                    evidence=(f"JIT CUDA_HOME: {where}",),
                    fix=_matched_fixes(facts, torch_cuda),
                )
            )
        return out
    if home.error or not home.release:
        out.append(
            Finding(
                code="nvcc-broken",
                severity=ERROR,
                cause=f"{home.nvcc} --version failed: {home.error}",
                evidence=(f"JIT CUDA_HOME: {where}",),
                fix=("repair or replace that toolkit", *_matched_fixes(facts, torch_cuda)),
            )
        )
        return out
    release = home.release
    evidence = [f"JIT CUDA_HOME: {where} (nvcc {release})"]
    if facts.torch_version:
        evidence.append(f"torch {facts.torch_version} built for CUDA {torch_cuda}")
    if Path(home.path).name == "usr":
        evidence.append("a distro /usr/bin/nvcc makes FlashInfer and torch use /usr as CUDA_HOME")
    intent = sm12_intent(facts)
    # Versions another interpreter reported: one that cannot be read is not known, and the
    # rules that need it say nothing.
    jm = CudaVersion.read(release)
    if intent and jm is not None and jm < SM12_MIN_CUDA:
        torch_part = f" but torch is built for CUDA {torch_cuda}" if torch_cuda else ""
        out.append(
            Finding(
                code="sm12x-nvcc-too-old",
                severity=ERROR,
                cause=f"FlashInfer's JIT uses nvcc {release} (from {where}){torch_part}; "
                f"SM 12.x needs {SM12_MIN_CUDA}+",
                evidence=(
                    *evidence,
                    f"SM 12.x intent: {intent}",
                    'FlashInfer then logs "Failed to get device capability: SM 12.x requires '
                    'CUDA >= 12.9" and builds no kernel',
                ),
                fix=_matched_fixes(facts, torch_cuda or str(SM12_MIN_CUDA)),
            )
        )
    tm = CudaVersion.read(torch_cuda)
    if tm is not None and jm is not None and tm != jm:
        major = tm.major != jm.major
        out.append(
            Finding(
                code="jit-toolkit-mismatch",
                severity=ERROR if major else WARNING,
                cause=f"the JIT toolkit is CUDA {release} ({where}) but torch is built for CUDA "
                f"{torch_cuda}"
                + (
                    ": a major mismatch, torch's cpp_extension refuses it"
                    if major
                    else ": a minor mismatch (torch only warns; headers and runtime differ)"
                ),
                evidence=tuple(evidence),
                fix=_matched_fixes(facts, torch_cuda),
            )
        )
    return out


def sm12_intent(facts: Facts) -> str:
    """Why this env is meant for SM 12.x, if it is: a visible GPU, an arch list in its
    environment, the arch list it was built with (its manifest), or ``--archs``. The box that
    diagnoses it may have no GPU at all."""
    reasons = []
    if facts.manifest is not None and any(a.major == 12 for a in facts.manifest.archs):
        reasons.append(f"the env's arch list is {' '.join(archs.texts(facts.manifest.archs))}")
    if any(a.major == 12 for a in facts.target_archs):
        reasons.append(f"--archs {' '.join(archs.texts(facts.target_archs))}")
    for gpu in facts.gpus:
        if gpu.capability is not None and gpu.capability[0] == 12:
            reasons.append(f"GPU {gpu.index} {gpu.name} is SM {gpu.capability_text}")
    for var in variables.ARCH_LISTS:
        value = facts.env.get(var) or ""
        if any(arch.major == 12 for arch in archs.parse_lenient(value)):
            reasons.append(f"{var}={value}")
    return "; ".join(reasons)


def rule_wheels(facts: Facts) -> list[Finding]:
    """Mixed toolkit minors, more than one CUDA major, FlashInfer companions."""
    out: list[Finding] = []
    minors: dict[CudaVersion, list[str]] = {}
    for name in channels.CUDA_VERSIONED:
        if name in facts.dists:
            m = CudaVersion.read(facts.dists[name])
            if m is not None:
                minors.setdefault(m, []).append(f"{name} {facts.dists[name]}")
    if len(minors) > 1:
        want = facts.torch_cuda or str(max(minors, key=lambda k: len(minors[k])))
        pin = facts.dists.get("cuda-toolkit")
        out.append(
            Finding(
                code="mixed-toolkit-minors",
                severity=ERROR,
                cause=f"NVIDIA toolkit wheels of {len(minors)} CUDA minors are installed "
                f"({', '.join(str(m) for m in sorted(minors))}): nvcc and headers disagree "
                "(flashinfer#3493)",
                evidence=tuple(f"CUDA {m}: {', '.join(v)}" for m, v in sorted(minors.items())),
                fix=(
                    *((_adopt_fix(facts),) if _adopt_fix(facts) else ()),
                    "pin every component to torch's: `"
                    + install_command(
                        facts, "install", f"cuda-toolkit[nvcc,cudart,crt,nvvm,cccl]=={pin}"
                    )
                    + "`"
                    if pin
                    else f"reinstall the toolkit wheels of CUDA {want}",
                    "the cudaenv way: `cudaenv lock SPEC` refuses such a set; `cudaenv build SPEC`",
                ),
            )
        )
    split = policy.mixed_majors(facts.dists)
    if split is not None:
        majors: dict[int, list[str]] = {}
        for wheel in split.wheels:
            majors.setdefault(wheel.major, []).append(f"{wheel.name} {wheel.version}")
        torch_minor = CudaVersion.read(facts.torch_cuda)
        keep = torch_minor.major if torch_minor is not None else max(split.majors)
        drop = sorted(w.name for w in split.others(keep))
        out.append(
            Finding(
                code="multiple-cuda-majors",
                severity=ERROR,
                cause=f"CUDA {' and '.join(str(m) for m in split.majors)} wheels are installed "
                "together: two libcudart/libcublas generations in one process",
                evidence=tuple(
                    f"CUDA {m}: {', '.join(sorted(v))}" for m, v in sorted(majors.items())
                ),
                fix=(
                    install_command(facts, "uninstall", *drop),
                    "the cudaenv way: `cudaenv build SPEC` "
                    "(one CUDA major per env is a lock-time rule)",
                ),
            )
        )
    for found in policy.companion_mismatches(facts.dists):
        comp, comp_version, fi = found.companion, found.version, found.flashinfer
        out.append(
            Finding(
                code="flashinfer-companion-mismatch",
                severity=ERROR,
                cause=f"{comp} {comp_version} does not match flashinfer-python {fi or '(not installed)'}",
                evidence=(f"{comp} {comp_version}", f"flashinfer-python {fi}"),
                fix=(
                    install_command(facts, "install", f"{comp}=={fi}")
                    if fi
                    else install_command(facts, "uninstall", comp),
                ),
            )
        )
    return out


def rule_driver(facts: Facts) -> list[Finding]:
    if facts.driver is None:
        return [
            Finding(
                code="no-driver",
                severity=INFO,
                cause="no NVIDIA driver (/proc/driver/nvidia/version absent): kernels "
                "compile but cannot run here",
            )
        ]
    tm = CudaVersion.read(facts.torch_cuda)
    if tm is None or tm.major not in driver.MINIMUM_DRIVER:
        return []
    try:
        too_old = not driver.runs(facts.driver, tm)
        fits = driver.newest_cuda_major(facts.driver)
    except ValueError:  # the probe read a version that is not dotted numbers: no judgement
        return []
    if not too_old:
        return []
    need = driver.minimum_driver(tm)
    older = (
        f"or use a torch/spec built for CUDA {fits}.x, which this driver runs"
        if fits is not None
        else "or use a torch/spec built for an older CUDA"
    )
    return [
        Finding(
            code="driver-too-old",
            severity=ERROR,
            cause=f"driver {facts.driver} is too old for torch's CUDA {facts.torch_cuda}: "
            f"CUDA {tm.major}.x needs {need}+",
            evidence=(f"driver {facts.driver}", f"torch {facts.torch_version}"),
            fix=(
                f"install NVIDIA driver {need} or newer (or cuda-compat-{tm.major}-{tm.minor} "
                "on a datacenter GPU)",
                older,
            ),
        )
    ]


def rule_jit_cache(facts: Facts) -> list[Finding]:
    home = facts.jit_home
    out: list[Finding] = []
    if not facts.jit_entries:
        return out
    current = os.path.realpath(home.path) if home else None
    other_toolkit = [
        e
        for e in facts.jit_entries
        if e.version == facts.flashinfer
        and e.cuda_home
        and current
        and os.path.realpath(e.cuda_home) != current
    ]
    if other_toolkit:
        homes = sorted({str(e.cuda_home) for e in other_toolkit})
        version_dir = f"{facts.jit_root}/{facts.flashinfer}"
        out.append(
            Finding(
                code="stale-jit-cache",
                severity=ERROR,
                cause=f"FlashInfer's JIT cache holds {len(other_toolkit)} op(s) built with another "
                f"toolkit ({', '.join(homes)}) than the one it now uses ({home.path if home else '?'}); "
                "FlashInfer reuses them: the toolkit is not in its cache key (flashinfer#3229)",
                evidence=tuple(
                    f"{e.version}/{e.archs}/{e.op}: cuda_home={e.cuda_home}"
                    for e in other_toolkit[:8]
                ),
                fix=(
                    f"rm -rf {version_dir}",
                    "the cudaenv way: each env has its own cache "
                    "(FLASHINFER_WORKSPACE_BASE=ENV/var/flashinfer)",
                ),
            )
        )
    other_version = sorted({e.version for e in facts.jit_entries if e.version != facts.flashinfer})
    if other_version and facts.flashinfer:
        out.append(
            Finding(
                code="old-jit-cache",
                severity=WARNING,
                cause=f"FlashInfer's JIT cache holds builds of FlashInfer {', '.join(other_version)}, "
                f"not the installed {facts.flashinfer}: unused, only disk",
                evidence=(f"cache: {facts.jit_root}",),
                fix=tuple(f"rm -rf {facts.jit_root}/{v}" for v in other_version),
            )
        )
    return out


def rule_host_compiler(facts: Facts) -> list[Finding]:
    home = facts.jit_home
    if not home or not home.release or home.max_gcc is None or facts.gcc_major is None:
        return []
    if facts.gcc_major > home.max_gcc:
        return [
            Finding(
                code="host-compiler-unsupported",
                severity=ERROR,
                cause=f"nvcc {home.release} accepts GCC up to {home.max_gcc} (its crt/host_config.h) "
                f"but the host compiler is GCC {facts.gcc_major} ({facts.cxx})",
                evidence=(facts.cxx_banner,),
                fix=(
                    f"install g++-{home.max_gcc} and `export NVCC_PREPEND_FLAGS='-ccbin "
                    f"g++-{home.max_gcc}'`",
                    "or use a newer CUDA whose nvcc accepts it",
                ),
            )
        ]
    return []


def rule_glibc(facts: Facts) -> list[Finding]:
    home = facts.jit_home
    try:
        glibc = Version(facts.glibc) if facts.glibc else None
    except InvalidVersion:
        glibc = None
    release = CudaVersion.read(home.release) if home else None
    if (
        glibc
        and glibc >= Version("2.42")
        and release is not None
        and release < CudaVersion(major=13, minor=2)
    ):
        return [
            Finding(
                code="glibc-too-new-for-cuda",
                severity=ERROR,
                cause=f"glibc {facts.glibc} declares math functions (rsqrt, sinpi, ...) that CUDA "
                f"{home.release if home else ''} headers redeclare: nvcc fails with "
                "'exception specification is incompatible'; CUDA 13.2+ fixed it",
                evidence=(f"glibc {facts.glibc}", f"nvcc {home.release if home else ''}"),
                fix=('use CUDA 13.2 or newer (a spec with cuda: "13.2", torch 2.15)',),
            )
        ]
    return []


def rule_gpu_archs(facts: Facts) -> list[Finding]:
    """A visible GPU no arch of the env's list runs on. A GPU whose capability is unknown is
    not reported: nothing says it is missing."""
    built = facts.manifest
    if built is None:
        return []
    missing = [gpu for gpu in facts.gpus if archs.uncovered(built.archs, gpu)]
    if not missing:
        return []
    first = missing[0]
    return [
        Finding(
            code="gpu-arch-missing",
            severity=WARNING,
            cause=f"GPU {first.name} (SM {first.capability_text}) is not in this env's arch "
            f"list ({archs.flashinfer_spelling(built.archs)}): FlashInfer would build no "
            "kernel for it",
            # Spelled as FlashInfer would target it with the env's nvcc.
            evidence=tuple(
                f"GPU {g.index} {g.name}: {g.arch(CudaVersion.read(built.nvcc))}" for g in missing
            ),
            fix=(f"rebuild so the arch list picks it up: `cudaenv build {built.spec}`",),
        )
    ]


def rule_no_host_compiler(facts: Facts) -> list[Finding]:
    """nvcc hands every host-side file to a C++ compiler: without one no JIT build works."""
    wants_jit = facts.flashinfer or facts.torch_installed or facts.jit_home is not None
    probed = "host_compiler" not in facts.errors  # a crashed step is rule_probe's finding
    if not wants_jit or not probed or (facts.cxx is not None and facts.cxx_error is None):
        return []
    what = (
        f"the host C++ compiler {facts.cxx} does not run ({facts.cxx_error})"
        if facts.cxx
        else f"no host C++ compiler ({facts.cxx_error or 'none found'})"
    )
    return [
        Finding(
            code="no-host-compiler",
            severity=ERROR,
            cause=f"{what}: nvcc needs one, so every JIT compile (FlashInfer, torch "
            "cpp_extension) fails",
            evidence=(f"CXX={facts.env.get('CXX') or '(unset)'}",),
            fix=(
                "install a C++ compiler: `apt-get install g++` (or your distro's equivalent)",
                "or point at one: `export CXX=/path/to/g++` or "
                "`export NVCC_PREPEND_FLAGS='-ccbin /path/to/g++'`",
            ),
        )
    ]


def rule_probe(facts: Facts) -> list[Finding]:
    out = [
        Finding(
            code="probe-failed",
            severity=ERROR,
            cause=f"probing {step} failed: {error}",
            fix=("reinstall the package named in the error",),
        )
        for step, error in sorted(facts.errors.items())
    ]
    if facts.deep:
        for key in ("torch", "flashinfer"):
            part = facts.deep.get(key)
            if isinstance(part, dict) and part.get("error") and part.get("installed") is not False:
                out.append(
                    Finding(
                        code=f"{key}-import-failed",
                        severity=ERROR,
                        cause=f"import {key} failed: {part['error']}",
                        fix=(f"reinstall {key} in this env",),
                    )
                )
    return out


def rule_caches(facts: Facts) -> list[Finding]:
    """A cudaenv env keeps every JIT cache in its own var/ and Triton's tools at its own
    binaries; a cache elsewhere is shared with envs of other toolkits (flashinfer#5145)."""
    if facts.manifest is None or not facts.prefix:
        return []
    # Only the variables the probe was asked for: a probe of an older cudaenv reports none.
    if not any(v in facts.env for v in caches.VARIABLES):
        return []
    wrong = caches.outside_env(facts.prefix, facts.env)
    if not wrong:
        return []
    return [
        Finding(
            code="cache-outside-env",
            severity=WARNING,
            cause=f"{len(wrong)} JIT cache setting(s) of this env point outside it: compiled "
            "results are shared with envs of other toolkits and can be reused stale "
            "(flashinfer#5145)",
            evidence=tuple(wrong),
            fix=(
                _adopt_fix(facts)
                or f"rebuild the env so its hook sets them: cudaenv build {facts.manifest.spec} "
                "--force",
                "or remove the override from the spec's `env:` / the code that sets it",
            ),
        )
    ]


def rule_activation(facts: Facts) -> list[Finding]:
    """Every shell's activation script of a cudaenv env carries its settings. bin/activate
    holding the block shows the env was wired; another shell's script without it (an env
    built before cudaenv patched that shell, or a script added since) activates with whatever
    CUDA_HOME the shell had."""
    if facts.manifest is None or not facts.prefix:
        return []
    # Here, not at the top: toolchain brings the spec loader and YAML (~30 ms) that a doctor
    # run needs only for a cudaenv env.
    from builder.toolchain import ACTIVATIONS, BLOCK_MARK

    bin_dir = Path(facts.prefix) / "bin"

    def marked(name: str) -> bool | None:
        try:
            return BLOCK_MARK in (bin_dir / name).read_text(errors="replace")
        except OSError:
            return None  # the env has no such script

    if not marked("activate"):
        return []
    bare = [name for name, _, _ in ACTIVATIONS if marked(name) is False]
    if not bare:
        return []
    return [
        Finding(
            code="activation-unwired",
            severity=WARNING,
            cause=f"{len(bare)} shell activation script(s) of this env lack its CUDA settings: "
            "a shell activated with them keeps its own CUDA_HOME and PATH (the Python hook "
            "still applies to the env's interpreter)",
            evidence=tuple(f"bin/{name}" for name in bare),
            fix=(
                _adopt_fix(facts)
                or f"rebuild the env: cudaenv build {facts.manifest.spec} --force",
            ),
        )
    ]


def rule_drift(facts: Facts) -> list[Finding]:
    """A built env holds exactly its lock: a package added, removed or changed since (a
    `uv pip install` into it, say) is named, with how to make it part of the spec."""
    built = facts.manifest
    if built is None or built.spec == manifest.ADOPTED_SPEC or not facts.dists:
        return []
    locked = {canonicalize_name(n): v for n, v in built.packages}
    now = {canonicalize_name(n): v for n, v in facts.dists.items()}
    added = sorted(f"{n}=={v}" for n, v in now.items() if n not in locked)
    removed = sorted(f"{n}=={v}" for n, v in locked.items() if n not in now)
    changed = sorted(
        f"{n} {locked[n]} -> {v}" for n, v in now.items() if n in locked and locked[n] != v
    )
    if not (added or removed or changed):
        return []
    evidence = [*(f"added {a}" for a in added), *(f"removed {r}" for r in removed),
                *(f"changed {c}" for c in changed)]  # fmt: skip
    return [
        Finding(
            code="env-drift",
            severity=WARNING,
            cause=f"this env no longer holds exactly its lock: {len(added)} added, "
            f"{len(removed)} removed, {len(changed)} changed since it was built",
            evidence=tuple(evidence[:20]),
            fix=(
                f"put what you need in `packages:` of {built.spec}, then `cudaenv build "
                f"{built.spec} --force` (re-locks and rebuilds exactly)",
            ),
        )
    ]


RULES: tuple[Callable[[Facts], list[Finding]], ...] = (
    rule_probe,
    rule_nvcc,
    rule_wheels,
    rule_driver,
    rule_jit_cache,
    rule_caches,
    rule_activation,
    rule_drift,
    rule_host_compiler,
    rule_no_host_compiler,
    rule_glibc,
    rule_gpu_archs,
)
ROOT_FIRST = (
    "probe-failed",
    "torch-import-failed",
    "flashinfer-import-failed",
    "sm12x-nvcc-too-old",
    "nvcc-broken",
    "no-nvcc",
    "jit-toolkit-mismatch",
    "glibc-too-new-for-cuda",
    "no-host-compiler",
    "host-compiler-unsupported",
    "mixed-toolkit-minors",
    "multiple-cuda-majors",
    "flashinfer-companion-mismatch",
    "driver-too-old",
    "stale-jit-cache",
    "cache-outside-env",
    "activation-unwired",
    "env-drift",
    "gpu-arch-missing",
    "old-jit-cache",
    "no-driver",
    "rule-crashed",  # a doctor bug, not the env's: after every finding about the env
)
# root -> the symptoms it explains (grouped under it when both fire).
EXPLAINS = {
    "sm12x-nvcc-too-old": ("jit-toolkit-mismatch",),
    "nvcc-broken": ("jit-toolkit-mismatch",),
    "mixed-toolkit-minors": ("jit-toolkit-mismatch",),
}


def _apply(rule: Callable[[Facts], list[Finding]], facts: Facts) -> list[Finding]:
    """One rule; a rule that raises becomes a Finding so the others still report."""
    try:
        return rule(facts)
    except Exception as exc:  # any bug in one rule must not hide the other findings
        return [
            Finding(
                code="rule-crashed",
                severity=ERROR,
                cause=f"the doctor's rule {rule.__name__} crashed: {type(exc).__name__}: {exc}",
                fix=(
                    "the findings above are still valid; report this cudaenv bug with the "
                    "output of `cudaenv doctor --json`",
                ),
            )
        ]


def diagnose(facts: Facts) -> list[Finding]:
    found = [f for rule in RULES for f in _apply(rule, facts)]
    by_code = {f.code: f for f in found}
    grouped: list[Finding] = []
    absorbed: set[str] = set()
    for f in found:
        for code in EXPLAINS.get(f.code, ()):
            if code in by_code and code not in absorbed:
                absorbed.add(code)
                f = replace(f, symptoms=(*f.symptoms, by_code[code]))
        grouped.append(f)
    grouped = [f for f in grouped if f.code not in absorbed]
    rank = {code: i for i, code in enumerate(ROOT_FIRST)}
    return sorted(grouped, key=lambda f: (SEVERITY_ORDER[f.severity], rank.get(f.code, 99)))


# --------------------------------------------------------------------------- running


def default_python() -> str:
    venv = os.environ.get("VIRTUAL_ENV")
    if venv and (Path(venv) / "bin" / "python").exists():
        return str(Path(venv) / "bin" / "python")
    return proc.which("python3") or "python3"


def _probe_failed(cause: str, *fix: str) -> Finding:
    return Finding(code="probe-failed", severity=ERROR, cause=cause, fix=fix)


def probe(
    python: Path | str, *, deep: bool, target_archs: Sequence[archs.Arch] = ()
) -> tuple[Facts | None, list[Finding], float]:
    """Run the probe; a probe that cannot run becomes a Finding, not a traceback."""
    # Run by path: the probe imports its sibling flashinfer_light.py (sys.path[0] is its dir).
    script = str(resources.files("builder.probe").joinpath("doctor_probe.py"))
    started = time.monotonic()
    argv = [
        os.fspath(python),
        script,
        # What to report: the probe imports nothing of cudaenv.
        variables.probe_arg(variables.DOCTOR_PROBE),
        *(["--deep"] if deep else []),
    ]
    try:
        done = proc.run(argv, check=False, timeout=DEEP_TIMEOUT if deep else PROBE_TIMEOUT)
    except proc.CommandFailed as exc:
        limit = f"{exc.timed_out:g} s" if exc.timed_out is not None else "time"
        return None, [_probe_failed(f"the probe did not finish in {limit}", HANG_FIX)], 0.0
    except CudaenvError as exc:
        return None, [_probe_failed(str(exc), PYTHON_FIX)], 0.0
    except OSError as exc:
        # proc.run maps only FileNotFoundError: a file without the exec bit (PermissionError),
        # a directory or an unknown binary format (ENOEXEC) arrive here.
        cause = f"{os.fspath(python)} cannot be run: {exc.strerror or exc}"
        return None, [_probe_failed(cause, PYTHON_FIX)], 0.0
    line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    try:
        doc = json.loads(line)
        prefix = str(doc["python"]["prefix"])
    except (ValueError, KeyError, TypeError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        cause = (
            f"{os.fspath(python)} could not run the probe (exit {done.returncode}): "
            + " | ".join(tail)
        )
        return None, [_probe_failed(cause, PYTHON_FIX)], time.monotonic() - started
    # GPUs are listed here, in cudaenv, by the one query every command uses (archs.py).
    gpus, gpus_note = archs.visible_gpus()
    built = manifest.try_read(Path(prefix)) if prefix else None
    facts = Facts.from_json(doc, built, gpus=gpus, gpus_note=gpus_note, target_archs=target_archs)
    return facts, diagnose(facts), time.monotonic() - started


def facts_table(facts: Facts) -> list[tuple[str, str]]:
    rows = [
        ("python", f"{facts.python_version} ({facts.python})"),
        ("glibc", facts.glibc or "?"),
        (
            "torch",
            f"{facts.torch_version} (CUDA {facts.torch_cuda})"
            if facts.torch_version
            else "not installed",
        ),
        ("flashinfer", facts.flashinfer or "not installed"),
        ("sglang", facts.dists.get("sglang", "not installed")),
        ("cuda-toolkit", facts.dists.get("cuda-toolkit", "-")),
    ]
    for i, home in enumerate(facts.cuda_homes):
        state = home.release or home.error or ("no nvcc" if not home.exists else "?")
        rows.append(
            (
                ("JIT CUDA_HOME" if i == 0 else "  candidate"),
                f"{home.path} [{home.source}] nvcc {state}",
            )
        )
    if not facts.cuda_homes:
        rows.append(("JIT CUDA_HOME", "none"))
    for var in (*variables.ARCH_LISTS, "LD_LIBRARY_PATH"):
        rows.append((var, facts.env.get(var) or "(unset)"))
    shell = facts.env.get("CUDAENV_SHELL_CUDA_HOME")
    if shell is not None:
        rows.append(("shell CUDA_HOME", (shell or "(unset)") + " (overridden by this env's hook)"))
    rows.append(("driver", facts.driver or "no driver"))
    for gpu in facts.gpus:
        rows.append((f"GPU {gpu.index}", f"{gpu.name} SM {gpu.capability_text}"))
    rows.append(("JIT cache", f"{facts.jit_root} ({len(facts.jit_entries)} op(s))"))
    for cache in caches.CACHES:
        if cache.variable in facts.env:
            rows.append(
                (
                    f"  {cache.variable}",
                    facts.env.get(cache.variable) or f"(unset: {cache.owner}'s default)",
                )
            )
    for variable, _tool in caches.TRITON_TOOLS:
        if facts.env.get(variable):
            rows.append((f"  {variable}", str(facts.env[variable])))
    rows.append(("host C++", facts.cxx_banner or "none"))
    nv = sorted(
        f"{k}=={v}"
        for k, v in facts.dists.items()
        if k.startswith("nvidia-cuda") or k == "nvidia-nvvm"
    )
    rows.append(("toolkit wheels", ", ".join(nv) or "none"))
    if facts.deep:
        fi = facts.deep.get("flashinfer")
        if isinstance(fi, dict) and "cuda_version" in fi:
            rows.append(
                (
                    "FlashInfer sees",
                    f"get_cuda_path()={fi.get('cuda_path')} get_cuda_version()={fi['cuda_version']}",
                )
            )
        t = facts.deep.get("torch")
        if isinstance(t, dict) and "version" in t:
            rows.append(
                (
                    "torch.cuda",
                    f"available={t.get('available')} {t.get('capabilities') or t.get('cuda_error') or ''}",
                )
            )
    return rows


def render(python: Path | str, facts: Facts | None, findings: Sequence[Finding]) -> str:
    lines: list[str] = []
    errors = [f for f in findings if f.severity == ERROR]
    if findings and findings[0].severity != INFO:
        lines.append(findings[0].cause)
    else:
        lines.append(f"healthy: no error or warning for {os.fspath(python)}")
    for f in findings:
        lines.append("")
        lines.append(f"[{f.severity}] {f.code}: {f.cause}")
        for e in f.evidence:
            lines.append(f"    evidence: {e}")
        for fix in f.fix:
            lines.append(f"    fix: {fix}")
        for s in f.symptoms:
            lines.append(f"    explains [{s.severity}] {s.code}: {s.cause}")
    if facts is not None:
        lines.append("")
        rows = facts_table(facts)
        width = max(len(k) for k, _ in rows)
        lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("")
    lines.append(
        f"{len(errors)} error(s), {sum(f.severity == WARNING for f in findings)} warning(s)"
    )
    return "\n".join(lines)


def to_json(
    python: Path | str, facts: Facts | None, findings: Sequence[Finding], seconds: float
) -> dict[str, Any]:
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "python": os.fspath(python),
        "healthy": not any(f.severity == ERROR for f in findings),
        "findings": [f.to_json() for f in findings],
        "facts": facts.to_json() if facts is not None else None,
        "seconds": round(seconds, 3),
    }
