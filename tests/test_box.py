"""What cudaenv reads of this machine for its compiles (builder/machine/box.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def test_ninjas_jobs_share_the_cores_among_nvcc_threads_within_free_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MAX_JOBS for cudaenv's FlashInfer builds: cores / nvcc threads, cut to what the free
    memory holds (2 GiB a thread), at least one; a MAX_JOBS the user set is kept."""
    from builder.machine import box

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 134217728 kB\nMemAvailable: 125829120 kB\n")  # 120 GiB
    assert box.compile_jobs(1, meminfo=meminfo) == 16
    assert box.compile_jobs(3, meminfo=meminfo) == 6  # ceil(16 / 3)
    meminfo.write_text("MemAvailable: 8388608 kB\n")  # 8 GiB: 4 threads' worth
    assert box.compile_jobs(1, meminfo=meminfo) == 4
    assert box.compile_jobs(8, meminfo=meminfo) == 1
    assert box.compile_environ("9.0a 12.0f", {"MAX_JOBS": "3"}) == {"MAX_JOBS": "3"}
    assert box.compile_environ("12.0f", {})["MAX_JOBS"].isdigit()
