"""$GITHUB_STEP_SUMMARY, the one output file cudaenv appends to rather than replaces: a
regular file only, never through a link, never waiting on a FIFO."""

from __future__ import annotations

import os
import time
from pathlib import Path


def test_the_step_summary_is_appended_to_a_regular_file_only(tmp_path: Path) -> None:
    """$GITHUB_STEP_SUMMARY naming a FIFO (no reader: an open for writing would wait for one),
    a link to another file, or a directory: nothing is written and nothing waits; a regular
    file gets the Markdown appended."""
    from builder.verify.report import append_step_summary

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (tmp_path / "link").symlink_to(victim)
    (tmp_path / "dir").mkdir()
    for name in ("fifo", "link", "dir"):
        started = time.monotonic()
        assert not append_step_summary("# x", {"GITHUB_STEP_SUMMARY": str(tmp_path / name)})
        assert time.monotonic() - started < 5
    assert victim.read_text() == "keep\n"
    summary = tmp_path / "summary.md"
    summary.write_text("before\n")
    assert append_step_summary("# report", {"GITHUB_STEP_SUMMARY": str(summary)})
    assert summary.read_text() == "before\n# report\n"
