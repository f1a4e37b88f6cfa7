"""The index view: how a time is read, what a lock records and derives, what uv is told."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from builder.core import indexview
from builder.core.errors import LockUnreadable
from builder.spec import envspec as spec
from builder.spec import lock, resolve
from tests.helpers import ENVSPECS, lock_of


def test_times_are_read_in_utc_and_written_as_uv_writes_them() -> None:
    assert indexview.canonical("2026-12-01") == "2026-12-01T00:00:00Z"
    assert indexview.canonical("2026-12-01T05:23:12.734Z") == "2026-12-01T05:23:12Z"
    assert indexview.canonical("2026-12-01T06:23:12+01:00") == "2026-12-01T05:23:12Z"
    for bad in ("", "yesterday", "2026-13-01", "P7D"):
        assert indexview.problem(bad) is not None, bad
    assert "without a zone" in str(indexview.problem("2026-12-01T05:23:12"))


def test_the_view_after_upload_times_holds_the_newest_file() -> None:
    """uv leaves out a file uploaded at the cut-off itself: the view is the next second."""
    times = ["2026-11-16T23:50:58.123456Z", "2026-11-01T00:00:00Z", "not a time"]
    assert indexview.after(times) == "2026-11-16T23:50:59Z"
    assert indexview.after([]) is None


def test_what_uv_is_told() -> None:
    assert indexview.View().uv_args() == []
    view = indexview.View(
        at="2026-12-01T05:23:12Z",
        packages=(("vllm", "2026-12-02T00:00:00Z"),),
        exempt=("wheelhouse-only",),
        moving=("added",),
    )
    assert view.uv_args() == [
        "--exclude-newer", "2026-12-01T05:23:12Z",
        "--exclude-newer-package", "vllm=2026-12-02T00:00:00Z",
        "--exclude-newer-package", "added=false",
        "--exclude-newer-package", "wheelhouse-only=false",
    ]  # fmt: skip


def committed(name: str = "vllm-0.33-cu130.yaml") -> lock.Lock:
    return lock.read(lock_of(ENVSPECS / name))


def test_every_committed_lock_records_its_view() -> None:
    for path in sorted((ENVSPECS / "locks").glob("pylock.*.toml")):
        lk = lock.read(path)
        assert lk.exclude_newer is not None, path
        newest = indexview.after(
            f.upload_time for p in lk.packages for f in p.files if f.upload_time
        )
        assert newest is not None and newest <= lk.exclude_newer, path  # every file is seen


def test_a_lock_without_a_recorded_view_takes_one_from_its_files() -> None:
    old = dataclasses.replace(committed(), exclude_newer=None)
    view = old.view()
    assert view.at == indexview.after(
        f.upload_time for p in old.packages for f in p.files if f.upload_time
    )
    assert view.exempt == ()
    untimed = dataclasses.replace(
        old.packages[0],
        wheels=tuple(dataclasses.replace(w, upload_time=None) for w in old.packages[0].wheels),
    )
    partly = dataclasses.replace(old, packages=(untimed, *old.packages[1:]))
    assert partly.view().exempt == (untimed.name,)
    nothing = dataclasses.replace(
        old,
        packages=tuple(
            dataclasses.replace(
                p,
                wheels=tuple(dataclasses.replace(w, upload_time=None) for w in p.wheels),
                sdist=None,
            )
            for p in old.packages
        ),
    )
    assert nothing.view().at is None  # no cut-off could see a file without an upload time


def test_the_view_round_trips_through_the_lock(tmp_path: Path) -> None:
    lk = dataclasses.replace(
        committed(), exclude_newer_packages=(("vllm", "2026-12-02T10:00:00Z"),)
    )
    path = tmp_path / "pylock.vllm-0-33-cu130.toml"
    lock.write(lk, path)
    text = path.read_text()
    assert 'exclude-newer = "2026-12-01T05:23:12Z"' in text
    assert 'exclude-newer-package = { vllm = "2026-12-02T10:00:00Z" }' in text
    back = lock.read(path)
    assert back.exclude_newer == "2026-12-01T05:23:12Z"
    assert back.exclude_newer_packages == (("vllm", "2026-12-02T10:00:00Z"),)
    assert back.view().describe() == (
        "2026-12-01T05:23:12Z (kept from the lock); vllm as of 2026-12-02T10:00:00Z"
    )


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ('exclude-newer = "soon"', "[tool.cudaenv] exclude-newer: expected a UTC time"),
        ("exclude-newer = 7", "[tool.cudaenv] exclude-newer: expected a UTC time"),
        ('exclude-newer-package = { vllm = "x" }', "exclude-newer-package.vllm: expected"),
        ('exclude-newer-package = { "--x" = "2026-12-01" }', "not a normalised name"),
    ],
)
def test_a_lock_with_a_bad_view_is_refused_naming_the_key(
    tmp_path: Path, line: str, said: str
) -> None:
    """The lock's view goes to uv's command line: only a time is taken."""
    text = lock_of(ENVSPECS / "toolchain-cu130.yaml").read_text()
    text = text.replace('exclude-newer = "2026-11-30T04:22:14Z"', line)
    path = tmp_path / "pylock.toolchain-cu130.toml"
    path.write_text(text)
    with pytest.raises(LockUnreadable, match=said.replace("[", r"\[").replace("]", r"\]")):
        lock.read(path)


def test_a_relock_keeps_the_view_and_moves_only_what_it_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = spec.load(ENVSPECS / "vllm-0.33-cu130.yaml")
    lk = committed()
    monkeypatch.delenv("CUDAENV_EXCLUDE_NEWER", raising=False)
    kept = resolve.choose_view(lk, s)
    assert (kept.at, kept.moving, kept.origin) == ("2026-12-01T05:23:12Z", (), "kept from the lock")
    one = resolve.choose_view(lk, s, upgrade_packages=["vLLM"])
    assert (one.at, one.moving) == ("2026-12-01T05:23:12Z", ("vllm",))
    assert resolve.choose_view(lk, s, upgrade=True).at is None  # now
    assert resolve.choose_view(None, s).at is None
    given = resolve.choose_view(lk, s, given="2026-11-20")
    assert (given.at, given.origin) == ("2026-11-20T00:00:00Z", "given by --exclude-newer")
    monkeypatch.setenv("CUDAENV_EXCLUDE_NEWER", "2026-11-21")
    assert resolve.choose_view(None, s).at == "2026-11-21T00:00:00Z"
    assert resolve.choose_view(lk, s, upgrade=True).origin == "CUDAENV_EXCLUDE_NEWER"
    assert resolve.choose_view(lk, s).at == "2026-12-01T05:23:12Z"  # the lock's own comes first
    added = dataclasses.replace(s, packages=(*s.packages, "causal-conv1d>=1.6"))
    assert resolve.choose_view(lk, added).moving == ("causal-conv1d",)


def test_what_moved_is_said_per_package() -> None:
    before = committed()
    vllm = next(p for p in before.packages if p.name == "vllm")
    bumped = dataclasses.replace(vllm, version="0.34.0")
    others = [p for p in before.packages if p.name not in ("vllm", "yarl")]
    after = dataclasses.replace(before, packages=(*others, bumped))
    lines = resolve.moved(before, after)
    assert "vllm 0.33.0 -> 0.34.0" in lines
    assert any(line.startswith("gone: yarl ") for line in lines)
    assert resolve.moved(before, before) == []


@pytest.mark.parametrize("previous", [False, True])
def test_a_package_pinned_to_a_directory_index_is_exempt(
    previous: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``file://`` index serves no upload times and uv drops every untimed file under a
    cut-off: such a pin is exempt, on a fresh lock and a re-lock alike; an HTTP pin is not."""
    monkeypatch.setenv("CUDAENV_EXCLUDE_NEWER", "2026-11-21")
    s = dataclasses.replace(
        spec.load(ENVSPECS / "vllm-0.33-cu130.yaml"),
        indexes=(("Six", "file:///srv/wheels/simple"), ("idna", "https://example.test/simple")),
    )
    view = resolve.choose_view(committed() if previous else None, s)
    assert view.at is not None and "six" in view.exempt and "idna" not in view.exempt
    assert "--exclude-newer-package" in view.uv_args() and "six=false" in view.uv_args()
