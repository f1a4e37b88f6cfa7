"""Shared fixtures. Markers (pyproject): network, e2e, gpu, slow. Plain helpers: tests/helpers.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def gpu_reason() -> str | None:
    """Why GPU tests cannot run here, or None when an NVIDIA GPU is visible: the product's
    own answer (archs.visible_gpus, whose driver is driver.detect's, the gate's)."""
    from builder.machine import archs

    gpus, why = archs.visible_gpus()
    return None if gpus else why or "no visible NVIDIA GPU"


def pytest_configure(config: pytest.Config) -> None:
    # A process a non-interactive shell starts in the background (a CI runner, `cmd &`, nohup)
    # inherits SIGINT ignored, and every child of it too (POSIX; Python then installs no
    # KeyboardInterrupt handler): a test that sends SIGINT as a terminal's Ctrl-C does would
    # reach a cudaenv that ignores it, and wait out whatever it was doing. Measured: the two
    # Ctrl-C-at-the-swap tests timed out under CI's runner and passed from a terminal. A
    # handler here (not SIG_IGN) is reset to the default in each child at exec, so the
    # tests' children start as a terminal's foreground process does.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if "gpu" in item.keywords]
    reason = gpu_reason() if marked else None
    if reason is None:
        return
    for item in marked:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def session_jit_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The JIT store of this test session, one for every xdist worker (a directory under the
    session's base temp, which each worker's is in), never the user's: what a store holds
    changes what a build does (a module a warm marked is prefetched into each new env), so a
    suite run where an earlier run, a bench or a developer left marks behaved otherwise than
    on a fresh machine. Measured: CI on a machine whose ~/.cache/cudaenv held a sampling
    module marked by an earlier run failed four tests that pass on an empty one. Session
    scope: made before any module fixture builds an env. Offline tests have a store of their
    own under :func:`own_cache_dir`."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDAENV_JIT_STORE", str(root / "jit-store"))
        yield root / "jit-store"


@pytest.fixture(autouse=True)
def own_cache_dir(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fresh, empty cudaenv cache (builder.core.paths.cache_dir) for each offline test, so a unit
    test neither writes to the user's ~/.cache/cudaenv nor passes thanks to what is in it.
    Children started by the test inherit it through the environment. network and e2e tests
    keep the real cache (its channel pins and resolutions save minutes) but not its JIT store
    (:func:`session_jit_store`), and resolve against the committed locks' index view
    (CUDAENV_EXCLUDE_NEWER)."""
    if any(request.node.get_closest_marker(m) for m in ("network", "e2e")):
        # A resolution that keeps no view of its own (a new lock, init) sees the index as the
        # committed locks saw it: what the index publishes tomorrow changes no answer.
        from tests.helpers import index_view

        monkeypatch.setenv("CUDAENV_EXCLUDE_NEWER", index_view())
        return
    monkeypatch.setenv("CUDAENV_CACHE_DIR", str(tmp_path_factory.mktemp("cudaenv-cache")))
    monkeypatch.delenv(
        "CUDAENV_JIT_STORE", raising=False
    )  # the store in that cache, fresh as the rest


@pytest.fixture
def in_tmp(tmp_path: Path) -> Iterator[Path]:
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """A service a fixture started, stopped: asked, then killed after 5 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


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
        stop_process(self.process)


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


# The password of the test server that asks one: a throwaway of a loopback server.
TEST_PASSWORD = "s3cret pass"  # noqa: S105 (a test server's, on loopback, gone at teardown)


class Redis:
    """A Redis server (Debian's redis-server) on loopback (see ``redis_server``)."""

    def __init__(self, port: int, password: str | None, process: subprocess.Popen[bytes]) -> None:
        self.port = port
        self.password = password
        self.process = process
        # What a node names it by: the password is given apart (CUDAENV_REMOTE_CACHE_PASSWORD).
        self.url = f"redis://127.0.0.1:{port}/0"

    def command(self, *words: str) -> str:
        """One redis-cli command's answer (``KEYS *``, ``FLUSHALL``), bounded."""
        argv = ["redis-cli", "-p", str(self.port), "--no-auth-warning"]
        if self.password:
            argv += ["-a", self.password]
        done = subprocess.run([*argv, *words], capture_output=True, text=True, timeout=10)
        return done.stdout

    def keys(self, pattern: str = "*") -> list[str]:
        return sorted(k for k in self.command("--raw", "KEYS", pattern).splitlines() if k)

    def stop(self) -> None:
        stop_process(self.process)


def start_redis(root: Path, password: str | None = None) -> Redis:
    """Debian's redis-server on a free 127.0.0.1 port, nothing saved to disk, its files
    under ``root``; answering PING before it is returned. Skips where it is not installed."""
    import socket
    import time

    binary = shutil.which("redis-server")
    if binary is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server is not installed (apt install redis-server)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root.mkdir(parents=True, exist_ok=True)
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--dir", str(root)]  # fmt: skip
    if password:
        argv += ["--requirepass", password]
    log = root / "redis.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=out)
    served = Redis(port, password, process)
    deadline = time.monotonic() + 10
    while "PONG" not in served.command("PING"):
        if process.poll() is not None or time.monotonic() > deadline:
            served.stop()
            pytest.fail(f"redis-server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return served


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Redis]:
    """A real Redis server on loopback without a password, stopped at teardown."""
    served = start_redis(tmp_path / "redis")
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture
def redis_with_password(tmp_path: Path) -> Iterator[Redis]:
    """A real Redis server on loopback that asks a password (``requirepass``)."""
    served = start_redis(tmp_path / "redis-auth", password=TEST_PASSWORD)
    try:
        yield served
    finally:
        served.stop()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How many tests skipped for want of a program (the registry, Redis, a shell, Chromium): a
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
        "(.ci/run, and the nox test sessions for the registry and Redis, install them where "
        "they can)"
    )


@pytest.fixture
def tools(tmp_path: Path) -> Path:
    """The toy compiler and linker of the JIT store's tests (tests/test_jit_store.py)."""
    from tests.test_jit_store import make_tools

    return make_tools(tmp_path)


@pytest.fixture
def host_path(tmp_path: Path) -> str:
    """A PATH whose host compilers are scripts of known content (tests/test_jit_store.py)."""
    from tests.test_jit_store import make_host_path

    return make_host_path(tmp_path)
