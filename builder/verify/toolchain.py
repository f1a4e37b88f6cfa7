"""`toolchain`: torch.version.cuda = nvcc in CUDA_HOME = cudart = FlashInfer's own view."""

from __future__ import annotations

import dataclasses

from builder.core.statuses import FAILED, PASSED
from builder.verify.model import CheckResult, EnvFacts, Target


def check(target: Target, facts: EnvFacts) -> CheckResult:
    result = _check(target, facts)
    # The facts came from one probe run; its time, less FlashInfer's JIT build, is this check's.
    jit_seconds = facts.jit.seconds
    return dataclasses.replace(result, seconds=max(facts.seconds - jit_seconds, 0.0))


def _check(target: Target, facts: EnvFacts) -> CheckResult:
    seen: list[tuple[str, str]] = []  # (who, CUDA major.minor)
    found = f" (from {facts.cuda_home_source})" if facts.cuda_home_source else ""
    evidence: list[tuple[str, str]] = [("CUDA_HOME", (facts.cuda_home or "(none)") + found)]
    problems: list[str] = []
    if facts.nvcc_release:
        seen.append((f"nvcc in CUDA_HOME ({facts.nvcc_path})", facts.nvcc_release))
        evidence.append(("nvcc", facts.nvcc_release))
    else:
        problems.append(f"no working nvcc: {facts.nvcc_error}")
    if facts.cudart_version:
        seen.append(("cudart", facts.cudart_version))
        evidence.append(("cudart", facts.cudart_version))
    else:
        problems.append(f"no cudart in CUDA_HOME: {facts.cudart_error}")
    if facts.torch_installed:
        if facts.torch_error:
            problems.append(f"torch does not import: {facts.torch_error}")
        elif facts.torch_cuda is None:
            problems.append(
                f"torch {facts.torch_version} is a CPU build (torch.version.cuda is None)"
            )
        else:
            seen.insert(0, ("torch.version.cuda", facts.torch_cuda))
            evidence.append(("torch", f"{facts.torch_version} (CUDA {facts.torch_cuda})"))
    if facts.flashinfer_installed:
        if facts.flashinfer_error:
            problems.append(f"FlashInfer: {facts.flashinfer_error}")
        else:
            evidence.append(("flashinfer import", str(facts.flashinfer_import)))
            evidence.append(("flashinfer get_cuda_path()", str(facts.flashinfer_cuda_path)))
            evidence.append(("flashinfer get_cuda_version()", str(facts.flashinfer_cuda_version)))
            if facts.flashinfer_cuda_version:
                seen.append(("FlashInfer get_cuda_version()", facts.flashinfer_cuda_version))
            if (
                facts.flashinfer_cuda_path
                and facts.cuda_home
                and (facts.flashinfer_cuda_path.rstrip("/") != facts.cuda_home.rstrip("/"))
            ):
                problems.append(
                    f"FlashInfer's get_cuda_path() is {facts.flashinfer_cuda_path}, not "
                    f"CUDA_HOME={facts.cuda_home}"
                )
    if target.expected_cuda:
        # torch (when installed) stays the reference: FlashInfer falls back to it and the
        # message then reads "nvcc ... is 12.8 but torch.version.cuda is 13.0".
        seen.insert(1 if facts.torch_cuda else 0, ("the spec", target.expected_cuda))
    reference = seen[0] if seen else None
    if reference:
        for who, version in seen[1:]:
            if version != reference[1]:
                problems.append(f"{who} is {version} but {reference[0]} is {reference[1]}")
    if problems:
        # Which CUDA to point at: torch's (or the spec's) where there is one to match.
        toolkit = f"a CUDA {reference[1]} toolkit" if reference else "a CUDA toolkit"
        fix = (
            f"rebuild the env: `cudaenv build {target.spec_path or 'SPEC'}` (its start-up hook "
            f"points CUDA_HOME at the matched toolkit)"
            if target.env_dir
            else f"point CUDA_HOME at {toolkit} (`export CUDA_HOME=/usr/local/cuda-X.Y`), or "
            "build a matched env with `cudaenv build SPEC`"
        )
        return CheckResult(
            name="toolchain",
            status=FAILED,
            summary="; ".join(problems),
            evidence=tuple(evidence),
            fix=fix,
        )
    agreed = reference[1] if reference else "?"
    who = ", ".join(w for w, _ in seen)
    return CheckResult(
        name="toolchain",
        status=PASSED,
        summary=f"CUDA {agreed}: {who} agree",
        evidence=tuple(evidence),
    )
