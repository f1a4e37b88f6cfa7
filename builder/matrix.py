"""Release matrices: expand a matrix file into cells, run them, aggregate one report.

A matrix file is either a list of spec files (``specs:``) or a base spec plus axes, with
``exclude:`` / ``include:`` as in CI matrices. Each cell gets a stable name from its axis
values and a generated spec (``extends:`` the base) under ``.envs/.matrix/MATRIX/``. Cells
run as ``cudaenv build --verify`` subprocesses, several at once (``-j``): uv's cache is shared
(envs are hard links into it) and an unchanged cell reuses its env and JIT cache.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from builder import spec as specs
from builder.errors import SpecError

AXES = ("torch", "cuda", "python", "flashinfer", "sglang", "archs")
MATRIX_KEYS = ("name", "specs", "base", "axes", "exclude", "include", "runners")
SHORT = {
    "torch": "torch",
    "cuda": "cu",
    "python": "py",
    "flashinfer": "fi",
    "sglang": "sglang",
    "archs": "sm",
}
PACKAGE_OF = {"flashinfer": "flashinfer-python", "sglang": "sglang"}
MATRIX_DIR = Path(".envs") / ".matrix"
CHECK_COLUMNS = ("resolve", "build", *specs.CHECKS)
EXIT_STATUS = {0: "passed", 2: "error", 3: "refused", 4: "failed", 5: "failed", 6: "error"}


@dataclass(frozen=True, kw_only=True)
class Cell:
    name: str
    spec_path: Path
    values: tuple[tuple[str, str], ...] = ()
    archs: tuple[str, ...] = ()
    runs_on: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Matrix:
    name: str
    source: Path
    cells: tuple[Cell, ...]

    def cell(self, name: str) -> Cell:
        for c in self.cells:
            if c.name == name:
                return c
        raise SpecError(
            [f"{self.source}:1:1: no cell {name!r}; cells: {', '.join(c.name for c in self.cells)}"]
        )


def _err(path: Path, where: str, message: str) -> SpecError:
    return SpecError([f"{path}:1:1: {where}: {message}"])


def _text(value: object) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


def cell_name(values: Mapping[str, object]) -> str:
    parts = []
    for axis in AXES:
        if axis in values:
            v = _text(values[axis]).replace(" ", "+")
            parts.append(f"{SHORT[axis]}{v}")
    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", "-".join(parts))
    return name[:100] or "cell"


def load(path: Path, out_root: Path | None = None) -> Matrix:
    """Expand a matrix file; writes each cell's generated spec. Raises SpecError."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise _err(path, "matrix", f"cannot read: {exc}") from exc
    if not isinstance(raw, dict):
        raise _err(path, "matrix", "a matrix file is a YAML mapping")
    unknown = [k for k in raw if k not in MATRIX_KEYS]
    if unknown:
        raise _err(path, unknown[0], f"unknown key; expected one of: {', '.join(MATRIX_KEYS)}")
    name = str(raw.get("name") or path.stem)
    runners = raw.get("runners") or {}
    if not isinstance(runners, dict):
        raise _err(path, "runners", "expected a mapping of arch -> runner labels")
    out_dir = (out_root or MATRIX_DIR) / name
    cells: list[Cell] = []
    if "specs" in raw:
        for i, item in enumerate(raw["specs"] or []):
            spec_path = (path.parent / str(item)).resolve()
            try:
                s = specs.load(spec_path)
            except SpecError as exc:
                raise SpecError([f"{path}:1:1: specs[{i}]: {p}" for p in exc.problems]) from exc
            cells.append(
                Cell(
                    name=s.name,
                    spec_path=spec_path,
                    values=(("spec", s.name),),
                    archs=s.archs,
                    runs_on=runs_on(runners, s.archs),
                )
            )
    if "base" not in raw:
        if not cells:
            raise _err(path, "matrix", "needs `specs:` or `base:` with `axes:`")
        return Matrix(name=name, source=path, cells=tuple(cells))
    base_path = (path.parent / str(raw["base"])).resolve()
    base = specs.load(base_path)
    combos = expand(path, raw.get("axes") or {}, raw.get("exclude") or [], raw.get("include") or [])
    out_dir.mkdir(parents=True, exist_ok=True)
    seen: set[str] = {c.name for c in cells}
    for values in combos:
        cname = cell_name(values)
        if cname in seen:
            continue
        seen.add(cname)
        spec_path = write_cell_spec(out_dir, cname, base, base_path, values)
        archs = tuple(values["archs"]) if isinstance(values.get("archs"), list) else base.archs
        cells.append(
            Cell(
                name=cname,
                spec_path=spec_path,
                values=tuple((k, _text(v)) for k, v in values.items()),
                archs=archs,
                runs_on=runs_on(runners, archs),
            )
        )
    return Matrix(name=name, source=path, cells=tuple(cells))


