"""What a warm build no longer repeats (the libcuda stub, nvcc --version, the hook templates)
is still right: each memo is keyed by what decides its answer, and a changed input is seen.
Real tiny processes: a compiler and an nvcc that are shell scripts counting their runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from builder.core.errors import BuildError, ToolMissing
from builder.core.paths import cache_dir
from builder.env import hooks, toolchain
from builder.formats import templates
from builder.machine import archs, toolkits
from builder.spec import envspec as spec
from tests.helpers import REPO, write


def counting(path: Path, body: str) -> Path:
    """An executable script that appends a line to ``path.runs`` each time it runs."""
    write(path, f'#!/bin/sh\necho run >> "{path}.runs"\n{body}\n')
    path.chmod(0o755)
    return path


def runs(script: Path) -> int:
    log = Path(f"{script}.runs")
    return len(log.read_text().splitlines()) if log.exists() else 0


def touch_later(path: Path) -> None:
    """A new mtime for ``path``, later than the one it has (coarse clocks included)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))


# --------------------------------------------------------------------------- libcuda stub


@pytest.fixture
def cc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("no C compiler (cc/gcc) on this machine")
    script = counting(tmp_path / "bin" / "mycc", f'exec {real} "$@"')
    monkeypatch.setenv("CC", str(script))
    return script


def test_stub_is_compiled_once_per_compiler(tmp_path: Path, cc: Path) -> None:
    first = toolchain.build_libcuda_stub(tmp_path / "a" / "stubs")
    second = toolchain.build_libcuda_stub(tmp_path / "b" / "stubs")
    assert runs(cc) == 1
    assert second.read_bytes() == first.read_bytes()
    assert second.read_bytes()[:4] == b"\x7fELF"
    done = subprocess.run(["readelf", "-d", str(second)], capture_output=True, text=True)
    if done.returncode == 0:
        assert "Library soname: [libcuda.so.1]" in done.stdout


def test_a_changed_compiler_compiles_again(tmp_path: Path, cc: Path) -> None:
    toolchain.build_libcuda_stub(tmp_path / "a" / "stubs")
    touch_later(cc)
    toolchain.build_libcuda_stub(tmp_path / "b" / "stubs")
    assert runs(cc) == 2


def test_a_damaged_cached_stub_is_rebuilt(tmp_path: Path, cc: Path) -> None:
    toolchain.build_libcuda_stub(tmp_path / "a" / "stubs")
    (cached,) = (cache_dir() / "stubs").glob("*/libcuda.so")
    cached.unlink()  # the env's hard link keeps its own copy
    cached.write_bytes(b"not an ELF file")
    out = toolchain.build_libcuda_stub(tmp_path / "b" / "stubs")
    assert runs(cc) == 2
    assert out.read_bytes()[:4] == b"\x7fELF"
    assert cached.read_bytes()[:4] == b"\x7fELF"


def test_a_missing_compiler_is_still_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(ToolMissing) as info:
        toolchain.build_libcuda_stub(tmp_path / "stubs")
    assert str(info.value) == (
        "C compiler /nonexistent/cc not found: it builds the libcuda.so link stub and is nvcc's "
        "host compiler; install one (`apt-get install gcc`) or point CC at it"
    )


# --------------------------------------------------------------------------- nvcc --version


def fake_nvcc(home: Path, release: str) -> Path:
    banner = f"Cuda compilation tools, release {release}, V{release}.88"
    return counting(
        home / "bin" / "nvcc", f"echo 'nvcc: NVIDIA (R) Cuda compiler driver'\necho '{banner}'"
    )


def test_nvcc_release_runs_nvcc_once_per_file(tmp_path: Path) -> None:
    nvcc = fake_nvcc(tmp_path / "home", "13.0")
    assert toolkits.nvcc_release(tmp_path / "home") == "13.0"
    assert toolkits.nvcc_release(tmp_path / "home") == "13.0"
    assert runs(nvcc) == 1


def test_a_hard_link_of_the_same_nvcc_is_not_run_again(tmp_path: Path) -> None:
    # What a warm build sees: each env's cuda-home/bin/nvcc links to uv's one cached file.
    nvcc = fake_nvcc(tmp_path / "a", "13.0")
    (tmp_path / "b" / "bin").mkdir(parents=True)
    os.link(nvcc, tmp_path / "b" / "bin" / "nvcc")
    assert toolkits.nvcc_release(tmp_path / "a") == "13.0"
    assert toolkits.nvcc_release(tmp_path / "b") == "13.0"
    assert runs(nvcc) == 1


