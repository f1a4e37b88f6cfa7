"""core/context.py: a value asked for inside one command is made once; outside, every time."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from builder.core import context
from tests.helpers import ENVSPECS, lock_of, program


def test_a_value_is_made_once_per_command_and_never_outlives_it() -> None:
    made: list[str] = []

    def make() -> str:
        made.append("x")
        return f"value {len(made)}"

    assert context.once("k", make) == "value 1"  # no command: nothing kept
    assert context.once("k", make) == "value 2"
    with context.command():
        assert context.once("k", make) == context.once("k", make) == "value 3"
        assert context.once("other", make) == "value 4"
        with context.command():  # a command inside a command has its own values
            assert context.once("k", make) == "value 5"
        assert context.once("k", make) == "value 3"
    assert context.once("k", make) == "value 6"


def test_a_failure_is_not_kept_and_a_thread_asks_afresh() -> None:
    calls: list[int] = []

    def flaky() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("busy")
        return len(calls)

    with context.command():
        with pytest.raises(OSError):
            context.once("f", flaky)
        assert context.once("f", flaky) == context.once("f", flaky) == 2
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(context.once("f", flaky)))
        thread.start()
        thread.join(timeout=10)
        assert seen == [3]  # a thread starts outside the command's scope: made again


def test_one_command_lists_the_gpus_once_and_hashes_its_spec_and_lock_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside a command, the GPU list is one nvidia-smi query however often it is asked for
    (a `build --verify` asks for the arch list, then the sampling check); a spec's fingerprint
    and a lock's content hash are made once per object."""
    from builder.machine import archs
    from builder.spec import envspec, lock

    bin_dir = tmp_path / "bin"
    asked = tmp_path / "asked"
    program(bin_dir / "nvidia-smi", f'echo "$@" >> {asked}\necho "0, NVIDIA H100, 9.0, [N/A]"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("CUDAENV_DRIVER_VERSION", "580.65.06")
    with context.command():
        first = archs.visible_gpus()
        assert archs.visible_gpus() == first
    assert len(asked.read_text().splitlines()) == 1
    spec = envspec.load(ENVSPECS / "toolchain-cu130.yaml")
    assert spec.fingerprint() is spec.fingerprint()
    locked = lock.read(lock_of(ENVSPECS / "toolchain-cu130.yaml"))
    assert locked.content_hash() is locked.content_hash()