def expand(
    path: Path, axes: Mapping[str, Any], exclude: Sequence[Any], include: Sequence[Any]
) -> list[dict[str, Any]]:
    if not isinstance(axes, dict):
        raise _err(path, "axes", "expected a mapping of axis -> values")
    lists: list[list[dict[str, Any]]] = []
    for axis, values in axes.items():
        keys = str(axis).split("+")
        for key in keys:
            if key not in AXES:
                raise _err(path, f"axes.{axis}", f"unknown axis {key!r}; axes: {', '.join(AXES)}")
        if not isinstance(values, list) or not values:
            raise _err(path, f"axes.{axis}", "expected a non-empty list")
        options = []
        for i, value in enumerate(values):
            if len(keys) > 1:
                if not isinstance(value, dict) or sorted(value) != sorted(keys):
                    raise _err(
                        path, f"axes.{axis}[{i}]", f"expected a mapping with keys {', '.join(keys)}"
                    )
                options.append({k: value[k] for k in keys})
            else:
                options.append({keys[0]: value})
        lists.append(options)
    combos = [
        dict(kv for part in product for kv in part.items()) for product in itertools.product(*lists)
    ]
    for i, rule in enumerate(exclude):
        if not isinstance(rule, dict):
            raise _err(path, f"exclude[{i}]", "expected a mapping")
    combos = [
        c
        for c in combos
        if not any(all(_text(c.get(k)) == _text(v) for k, v in rule.items()) for rule in exclude)
    ]
    for i, extra in enumerate(include):
        if not isinstance(extra, dict) or any(k not in AXES for k in extra):
            raise _err(path, f"include[{i}]", f"expected a mapping of axes ({', '.join(AXES)})")
        combos.append(dict(extra))
    return combos


def write_cell_spec(
    out_dir: Path, name: str, base: specs.EnvSpec, base_path: Path, values: Mapping[str, Any]
) -> Path:
    doc: dict[str, Any] = {"extends": os.path.relpath(base_path, out_dir), "name": name}
    for key in ("torch", "cuda", "python"):
        if key in values:
            doc[key] = str(values[key])
    if "archs" in values:
        doc["archs"] = [
            str(a)
            for a in (values["archs"] if isinstance(values["archs"], list) else [values["archs"]])
        ]
    packages = list(base.packages)
    for axis, package in PACKAGE_OF.items():
        if axis in values:
            pin = f"{package}=={values[axis]}"
            replaced = [
                pin if canonicalize_name(Requirement(p).name) == package else p for p in packages
            ]
            packages = replaced if pin in replaced else [*packages, pin]
    if packages != list(base.packages):
        doc["packages"] = packages
    path = out_dir / f"{name}.yaml"
    text = "# Generated by cudaenv matrix; do not edit.\n" + yaml.safe_dump(doc, sort_keys=False)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def runs_on(runners: Mapping[str, Any], archs: Sequence[str]) -> tuple[str, ...]:
    labels: list[str] = []
    for arch in archs:
        for label in runners.get(arch, []) or []:
            if str(label) not in labels:
                labels.append(str(label))
    if not labels:
        labels = [str(x) for x in runners.get("default", ["ubuntu-latest"])]
    return tuple(labels)


def resolve_spec_arg(arg: str) -> Path:
    """``MATRIX.yaml:CELL`` -> that cell's generated spec; anything else is a spec path."""
    if ":" in arg:
        file, _, cell = arg.rpartition(":")
        if file.endswith((".yaml", ".yml")) and Path(file).is_file() and cell:
            return load(Path(file)).cell(cell).spec_path
    return Path(arg)


# --------------------------------------------------------------------------- running


@dataclass(frozen=True, kw_only=True)
class CellResult:
    cell: Cell
    status: str  # passed | failed | refused | error | not run
    reason: str
    seconds: float
    log: Path | None
    report: Mapping[str, Any] | None = None


