"""What a source build changed in its env (builder/env/treeguard.py): every kind of write a
build could make outside its own tree is found and named; its own tree and the bookkeeping of
directories are not."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from builder.core.errors import BuildError
from builder.env import sdistbuild, treeguard
from tests.helpers import write


def an_env(root: Path) -> tuple[Path, Path]:
    env = root / "env"
    write(env / "lib" / "site-packages" / "torch" / "__init__.py", "")
    write(env / "lib" / "site-packages" / "torch" / "include" / "ATen.h", "#pragma once\n")
    write(env / "bin" / "python", "#!/bin/sh\n").chmod(0o755)
    work = env / "var" / "source-builds" / "pkg-1.0"
    write(work / "build.log", "")
    return env, work


def found(env: Path, work: Path, before: dict[str, treeguard.Entry]) -> list[str]:
    return treeguard.changes(before, treeguard.record(env, skip=work))


def test_nothing_changed_and_the_builds_own_tree_are_no_finding(tmp_path: Path) -> None:
    env, work = an_env(tmp_path)
    before = treeguard.record(env, skip=work)
    assert "lib/site-packages/torch/include/ATen.h" in before
    assert not any(p.startswith("var/source-builds/pkg-1.0") for p in before)
    write(work / "home" / ".cache" / "x", "cache")
    write(work / "tmp" / "obj.o", "obj")
    (work / "build.log").write_text("more")
    assert found(env, work, before) == []


def test_each_kind_of_write_into_the_env_is_named(tmp_path: Path) -> None:
    env, work = an_env(tmp_path)
    site = env / "lib" / "site-packages"
    before = treeguard.record(env, skip=work)
    write(site / "planted.pth", "import os\n")  # added (its directory's mtime is not news)
    (site / "torch" / "__init__.py").unlink()  # removed
    header = site / "torch" / "include" / "ATen.h"
    (env / "bin" / "python").chmod(0o777)  # a chmod
    assert found(env, work, before) == [
        "bin/python (changed)",
        "lib/site-packages/planted.pth (added)",
        "lib/site-packages/torch/__init__.py (removed)",
    ]
    # Rewritten in place with the same size: its mtime moves.
    before = treeguard.record(env, skip=work)
    stat = header.stat()
    header.write_text("#pragma onc3\n")
    os.utime(header, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert header.stat().st_size == stat.st_size
    assert found(env, work, before) == ["lib/site-packages/torch/include/ATen.h (changed)"]
    # Replaced by another file (a new inode).
    before = treeguard.record(env, skip=work)
    tmp = site / "torch" / "include" / ".ATen.h.new"
    tmp.write_text("#pragma once\n")
    os.replace(tmp, header)
    assert found(env, work, before) == ["lib/site-packages/torch/include/ATen.h (changed)"]


def test_another_env_linking_the_same_cached_files_is_no_finding(tmp_path: Path) -> None:
    """The env's files are hard links into uv's cache: another env built or removed beside
    this build links and unlinks the same inodes, which moves their ctime and link count."""
    env, work = an_env(tmp_path)
    header = env / "lib" / "site-packages" / "torch" / "include" / "ATen.h"
    before = treeguard.record(env, skip=work)
    other = tmp_path / "other-env-ATen.h"
    os.link(header, other)
    assert found(env, work, before) == []
    other.unlink()
    assert found(env, work, before) == []


def test_a_link_is_recorded_as_a_link_and_never_followed(tmp_path: Path) -> None:
    env, work = an_env(tmp_path)
    outside = tmp_path / "outside"
    write(outside / "big" / "file", "x")
    (env / "lib" / "linked").symlink_to(outside, target_is_directory=True)
    before = treeguard.record(env, skip=work)
    assert "lib/linked" in before and not any(p.startswith("lib/linked/") for p in before)
    write(outside / "big" / "other", "y")  # outside the env: not its business
    assert found(env, work, before) == []
    (env / "lib" / "linked").unlink()
    (env / "lib" / "linked").symlink_to(tmp_path, target_is_directory=True)
    assert found(env, work, before) == ["lib/linked (changed)"]


def test_a_directory_replaced_or_chmodded_is_named(tmp_path: Path) -> None:
    env, work = an_env(tmp_path)
    before = treeguard.record(env, skip=work)
    (env / "bin").chmod(0o777)
    assert found(env, work, before) == ["bin (changed)"]


def test_the_phrase_names_a_few_and_counts_the_rest() -> None:
    paths = [f"f{i} (added)" for i in range(5)]
    assert treeguard.said(paths, most=2) == "f0 (added), f1 (added) and 3 more"
    assert treeguard.said(paths[:1]) == "f0 (added)"


def test_an_env_in_use_leaves_out_what_its_processes_write_and_a_new_one_does_not(
    tmp_path: Path,
) -> None:
    """Building ahead in an env a server runs from: its JIT caches (var/) and bytecode move
    meanwhile, which is no finding there; in an env cudaenv is building, nothing runs, so
    the same writes are named."""
    env, work = an_env(tmp_path)
    site = env / "lib" / "site-packages"
    live = treeguard.record(env, skip=work, live=True)
    new = treeguard.record(env, skip=work)
    write(env / "var" / "flashinfer" / "cached_ops" / "norm" / "norm.so", "jit")
    write(site / "torch" / "__pycache__" / "__init__.cpython-312.pyc", "bytecode")
    write(site / "torch" / "planted.py", "x = 1\n")
    assert treeguard.changes(live, treeguard.record(env, skip=work, live=True)) == [
        "lib/site-packages/torch/planted.py (added)"
    ]
    assert found(env, work, new) == [
        "lib/site-packages/torch/__pycache__ (added)",
        "lib/site-packages/torch/__pycache__/__init__.cpython-312.pyc (added)",
        "lib/site-packages/torch/planted.py (added)",
        "var/flashinfer (added)",
        "var/flashinfer/cached_ops (added)",
        "var/flashinfer/cached_ops/norm (added)",
        "var/flashinfer/cached_ops/norm/norm.so (added)",
    ]


def test_a_builds_steps_share_one_record_and_a_write_in_either_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fetch's closing record of the env is the compile's opening one (three walks for
    two steps), and a write in the second step is still found."""
    env, work = an_env(tmp_path)
    walks: list[Path] = []
    real = treeguard.record

    def counted(root: Path, **kw: Any) -> dict[str, treeguard.Entry]:
        walks.append(root)
        return real(root, **kw)

    monkeypatch.setattr(treeguard, "record", counted)
    guard = sdistbuild.Guard(env, work, live=False)
    with sdistbuild.guarded(guard, "pkg 1.0"):
        write(work / "sdist" / "pkg-1.0.tar.gz", "sdist")  # its own tree
    assert len(walks) == 2 and guard.seen is not None
    said = r"pkg 1\.0: its build wrote .*torch/planted\.py"
    with pytest.raises(BuildError, match=said), sdistbuild.guarded(guard, "pkg 1.0"):
        write(env / "lib" / "site-packages" / "torch" / "planted.py", "")
    assert len(walks) == 3 and guard.seen is None  # nothing is handed on from a failed step
