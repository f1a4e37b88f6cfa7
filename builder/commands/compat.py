"""`cudaenv compat`: stacks as rows, GPU classes x platform x driver as columns, each cell a
stack's verdict on that class from its lock's own wheels (:mod:`builder.audit.fleet`).

Without a fleet file the columns are the common classes: the compute capabilities clouds and
clusters run (7.5 T4 ... 12.1 DGX Spark) on both platforms, each on a 570 and a 580 driver.
The table is data first (:meth:`Table.to_json`); the terminal text, Markdown and the HTML
page are renderings of it, and the docs site's page is the Markdown of a committed JSON file,
so a test can tell a stale page from the locks alone, without a wheel.
"""

from __future__ import annotations

import html as html_mod
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from builder.audit import fleet
from builder.commands import pipeline
from builder.core import platforms, proc
from builder.core.errors import CudaenvError, ReportError
from builder.core.reporter import Reporter
from builder.formats import codec
from builder.formats.yamldoc import Problems, compose
from builder.machine import targets
from builder.machine.archs import Arch
from builder.machine.targets import Target
from builder.spec import envspec as spec
from builder.spec import lock, matrixfile

# The classes the table shows by default: (compute capability, a GPU of it).
COMMON: tuple[tuple[tuple[int, int], str], ...] = (
    ((7, 5), "T4"),
    ((8, 0), "A100"),
    ((8, 6), "A10 / RTX A6000"),
    ((8, 9), "L4 / L40S"),
    ((9, 0), "H100 / H200 / GH200"),
    ((10, 0), "B200 / GB200"),
    ((10, 3), "B300 / GB300"),
    ((11, 0), "Thor"),
    ((12, 0), "RTX PRO 6000"),
    ((12, 1), "DGX Spark (GB10)"),
)
DRIVERS = ("570", "580")
SCHEMA_VERSION = 1


def common_targets() -> tuple[Target, ...]:
    out = []
    for platform in platforms.KNOWN:
        for drv in DRIVERS:
            for (major, minor), _ in COMMON:
                arch = Arch(major=major, minor=minor)
                out.append(
                    Target(
                        name=f"sm{arch.major}{arch.minor}-{platform.removeprefix('linux-')}-{drv}",
                        cc=arch,
                        platform=platform,
                        driver=drv,
                    )
                )
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Row:
    stack: str  # the spec's name
    source: str  # the spec file (or MATRIX:CELL)
    lock: str  # the lock's content hash it was judged from ("" when none)
    cuda: str
    verdicts: tuple[fleet.Verdict, ...] = ()
    error: str | None = None  # why the stack could not be judged (no lock, ...)

    json_form: ClassVar[codec.Form] = codec.Form(
        keys=("stack", "source", "lock", "cuda", "error", "verdicts"), required=("verdicts",)
    )

    def to_json(self) -> dict[str, object]:
        return codec.to_json(self)


@dataclass(frozen=True, kw_only=True)
class Table:
    targets: tuple[Target, ...]
    rows: tuple[Row, ...]

    json_form: ClassVar[codec.Form] = codec.Form(
        what="compatibility table", head={"schema_version": SCHEMA_VERSION}
    )

    def to_json(self) -> dict[str, object]:
        return codec.to_json(self)


def from_json(doc: dict[str, object], where: str = "compat.json") -> Table:
    """The table :meth:`Table.to_json` wrote; ValueError naming the key of anything else
    (another schema included)."""
    try:
        return codec.from_json(Table, doc, where)
    except ReportError as exc:
        raise ValueError(str(exc)) from exc


def _is_matrix(path: Path) -> bool:
    root = compose(path, Problems(), what="file")
    return (
        root is not None
        and isinstance(root.value, dict)
        and bool({"axes", "specs", "base"} & set(root.value))
    )


def stacks(args: Sequence[Path]) -> list[tuple[str, spec.EnvSpec]]:
    """(label, spec) for each SPEC argument, a matrix file giving each of its cells."""
    out: list[tuple[str, spec.EnvSpec]] = []
    for arg in args:
        if arg.is_file() and _is_matrix(arg):
            mx = matrixfile.load(arg)
            out += [(f"{arg}:{c.name}", mx.spec_of(c)) for c in mx.cells]
        else:
            out.append((str(arg), pipeline.load_spec(arg)))
    return out


