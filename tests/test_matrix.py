"""Release matrices: located loading, expansion, names, namespaced cells, the cell runner's
structured records, reports (JSON, HTML, Markdown, JUnit), GitHub emit, merge and
regressions; a real run of a small matrix in e2e."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from builder.cli import main as cli
from builder.cli import parser as cliargs
from builder.commands import build as buildrun
from builder.commands import matrix
from builder.commands.args import BuildArgs
from builder.core.errors import ReportError, SpecError
from builder.core.statuses import CellStatus, CheckStatus
from builder.machine.archs import Arch
from builder.spec import envspec as spec
from builder.spec import matrixfile
from builder.verify import CHECKS, report
from builder.verify.model import CheckResult
from tests import chromium
from tests.helpers import ENVSPECS, REPO, cudaenv, workspace, write

RELEASE = ENVSPECS / "matrix" / "release.yaml"
F120 = Arch.parse("12.0f")


def test_release_matrix_expands_to_stable_named_cells(tmp_path: Path) -> None:
    mx = matrixfile.load(RELEASE, out_root=tmp_path)
    names = [c.name for c in mx.cells]
    assert names == [
        "toolchain-cu130",
        "flashinfer-0.7.4-torch2.15-cu132",
        "torch2.9-cu128-system",
        "vllm-0.33-cu130",
        "torch2.14.1-cu13.0-fi0.7.2-sglang0.5.23-sm12.0f",
        "torch2.14.1-cu13.0-fi0.7.2-sglang0.5.23-sm9.0a+12.0f",
        "torch2.11.0-cu13.0-fi0.6.15.post1-sglang0.5.17-sm12.0f",
        "torch2.14.1-cu13.2-fi0.7.2-sglang0.5.23",
    ]
    again = matrixfile.load(RELEASE, out_root=tmp_path)
    assert [c.name for c in again.cells] == names
    cell = mx.spec_of(mx.cell("torch2.11.0-cu13.0-fi0.6.15.post1-sglang0.5.17-sm12.0f"))
    assert (cell.torch, cell.cuda, cell.archs) == ("2.11.0", "13.0", (F120,))
    assert cell.packages == ("sglang==0.5.17", "flashinfer-python==0.6.15.post1")
    assert mx.cell("torch2.14.1-cu13.0-fi0.7.2-sglang0.5.23-sm9.0a+12.0f").runs_on == (
        "self-hosted",
        "sm90",
        "sm120",
    )
    assert [c.generated for c in mx.cells] == [False] * 4 + [True] * 4


def test_matrix_file_errors_are_located_and_all_reported(tmp_path: Path) -> None:
    write(tmp_path / "x.yaml", 'name: x\npython: "3.12"\ncuda: "13.0"\n')
    bad = write(
        tmp_path / "m.yaml",
        """\
base: x.yaml
axes:
  gpu: [a]
  archs: [["9.9"], ["12.0q"]]
exclude:
  - {torhc: "2.11.0"}
