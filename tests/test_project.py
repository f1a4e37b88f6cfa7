"""The project's [tool.cudaenv] settings: found in the nearest pyproject.toml, validated all at
once, and what each lock mode writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.core.errors import ResolveError, SpecError
from builder.env import build
from builder.spec import envspec as spec
from builder.spec import project, resolve
from builder.spec.lock import LockedFile, LockedPackage
from tests.helpers import cudaenv, write

SPEC = 'name: x\npython: "3.12"\ncuda: "13.0"\n'


def test_no_pyproject_means_locks_of_urls(tmp_path: Path) -> None:
    settings = project.settings_for(write(tmp_path / "envspecs" / "x.yaml", SPEC))
    assert settings == project.Settings(locks="urls", wheelhouse="wheels", source=None)
    assert settings.lock_wheelhouse is None


def test_the_nearest_pyproject_decides(tmp_path: Path) -> None:
    write(tmp_path / "pyproject.toml", '[tool.cudaenv]\nlocks = "index-neutral"\n')
    spec_file = write(tmp_path / "envspecs" / "x.yaml", SPEC)
    settings = project.settings_for(spec_file)
    assert settings.lock_wheelhouse == "wheels" and settings.source == tmp_path / "pyproject.toml"
    write(
        tmp_path / "pyproject.toml",
        '[tool.cudaenv]\nlocks = "index-neutral"\nwheelhouse = "../w/"\n',
    )
    assert project.settings_for(spec_file).lock_wheelhouse == "../w"
    # A nested project is its own, with or without a [tool.cudaenv] table.
    write(tmp_path / "envspecs" / "pyproject.toml", '[project]\nname = "inner"\n')
    assert project.settings_for(spec_file).lock_wheelhouse is None


def test_every_problem_of_the_table_is_reported_at_once(in_tmp: Path) -> None:
    write(
        in_tmp / "pyproject.toml",
        '[tool.cudaenv]\nlock = "urls"\nlocks = "neutral"\nwheelhouse = "/srv/wheels"\n',
    )
    with pytest.raises(SpecError) as info:
        project.settings_for(write(in_tmp / "x.yaml", SPEC))
    assert info.value.problems == [
        "pyproject.toml: tool.cudaenv.lock: unknown key; did you mean 'locks'?",
        "pyproject.toml: tool.cudaenv.locks: expected one of 'urls', 'index-neutral', got "
        "'neutral'",
        "pyproject.toml: tool.cudaenv.wheelhouse: '/srv/wheels' must be a relative POSIX path "
        "(relative to the lock file's directory)",
    ]
    assert info.value.what == "project settings"


def test_a_bad_setting_stops_lock_before_any_resolver_call(tmp_path: Path) -> None:
    write(tmp_path / "pyproject.toml", "[tool.cudaenv]\nlocks = 3\n")
    write(tmp_path / "envspecs" / "x.yaml", SPEC)
    done = cudaenv(
        "lock", "envspecs/x.yaml", cwd=tmp_path, check=False, env={"CUDAENV_UV": "/nonexistent"}
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-2:] == [
        "error: pyproject.toml: tool.cudaenv.locks: expected one of 'urls', 'index-neutral', "
        "got the number 3",
        "error: 1 problem(s) in the project settings; nothing was done",
    ]


def wheel(name: str, url: str) -> LockedFile:
    return LockedFile(name=name, sha256="0" * 64, url=url)


OPEN = LockedPackage(
    name="six",
    version="1.16.0",
    wheels=(wheel("six-1.16.0-py2.py3-none-any.whl", "https://mirror.invalid/six.whl"),),
    sdist=wheel("six-1.16.0.tar.gz", "https://mirror.invalid/six.tar.gz"),
)
PINNED = LockedPackage(
    name="torch",
    version="2.14.1",
    wheels=(
        wheel(
            "torch-2.14.1-cp312-cp312-manylinux_2_28_x86_64.whl",
            "https://pinned.invalid/whl/cu130/torch-2.14.1-cp312-cp312-manylinux_2_28_x86_64.whl",
        ),
    ),
)


def pinned_spec(tmp_path: Path) -> spec.EnvSpec:
    return spec.load(
        write(
            tmp_path / "x.yaml",
            SPEC + "packages: [six]\nindexes: {torch: https://pinned.invalid/whl/cu130}\n",
        )
    )


def test_locks_of_urls_keep_every_url(tmp_path: Path) -> None:
    got = resolve.pin_sources(pinned_spec(tmp_path), [OPEN, PINNED])
    assert got[0] == OPEN
    assert got[1].wheels == PINNED.wheels and got[1].index == "https://pinned.invalid/whl/cu130"


def test_index_neutral_locks_name_paths_and_keep_only_pinned_urls(tmp_path: Path) -> None:
    got = resolve.pin_sources(pinned_spec(tmp_path), [OPEN, PINNED], wheelhouse="wheels")
    assert [(f.url, f.path) for f in got[0].files] == [
        (None, "wheels/six-1.16.0-py2.py3-none-any.whl"),
        (None, "wheels/six-1.16.0.tar.gz"),
    ]
    # The spec chose that host: its URL stays, in both modes.
    assert got[1].wheels == PINNED.wheels and got[1].index == "https://pinned.invalid/whl/cu130"
    other = resolve.pin_sources(pinned_spec(tmp_path), [OPEN], wheelhouse="../../wheels")
    assert other[0].wheels[0].path == "../../wheels/six-1.16.0-py2.py3-none-any.whl"


def test_a_pinned_package_from_elsewhere_is_refused_in_both_modes(tmp_path: Path) -> None:
    stray = LockedPackage(
        name="torch",
        version="2.14.1",
        wheels=(wheel("torch-2.14.1-py3-none-any.whl", "https://mirror.invalid/torch.whl"),),
    )
    for wheelhouse in (None, "wheels"):
        with pytest.raises(ResolveError, match=r"torch must come from https://pinned\.invalid"):
            resolve.pin_sources(pinned_spec(tmp_path), [stray], wheelhouse=wheelhouse)


def test_a_specs_env_lives_in_the_project_that_holds_the_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cudaenv verify ~/proj/envspecs/x.yaml` run from elsewhere finds ~/proj/.envs/x, not
    ./.envs/x; a spec outside any project keeps the current directory's envs dir."""
    proj = tmp_path / "proj"
    spec_file = write(proj / "envspecs" / "x.yaml", SPEC)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert build.default_env_dir(spec.load(spec_file)) == proj / ".envs" / "x"
    assert build.default_env_dir(spec.load(Path("../proj/envspecs/x.yaml"))) == (
        proj / ".envs" / "x"
    )
    loose = write(tmp_path / "loose" / "x.yaml", SPEC)
    assert build.default_env_dir(spec.load(loose)) == elsewhere / ".envs" / "x"
    # Through the CLI: verify looks for the env in the spec's project.
    done = cudaenv("verify", "../proj/envspecs/x.yaml", cwd=elsewhere, check=False)
    assert done.returncode == 4
    assert f"error: {proj / '.envs' / 'x'} is not built" in done.stderr
    assert not (elsewhere / ".envs").exists()