def tabulate(args: Sequence[Path], targets_file: Path | None, reporter: Reporter) -> Table:
    fleet_ = targets.load_file(targets_file) if targets_file is not None else common_targets()
    rows: list[Row] = []
    for label, s in stacks(args):
        try:
            lk = pipeline.committed_lock(s, label)
            reporter(f"judging {s.name} for {len(fleet_)} targets")
            done = pipeline.judge_targets(s, lk, fleet_, reporter)
        except CudaenvError as exc:
            rows.append(Row(stack=s.name, source=label, lock="", cuda=s.cuda, error=str(exc)))
            continue
        rows.append(
            Row(
                stack=s.name,
                source=label,
                lock=lk.content_hash(),
                cuda=str(fleet.lock_cuda(s, lk)),
                verdicts=done.verdicts,
            )
        )
    return Table(targets=tuple(fleet_), rows=tuple(rows))


# --------------------------------------------------------------------------- renderings


def _groups(table: Table) -> list[tuple[str, str, list[Target]]]:
    """Columns grouped by (platform, driver), in the targets' order."""
    out: list[tuple[str, str, list[Target]]] = []
    for t in table.targets:
        for platform, drv, members in out:
            if platform == t.platform and drv == t.driver:
                members.append(t)
                break
        else:
            out.append((t.platform, t.driver, [t]))
    return out


def _cell(row: Row, target: Target) -> fleet.Verdict | None:
    return next((v for v in row.verdicts if v.target == target), None)


def text(table: Table) -> str:
    lines: list[str] = []
    for row in table.rows:
        head = f"{row.stack} (CUDA {row.cuda}, {row.source})"
        if row.error is not None:
            lines.append(f"{head}: not judged: {row.error}")
            continue
        runs = [v for v in row.verdicts if v.ok]
        lines.append(f"{head}: runs on {len(runs)} of {len(row.verdicts)} classes")
        if runs:
            # Which ones, on one line: the failing ones follow, each with why.
            lines.append("  runs on: " + ", ".join(v.target.name for v in runs))
        for v in row.verdicts:
            if not v.ok or v.kind == "runs-after-ptx-jit" or v.compiles_at_start:
                lines.append(f"  {v.line()}")
    return "\n".join(lines)


def markdown(table: Table, *, title: str = "Compatibility") -> str:
    """One table per platform and driver: stacks as rows, compute capabilities as columns;
    each failing cell numbered, its reason listed below the table."""
    lines = [f"# {title}", ""]
    lines.append(
        "Each cell: what the stack's own wheels for that platform hold for that GPU, with the "
        "driver's CUDA checked (`cudaenv compat`, `cudaenv audit SPEC --targets FILE`)."
    )
    notes: dict[str, int] = {}  # a reason -> its number: one number per distinct reason
    for platform, drv, members in _groups(table):
        lines += ["", f"## {platform}, driver {drv}", ""]
        lines.append("| stack | " + " | ".join(t.cc_text for t in members) + " |")
        lines.append("|---|" + "---|" * len(members))
        for row in table.rows:
            cells = []
            for t in members:
                v = _cell(row, t)
                if row.error is not None or v is None:
                    cells.append("-")
                    continue
                mark = fleet.SHORT[v.kind]
                if not v.ok or v.kind == "runs-after-ptx-jit" or v.compiles_at_start:
                    number = notes.setdefault(f"{row.stack}: {v.detail}", len(notes) + 1)
                    mark += f" [{number}]"
                cells.append(mark)
            lines.append(f"| {row.stack} | " + " | ".join(cells) + " |")
    errors = [f"{r.stack}: {r.error}" for r in table.rows if r.error is not None]
    if notes or errors:
        lines += ["", "## Why", ""]
        lines += [f"{i}. {n}".replace("|", "\\|") for n, i in notes.items()]
        lines += [f"- not judged: {e}" for e in errors]
    return "\n".join(lines) + "\n"


_CLASS = {
    "runs": "ok",
    "runs-after-ptx-jit": "jit",
    "no-kernel": "bad",
    "driver-too-old": "bad",
    "no-wheel": "none",
}


