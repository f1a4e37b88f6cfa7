"""The one message formatter (errors.printable, printable_block): every line cudaenv prints to
stderr (an error, a progress line, a warning) shows an argument's or a file's control
characters as escapes, so a newline cannot forge an `error:` line and an ESC cannot act on
the terminal. Every positional argument of every command of the command table is tried."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.core.errors import (
    BuildError,
    UsageError,
    error_lines,
    printable,
    printable_block,
)
from tests.helpers import command_arguments, cudaenv

FORGED = "x\nerror: forged\r\x1b[2J\x9b\u2028y"


def test_printable_escapes_every_control_and_undecodable_byte() -> None:
    assert printable(FORGED) == "x\\nerror: forged\\r\\x1b[2J\\x9b\\u2028y"
    assert printable("a\udcffb") == "a\\xffb"  # a byte that was not UTF-8 (surrogateescape)
    assert printable("tab\tand ünïcode") == "tab\tand ünïcode"


def test_bad_input_is_one_line_and_a_tools_output_is_indented() -> None:
    assert error_lines(UsageError(f"{FORGED}: no such spec")) == [
        "error: x\\nerror: forged\\r\\x1b[2J\\x9b\\u2028y: no such spec"
    ]
    said = error_lines(BuildError("nvcc --version failed:\nerror: its own\x1b[1m words"))
    assert said == ["error: nvcc --version failed:\n  error: its own\\x1b[1m words"]
    assert printable_block("a\nb\nc") == "a\n  b\n  c"


def positionals() -> list[tuple[tuple[str, ...], list[str]]]:
    """(command words, its positional arguments' values) for every command that takes one:
    the forged text for each, `true` for `run`'s command."""
    found: dict[tuple[str, ...], list[str]] = {}
    for words, _, option, _ in command_arguments():
        if not option.flags:
            remainder = option.argparse.get("nargs") == "..."
            found.setdefault(words, []).extend(["--", "true"] if remainder else [FORGED])
    return list(found.items())


@pytest.mark.slow
@pytest.mark.parametrize(("words", "values"), positionals(), ids=lambda v: " ".join(v))
def test_no_argument_forges_a_line_or_reaches_the_terminal_raw(
    words: tuple[str, ...], values: list[str], tmp_path: Path
) -> None:
    done = cudaenv(*words, *values, cwd=tmp_path, check=False, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    for raw in ("\x1b", "\r", "\x9b", "\u2028"):
        assert raw not in out, (raw, out)
    forged = [ln for ln in out.splitlines() if ln.startswith(("error: forged", "forged"))]
    assert not forged, out
    assert "Traceback" not in out, out
