"""Sessions of cudaenv. `nox -s build-env` is the main job."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["build-env"]
nox.options.reuse_existing_virtualenvs = True

DEFAULT_SPEC = "envspecs/default.yaml"
PYPROJECT = nox.project.load_toml("pyproject.toml")


def _install(session: nox.Session, *groups: str) -> None:
    # Editable: templates/ and the specs are read from this checkout.
    session.install("-e", ".")
    for group in groups:
        session.install(*nox.project.dependency_groups(PYPROJECT, group))


@nox.session(name="build-env")
def build_env(session: nox.Session) -> None:
    """Build (locking first if a spec has no lock) and verify each spec; default
    envspecs/default.yaml. A failed check fails the session (exit code 5)."""
    _install(session)
    specs = session.posargs or [DEFAULT_SPEC]
    session.run("cudaenv", "build", "--verify", *specs)


@nox.session(name="verify-env")
def verify_env(session: nox.Session) -> None:
    """Verify already built envs (posargs: spec paths)."""
    _install(session)
    for spec in session.posargs or [DEFAULT_SPEC]:
        session.run("cudaenv", "verify", spec)


@nox.session(python=False)
def install(session: nox.Session) -> None:
    """Put the `cudaenv` command on PATH: `uv tool install` of this checkout with the uv that
    tools/nox.sh installed beside nox (so it works on a box with no uv or pipx on PATH)."""
    bin_dir = session.run(
        sys.executable, "-m", "uv", "tool", "dir", "--bin", silent=True, external=True
    )
    session.run(
        sys.executable, "-m", "uv", "tool", "install", "--force", "--reinstall", ".",
        external=True,
    )  # fmt: skip
    where = str(bin_dir).strip() if isinstance(bin_dir, str) else ""
    on_path = where in os.environ.get("PATH", "").split(os.pathsep)
    session.log(
        f"cudaenv is {where}/cudaenv"
        + ("" if on_path else f"; {where} is not on PATH: add it (`{sys.executable} -m uv tool "
           "update-shell` does that for your shell)")
    )  # fmt: skip


@nox.session
def matrix(session: nox.Session) -> None:
    """Build and verify every cell of the release matrix (posargs: matrix file, options);
    reports in .envs/.matrix/NAME/report/ (JSON, HTML, Markdown, JUnit)."""
    _install(session)
    args = session.posargs or ["envspecs/matrix/release.yaml", "-j", "2"]
    session.run("cudaenv", "matrix", *args)


@nox.session(name="cudaenv")
def cudaenv_cli(session: nox.Session) -> None:
    """Run cudaenv itself with the posargs: `nox -s cudaenv -- doctor --python PATH`."""
    _install(session)
    session.run("cudaenv", *session.posargs)


@nox.session
def lock(session: nox.Session) -> None:
    """Re-lock specs (default: every spec in envspecs/)."""
    _install(session)
    specs = session.posargs or sorted(str(p) for p in Path("envspecs").glob("*.yaml"))
    session.run("cudaenv", "lock", *specs)


@nox.session
def compat(session: nox.Session) -> None:
    """Regenerate the compatibility page (docs/reference/compat.md and its data compat.json)
    from the shipped specs' locks: reads their wheels for both platforms (the first run
    downloads them into uv's cache)."""
    _install(session)
    session.run("python", "-m", "builder.commands.compat", *session.posargs)


# Programs some tests drive, and the Debian package of each (as .ci/run installs them).
TEST_PROGRAMS = {"docker-registry": "docker-registry", "redis-server": "redis-server"}


def _test_programs(session: nox.Session) -> None:
    """The real services the tests start (an OCI registry, a Redis server, on loopback):
    installed with apt where this runs as root on Debian/Ubuntu; elsewhere their tests skip,
    and pytest's summary counts them (tests/conftest.py)."""
    missing = [p for p in TEST_PROGRAMS if shutil.which(p) is None]
    if not missing:
        return
    if os.name == "posix" and os.geteuid() == 0 and shutil.which("apt-get"):
        packages = [TEST_PROGRAMS[p] for p in missing]
        session.log(f"installing {', '.join(packages)} with apt-get for the tests that use them")
        session.run("apt-get", "update", "-qq", external=True, success_codes=[0, 100])
        session.run(
            "apt-get", "install", "-y", "-qq", *packages, external=True, success_codes=[0, 100],
            env={"DEBIAN_FRONTEND": "noninteractive"},
        )  # fmt: skip
    else:
        session.log(
            f"{', '.join(missing)} not installed (apt-get install {' '.join(missing)} as root): "
            "the tests that need it skip; the summary counts them"
        )


