"""Verification: one module per check, each returning a :class:`CheckResult`.

A check that cannot run says ``skipped`` with its reason; it never says ``passed``.
The facts every check reads come from one run of ``builder/probe/env_facts.py`` inside the
target interpreter (FlashInfer's import, ~7 s, is paid once).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from builder import proc
from builder.errors import VerifyFailed

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    name: str
    status: str
    summary: str
    evidence: tuple[tuple[str, str], ...] = ()
    seconds: float = 0.0
    fix: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "summary": self.summary,
            "evidence": dict(self.evidence),
            "seconds": round(self.seconds, 3),
            "fix": self.fix,
        }


@dataclass(frozen=True, kw_only=True)
class Target:
    """What is verified: an interpreter, its env dir when cudaenv built it, the archs."""

    python: Path
    archs: tuple[str, ...]
    work: Path  # where checks write their builds (the env's var/cudaenv, or a cache dir)
    env_dir: Path | None = None
    expected_cuda: str | None = None
    spec_name: str | None = None
    checks: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()


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
    seconds: float = 0.0

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
            seconds=seconds,
        )


def target_env(target: Target) -> dict[str, str]:
    env = dict(os.environ)
    env.update(dict(target.extra_env))
    return env


def probe(target: Target, *, jit: bool) -> EnvFacts:
    # Run by path: the probe imports its sibling flashinfer_light.py (sys.path[0] is its dir).
    script = str(resources.files("builder.probe").joinpath("env_facts.py"))
    started = time.monotonic()
    argv: list[str | os.PathLike[str]] = [target.python, script]
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


def registry() -> dict[str, Check]:
    from builder.verify import cubin, flashinfer_jit, kernel_compile, sampling, toolchain

    return {
        "toolchain": toolchain.check,
        "kernel-compile": kernel_compile.check,
        "flashinfer-jit": flashinfer_jit.check,
        "cubin": cubin.check,
        "sampling": sampling.check,
    }


def run_checks(
    target: Target, names: Sequence[str], progress: Callable[[str], None] = lambda _m: None
) -> tuple[EnvFacts, list[CheckResult]]:
    checks = registry()
    unknown = [n for n in names if n not in checks]
    if unknown:
        raise VerifyFailed(f"unknown check(s): {', '.join(unknown)}; known: {', '.join(checks)}")
    progress(
        f"probing {target.python}"
        + (" and JIT-building FlashInfer's sampling module" if "flashinfer-jit" in names else "")
    )
    facts = probe(target, jit="flashinfer-jit" in names)
    results = []
    for name in names:
        started = time.monotonic()
        try:
            result = checks[name](target, facts)
        except proc.CommandFailed as exc:
            result = CheckResult(
                name=name,
                status=FAILED,
                summary=f"command failed: {exc.argv[0]}",
                evidence=(("output", exc.output[-2000:]),),
            )
        if result.seconds == 0.0:
            result = dataclasses.replace(result, seconds=time.monotonic() - started)
        progress(f"{name}: {result.status} ({result.seconds:.1f} s) {result.summary}")
        results.append(result)
    return facts, results