def html(table: Table) -> str:
    """A self-contained page: the grid, each cell's reason one click away."""
    e = html_mod.escape
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>cudaenv compat</title><style>",
        "body{font:14px system-ui,sans-serif;margin:2em}table{border-collapse:collapse;"
        "margin-bottom:2em}td,th{border:1px solid #ccc;padding:4px 6px;vertical-align:top}"
        ".ok{background:#d9f2d9}.jit{background:#fff2cc}.bad{background:#f8d0d0}"
        ".none{background:#eee}details summary{cursor:pointer}",
        "</style></head><body><h1>Which stacks run on which GPU classes</h1>",
    ]
    for platform, drv, members in _groups(table):
        out.append(f"<h2>{e(platform)}, driver {e(drv)}</h2><table><tr><th>stack</th>")
        out += [f"<th>{e(t.cc_text)}</th>" for t in members]
        out.append("</tr>")
        for row in table.rows:
            out.append(f"<tr><th>{e(row.stack)}</th>")
            for t in members:
                v = _cell(row, t)
                if row.error is not None or v is None:
                    out.append(f"<td class='none' title='{e(row.error or '')}'>-</td>")
                    continue
                evidence = "".join(f"<li>{e(x)}</li>" for x in v.evidence)
                out.append(
                    f"<td class='{_CLASS[v.kind]}'><details><summary>{e(fleet.SHORT[v.kind])}"
                    f"</summary>{e(v.detail)}<ul>{evidence}</ul></details></td>"
                )
            out.append("</tr>")
        out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_data(table: Table, path: Path) -> None:
    proc.atomic_write_text(path, json.dumps(table.to_json(), indent=1, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- the docs page

DOCS_DATA = Path("docs/reference/compat.json")
DOCS_PAGE = Path("docs/reference/compat.md")
SHIPPED = Path("envspecs")
PAGE_TITLE = "Compatibility of the shipped stacks"


def page(table: Table) -> str:
    """The docs page: the Markdown of the table, saying how it is made."""
    body = markdown(table, title=PAGE_TITLE)
    head, _, rest = body.partition("\n\n")
    note = (
        "Generated by `nox -s compat` (`python -m builder.commands.compat`) from the committed locks of "
        "`envspecs/*.yaml`, whose wheels it reads for each platform; its data is "
        "[compat.json](compat.json). A test fails when a lock has changed since."
    )
    return f"{head}\n\n{note}\n\n{rest}"


def stale(root: Path) -> list[str]:
    """Why the committed page under ``root`` no longer says what the locks would: a shipped
    spec missing or added, a lock changed since, or a page that is not its data's rendering."""
    data = root / DOCS_DATA
    if not data.is_file():
        return [f"{DOCS_DATA} is missing: run `nox -s compat`"]
    table = from_json(json.loads(data.read_text()))
    out: list[str] = []
    rows = {r.source: r for r in table.rows}
    for path in sorted((root / SHIPPED).glob("*.yaml")):
        rel = str(path.relative_to(root))
        s = spec.load(path)
        row = rows.pop(rel, None)
        lock_path = pipeline.lock_file(s)
        current = lock.read(lock_path).content_hash() if lock_path.is_file() else ""
        if row is None:
            out.append(f"{rel} is not in the table")
        elif row.lock != current:
            out.append(f"{rel}: its lock changed since the table was made")
    out += [f"{src} is in the table but no longer shipped" for src in rows]
    text = (root / DOCS_PAGE).read_text() if (root / DOCS_PAGE).is_file() else ""
    if text != page(table):
        out.append(f"{DOCS_PAGE} is not the rendering of {DOCS_DATA}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m builder.commands.compat [--check]``: regenerate the docs page from the shipped specs'
    locks (reads their wheels), or only say whether it is stale."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--check"]:
        problems = stale(Path.cwd())
        for p in problems:
            print(f"stale: {p}", file=sys.stderr)
        return 1 if problems else 0
    specs = sorted(SHIPPED.glob("*.yaml"))
    table = tabulate(specs, None, Reporter())
    write_data(table, DOCS_DATA)
    proc.atomic_write_text(DOCS_PAGE, page(table))
    print(
        f"wrote {DOCS_PAGE} and {DOCS_DATA}: {len(table.rows)} stacks x {len(table.targets)} classes"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
