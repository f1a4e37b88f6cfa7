"""cudaenv's configuration is read once, in one place: the cascade (command line > environment
> pyproject.toml > default) with where each value came from, the start-up refusal of a bad
value, ``--debug``'s print, and no other builder module reading the environment."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from builder.core import paths, settings, variables
from builder.verify import model
from tests.helpers import write

BUILDER = Path(__file__).resolve().parent.parent / "builder"
REMOTE = "CUDAENV_JIT_REMOTE"


# --------------------------------------------------------------------------- the table


def test_every_field_is_a_rows_setting_or_a_flag() -> None:
    rows = [v.setting.field for v in variables.TABLE if v.setting is not None]
    assert len(rows) == len(set(rows))
    names = {f.name for f in dataclasses.fields(settings.Settings)} - {"origins"}
    assert names == set(rows) | set(settings.FLAGS)


def test_the_defaults_are_the_tables() -> None:
    """The dataclass's own defaults agree with the rows' (the rows decide: resolve applies
    them), so a Settings() built by hand is the settings of an empty environment."""
    assert settings.resolve({}) == settings.Settings()
    found = settings.resolve({})
    assert found.jit_store_max == 10 << 30 and found.jit_remote_timeout == 30.0
    assert all(found.origin(f) == settings.DEFAULT for f in ("jit_store_max", "jit_remote"))


# --------------------------------------------------------------------------- the cascade


def test_command_line_over_environment_over_pyproject_over_default(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    from_project = {"jit_remote": "oci://project.example/jit"}
    env = {REMOTE: "oci://env.example/jit"}

    default = settings.resolve({}).with_pyproject({"jit_remote": None}, pyproject)
    assert (default.jit_remote, default.origin("jit_remote")) == (None, "default")

    project = settings.resolve({}).with_pyproject(from_project, pyproject)
    assert project.jit_remote == "oci://project.example/jit"
    assert project.origin("jit_remote") == f"{pyproject} [tool.cudaenv] jit-remote"

    environment = settings.resolve(env).with_pyproject(from_project, pyproject)
    assert (environment.jit_remote, environment.origin("jit_remote")) == (
        "oci://env.example/jit",
        REMOTE,
    )

    flag = settings.resolve(env, flags={"jit_remote": "oci://flag.example/jit"})
    flag = flag.with_pyproject(from_project, pyproject)
    assert (flag.jit_remote, flag.origin("jit_remote")) == (
        "oci://flag.example/jit",
        settings.COMMAND_LINE,
    )


def test_off_in_the_environment_wins_over_the_project() -> None:
    found = settings.resolve({REMOTE: "off"}).with_pyproject({"jit_remote": "oci://p/j"}, None)
    assert found.jit_remote is None and found.origin("jit_remote") == REMOTE


def test_values_are_typed_and_derived_ones_say_so(tmp_path: Path) -> None:
    found = settings.resolve(
        {
            "CUDAENV_JIT_STORE_MAX": "5G",
            "CUDAENV_JIT_PUSH": "1",
            "CUDAENV_JIT_SIGNING_KEY": str(tmp_path / "key"),
            "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        }
    )
    assert found.jit_store_max == 5 << 30 and found.jit_push is True
    assert found.jit_signing_key == tmp_path / "key"
    assert found.cache_dir == tmp_path / "xdg" / "cudaenv"
    assert found.origin("cache_dir") == "XDG_CACHE_HOME"
    own = settings.resolve({"CUDAENV_CACHE_DIR": str(tmp_path / "c"), "XDG_CACHE_HOME": "/x"})
    assert (own.cache_dir, own.origin("cache_dir")) == (tmp_path / "c", "CUDAENV_CACHE_DIR")


def test_resolved_once_and_again_only_where_the_environment_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = settings.current()
    assert settings.current() is first
    monkeypatch.setenv(REMOTE, "oci://changed.example/jit")
    assert settings.current() is not first
    assert settings.current().jit_remote == "oci://changed.example/jit"


# --------------------------------------------------------------------------- bad values


def test_a_bad_value_is_one_located_line_at_start_up(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from builder.cli import main as cli

    monkeypatch.setenv("CUDAENV_JIT_STORE_MAX", "lots")
    assert cli.main(["store", "list"]) == 2
    err = capsys.readouterr().err
    assert err == "error: CUDAENV_JIT_STORE_MAX=lots: not a size (like 10G, 500M or 1048576)\n"


def test_a_process_started_otherwise_takes_the_default_and_says_why() -> None:
    found = settings.resolve({"CUDAENV_JIT_REMOTE_TIMEOUT": "nan"})
    assert found.jit_remote_timeout == 30.0
    assert found.origin("jit_remote_timeout").startswith(
        "default (CUDAENV_JIT_REMOTE_TIMEOUT=nan refused: not a number of seconds"
    )


# --------------------------------------------------------------------------- --debug


def test_debug_prints_each_setting_and_where_it_came_from_before_any_work(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from builder.cli import main as cli

    write(in_tmp / "pyproject.toml", '[tool.cudaenv]\njit-remote = "oci://project.example/j"\n')
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(in_tmp / "store"))
    monkeypatch.setenv("CUDAENV_JIT_REMOTE_TIMEOUT", "12")
    assert cli.main(["--debug", "store", "list"]) == 0
    lines = capsys.readouterr().err.splitlines()
    shown = [line for line in lines if line.startswith("cudaenv: setting ")]
    assert f"cudaenv: setting CUDAENV_JIT_STORE = {in_tmp / 'store'}  (CUDAENV_JIT_STORE)" in shown
    assert "cudaenv: setting CUDAENV_JIT_REMOTE_TIMEOUT = 12  (CUDAENV_JIT_REMOTE_TIMEOUT)" in shown
    assert "cudaenv: setting --debug = True  (command line)" in shown
    assert "cudaenv: setting CUDAENV_JIT_STORE_MAX = 10737418240  (default)" in shown
    assert (
        "cudaenv: setting CUDAENV_JIT_REMOTE = oci://project.example/j  "
        f"({in_tmp / 'pyproject.toml'} [tool.cudaenv] jit-remote)"
    ) in shown
    assert len(shown) == len(dataclasses.fields(settings.Settings)) - 1
    assert lines[: len(shown)] == shown  # before anything the command says


def test_debug_never_prints_a_registry_password_and_keeps_the_exit_code(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A registry's login written in its URL is shown without its password; an error under
    ``--debug`` prints its traceback and still exits with its documented code."""
    from builder.cli import main as cli

    monkeypatch.setenv("CUDAENV_JIT_STORE", str(in_tmp / "store"))
    monkeypatch.setenv("CUDAENV_JIT_REMOTE", "oci://admin:hunter2@registry.example:5000/jit")
    assert cli.main(["--debug", "store", "list"]) == 0
    err = capsys.readouterr().err
    assert "hunter2" not in err
    assert "CUDAENV_JIT_REMOTE = oci://admin:***@registry.example:5000/jit" in err
    bad = write(in_tmp / "bad.yaml", "name: [\n")
    assert cli.main(["--debug", "plan", str(bad)]) == 2  # a spec error, as without --debug
    err = capsys.readouterr().err
    assert "Traceback" in err and "error: " in err


