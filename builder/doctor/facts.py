"""What the doctor knows about an interpreter: the probe's facts (:class:`Facts`) and the
findings the rules draw from them (:class:`Finding`, with its severity), as ``doctor --json``
writes them.

The facts come from ``builder/probe/doctor_probe.py`` run inside the target interpreter
(standard library only); :meth:`Facts.from_json` reads its JSON, in which every key may be
missing, and adds what cudaenv itself knows (the env's manifest, the visible GPUs).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from builder.core.remote_cache import Answer
from builder.env.manifest import Manifest
from builder.formats import codec
from builder.machine import archs

Severity = Literal["error", "warning", "info"]
ERROR: Final = "error"
WARNING: Final = "warning"
INFO: Final = "info"
SEVERITY_ORDER: dict[Severity, int] = {ERROR: 0, WARNING: 1, INFO: 2}


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
        return codec.to_json(self)


@dataclass(frozen=True, kw_only=True)
class JitEntry:
    version: str
    archs: str
    op: str
    cuda_home: str | None

    def to_json(self) -> dict[str, Any]:
        return codec.to_json(self)


@dataclass(frozen=True, kw_only=True)
class LastVerify:
    """What the env's own last verify report (``var/cudaenv/verify.json``) says."""

    path: str
    created: str
    failed: tuple[tuple[str, str], ...]  # each failed check: its name and summary
    # Of the env as it stands: the report's lock hash is the manifest's (a rebuild since
    # leaves the report of another env).
    current: bool

    def to_json(self) -> dict[str, Any]:
        return codec.to_json(self)


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
    driver: str | None  # its version, read by machine/driver.py (doctor.diagnose)
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
    # Where the driver was read, and the newest CUDA it runs where only libcuda answered
    # (it gives no version).
    driver_source: str = ""
    driver_cuda: str | None = None
    # The Redis cache this interpreter's Triton and Inductor are to share (its URL without the
    # password) and what it said to PING, asked by cudaenv (doctor.probe); None: none named.
    remote_cache: str | None = None
    remote_answer: Answer | None = None
    # The env's last verify, as its report says (doctor.probe); None: none there.
    last_verify: LastVerify | None = None
    # What the env's index answered for the exact requirements a fix would install
    # (doctor.probe asks it, with the installer the fix names): True it holds it, False it
    # does not, absent when it could not be asked (offline). A fix names only what is there.
    index_holds: tuple[tuple[str, bool], ...] = ()

    def index_has(self, requirement: str) -> bool | None:
        return dict(self.index_holds).get(requirement)

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
            cuda_homes=_homes(doc.get("cuda_homes")),
            toolkits=_homes(doc.get("toolkits")),
            driver=None if drv.get("version") is None else str(drv["version"]),
            driver_source=str(drv.get("source") or ""),
            driver_cuda=None if drv.get("cuda") is None else str(drv["cuda"]),
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
            "driver_source": self.driver_source or None,
            "driver_cuda": self.driver_cuda,
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
            "remote_cache": None
            if self.remote_cache is None
            else {
                "url": self.remote_cache,
                "status": self.remote_answer.status if self.remote_answer else None,
                "detail": self.remote_answer.detail if self.remote_answer else None,
            },
            "last_verify": None if self.last_verify is None else self.last_verify.to_json(),
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
        return codec.to_json(self)

    def commands(self) -> tuple[str, ...]:
        """The commands the fix prints, as a user copies them: each backticked span of a
        line, or a line that is one command whole (``rm -rf ...``, ``uv pip ...``). The rest
        of a fix is prose. Every command a rule prints is run by a test
        (tests/test_doctor_fixes.py reads which from the rule modules)."""
        out: list[str] = []
        for line in self.fix:
            spans = _BACKTICKED.findall(line)
            out += spans or ([line] if _WHOLE_COMMAND.match(line) else [])
        return tuple(out)


# What a fix line holds of a command: a backticked span, or the whole line where it starts
# with a program a fix names.
_BACKTICKED = re.compile(r"`([^`]+)`")
_WHOLE_COMMAND = re.compile(r"(rm|uv|export|unset|cudaenv|pip|python[0-9.]*) ")


def _homes(items: Any) -> tuple[CudaHome, ...]:
    """The probe's list of CUDA homes (each key may be missing), as CudaHome values."""
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
