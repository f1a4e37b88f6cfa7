"""`binaries`: every prebuilt binary the stack loads has code for each of the env's archs.

The audit of builder/audit/scan.py over the env, for the verify's archs: torch's libraries,
sgl_kernel's common ops as its loader picks them per arch, vLLM's extensions and what they
link must run there (SASS, or PTX the driver compiles). The import probe (what one process
maps) is `cudaenv audit`'s; verify judges the files, which needs no import.
"""

from __future__ import annotations

from builder.audit import scan as audit
from builder.core.statuses import FAILED, PASSED, SKIPPED
from builder.verify.model import CheckResult, EnvFacts, Target


def check(target: Target, facts: EnvFacts) -> CheckResult:
    env = target.env_dir or target.python.absolute().parent.parent
    cache = audit.ScanCache.default()
    # The driver's CUDA is not asked here: a PTX-only binary is judged by arch alone, and
    # `cudaenv audit` on the GPU machine adds the driver's bound.
    done = audit.run(env, target.archs, driver_cuda=None, cache=cache)
    evidence: list[tuple[str, str]] = [("binaries with device code", str(len(done.binaries)))]
    judged = 0
    for arch in done.archs:
        required = [j for j in done.judgements if j.arch == arch and j.required is not None]
        judged += len(required)
        runs = sum(j.covered for j in required)
        evidence.append((f"required on {arch}", f"{runs}/{len(required)} run"))
    for i, warning in enumerate(done.warnings[:5]):
        evidence.append((f"warning {i + 1}", warning))
    failures = done.failures
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return CheckResult(
            name="binaries",
            status=FAILED,
            summary=failures[0] + more,
            evidence=(*evidence, *((f"failure {i + 1}", f) for i, f in enumerate(failures))),
            fix="a GPU of that arch cannot run this stack as installed: use archs the "
            "binaries hold, or a build of the package for that arch "
            f"(`cudaenv audit --python {target.python} --archs ...` lists what each holds)",
        )
    if judged == 0:
        return CheckResult(
            name="binaries",
            status=SKIPPED,
            summary="no binary the stack loads holds device code (torch, sgl_kernel and vLLM "
            "are not installed)",
            evidence=tuple(evidence),
        )
    return CheckResult(
        name="binaries",
        status=PASSED,
        summary=f"{judged} required binary/arch pair(s) have code for "
        + ", ".join(str(a) for a in done.archs)
        + f"; {len(done.with_code)} binaries with device code read",
        evidence=tuple(evidence),
    )
