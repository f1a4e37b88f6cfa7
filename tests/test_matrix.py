"""Release matrices: expansion, names, reports (JSON, HTML, Markdown, JUnit), GitHub emit,
merge and regressions; a real run of a small matrix in e2e."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

import pytest

from builder import matrix, report, spec
from builder.errors import SpecError
from tests.conftest import ENVSPECS, write
from tests.test_e2e import cudaenv, workspace

RELEASE = ENVSPECS / "matrix" / "release.yaml"


def test_release_matrix_expands_to_stable_named_cells(tmp_path: Path) -> None:
    mx = matrix.load(RELEASE, out_root=tmp_path)
    names = [c.name for c in mx.cells]
    assert names == [
        "toolchain-cu130",
        "flashinfer-0.7.4-torch2.15-cu132",
        "torch2.9-cu128-system",
        "torch2.14.1-cu13.0-fi0.7.2-sglang0.5.23-sm12.0f",
        "torch2.14.1-cu13.0-fi0.7.2-sglang0.5.23-sm9.0a+12.0f",
        "torch2.11.0-cu13.0-fi0.6.15.post1-sglang0.5.17-sm12.0f",
        "torch2.14.1-cu13.2-fi0.7.2-sglang0.5.23",
    ]
    assert len(names) >= 6
    again = matrix.load(RELEASE, out_root=tmp_path)
    assert [c.name for c in again.cells] == names
    cell = spec.load(mx.cell("torch2.11.0-cu13.0-fi0.6.15.post1-sglang0.5.17-sm12.0f").spec_path)
    assert (cell.torch, cell.cuda, cell.archs) == ("2.11.0", "13.0", ("12.0f",))
    assert cell.packages == ("sglang==0.5.17", "flashinfer-python==0.6.15.post1")
    assert mx.cell("torch2.14.1-cu13.0-fi0.7.2-sglang0.5.23-sm9.0a+12.0f").runs_on == (
        "self-hosted",
        "sm90",
        "sm120",
    )


def test_matrix_file_errors_are_located(tmp_path: Path) -> None:
    write(tmp_path / "m.yaml", "base: ../x.yaml\naxes: {gpu: [a]}\n")
    write(tmp_path / "x.yaml", 'name: x\npython: "3.12"\ncuda: "13.0"\n')
    bad = write(tmp_path / "sub" / "m.yaml", "base: ../x.yaml\naxes: {gpu: [a]}\n")
    with pytest.raises(SpecError) as info:
        matrix.load(bad, out_root=tmp_path / "out")
    assert info.value.problems == [
        f"{bad}:1:1: axes.gpu: unknown axis 'gpu'; axes: torch, cuda, python, flashinfer, sglang, archs"
    ]
    with pytest.raises(SpecError, match="unknown key"):
        matrix.load(write(tmp_path / "n.yaml", "axis: {}\n"), out_root=tmp_path / "out")


def test_github_matrix_round_trips_through_report_merge(tmp_path: Path) -> None:
    mx = matrix.load(RELEASE, out_root=tmp_path)
    emitted = json.loads(json.dumps(matrix.github_matrix(mx)))
    assert [e["cell"] for e in emitted["include"]] == [c.name for c in mx.cells]
    assert emitted["include"][3]["spec"].endswith(f"release.yaml:{mx.cells[3].name}")
    # Each runner uploads the verify report of its cell; merge joins them.
    uploads = []
    for i, entry in enumerate(emitted["include"]):
        status = "failed" if i == 1 else "passed"
        uploads.append(
            {
                "schema_version": 1,
                "kind": "verify",
                "spec": entry["cell"],
                "status": status,
                "archs": ["12.0f"],
                "versions": {"nvcc": "13.0"},
                "seconds": 1.0,
                "checks": [
                    {
                        "name": "toolchain",
                        "status": status,
                        "summary": "s",
                        "evidence": {},
                        "seconds": 0.5,
                        "fix": "",
                    },
                    {
                        "name": "sampling",
                        "status": "skipped",
                        "summary": "no NVIDIA driver",
                        "evidence": {},
                        "seconds": 0.0,
                        "fix": "",
                    },
                ],
            }
        )
    merged = matrix.merge(uploads, name="release")
    assert [c["name"] for c in merged["cells"]] == [e["cell"] for e in emitted["include"]]
    assert merged["status"] == "failed"
    assert merged["cells"][1]["columns"]["toolchain"] == "failed"
    assert merged["cells"][0]["columns"]["sampling"] == "skipped"
    # ... and a merged report merges again unchanged.
    assert [c["name"] for c in matrix.merge([merged])["cells"]] == [
        c["name"] for c in merged["cells"]
    ]


def sample_doc() -> dict[str, Any]:
    cells = [
        {
            "name": "a",
            "spec": "a.yaml",
            "status": "passed",
            "reason": "",
            "values": {},
            "archs": ["12.0f"],
            "runs_on": [],
            "seconds": 10,
            "log": "logs/a.log",
            "verify": {"versions": {"nvcc": "13.0"}},
            "columns": matrix.cell_checks(
                "passed",
                {
                    "checks": [
                        {"name": n, "status": "skipped" if n == "sampling" else "passed"}
                        for n in spec.CHECKS
                    ]
                },
            ),
        },
        {
            "name": "b<script>",
            "spec": "b.yaml",
            "status": "refused",
            "reason": "torch 2.14.1 is built for CUDA 13.0 but the spec asks 13.2",
            "values": {},
            "archs": [],
            "runs_on": [],
            "seconds": 1,
            "log": "logs/b.log",
            "verify": None,
            "columns": matrix.cell_checks("refused", None),
        },
        {
            "name": "c",
            "spec": "c.yaml",
            "status": "failed",
            "reason": "1 check(s) failed: kernel-compile",
            "values": {},
            "archs": [],
            "runs_on": [],
            "seconds": 5,
            "log": "logs/c.log",
            "verify": None,
            "columns": matrix.cell_checks(
                "failed",
                {
                    "checks": [
                        {
                            "name": "kernel-compile",
                            "status": "failed",
                            "summary": "nvcc cannot build 9.9a",
                        }
                    ]
                },
            ),
        },
    ]
    return matrix.aggregate("t", cells)


def test_junit_has_one_case_per_cell_and_column() -> None:
    doc = sample_doc()
    root = ET.fromstring(report.matrix_junit(doc).split("\n", 1)[1])  # noqa: S314 - our own output
    assert root.tag == "testsuites"
    suite = root.find("testsuite")
    assert suite is not None
    cases = suite.findall("testcase")
    assert len(cases) == 3 * len(matrix.CHECK_COLUMNS) == int(suite.get("tests", "0"))
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
    doc = sample_doc()
    html = report.matrix_html(doc, matrix.regressions(doc, doc))
    grid = Grid()
    grid.feed(html)
    assert list(grid.rows) == ["a", "b<script>", "c"]
    assert grid.scripts == 0  # names are escaped
    assert grid.rows["a"]["toolchain"] == "s-passed|passed"
    assert grid.rows["a"]["sampling"] == "s-skipped|skipped"
    assert grid.rows["b<script>"]["resolve"] == "s-refused|refused"
    assert grid.rows["c"]["kernel-compile"] == "s-failed|failed"
    assert all(len(cols) == len(matrix.CHECK_COLUMNS) for cols in grid.rows.values())


def test_regressions_against_a_baseline() -> None:
    old = sample_doc()
    new = json.loads(json.dumps(old))
    new["cells"][0]["columns"]["cubin"] = "failed"
    assert matrix.regressions(old, new) == ["a: cubin passed before, failed now"]
    assert matrix.regressions(old, old) == []
    md = report.matrix_markdown(new, matrix.regressions(old, new))
    assert "- a: cubin passed before, failed now" in md


def test_rendered_page_in_headless_chromium(tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    page = tmp_path / "matrix.html"
    page.write_text(report.matrix_html(sample_doc()))
    done = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
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
