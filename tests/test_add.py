"""`cudaenv add`: the spec edited in place (comments and layout kept), then locked, rebuilt and
verified; a failed resolve leaves the spec and its lock as they were."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from builder.commands import add
from builder.core.errors import UsageError
from builder.formats.yamldoc import Problems, compose
from builder.spec import envspec as spec
from tests.helpers import FAULTS_PYTHONPATH, cudaenv, lock_of, workspace, write

BLOCK = """\
# The stack we serve with.
name: demo
python: "3.12"
cuda: "13.0"
packages:
  # the server
  - sglang==0.5.23   # pinned: see the release notes
  - "flashinfer-python==0.7.2"
archs: ["12.0f"]   # Blackwell
"""


def edited(tmp_path: Path, text: str, *reqs: str, name: str = "s.yaml") -> str:
    path = write(tmp_path / name, text)
    root = compose(path, Problems())
    assert root is not None and isinstance(root.value, dict)
    inherited = list(spec.load(path).packages) if "packages" not in root.value else []
    out = add.edit(text, root, add.requirements(reqs), inherited)
    spec.load(path, text=out)  # still a valid spec
    return out


def test_a_block_list_gains_lines_in_its_own_style(tmp_path: Path) -> None:
    out = edited(tmp_path, BLOCK, "transformers>=4.57", "datasets[audio]")
    assert out == BLOCK.replace(
        '  - "flashinfer-python==0.7.2"\n',
        '  - "flashinfer-python==0.7.2"\n  - transformers>=4.57\n  - "datasets[audio]"\n',
    )


def test_a_listed_package_gets_the_new_requirement_in_place(tmp_path: Path) -> None:
    out = edited(tmp_path, BLOCK, "SGLang==0.5.24", "flashinfer_python>=0.7.3,<0.8")
    assert "  - SGLang==0.5.24   # pinned: see the release notes\n" in out
    assert '  - "flashinfer_python>=0.7.3,<0.8"\n' in out
    assert out.count("\n") == BLOCK.count("\n")  # no line added or lost


def test_a_flow_list_and_a_missing_key(tmp_path: Path) -> None:
    flow = 'name: demo\npython: "3.12"\ncuda: "13.0"\npackages: [sglang==0.5.23]  # one\n'
    out = edited(tmp_path, flow, "vllm>=0.33,<0.34")
    assert out.splitlines()[3] == 'packages: [sglang==0.5.23, "vllm>=0.33,<0.34"]  # one'
    empty = 'name: demo\npython: "3.12"\ncuda: "13.0"\npackages: []\n'
    assert edited(tmp_path, empty, "six").splitlines()[3] == "packages: [six]"
    none = 'name: demo\npython: "3.12"\ncuda: "13.0"  # no newline at the end'
    assert edited(tmp_path, none, "six").endswith("end\npackages:\n  - six\n")
    null = 'name: demo\npackages:\npython: "3.12"\ncuda: "13.0"\n'
    assert (
        edited(tmp_path, null, "six")
        == 'name: demo\npackages:\n  - six\npython: "3.12"\ncuda: "13.0"\n'
    )


def test_a_spec_that_extends_another_keeps_the_bases_packages(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", BLOCK)
    child = "extends: base.yaml\nname: child\n"
    out = edited(tmp_path, child, "six", name="child.yaml")
    got = spec.load(write(tmp_path / "child.yaml", out))
    assert got.packages == ("sglang==0.5.23", "flashinfer-python==0.7.2", "six")


@pytest.mark.parametrize("bad", ["not a requirement!", "torch==2.14.1", ""])
def test_a_bad_requirement_is_refused_in_one_line(bad: str) -> None:
    with pytest.raises(UsageError, match="add "):
        add.requirements([bad])


@pytest.mark.network
def test_a_package_the_index_lacks_leaves_spec_and_lock_as_they_were(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    spec_file = ws / "envspecs" / "toolchain-cu130.yaml"
    before = spec_file.read_text()
    lock = lock_of(spec_file)
    lock_before = lock.read_bytes()
    done = cudaenv("add", "no-such-package-cudaenv-test==1.0", "--spec", str(spec_file),
                   cwd=ws, check=False)  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    assert spec_file.read_text() == before and lock.read_bytes() == lock_before
    assert "are as they were" in done.stderr


@pytest.mark.network
@pytest.mark.e2e
def test_add_locks_rebuilds_and_verifies_in_one_command(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    spec_file = ws / "envspecs" / "toolchain-cu130.yaml"
    cudaenv("add", "six", "--spec", str(spec_file), "--no-verify", cwd=ws)
    assert "  - six\n" in spec_file.read_text() or "six" in spec_file.read_text()
    env = ws / ".envs" / spec.load(spec_file).name
    done = cudaenv("run", spec.load(spec_file).name, "--", "python", "-c", "import six",
                   cwd=ws, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    listed = (env / "bin" / "pip").exists()
    assert listed


@pytest.mark.parametrize("name", ["yes", "null", "on", "No", "true", "1_000", "0x10", "12"])
def test_a_package_whose_name_yaml_would_read_as_no_string_is_quoted(
    tmp_path: Path, name: str
) -> None:
    """Valid package names that YAML 1.1 reads, unquoted, as a boolean, null or a number."""
    out = edited(tmp_path, BLOCK, name)
    assert f'  - "{name}"\n' in out
    assert spec.load(write(tmp_path / "s.yaml", out)).packages[-1] == name
    flow = 'name: demo\npython: "3.12"\ncuda: "13.0"\npackages: [six]\n'
    assert edited(tmp_path, flow, name).splitlines()[3] == f'packages: [six, "{name}"]'


@pytest.mark.network
@pytest.mark.e2e
@pytest.mark.parametrize("point", ["add-edited", "add-locked", "swap", "swapped"])
def test_a_killed_add_leaves_spec_lock_and_env_together(tmp_path: Path, point: str) -> None:
    """SIGKILL at each step of `cudaenv add six` (no handler runs): the next command that
    reads the spec finds the spec, the lock and the env of one piece: all as before the add
    where the env was not swapped yet, the add whole where it was."""
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    spec_file = ws / "envspecs" / "toolchain-cu130.yaml"
    cudaenv("build", str(spec_file), cwd=ws)
    before, lock = spec_file.read_bytes(), lock_of(spec_file)
    lock_before = lock.read_bytes()
    child = subprocess.Popen(
        [sys.executable, "-m", "builder.cli", "add", "six", "--spec", str(spec_file),
         "--no-verify"],
        cwd=ws, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": FAULTS_PYTHONPATH, "CUDAENV_FAULT_PAUSE": point,
             "CUDAENV_FAULT_PAUSE_SECONDS": "600"},
    )  # fmt: skip
    assert child.stderr is not None
    seen = []
    for line in child.stderr:
        seen.append(line)
        if f"fault point {point}" in line:
            break
    child.kill()
    child.wait(timeout=30)
    assert any(f"fault point {point}" in line for line in seen), "".join(seen)
    name = spec.load(spec_file).name
    done = cudaenv("plan", str(spec_file), cwd=ws, timeout=120)
    has_six = cudaenv("run", name, "--", "python", "-c", "import six", cwd=ws, check=False)
    if point == "swapped":
        assert b"six" in spec_file.read_bytes() and lock.read_bytes() != lock_before
        assert has_six.returncode == 0, has_six.stderr
        assert "as they were" not in done.stderr
    else:
        assert spec_file.read_bytes() == before and lock.read_bytes() == lock_before
        assert has_six.returncode != 0
        assert "both are as they were before it" in done.stderr, done.stderr
    assert not list(spec_file.parent.glob(".*.edit.json"))
    listed = cudaenv("list", "--json", cwd=ws)
    assert '"up to date"' in listed.stdout, listed.stdout
