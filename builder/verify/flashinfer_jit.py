"""`flashinfer-jit`: FlashInfer's sampling module JIT-builds for the env's archs into the env's
own cache (FLASHINFER_WORKSPACE_BASE = var/flashinfer); an unchanged env reuses it."""

from __future__ import annotations

from pathlib import Path

from builder import channels
from builder.archs import Arch, flashinfer_spelling, parse_list
from builder.verify import FAILED, PASSED, SKIPPED, CheckResult, EnvFacts, Target


def built_archs(facts: EnvFacts) -> tuple[Arch, ...] | None:
    """The archs FlashInfer's JIT was asked for in the probe (its FLASHINFER_CUDA_ARCH_LIST),
    or None when unset or unreadable (FlashInfer then uses the visible GPUs')."""
    try:
        return parse_list(facts.env.get("FLASHINFER_CUDA_ARCH_LIST") or "")
    except ValueError:
        return None


def check(target: Target, facts: EnvFacts) -> CheckResult:
    if not facts.flashinfer_installed:
        return CheckResult(
            name="flashinfer-jit",
            status=SKIPPED,
            summary="flashinfer-python is not installed in this env",
        )
    archs = facts.env.get("FLASHINFER_CUDA_ARCH_LIST") or "(unset: the visible GPUs')"
    evidence = [
        ("FLASHINFER_CUDA_ARCH_LIST", archs),
        ("FLASHINFER_WORKSPACE_BASE", str(facts.env.get("FLASHINFER_WORKSPACE_BASE"))),
    ]
    jit = facts.jit
    seconds = float(jit.get("seconds", 0.0) or 0.0)
    built_for = built_archs(facts)
    if built_for is not None and set(built_for) != set(target.archs):
        # The JIT read another list than the one verified: e.g. a hook that overwrote an
        # explicit `--archs`. Passing here would vouch for archs nothing was built for.
        return CheckResult(
            name="flashinfer-jit",
            status=FAILED,
            summary=f"FlashInfer JIT-built for {archs} but verify asked for "
            f"{flashinfer_spelling(target.archs)}",
            evidence=tuple(evidence),
            seconds=seconds,
            fix="rebuild the env (`cudaenv build SPEC --force`): its start-up hook then honours "
            "`cudaenv verify --archs`",
        )
    if facts.flashinfer_error or "error" in jit or "library" not in jit:
        error = str(jit.get("error") or facts.flashinfer_error or "no JIT result")
        hint = ""
        fix = "check the toolchain check first; rebuild the env with `cudaenv build SPEC`"
        if "cannot find -lcudart" in error or "cannot find -lcuda" in error:
            hint = (
                " (CUDA_HOME lacks lib64/libcudart.so or lib64/stubs/libcuda.so: flashinfer#5064)"
            )
        missing = channels.missing_header(error)
        if missing:
            header, component = missing
            hint = f" (the toolkit has no {header})"
            if component:
                fix = channels.component_fix(header, component)
        return CheckResult(
            name="flashinfer-jit",
            status=FAILED,
            summary=f"FlashInfer's sampling module did not build{hint}",
            evidence=(*evidence, ("error", error[-3000:])),
            seconds=seconds,
            fix=fix,
        )
    library = Path(str(jit["library"]))
    evidence.append(("library", str(library)))
    if target.env_dir is not None and not library.is_relative_to(target.env_dir):
        return CheckResult(
            name="flashinfer-jit",
            status=FAILED,
            summary=f"the JIT cache is outside the env ({library}): another toolkit's objects "
            "could be reused (flashinfer#3229)",
            evidence=tuple(evidence),
            seconds=seconds,
            fix="run the env's own python (its start-up hook sets FLASHINFER_WORKSPACE_BASE)",
        )
    how = "reused from the env's JIT cache" if jit.get("reused") else f"built in {seconds:.1f} s"
    stored = jit.get("store")
    warnings: tuple[str, ...] = ()
    if isinstance(stored, dict) and isinstance(stored.get("warnings"), list):
        warnings = tuple(str(w) for w in stored["warnings"])
    if isinstance(stored, dict) and stored.get("used"):
        evidence.append(("JIT store key", str(stored.get("key"))))
        if stored.get("hit"):
            day = str(stored.get("first_built") or "?")[:10]
            how = f"reused from the store (first built {day} for {stored.get('env')})"
        elif stored.get("kept"):
            how += ", kept in the store for envs of the same toolchain"
    return CheckResult(
        name="flashinfer-jit",
        status=PASSED,
        summary=f"sampling module for {archs}: {how}",
        evidence=tuple(evidence),
        seconds=seconds,
        warnings=warnings,
    )
