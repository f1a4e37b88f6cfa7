"""What verification speaks of: the :class:`Target` verified, the :class:`EnvFacts` the probe
reported, the :class:`CheckResult` each check returns, and the environment a check runs its
commands with (:func:`env_of`).

Every check imports this module, and the package's run loop (``builder/verify/__init__.py``)
imports the checks: the model sits below both, so no check imports the package.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.core import settings
from builder.core.cudaversion import CudaVersion
from builder.core.paths import jit_store_dir
from builder.core.statuses import CHECK_STATUSES, CheckStatus
from builder.formats.jsondoc import Reader
from builder.machine import box
from builder.machine.archs import Arch, flashinfer_spelling


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    name: str
    status: CheckStatus
    summary: str
    evidence: tuple[tuple[str, str], ...] = ()
    seconds: float = 0.0
    fix: str = ""
    # A tool the check needs is missing (no host compiler): verify then exits with
    # ToolMissing's code, not VerifyFailed's: the env is not wrong, the machine lacks a tool.
    missing_tool: str | None = None
    # What the user should hear of that is not the verdict (the JIT store could not be used,
    # an entry was discarded): printed as warnings.
    warnings: tuple[str, ...] = ()
    # When the check started, in seconds after its verify's run began (the checks of one
    # verify overlap where their inputs allow: builder/verify/__init__.py); None for one that
    # was not run. Its end is ``started + seconds``.
    started: float | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "status": self.status,
            "summary": self.summary,
            "evidence": dict(self.evidence),
            "seconds": round(self.seconds, 3),
            "fix": self.fix,
            "missing_tool": self.missing_tool,
            "warnings": list(self.warnings),
        }
        if self.started is not None:
            doc["started"] = round(self.started, 3)
            doc["ended"] = round(self.started + self.seconds, 3)
        return doc

    @classmethod
    def from_json(cls, r: Reader) -> CheckResult:
        evidence = r.raw_map("evidence")
        return cls(
            name=r.text("name"),
            status=r.choice("status", CHECK_STATUSES),
            summary=r.text("summary"),
            evidence=tuple((str(k), str(v)) for k, v in evidence.items()),
            seconds=r.num("seconds", 0.0),
            fix=r.opt_text("fix") or "",
            missing_tool=r.opt_text("missing_tool"),
            warnings=r.texts("warnings", required=False),
            started=r.opt_num("started"),
        )


@dataclass(frozen=True, kw_only=True)
class Target:
    """What is verified: an interpreter, its env dir when cudaenv built it, the archs."""

    python: Path
    archs: tuple[Arch, ...]
    work: Path  # where checks write their builds (the env's var/cudaenv, or a cache dir)
    env_dir: Path | None = None
    expected_cuda: str | None = None
    spec_name: str | None = None
    # The spec file as the user named it: what a fix tells them to run (`cudaenv build PATH`).
    spec_path: str | None = None
    checks: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()
    fresh: bool = False  # rebuild what a check would reuse (`verify --fresh`)
    # The JIT store's registry tier named by the project ([tool.cudaenv] jit-remote).
    jit_remote: str | None = None
    # The spec's requirements (torch first where it pins one) the `imports` check imports;
    # None for an interpreter verified without a spec (the usual stack, where installed).
    packages: tuple[str, ...] | None = None
    # Run every asked check even after a cheap one failed (`--keep-going`).
    keep_going: bool = False


@dataclass(frozen=True, kw_only=True)
class StoreUse:
    """What the JIT store did for the probe's build of the sampling module (its
    ``flashinfer.jit.store``): placed an entry (``hit``), kept the result (``kept``), or was
    not used, with the notes it made on the way."""

    used: bool = False
    hit: bool = False
    kept: bool = False
    key: str | None = None  # the entry's key, shortened
    first_built: str | None = None  # a hit: when and for which env the entry was made
    env: str | None = None
    warnings: tuple[str, ...] = ()
    entry: str | None = None  # the entry placed or kept, ``v3/ab/KEY/VARIANT`` in the store

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StoreUse:
        def opt(key: str) -> str | None:
            v = doc.get(key)
            return None if v is None else str(v)

        told = doc.get("warnings")
        return cls(
            used=bool(doc.get("used")),
            hit=bool(doc.get("hit")),
            kept=bool(doc.get("kept")),
            key=opt("key"),
            first_built=opt("first_built"),
            env=opt("env"),
            warnings=tuple(str(w) for w in told) if isinstance(told, list) else (),
            entry=opt("entry"),
        )


@dataclass(frozen=True, kw_only=True)
class JitBuild:
    """FlashInfer's JIT build of its sampling module in the probe (``flashinfer.jit``): the
    library made, or the error; what ninja ran (``reused`` only where it ran nothing)."""

    seconds: float = 0.0
    error: str | None = None  # present (maybe empty) where the build failed
    library: str | None = None
    reused: bool = False
    ran: tuple[str, ...] = ()
    store: StoreUse | None = None

    @classmethod
    def from_json(cls, doc: object) -> JitBuild:
        """The probe's ``jit`` object; anything else is a build that said nothing."""
        if not isinstance(doc, Mapping):
            return cls()
        ran, store = doc.get("ran"), doc.get("store")
        return cls(
            seconds=float(doc.get("seconds", 0.0) or 0.0),
            error=None if "error" not in doc else str(doc["error"] or ""),
            library=None if doc.get("library") is None else str(doc["library"]),
            reused=doc.get("reused") is True,
            ran=tuple(str(r) for r in ran) if isinstance(ran, list) else (),
            store=StoreUse.from_json(store) if isinstance(store, Mapping) else None,
        )


