"""Atomic swap, leftovers and the per-env lock, with real files and processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from builder import build, interpreters


def make_tree(path: Path, marker: str) -> Path:
    path.mkdir(parents=True)
    (path / "marker").write_text(marker)
    return path


def test_swap_into_empty_place(tmp_path: Path) -> None:
    new = make_tree(tmp_path / ".env.tmp-1", "new")
    assert build.swap_into_place(new, tmp_path / "env") is None
    assert (tmp_path / "env" / "marker").read_text() == "new"
    assert not new.exists()


def test_swap_replaces_and_returns_the_old_tree(tmp_path: Path) -> None:
    make_tree(tmp_path / "env", "old")
    new = make_tree(tmp_path / ".env.tmp-1", "new")
    old = build.swap_into_place(new, tmp_path / "env")
    assert (tmp_path / "env" / "marker").read_text() == "new"
    assert old is not None
    assert (old / "marker").read_text() == "old"


def test_leftovers_of_killed_builds_are_removed(tmp_path: Path) -> None:
    make_tree(tmp_path / "env", "current")
    make_tree(tmp_path / ".env.tmp-123-abc", "half")
    make_tree(tmp_path / ".env.old-77", "old")
    make_tree(tmp_path / ".other.tmp-1", "someone else's")
    removed = build.clean_leftovers(tmp_path / "env")
    assert sorted(p.name for p in removed) == [".env.old-77", ".env.tmp-123-abc"]
    assert (tmp_path / "env" / "marker").read_text() == "current"
    assert (tmp_path / ".other.tmp-1").exists()


def hold_lock(env: Path, seconds: float) -> subprocess.Popen[str]:
    """A real second process holding the env's build lock for ``seconds``."""
    holder = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from pathlib import Path
        from builder import build
        with build.env_lock(Path({str(env)!r}), print):
            print("held", flush=True)
            time.sleep({seconds})
        """
    )
    child = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


def test_second_builder_waits_for_the_lock_and_says_why(tmp_path: Path) -> None:
    first = hold_lock(tmp_path / "env", 1.5)
    messages: list[str] = []
    started = time.monotonic()
    with build.env_lock(tmp_path / "env", messages.append):
        waited = time.monotonic() - started
    first.wait(timeout=10)
    assert waited > 0.5
    assert len(messages) == 1
    assert messages[0].startswith(f"waiting for cudaenv build pid {first.pid} to finish building")


def test_lock_of_a_killed_builder_is_taken_over(tmp_path: Path) -> None:
    first = hold_lock(tmp_path / "env", 60)
    first.kill()
    first.wait(timeout=10)
    messages: list[str] = []
    started = time.monotonic()
    with build.env_lock(tmp_path / "env", messages.append):
        pass
    assert time.monotonic() - started < 1.0
    assert messages == []


def test_python_discovery_finds_this_interpreter() -> None:
    minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
    found = interpreters.find(minor, allow_download=False)
    assert found.version.startswith(minor + ".")


def test_python_discovery_names_what_it_found() -> None:
    from builder.errors import ToolMissing

    with pytest.raises(ToolMissing) as info:
        interpreters.find("3.99", allow_download=False)
    message = str(info.value)
    assert message.startswith("no Python 3.99 on this machine (looked at: ")
    assert "uv python install 3.99" in message


# --------------------------------------------------------------------------- install from the cache


def fake_uv(tmp_path: Path, *, cached: bool) -> Path:
    """A stand-in uv that, like uv, fails with --offline when the files are not cached, and
    records each of its runs."""
    uv = tmp_path / "uv"
    uv.write_text(
        f"#!{sys.executable}\n"
        "import sys, pathlib\n"
        f"pathlib.Path({str(tmp_path / 'runs')!r}).open('a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"cached = {cached!r}\n"
        "if '--offline' in sys.argv and not cached:\n"
        "    sys.exit('error: cuda-toolkit was not found in the cache')\n"
        "sys.stderr.write(' + cuda-toolkit==13.0.3.0\\n')\n"
    )
    uv.chmod(0o755)
    return uv


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "not-cached"])
def test_a_warm_install_asks_no_index_and_a_cold_one_goes_online(
    tmp_path: Path, cached: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    uv = fake_uv(tmp_path, cached=cached)
    req = tmp_path / "req.txt"
    argv = [str(uv), "pip", "sync", "--require-hashes"]
    took_cache = build._sync_from_cache(argv, req)
    assert took_cache is cached
    runs = (tmp_path / "runs").read_text().splitlines()
    assert runs == [f"pip sync --require-hashes --offline {req}"]
    # A cached install shows uv's own lines, as the online run would have; a failed attempt
    # shows nothing (the online run that follows says what there is to say).
    assert (" + cuda-toolkit" in capsys.readouterr().err) is cached


def test_an_install_that_is_offline_or_from_a_wheelhouse_is_left_as_asked(tmp_path: Path) -> None:
    uv = fake_uv(tmp_path, cached=True)
    for extra in (["--offline"], ["--no-index", "--find-links", "/w"]):
        assert not build._sync_from_cache([str(uv), "pip", "sync", *extra], tmp_path / "r.txt")
    assert not (tmp_path / "runs").exists()
