"""Rules over the facts of any interpreter -> Findings (cause, evidence, fix), root cause first.

Every rule is one function over :class:`~builder.doctor.facts.Facts` (the toolchain's in
:mod:`builder.doctor.toolkit_rules`, the wheels' in :mod:`builder.doctor.wheel_rules`, the
compiled torch extensions' in :mod:`builder.doctor.extension_rules`, the machine's and the
env's state in :mod:`builder.doctor.env_rules`); :func:`diagnose` runs them
all, puts the root cause first and groups the symptoms it explains under it.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import replace

from builder.doctor.env_rules import (
    rule_activation,
    rule_caches,
    rule_drift,
    rule_driver,
    rule_gpu_archs,
    rule_jit_cache,
    rule_last_verify,
    rule_probe,
    rule_remote_cache,
)
from builder.doctor.extension_rules import rule_extension_cuda
from builder.doctor.facts import ERROR, SEVERITY_ORDER, Facts, Finding
from builder.doctor.toolkit_rules import (
    SM12_MIN_CUDA,
    install_command,
    rule_glibc,
    rule_host_compiler,
    rule_no_host_compiler,
    rule_nvcc,
    sm12_intent,
)
from builder.doctor.wheel_rules import (
    rule_bindings,
    rule_nvjitlink,
    rule_other_major_binary,
    rule_wheels,
)

# The rules' own modules are below this one; their names stay importable from here.
__all__ = [
    "EXPLAINS",
    "ROOT_FIRST",
    "RULES",
    "SM12_MIN_CUDA",
    "diagnose",
    "install_command",
    "rule_activation",
    "rule_bindings",
    "rule_caches",
    "rule_drift",
    "rule_driver",
    "rule_extension_cuda",
    "rule_glibc",
    "rule_gpu_archs",
    "rule_host_compiler",
    "rule_jit_cache",
    "rule_last_verify",
    "rule_no_host_compiler",
    "rule_nvcc",
    "rule_nvjitlink",
    "rule_other_major_binary",
    "rule_probe",
    "rule_remote_cache",
    "rule_wheels",
    "sm12_intent",
]

RULES: tuple[Callable[[Facts], list[Finding]], ...] = (
    rule_probe,
    rule_nvcc,
    rule_wheels,
    rule_bindings,
    rule_nvjitlink,
    # Before rule_other_major_binary: its finding, when both fire, is this one's symptom.
    rule_extension_cuda,
    rule_other_major_binary,
    rule_driver,
    rule_jit_cache,
    rule_caches,
    rule_activation,
    rule_drift,
    rule_remote_cache,
    rule_host_compiler,
    rule_no_host_compiler,
    rule_glibc,
    rule_gpu_archs,
    rule_last_verify,
)
ROOT_FIRST = (
    "probe-failed",
    "cuda-binding-major",
    "extension-built-for-other-cuda",
    "built-for-other-cuda-major",
    "torch-import-failed",
    "flashinfer-import-failed",
    "sm12x-nvcc-too-old",
    "nvcc-broken",
    "no-nvcc",
    "jit-toolkit-mismatch",
    "glibc-too-new-for-cuda",
    "no-host-compiler",
    "host-compiler-unsupported",
    "nvjitlink-too-old",
    "mixed-toolkit-minors",
    "multiple-cuda-majors",
    "flashinfer-companion-mismatch",
    "driver-too-old",
    "stale-jit-cache",
    "cache-outside-env",
    "activation-unwired",
    "env-drift",
    "remote-cache-auth",
    "remote-cache-unwired",
    "remote-cache-down",
    "gpu-arch-missing",
    "old-jit-cache",
    "extension-ptx-newer-than-torch",
    "no-driver",
    "last-verify-failed",  # after every cause the doctor can name itself
    "rule-crashed",  # a doctor bug, not the env's: after every finding about the env
)

# root -> the symptoms it explains (grouped under it when both fire).
EXPLAINS = {
    "sm12x-nvcc-too-old": ("jit-toolkit-mismatch",),
    "nvcc-broken": ("jit-toolkit-mismatch",),
    "mixed-toolkit-minors": ("jit-toolkit-mismatch",),
    "built-for-other-cuda-major": (
        "flashinfer-import-failed",
        "torch-import-failed",
        "last-verify-failed",
    ),
    # The static reading of the same cause (the import error, read by --deep, and what it
    # explains): listed whole, since a symptom's own symptoms are not kept once it is grouped.
    "extension-built-for-other-cuda": (
        "built-for-other-cuda-major",
        "flashinfer-import-failed",
        "torch-import-failed",
        "last-verify-failed",
    ),
    "cuda-binding-major": ("flashinfer-import-failed", "torch-import-failed", "last-verify-failed"),
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
                    f"output of `cudaenv doctor --python {shlex.quote(facts.python or 'python3')} "
                    "--json`",
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