NOBODY = 65534  # another user's uid: the attacker's files


def test_a_parent_another_user_owns_or_can_write_is_never_the_project(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """git's safe.directory rule (CVE-2022-24765) for cudaenv, which often runs as root: the
    search for a pyproject.toml and for the project root stops at a directory another user
    owns or can write (a shared /tmp), so a settings file or an envspecs/ planted there never
    chooses the registry, the envs dir or the interpreter cudaenv runs."""
    import os

    from builder.core import paths

    shared = tmp_path / "shared"
    write(shared / "pyproject.toml", '[tool.cudaenv]\njit-remote = "oci://attacker.example/j"\n')
    (shared / "envspecs").mkdir()
    spec_file = write(shared / "project" / "specs" / "x.yaml", SPEC)
    # Ours, writable by no one else: the parent's files are used (a control).
    assert project.settings_for(spec_file).jit_remote == "oci://attacker.example/j"
    assert paths.project_root(shared / "project") == shared
    # Writable by every user (as /tmp is): nothing at or above it is used.
    shared.chmod(0o777)
    assert project.settings_for(spec_file) == project.Settings()
    assert paths.project_root(shared / "project") is None
    said = capsys.readouterr().err
    assert f"warning: {shared / 'pyproject.toml'} is not read: {shared} can be written" in said
    shared.chmod(0o755)
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    # Another user's directory, or another user's file in ours.
    os.chown(shared, NOBODY, NOBODY)
    assert project.settings_for(spec_file).jit_remote is None
    assert paths.project_root(shared / "project") is None
    os.chown(shared, 0, 0)
    os.chown(shared / "pyproject.toml", NOBODY, NOBODY)
    os.chown(shared / "envspecs", NOBODY, NOBODY)
    assert project.settings_for(spec_file).jit_remote is None
    assert paths.project_root(shared / "project") is None


def test_a_pyproject_that_is_no_file_is_not_read(tmp_path: Path) -> None:
    """A FIFO where pyproject.toml would be hangs no command: it is not a project file."""
    import os

    spec_file = write(tmp_path / "project" / "specs" / "x.yaml", SPEC)
    os.mkfifo(tmp_path / "project" / "pyproject.toml")
    assert project.settings_for(spec_file) == project.Settings()


def test_a_pyproject_nested_too_deep_is_one_located_error(tmp_path: Path) -> None:
    from builder.core import paths

    spec_file = write(tmp_path / "specs" / "x.yaml", SPEC)
    write(tmp_path / "pyproject.toml", "a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(SpecError, match=r"pyproject\.toml: not valid TOML: nested too deep"):
        project.settings_for(spec_file)
    assert paths.project_root(tmp_path) is None  # and finding the root does not fail on it
