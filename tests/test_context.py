"""core/context.py: a value asked for inside one command is made once; outside, every time."""

from __future__ import annotations

import threading

import pytest

from builder.core import context


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
