"""Shared fixtures. Markers (pyproject): network, e2e, gpu. Plain helpers: tests/helpers.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


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


@pytest.fixture(autouse=True)
def own_cache_dir(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fresh, empty cudaenv cache (builder.paths.cache_dir) for each offline test, so a unit
    test neither writes to the user's ~/.cache/cudaenv nor passes thanks to what is in it.
    Children started by the test inherit it through the environment. network and e2e tests
    keep the real cache: its channel pins and resolutions save minutes."""
    if any(request.node.get_closest_marker(m) for m in ("network", "e2e")):
        return
    monkeypatch.setenv("CUDAENV_CACHE_DIR", str(tmp_path_factory.mktemp("cudaenv-cache")))


@pytest.fixture
def in_tmp(tmp_path: Path) -> Iterator[Path]:
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old)
