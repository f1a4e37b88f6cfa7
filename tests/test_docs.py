"""The documentation: the generated reference pages match the code they come from, every
command a page shows parses, every troubleshooting page says cause / see it / fix it / where
from, the README is the front door it should be, and the built site (mkdocs --strict) renders
its headings and finds each troubleshooting page from the message, in headless Chromium."""

from __future__ import annotations

import html
import os
import re
import shlex
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.cli import docgen
from builder.cli import parser as cliargs
from builder.core import errors, variables
from tests import chromium
from tests.helpers import REPO, served

DOCS = REPO / "docs"
TROUBLE = DOCS / "troubleshooting"

# Each message a user pastes, and the page that must answer it (the list).
MESSAGES = {
    "SM 12.x requires CUDA >= 12.9": "sm12x-requires-cuda-12-9",
    "no kernel image is available for execution on the device": "no-kernel-image",
    "CUDA driver version is insufficient for CUDA runtime version": "driver-insufficient",
    "CUDA compiler and CUDA toolkit headers are incompatible": "headers-incompatible",
    "Could not detect CUDA compute_cap automatically": "compute-cap",
    "cudaErrorInsufficientDriver": "reused-jit-module",
    "torch.cuda.is_available() False aarch64": "cpu-only-torch-aarch64",
    "sm_121a": "triton-ptxas-sm121a",
    "mismatches the version that was used to compile PyTorch": "cuda-version-mismatch",
    "Not compiled with GPU support": "built-without-cuda",
    "Setting accelerator to CPU": "built-without-cuda",
}


def test_the_generated_pages_are_what_the_code_says() -> None:
    stale = [str(rel) for rel, text in docgen.pages().items()
             if (REPO / rel).read_text(encoding="utf-8") != text]  # fmt: skip
    assert stale == [], "run `python -m builder.cli.docgen` and commit the pages"


@pytest.mark.slow
def test_docgen_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    assert docgen.main(["--root", str(tmp_path)]) == 0  # writes them
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 0
    page = tmp_path / "docs" / "reference" / "commands.md"
    page.write_text(page.read_text().replace("`--upgrade`", "`--upgrayedd`"))
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 1


def test_every_command_and_argument_is_in_the_reference() -> None:
    text = (DOCS / "reference" / "commands.md").read_text()
    parser = cliargs.make_parser()
    listed = list(docgen.commands(parser))
    assert len(listed) >= 20
    missing = []
    for prog, sub in [("cudaenv", parser), *listed]:
        if prog != "cudaenv" and f"## `{prog}`" not in text:
            missing.append(prog)
        for action in docgen.shown(sub):
            for option in action.option_strings:
                if f"`{option}" not in text:
                    missing.append(f"{prog} {option}")
    assert missing == []
    # What the generator is given is all it writes: a flag it does not know is not there.
    assert "--upgrayedd" not in text


