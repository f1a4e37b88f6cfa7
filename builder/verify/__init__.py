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

The checks run at once where their inputs allow (:func:`waits_for`), on a pool as wide as the
machine's cores: the imports (a minute of one core of Python) beside cudaenv's kernel and
FlashInfer's JIT (minutes of nvcc), which wait only for the toolchain and binaries checks.
On the README's main job (2 cores) the checks took 226 s one after another, against a bound of
about 145 s with both cores busy. A check that fails leaves what waits for it not run (its
checks say ``skipped``, "not run: X failed"); a check that ran beside it keeps its result.
Where the imports failed last time the compiles wait for them: an env whose packages do not
import is not worth ten minutes of JIT. ``--keep-going`` runs everything anyway.
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

from builder.core import context, proc, settings, variables
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
def heartbeat(progress: Callable[[str], None], what: str | Callable[[], str]) -> Iterator[None]:
    """Say ``what`` (or what it returns each time: the checks running now) with the elapsed
    time every :data:`HEARTBEAT_SECONDS` until the block ends: a step that takes minutes is
    not mistaken for a hang."""
    done = threading.Event()
    started = time.monotonic()
    every = HEARTBEAT_SECONDS or settings.current().heartbeat_seconds

    def beat() -> None:
        while not done.wait(every):
            said = what() if callable(what) else what
            progress(f"{said} ({time.monotonic() - started:.0f} s)")

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
    """Run ``names``, at once where their inputs allow (:func:`waits_for`), the results in
    :data:`CHECKS` order; a failure leaves the checks that wait for it not run unless
    ``target.keep_going``. The imports check runs beside the compiles, which wait only for
    the toolchain and binaries checks (seconds); FlashInfer's JIT (in a second probe) starts
    as soon as those passed, unless the imports failed last time (then it waits for them)."""
    checks = registry()
    unknown = [n for n in names if n not in checks]
    if unknown:
        raise UsageError(f"unknown check(s): {', '.join(unknown)}; known: {', '.join(checks)}")
    order = run_order(names)
    wants_jit = "flashinfer-jit" in order
    # With nothing cheap to run first, one probe serves every check. So it does, one check
    # at a time (a 1-core box), where every cheap check that keeps a record passed last time
    # (an env verified before: one torch import, not two). With more cores the JIT's own
    # probe runs beside the imports instead: folded into the first probe, it ran before them
    # (measured on the main job, 2 cores: 108 s folded, the JIT alone 88 s).
    from builder.verify import recorded

    cheap = [n for n in order if STAGES[n] == READS]
    kept = [n for n in cheap if n in recorders()]
    jit_done = wants_jit and (
        not cheap
        or (cores() == 1 and bool(kept) and all(recorded.passed_last(target, n) for n in kept))
    )
    facts = probe_with_progress(target, progress, jit=jit_done)
    doubted = frozenset(n for n in kept if recorded.failed_last(target, n))
    run = _Run(target, checks, order, facts, progress, jit_done=jit_done, doubted=doubted)
    return run.go()


def waits_for(name: str, order: Sequence[str], doubted: frozenset[str] = frozenset()) -> list[str]:
    """The checks of ``order`` that ``name`` starts after (one of an earlier stage that failed
    leaves it not run): the compiles wait for the toolchain and the binaries checks (what they compile
    with) and for a ``doubted`` check (one that failed last time: a failure is likely again,
    and the compiles cost minutes), not for the imports (one core of Python, a minute) that
    run beside them; cubin reads what both compiles made, after every check that reads the
    env; the GPU checks wait for all."""
    before = order[: order.index(name)]
    stage = STAGES[name]
    if stage == READS:
        return []
    if name in ("kernel-compile", "flashinfer-jit"):
        return [n for n in before if STAGES[n] == READS and (n != "imports" or n in doubted)]
    return list(before)


# Which check starts first when several may and the pool is full: the longest (measured on
# the README's main job, 2 cores: FlashInfer's JIT 124 s, the imports 75 s, cudaenv's kernel
# 14 s, the toolchain 8 s), so the shortest fill in beside them.
START_FIRST: Final = (
    "flashinfer-jit", "imports", "kernel-compile", "toolchain", "binaries", "cubin", "sampling",
)  # fmt: skip


