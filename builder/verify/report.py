"""The report models (a verify run, a build record, a matrix) and their renderings.

Each model is a frozen dataclass with ``to_json``/``from_json`` and a ``schema_version``
checked on read (builder/formats/jsondoc.py), so a report from another cudaenv is a one-line error.
Renderings (terminal, Markdown, HTML, JUnit) read the models; the templates get the JSON form.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from builder import __version__
from builder.core import settings
from builder.core.errors import ReportError
from builder.core.proc import atomic_write_text
from builder.core.statuses import (
    FAILED,
    PASSED,
    SKIPPED,
    CellStatus,
    CheckStatus,
    ColumnStatus,
    Verdict,
)
from builder.env.manifest import Manifest
from builder.formats import codec, jsondoc
from builder.formats.templates import templates
from builder.machine.archs import Arch
from builder.spec.envspec import CHECKS
from builder.verify.model import CheckResult, EnvFacts, Target

SCHEMA_VERSION = 1
# The grid's columns: the two stages before verification, then each check.
COLUMNS = ("resolve", "build", *CHECKS)


def timestamp() -> str:
    """Now, as every report spells its ``created``."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- verify


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    spec: str | None
    env: str | None
    python: str
    lock_hash: str | None
    archs: tuple[Arch, ...]
    versions: tuple[tuple[str, str], ...]
    checks: tuple[CheckResult, ...] = field(
        metadata=codec.meta(
            encode=lambda checks: [c.to_json() for c in checks],
            decode=lambda r, key: tuple(CheckResult.from_json(c) for c in r.subs(key)),
        )
    )
    seconds: float = field(metadata=codec.meta(places=3))
    created: str
    cudaenv: str = __version__

    json_form: ClassVar[codec.Form] = codec.Form(
        head={"schema_version": SCHEMA_VERSION, "kind": "verify"},
        keys=("cudaenv", "created", "spec", "env", "python", "lock_hash", "archs", "versions",
              "status", "seconds", "checks"),
        required=("cudaenv",),
    )  # fmt: skip

    @property
    def status(self) -> Verdict:
        return FAILED if any(c.status == FAILED for c in self.checks) else PASSED

    def check(self, name: str) -> CheckResult | None:
        return next((c for c in self.checks if c.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return codec.to_json(self)

    @classmethod
    def from_json(cls, doc: object, where: str) -> VerifyReport:
        return codec.from_json(cls, doc, where)


def verify_report(
    target: Target,
    facts: EnvFacts,
    results: Sequence[CheckResult],
    seconds: float,
    manifest: Manifest | None,
) -> VerifyReport:
    versions = [
        ("python", f"{facts.python_version} ({facts.python})"),
        (
            "torch",
            f"{facts.torch_version} (CUDA {facts.torch_cuda})" if facts.torch_version else "-",
        ),
        ("nvcc", facts.nvcc_release or "-"),
        ("cudart", facts.cudart_version or "-"),
        ("flashinfer", facts.flashinfer_version or "-"),
        ("CUDA_HOME", facts.cuda_home or "-"),
    ]
    return VerifyReport(
        spec=target.spec_name,
        env=str(target.env_dir) if target.env_dir else None,
        python=str(target.python),
        lock_hash=manifest.lock_hash if manifest else None,
        archs=target.archs,
        versions=tuple(versions),
        checks=tuple(results),
        seconds=seconds,
        created=timestamp(),
    )


# --------------------------------------------------------------------------- build record


@dataclass(frozen=True, kw_only=True)
class BuildRecord:
    """What a build (``cudaenv build --record FILE``, a matrix cell: buildrun.Run) ran into,
    for the matrix to read instead of scraping a log: the stage it ended in, the grid
    status, the reason, the exit code."""

    stage: str  # "resolve", "build" or "verify": the last stage that ran
    status: CellStatus
    reason: str
    exit_code: int
    verify: VerifyReport | None = None

    json_form: ClassVar[codec.Form] = codec.Form(
        head={"schema_version": SCHEMA_VERSION, "kind": "build"}
    )

    def to_json(self) -> dict[str, Any]:
        return codec.to_json(self)

    @classmethod
    def from_json(cls, doc: object, where: str) -> BuildRecord:
        return codec.from_json(cls, doc, where)


# --------------------------------------------------------------------------- matrix


@dataclass(frozen=True, kw_only=True)
class CellReport:
    name: str
    spec: str | None
    status: CellStatus
    reason: str
    values: tuple[tuple[str, str], ...]
    archs: tuple[Arch, ...]
    runs_on: tuple[str, ...]
    seconds: float = field(metadata=codec.meta(places=1))
    log: str | None
    # In COLUMNS order.
    columns: tuple[tuple[str, ColumnStatus], ...] = field(metadata=codec.meta(noun="status"))
    verify: VerifyReport | None

    json_form: ClassVar[codec.Form] = codec.Form(absent={"seconds": 0.0})

    def column(self, name: str) -> ColumnStatus:
        return dict(self.columns).get(name, "-")

    def to_json(self) -> dict[str, Any]:
        return codec.to_json(self)


def columns_of(
    status: CellStatus, verify: VerifyReport | None
) -> tuple[tuple[str, ColumnStatus], ...]:
    """Status per grid column: resolve, build, then each verification check. A check the
    spec does not run is ``-``; one a stopped cell never reached is ``not run``."""
    checks: dict[str, CheckStatus] = {c.name: c.status for c in verify.checks} if verify else {}
    cols: dict[str, ColumnStatus] = {"resolve": "passed", "build": "passed"}
    if status == "refused":
        cols = {"resolve": "refused", "build": "not run"}
    elif status in ("error", "not run") and not checks:
        cols = {"resolve": status, "build": "not run"}
    elif status == "failed" and not checks:
        cols["build"] = "failed"
    for name in CHECKS:
        cols[name] = checks.get(name, "not run" if status != "passed" else "-")
    return tuple(cols.items())


@dataclass(frozen=True, kw_only=True)
class MatrixReport:
    name: str
    created: str
    cells: tuple[CellReport, ...]
    columns: tuple[str, ...] = COLUMNS

    json_form: ClassVar[codec.Form] = codec.Form(
        head={"schema_version": SCHEMA_VERSION, "kind": "matrix"},
        keys=("name", "created", "status", "columns", "cells"),
        required=("columns",),
    )

    @property
    def status(self) -> Verdict:
        bad = [c for c in self.cells if c.status not in ("passed", "refused")]
        return "failed" if bad else "passed"

    def never_ran(self) -> tuple[tuple[str, str], ...]:
        """Each check no built cell ran (skipped or not run in every one: the GPU check on a
        runner without a GPU), with the first cell's reason: a "passed" matrix says it
        proved nothing there."""
        built = [c for c in self.cells if c.verify is not None]
        out: list[tuple[str, str]] = []
        for col in CHECKS:
            statuses = {c.column(col) for c in built}
            if built and statuses <= {SKIPPED, "not run", "-"}:
                found = [c.verify.check(col) for c in built if c.verify is not None]
                check = next((f for f in found if f is not None), None)
                out.append((col, check.summary if check is not None else "not run"))
        return tuple(out)

    def to_json(self) -> dict[str, Any]:
        return codec.to_json(self)

    @classmethod
    def from_json(cls, doc: object, where: str) -> MatrixReport:
        return codec.from_json(cls, doc, where)


AnyReport = VerifyReport | MatrixReport


def read_report(path: Path) -> AnyReport:
    """A verify or matrix report file; ReportError (exit 2) for anything else."""
    doc = jsondoc.load(path, "report")
    where = str(path)
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind == "verify":
        return VerifyReport.from_json(doc, where)
    if kind == "matrix":
        return MatrixReport.from_json(doc, where)
    raise ReportError(
        f"{path}: not a cudaenv verify or matrix report (kind is {kind!r}); reports are "
        "written by `cudaenv verify --report` and `cudaenv matrix`"
    )


def merge(reports: Sequence[AnyReport], name: str = "merged") -> MatrixReport:
    """Join verify reports (one per CI runner) and matrix reports into one matrix report;
    a later cell of the same name replaces an earlier one."""
    cells: dict[str, CellReport] = {}
    for rep in reports:
        if isinstance(rep, MatrixReport):
            cells.update((c.name, c) for c in rep.cells)
            continue
        cname = rep.spec or rep.python
        status = rep.status
        cells[cname] = CellReport(
            name=cname,
            spec=rep.spec,
            status=status,
            reason="",
            values=(),
            archs=rep.archs,
            runs_on=(),
            seconds=rep.seconds,
            log=None,
            columns=columns_of(status, rep),
            verify=rep,
        )
    return MatrixReport(name=name, created=timestamp(), cells=tuple(cells.values()))


@dataclass(frozen=True, kw_only=True, order=True)
class Regression:
    cell: str
    column: str
    before: ColumnStatus
    now: ColumnStatus | Literal["missing"]  # "missing": the cell is gone from the new report

    @property
    def key(self) -> str:
        return f"{self.cell}: {self.column}"

    def __str__(self) -> str:
        return f"{self.key} {self.before} before, {self.now} now"


def regressions(old: MatrixReport, new: MatrixReport) -> list[Regression]:
    """(cell, column) that passed in ``old`` and do not now; a cell gone from ``new`` is one."""
    current = {c.name: c for c in new.cells}
    out = []
    for prev in old.cells:
        cell = current.get(prev.name)
        for col, status in prev.columns:
            if status != "passed":
                continue
            now = cell.column(col) if cell else "missing"
            if now != "passed":
                out.append(Regression(cell=prev.name, column=col, before=status, now=now))
    return out


# --------------------------------------------------------------------------- renderings


def write_json(report: VerifyReport | MatrixReport | BuildRecord, path: Path) -> Path:
    """Atomically: a reader never sees half a report."""
    return atomic_write_text(path, json.dumps(report.to_json(), indent=2) + "\n")


def terminal(report: VerifyReport) -> str:
    rows = [(c.name, c.status.upper(), f"{c.seconds:.1f}s", c.summary) for c in report.checks]
    w0 = max([len(r[0]) for r in rows] + [5])
    w1 = max([len(r[1]) for r in rows] + [6])
    lines = [
        f"verify {report.spec or report.python}: {report.status.upper()} in {report.seconds:.1f} s"
    ]
    for name, status, secs, summary in rows:
        lines.append(f"  {name:<{w0}}  {status:<{w1}}  {secs:>7}  {summary}")
    for c in report.checks:
        if c.status == FAILED and c.fix:
            lines.append(f"  fix ({c.name}): {c.fix}")
        lines += [f"  warning ({c.name}): {w}" for w in c.warnings]
    return "\n".join(lines)


def markdown(report: VerifyReport) -> str:
    return templates().get_template("verify.md.j2").render(report=report.to_json())


def headline(reason: str, limit: int = 400) -> str:
    """A cell's reason on one line, cause first: a refusal's header ("NAME (SPEC): refused by
    the matching policy, nothing was installed:") gives way to its causes ("torch 2.14.1 is
    built for CUDA 13.0 ..."), which are what a reader of the console or matrix.md needs."""
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    if not lines:
        return ""
    causes = [ln.removeprefix("- ") for ln in lines[1:] if ln.startswith("- ")]
    if "refused by the matching policy" in lines[0] and causes:
        text = "refused: " + "; ".join(causes)
    else:
        text = " ".join(lines)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def matrix_markdown(report: MatrixReport, regressions: Sequence[Regression] = ()) -> str:
    env = templates()
    env.filters["headline"] = headline
    return env.get_template("matrix.md.j2").render(
        doc=report.to_json(), regressions=[str(r) for r in regressions],
        never_ran=report.never_ran(),
    )  # fmt: skip


def matrix_html(report: MatrixReport, regressions: Sequence[Regression] = ()) -> str:
    # Autoescape here: cell names, reasons and versions come from specs and tool output.
    env = templates()
    env.autoescape = True
    return env.get_template("matrix.html.j2").render(
        doc=report.to_json(),
        regressions=[str(r) for r in regressions],
        regression_keys={r.key for r in regressions},
        never_ran=report.never_ran(),
    )


def matrix_junit(report: MatrixReport) -> str:
    """JUnit XML: one testsuite, one testcase per cell x column (what CI test tabs read)."""
    from xml.etree import ElementTree as ET

    cases = [(c, col) for c in report.cells for col in report.columns]
    failures = sum(1 for c, col in cases if c.column(col) in ("failed", "error"))
    skipped = sum(1 for c, col in cases if c.column(col) not in ("passed", "failed", "error"))
    counts = {
        "tests": str(len(cases)),
        "failures": str(failures),
        "errors": "0",
        "skipped": str(skipped),
    }
    suites = ET.Element("testsuites", {"name": f"cudaenv matrix {report.name}", **counts})
    suite = ET.SubElement(
        suites, "testsuite", {"name": report.name, "timestamp": report.created, **counts}
    )
    for cell, col in cases:
        status = cell.column(col)
        case = ET.SubElement(suite, "testcase", classname=cell.name, name=col, time="0")
        check = cell.verify.check(col) if cell.verify else None
        if check is not None:
            case.set("time", str(round(check.seconds, 3)))
        message = (check.summary if check else "") or cell.reason or status
        if status in ("failed", "error"):
            ET.SubElement(case, "failure", message=message[:500], type=status).text = message
        elif status == "-":
            ET.SubElement(case, "skipped", message="not among this spec's checks")
        elif status != "passed":
            ET.SubElement(case, "skipped", message=f"{status}: {message}"[:500])
    ET.indent(suites)
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
    )


def write_matrix_outputs(
    report: MatrixReport, out: Path, regressions: Sequence[Regression] = ()
) -> list[Path]:
    """matrix.json, matrix.html, matrix.md and junit.xml in ``out``, each written atomically;
    the Markdown is also appended to ``$GITHUB_STEP_SUMMARY`` when set."""
    md = matrix_markdown(report, regressions)
    written = [
        write_json(report, out / "matrix.json"),
        atomic_write_text(out / "matrix.html", matrix_html(report, regressions)),
        atomic_write_text(out / "matrix.md", md),
        atomic_write_text(out / "junit.xml", matrix_junit(report)),
    ]
    append_step_summary(md)
    return written


def append_step_summary(markdown_text: str, environ: Mapping[str, str] | None = None) -> bool:
    """Append the Markdown to ``$GITHUB_STEP_SUMMARY`` when set: only to a regular file, opened
    without following a link and without waiting (a FIFO named there would hold the command
    until a reader came); anything else is left alone. Whether it was appended."""
    summary = settings.of(environ).github_step_summary
    if not summary:
        return False
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(summary, flags, 0o644)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        data = memoryview((markdown_text + "\n").encode())
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        return False
    finally:
        os.close(fd)
    return True