def _error_classes(cls: type[errors.CudaenvError]) -> Iterator[type[errors.CudaenvError]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _error_classes(sub)


def test_every_exit_code_is_in_the_table_and_the_reference() -> None:
    import builder.adopt.repair  # noqa: F401  (its own error class)

    codes = {code for code, _, _ in errors.EXIT_CODES}
    raised = {c.exit_code for c in _error_classes(errors.CudaenvError)}
    assert raised <= codes
    assert {0, 126, 127, 130, 141} <= codes  # the CLI's own
    text = (DOCS / "reference" / "exit-codes.md").read_text()
    assert all(f"\n| {code} |" in text for code in codes)
    helped = cliargs.make_parser().format_help()
    assert all(f" {code} " in " ".join(helped.split()) for code in codes)


def test_every_variable_is_in_the_table_and_the_reference() -> None:
    named = {v.name for v in variables.TABLE}
    # Every CUDAENV_* name the code or a template spells is a row of the table.
    spelled: set[str] = set()
    for root in (REPO / "builder", REPO / "templates"):
        for path in root.rglob("*"):
            if path.suffix in {".py", ".j2"} and path.is_file():
                spelled |= set(re.findall(r"\bCUDAENV_[A-Z][A-Z_]*[A-Z]\b", path.read_text()))
    assert spelled - named == set()
    text = (DOCS / "reference" / "variables.md").read_text()
    assert [n for n in sorted(named) if f"`{n}`" not in text] == []


def _commands_shown(page: Path) -> Iterator[tuple[int, list[str]]]:
    """Each `cudaenv ...` command line in a page's sh/text code blocks (after `$ ` and any
    VAR=value prefixes), as argv."""
    fence = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            continue
        text = line.removeprefix("$ ")
        if not re.match(r"([A-Z_][A-Z0-9_]*=\S*\s+)*cudaenv\s", text):
            continue
        words = shlex.split(text, comments=True)
        # Up to a redirection or the next command: what the shell, not cudaenv, reads.
        for i, word in enumerate(words):
            if word in {">", ">>", "<", "|", "&&", ";", "||"} or word.startswith(">"):
                words = words[:i]
                break
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words = words[1:]
        if words[:1] == ["cudaenv"]:
            yield number, words[1:]


def _parses(argv: list[str]) -> str | None:
    parser = cliargs.make_parser()
    try:
        with Path(os.devnull).open("w") as quiet:
            saved, sys.stderr = sys.stderr, quiet
            try:
                cliargs.parse(parser, argv)
            finally:
                sys.stderr = saved
    except SystemExit as stop:
        return None if stop.code == 0 else f"exit {stop.code}"
    return None


@pytest.mark.slow
def test_every_command_a_page_shows_parses() -> None:
    pages = [*DOCS.rglob("*.md"), REPO / "README.md"]
    bad = [f"{page.relative_to(REPO)}:{number}: cudaenv {shlex.join(argv)}: {problem}"
           for page in pages for number, argv in _commands_shown(page)
           if (problem := _parses(argv)) is not None]  # fmt: skip
    assert bad == []
    # The check can fail: a flag no command has is refused.
    assert _parses(["build", "--no-such-flag", "x.yaml"]) is not None
    assert _parses(["nosuchcommand"]) is not None


@pytest.mark.parametrize(
    "page", sorted(p.name for p in TROUBLE.glob("*.md") if p.name != "index.md")
)
def test_a_troubleshooting_page_has_cause_command_fix_and_origin(page: str) -> None:
    text = (TROUBLE / page).read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    titles = [s.split("\n", 1)[0].strip() for s in sections[1:]]
    assert titles == ["Cause", "See it", "Fix it", "Where it comes from"]
    see, fix, origin = sections[2], sections[3], sections[4]
    assert list(_commands_shown(TROUBLE / page)), "names no cudaenv command"
    for part in (see, fix):
        assert re.search(r"^cudaenv \w+", part, flags=re.M), part[:80]
    # The upstream report it comes from, as owner/repo#N.
    assert re.search(r"\b[\w.-]+/[\w.-]+#\d+", origin), origin
    # Listed in the index, and the message it answers is in it verbatim.
    index = (TROUBLE / "index.md").read_text()
    assert f"]({page})" in index
    for message, slug in MESSAGES.items():
        if slug == page.removesuffix(".md") and " " in message and "False" not in message:
            assert message in text


def test_the_readme_is_the_front_door() -> None:
    readme = (REPO / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 90
    first = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    assert first.splitlines() == ["sh tools/nox.sh -s build-env", "sh tools/nox.sh -s tests"]
    # Right after them: how long each takes, and the quick path.
    after = readme.split("```", 2)[2].split("## ", 1)[0]
    assert re.search(r"about \d+ minutes on 2 cores", after)
    assert re.search(r"every test .*about \d+ minutes", after, re.S)
    assert "sh tools/nox.sh -s fast" in after
    assert "SM 12.x requires CUDA >= 12.9" in readme
    # Every link goes into the repository, to a file that exists.
    links = re.findall(r"\]\(([^)]+)\)", readme)
    assert links and all(not re.match(r"\w+://", link) for link in links)
    assert [link for link in links if not (REPO / link.split("#")[0]).is_file()] == []
    # Nothing it says lives only there: its transcript is on the site's pages too.
    transcript = readme.split("```text\n", 1)[1].split("```", 1)[0]
    site = "\n".join(p.read_text() for p in DOCS.rglob("*.md"))
    assert [line for line in transcript.splitlines() if line not in site] == []


def mkdocs_build(config: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of ``config`` into ``out`` (never `-q`: mkdocs then stops
    counting warnings, and strict passes what it should refuse)."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the `test` dependency group)")
    pytest.importorskip("material", reason="mkdocs-material is not installed")
    root = tmp_path_factory.mktemp("site")
    done = mkdocs_build(REPO / "mkdocs.yml", root)
    assert done.returncode == 0, done.stderr[-3000:]
    with served(root) as url:
        yield url


@pytest.mark.slow
def test_the_site_builds_strict_and_a_broken_link_fails_it(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the `test` dependency group)")
    pytest.importorskip("material", reason="mkdocs-material is not installed")
    copy = tmp_path / "repo"
    (copy / "docs").mkdir(parents=True)
    subprocess.run(["cp", "-r", f"{DOCS}/.", str(copy / "docs")], check=True)
    (copy / "mkdocs.yml").write_text((REPO / "mkdocs.yml").read_text())
    page = copy / "docs" / "guides" / "same-env.md"
    page.write_text(page.read_text() + "\n[x](../concepts/matched.md#no-such-heading)\n")
    done = mkdocs_build(copy / "mkdocs.yml", tmp_path / "out")
    assert done.returncode != 0
    assert "no-such-heading" in done.stderr
    # A page outside the nav fails it too.
    page.write_text(page.read_text().replace("[x](../concepts/matched.md#no-such-heading)", ""))
    (copy / "docs" / "guides" / "orphan.md").write_text("# An orphan\n")
    done = mkdocs_build(copy / "mkdocs.yml", tmp_path / "out")
    assert done.returncode != 0
    assert "orphan.md" in done.stderr


@pytest.mark.slow
def test_the_search_index_holds_every_message_on_its_page(site: str) -> None:
    import json
    import urllib.request

    index = f"{site}/search/search_index.json"  # http on loopback, the fixture's server
    with urllib.request.urlopen(index, timeout=30) as answer:  # noqa: S310
        docs = json.load(answer)["docs"]
    for message, slug in MESSAGES.items():
        words = [w for w in re.split(r"[\s(),]+", message) if w and w != "False"]
        text = " ".join(html.unescape(d["title"] + " " + d["text"]) for d in docs
                        if d["location"].startswith(f"troubleshooting/{slug}/"))  # fmt: skip
        assert text, slug
        assert all(w in text for w in words), (slug, [w for w in words if w not in text])


@pytest.mark.slow
def test_the_site_renders_in_headless_chromium_and_its_search_finds_each_message(
    site: str, tmp_path: Path
) -> None:
    browser = chromium.find()
    if browser is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    headings = "[...document.querySelectorAll('article h1, article h2')].map(h => h.textContent.replace('¶', '').trim())"
    with chromium.Browser(browser, tmp_path / "profile") as page:
        page.open(f"{site}/")
        home = page.evaluate(headings)
        assert home[:4] == ["cudaenv", "The problem", "Start", "What it looks like"]
        page.open(f"{site}/troubleshooting/sm12x-requires-cuda-12-9/")
        assert page.evaluate(headings) == [
            '"SM 12.x requires CUDA >= 12.9"',
            "Cause",
            "See it",
            "Fix it",
            "Where it comes from",
        ]
        # The nav lists every other troubleshooting page.
        nav = " ".join(page.evaluate(
            "[...document.querySelectorAll('nav a')].map(a => a.href)"))  # fmt: skip
        others = [s for s in MESSAGES.values() if s != "sm12x-requires-cuda-12-9"]
        assert [s for s in others if f"/troubleshooting/{s}/" not in nav] == []
        for message, slug in MESSAGES.items():
            page.open(f"{site}/?q={urllib.parse.quote(message)}")
            page.wait_for(
                "/matching|No matching/.test(document.querySelector('.md-search-result__meta')"
                "?.textContent || '')"
            )
            first = page.evaluate(
                "document.querySelector('.md-search-result__item > a')?.getAttribute('href')"
            )
            assert first is not None and f"/troubleshooting/{slug}/" in first, (message, first)
        # A message no page holds finds nothing: the search is not a constant.
        page.open(f"{site}/?q=zzqxnotamessage")
        page.wait_for(
            "/No matching/.test(document.querySelector('.md-search-result__meta')?.textContent || '')"
        )


@pytest.mark.slow
def test_the_docs_session_and_ci_build_the_site() -> None:
    noxfile = (REPO / "noxfile.py").read_text()
    assert '"mkdocs", "build", "--strict"' in noxfile and '"builder.cli.docgen"' in noxfile
    assert "sh tools/nox.sh -s docs" in (REPO / ".ci" / "run").read_text()


def test_the_fast_session_installs_no_system_package() -> None:
    """`nox -s fast` is the quick check a contributor runs anywhere, root included: no
    apt-get from it, directly or through the helper the full sessions use."""
    import ast

    tree = ast.parse((REPO / "noxfile.py").read_text())
    fast = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "fast")
    names = {n.id for n in ast.walk(fast) if isinstance(n, ast.Name)}
    said = {n.value for n in ast.walk(fast) if isinstance(n, ast.Constant)}
    assert "_test_programs" not in names and "apt-get" not in said
    # And the helper is a real one the full session calls: the check is not vacuous.
    tests = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "tests")
    assert "_test_programs" in {n.id for n in ast.walk(tests) if isinstance(n, ast.Name)}
