"""The README's way to get the `cudaenv` command, on a clean clone of this repository, on a box
whose PATH has neither uv nor pipx (the uv `tools/nox.sh` installs stays in `.tools/venv`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO


@pytest.mark.network
def test_the_readmes_install_puts_cudaenv_on_a_box_without_uv_or_pipx(tmp_path: Path) -> None:
    if shutil.which("git") is None or shutil.which("python3", path="/usr/bin:/bin") is None:
        pytest.skip("needs git and a system python3")
    readme = (REPO / "README.md").read_text()
    assert "sh tools/nox.sh -s install" in readme
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--depth", "1", f"file://{REPO}", str(clone)],
                   check=True, timeout=120)  # fmt: skip
    home = tmp_path / "home"
    home.mkdir()
    path = "/usr/local/sbin:/usr/sbin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert shutil.which("uv", path=path) is None and shutil.which("pipx", path=path) is None
    # The machine's set-up for reaching the package index (certificates, index settings, the
    # pip and uv config under XDG_CONFIG_HOME) stays as it is: the README's install must work
    # through the clients as configured. Only PATH (no uv, no pipx) and HOME (where the tool
    # lands) change, and nothing from this test's own venv leaks in.
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"VIRTUAL_ENV", "UV_TOOL_DIR", "UV_TOOL_BIN_DIR", "XDG_BIN_HOME",
                       "XDG_DATA_HOME", "PYTHONPATH", "NOX_DEFAULT_VENV_BACKEND"}
    }  # fmt: skip
    env.update(
        PATH=path,
        HOME=str(home),
        XDG_CONFIG_HOME=os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config"),
        # The machine's caches: only speed, what is installed is what the clone asks for.
        UV_CACHE_DIR=os.environ.get("UV_CACHE_DIR") or str(Path.home() / ".cache" / "uv"),
        PIP_CACHE_DIR=os.environ.get("PIP_CACHE_DIR") or str(Path.home() / ".cache" / "pip"),
    )
    done = subprocess.run(["sh", "tools/nox.sh", "-s", "install"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    installed = home / ".local" / "bin" / "cudaenv"
    assert f"cudaenv is {installed.parent}/cudaenv" in done.stderr
    assert "is not on PATH" in done.stderr  # ~/.local/bin is not on this PATH: it says so
    ran = subprocess.run([str(installed), "--help"], env=env, capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert ran.returncode == 0 and "usage: cudaenv" in ran.stdout, ran.stderr