@nox.session
def tests(session: nox.Session) -> None:
    """Every test but the heavy ones: unit, slow, network and e2e (gpu tests skip with their
    reason without a GPU). `-m ...` in the posargs replaces the marker choice."""
    _install(session, "test")
    _test_programs(session)
    # The heavy builds (half an hour of nvcc each on 2 cores) have their own session: a later
    # -m in the posargs wins (pytest keeps the last).
    # Two workers a file at a time (pytest-xdist's loadfile: a file's tests keep their order
    # and its module fixtures are made once): the e2e tests spend much of their time in one
    # core (a single nvcc, Python imports) or on the network (a cold uv cache), and another
    # file's test fills the other core. On 2 cores from a fresh machine this took the suite
    # from 2,801 s to the figure in docs/development/testing.md.
    session.run(
        "pytest", "-n", "auto", "--maxprocesses", "4", "--dist", "loadfile", "-m", "not heavy",
        *session.posargs, env={"PYTHONDONTWRITEBYTECODE": None},
    )  # fmt: skip


@nox.session
def heavy(session: nox.Session) -> None:
    """The heavy tests alone: real sdists whose own gencode lists take tens of minutes of nvcc
    (causal-conv1d 1.7.0: about 30 minutes on 2 cores, cold). Run weekly by
    .github/workflows/heavy.yml, and by hand with `sh tools/nox.sh -s heavy`."""
    _install(session, "test")
    _test_programs(session)
    session.run("pytest", "-m", "heavy", *session.posargs)


@nox.session
def fast(session: nox.Session) -> None:
    """The offline unit tests, the slow ones left out (`-m slow` runs those): no network, no
    full builds; about a minute on 2 cores."""
    _install(session, "test")
    # No system packages here: the tests that start a registry or Redis are full-session ones
    # (`tests`, `.ci/run`), and a quick check must not reach for apt-get as root.
    # One worker a core (pytest-xdist): most of these tests start the CLI in a child process,
    # and waiting on one at a time is what made this session slow.
    # Bytecode kept, whatever the shell says: under PYTHONDONTWRITEBYTECODE pytest rewrites
    # the asserts of every test module again in each worker (~5 s of a minute on 2 cores),
    # and every CLI child compiles cudaenv again.
    session.run(
        "pytest", "-n", "auto", "-m", "not network and not e2e and not slow", *session.posargs,
        env={"PYTHONDONTWRITEBYTECODE": None},
    )  # fmt: skip


@nox.session
def bench(session: nox.Session) -> None:
    """Time cudaenv against raw uv and pip; writes benchmarks/results.{json,md,png}.
    Not part of the tests: the full run downloads the default stack cold twice and runs a
    pip install (~20 min). `nox -s bench -- --quick` for a short one."""
    # Not editable: users install cudaenv as a package, and an editable install's import
    # finder costs every cudaenv start ~11 ms that no user pays.
    session.install("--reinstall-package", "cudaenv", ".")
    session.install(*nox.project.dependency_groups(PYPROJECT, "bench"))
    session.run("python", "benchmarks/run.py", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site: regenerate the reference pages from the code (commands from the
    argument parser, variables, exit codes), then `mkdocs build --strict` into build/site/ (a
    broken link or anchor, or a page outside the nav, fails). `-- serve` serves it instead."""
    _install(session, "docs")
    # Material's notice about its successor, printed on every build, is not about this site.
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    session.run("python", "-m", "builder.cli.docgen")
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", *session.posargs[1:])
    else:
        session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff and mypy --strict over builder/, tests/ and noxfile.py."""
    _install(session, "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
