"""`cudaenv adopt` on real venvs, offline: two runs at once, an env cudaenv built, a failure
midway, an undo killed midway, a read-only env, a second undo.

The venv is a real one (uv) holding a stand-in torch 2.9.1 built for CUDA 12.8, and CUDA_HOME
is a stand-in 12.8 toolkit (an nvcc that prints its release): CUDA 12 has no pip nvcc, so
adopt wires the machine's toolkit and installs nothing, and every run is a real `cudaenv`
process that takes about a second."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from builder.adopt import journal as adopt_journal
from builder.adopt import repair as adopt
from builder.core import proc
from builder.core.errors import EnvBusy
from builder.env import hooks, manifest, toolchain
from builder.machine import archs
from builder.spec import envspec as spec
from tests.helpers import FAULTS_PYTHONPATH, REPO, a_manifest, cudaenv, links_only, write

NVCC_12_8 = "#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n"


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A uv venv whose torch (2.9.1, CUDA 12.8) is its files alone, never imported."""
    v = tmp_path / "v"
    proc.run([proc.uv_bin(), "venv", "--quiet", "--python", sys.executable, str(v)])
    site = toolchain.site_packages(v)
    write(site / "torch" / "__init__.py", "")
    write(site / "torch" / "version.py", "cuda = '12.8'\n")
    info = site / "torch-2.9.1.dist-info"
    write(info / "METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.9.1\n")
    write(info / "RECORD", "torch/__init__.py,,\ntorch/version.py,,\n")
    return v


@pytest.fixture
def cuda_home(tmp_path: Path) -> Path:
    home = tmp_path / "cuda-12.8"
    nvcc = write(home / "bin" / "nvcc", NVCC_12_8)
    nvcc.chmod(0o755)
    return home


def run(
    venv: Path, cuda_home: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return cudaenv(
        "adopt", "--python", str(venv / "bin" / "python"), *args,
        cwd=venv.parent, env={"CUDA_HOME": str(cuda_home), **(env or {})}, check=False,
    )  # fmt: skip


def adopt_argv(venv: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "builder.cli", "adopt", "--python", str(venv / "bin" / "python"),
            *args]  # fmt: skip


def start(venv: Path, cuda_home: Path, args: list[str], pause: str) -> subprocess.Popen[str]:
    """A `cudaenv` process held at the fault point ``pause`` (returned once it is there)."""
    child = subprocess.Popen(
        args, cwd=venv.parent, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": FAULTS_PYTHONPATH, "CUDA_HOME": str(cuda_home),
             "CUDAENV_FAULT_PAUSE": pause, "CUDAENV_FAULT_PAUSE_SECONDS": "3"},
    )  # fmt: skip
    assert child.stderr is not None
    for line in child.stderr:
        if f"fault point {pause}" in line:
            return child
    child.wait()
    raise AssertionError(f"{args} ended (exit {child.returncode}) without reaching {pause}")


