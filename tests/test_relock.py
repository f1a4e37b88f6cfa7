"""A re-lock keeps what the lock holds: every locked version, transitive ones too, is uv's
preference, whatever cudaenv's cache holds (a fresh clone has none), until `--upgrade` or
`--upgrade-package NAME` says otherwise.

The index is frozen for each test: a PEP 503 index of tiny wheels served on 127.0.0.1, uv and
pip pointed at it alone; a "newer release" is a wheel the test adds to it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.pylock import Pylock

from builder import lock, tomlwriter
from tests.helpers import (
    ENVSPECS,
    add_tiny_pair,
    add_to_index,
    cudaenv,
    lock_of,
    the_only_index,
    workspace,
    write,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PY = f"{sys.version_info.major}.{sys.version_info.minor}"
SPEC = f"""\
name: tiny
python: "{PY}"
cuda: "13.0"
toolchain: {{source: system, path: /usr/local/cuda-13.0}}
packages: [cudaenv-tiny-alpha]
"""


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "index"
    add_tiny_pair(root)
    with the_only_index(root, tmp_path / "uv-cache"):
        yield root


def versions(path: Path) -> dict[str, str]:
    return {p.name: p.version for p in lock.read(path).packages}


def relock(ws: Path, tmp_path: Path, *flags: str) -> dict[str, str]:
    """`cudaenv lock` as on a fresh clone: cudaenv's and uv's caches empty (uv would otherwise
    answer from index pages it cached before the test added a release)."""
    fresh = tmp_path / f"fresh-{len(list(tmp_path.glob('fresh-*')))}"
    env = {"CUDAENV_CACHE_DIR": str(fresh / "cudaenv"), "UV_CACHE_DIR": str(fresh / "uv")}
    cudaenv("lock", *flags, "envspecs/tiny.yaml", cwd=ws, env=env)
    return versions(lock_of(ws / "envspecs" / "tiny.yaml"))


@pytest.mark.slow
def test_a_relock_keeps_every_locked_version_when_the_index_has_newer(
    index: Path, tmp_path: Path
) -> None:
    ws = workspace(tmp_path / "ws")
    write(ws / "envspecs" / "tiny.yaml", SPEC)
    first = relock(ws, tmp_path)
    assert first == {"cudaenv-tiny-alpha": "1.0", "cudaenv-tiny-beta": "1.0"}
    path = lock_of(ws / "envspecs" / "tiny.yaml")
    text = path.read_text()
    # Newer releases of the asked package and of its dependency appear on the index.
    add_tiny_pair(index, "1.1")  # newer releases of the asked package and its dependency
    assert relock(ws, tmp_path) == first
    assert path.read_text() == text  # not one byte moved


@pytest.mark.slow
def test_upgrade_package_moves_that_package_alone(index: Path, tmp_path: Path) -> None:
    ws = workspace(tmp_path / "ws")
    write(ws / "envspecs" / "tiny.yaml", SPEC)
    relock(ws, tmp_path)
    add_tiny_pair(index, "1.1")  # newer releases of the asked package and its dependency
    moved = relock(ws, tmp_path, "--upgrade-package", "cudaenv-tiny-beta")
    assert moved == {"cudaenv-tiny-alpha": "1.0", "cudaenv-tiny-beta": "1.1"}
    assert relock(ws, tmp_path, "--upgrade") == {
        "cudaenv-tiny-alpha": "1.1",
        "cudaenv-tiny-beta": "1.1",
    }


@pytest.mark.slow
def test_a_relock_after_a_spec_change_keeps_the_versions_it_can(
    index: Path, tmp_path: Path
) -> None:
    """A new package in the spec (what `cudaenv add` writes) moves nothing already locked."""
    ws = workspace(tmp_path / "ws")
    write(ws / "envspecs" / "tiny.yaml", SPEC)
    relock(ws, tmp_path)
    add_to_index(index, "cudaenv-tiny-beta", "1.1", "WHO = 'beta'\n")
    add_to_index(index, "cudaenv-tiny-gamma", "1.0", "WHO = 'gamma'\n")
    write(
        ws / "envspecs" / "tiny.yaml",
        SPEC.replace("[cudaenv-tiny-alpha]", "[cudaenv-tiny-alpha, cudaenv-tiny-gamma]"),
    )
    assert relock(ws, tmp_path) == {
        "cudaenv-tiny-alpha": "1.0",
        "cudaenv-tiny-beta": "1.0",
        "cudaenv-tiny-gamma": "1.0",
    }


def test_toml_strings_round_trip_through_tomllib() -> None:
    """Strings are escaped for TOML, not JSON: DEL (U+007F) and every other control character
    come back equal from tomllib."""

    @settings(max_examples=300, deadline=None)
    @given(st.text(alphabet=st.characters(codec="utf-8")))
    def round_trips(value: str) -> None:
        assert tomllib.loads(f"k = {tomlwriter.string(value)}")["k"] == value

    round_trips()
    assert tomlwriter.string("a\x7fb") == '"a\\u007Fb"'
    with pytest.raises(ValueError, match="cannot be written to TOML"):
        tomlwriter.string("\ud800")


def test_a_lock_with_del_in_a_url_and_a_marker_is_read_by_every_reader(tmp_path: Path) -> None:
    committed = lock.read(lock_of(ENVSPECS / "toolchain-cu130.yaml"))
    first = committed.packages[0]
    odd = dataclasses.replace(
        first,
        marker="platform_machine == 'x86_64' and extra != 'a\x7fb'",
        wheels=tuple(
            dataclasses.replace(w, url="https://files.example/a\x7fb/" + w.name, path=None)
            for w in first.wheels
        ),
    )
    lk = dataclasses.replace(committed, packages=(odd, *committed.packages[1:]))
    path = tmp_path / "pylock.odd.toml"
    lock.write(lk, path)
    doc = tomllib.loads(path.read_text())
    Pylock.from_dict(doc)
    assert doc["packages"][0]["wheels"][0]["url"].startswith("https://files.example/a\x7fb/")
    assert lock.read(path).packages[0].wheels[0].url == odd.wheels[0].url


@pytest.mark.slow
def test_a_relock_writes_nothing_through_a_link_in_the_cache(index: Path, tmp_path: Path) -> None:
    """A red team's attack: `resolutions/last-NAME-PLATFORM.pylock.toml` linked to a root-only
    file made `lock --upgrade` overwrite it. A re-lock's preferences are the lock's own now, and
    nothing is written at that name, link or not."""
    ws = workspace(tmp_path / "ws")
    write(ws / "envspecs" / "tiny.yaml", SPEC)
    cache = tmp_path / "cache"
    victim = tmp_path / "root-only"
    victim.write_text("root's own\n")
    victim.chmod(0o600)
    (cache / "resolutions").mkdir(parents=True, mode=0o700)
    cache.chmod(0o700)
    for tag in ("x86_64-manylinux_2_34", "aarch64-manylinux_2_34"):
        (cache / "resolutions" / f"last-tiny-{tag}.pylock.toml").symlink_to(victim)
    env = {"CUDAENV_CACHE_DIR": str(cache), "UV_CACHE_DIR": str(tmp_path / "uv")}
    for flags in ((), ("--upgrade",)):
        cudaenv("lock", *flags, "envspecs/tiny.yaml", cwd=ws, env=env)
    assert victim.read_text() == "root's own\n"
    assert all(p.is_symlink() for p in (cache / "resolutions").glob("last-*"))
