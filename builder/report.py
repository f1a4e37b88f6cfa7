"""The Report model and its renderings (templates/): JSON, a terminal table, Markdown."""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder import __version__
from builder.toolchain import templates
from builder.verify import FAILED, CheckResult, EnvFacts, Target

SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Report:
    kind: str
    spec: str | None
    env: str | None
    python: str
    lock_hash: str | None
    archs: tuple[str, ...]
    versions: tuple[tuple[str, str], ...]
    checks: tuple[CheckResult, ...]
    seconds: float
    created: str

    @property
    def status(self) -> str:
        return FAILED if any(c.status == FAILED for c in self.checks) else "passed"

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "cudaenv": __version__,
            "created": self.created,
            "spec": self.spec,
            "env": self.env,
            "python": self.python,
            "lock_hash": self.lock_hash,
            "archs": list(self.archs),
            "versions": dict(self.versions),
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "checks": [c.to_json() for c in self.checks],
        }


def verify_report(
    target: Target,
    facts: EnvFacts,
    results: Sequence[CheckResult],
    seconds: float,
    manifest: Mapping[str, object] | None,
) -> Report:
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
    lock_hash = manifest.get("lock_hash") if manifest else None
    return Report(
        kind="verify",
        spec=target.spec_name,
        env=str(target.env_dir) if target.env_dir else None,
        python=str(target.python),
        lock_hash=str(lock_hash) if lock_hash else None,
        archs=target.archs,
        versions=tuple(versions),
        checks=tuple(results),
        seconds=seconds,
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    )


def write_json(report: Report, path: Path) -> None:
    """Atomically: a reader never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    os.replace(tmp, path)


def terminal(report: Report) -> str:
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
    return "\n".join(lines)


def markdown(report: Report) -> str:
    return templates().get_template("verify.md.j2").render(report=report.to_json())


def matrix_markdown(doc: Mapping[str, Any], regressions: Sequence[str] = ()) -> str:
    return templates().get_template("matrix.md.j2").render(doc=doc, regressions=list(regressions))


def matrix_html(doc: Mapping[str, Any], regressions: Sequence[str] = ()) -> str:
    # Autoescape here: cell names, reasons and versions come from specs and tool output.
    env = templates()
    env.autoescape = True
    keys = {r.split(" passed before")[0] for r in regressions}
    return env.get_template("matrix.html.j2").render(
        doc=doc, regressions=list(regressions), regression_keys=keys
    )


def matrix_junit(doc: Mapping[str, Any]) -> str:
    """JUnit XML: one testsuite, one testcase per cell x column (what CI test tabs read)."""
    from xml.etree import ElementTree as ET

    cells = doc.get("cells", [])
    cases = [(c, col) for c in cells for col in doc.get("columns", [])]
    failures = sum(1 for c, col in cases if c["columns"].get(col) in ("failed", "error"))
    skipped = sum(
        1 for c, col in cases if c["columns"].get(col) not in ("passed", "failed", "error")
    )
    suites = ET.Element(
        "testsuites",
        name=f"cudaenv matrix {doc.get('name')}",
        tests=str(len(cases)),
        failures=str(failures),
        errors="0",
        skipped=str(skipped),
    )
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=str(doc.get("name")),
        tests=str(len(cases)),
        failures=str(failures),
        errors="0",
        skipped=str(skipped),
        timestamp=str(doc.get("created", "")),
    )
    for cell, col in cases:
        status = cell["columns"].get(col, "-")
        case = ET.SubElement(suite, "testcase", classname=cell["name"], name=col, time="0")
        check = next(
            (c for c in (cell.get("verify") or {}).get("checks", []) if c["name"] == col), None
        )
        if check is not None:
            case.set("time", str(check.get("seconds", 0)))
        message = (check or {}).get("summary") or cell.get("reason") or status
        if status in ("failed", "error"):
            ET.SubElement(case, "failure", message=str(message)[:500], type=status).text = str(
                message
            )
        elif status == "-":
            ET.SubElement(case, "skipped", message="not among this spec's checks")
        elif status != "passed":
            ET.SubElement(case, "skipped", message=f"{status}: {message}"[:500])
    ET.indent(suites)
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
    )