def cores() -> int:
    """The cores this process may run on (its affinity: a container's or a CI runner's CPU
    set, where os.cpu_count() says the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _Run:
    """One verify's checks on a pool as wide as the machine's cores (a 1-core box runs them
    one after another, in order), each started once what it waits for has finished."""

    def __init__(
        self,
        target: Target,
        checks: dict[str, Check],
        order: list[str],
        facts: EnvFacts,
        progress: Callable[[str], None],
        *,
        jit_done: bool,
        doubted: frozenset[str],
    ) -> None:
        self.target, self.checks, self.order, self.facts = target, checks, order, facts
        self.progress, self.jit_done, self.doubted = progress, jit_done, doubted
        self.results: dict[str, CheckResult] = {}
        self.running: dict[str, str] = {}  # name -> what the heartbeat says of it
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.width = max(1, min(len(order), cores()))

    def go(self) -> tuple[EnvFacts, list[CheckResult]]:
        from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

        waiting = list(self.order)
        width = self.width
        pool = ThreadPoolExecutor(max_workers=width, thread_name_prefix="verify-check")
        live: dict[Future[CheckResult], str] = {}
        try:
            with heartbeat(self.progress, self.still):
                while waiting or live:
                    for name in self.ready(waiting, len(live), width):
                        waiting.remove(name)
                        live[pool.submit(context.carried(self.one), name)] = name
                    done, _ = wait(live, return_when=FIRST_COMPLETED)
                    for fut in done:
                        name = live.pop(fut)
                        self.results[name] = fut.result()
                        self.progress(f"checked {name} ({self.results[name].seconds:.1f} s)")
        except BaseException:
            # Ctrl-C (or a check's interrupt): the children of the checks still running end
            # now, so the pool's exit, which joins its threads, returns at once.
            from builder.core import descendants

            descendants.end_all()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return self.facts, [self.results[n] for n in self.order]

    def ready(self, waiting: list[str], busy: int, width: int) -> list[str]:
        """The waiting checks that may start now, the longest first (:data:`START_FIRST`), as
        many as the pool has room for; one whose wait ended in a failure of an earlier stage
        is settled here as not run, naming the first that failed in :data:`CHECKS` order
        (with ``keep_going`` it runs)."""
        out: list[str] = []
        # One at a time (a 1-core box): cheapest first, so a failure stops the most.
        first = START_FIRST.index if width > 1 else self.order.index
        for name in sorted(waiting, key=first):
            before = waits_for(name, self.order, self.doubted)
            # Only a failure of an earlier stage stops a check: cubin reads what a compile
            # that failed left, as it did when the checks ran one after another.
            stage = STAGE_ORDER.index(STAGES[name])
            stops = [n for n in before if STAGE_ORDER.index(STAGES[n]) < stage]
            if any(n not in self.results for n in before):
                continue  # settled once all it waits for are: the first failed is named
            failed = None if self.target.keep_going else self._failed(stops)
            if failed is not None:
                waiting.remove(name)
                self.results[name] = not_run(name, failed)
                self.progress(f"{name}: not run ({failed} failed)")
            elif busy + len(out) < width:
                out.append(name)
        return out

    def _failed(self, names: Sequence[str]) -> str | None:
        return next(
            (n for n in names if n in self.results and self.results[n].status == FAILED), None
        )

    def still(self) -> str:
        with self.lock:
            return "still checking " + ", ".join(self.running.values())

    def one(self, name: str) -> CheckResult:
        started = time.monotonic()
        facts = self.facts
        with self.lock:
            self.running[name] = name
        try:
            if name == "flashinfer-jit" and not self.jit_done:
                with self.lock:
                    self.running[name] = "flashinfer-jit (JIT-building in a probe)"
                self.progress(
                    f"probing {self.target.python} and JIT-building FlashInfer's sampling module"
                )
                facts = self.facts = probe(self.target, jit=True)
                self.jit_done = True
            # Beside FlashInfer's JIT (the longest, what decides when the verify ends), the
            # other checks' children yield the CPU to its compiles: they fill what it leaves.
            aside = self.width > 1 and "flashinfer-jit" in self.order and name != "flashinfer-jit"
            with proc.yielding() if aside else contextlib.nullcontext():
                result = run_recorded(name, self.checks[name], self.target, facts)
        finally:
            with self.lock:
                self.running.pop(name, None)
        # Its own seconds as this verify spent them: FlashInfer's JIT check says how long the
        # build took, and its probe (an interpreter, torch's import) came before that.
        took = max(result.seconds, time.monotonic() - started)
        return dataclasses.replace(result, started=started - self.t0, seconds=took)


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
