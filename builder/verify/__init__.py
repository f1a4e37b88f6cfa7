"""Verification: one module per check, each returning a :class:`CheckResult`.

A check that cannot run says ``skipped`` with its reason; it never says ``passed``.
The facts every check reads come from one run of ``builder/probe/env_facts.py`` inside the
target interpreter (FlashInfer's import, ~7 s, is paid once). That run also reports the
interpreter's whole environment as its start-up hook left it, and every command a check
runs (nvcc, cuobjdump, the sampling kernels) gets exactly that environment: a check proves
the env as its users meet it, with the spec's own variables (``NVCC_APPEND_FLAGS``, ...).

This file is the run loop: the probe run, the registry and the order the checks run in. What
they speak of (``Target``, ``EnvFacts``, ``CheckResult``, ``env_of``) is in ``model.py``, which
every check imports; no check imports this file, so the imports go one way.

How to add a check: write ``builder/verify/NAME.py`` with ``check(target, facts) ->
CheckResult`` (its types from ``builder.verify.model``, its statuses from
``builder.core.statuses``), add its name to ``spec.CHECKS`` (what a spec's ``verify:`` may name;
order = run order; :data:`CHECKS` here is that tuple), to :data:`STAGES` and to
:func:`registry`, and give it a test that shows it failing on a broken input. A test keeps
the names and the registry equal.

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
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Final

from builder.core import proc, settings, variables
from builder.core.errors import ToolMissing, UsageError, VerifyFailed
from builder.core.statuses import FAILED, SKIPPED
from builder.spec import envspec as spec
from builder.verify.model import CheckResult, EnvFacts, target_env
from builder.verify.model import Target as Target  # the run loop's input, named for its callers

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "model",
    "recorded",
    "reference",
    "imports",
    "toolchain",
    "binaries",
    "kernel_compile",
    "flashinfer_jit",
    "cubin",
    "sampling",
    "report",
)

log = logging.getLogger("cudaenv")


def probe(target: Target, *, jit: bool) -> EnvFacts:
    # Run by path: the probe imports its sibling flashinfer_light.py (sys.path[0] is its dir).
    script = str(resources.files("builder.probe").joinpath("env_facts.py"))
    started = time.monotonic()
    # The variables to report (builder/core/variables.py): the probe imports nothing of cudaenv.
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


# Every check, in run order (what `--checks` and a spec's `verify:` may name): cheapest
# first. The spec's validator holds the names; the registry below maps each to its check.
CHECKS = spec.CHECKS

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
    # Imported when checks run: a report, a spec or the model (whose import runs this file)
    # reads the check names without loading every check and its tools (~40 ms).
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


# Seconds between "still ..." lines while a long step (FlashInfer's ~90 s JIT) says nothing:
# CUDAENV_HEARTBEAT_SECONDS (settings) unless set here.
HEARTBEAT_SECONDS: float | None = None


@contextlib.contextmanager
def heartbeat(progress: Callable[[str], None], what: str) -> Iterator[None]:
    """Say ``what`` with the elapsed time every :data:`HEARTBEAT_SECONDS` until the block
    ends: a step that takes minutes is not mistaken for a hang."""
    done = threading.Event()
    started = time.monotonic()
    every = HEARTBEAT_SECONDS or settings.current().heartbeat_seconds

    def beat() -> None:
        while not done.wait(every):
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
    # With nothing cheap to run first, one probe serves every check; so it does where every
    # cheap check that keeps a record passed last time (an env verified before: one torch
    # import, not two).
    from builder.verify import recorded

    cheap = [n for n in order if STAGES[n] == READS]
    kept = [n for n in cheap if n in recorders()]
    jit_done = wants_jit and (
        not cheap or (bool(kept) and all(recorded.passed_last(target, n) for n in kept))
    )
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
        with heartbeat(progress, f"still checking {name}"):
            result = run_recorded(name, checks[name], target, facts)
        # The results are printed once, in the summary; this only says how far verify got.
        progress(f"checked {name} ({result.seconds:.1f} s)")
        results.append(result)
        if result.status == FAILED and first_failed is None:
            first_failed = result
    return facts, results


def recorders() -> dict[str, Callable[[Target, EnvFacts], dict[str, object] | None]]:
    """The checks that can name every input of their verdict (verify/recorded.py): a pass
    under the same inputs is reused, not run again."""
    from builder.verify import imports

    return {"imports": imports.inputs}


def borrowers() -> dict[str, Callable[[Path, Target], tuple[str, str]]]:
    """What a check whose pass is reused from an identical env does in this one instead of
    running (its evidence line): the imports check's bytecode, copied from that env."""
    from builder.verify import imports

    return {"imports": imports.borrow_bytecode}


def run_recorded(name: str, check: Check, target: Target, facts: EnvFacts) -> CheckResult:
    """:func:`run_one`, or the pass recorded for ``name`` when its inputs are unchanged."""
    from builder.verify import recorded

    started = time.monotonic()
    inputs_of = recorders().get(name)
    key = None
    if inputs_of is not None:
        try:
            found = inputs_of(target, facts)
        except OSError:  # an env cudaenv cannot read whole: checked, never reused
            found = None
        if found is not None:
            key = recorded.fingerprint(found)
            again = recorded.recorded(target, name, key)
            if again is not None:
                recorded.note_twin(target, name, key)
                return dataclasses.replace(again, seconds=time.monotonic() - started)
            twin = recorded.borrowed(target, name, key)
            if twin is not None:
                result, other = twin
                after = borrowers().get(name)
                if after is not None:  # what the check would have left in this env
                    result = dataclasses.replace(
                        result, evidence=(*result.evidence, after(other, target))
                    )
                recorded.record(target, name, key, result, shared=False)
                return dataclasses.replace(result, seconds=time.monotonic() - started)
    result = run_one(name, check, target, facts)
    if key is not None:
        recorded.record(target, name, key, result)
    return result


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
