"""A re-lock keeps what the lock holds: every locked version, transitive ones too, is uv's
preference, whatever cudaenv's cache holds (a fresh clone has none), until `--upgrade` or
`--upgrade-package NAME` says otherwise.

The index is frozen for each test: a PEP 503 index of tiny wheels served on 127.0.0.1, uv and
pip pointed at it alone; a "newer release" is a wheel the test adds to it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.pylock import Pylock

from builder.formats import tomlwriter
from builder.spec import lock
from tests.helpers import (
    ENVSPECS,
    add_tiny_pair,
    add_to_index,
    cudaenv,
    lock_of,
    simple_index,
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


# --------------------------------------------------------------------------- the index view

VIEW = "2026-11-15T00:00:00Z"
BEFORE = dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc).timestamp()
AFTER = dt.datetime(2026, 11, 20, tzinfo=dt.timezone.utc).timestamp()


def published(
    root: Path, when: float, name: str, version: str, requires: Sequence[str] = ()
) -> None:
    """A release of ``name`` on the test index, uploaded at ``when`` (its upload time)."""
    wheel = add_to_index(root, name, version, f"WHO = {name!r}\n", requires=requires)
    os.utime(wheel, (when, when))
    simple_index(root)


def lock_said(ws: Path, tmp_path: Path, *flags: str) -> str:
    """`cudaenv lock` as on a fresh clone (see :func:`relock`); what it said."""
    fresh = tmp_path / f"fresh-{len(list(tmp_path.glob('fresh-*')))}"
    env = {"CUDAENV_CACHE_DIR": str(fresh / "cudaenv"), "UV_CACHE_DIR": str(fresh / "uv")}
    return cudaenv("lock", *flags, "envspecs/tiny.yaml", cwd=ws, env=env).stderr


@pytest.fixture
def dated_index(tmp_path: Path) -> Iterator[Path]:
    """The tiny pair at 1.0, uploaded (PEP 700 upload times) before :data:`VIEW`."""
    root = tmp_path / "index"
    published(root, BEFORE, "cudaenv-tiny-beta", "1.0")
    published(root, BEFORE, "cudaenv-tiny-alpha", "1.0", ["cudaenv-tiny-beta"])
    with the_only_index(root, tmp_path / "uv-cache"):
        yield root


@pytest.mark.slow
def test_a_newer_release_changes_nothing_until_the_view_moves(
    dated_index: Path, tmp_path: Path
) -> None:
    """The proof: a lock made against the index as it stood at VIEW is written again byte for
    byte after newer releases of both locked packages appear; --upgrade takes them and names
    them; the lock records each view it saw."""
    ws = workspace(tmp_path / "ws")
    write(ws / "envspecs" / "tiny.yaml", SPEC)
    path = lock_of(ws / "envspecs" / "tiny.yaml")
    said = lock_said(ws, tmp_path, "--exclude-newer", VIEW)
    assert f"index view: {VIEW} (given by --exclude-newer)" in said
    first = path.read_text()
    assert f'exclude-newer = "{VIEW}"' in first
    assert "upload-time = 2026-11-01T00:00:00" in first  # the index served upload times
    published(dated_index, AFTER, "cudaenv-tiny-beta", "1.1")
    published(dated_index, AFTER, "cudaenv-tiny-alpha", "1.1", ["cudaenv-tiny-beta"])

    said = lock_said(ws, tmp_path)
    assert f"index view: {VIEW} (kept from the lock)" in said
    assert "moved: nothing" in said
    assert path.read_text() == first  # not one byte moved

    said = lock_said(ws, tmp_path, "--upgrade-package", "cudaenv-tiny-beta")
    assert "moved: cudaenv-tiny-beta 1.0 -> 1.1" in said, said
    assert versions(path) == {"cudaenv-tiny-alpha": "1.0", "cudaenv-tiny-beta": "1.1"}
    after_one = lock.read(path)
    assert after_one.exclude_newer == VIEW
    assert dict(after_one.exclude_newer_packages)["cudaenv-tiny-beta"] > "2026-11-20T00:00:00Z"
    assert lock_said(ws, tmp_path).count("moved: nothing") == 1  # beta's own view is kept

    said = lock_said(ws, tmp_path, "--upgrade")
    assert "moved: cudaenv-tiny-alpha 1.0 -> 1.1" in said, said
    assert versions(path) == {"cudaenv-tiny-alpha": "1.1", "cudaenv-tiny-beta": "1.1"}
    upgraded = lock.read(path)
    assert upgraded.exclude_newer is not None and upgraded.exclude_newer > VIEW
    assert upgraded.exclude_newer_packages == ()


@pytest.mark.slow
def test_a_new_dependency_resolves_as_the_index_stood(dated_index: Path, tmp_path: Path) -> None:
    """What preferring the locked versions cannot do: a package the old lock never had (a
    dependency of one the spec now names) comes as the lock's view saw it, not as it is now;
    the package the spec names anew is seen as it is now (what `cudaenv add` asks)."""
    published(dated_index, BEFORE, "cudaenv-tiny-delta", "1.0")
    published(dated_index, AFTER, "cudaenv-tiny-delta", "2.0")
    published(dated_index, AFTER, "cudaenv-tiny-epsilon", "1.0", ["cudaenv-tiny-delta"])
    ws = workspace(tmp_path / "ws")
    write(ws / "envspecs" / "tiny.yaml", SPEC)
    lock_said(ws, tmp_path, "--exclude-newer", VIEW)
    write(
        ws / "envspecs" / "tiny.yaml",
        SPEC.replace("[cudaenv-tiny-alpha]", "[cudaenv-tiny-alpha, cudaenv-tiny-epsilon]"),
    )
    said = lock_said(ws, tmp_path)
    assert "cudaenv-tiny-epsilon as of now" in said
    path = lock_of(ws / "envspecs" / "tiny.yaml")
    assert versions(path)["cudaenv-tiny-delta"] == "1.0"
    assert versions(path)["cudaenv-tiny-epsilon"] == "1.0"
    assert "new: cudaenv-tiny-delta 1.0" in said
    # Without a view (the index as it is now) the same spec takes delta 2.0.
    lock_said(ws, tmp_path, "--upgrade")
    assert versions(path)["cudaenv-tiny-delta"] == "2.0"


@pytest.mark.slow
def test_cudaenv_exclude_newer_is_the_view_of_a_new_lock(dated_index: Path, tmp_path: Path) -> None:
    published(dated_index, AFTER, "cudaenv-tiny-beta", "1.1")
    ws = workspace(tmp_path / "ws")
    write(ws / "envspecs" / "tiny.yaml", SPEC)
    fresh = {"CUDAENV_CACHE_DIR": str(tmp_path / "c"), "UV_CACHE_DIR": str(tmp_path / "u")}
    done = cudaenv(
        "lock", "envspecs/tiny.yaml", cwd=ws, env={**fresh, "CUDAENV_EXCLUDE_NEWER": "2026-11-15"}
    )
    assert f"index view: {VIEW} (CUDAENV_EXCLUDE_NEWER)" in done.stderr
    assert versions(lock_of(ws / "envspecs" / "tiny.yaml"))["cudaenv-tiny-beta"] == "1.0"


@pytest.mark.parametrize(
    ("env", "flags", "said"),
    [
        (
            {"CUDAENV_EXCLUDE_NEWER": "last tuesday"},
            (),
            "CUDAENV_EXCLUDE_NEWER=last tuesday: not a UTC time",
        ),
        (
            {},
            ("--exclude-newer", "2026-13-01"),
            "argument --exclude-newer: '2026-13-01': not a UTC time",
        ),
        ({}, ("--exclude-newer", "2026-12-01T05:00:00"), "a time without a zone"),
    ],
    ids=["variable", "flag", "no-zone"],
)
def test_a_bad_view_time_is_one_line_exit_2(
    tmp_path: Path, env: dict[str, str], flags: tuple[str, ...], said: str
) -> None:
    write(tmp_path / "envspecs" / "tiny.yaml", SPEC)
    done = cudaenv("lock", *flags, "envspecs/tiny.yaml", cwd=tmp_path, env=env, check=False)
    assert done.returncode == 2, done.stderr
    assert said in done.stderr
    assert "Traceback" not in done.stderr
    assert not lock_of(tmp_path / "envspecs" / "tiny.yaml").exists()


@pytest.mark.slow
def test_a_pin_newer_than_the_view_is_refused_naming_the_view(
    dated_index: Path, tmp_path: Path
) -> None:
    """A spec that now asks a release uploaded after the lock's view: exit 3, no lock
    change, and the error says which view hid it and how to move it."""
    ws = workspace(tmp_path / "ws")
    write(ws / "envspecs" / "tiny.yaml", SPEC)
    lock_said(ws, tmp_path, "--exclude-newer", VIEW)
    path = lock_of(ws / "envspecs" / "tiny.yaml")
    text = path.read_text()
    published(dated_index, AFTER, "cudaenv-tiny-alpha", "1.1", ["cudaenv-tiny-beta"])
    write(
        ws / "envspecs" / "tiny.yaml",
        SPEC.replace("[cudaenv-tiny-alpha]", "[cudaenv-tiny-alpha==1.1]"),
    )
    fresh = {"CUDAENV_CACHE_DIR": str(tmp_path / "c"), "UV_CACHE_DIR": str(tmp_path / "u")}
    done = cudaenv("lock", "envspecs/tiny.yaml", cwd=ws, env=fresh, check=False)
    assert done.returncode == 3, done.stderr
    assert f"the index as it stood at {VIEW} (kept from the lock)" in done.stderr
    assert "`cudaenv lock --upgrade`" in done.stderr
    assert "Traceback" not in done.stderr
    assert path.read_text() == text
    done = cudaenv(
        "lock", "--upgrade-package", "cudaenv-tiny-alpha", "envspecs/tiny.yaml", cwd=ws, env=fresh
    )
    assert versions(path)["cudaenv-tiny-alpha"] == "1.1"
