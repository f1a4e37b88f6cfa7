"""The one launcher's owner rule (core/owners.py, asked where every child starts): cudaenv
often runs as root, and an interpreter of an env another user owns or can write runs her
code at its start (a `.pth` in its site-packages), so no such program is started, whichever
command names it; the current directory is no exception when it would hold the envs. Every
command that takes `--python` is found in the command table, so a new one is tested too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.core import proc
from builder.env import manifest
from tests.helpers import a_manifest, command_arguments, cudaenv, write

NOBODY = 65534  # another user's uid: the attacker's files


def commands_taking(flag: str) -> list[tuple[str, ...]]:
    """The words of every (sub)command of the command table with an argument ``flag``."""
    return [words for words, _, option, _ in command_arguments() if flag in option.flags]


PYTHON_COMMANDS = commands_taking("--python")


def test_the_commands_that_take_an_interpreter_are_found() -> None:
    assert {"verify", "doctor", "adopt", "fingerprint", "audit"} <= {w[0] for w in PYTHON_COMMANDS}


def an_env_with_a_pth(env: Path, marker: Path) -> Path:
    """A real venv whose site-packages holds a `.pth` that writes its uid into ``marker``."""
    proc.run([proc.uv_bin(), "venv", "--quiet", "--python", sys.executable, str(env)])
    [site] = env.glob("lib/python*/site-packages")
    write(site / "planted.pth", f"import os; open({str(marker)!r}, 'w').write(str(os.getuid()))\n")
    return env


def chown_tree(root: Path, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            os.lchown(Path(dirpath) / name, uid, uid)
    os.lchown(root, uid, uid)


@pytest.fixture
def her_env(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    marker = tmp_path / "ran-as"
    env = an_env_with_a_pth(tmp_path / "her-env", marker)
    chown_tree(env, NOBODY)
    yield env, marker
    chown_tree(env, 0)


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.parametrize("words", PYTHON_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("given", ["interpreter", "env"])
def test_no_command_starts_an_interpreter_of_another_users_env(
    words: tuple[str, ...], given: str, her_env: tuple[Path, Path], tmp_path: Path
) -> None:
    env, marker = her_env
    python = env / "bin" / "python" if given == "interpreter" else env
    done = cudaenv(*words, "--python", str(python), cwd=tmp_path, check=False)
    assert not marker.exists(), f"her .pth ran as uid {marker.read_text()}"
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_error_line(done)
    assert "belongs to uid 65534" in line, line
    assert f"CUDAENV_SAFE_DIRECTORIES={env}" in line, line


def test_a_site_packages_other_users_can_write_is_refused_too(tmp_path: Path) -> None:
    """Root's own env, but its site-packages is world-writable: anyone's `.pth` would run."""
    marker = tmp_path / "ran-as"
    env = an_env_with_a_pth(tmp_path / "env", marker)
    [site] = env.glob("lib/python*/site-packages")
    site.chmod(0o777)
    done = cudaenv("doctor", "--python", str(env / "bin" / "python"), cwd=tmp_path, check=False)
    assert not marker.exists()
    assert done.returncode == 2
    assert f"{site} can be written by other users" in one_error_line(done)


def test_the_override_trusts_what_it_names(her_env: tuple[Path, Path], tmp_path: Path) -> None:
    """CUDAENV_SAFE_DIRECTORIES, as git's safe.directory: the user vouches for that tree."""
    env, marker = her_env
    done = cudaenv(
        "doctor", "--python", str(env / "bin" / "python"), cwd=tmp_path, check=False,
        env={"CUDAENV_SAFE_DIRECTORIES": f"/nonexistent{os.pathsep}{env}"},
    )  # fmt: skip
    assert "not run" not in done.stderr, done.stderr
    assert marker.read_text() == "0"  # it ran, as root, because root said so


def planted_envs_dir(directory: Path, marker: Path) -> None:
    """What she leaves in a directory root may run cudaenv from: `.envs/default/` with a
    manifest, a bin/python and her own bin/nvidia-smi."""
    env = directory / ".envs" / "default"
    env.mkdir(parents=True)
    manifest.write(a_manifest(name="default", spec="gone.yaml", path=str(env)), env)
    (env / "bin").mkdir()
    (env / "bin" / "python").symlink_to(shutil.which("python3") or sys.executable)
    tool = write(env / "bin" / "nvidia-smi", f"#!/bin/sh\nid -u > {marker}\n")
    tool.chmod(0o755)


@pytest.mark.parametrize("how", ["sticky-1777", "hers"])
@pytest.mark.parametrize(
    "argv", [("run", "default", "--", "nvidia-smi"), ("list",), ("remove", "default")]
)
def test_the_current_directory_another_user_can_write_holds_no_envs(
    tmp_path: Path, how: str, argv: tuple[str, ...]
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    marker = tmp_path / "ran-as"
    planted_envs_dir(shared, marker)
    if how == "sticky-1777":
        shared.chmod(0o1777)
        said = "can be written by other users (mode 1777)"
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        chown_tree(shared, NOBODY)
        said = "belongs to uid 65534"
    done = cudaenv(*argv, cwd=shared, check=False)
    assert not marker.exists()
    assert (shared / ".envs" / "default" / "cudaenv.json").exists()
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_error_line(done)
    assert f"{shared} {said}" in line and "--env-dir" in line, line
    assert "default" not in done.stdout