def snapshot(venv: Path) -> dict[str, str]:
    """Every file and link of the env (Python's own __pycache__ left out) -> its content."""
    out = {}
    for path in sorted(venv.rglob("*")):
        if "__pycache__" in path.parts:
            continue
        rel = str(path.relative_to(venv))
        if path.is_symlink():
            out[rel] = "-> " + str(path.readlink())
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def errors(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in done.stderr, done.stderr
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------- the env's lock


@pytest.mark.slow
def test_a_second_adopt_waits_for_the_first_then_finds_the_env_adopted(
    venv: Path, cuda_home: Path
) -> None:
    first = start(venv, cuda_home, adopt_argv(venv, "--no-verify", "--no-driver-check"),
                  "adopt-overlay")  # fmt: skip
    second = run(venv, cuda_home, "--no-verify", "--no-driver-check")
    assert first.wait(timeout=60) == 0
    assert second.returncode == 0, second.stderr
    assert f"waiting for cudaenv adopt pid {first.pid} to finish changing {venv}" in second.stderr
    assert f"{venv} is adopted already" in second.stderr
    assert (venv / "cuda-home").readlink() == cuda_home
    assert (venv / "cuda-home" / "bin" / "nvcc").is_file()
    journal = adopt_journal.read_journal(venv)
    assert journal is not None and journal.state == "done"
    assert manifest.read(venv).spec == manifest.ADOPTED_SPEC


@pytest.mark.slow
def test_a_lock_held_past_the_wait_is_refused_naming_its_holder(venv: Path) -> None:
    code = (
        "import sys, time; from pathlib import Path; from builder.adopt import journal as adopt_journal\n"
        "with adopt_journal.locked(Path(sys.argv[1]), print):\n"
        "    print('held', flush=True); time.sleep(30)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(venv)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        said: list[str] = []
        with pytest.raises(EnvBusy) as info, adopt_journal.locked(venv, said.append, wait=0.3):
            pass
        lock = venv / adopt_journal.LOCK_FILE
        assert str(info.value) == (
            f"{venv}: cudaenv adopt pid {holder.pid} holds its lock {lock} after a wait of "
            "0.3 s; nothing was changed: run again when it has finished"
        )
        assert info.value.exit_code == 3
        assert said == [f"waiting for cudaenv adopt pid {holder.pid} to finish changing {venv} "
                        f"(lock {lock})"]  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    # The holder died holding it: the kernel dropped the lock, and the next one takes it.
    with adopt_journal.locked(venv, print, wait=0):
        pass
    assert not (venv / adopt_journal.LOCK_FILE).exists()  # no journal: nothing of cudaenv stays


# --------------------------------------------------------------------------- envs adopt leaves alone


def built_env(venv: Path, cuda_home: Path) -> None:
    """What `cudaenv build` leaves: a manifest naming its spec, cuda-home/, the hook."""
    s = spec.load(write(venv.parent / "x.yaml", 'name: x\npython: "3.12"\ncuda: "12.8"\n'))
    (venv / "cuda-home").symlink_to(cuda_home)
    hooks.write_hooks(venv, s, archs.DEFAULT_ARCHS)
    manifest.write(a_manifest(spec="envspecs/x.yaml", path=str(venv)), venv)


@pytest.mark.slow
def test_adopt_refuses_an_env_cudaenv_built_and_changes_nothing(
    venv: Path, cuda_home: Path
) -> None:
    built_env(venv, cuda_home)
    before = snapshot(venv)
    python = venv / "bin" / "python"
    refusal = (
        f"error: {python}: {venv} was built by cudaenv from envspecs/x.yaml (its cudaenv.json); "
        "`cudaenv build envspecs/x.yaml --force` rebuilds it, adopt would unwire it; "
        "nothing was changed"
    )
    for args in (["--dry-run"], ["--no-verify", "--no-driver-check"]):
        done = run(venv, cuda_home, *args)
        assert (done.returncode, errors(done)) == (3, [refusal])
        assert snapshot(venv) == before
    undone = run(venv, cuda_home, "--undo")
    assert undone.returncode == 0
    assert (
        f"nothing to undo: {venv} was built by cudaenv from envspecs/x.yaml, not adopted "
        "(`cudaenv build envspecs/x.yaml` manages it)" in undone.stderr
    )
    assert snapshot(venv) == before


def test_apply_leaves_an_env_cudaenv_built_as_it_was(venv: Path, cuda_home: Path) -> None:
    """apply itself checks again (what plan saw may have changed before the lock was held): a
    plan made before the build wired the env fails with nothing of the build's undone."""
    found = adopt_journal.inspect(venv / "bin" / "python")
    planned = adopt.plan(dataclasses.replace(found, cuda_home=str(cuda_home)))
    built_env(venv, cuda_home)
    before = snapshot(venv)
    with pytest.raises(adopt_journal.Refused, match=r"was built by cudaenv from envspecs/x\.yaml"):
        adopt.apply(planned, lambda _: None)
    assert snapshot(venv) == before


def test_cudaenv_files_with_no_journal_are_refused_not_removed(venv: Path, cuda_home: Path) -> None:
    """What a failed adopt of an older cudaenv could leave: cuda-home/ and a block in
    bin/activate, no journal. Undoing a failure would remove them without knowing what they
    replaced, so adopt names them instead."""
    (venv / "cuda-home").symlink_to(cuda_home)
    activate = venv / "bin" / "activate"
    activate.write_text(activate.read_text() + f"{hooks.BLOCK_MARK}x >>>\n")
    before = snapshot(venv)
    done = run(venv, cuda_home, "--no-verify", "--no-driver-check")
    assert (done.returncode, errors(done)) == (3, [
        f"error: {venv / 'bin' / 'python'}: {venv} holds cudaenv's cuda-home/, the cudaenv block "
        f"in bin/activate but no adopt journal ({adopt_journal.JOURNAL}) says what they replaced; remove "
        "them, then adopt; nothing was changed"
    ])  # fmt: skip
    assert snapshot(venv) == before


@pytest.mark.slow
def test_a_failure_at_the_overlay_step_leaves_the_env_as_it_was(
    venv: Path, cuda_home: Path
) -> None:
    before = snapshot(venv)
    child = start(venv, cuda_home, adopt_argv(venv, "--no-verify", "--no-driver-check"),
                  "adopt-overlay")  # fmt: skip
    # While it waits there, the toolkit becomes another release: the overlay step fails.
    (cuda_home / "bin" / "nvcc").write_text(NVCC_12_8.replace("12.8", "12.9"))
    assert child.stderr is not None
    rest = child.stderr.read()
    assert child.wait(timeout=60) == 4, rest
    assert "Traceback" not in rest
    assert [line for line in rest.splitlines() if line.startswith("error:")] == [
        f"error: {venv}/cudaenv-adopted: toolchain.path {cuda_home} holds nvcc 12.9 but the "
        "spec asks CUDA 12.8"
    ]
    assert snapshot(venv) == before  # no cuda-home/, hook, manifest, journal or lock file


# --------------------------------------------------------------------------- undo


def nvidia_wheel(directory: Path, name: str, version: str, headers: int) -> Path:
    """A wheel of ``name`` unpacking ``headers`` files into nvidia/cu13/include/ as NVIDIA's
    CUDA 13 wheels do."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {f"nvidia/cu13/include/{name}/h{i}.h": f"// {i}\n" for i in range(headers)}
    files[f"{dist}.dist-info/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    files[f"{dist}.dist-info/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: cudaenv-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
    wheel = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def adopted_with_packages(venv: Path, cuda_home: Path) -> Path:
    """The env adopted, then two toolkit packages installed after the journal was written (as
    adopt's uv install does): undo has them to remove. Returns site-packages."""
    assert run(venv, cuda_home, "--no-verify", "--no-driver-check").returncode == 0
    wheels = [nvidia_wheel(venv.parent, "nvidia-cuda-cccl", "13.0.85", 40),
              nvidia_wheel(venv.parent, "nvidia-cuda-nvcc", "13.0.88", 5)]  # fmt: skip
    proc.run([proc.uv_bin(), "pip", "install", "--quiet", "--offline", "--no-deps", "--python",
              str(venv / "bin" / "python"), *map(str, wheels)], env=proc.uv_env())  # fmt: skip
    site = toolchain.site_packages(venv)
    assert (site / "nvidia" / "cu13" / "include" / "nvidia-cuda-cccl" / "h0.h").is_file()
    return site


def half_uninstall(site: Path, dist: str, keep_record: bool = True) -> None:
    """What an uninstall killed midway leaves: the first files of RECORD gone, METADATA gone,
    the rest and (unless not ``keep_record``) RECORD still there."""
    info = site / f"{dist}.dist-info"
    rows = (info / "RECORD").read_text().splitlines()
    for row in rows[: len(rows) // 2]:
        (site / row.split(",")[0]).unlink()
    (info / "METADATA").unlink()
    if not keep_record:
        (info / "RECORD").unlink()


@pytest.mark.slow
@pytest.mark.parametrize("killed", [True, False])
def test_an_undo_killed_midway_is_finished_by_the_next(
    venv: Path, cuda_home: Path, killed: bool
) -> None:
    """An undo SIGKILLed while uv removed the toolkit: cccl's dist-info has lost METADATA (so
    importlib.metadata no longer lists it) and half its files. The next undo finishes."""
    site = adopted_with_packages(venv, cuda_home)
    if killed:
        child = start(venv, cuda_home, adopt_argv(venv, "--undo"), "undo-packages")
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        journal = adopt_journal.read_journal(venv)
        assert journal is not None and journal.state == "undoing"  # the journal says how far
    # ... the uninstall that undo runs, killed midway through cccl.
    half_uninstall(site, "nvidia_cuda_cccl-13.0.85")
    done = run(venv, cuda_home, "--undo")
    assert done.returncode == 0, done.stderr
    if killed:
        assert f"an undo of {venv} did not finish: finishing it" in done.stderr
    assert "removed the half-removed nvidia_cuda_cccl-13.0.85.dist-info" in done.stderr
    assert sorted(p.name for p in site.glob("*.dist-info") if "nvidia" in p.name) == []
    assert not (site / "nvidia").exists()  # the tree adopt's packages made, gone
    assert not (venv / "var").exists() and not (venv / adopt_journal.LOCK_FILE).exists()
    again = run(venv, cuda_home, "--undo")
    assert again.returncode == 0, again.stderr
    assert f"nothing to undo: {venv} has no adopt journal" in again.stderr


@pytest.mark.slow
def test_files_no_package_names_that_adopt_left_are_removed(venv: Path, cuda_home: Path) -> None:
    """A half-removed distribution whose RECORD is gone too: its remaining files are named by
    nothing, but they were not below nvidia/ before adopt (the journal lists what was): undo
    removes them; a file that was there before adopt, named by nothing, stays."""
    site = toolchain.site_packages(venv)
    write(site / "nvidia" / "mine" / "notes.txt", "the user's own, named by no RECORD\n")
    site = adopted_with_packages(venv, cuda_home)
    half_uninstall(site, "nvidia_cuda_cccl-13.0.85", keep_record=False)
    done = run(venv, cuda_home, "--undo")
    assert done.returncode == 0, done.stderr
    assert "file(s) below nvidia/ no package names" in done.stderr
    assert sorted(p.relative_to(site).as_posix() for p in (site / "nvidia").rglob("*")) == [
        "nvidia/mine", "nvidia/mine/notes.txt"
    ]  # fmt: skip
    assert adopt_journal.read_journal(venv) is None


@pytest.mark.slow
def test_an_undo_says_what_it_could_not_put_back_and_keeps_the_journal(
    venv: Path, cuda_home: Path
) -> None:
    """A journal from before the files below nvidia/ were listed: the files a half-removed
    distribution without RECORD left are named by nothing, so undo cannot tell they are
    adopt's; it names the tree, exits 4, keeps the journal."""
    site = adopted_with_packages(venv, cuda_home)
    journal = venv / adopt_journal.JOURNAL
    doc = json.loads(journal.read_text())
    del doc["nvidia_before"]
    journal.write_text(json.dumps(doc))
    half_uninstall(site, "nvidia_cuda_cccl-13.0.85", keep_record=False)
    done = run(venv, cuda_home, "--undo")
    assert (done.returncode, errors(done)) == (4, [
        f"error: {venv}: undo could not put back files no package names in nvidia/ (the "
        f"journal is kept: `cudaenv adopt --undo --python {venv / 'bin' / 'python'}` tries "
        "again)"
    ])  # fmt: skip
    assert adopt_journal.read_journal(venv) is not None
    shutil.rmtree(site / "nvidia")  # what the user does with that message
    assert run(venv, cuda_home, "--undo").returncode == 0
    assert adopt_journal.read_journal(venv) is None


@pytest.mark.slow
def test_a_second_undo_has_nothing_to_undo_and_exits_0(venv: Path, cuda_home: Path) -> None:
    before = snapshot(venv)
    assert run(venv, cuda_home, "--no-verify", "--no-driver-check").returncode == 0
    assert run(venv, cuda_home, "--undo").returncode == 0
    assert snapshot(venv) == before
    again = run(venv, cuda_home, "--undo")
    assert (again.returncode, errors(again)) == (0, [])
    assert again.stderr.strip().endswith(
        f"nothing to undo: {venv} has no adopt journal ({adopt_journal.JOURNAL}); it is not adopted"
    )


# --------------------------------------------------------------------------- a read-only env


def read_only(venv: Path) -> list[str]:
    """A command prefix under which ``venv`` cannot be written: plain permissions for a user,
    a read-only bind mount in a mount namespace for root (whom permissions do not stop)."""
    if os.geteuid() != 0:
        for path in [venv, *venv.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o555)
        return []
    unshare = shutil.which("unshare")
    probe = [unshare or "unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0"', str(venv)]
    if unshare is None or subprocess.run(probe, capture_output=True, check=False).returncode:
        pytest.skip("running as root without a mount namespace: no way to make a read-only env")
    return ["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && shift && exec "$@"',
            str(venv), "--"]  # fmt: skip


def test_a_read_only_env_is_one_line_naming_the_path(venv: Path, cuda_home: Path) -> None:
    before = snapshot(venv)
    prefix = read_only(venv)
    try:
        done = subprocess.run(
            [*prefix, *adopt_argv(venv, "--no-verify", "--no-driver-check")],
            cwd=venv.parent, capture_output=True, text=True, check=False,
            env={**os.environ, "PYTHONPATH": str(REPO), "CUDA_HOME": str(cuda_home)},
        )  # fmt: skip
    finally:
        for path in [venv, *venv.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
    assert (done.returncode, errors(done)) == (3, [
        f"error: {venv / 'bin' / 'python'}: {venv} is not writable by this user (a read-only "
        "env?); nothing was changed"
    ]), done.stderr  # fmt: skip
    assert snapshot(venv) == before


# --------------------------------------------------------------------------- kill points, CUDA 13
#
# A CUDA 13 env adopt installs packages into: a stand-in torch 2.11.0 pinning
# cuda-toolkit[cudart]==13.0.2 (its runtime installed, as torch's own dependency), and stand-in
# toolkit wheels on a find-links directory (uv asks no index): nvcc prints its release, cccl
# unpacks enough headers that uv takes a moment. Every run is a real `cudaenv` and a real uv.

TOOLKIT = "13.0.2"
NVCC_13 = "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n"
CCCL_HEADERS = 600


def a_wheel(
    directory: Path,
    name: str,
    version: str,
    files: dict[str, str],
    requires: Sequence[str] = (),
    extras: Sequence[str] = (),
) -> Path:
    """A wheel of ``name`` holding ``files`` (those below a ``bin/`` executable)."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}"]
    meta += [f"Provides-Extra: {e}" for e in extras] + [f"Requires-Dist: {r}" for r in requires]
    files = {**files, f"{dist}.dist-info/METADATA": "\n".join(meta) + "\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: cudaenv-tests\n"
                                        "Root-Is-Purelib: true\nTag: py3-none-any\n"}  # fmt: skip
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
    wheel = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            info = zipfile.ZipInfo(path)
            info.external_attr = (0o755 if "/bin/" in path else 0o644) << 16
            zf.writestr(info, text)
    return wheel


def toolkit_wheels(directory: Path) -> Path:
    directory.mkdir()
    parts = {
        "cccl": ("nvidia-cuda-cccl", "13.0.85", {
            f"nvidia/cu13/include/cccl/cuda/std/h{i}.h": f"// {i}\n" for i in range(CCCL_HEADERS)
        }),
        "crt": ("nvidia-cuda-crt", "13.0.88", {"nvidia/cu13/include/crt/host_config.h": "//\n"}),
        "cudart": ("nvidia-cuda-runtime", "13.0.96", {
            "nvidia/cu13/lib/libcudart.so.13": "stand-in\n",
            "nvidia/cu13/include/cuda_runtime.h": "#pragma once\n",
        }),
        "nvcc": ("nvidia-cuda-nvcc", "13.0.88", {
            "nvidia/cu13/bin/nvcc": NVCC_13, "nvidia/cu13/bin/ptxas": NVCC_13,
            "nvidia/cu13/bin/nvcc.profile": "TOP = $(_HERE_)/..\n",
            **{f"nvidia/cu13/.metadata/nvcc-{i}.json": "{}\n" for i in range(20)},
        }),
        "nvvm": ("nvidia-nvvm", "13.0.88", {"nvidia/cu13/nvvm/bin/cicc": NVCC_13}),
    }  # fmt: skip
    for name, version, files in parts.values():
        a_wheel(directory, name, version, files)
    requires = [f'{n}=={v}; extra == "{e}"' for e, (n, v, _) in parts.items()]
    a_wheel(directory, "cuda-toolkit", TOOLKIT, {}, requires, extras=list(parts))
    return directory


@dataclasses.dataclass(frozen=True)
class Cu13:
    venv: Path
    env: dict[str, str]  # what every cudaenv and uv of the test runs with

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "builder.cli", "adopt", "--python", str(self.python), *args]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), cwd=self.venv.parent, capture_output=True,
                              text=True, check=False, env=self.env, timeout=300)  # fmt: skip

    def adopt(self) -> subprocess.CompletedProcess[str]:
        return self.run("--no-verify", "--no-driver-check")


@pytest.fixture
def cu13(tmp_path: Path) -> Cu13:
    wheels = toolkit_wheels(tmp_path / "wheels")
    env = {**os.environ, "PYTHONPATH": FAULTS_PYTHONPATH, **links_only(tmp_path, wheels),
           "UV_OFFLINE": "true", "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
           "UV_PYTHON_DOWNLOADS": "never"}  # fmt: skip
    env.pop("CUDA_HOME", None)
    v = tmp_path / "v"
    proc.run([proc.uv_bin(), "venv", "--quiet", "--python", sys.executable, str(v)], env=env)
    site = toolchain.site_packages(v)
    write(site / "torch" / "__init__.py", "")
    write(site / "torch" / "version.py", "cuda = '13.0'\n")
    info = site / "torch-2.11.0.dist-info"
    write(info / "METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\nRequires-Dist: "
          f'cuda-toolkit[cudart]=={TOOLKIT}; platform_system == "Linux"\n')  # fmt: skip
    write(info / "RECORD", "torch/__init__.py,,\ntorch/version.py,,\n")
    # torch's own CUDA dependency, as a real cu130 torch env has it: nvidia/cu13/ is there first.
    proc.run([proc.uv_bin(), "pip", "install", "--quiet", "--python", str(v / "bin" / "python"),
              f"cuda-toolkit[cudart]=={TOOLKIT}"], env=env)  # fmt: skip
    assert (site / "nvidia" / "cu13" / "lib" / "libcudart.so.13").is_file()
    return Cu13(venv=v, env=env)


def clean(venv: Path) -> dict[str, str]:
    """The env's files as a snapshot compares them, uv's own lock file (``.lock``, made by any
    uv run on the env, adopt's dry run included) left out."""
    return {k: v for k, v in snapshot(venv).items() if k != ".lock"}


def is_adopted(cu13: Cu13) -> None:
    journal = adopt_journal.read_journal(cu13.venv)
    assert journal is not None and journal.state == "done"
    assert (cu13.venv / "cuda-home" / "bin" / "nvcc").is_file()
    site = toolchain.site_packages(cu13.venv)
    assert len(list((site / "nvidia" / "cu13" / "include" / "cccl").rglob("*.h"))) == CCCL_HEADERS


@pytest.mark.slow
def test_the_cu13_stand_in_adopts_and_undoes(cu13: Cu13) -> None:
    before = clean(cu13.venv)
    done = cu13.adopt()
    assert done.returncode == 0, done.stderr
    assert "install nvidia-cuda-nvcc 13.0.88" in done.stdout + done.stderr
    is_adopted(cu13)
    undone = cu13.run("--undo")
    assert undone.returncode == 0, undone.stderr
    assert clean(cu13.venv) == before


# The uv adopt and undo run, with one difference where STAND_IN_UV_KILL says: after the real
# uv has run, the state a uv killed midway leaves is made, and cudaenv (its parent) is
# SIGKILLed, as if the kill had come while uv ran. "install": uv copies a wheel's files
# before its .dist-info, and writes RECORD last: cccl's files are there with no .dist-info,
# nvcc's .dist-info has no RECORD, nvvm's has lost METADATA. "uninstall": the first package
# named is half removed (RECORD's first half, METADATA), the others are gone.
KILLING_UV = """\
import os, pathlib, shutil, signal, subprocess, sys
real, args = {real!r}, sys.argv[1:]
kill = os.environ.get("STAND_IN_UV_KILL")
if kill is None or args[:2] != ["pip", kill] or "--dry-run" in args:
    os.execv(real, [real, *args])
python = pathlib.Path(args[args.index("--python") + 1])
site = next(python.parent.parent.glob("lib/python3.*/site-packages"))
if kill == "uninstall":
    first = args[args.index("--python") + 2]
    subprocess.run([real, *args[:-len(args) + args.index("--python") + 2], *args[args.index("--python") + 3:]], check=True)
    info = next(site.glob(first.replace("-", "_") + "-*.dist-info"))
    rows = (info / "RECORD").read_text().splitlines()
    for row in rows[: len(rows) // 2]:
        (site / row.split(",")[0]).unlink(missing_ok=True)
    (info / "METADATA").unlink()
else:
    subprocess.run([real, *args], check=True)
    shutil.rmtree(next(site.glob("nvidia_cuda_cccl-*.dist-info")))
    (next(site.glob("nvidia_cuda_nvcc-*.dist-info")) / "RECORD").unlink()
    (next(site.glob("nvidia_nvvm-*.dist-info")) / "METADATA").unlink()
os.kill(os.getppid(), signal.SIGKILL)
"""


def killing_uv(cu13: Cu13, when: str) -> Cu13:
    uv = cu13.venv.parent / "killing-uv"
    uv.write_text(f"#!{sys.executable}\n" + KILLING_UV.format(real=proc.uv_bin()))
    uv.chmod(0o755)
    return dataclasses.replace(cu13, env={**cu13.env, "CUDAENV_UV": str(uv),
                                           "STAND_IN_UV_KILL": when})  # fmt: skip


def killed_at(cu13: Cu13, args: Sequence[str], point: str) -> None:
    """Run ``cudaenv adopt ARGS`` and SIGKILL it at ``point``: a fault point, or inside uv's
    ``install`` or ``uninstall`` (:data:`KILLING_UV`)."""
    if point in ("install", "uninstall"):
        done = killing_uv(cu13, point).run(*args)
        assert done.returncode == -signal.SIGKILL, done.stderr
        return
    env = {**cu13.env, "CUDAENV_FAULT_PAUSE": point, "CUDAENV_FAULT_PAUSE_SECONDS": "60"}
    child = subprocess.Popen(cu13.argv(*args), cwd=cu13.venv.parent, env=env,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stderr is not None
    for line in child.stderr:
        if f"fault point {point}" in line:
            break
    else:
        child.wait()
        raise AssertionError(f"adopt {args} ended (exit {child.returncode}) before {point}")
    child.kill()
    child.wait(timeout=30)


ADOPT_POINTS = ["adopt-start", "adopt-journal", "install", "adopt-overlay", "adopt-hooks", "adopt-manifest",
                "adopt-done"]  # fmt: skip
UNDO_POINTS = ["undo-files", "undo-packages", "uninstall", "undo-sweep", "undo-journal",
               "undo-done"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("then", ["undo", "adopt"])
@pytest.mark.parametrize("point", ADOPT_POINTS)
def test_an_adopt_killed_at_any_point_is_set_right_by_one_more_run(
    cu13: Cu13, point: str, then: str
) -> None:
    """SIGKILL at each step of adopt (uv's install included): one `adopt --undo` gives the env
    back as it was, or one `adopt` undoes and adopts, after which `--undo` gives it back."""
    before = clean(cu13.venv)
    killed_at(cu13, ["--no-verify", "--no-driver-check"], point)
    if then == "undo":
        done = cu13.run("--undo")
        assert done.returncode == 0, done.stderr
    else:
        done = cu13.adopt()
        assert done.returncode == 0, done.stderr
        # Killed before its journal was written, adopt had changed nothing to undo.
        undid = "did not finish: undoing it first" in done.stderr
        assert undid is (point != "adopt-start"), done.stderr
        is_adopted(cu13)
        done = cu13.run("--undo")
        assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert clean(cu13.venv) == before


@pytest.mark.slow
@pytest.mark.parametrize("then", ["undo", "adopt"])
@pytest.mark.parametrize("point", UNDO_POINTS)
def test_an_undo_killed_at_any_point_is_finished_by_one_more_run(
    cu13: Cu13, point: str, then: str
) -> None:
    before = clean(cu13.venv)
    assert cu13.adopt().returncode == 0
    killed_at(cu13, ["--undo"], point)
    done = cu13.run("--undo") if then == "undo" else cu13.adopt()
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    if then == "adopt":
        is_adopted(cu13)
        assert cu13.run("--undo").returncode == 0
    assert clean(cu13.venv) == before


@pytest.mark.slow
def test_kills_at_random_points_under_load_are_each_set_right_by_one_more_run(cu13: Cu13) -> None:
    """adopt and undo SIGKILLed at random moments while the CPUs are busy: after each kill, one
    more `adopt --undo` gives the env back as it was, or one more `adopt` leaves it adopted.
    The seed is in every failure's message (ADOPT_KILL_SEED replays it)."""
    seed = int(os.environ.get("ADOPT_KILL_SEED") or random.randrange(2**32))  # noqa: S311 - when to kill, not a secret
    rng = random.Random(seed)  # noqa: S311 - when to kill, not a secret
    before = clean(cu13.venv)
    started = time.monotonic()
    assert cu13.adopt().returncode == 0
    took = {"adopt": time.monotonic() - started}
    started = time.monotonic()
    assert cu13.run("--undo").returncode == 0
    took["undo"] = time.monotonic() - started
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for i in range(6):
            op = "undo" if adopt_journal.read_journal(cu13.venv) is not None else "adopt"
            args = ["--undo"] if op == "undo" else ["--no-verify", "--no-driver-check"]
            delay = rng.uniform(0, took[op])
            child = subprocess.Popen(cu13.argv(*args), cwd=cu13.venv.parent, env=cu13.env,
                                     stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            time.sleep(delay)
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)  # cudaenv alone; uv dies with it
            child.wait(timeout=30)
            gone_within(child.pid, 10)
            then = rng.choice(["undo", "adopt"])
            done = cu13.run("--undo") if then == "undo" else cu13.adopt()
            where = f"seed {seed}, kill {i}: {op} killed after {delay:.2f} s, then {then}"
            assert done.returncode == 0, f"{where}\n{done.stderr}"
            if then == "undo":
                assert clean(cu13.venv) == before, where
            else:
                is_adopted(cu13)
    finally:
        burner.kill()
        burner.wait()
    assert cu13.run("--undo").returncode == 0
    assert clean(cu13.venv) == before


def gone_within(session: int, seconds: float) -> None:
    """Wait until every process of ``session`` (a killed cudaenv's uv, say) has exited."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(session, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    raise AssertionError(f"processes of session {session} still running after {seconds} s")
