"""One verify's checks at once where their inputs allow (builder/verify/__init__.py): the
imports beside the compiles, each result whole, the report in the spec's order with each
check's start and end, a failure leaving only what waits for it not run."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from builder import verify
from builder.commands import verify as verifyrun
from builder.core.reporter import Reporter
from builder.core.statuses import FAILED, PASSED, SKIPPED
from builder.verify.model import CheckResult, EnvFacts, Target
from tests.test_sampling import facts, target


def sleeper(
    name: str, seconds: float, status: str = PASSED
) -> Callable[[Target, EnvFacts], CheckResult]:
    def check(t: Target, f: EnvFacts) -> CheckResult:
        time.sleep(seconds)
        return CheckResult(
            name=name, status=status, summary=f"{name} {status}",  # type: ignore[arg-type]
            evidence=(("thread", threading.current_thread().name),),
        )  # fmt: skip

    return check


@pytest.fixture
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Callable[..., CheckResult]]:
    """Every check a sleeper (the imports the longest, as measured on the main job), the env
    probe one fixed set of facts, and a pool of 4: the order is the runner's alone."""
    checks = {
        "imports": sleeper("imports", 1.2),
        "toolchain": sleeper("toolchain", 0.2),
        "binaries": sleeper("binaries", 0.1),
        "kernel-compile": sleeper("kernel-compile", 0.3),
        "flashinfer-jit": sleeper("flashinfer-jit", 0.6),
        "cubin": sleeper("cubin", 0.1),
        "sampling": sleeper("sampling", 0.1),
    }
    monkeypatch.setattr(verify, "registry", lambda: checks)
    monkeypatch.setattr(verify, "probe", lambda t, jit: facts(tmp_path))
    monkeypatch.setattr(verify, "cores", lambda: 4)
    return checks


def interval(doc: dict[str, object], name: str) -> tuple[float, float]:
    (check,) = [c for c in doc["checks"] if c["name"] == name]  # type: ignore[attr-defined]
    return check["started"], check["ended"]


def test_the_checks_of_one_verify_overlap_and_the_report_keeps_the_specs_order(
    tmp_path: Path, fakes: object
) -> None:
    out = tmp_path / "verify.json"
    every = dataclasses.replace(target(tmp_path), checks=verify.CHECKS)
    rep = verifyrun.verify_and_report(every, None, Reporter(quiet=True), report_path=out)
    doc = json.loads(out.read_text())
    assert [c["name"] for c in doc["checks"]] == list(verify.CHECKS)
    assert all(c.status == PASSED for c in rep.checks)
    imports = interval(doc, "imports")
    # FlashInfer's JIT and cudaenv's kernel run while the imports do, after the toolchain
    # and binaries checks they compile with; cubin after both compiles; the GPU check last.
    for name in ("kernel-compile", "flashinfer-jit"):
        start, end = interval(doc, name)
        assert start < imports[1] and end > imports[0], (name, imports, (start, end))
        assert start >= max(interval(doc, "toolchain")[1], interval(doc, "binaries")[1])
    assert interval(doc, "cubin")[0] >= interval(doc, "flashinfer-jit")[1]
    assert interval(doc, "sampling")[0] >= max(
        e for _, e in map(lambda n: interval(doc, n), verify.CHECKS[:-1])
    )
    # The whole run took about the longest lane (the imports), not the sum of the checks.
    total = sum(c["seconds"] for c in doc["checks"])
    assert doc["checks"][-1]["ended"] < total


def test_a_failing_check_leaves_the_others_results_whole(
    tmp_path: Path, fakes: dict[str, Callable[..., CheckResult]]
) -> None:
    """The toolchain fails while the imports run: the imports finish with their evidence, the
    compiles (which wait for the toolchain) and what comes after are not run, and say why."""
    fakes["toolchain"] = sleeper("toolchain", 0.1, FAILED)
    said: list[str] = []
    _, results = verify.run_checks(target(tmp_path), verify.CHECKS, said.append)
    got = {r.name: r for r in results}
    assert got["imports"].status == PASSED and got["imports"].summary == "imports passed"
    assert dict(got["imports"].evidence)["thread"].startswith("verify-check")
    assert got["binaries"].status == PASSED
    assert got["toolchain"].status == FAILED
    for name in ("kernel-compile", "flashinfer-jit", "cubin", "sampling"):
        assert got[name].status == SKIPPED, name
        assert got[name].summary == "not run: toolchain failed (`--keep-going` runs it anyway)"
        assert got[name].started is None
    assert any(line.startswith("checked imports (") for line in said), said


