"""Release matrices run: each cell of a matrix file (builder/spec/matrixfile.py) built and
verified, several at once (``-j``), one report of them all, regressions against a baseline.

Each cell is a `cudaenv build` of one spec (commands.args.BuildArgs), in a process of its own
(``python -m builder.cli build SPEC --env-dir ... --verify --record ...``) started through
builder/core/proc.py, rather than in a thread: each cell's uv and nvcc output lands in its own log,
and a cell that crashes or is killed costs that cell only. A pool thread waits for its cell's
process (a child dies with the thread that started it: proc.py). Each cell writes a
structured build record (report.BuildRecord) that the grid is made from. uv's cache is shared
(envs are hard links into it) and an unchanged cell reuses its env and JIT cache.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from builder.commands.args import BuildArgs, MatrixArgs
from builder.core import context, proc
from builder.core.errors import STATUS_OF_EXIT, CudaenvError, ReportError, UsageError
from builder.core.reporter import Reporter
from builder.core.statuses import CellStatus
from builder.formats import jsondoc
from builder.spec import matrixfile
from builder.spec.matrixfile import Cell, Matrix
from builder.verify import report
from builder.verify.report import Regression


@dataclass(frozen=True, kw_only=True)
class CellResult:
    cell: Cell
    status: CellStatus
    reason: str
    seconds: float
    log: Path | None
    verify: report.VerifyReport | None = None


def cell_request(matrix: Matrix, cell: Cell, record: Path) -> BuildArgs:
    """What a cell runs: build and verify its spec into the matrix's own env directory."""
    return BuildArgs(
        specs=(cell.spec_path,),
        env_dir=matrix.env_dir(cell).absolute(),
        verify=True,
        record=record,
        # The cell's lock is the matrix's own: re-resolve it when the base spec changed.
        relock=cell.generated,
    )


def cell_argv(request: BuildArgs) -> list[str]:
    """The cell's process: `cudaenv build` with the request's arguments (the module's
    docstring says why a process and not a thread)."""
    return [sys.executable, "-m", "builder.cli", "build", *request.argv()]


def run_cell(matrix: Matrix, cell: Cell, out: Path) -> CellResult:
    out = out.absolute()
    log_path = out / "logs" / f"{cell.name}.log"
    record_path = out / "cells" / f"{cell.name}.json"
    record_path.parent.mkdir(parents=True, exist_ok=True)
    record_path.unlink(missing_ok=True)
    matrixfile.write_cell_spec(cell)
    request = cell_request(matrix, cell, record_path)
    started = time.monotonic()
    try:
        done = proc.run(cell_argv(request), check=False, log_file=log_path)
        code = done.returncode
    except CudaenvError as exc:
        return CellResult(
            cell=cell, status="error", reason=str(exc)[:600], seconds=0.0, log=log_path
        )
    seconds = time.monotonic() - started
    try:
        rec = report.BuildRecord.from_json(
            jsondoc.load(record_path, "build record"), str(record_path)
        )
    except ReportError:
        # The cell died before it could say why (killed, a crash): the exit code is all.
        status = STATUS_OF_EXIT.get(code, "error")
        reason = f"exit {code} without a build record; see {log_path.name}"
        return CellResult(cell=cell, status=status, reason=reason, seconds=seconds, log=log_path)
    return CellResult(
        cell=cell,
        status=rec.status,
        reason=rec.reason[:600],
        seconds=seconds,
        log=log_path,
        verify=rec.verify,
    )


def run(
    matrix: Matrix,
    out: Path,
    *,
    jobs: int = 2,
    fail_fast: bool = False,
    progress: Callable[[str], None] = lambda _m: None,
) -> list[CellResult]:
    results: dict[str, CellResult] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        cell_of = context.carried(run_cell)  # the command's values (its driver) for each cell
        futures = {pool.submit(cell_of, matrix, cell, out): cell for cell in matrix.cells}
        for fut in concurrent.futures.as_completed(futures):
            cell = futures[fut]
            result = fut.result()
            results[cell.name] = result
            progress(
                f"{cell.name}: {result.status} in {result.seconds:.0f} s "
                f"{report.headline(result.reason)}"
            )
            if fail_fast and result.status not in ("passed", "refused"):
                for other in futures:
                    other.cancel()
    for cell in matrix.cells:
        results.setdefault(
            cell.name,
            CellResult(cell=cell, status="not run", reason="--fail-fast", seconds=0.0, log=None),
        )
    return [results[c.name] for c in matrix.cells]


def matrix_report(name: str, results: Sequence[CellResult], out: Path) -> report.MatrixReport:
    cells = tuple(
        report.CellReport(
            name=r.cell.name,
            spec=str(r.cell.spec_path),
            status=r.status,
            reason=r.reason,
            values=r.cell.values,
            archs=r.cell.archs,
            runs_on=r.cell.runs_on,
            seconds=r.seconds,
            log=os.path.relpath(r.log, out.absolute()) if r.log else None,
            columns=report.columns_of(r.status, r.verify),
            verify=r.verify,
        )
        for r in results
    )
    return report.MatrixReport(name=name, created=report.timestamp(), cells=cells)


# --------------------------------------------------------------------------- the command


@dataclass(frozen=True, kw_only=True)
class MatrixRun:
    """A matrix run: each cell's result, the report, and the regressions against the
    baseline (None without one)."""

    name: str
    results: tuple[CellResult, ...]
    report: report.MatrixReport
    regressions: tuple[Regression, ...] | None

    @property
    def exit_code(self) -> int:
        """With a baseline, 1 for a regression only; else 1 unless every cell passed."""
        if self.regressions is not None:
            return 1 if self.regressions else 0
        return 0 if self.report.status == "passed" else 1


def read_baseline(path: Path) -> report.MatrixReport:
    rep = report.read_report(path)
    if not isinstance(rep, report.MatrixReport):
        raise ReportError(
            f"{path}: --baseline needs a matrix report (matrix.json), not a verify report"
        )
    return rep


def prepare(request: MatrixArgs) -> tuple[Matrix, report.MatrixReport | None]:
    """The matrix (one cell with ``request.cell``) and its baseline, every argument checked
    before any cell runs: a typo must not cost a matrix run."""
    if request.jobs < 1:
        raise UsageError(f"-j {request.jobs}: run at least one cell at a time")
    baseline = read_baseline(request.baseline) if request.baseline else None
    mx = matrixfile.load(request.file)
    if request.cell:
        # One cell, run and judged exactly as in the whole matrix (a refused cell is a
        # result, exit 0): what a CI job per cell runs, so both agree.
        mx = dataclasses.replace(mx, cells=(mx.cell(request.cell),))
    return mx, baseline


def run_matrix(request: MatrixArgs, reporter: Reporter) -> MatrixRun:
    """Run every cell, write the reports (matrix.json, .html, .md, junit.xml)."""
    mx, baseline = prepare(request)
    out = request.out or mx.root / "report"
    reporter(
        f"matrix {mx.name}: {len(mx.cells)} cells, {request.jobs} at a time; logs in {out}/logs"
    )
    results = run(mx, out, jobs=request.jobs, fail_fast=request.fail_fast, progress=reporter)
    rep = matrix_report(mx.name, results, out)
    found = report.regressions(baseline, rep) if baseline else []
    written = report.write_matrix_outputs(rep, out, found)
    reporter("reports: " + ", ".join(str(p) for p in written))
    return MatrixRun(
        name=mx.name,
        results=tuple(results),
        report=rep,
        regressions=tuple(found) if baseline is not None else None,
    )