def run_cell(cell: Cell, out: Path) -> CellResult:
    out = out.absolute()
    log_path = out / "logs" / f"{cell.name}.log"
    report_path = out / "cells" / f"{cell.name}.json"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.unlink(missing_ok=True)
    started = time.monotonic()
    with log_path.open("w") as fh:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "builder.cli",
                "build",
                "--verify",
                str(cell.spec_path),
                "--report",
                str(report_path),
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            check=False,
        )
    seconds = time.monotonic() - started
    text = log_path.read_text(errors="replace")
    errors = [ln[len("error: ") :] for ln in text.splitlines() if ln.startswith("error: ")]
    status = EXIT_STATUS.get(done.returncode, "error")
    reason = "; ".join(errors)[:600] or ("" if status == "passed" else f"exit {done.returncode}")
    if status == "refused":
        reason = (
            " ".join(ln.strip() for ln in text.splitlines() if ln.strip().startswith("- "))[:600]
            or reason
        )
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return CellResult(
        cell=cell, status=status, reason=reason, seconds=seconds, log=log_path, report=report
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
        futures = {pool.submit(run_cell, cell, out): cell for cell in matrix.cells}
        for fut in concurrent.futures.as_completed(futures):
            cell = futures[fut]
            result = fut.result()
            results[cell.name] = result
            progress(
                f"{cell.name}: {result.status} in {result.seconds:.0f} s {result.reason[:120]}"
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


# --------------------------------------------------------------------------- the report


def cell_checks(status: str, report: Mapping[str, Any] | None) -> dict[str, str]:
    """Status per grid column: resolve, build, then each verification check."""
    checks = {c["name"]: c["status"] for c in (report or {}).get("checks", [])}
    cols = {"resolve": "passed", "build": "passed"}
    if status == "refused":
        cols = {"resolve": "refused", "build": "not run"}
    elif status in ("error", "not run") and not checks:
        cols = {"resolve": status, "build": "not run"}
    elif status == "failed" and not checks:
        cols["build"] = "failed"
    for name in specs.CHECKS:
        cols[name] = checks.get(name, "not run" if status != "passed" else "-")
    return cols


def matrix_report(name: str, results: Sequence[CellResult], out: Path) -> dict[str, Any]:
    cells = []
    for r in results:
        cells.append(
            {
                "name": r.cell.name,
                "spec": str(r.cell.spec_path),
                "status": r.status,
                "reason": r.reason,
                "values": dict(r.cell.values),
                "archs": list(r.cell.archs),
                "runs_on": list(r.cell.runs_on),
                "seconds": round(r.seconds, 1),
                "log": os.path.relpath(r.log, out) if r.log else None,
                "columns": cell_checks(r.status, r.report),
                "verify": r.report,
            }
        )
    return aggregate(name, cells)


def aggregate(name: str, cells: list[dict[str, Any]]) -> dict[str, Any]:
    bad = [c for c in cells if c["status"] not in ("passed", "refused")]
    return {
        "schema_version": 1,
        "kind": "matrix",
        "name": name,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "status": "failed" if bad else "passed",
        "columns": list(CHECK_COLUMNS),
        "cells": cells,
    }


def merge(docs: Sequence[Mapping[str, Any]], name: str = "merged") -> dict[str, Any]:
    """Join verify reports (one per CI runner) and matrix reports into one matrix report."""
    cells: dict[str, dict[str, Any]] = {}
    for doc in docs:
        if doc.get("kind") == "matrix":
            for c in doc.get("cells", []):
                cells[c["name"]] = dict(c)
        elif doc.get("kind") == "verify":
            cname = str(doc.get("spec") or doc.get("python"))
            status = "failed" if doc.get("status") == "failed" else "passed"
            cells[cname] = {
                "name": cname,
                "spec": doc.get("spec"),
                "status": status,
                "reason": "",
                "values": {},
                "archs": doc.get("archs", []),
                "runs_on": [],
                "seconds": doc.get("seconds", 0),
                "log": None,
                "columns": cell_checks(status, doc),
                "verify": dict(doc),
            }
        else:
            raise SpecError([f"report merge: not a cudaenv report (kind={doc.get('kind')!r})"])
    return aggregate(name, list(cells.values()))


def regressions(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """(cell, column) that passed in ``old`` and do not now."""
    before = {c["name"]: c for c in old.get("cells", [])}
    out = []
    for cell in new.get("cells", []):
        prev = before.get(cell["name"])
        if not prev:
            continue
        for col, status in prev.get("columns", {}).items():
            if status == "passed" and cell.get("columns", {}).get(col) != "passed":
                out.append(
                    f"{cell['name']}: {col} passed before, {cell.get('columns', {}).get(col, 'missing')} now"
                )
    return out


def github_matrix(matrix: Matrix) -> dict[str, Any]:
    return {
        "include": [
            {
                "cell": c.name,
                "spec": f"{matrix.source}:{c.name}"
                if c.values and c.values[0][0] != "spec"
                else os.path.relpath(c.spec_path),
                "runs-on": list(c.runs_on),
            }
            for c in matrix.cells
        ]
    }
