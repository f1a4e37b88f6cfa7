"""Verification: one module per check, each returning a :class:`CheckResult`.

A check that cannot run says ``skipped`` with its reason; it never says ``passed``.
The facts every check reads come from one run of ``builder/probe/env_facts.py`` inside the
target interpreter (FlashInfer's import, ~7 s, is paid once). That run also reports the
interpreter's whole environment as its start-up hook left it, and every command a check
runs (nvcc, cuobjdump, the sampling kernels) gets exactly that environment: a check proves
the env as its users meet it, with the spec's own variables (``NVCC_APPEND_FLAGS``, ...).

How to add a check: write ``builder/verify/NAME.py`` with ``check(target, facts) ->
CheckResult``, add it to :data:`CHECKS` below (order = run order) and to :data:`STAGES`,
and give it a test that shows it failing on a broken input. ``spec.CHECKS`` (what a spec's
``verify:`` may name) is this tuple's names; a test keeps them equal.

The checks run cheapest first, whatever order a spec lists them in: those that only read the
env (seconds), then those that compile (FlashInfer's JIT: minutes), then those that need a
GPU. A check that fails stops every later stage (its checks say ``skipped``, "not run: X
failed"): an env whose packages do not import is not worth ten minutes of JIT. ``--keep-going``
runs them anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Final, Literal, get_args

from builder import proc, variables
from builder.archs import Arch
from builder.cudaversion import CudaVersion
from builder.errors import ToolMissing, UsageError, VerifyFailed
from builder.jsondoc import Reader
from builder.paths import jit_store_dir

log = logging.getLogger("cudaenv")

# What a check comes to; a report file holding anything else is refused on read.
CheckStatus = Literal["passed", "failed", "skipped"]
CHECK_STATUSES: tuple[CheckStatus, ...] = get_args(CheckStatus)
PASSED: Final = "passed"
FAILED: Final = "failed"
SKIPPED: Final = "skipped"


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

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "summary": self.summary,
            "evidence": dict(self.evidence),
            "seconds": round(self.seconds, 3),
            "fix": self.fix,
            "missing_tool": self.missing_tool,
            "warnings": list(self.warnings),
        }

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
    jit: Mapping[str, Any] = field(default_factory=dict)
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

        jit = fi.get("jit")
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
            jit=jit if isinstance(jit, dict) else {},
            environ={str(k): str(v) for k, v in sub("environ").items()},
            seconds=seconds,
        )


def target_env(target: Target) -> dict[str, str]:
    """The environment the probe starts with: ours plus the target's overrides, and where the
    JIT store is (none with ``--fresh``: everything is compiled again)."""
    env = dict(os.environ)
    env.update(dict(target.extra_env))
    store = jit_store_dir()
    env["CUDAENV_JIT_STORE"] = "off" if target.fresh or store is None else str(store)
    remote = os.environ.get("CUDAENV_JIT_REMOTE") or target.jit_remote
    env.pop("CUDAENV_JIT_SHARE", None)
    if remote and remote != "off" and store is not None and not target.fresh:
        # The probe runs in the env's interpreter, which has no registry client: it asks
        # this interpreter (builder/jit_share.py) to pull or push.
        env["CUDAENV_JIT_REMOTE"] = remote
        env["CUDAENV_JIT_SHARE"] = json.dumps([sys.executable, "-m", "builder.jit_share"])
    return env


def env_of(target: Target, facts: EnvFacts) -> dict[str, str]:
    """What a check runs its commands with: the env's own environment as its interpreter
    reported it (hook applied, spec variables set), or ours when the probe said nothing."""
    return dict(facts.environ) if facts.environ else target_env(target)


def probe(target: Target, *, jit: bool) -> EnvFacts:
    # Run by path: the probe imports its sibling flashinfer_light.py (sys.path[0] is its dir).
    script = str(resources.files("builder.probe").joinpath("env_facts.py"))
    started = time.monotonic()
    # The variables to report (builder/variables.py): the probe imports nothing of cudaenv.
    argv: list[str | os.PathLike[str]] = [
        target.python,
        script,
        variables.probe_arg(variables.VERIFY_PROBE),
    ]
    if jit:
        argv.append("--jit")
    try:
        done = proc.run(argv, env=target_env(target), timeout=3600)
    except proc.CommandFailed as exc:
        raise VerifyFailed(f"{target.python}: the env probe failed:\n{exc.output[-3000:]}") from exc
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "{}"
    try:
        doc = json.loads(last)
    except ValueError as exc:
        raise VerifyFailed(
            f"{target.python}: the env probe printed no JSON: {last[:300]!r}"
        ) from exc
    return EnvFacts.from_json(doc, time.monotonic() - started)


Check = Callable[[Target, EnvFacts], CheckResult]


# Every check, in run order (what `--checks` and a spec's `verify:` may name): cheapest first.
CHECKS = (
    "imports",
    "toolchain",
    "binaries",
    "kernel-compile",
    "flashinfer-jit",
    "cubin",
    "sampling",
)

# Each check's cost class: a failure in one stage leaves the later stages not run.
READS: Final = "reads the env"
COMPILES: Final = "compiles"
ON_GPU: Final = "runs on the GPU"
STAGES: Final[dict[str, str]] = {
    "imports": READS,
    "toolchain": READS,
    "binaries": READS,
    "kernel-compile": COMPILES,
    "flashinfer-jit": COMPILES,
    "cubin": COMPILES,
    "sampling": ON_GPU,
}
STAGE_ORDER: Final = (READS, COMPILES, ON_GPU)


def run_order(names: Sequence[str]) -> list[str]:
    """``names`` as they run: in :data:`CHECKS` order, whatever order they were asked in."""
    return sorted(dict.fromkeys(names), key=CHECKS.index)


def registry() -> dict[str, Check]:
    from builder.verify import (
        binaries,
        cubin,
        flashinfer_jit,
        imports,
        kernel_compile,
        sampling,
        toolchain,
    )

    return {
        "imports": imports.check,
        "toolchain": toolchain.check,
        "binaries": binaries.check,
        "kernel-compile": kernel_compile.check,
        "flashinfer-jit": flashinfer_jit.check,
        "cubin": cubin.check,
        "sampling": sampling.check,
    }


def parse_checks(text: str) -> tuple[str, ...]:
    """``"toolchain,cubin"`` (commas and/or spaces) -> names; UsageError for an unknown one."""
    names = tuple(dict.fromkeys(n for n in re.split(r"[\s,]+", text.strip()) if n))
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise UsageError(
            f"--checks {text!r}: unknown check(s) {', '.join(map(repr, unknown)) or '(none given)'}"
            f"; known: {', '.join(CHECKS)}"
        )
    return names


# Seconds between "still ..." lines while a long step (FlashInfer's ~90 s JIT) says nothing.
HEARTBEAT_SECONDS = float(os.environ.get("CUDAENV_HEARTBEAT_SECONDS", "15"))


@contextlib.contextmanager
def heartbeat(progress: Callable[[str], None], what: str) -> Iterator[None]:
    """Say ``what`` with the elapsed time every :data:`HEARTBEAT_SECONDS` until the block
    ends: a step that takes minutes is not mistaken for a hang."""
    done = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not done.wait(HEARTBEAT_SECONDS):
            progress(f"{what} ({time.monotonic() - started:.0f} s)")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)


def probe_with_progress(target: Target, progress: Callable[[str], None], *, jit: bool) -> EnvFacts:
    what = " and JIT-building FlashInfer's sampling module" if jit else ""
    progress(f"probing {target.python}{what}")
    with heartbeat(progress, "still probing" + (" and JIT-building" if jit else "")):
        return probe(target, jit=jit)


def not_run(name: str, failed: str) -> CheckResult:
    """What a check says when an earlier, cheaper one failed: never passed, never run."""
    return CheckResult(
        name=name,
        status=SKIPPED,
        summary=f"not run: {failed} failed (`--keep-going` runs it anyway)",
    )


def run_checks(
    target: Target, names: Sequence[str], progress: Callable[[str], None] = lambda _m: None
) -> tuple[EnvFacts, list[CheckResult]]:
    """Run ``names`` cheapest first (:data:`CHECKS` order); a failure leaves the checks of
    later stages not run unless ``target.keep_going``. FlashInfer's JIT (in the probe) waits
    until the checks that only read the env have passed."""
    checks = registry()
    unknown = [n for n in names if n not in checks]
    if unknown:
        raise UsageError(f"unknown check(s): {', '.join(unknown)}; known: {', '.join(checks)}")
    order = run_order(names)
    wants_jit = "flashinfer-jit" in order
    # With nothing cheap to run first, one probe serves every check.
    jit_done = wants_jit and not any(STAGES[n] == READS for n in order)
    facts = probe_with_progress(target, progress, jit=jit_done)
    results: list[CheckResult] = []
    first_failed: CheckResult | None = None
    for name in order:
        if (
            first_failed is not None
            and not target.keep_going
            and STAGE_ORDER.index(STAGES[name]) > STAGE_ORDER.index(STAGES[first_failed.name])
        ):
            results.append(not_run(name, first_failed.name))
            progress(f"{name}: not run ({first_failed.name} failed)")
            continue
        if name == "flashinfer-jit" and not jit_done:
            facts = probe_with_progress(target, progress, jit=True)
            jit_done = True
        result = run_one(name, checks[name], target, facts)
        # The results are printed once, in the summary; this only says how far verify got.
        progress(f"checked {name} ({result.seconds:.1f} s)")
        results.append(result)
        if result.status == FAILED and first_failed is None:
            first_failed = result
    return facts, results


def run_one(name: str, check: Check, target: Target, facts: EnvFacts) -> CheckResult:
    started = time.monotonic()
    try:
        result = check(target, facts)
    except proc.CommandFailed as exc:
        result = CheckResult(
            name=name,
            status=FAILED,
            summary=f"command failed: {exc.argv[0]}",
            evidence=(("output", exc.output[-2000:]),),
        )
    except ToolMissing as exc:
        result = CheckResult(name=name, status=FAILED, summary=str(exc), missing_tool=exc.tool)
    except Exception as exc:
        # A check's own bug is its verdict: the other checks run and the report is written.
        log.debug("check %s crashed", name, exc_info=True)
        result = CheckResult(
            name=name,
            status=FAILED,
            summary=f"the check crashed: {type(exc).__name__}: {exc}",
            fix="run with --debug and report it",
        )
    if result.seconds == 0.0:
        result = dataclasses.replace(result, seconds=time.monotonic() - started)
    return result