def test_without_debug_nothing_is_printed(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from builder.cli import main as cli

    assert cli.main(["store", "list"]) == 0
    assert "setting" not in capsys.readouterr().err


# --------------------------------------------------------------------------- one reader

# The settings module reads the environment; the probes run inside other interpreters and
# import nothing of cudaenv; the store runs inside them too (builder/store/).
MAY_READ_ENVIRON = {"core/settings.py"}
MAY_READ_ENVIRON_UNDER = ("probe", "store")


def environ_reads(source: str) -> list[int]:
    """The lines of ``source`` that touch the process environment: ``os.environ``,
    ``os.getenv``, ``os.environb``, ``os.putenv`` or a name imported from ``os`` as one."""
    found = []
    names = {"environ", "environb", "getenv", "putenv", "unsetenv"}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                found.append(node.lineno)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(alias.name in names for alias in node.names)
        ):
            found.append(node.lineno)
    return found


@pytest.mark.slow
def test_only_the_settings_module_reads_the_environment() -> None:
    readers = []
    for path in sorted(BUILDER.rglob("*.py")):
        rel = path.relative_to(BUILDER)
        if rel.parts[0] in MAY_READ_ENVIRON_UNDER or str(rel) in MAY_READ_ENVIRON:
            continue
        readers += [f"builder/{rel}:{line}" for line in environ_reads(path.read_text())]
    assert readers == [], "read it through builder/core/settings.py (settings.current())"


def test_an_environment_read_is_caught() -> None:
    code = (
        "import os\nfrom os import getenv\n"
        "x = os.environ.get('CUDAENV_X')\ny = dict(os.environ)\nz = os.getenv('A')\n"
        "s = 'os.environ in a string is no read'\n"
    )
    assert sorted(environ_reads(code)) == [2, 3, 4, 5]


def store_constructions(source: str) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "Store")
            or (isinstance(node.func, ast.Name) and node.func.id == "Store")
        )
    ]


@pytest.mark.slow
def test_one_place_makes_the_store() -> None:
    """paths.store_at makes each root's Store once per process; everyone asks it."""
    makers = [
        f"builder/{path.relative_to(BUILDER)}:{line}"
        for path in sorted(BUILDER.rglob("*.py"))
        if path.relative_to(BUILDER).parts[0] not in MAY_READ_ENVIRON_UNDER
        for line in store_constructions(path.read_text())
    ]
    assert [m.split(":")[0] for m in makers] == ["builder/core/paths.py"]
    assert store_constructions("s = jit_store.Store(root)\nt = Store(r)\n") == [1, 2]


def test_the_store_is_made_once_per_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "a"))
    first = paths.jit_store_here()
    assert first is not None and paths.jit_store_here() is first
    monkeypatch.setenv("CUDAENV_JIT_STORE", "off")
    assert paths.jit_store_here() is None


def test_the_remote_is_the_one_the_target_was_made_with(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Resolved once (pipeline.jit_remote_for, where the target is made): the probe's
    environment is not asked again."""
    monkeypatch.setenv(REMOTE, "oci://env.example/jit")
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store"))
    python = tmp_path / "bin" / "python"
    without = model.Target(python=python, archs=(), work=tmp_path, jit_remote=None)
    assert "CUDAENV_JIT_SHARE" not in model.target_env(without)
    made = model.Target(python=python, archs=(), work=tmp_path, jit_remote="oci://t.example/j")
    env = model.target_env(made)
    assert env[REMOTE] == "oci://t.example/j" and "CUDAENV_JIT_SHARE" in env