def test_a_compile_that_fails_beside_the_imports_leaves_the_imports_whole(
    tmp_path: Path, fakes: dict[str, Callable[..., CheckResult]]
) -> None:
    fakes["flashinfer-jit"] = sleeper("flashinfer-jit", 0.1, FAILED)
    _, results = verify.run_checks(target(tmp_path), verify.CHECKS)
    got = {r.name: r for r in results}
    assert got["imports"].status == PASSED and got["kernel-compile"].status == PASSED
    assert got["flashinfer-jit"].status == FAILED
    # cubin is of the compiles' stage: a failed compile does not stop it (as before).
    assert got["cubin"].status == PASSED
    assert (
        got["sampling"].summary == "not run: flashinfer-jit failed (`--keep-going` runs it anyway)"
    )


def test_one_core_runs_the_checks_one_after_another_in_order(
    tmp_path: Path, fakes: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verify, "cores", lambda: 1)
    _, results = verify.run_checks(target(tmp_path), verify.CHECKS)
    spans = [(r.started, (r.started or 0) + r.seconds) for r in results]
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start is not None and start >= end - 0.01


def test_the_start_order_and_the_waits_name_every_check() -> None:
    """A new check is placed in the start order and has its waits, or the suite fails."""
    assert sorted(verify.START_FIRST) == sorted(verify.CHECKS)
    for name in verify.CHECKS:
        assert set(verify.waits_for(name, verify.CHECKS)) <= set(verify.CHECKS) - {name}
    assert verify.waits_for("flashinfer-jit", verify.CHECKS) == ["toolchain", "binaries"]
    assert verify.waits_for("flashinfer-jit", verify.CHECKS, frozenset({"imports"})) == [
        "imports", "toolchain", "binaries",
    ]  # fmt: skip


def test_with_two_cores_the_jit_probes_beside_the_imports_though_they_passed_before(
    tmp_path: Path, fakes: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Folded into the first probe, FlashInfer's JIT ran before every other check; with a
    second core its own probe runs beside the imports, whatever the last verify said."""
    from builder.verify import recorded

    probes: list[bool] = []

    def probe(t: Target, jit: bool) -> EnvFacts:
        probes.append(jit)
        return facts(tmp_path)

    monkeypatch.setattr(verify, "probe", probe)
    monkeypatch.setattr(recorded, "passed_last", lambda t, n: True)
    verify.run_checks(target(tmp_path), verify.CHECKS)
    assert probes == [False, True]
    monkeypatch.setattr(verify, "cores", lambda: 1)
    probes.clear()
    verify.run_checks(target(tmp_path), verify.CHECKS)
    assert probes == [True]


def test_the_checks_on_threads_share_the_commands_values(
    tmp_path: Path, fakes: dict[str, Callable[..., CheckResult]]
) -> None:
    """What a command resolves once (its driver: core/context.py) is made once for all the
    checks that run on the pool's threads, not once per thread: a new thread starts in an
    empty context unless it is carried (a `build --verify` once looked for the driver twice)."""
    from builder.core import context

    made: list[str] = []

    def asking(name: str) -> Callable[[Target, EnvFacts], CheckResult]:
        def check(t: Target, f: EnvFacts) -> CheckResult:
            def make() -> str:
                made.append(name)
                time.sleep(0.05)  # two threads asking at once still get one value
                return "the driver"

            assert context.once("driver", make) == "the driver"
            return CheckResult(name=name, status=PASSED, summary="asked")

        return check

    for name in verify.CHECKS:
        fakes[name] = asking(name)
    with context.command():
        verify.run_checks(target(tmp_path), verify.CHECKS)
    assert len(made) == 1, made
    made.clear()
    # Outside a command nothing is kept (another work dir: no recorded pass to reuse).
    verify.run_checks(dataclasses.replace(target(tmp_path), work=tmp_path / "w2"), verify.CHECKS)
    assert len(made) == len(verify.CHECKS)
