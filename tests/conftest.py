"""Shared fixtures. Markers (pyproject): network, e2e, gpu."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENVSPECS = REPO / "envspecs"


def gpu_reason() -> str | None:
    """Why GPU tests cannot run here, or None when an NVIDIA GPU is visible."""
    if not Path("/proc/driver/nvidia/version").exists():
        return "no NVIDIA driver (/proc/driver/nvidia/version is absent)"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no nvidia-smi"
    done = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
    if done.returncode != 0 or "GPU" not in done.stdout:
        return "no visible NVIDIA GPU"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = gpu_reason()
    if reason is None:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def in_tmp(tmp_path: Path) -> Iterator[Path]:
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
