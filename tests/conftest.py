"""Shared fixtures. Markers (pyproject): network, e2e, gpu, slow. Plain helpers: tests/helpers.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def gpu_reason() -> str | None:
    """Why GPU tests cannot run here, or None when an NVIDIA GPU is visible: the product's
    own answer (archs.visible_gpus, whose driver is driver.detect's, the gate's)."""
    from builder import archs

    gpus, why = archs.visible_gpus()
    return None if gpus else why or "no visible NVIDIA GPU"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if "gpu" in item.keywords]
    reason = gpu_reason() if marked else None
    if reason is None:
        return
    for item in marked:
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


class Registry:
    """A CNCF distribution registry serving plain http on loopback (see ``registry``)."""

    def __init__(self, port: int, root: Path, process: subprocess.Popen[bytes]) -> None:
        self.port = port
        self.url = f"oci://127.0.0.1:{port}/cudaenv/jit"
        self.base = f"http://127.0.0.1:{port}"
        # Its storage: a blob is ROOT/docker/registry/v2/blobs/sha256/XX/HEX/data.
        self.root = root
        self.process = process

    def answers(self) -> bool:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
        try:
            conn.request("GET", "/v2/")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    """A real OCI registry (Debian's docker-registry) on a free loopback port, its storage
    under tmp_path; it answers GET /v2/ before the test starts and is stopped at teardown."""
    import socket
    import time

    binary = shutil.which("docker-registry")
    if binary is None:
        pytest.skip("docker-registry is not installed (apt install docker-registry)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = tmp_path / "registry"
    config = tmp_path / "registry.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: error\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root}\n  delete:\n    enabled: false\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    log = tmp_path / "registry.log"
    with log.open("wb") as out:
        process = subprocess.Popen([binary, "serve", str(config)], stdout=out, stderr=out)
    served = Registry(port, root, process)
    try:
        deadline = time.monotonic() + 10
        while not served.answers():
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"docker-registry did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield served
    finally:
        served.stop()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How many tests skipped for want of a program (the registry, a shell, Chromium): a
    developer's green run says what it did not test, once per program."""
    counts: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        found = re.search(r"(\S+(?: \([^)]*\))?) is not installed", reason)
        if found:
            counts[found.group(1)] = counts.get(found.group(1), 0) + 1
    if not counts:
        return
    terminalreporter.section("skipped for want of a program")
    for program, n in sorted(counts.items()):
        terminalreporter.write_line(f"{n} test(s) skipped: {program} is not installed here")
    terminalreporter.write_line(
        "(.ci/run, and the nox test sessions for the registry, install them where they can)"
    )
