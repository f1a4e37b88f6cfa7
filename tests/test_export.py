"""Locks every PEP 751 reader installs: a lock of URLs as written, an index-neutral lock once
`cudaenv export` has filled its wheelhouse, and `cudaenv export --pylock` for this machine's
index, each installed by real uv and real pip (>= 26) into fresh venvs.

The offline tests serve a PEP 503 index of two tiny wheels (alpha needs beta) on 127.0.0.1;
uv and pip are pointed at it alone, so nothing reaches the internet. The network test does the
same with the toolchain spec on the machine's own index.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.pylock import Pylock

from builder.core import proc
from builder.core.errors import SpecError
from builder.env import export as exporting
from builder.env.export import sha256_of
from builder.machine import interpreters
from builder.spec import envspec as spec
from builder.spec import lock
from tests.helpers import (
    ENVSPECS,
    add_tiny_pair,
    add_to_index,
    cudaenv,
    installed,
    lock_of,
    pip_venv,
    the_only_index,
    uv_venv,
    workspace,
    write,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PY = f"{sys.version_info.major}.{sys.version_info.minor}"
SPEC = f"""\
name: tiny.v1
python: "{PY}"
cuda: "13.0"
toolchain: {{source: system, path: /usr/local/cuda-13.0}}
packages: [cudaenv-tiny-alpha==1.0]
"""
TINY = {("cudaenv-tiny-alpha", "1.0"), ("cudaenv-tiny-beta", "1.0")}


@dataclass(frozen=True)
class Index:
    root: Path
    url: str


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    """The local index, and uv and pip (ours and every child's) configured with it alone."""
    root = tmp_path / "index"
    add_tiny_pair(root)
    with the_only_index(root, tmp_path / "uv-cache") as url:
        yield Index(root=root, url=url)


def files_of(path: Path) -> list[dict[str, object]]:
    doc = tomllib.loads(path.read_text())
    Pylock.from_dict(doc)  # what uv and pip read
    return [
        f
        for p in doc["packages"]
        for f in p.get("wheels", []) + ([p["sdist"]] if "sdist" in p else [])
    ]


def uv_install(venv_python: Path, pylock: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [proc.uv_bin(), "pip", "install", "--python", str(venv_python), "-r", str(pylock)],
        capture_output=True,
        text=True,
        check=False,
    )


def pip_install(venv_python: Path, pylock: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [venv_python, "-m", "pip", "install", "-q", "-r", str(pylock)],
        capture_output=True,
        text=True,
        check=False,
    )


def installs_exactly(pylock: Path, tmp: Path, expected: set[tuple[str, str]]) -> None:
    """Real `uv pip install -r` and `pip install -r` into fresh venvs give ``expected``."""
    py = Path(sys.executable).resolve()
    by_uv = uv_venv(py, tmp / "uv-venv")
    done = uv_install(by_uv, pylock)
    assert done.returncode == 0, done.stderr
    assert installed(by_uv) == expected
    by_pip = pip_venv(py, tmp / "pip-venv")
    done = pip_install(by_pip, pylock)
    assert done.returncode == 0, done.stderr
    assert installed(by_pip) == expected


@pytest.mark.slow
def test_a_users_lock_carries_urls_and_installs_as_written(index: Index, tmp_path: Path) -> None:
    ws = tmp_path / "ws"  # no pyproject.toml: a user's project, default settings
    write(ws / "envspecs" / "tiny.yaml", SPEC)
    cudaenv("lock", "envspecs/tiny.yaml", cwd=ws)
    path = lock_of(ws / "envspecs" / "tiny.yaml")
    assert path.name == "pylock.tiny-v1.toml"
    assert lock.read(path).spec_name == "tiny.v1"
    files = files_of(path)
    assert [f["url"] for f in files] == [
        f"{index.url}/cudaenv-tiny-alpha/cudaenv_tiny_alpha-1.0-py3-none-any.whl",
        f"{index.url}/cudaenv-tiny-beta/cudaenv_tiny_beta-1.0-py3-none-any.whl",
    ]
    assert not any("path" in f for f in files)
    installs_exactly(path, tmp_path, TINY)


@pytest.mark.slow
def test_an_index_neutral_lock_installs_once_export_fills_its_wheelhouse(
    index: Index, tmp_path: Path
) -> None:
    ws = workspace(tmp_path / "ws")  # this repository's settings: index-neutral, wheels/
    write(ws / "envspecs" / "tiny.yaml", SPEC)
    cudaenv("lock", "envspecs/tiny.yaml", cwd=ws)
    path = lock_of(ws / "envspecs" / "tiny.yaml")
    text = path.read_text()
    assert "://" not in text and "127.0.0.1" not in text
    assert [f["path"] for f in files_of(path)] == [
        "wheels/cudaenv_tiny_alpha-1.0-py3-none-any.whl",
        "wheels/cudaenv_tiny_beta-1.0-py3-none-any.whl",
    ]
    # Before the export the files are nowhere: a reader cannot install the lock.
    early = uv_install(uv_venv(Path(sys.executable).resolve(), tmp_path / "early"), path)
    assert early.returncode != 0
    assert f"{path.parent / 'wheels'}/cudaenv_tiny_" in early.stderr  # alpha or beta, uv's pick
    done = cudaenv("export", "envspecs/tiny.yaml", cwd=ws)
    assert f"{path.parent / 'wheels'}" in done.stderr
    assert sorted(p.name for p in (path.parent / "wheels").glob("*.whl")) == [
        "cudaenv_tiny_alpha-1.0-py3-none-any.whl",
        "cudaenv_tiny_beta-1.0-py3-none-any.whl",
    ]
    installs_exactly(path, tmp_path, TINY)


@pytest.mark.slow
def test_export_pylock_writes_this_index_urls_with_the_locked_hashes(
    index: Index, tmp_path: Path
) -> None:
    ws = workspace(tmp_path / "ws")
    write(ws / "envspecs" / "tiny.yaml", SPEC)
    cudaenv("lock", "envspecs/tiny.yaml", cwd=ws)
    locked = lock.read(lock_of(ws / "envspecs" / "tiny.yaml"))
    out = tmp_path / "out" / "pylock.tiny.toml"
    cudaenv("export", "envspecs/tiny.yaml", "--pylock", str(out), cwd=ws)
    assert not (lock_of(ws / "envspecs" / "tiny.yaml").parent / "wheels").exists()
    text = out.read_text()
    assert text.startswith(
        f"# This file was generated by `cudaenv export envspecs/tiny.yaml --pylock {out}`"
    )
    files = files_of(out)
    assert all(str(f["url"]).startswith(f"{index.url}/") and "path" not in f for f in files)
    exported = lock.read(out)
    assert [p.hashes for p in exported.packages] == [p.hashes for p in locked.packages]
    assert exported.content_hash() == locked.content_hash()
    installs_exactly(out, tmp_path, TINY)


@pytest.mark.slow
def test_export_pylock_refuses_a_file_the_index_serves_with_another_hash(
    index: Index, tmp_path: Path
) -> None:
    ws = workspace(tmp_path / "ws")
    write(ws / "envspecs" / "tiny.yaml", SPEC)
    cudaenv("lock", "envspecs/tiny.yaml", cwd=ws)
    locked = {p.name: p for p in lock.read(lock_of(ws / "envspecs" / "tiny.yaml")).packages}
    good = tmp_path / "pylock.good.toml"
    cudaenv("export", "envspecs/tiny.yaml", "--pylock", str(good), cwd=ws)
    # The index swaps beta for another file of the same name.
    swapped = add_to_index(index.root, "cudaenv-tiny-beta", "1.0", "WHO = 'someone else'\n")
    out = tmp_path / "pylock.tiny.toml"
    done = cudaenv(
        "export",
        "envspecs/tiny.yaml",
        "--pylock",
        str(out),
        cwd=ws,
        check=False,
        env={"UV_CACHE_DIR": str(tmp_path / "fresh-uv-cache")},
    )
    assert done.returncode == 4, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [
        "error: cudaenv-tiny-beta==1.0: the index this machine uses serves "
        f"{swapped.name} with sha256 {sha256_of(swapped)}, the lock has "
        f"{locked['cudaenv-tiny-beta'].hashes[0]}; refusing to export another file than the "
        "locked one"
    ]
    assert not out.exists()
    # And the readers check the hashes the exported lock carries: both refuse the swapped file.
    py = Path(sys.executable).resolve()
    by_uv = uv_install(uv_venv(py, tmp_path / "uv-venv"), good)
    assert by_uv.returncode != 0 and "cudaenv-tiny-beta" in by_uv.stderr
    by_pip = pip_install(pip_venv(py, tmp_path / "pip-venv"), good)
    assert by_pip.returncode != 0 and "hash" in by_pip.stderr.lower()


@pytest.mark.parametrize("name", ["pylock.tiny.v1.toml", "tiny.toml", "pylock..toml"])
def test_export_pylock_needs_a_pep751_file_name(name: str, tmp_path: Path) -> None:
    done = cudaenv(
        "export", "envspecs/none.yaml", "--pylock", str(tmp_path / name), cwd=tmp_path, check=False
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: --pylock {tmp_path / name}: not a PEP 751 file name; use pylock.toml or "
        "pylock.NAME.toml (NAME without dots)"
    ]
    assert not (tmp_path / name).exists()


def test_export_of_a_lock_of_urls_needs_a_destination(tmp_path: Path) -> None:
    write(tmp_path / "envspecs" / "tiny.yaml", SPEC)
    committed = lock.read(lock_of(ENVSPECS / "toolchain-cu130.yaml"))
    s = spec.load(tmp_path / "envspecs" / "tiny.yaml")
    urls = dataclasses.replace(
        committed,
        spec_name=s.name,
        fingerprint=s.fingerprint(),
        python=s.python,
        packages=tuple(
            dataclasses.replace(
                p,
                wheels=tuple(
                    dataclasses.replace(w, path=None, url=f"https://files.invalid/{w.name}")
                    for w in p.wheels
                ),
            )
            for p in committed.packages
        ),
    )
    lock.write(urls, lock.lock_path(s.source, s.name))
    done = cudaenv("export", "envspecs/tiny.yaml", cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: export needs --wheelhouse DIR or --pylock FILE: "
        "envspecs/locks/pylock.tiny-v1.toml names its files by URL, so it has no wheelhouse "
        "of its own"
    ]


@pytest.mark.slow
def one_wheel_lock(s: spec.EnvSpec, wheel: str, where: str) -> lock.Lock:
    """A lock of ``s`` with one package whose one wheel has the path ``where``."""
    f = lock.LockedFile(name=wheel, sha256="0" * 64, path=where)
    pkg = lock.LockedPackage(name="cudaenv-tiny-alpha", version="1.0", wheels=(f,))
    return lock.Lock(
        spec_name=s.name, fingerprint=s.fingerprint(), python=s.python,
        platforms=s.platforms, cuda=s.cuda, torch=None, torch_cuda=None, toolkit=None,
        packages=(pkg,),
    )  # fmt: skip


def test_export_writes_only_into_the_wheelhouse_the_project_configures(tmp_path: Path) -> None:
    """An edited lock's paths never choose where `cudaenv export` writes wheels and its
    manifest: each must be the project's wheelhouse (beside the lock) and the file's name."""
    ws = workspace(tmp_path / "ws")  # index-neutral, wheels/
    s = spec.load(write(ws / "envspecs" / "tiny.yaml", SPEC))
    path = lock.lock_path(s.source, s.name)
    wheel = "cudaenv_tiny_alpha-1.0-py3-none-any.whl"

    def locked(where: str) -> lock.Lock:
        return one_wheel_lock(s, wheel, where)

    lock.write(locked(f"wheels/{wheel}"), path)
    assert exporting.lock_wheelhouse(s, lock.read(path, spec=s), path) == path.parent / "wheels"
    for bad in (f"../../../elsewhere/{wheel}", f"../{wheel}"):
        lock.write(locked(bad), path)
        # pip asks no index: were the export to start, it would fail at once, not hang.
        offline = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
        done = cudaenv("export", "envspecs/tiny.yaml", cwd=ws, env=offline, check=False)
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines() == [
            f"error: envspecs/locks/pylock.tiny-v1.toml: cudaenv-tiny-alpha==1.0: path: {bad!r} "
            "is not in the wheelhouse wheels/ the project configures; refusing to write there "
            "(re-lock it with `cudaenv lock`)",
            "error: 1 problem(s) in the lock; nothing was done",
        ]
        assert not (tmp_path / "elsewhere").exists()
        assert not (path.parent.parent / exporting.MANIFEST).exists()
    # A project whose wheelhouse is above the lock's directory is obeyed, not refused.
    write(ws / "pyproject.toml", '[tool.cudaenv]\nlocks = "index-neutral"\nwheelhouse = "../w"\n')
    lock.write(locked(f"../w/{wheel}"), path)
    got = exporting.lock_wheelhouse(s, lock.read(path, spec=s), path)
    assert got == path.parent / "../w"


@pytest.mark.network
def test_the_toolchain_exported_for_this_index_installs_with_uv_and_pip(tmp_path: Path) -> None:
    ws = workspace(tmp_path / "ws", "toolchain-cu130.yaml")
    out = tmp_path / "out" / "pylock.toolchain.toml"
    cudaenv("export", "envspecs/toolchain-cu130.yaml", "--pylock", str(out), cwd=ws)
    committed = lock.read(lock_of(ws / "envspecs" / "toolchain-cu130.yaml"))
    exported = lock.read(out)
    assert {(p.name, p.hashes) for p in exported.packages} == {
        (p.name, p.hashes) for p in committed.packages
    }
    assert all(f.url and not f.path for p in exported.packages for f in p.files)
    Pylock.from_dict(tomllib.loads(out.read_text()))
    expected = {(p.name, p.version) for p in committed.packages}
    assert ("nvidia-cuda-nvcc", "13.0.88") in expected
    py = interpreters.find("3.12").path
    by_uv = uv_venv(py, tmp_path / "uv-venv")
    done = uv_install(by_uv, out)
    assert done.returncode == 0, done.stderr
    assert installed(by_uv) == expected
    by_pip = pip_venv(py, tmp_path / "pip-venv")
    done = pip_install(by_pip, out)
    assert done.returncode == 0, done.stderr
    assert installed(by_pip) == expected


def test_a_wheelhouse_that_leaves_the_project_is_refused(tmp_path: Path) -> None:
    """A cloned project's `wheelhouse = "../../../x"`, or a link inside it to /etc: export
    (often run as root) never writes outside the project, and says where it would have."""
    ws = workspace(tmp_path / "ws")
    s = spec.load(write(ws / "envspecs" / "tiny.yaml", SPEC))
    path = lock.lock_path(s.source, s.name)
    wheel = "cudaenv_tiny_alpha-1.0-py3-none-any.whl"

    def locked(where: str) -> lock.Lock:
        return one_wheel_lock(s, wheel, where)

    outside = tmp_path / "outside"
    outside.mkdir()
    for wheelhouse, made in (("../../../outside", None), ("w", ws / "envspecs" / "locks" / "w")):
        write(
            ws / "pyproject.toml",
            f'[tool.cudaenv]\nlocks = "index-neutral"\nwheelhouse = "{wheelhouse}"\n',
        )
        if made is not None:
            made.symlink_to(outside)  # a link in the project to a directory outside it
        lock.write(locked(f"{wheelhouse}/{wheel}"), path)
        with pytest.raises(SpecError, match=r"tool\.cudaenv\.wheelhouse: .* outside the project"):
            exporting.lock_wheelhouse(s, lock.read(path, spec=s), path)
    assert list(outside.iterdir()) == []