runner: {}
""",
    )
    with pytest.raises(SpecError) as info:
        matrixfile.load(bad, out_root=tmp_path / "out")
    shown = str(bad.relative_to(Path.cwd())) if bad.is_relative_to(Path.cwd()) else str(bad)
    assert info.value.what == "matrix file"
    assert info.value.problems == [
        f"{shown}:3:3: axes.gpu: unknown axis 'gpu'; expected one of: "
        "torch, cuda, python, flashinfer, sglang, archs",
        f"{shown}:4:21: axes.archs[1][0]: expected an arch like '9.0a', '10.0a' or '12.0f', "
        "got '12.0q'",
        f"{shown}:6:6: exclude[0].torhc: unknown axis 'torhc'; did you mean 'torch'?",
        f"{shown}:7:1: runner: unknown key; did you mean 'runners'?",
    ]


def test_matrix_file_that_is_not_a_mapping_or_not_yaml(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        matrixfile.load(write(tmp_path / "l.yaml", "- a\n- b\n"), out_root=tmp_path)
    assert "a matrix file is a YAML mapping, got a list" in info.value.problems[0]
    with pytest.raises(SpecError) as info:
        matrixfile.load(write(tmp_path / "y.yaml", "a: [\n"), out_root=tmp_path)
    assert ":2:1: invalid YAML" in info.value.problems[0]
    with pytest.raises(SpecError) as info:
        matrixfile.load(write(tmp_path / "e.yaml", "name: e\n"), out_root=tmp_path)
    assert "needs `specs:` or `base:` with `axes:`" in info.value.problems[0]


def test_two_specs_of_one_name_are_refused(tmp_path: Path) -> None:
    body = 'name: same\npython: "3.12"\ncuda: "13.0"\n'
    write(tmp_path / "a" / "s.yaml", body)
    write(tmp_path / "b" / "s.yaml", body)
    m = write(tmp_path / "m.yaml", "specs: [a/s.yaml, b/s.yaml]\n")
    with pytest.raises(SpecError, match="two cells are named 'same'"):
        matrixfile.load(m, out_root=tmp_path / "out")


def test_cells_of_two_matrices_never_share_an_env(tmp_path: Path) -> None:
    write(tmp_path / "x.yaml", 'name: x\npython: "3.12"\ncuda: "13.0"\n')
    one = matrixfile.load(
        write(tmp_path / "one.yaml", "base: x.yaml\naxes: {archs: [[9.0a]]}\n"), tmp_path / "o"
    )
    two = matrixfile.load(
        write(tmp_path / "two.yaml", "base: x.yaml\naxes: {archs: [[9.0a]]}\n"), tmp_path / "o"
    )
    assert one.cells[0].name == two.cells[0].name == "sm9.0a"
    assert one.env_dir(one.cells[0]) != two.env_dir(two.cells[0])
    assert one.env_dir(one.cells[0]) == tmp_path / "o" / "one" / "envs" / "sm9.0a"
    request = matrix.cell_request(one, one.cells[0], tmp_path / "r.json")
    assert request.env_dir == one.env_dir(one.cells[0]).absolute()
    assert request.verify and request.record == tmp_path / "r.json"
    # The cell's lock is the matrix's own: the build re-resolves it when it goes stale.
    assert request.relock
    # The cell's process is `cudaenv build` with arguments that make the same request.
    argv = matrix.cell_argv(request)
    assert argv[:4] == [sys.executable, "-m", "builder.cli", "build"]
    parsed = cliargs.parse(cliargs.make_parser(), argv[3:])
    assert isinstance(parsed.args, BuildArgs)
    assert buildrun.requests(parsed.args) == [request]


def test_loading_a_matrix_writes_nothing(tmp_path: Path) -> None:
    write(tmp_path / "x.yaml", 'name: x\npython: "3.12"\ncuda: "13.0"\n')
    mx = matrixfile.load(
        write(tmp_path / "m.yaml", "base: x.yaml\naxes: {archs: [[9.0a]]}\n"), tmp_path / "o"
    )
    assert not (tmp_path / "o").exists()
    cell = mx.cells[0]
    assert mx.spec_of(cell).archs == (Arch.parse("9.0a"),)  # read without writing
    with pytest.raises(SpecError, match="no cell 'nosuch'"):
        mx.cell("nosuch")
    assert not (tmp_path / "o").exists()
    assert matrixfile.write_cell_spec(cell).read_text() == cell.spec_text
    assert spec.load(cell.spec_path) == mx.spec_of(cell)


def fake_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str
) -> tuple[matrixfile.Matrix, matrixfile.Cell]:
    """A matrix whose one cell runs a tiny Python program instead of `cudaenv build`."""
    write(tmp_path / "x.yaml", 'name: x\npython: "3.12"\ncuda: "13.0"\n')
    mx = matrixfile.load(write(tmp_path / "m.yaml", "specs: [x.yaml]\n"), tmp_path / "o")

    def argv(request: BuildArgs) -> list[str]:
        return [sys.executable, "-c", code, str(request.record)]

    monkeypatch.setattr(matrix, "cell_argv", argv)
    return mx, mx.cells[0]


def test_a_cell_status_comes_from_its_build_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = report.BuildRecord(
        stage="resolve", status="refused", reason="torch 2.14.1 is built for CUDA 13.0", exit_code=3
    )
    code = (
        "import sys, pathlib; print('error: scraped text that must not be used');"
        f"pathlib.Path(sys.argv[1]).write_text({json.dumps(json.dumps(record.to_json()))});"
        "sys.exit(3)"
    )
    mx, cell = fake_cell(tmp_path, monkeypatch, code)
    result = matrix.run_cell(mx, cell, tmp_path / "out")
    assert (result.status, result.reason) == ("refused", "torch 2.14.1 is built for CUDA 13.0")
    assert result.log is not None and "scraped text" in result.log.read_text()


def test_a_cell_that_dies_without_a_record_is_judged_by_its_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mx, cell = fake_cell(tmp_path, monkeypatch, "import sys; sys.exit(4)")
    result = matrix.run_cell(mx, cell, tmp_path / "out")
    assert result.status == "failed"
    assert result.reason == "exit 4 without a build record; see x.log"
    mx, cell = fake_cell(tmp_path, monkeypatch, "import os, signal; os.kill(os.getpid(), 9)")
    assert matrix.run_cell(mx, cell, tmp_path / "out").status == "error"


def test_the_cli_writes_a_record_for_a_refused_spec(tmp_path: Path) -> None:
    bad = write(
        tmp_path / "bad.yaml", 'name: bad\npython: "3.12"\ncuda: "12.6"\narchs: ["12.0f"]\n'
    )
    out = tmp_path / "rec.json"
    rc = cli.main(["--quiet", "build", "--verify", str(bad), "--record", str(out)])
    assert rc == 3
    rec = report.BuildRecord.from_json(json.loads(out.read_text()), str(out))
    assert (rec.stage, rec.status, rec.exit_code) == ("resolve", "refused", 3)
    assert "arch 12.0f needs CUDA >= 12.9 but the spec asks 12.6" in rec.reason


def test_github_matrix_round_trips_through_report_merge(tmp_path: Path) -> None:
    mx = matrixfile.load(RELEASE, out_root=tmp_path)
    emitted = json.loads(json.dumps(matrixfile.github_matrix(mx)))
    assert [e["cell"] for e in emitted["include"]] == [c.name for c in mx.cells]
    first = next(i for i, c in enumerate(mx.cells) if c.generated)  # after the spec files
    assert emitted["include"][first]["spec"].endswith(f"release.yaml:{mx.cells[first].name}")
    # Each runner uploads the verify report of its cell; merge joins them.
    uploads = []
    for i, entry in enumerate(emitted["include"]):
        status: CheckStatus = "failed" if i == 1 else "passed"
        uploads.append(
            report.VerifyReport(
                spec=entry["cell"],
                env=None,
                python="/x/bin/python",
                lock_hash=None,
                archs=(F120,),
                versions=(("nvcc", "13.0"),),
                checks=(
                    CheckResult(name="toolchain", status=status, summary="s", seconds=0.5),
                    CheckResult(name="sampling", status="skipped", summary="no NVIDIA driver"),
                ),
                seconds=1.0,
                created="2026-11-30T00:00:00+00:00",
            )
        )
    files = []
    for i, up in enumerate(uploads):
        files.append(report.write_json(up, tmp_path / f"runner{i}" / "verify.json"))
    merged = report.merge([report.read_report(f) for f in files], name="release")
    assert [c.name for c in merged.cells] == [e["cell"] for e in emitted["include"]]
    assert merged.status == "failed"
    assert merged.cells[1].column("toolchain") == "failed"
    assert merged.cells[0].column("sampling") == "skipped"
    # ... and a merged report reads back and merges again unchanged.
    path = report.write_json(merged, tmp_path / "merged.json")
    again = report.merge([report.read_report(path)])
    assert again.cells == merged.cells


def test_report_files_that_are_missing_broken_or_foreign(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=r"missing\.json: cannot read the report"):
        report.read_report(tmp_path / "missing.json")
    with pytest.raises(ReportError, match="the report is not JSON"):
        report.read_report(write(tmp_path / "broken.json", "{"))
    with pytest.raises(
        ReportError, match=r"not a cudaenv verify or matrix report \(kind is None\)"
    ):
        report.read_report(write(tmp_path / "a.json", '{"a": 1}'))
    with pytest.raises(ReportError, match="schema_version is 99"):
        report.read_report(write(tmp_path / "v.json", '{"kind": "matrix", "schema_version": 99}'))
    doc = sample_report().to_json()
    doc["cells"][1]["status"] = "exploded"
    with pytest.raises(ReportError, match=r"in 'cells\[1\].status': unknown status 'exploded'"):
        report.read_report(write(tmp_path / "m.json", json.dumps(doc)))


@pytest.mark.parametrize(
    ("where", "message"),
    [
        (("columns", "build"), r"in 'cells\[0\].columns.build': unknown status 'green'"),
        (("verify", "checks", 0, "status"), r"in 'cells\[0\].verify.checks\[0\].status': "
         "unknown status 'green'; expected one of: passed, failed, skipped$"),
    ],
)  # fmt: skip
def test_a_status_no_cudaenv_writes_is_refused_with_its_key(
    tmp_path: Path, where: tuple[str | int, ...], message: str
) -> None:
    doc = sample_report().to_json()
    node = doc["cells"][0]
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = "green"
    with pytest.raises(ReportError, match=message):
        report.read_report(write(tmp_path / "m.json", json.dumps(doc)))


@pytest.mark.slow
def test_cli_report_merge_and_baseline_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    broken = write(tmp_path / "broken.json", "not json")
    for argv in (
        ["report", "merge", str(tmp_path / "missing.json")],
        ["report", "merge", str(broken)],
        ["report", "merge", str(write(tmp_path / "a.json", '{"a": 1}'))],
        # Checked before any cell runs: the matrix file need not even be valid.
        ["matrix", str(tmp_path / "nope.yaml"), "--baseline", str(tmp_path / "missing.json")],
        ["matrix", str(tmp_path / "nope.yaml"), "--baseline", str(broken)],
    ):
        done = cudaenv(*argv, cwd=tmp_path, check=False)
        assert done.returncode == 2, (argv, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "report" in lines[0], lines
        assert "Traceback" not in done.stderr


def sample_report() -> report.MatrixReport:
    def verify(*checks: CheckResult) -> report.VerifyReport:
        return report.VerifyReport(
            spec="s",
            env=None,
            python="p",
            lock_hash=None,
            archs=(F120,),
            versions=(("nvcc", "13.0"),),
            checks=checks,
            seconds=1.0,
            created="2026-11-30T00:00:00+00:00",
        )

    a = verify(
        *(
            CheckResult(name=n, status="skipped" if n == "sampling" else "passed", summary="ok")
            for n in CHECKS
        )
    )
    c = verify(
        CheckResult(name="kernel-compile", status="failed", summary="nvcc cannot build 9.9a")
    )

    def cell(
        name: str, status: CellStatus, reason: str, v: report.VerifyReport | None
    ) -> report.CellReport:
        return report.CellReport(
            name=name,
            spec=f"{name}.yaml",
            status=status,
            reason=reason,
            values=(),
            archs=(F120,) if status == "passed" else (),
            runs_on=(),
            seconds=10 if status == "passed" else 1,
            log=f"logs/{name}.log",
            columns=report.columns_of(status, v),
            verify=v,
        )

    cells = (
        cell("a", "passed", "", a),
        cell(
            "b<script>",
            "refused",
            "torch 2.14.1 is built for CUDA 13.0 but the spec asks 13.2",
            None,
        ),
        cell("c", "failed", "1 check(s) failed: kernel-compile", c),
    )
    return report.MatrixReport(name="t", created="2026-11-30T00:00:00+00:00", cells=cells)


def test_matrix_report_round_trips_through_json(tmp_path: Path) -> None:
    rep = sample_report()
    path = report.write_json(rep, tmp_path / "m.json")
    back = report.read_report(path)
    assert back == rep
    assert back.status == "failed"


def test_junit_has_one_case_per_cell_and_column() -> None:
    rep = sample_report()
    root = ET.fromstring(report.matrix_junit(rep).split("\n", 1)[1])  # noqa: S314 - our own output
    assert root.tag == "testsuites"
    suite = root.find("testsuite")
    assert suite is not None
    cases = suite.findall("testcase")
    assert len(cases) == 3 * len(report.COLUMNS) == int(suite.get("tests", "0"))
    failures = [c for c in cases if c.find("failure") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    assert int(suite.get("failures", "-1")) == len(failures) == 1
    assert int(suite.get("skipped", "-1")) == len(skipped)
    assert {(c.get("classname"), c.get("name")) for c in failures} == {("c", "kernel-compile")}
    for case in cases:
        assert case.get("classname") and case.get("name") and case.get("time") is not None


class Grid(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self._row: str | None = None
        self._col: str | None = None
        self.scripts = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "script":
            self.scripts += 1
        if tag == "tr" and a.get("data-cell"):
            self._row = str(a["data-cell"])
            self.rows[self._row] = {}
        if tag == "td" and self._row and a.get("data-col"):
            self._col = str(a["data-col"])
            self.rows[self._row][self._col] = str(a.get("class", ""))

    def handle_data(self, data: str) -> None:
        if self._row and self._col and data.strip():
            self.rows[self._row][self._col] += "|" + data.strip()
            self._col = None


def test_html_grid_shows_every_cell_and_status() -> None:
    rep = sample_report()
    html = report.matrix_html(rep, report.regressions(rep, rep))
    grid = Grid()
    grid.feed(html)
    assert list(grid.rows) == ["a", "b<script>", "c"]
    assert grid.scripts == 0  # names are escaped
    assert grid.rows["a"]["toolchain"] == "s-passed|passed"
    assert grid.rows["a"]["sampling"] == "s-skipped|skipped"
    assert grid.rows["b<script>"]["resolve"] == "s-refused|refused"
    assert grid.rows["c"]["kernel-compile"] == "s-failed|failed"
    assert all(len(cols) == len(report.COLUMNS) for cols in grid.rows.values())


def test_a_check_no_cell_ran_is_said_not_proved_and_each_skip_says_why() -> None:
    """The GPU check skipped in every cell (a runner without a GPU): the page says the matrix
    did not prove it, next to its status; each skipped check's reason is on the page (not on
    hover only), and each cell's arch list has a column."""
    rep = sample_report()
    assert rep.never_ran() == (("sampling", "ok"),)
    html = report.matrix_html(rep)
    assert (
        '<p class="never" id="never-ran"><strong>Not proved by this matrix:</strong> <code>sampling</code> ran in no cell (ok)</p>'
        in html
    )
    assert '<div class="skip">sampling skipped: ok</div>' in html
    assert "<th>archs</th>" in html and '<td class="archs">12.0f</td>' in html
    md = report.matrix_markdown(rep)
    assert "Not proved by this matrix: `sampling` ran in no cell (ok)" in md
    assert "| `a` | 12.0f |" in md
    first = rep.cells[0].verify
    assert first is not None
    passed = dataclasses.replace(
        first, checks=tuple(dataclasses.replace(c, status="passed") for c in first.checks)
    )
    ran = dataclasses.replace(
        rep.cells[0], verify=passed, columns=report.columns_of("passed", passed)
    )
    assert report.MatrixReport(name="t", created=rep.created, cells=(ran,)).never_ran() == ()