def test_a_replaced_nvcc_is_asked_again(tmp_path: Path) -> None:
    fake_nvcc(tmp_path / "home", "13.0")
    assert toolkits.nvcc_release(tmp_path / "home") == "13.0"
    nvcc = tmp_path / "home" / "bin" / "nvcc"
    nvcc.unlink()  # a new file: a new inode, as a reinstall makes
    fake_nvcc(tmp_path / "home", "12.9")
    assert toolkits.nvcc_release(tmp_path / "home") == "12.9"


def test_a_broken_nvcc_is_an_error_every_time(tmp_path: Path) -> None:
    counting(tmp_path / "home" / "bin" / "nvcc", "echo 'no banner'")
    for _ in range(2):
        with pytest.raises(BuildError, match=r"printed no 'release X\.Y'"):
            toolkits.nvcc_release(tmp_path / "home")
    assert runs(tmp_path / "home" / "bin" / "nvcc") == 2


# --------------------------------------------------------------------------- hook templates


def hook_spec(tmp_path: Path, value: str) -> spec.EnvSpec:
    text = f'name: memo\npython: "3.12"\ncuda: "13.0"\narchs: ["12.0f"]\nenv:\n  X: "{value}"\n'
    return spec.load(write(tmp_path / f"{value}.yaml", text))


def fake_venv(path: Path) -> Path:
    (path / "lib" / "python3.12" / "site-packages").mkdir(parents=True)
    write(path / "bin" / "activate", "# activate\n")
    return path


def test_memoised_hooks_are_what_jinja2_rendered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = hook_spec(tmp_path, "one")
    first = fake_venv(tmp_path / "a")
    hooks.write_hooks(first, s, archs.DEFAULT_ARCHS)

    def no_jinja() -> jinja2.Environment:
        raise AssertionError("rendered again")

    monkeypatch.setattr(templates, "templates", no_jinja)
    second = fake_venv(tmp_path / "b")
    hooks.write_hooks(second, s, archs.DEFAULT_ARCHS)
    monkeypatch.undo()
    site = Path("lib") / "python3.12" / "site-packages" / f"{hooks.HOOK_MODULE}.py"
    assert (second / site).read_text() == (first / site).read_text()
    assert (second / "bin" / "activate").read_text() == (first / "bin" / "activate").read_text()
    assert '"one"' in (second / site).read_text()


def test_other_values_render_anew(tmp_path: Path) -> None:
    hooks.write_hooks(fake_venv(tmp_path / "a"), hook_spec(tmp_path, "one"), archs.DEFAULT_ARCHS)
    other = fake_venv(tmp_path / "b")
    hooks.write_hooks(other, hook_spec(tmp_path, "two"), archs.DEFAULT_ARCHS)
    hook = (other / "lib" / "python3.12" / "site-packages" / "_cudaenv_hook.py").read_text()
    assert '"two"' in hook
    assert '"one"' not in hook


def test_a_template_error_is_raised_every_time() -> None:
    for _ in range(2):
        with pytest.raises(jinja2.UndefinedError):
            templates.render("hook.py.j2", {"name": "x"})


# --------------------------------------------------------------------------- imports


def test_lock_and_plan_do_not_import_jinja2() -> None:
    # `cudaenv lock` loads builder.commands.matrix (FILE:CELL arguments), which imports report and
    # toolchain; jinja2 is only for rendering.
    code = "import sys, builder.cli, builder.commands.matrix; print('jinja2' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.stdout.strip() == "False"


def test_nvcc_memo_keeps_a_bounded_number_of_files(tmp_path: Path) -> None:
    for i in range(toolkits._NVCC_MEMO_ENTRIES + 3):
        fake_nvcc(tmp_path / f"h{i}", "13.0")
        toolkits.nvcc_release(tmp_path / f"h{i}")
    kept = json.loads((cache_dir() / "nvcc-releases.json").read_text())
    assert len(kept) == toolkits._NVCC_MEMO_ENTRIES