@dataclass(frozen=True, kw_only=True)
class EnvFacts:
    """The probe's JSON, parsed once at this edge."""

    python: str
    python_version: str
    cuda_home: str
    env: Mapping[str, str | None]
    nvcc_release: str | None
    nvcc_path: str
    nvcc_error: str | None
    cudart_version: str | None
    cudart_error: str | None
    torch_installed: bool
    torch_version: str | None
    torch_cuda: str | None
    torch_error: str | None
    flashinfer_installed: bool
    flashinfer_version: str | None
    flashinfer_cuda_path: str | None
    flashinfer_cuda_version: str | None
    flashinfer_error: str | None
    flashinfer_import: str | None = None
    jit: JitBuild = field(default_factory=JitBuild)
    # The interpreter's whole environment after its start-up hook: what every check runs with.
    environ: Mapping[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    # Where CUDA_HOME came from, in the JIT compilers' lookup order ($CUDA_HOME, $CUDA_PATH,
    # `which nvcc`, /usr/local/cuda): the same answer doctor gives.
    cuda_home_source: str = ""

    @property
    def nvcc_cuda(self) -> CudaVersion | None:
        """The CUDA of CUDA_HOME's nvcc, None when there is no working one. The probe reports
        the ``X.Y`` of nvcc's "release X.Y", so anything else is refused (ValueError)."""
        return None if self.nvcc_release is None else CudaVersion.parse(self.nvcc_release)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], seconds: float) -> EnvFacts:
        def sub(key: str) -> Mapping[str, Any]:
            value = doc.get(key)
            return value if isinstance(value, dict) else {}

        nvcc, cudart, torch, fi = sub("nvcc"), sub("cudart"), sub("torch"), sub("flashinfer")

        def opt(m: Mapping[str, Any], key: str) -> str | None:
            v = m.get(key)
            return None if v is None else str(v)

        return cls(
            python=str(doc.get("python", "")),
            python_version=str(doc.get("python_version", "")),
            cuda_home=str(doc.get("cuda_home", "")),
            cuda_home_source=str(doc.get("cuda_home_source") or ""),
            env={str(k): (None if v is None else str(v)) for k, v in sub("env").items()},
            nvcc_release=opt(nvcc, "release"),
            nvcc_path=str(nvcc.get("path", "")),
            nvcc_error=opt(nvcc, "error"),
            cudart_version=opt(cudart, "version"),
            cudart_error=opt(cudart, "error"),
            torch_installed=bool(torch.get("installed")),
            torch_version=opt(torch, "version"),
            torch_cuda=opt(torch, "cuda"),
            torch_error=opt(torch, "error") if torch.get("installed") else None,
            flashinfer_installed=bool(fi.get("installed")),
            flashinfer_version=opt(fi, "version"),
            flashinfer_cuda_path=opt(fi, "cuda_path"),
            flashinfer_cuda_version=opt(fi, "cuda_version"),
            flashinfer_error=opt(fi, "error") if fi.get("installed") else None,
            flashinfer_import=opt(fi, "import"),
            jit=JitBuild.from_json(fi.get("jit")),
            environ={str(k): str(v) for k, v in sub("environ").items()},
            seconds=seconds,
        )


def target_env(target: Target) -> dict[str, str]:
    """The environment the probe starts with: ours plus the target's overrides, and where the
    JIT store is (none with ``--fresh``: everything is compiled again)."""
    env = settings.child_environ(CUDAENV_JIT_SHARE=None)
    env.update(dict(target.extra_env))
    # ninja's jobs for FlashInfer's build of the target's archs, within the cores and memory.
    env = box.compile_environ(flashinfer_spelling(target.archs), env)
    store = jit_store_dir()
    env["CUDAENV_JIT_STORE"] = "off" if target.fresh or store is None else str(store)
    # Resolved once, where the target was made (CUDAENV_JIT_REMOTE, else the project's).
    remote = target.jit_remote
    if remote and remote != "off" and store is not None and not target.fresh:
        # The probe runs in the env's interpreter, which has no registry client: it asks
        # this interpreter (builder/jit/share.py) to pull or push.
        env["CUDAENV_JIT_REMOTE"] = remote
        env["CUDAENV_JIT_SHARE"] = json.dumps([sys.executable, "-m", "builder.jit.share"])
    return env


def env_of(target: Target, facts: EnvFacts) -> dict[str, str]:
    """What a check runs its commands with: the env's own environment as its interpreter
    reported it (hook applied, spec variables set), or ours when the probe said nothing."""
    return dict(facts.environ) if facts.environ else target_env(target)