def test_regressions_against_a_baseline() -> None:
    old = sample_report()
    cell = old.cells[0]
    broken = tuple((k, "failed" if k == "cubin" else v) for k, v in cell.columns)
    new = report.MatrixReport(
        name="t",
        created=old.created,
        cells=(dataclasses.replace(cell, columns=broken), *old.cells[1:]),
    )
    found = report.regressions(old, new)
    assert found == [report.Regression(cell="a", column="cubin", before="passed", now="failed")]
    assert str(found[0]) == "a: cubin passed before, failed now"
    assert report.regressions(old, old) == []
    md = report.matrix_markdown(new, found)
    assert "- a: cubin passed before, failed now" in md
    # A cell that vanished regresses in each column it passed.
    gone = report.MatrixReport(name="t", created=old.created, cells=old.cells[1:])
    assert {r.now for r in report.regressions(old, gone)} == {"missing"}


def test_rendered_page_in_headless_chromium(tmp_path: Path) -> None:
    browser = chromium.find()
    if browser is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    page = tmp_path / "matrix.html"
    page.write_text(report.matrix_html(sample_report()))
    done = subprocess.run(
        [browser, *chromium.FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
         page.as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    grid = Grid()
    grid.feed(done.stdout)
    assert list(grid.rows) == ["a", "b<script>", "c"]
    assert grid.rows["c"]["kernel-compile"] == "s-failed|failed"


@pytest.mark.network
@pytest.mark.e2e
def test_a_matrix_run_shows_broken_cells_and_completes_the_others(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    write(
        ws / "envspecs" / "matrix" / "small.yaml",
        """\
name: small
specs: [../toolchain-cu130.yaml]
base: ../toolchain-cu130.yaml
axes:
  archs: [["9.9a"]]
include:
  - {torch: "2.14.1", cuda: "13.2"}
""",
    )
    done = cudaenv(
        "matrix", "envspecs/matrix/small.yaml", "-j", "2", "--out", "out", cwd=ws, check=False
    )
    assert done.returncode == 1, done.stderr
    doc = json.loads((ws / "out" / "matrix.json").read_text())
    status = {c["name"]: c["status"] for c in doc["cells"]}
    assert status == {
        "toolchain-cu130": "passed",
        "sm9.9a": "failed",
        "torch2.14.1-cu13.2": "refused",
    }
    cells = {c["name"]: c for c in doc["cells"]}
    assert "torch 2.14.1 is built for CUDA 13.0" in cells["torch2.14.1-cu13.2"]["reason"]
    assert cells["sm9.9a"]["columns"]["kernel-compile"] == "failed"
    assert cells["toolchain-cu130"]["columns"]["cubin"] == "passed"
    for name in ("matrix.html", "matrix.md", "junit.xml"):
        assert (ws / "out" / name).exists()
    assert (ws / "out" / cells["sm9.9a"]["log"]).read_text()
    # An unchanged re-run reuses envs and kernels, and the baseline sees no regression.
    again = cudaenv(
        "matrix",
        "envspecs/matrix/small.yaml",
        "--out",
        "out2",
        "--baseline",
        "out/matrix.json",
        cwd=ws,
        check=False,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert "is up to date" in (ws / "out2" / "logs" / "toolchain-cu130.log").read_text()


def test_emitted_specs_are_relative_to_the_repository_however_the_file_is_named(
    tmp_path: Path,
) -> None:
    """`--emit github` with an absolute matrix path: a CI checkout has the repository at
    another path, so every spec is written relative to the repository root."""
    mx = matrixfile.load(RELEASE.absolute(), out_root=tmp_path)
    emitted = matrixfile.github_matrix(mx)["include"]
    assert all(not e["spec"].startswith("/") for e in emitted)
    generated = [e for e in emitted if ":" in e["spec"]]
    assert generated and all(
        e["spec"].startswith("envspecs/matrix/release.yaml:") for e in generated
    )
    for entry in emitted:
        path = entry["spec"].split(":")[0]
        assert (REPO / path).is_file(), path


@pytest.mark.slow
def test_one_cell_runs_judged_as_in_the_whole_matrix(tmp_path: Path) -> None:
    """`matrix FILE --cell NAME` (one CI job per cell): a refused cell is a result, exit 0,
    as the whole matrix says locally; an unknown cell is a one-line error."""
    spec_dir = tmp_path / "envs"
    write(spec_dir / "bad.yaml", 'name: bad\npython: "3.12"\ncuda: "12.6"\narchs: ["12.0f"]\n')
    write(tmp_path / "m.yaml", "name: m\nspecs: [envs/bad.yaml]\n")
    whole = cli.main(["--quiet", "matrix", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "a")])
    one = cli.main(["--quiet", "matrix", str(tmp_path / "m.yaml"), "--cell", "bad",
                    "--out", str(tmp_path / "b")])  # fmt: skip
    assert whole == one == 0
    doc = json.loads((tmp_path / "b" / "matrix.json").read_text())
    assert [(c["name"], c["status"]) for c in doc["cells"]] == [("bad", "refused")]
    assert cli.main(["--quiet", "matrix", str(tmp_path / "m.yaml"), "--cell", "nope"]) == 2


def test_a_cell_runs_the_public_build_command(tmp_path: Path) -> None:
    """A cell's process is `cudaenv build` (no private entry point): every option of a request
    parses back to the same request, and a spec that looks like an option stays the spec."""
    request = BuildArgs(
        specs=(Path("-odd.yaml"),),
        env_dir=tmp_path / "env",
        force=True,
        verify=True,
        report=tmp_path / "r.json",
        record=tmp_path / "rec.json",
        relock=True,
        wheelhouse=tmp_path / "wh",
        offline=True,
        platform="linux-aarch64",
        no_driver_check=True,
        keep_going=True,
        no_target_check=True,
    )
    argv = matrix.cell_argv(request)
    assert "builder.commands.pipeline" not in argv and argv[2:4] == ["builder.cli", "build"]
    parsed = cliargs.parse(cliargs.make_parser(), argv[3:])
    assert isinstance(parsed.args, BuildArgs)
    assert buildrun.requests(parsed.args) == [request]


def test_a_refused_cells_cause_is_shown_not_cut() -> None:
    """The console line and matrix.md show why a cell was refused (the policy's causes), not
    the header the reason starts with."""
    reason = (
        "c (c.yaml): refused by the matching policy, nothing was installed:\n"
        "  - torch 2.14.1 is built for CUDA 13.0 (its cuda-toolkit pin 13.0.2) but the spec "
        "asks 13.2\n"
        "  - flashinfer-cubin 0.7.1 is not flashinfer-python 0.7.2"
    )
    line = report.headline(reason)
    assert line == (
        "refused: torch 2.14.1 is built for CUDA 13.0 (its cuda-toolkit pin 13.0.2) but the "
        "spec asks 13.2; flashinfer-cubin 0.7.1 is not flashinfer-python 0.7.2"
    )
    old = sample_report()
    refused = dataclasses.replace(old.cells[1], reason=reason)
    md = report.matrix_markdown(dataclasses.replace(old, cells=(old.cells[0], refused)))
    assert line in md
    assert report.headline("exit 4\nsee the log") == "exit 4 see the log"
    assert report.headline("x" * 1000).endswith("...") and len(report.headline("x" * 1000)) == 400
