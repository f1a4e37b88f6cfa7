"""Nothing lost, nobody surprised: interrupted, concurrent, failing and offline builds.

Each fault ends in one `error:` line with the fix and the exit code of the errors tree, and
leaves either no env or the previous one, working.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.core import proc
from builder.spec import envspec as spec
from builder.spec import lock
from tests.helpers import (
    ENVSPECS,
    FAULTS_PYTHONPATH,
    cudaenv,
    local_index,
    lock_of,
    workspace,
    write,
)

TOOLCHAIN = "envspecs/toolchain-cu130.yaml"
ENV = Path(".envs") / "toolchain-cu130"


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def works(env: Path) -> bool:
    done = subprocess.run(
        [env / "cuda-home" / "bin" / "nvcc", "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    return (
        done.returncode == 0 and "release 13.0" in done.stdout and (env / "cudaenv.json").exists()
    )


def no_leftovers(ws: Path) -> bool:
    return not list((ws / ".envs").glob(".toolchain-cu130.*-*"))


def start(ws: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "builder.cli", "build", TOOLCHAIN, *args],
        cwd=ws,
        env={**os.environ, "PYTHONPATH": FAULTS_PYTHONPATH, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(predicate: object, timeout: float = 120.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("timed out waiting")


# --------------------------------------------------------------------------- offline


@pytest.mark.slow
def test_missing_uv_is_one_line_exit_6(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    (lock_of(ws / TOOLCHAIN)).unlink()
    done = cudaenv("lock", TOOLCHAIN, cwd=ws, check=False, env={"CUDAENV_UV": "/nonexistent/uv"})
    assert done.returncode == 6
    assert error_lines(done.stderr) == [
        "error: CUDAENV_UV=/nonexistent/uv is not an executable; unset it or install uv: "
        f"`{sys.executable} -m pip install uv`"
    ]
    assert not (lock_of(ws / TOOLCHAIN)).exists()


@pytest.mark.slow
def test_an_unreachable_index_is_one_line_exit_3(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    (lock_of(ws / TOOLCHAIN)).unlink()
    done = cudaenv(
        "lock",
        TOOLCHAIN,
        cwd=ws,
        check=False,
        env={
            "UV_INDEX_URL": "http://127.0.0.1:9/simple",
            "UV_DEFAULT_INDEX": "http://127.0.0.1:9/simple",
            "UV_CACHE_DIR": str(tmp_path / "cache"),
            "UV_HTTP_RETRIES": "0",
        },
    )
    assert done.returncode == 3, done.stderr
    lines = error_lines(done.stderr)
    assert len(lines) == 1
    assert lines[0].startswith("error: toolchain-cu130: the package index did not answer (")
    assert lines[0].endswith("`cudaenv build --offline --wheelhouse DIR`")


@pytest.mark.slow
def test_an_index_that_times_out_is_one_line_exit_3(tmp_path: Path) -> None:
    """A server on loopback that accepts and never answers: uv's timeout, then one line."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                held.append(conn)  # never answer
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        ws = workspace(tmp_path, "toolchain-cu130.yaml")
        (lock_of(ws / TOOLCHAIN)).unlink()
        index = f"http://127.0.0.1:{port}/simple"
        started = time.monotonic()
        done = cudaenv(
            "lock",
            TOOLCHAIN,
            cwd=ws,
            check=False,
            env={
                "UV_INDEX_URL": index,
                "UV_DEFAULT_INDEX": index,
                "UV_HTTP_TIMEOUT": "2",
                "UV_HTTP_RETRIES": "0",
                "UV_CACHE_DIR": str(tmp_path / "cache"),
            },
        )
        assert time.monotonic() - started < 120
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        server.close()
    assert done.returncode == 3, done.stderr
    lines = error_lines(done.stderr)
    assert len(lines) == 1
    assert lines[0].startswith("error: toolchain-cu130: the package index did not answer (")


@pytest.mark.slow
def test_a_missing_python_is_one_line_exit_6(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    text = (ws / TOOLCHAIN).read_text().replace('python: "3.12"', 'python: "3.99"')
    write(ws / TOOLCHAIN, text)
    s = spec.load(ws / TOOLCHAIN)
    lock_file = lock_of(ws / TOOLCHAIN)
    old = lock.read(lock_file)
    lock.write(
        lock.Lock(**{**old.__dict__, "fingerprint": s.fingerprint(), "python": "3.99"}), lock_file
    )
    done = cudaenv("build", TOOLCHAIN, "--offline", cwd=ws, check=False)
    assert done.returncode == 6
    lines = error_lines(done.stderr)
    assert len(lines) == 1
    assert lines[0].startswith("error: no Python 3.99 on this machine (looked at: ")
    assert not (ws / ENV).exists()


def test_a_symlinked_env_path_is_refused(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    (ws / ".envs").mkdir()
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data").write_text("keep")
    (ws / ENV).symlink_to(precious)
    done = cudaenv("build", TOOLCHAIN, cwd=ws, check=False)
    assert done.returncode == 4
    assert error_lines(done.stderr)[0].startswith(f"error: {ws / ENV} is a symlink (to {precious})")
    assert (precious / "data").read_text() == "keep"


@pytest.mark.slow
def test_a_missing_wheelhouse_is_one_line_exit_2(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    write(tmp_path / "a-file", "")
    for given, what in ((tmp_path / "nonexistent", "does not exist"),
                        (tmp_path / "a-file", "is not a directory")):  # fmt: skip
        done = cudaenv("build", TOOLCHAIN, "--wheelhouse", str(given), cwd=ws, check=False)
        assert (done.returncode, error_lines(done.stderr)) == (2, [
            f"error: --wheelhouse {given}: {what}; name the directory `cudaenv export "
            "--wheelhouse DIR` filled"
        ]), done.stderr  # fmt: skip
        assert "Traceback" not in done.stderr
    assert not (ws / ".envs").exists()


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """``path``, a directory this process cannot write: a read-only tmpfs for root (whom
    permissions do not stop; skipped where mount is refused), mode 0555 for anyone else."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                             capture_output=True, text=True, check=False)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"root cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


@pytest.mark.parametrize("where", ["env", "sub/env"])
def test_a_read_only_env_dir_is_one_line_exit_4(tmp_path: Path, where: str) -> None:
    ws = workspace(tmp_path / "ws", "toolchain-cu130.yaml")
    with read_only_dir(tmp_path / "ro") as ro:
        target = ro / where
        done = cudaenv("build", TOOLCHAIN, "--env-dir", str(target), cwd=ws, check=False,
                       env={"CUDAENV_DRIVER_VERSION": "580.65"})  # fmt: skip
        named = ro / ".env.lock" if where == "env" else ro / "sub"
        reason = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
        assert (done.returncode, error_lines(done.stderr)) == (4, [
            f"error: {named}: cannot take the lock of {target} ({reason}); the env's directory "
            "must be writable by this user: pass --env-dir on a writable filesystem. Nothing "
            "was changed"
        ]), done.stderr  # fmt: skip
        assert "Traceback" not in done.stderr


# --------------------------------------------------------------------------- real builds


@pytest.mark.network
@pytest.mark.e2e
def test_missing_c_compiler_is_one_line_exit_6(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    done = cudaenv("build", TOOLCHAIN, cwd=ws, check=False, env={"CC": "/nonexistent/cc"})
    assert done.returncode == 6, done.stderr
    assert error_lines(done.stderr) == [
        "error: C compiler /nonexistent/cc not found: it builds the libcuda.so link stub and is "
        "nvcc's host compiler; install one (`apt-get install gcc`) or point CC at it"
    ]
    assert not (ws / ENV).exists()
    assert no_leftovers(ws)


@pytest.mark.network
@pytest.mark.e2e
def test_a_full_disk_is_one_line_exit_4(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        ws = workspace(tmp_path / "ws", "toolchain-cu130.yaml")
        target = mnt / "toolchain-cu130"
        done = cudaenv("build", TOOLCHAIN, "--env-dir", str(target), cwd=ws, check=False)
        assert done.returncode == 4, done.stderr
        # uv's own progress (streamed) says what it could not copy; cudaenv's verdict is one line.
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: no space left on device while building in {mnt} ("), (
            done.stderr
        )
        assert last.endswith("Nothing was replaced: the previous env, if any, is intact")
        assert not target.exists()
        assert [p.name for p in mnt.iterdir()] == [".toolchain-cu130.lock"]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@contextlib.contextmanager
def small_tmpfs(path: Path, mib: int) -> Iterator[Path]:
    """A tmpfs of ``mib`` MiB mounted at ``path`` (root only; skipped where mount is refused)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                             capture_output=True, text=True, check=False)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


@pytest.mark.network
@pytest.mark.e2e
@pytest.mark.parametrize("mib", [200, 260])
def test_a_full_tmpfs_never_exits_0(tmp_path: Path, mib: int) -> None:
    """The toolchain env (~270 MiB, copied: uv's cache is on another filesystem) into a
    tmpfs too small for it: exit 4 naming the full disk, no env, nothing left behind."""
    ws = workspace(tmp_path / "ws", "toolchain-cu130.yaml")
    with small_tmpfs(tmp_path / "small", mib) as mnt:
        target = mnt / "toolchain-cu130"
        done = cudaenv("build", TOOLCHAIN, "--env-dir", str(target), cwd=ws, check=False)
        assert done.returncode == 4, done.stderr
        [line] = error_lines(done.stderr)
        assert line.startswith(f"error: no space left on device while building in {mnt} ("), line
        assert not target.exists()
        assert [p.name for p in mnt.iterdir()] == [".toolchain-cu130.lock"]


@pytest.mark.network
@pytest.mark.e2e
def test_a_forced_rebuild_into_a_full_tmpfs_keeps_the_complete_env(tmp_path: Path) -> None:
    """Room for one env, not two: --force fails with exit 4 and the env there still works."""
    ws = workspace(tmp_path / "ws", "toolchain-cu130.yaml")
    with small_tmpfs(tmp_path / "small", 300) as mnt:
        target = mnt / "toolchain-cu130"
        cudaenv("build", TOOLCHAIN, "--env-dir", str(target), cwd=ws)
        before = (target / "cudaenv.json").read_text()
        done = cudaenv("build", TOOLCHAIN, "--env-dir", str(target), "--force", cwd=ws,
                       check=False)  # fmt: skip
        assert done.returncode == 4, done.stderr
        [line] = error_lines(done.stderr)
        assert line.startswith(f"error: no space left on device while building in {mnt} ("), line
        assert "; the env there now holds 2" in line  # ~270 MiB
        assert works(target)
        assert (target / "cudaenv.json").read_text() == before
        assert sorted(p.name for p in mnt.iterdir()) == [".toolchain-cu130.lock", "toolchain-cu130"]


@pytest.mark.network
@pytest.mark.e2e
def test_two_builds_of_one_env_wait_and_both_succeed(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    first = start(ws, "--force", CUDAENV_FAULT_PAUSE="overlay", CUDAENV_FAULT_PAUSE_SECONDS="3")
    wait_for(
        lambda: (
            (ws / ".envs" / ".toolchain-cu130.lock").exists()
            and "pid" in (ws / ".envs" / ".toolchain-cu130.lock").read_text()
        )
    )
    second = start(ws, "--force")
    _, err1 = first.communicate(timeout=300)
    _, err2 = second.communicate(timeout=300)
    assert first.returncode == 0, err1
    assert second.returncode == 0, err2
    assert (
        f"cudaenv: waiting for cudaenv build pid {first.pid} to finish building {ws / ENV}" in err2
    )
    assert works(ws / ENV)
    assert no_leftovers(ws)


@pytest.mark.network
@pytest.mark.e2e
def test_builds_of_different_envs_run_in_parallel(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    other = (ws / TOOLCHAIN).read_text().replace("name: toolchain-cu130", "name: toolchain-b")
    write(ws / "envspecs" / "b.yaml", other)
    lock_b = lock_of(ws / "envspecs" / "b.yaml")
    old = lock.read(lock_of(ws / TOOLCHAIN))
    lock.write(lock.Lock(**{**old.__dict__, "spec_name": "toolchain-b"}), lock_b)
    pause = {"CUDAENV_FAULT_PAUSE": "overlay", "CUDAENV_FAULT_PAUSE_SECONDS": "2"}
    started = time.monotonic()
    a = start(ws, **pause)
    b = subprocess.Popen(
        [sys.executable, "-m", "builder.cli", "build", "envspecs/b.yaml"],
        cwd=ws,
        env={**os.environ, "PYTHONPATH": FAULTS_PYTHONPATH, **pause},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, err_a = a.communicate(timeout=300)
    _, err_b = b.communicate(timeout=300)
    assert a.returncode == 0 and b.returncode == 0, (err_a, err_b)
    assert "waiting for" not in err_a + err_b
    assert time.monotonic() - started < 2 * 2 + 30  # the two pauses overlapped
    assert works(ws / ENV) and works(ws / ".envs" / "toolchain-b")


@pytest.mark.network
@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("point", ["overlay", "hooks", "swap"])
def test_a_rebuild_killed_at_any_stage_keeps_the_previous_env(
    tmp_path: Path, sig: int, point: str
) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    cudaenv("build", TOOLCHAIN, cwd=ws)
    before = (ws / ENV / "cudaenv.json").read_text()
    child = start(ws, "--force", CUDAENV_FAULT_PAUSE=point, CUDAENV_FAULT_PAUSE_SECONDS="60")
    assert child.stderr is not None
    for line in child.stderr:
        if f"fault point {point}" in line:
            break
    child.send_signal(sig)
    child.wait(timeout=60)
    assert works(ws / ENV)
    assert (ws / ENV / "cudaenv.json").read_text() == before
    if sig == signal.SIGTERM:
        assert child.returncode == 130
        assert no_leftovers(ws)
    done = cudaenv("build", TOOLCHAIN, "--force", cwd=ws)
    assert works(ws / ENV)
    assert no_leftovers(ws)
    if sig == signal.SIGKILL:
        assert "removed leftover" in done.stderr


@pytest.mark.network
@pytest.mark.e2e
def test_a_build_killed_during_verify_leaves_a_complete_env(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    child = start(ws, "--verify")
    assert child.stderr is not None
    for line in child.stderr:
        if line.startswith("cudaenv: probing"):
            break
    time.sleep(1.0)  # inside the kernel compile (~6 s)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    assert works(ws / ENV)
    assert no_leftovers(ws)
    done = cudaenv("build", TOOLCHAIN, "--verify", cwd=ws)
    assert "verify toolchain-cu130: PASSED" in done.stdout


@pytest.mark.network
@pytest.mark.e2e
def test_offline_build_from_a_wheelhouse(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    wheelhouse = tmp_path / "wheelhouse"
    cudaenv("export", TOOLCHAIN, "--wheelhouse", str(wheelhouse), cwd=ws)
    assert (wheelhouse / "cudaenv-export.json").exists()
    blocked = {
        "HTTP_PROXY": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "ALL_PROXY": "http://127.0.0.1:9",
        "UV_OFFLINE": "1",
        "PIP_NO_INDEX": "1",
        "UV_CACHE_DIR": str(tmp_path / "empty-cache"),
        "UV_PYTHON_DOWNLOADS": "never",
    }
    done = cudaenv(
        "build", TOOLCHAIN, "--offline", "--wheelhouse", str(wheelhouse), cwd=ws, env=blocked
    )
    assert works(ws / ENV), done.stderr
    # A tampered wheelhouse is refused before anything is built, naming the package.
    nvcc = next(wheelhouse.glob("nvidia_cuda_nvcc-*.whl"))
    nvcc.write_bytes(nvcc.read_bytes()[:-10])
    done = cudaenv(
        "build",
        TOOLCHAIN,
        "--force",
        "--offline",
        "--wheelhouse",
        str(wheelhouse),
        cwd=ws,
        env=blocked,
        check=False,
    )
    assert done.returncode == 4
    assert "no file with a locked hash for 1 package(s): nvidia-cuda-nvcc==13.0.88" in done.stderr
    assert works(ws / ENV)


@pytest.mark.network
@pytest.mark.e2e
def test_an_air_gapped_first_verify_reuses_the_exported_jit_results(tmp_path: Path) -> None:
    """flashinfer#1352 (first runs fail offline): the env's compiled kernel travels in the
    wheelhouse (export --with-jit), an offline build on a machine with an empty store adds it
    there, and the first verify reuses it instead of compiling."""
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    here = {"CUDAENV_JIT_STORE": str(tmp_path / "store-here")}
    cudaenv("build", TOOLCHAIN, "--verify", cwd=ws, env=here)
    wheelhouse = tmp_path / "wheelhouse"
    done = cudaenv(
        "export", TOOLCHAIN, "--wheelhouse", str(wheelhouse), "--with-jit", cwd=ws, env=here
    )
    assert "carried 1 JIT result(s)" in done.stderr, done.stderr
    there = {
        "CUDAENV_JIT_STORE": str(tmp_path / "store-there"),
        "UV_OFFLINE": "1",
        "PIP_NO_INDEX": "1",
        "UV_CACHE_DIR": str(tmp_path / "empty-cache"),
        "UV_PYTHON_DOWNLOADS": "never",
    }
    other = tmp_path / "offline-env"
    done = cudaenv("build", TOOLCHAIN, "--offline", "--wheelhouse", str(wheelhouse),
                   "--env-dir", str(other), "--verify", "--report", str(tmp_path / "r.json"),
                   cwd=ws, env=there)  # fmt: skip
    assert "1 JIT result(s) from" in done.stderr
    checks = {c["name"]: c for c in json.loads((tmp_path / "r.json").read_text())["checks"]}
    assert checks["kernel-compile"]["status"] == "passed"
    assert "reused from the store: 12.0f: first built " in checks["kernel-compile"]["summary"]
    # Without the results (an env never verified): refused, naming what to do.
    fresh = tmp_path / "never-verified"
    cudaenv("build", TOOLCHAIN, "--env-dir", str(fresh), cwd=ws, env=here)
    done = cudaenv("export", TOOLCHAIN, "--wheelhouse", str(tmp_path / "w2"), "--with-jit",
                   "--env-dir", str(fresh), cwd=ws, env=here, check=False)  # fmt: skip
    assert done.returncode == 4
    assert "has no JIT results in the store to carry: verify it first" in done.stderr


@pytest.mark.network
@pytest.mark.e2e
@pytest.mark.parametrize("point", ["swap", "swapped"])
def test_ctrl_c_says_which_env_is_there(tmp_path: Path, point: str) -> None:
    """Before the swap the previous env is there; after it, the new one, complete. Ctrl-C
    ends the build at once: the pause is ten minutes, the bound 30 s, so a build that waits
    the pause out (or finishes its work first) fails rather than winning a race."""
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    cudaenv("build", TOOLCHAIN, cwd=ws)
    child = start(ws, "--force", CUDAENV_FAULT_PAUSE=point, CUDAENV_FAULT_PAUSE_SECONDS="600")
    assert child.stderr is not None
    for line in child.stderr:
        if f"fault point {point}" in line:
            break
    child.send_signal(signal.SIGINT)
    try:
        _, rest = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 130
    env = (ws / ENV).absolute()
    says = {
        "swap": f"{env}: the previous env (if any) is untouched",
        "swapped": f"{env} is the new env, complete (built from pylock.toolchain-cu130.toml)",
    }[point]
    assert rest.strip().splitlines()[-1] == f"error: interrupted; {says}"
    assert works(ws / ENV)


def test_a_tests_child_starts_with_sigint_at_its_default() -> None:
    """What the Ctrl-C tests rely on, whoever started pytest: a child of a test does not
    inherit SIGINT ignored (a CI runner's background shell ignores it; conftest.py)."""
    done = subprocess.run(["sh", "-c", "grep SigIgn /proc/$$/status"], capture_output=True,
                          text=True, check=True, timeout=30)  # fmt: skip
    ignored = int(done.stdout.split()[-1], 16)
    assert not ignored & (1 << (signal.SIGINT - 1)), done.stdout


def test_shipped_specs_are_the_ones_tested() -> None:
    assert (ENVSPECS / "toolchain-cu130.yaml").exists()


# --------------------------------------------------------------------------- supply chain


@pytest.mark.network
@pytest.mark.e2e
def test_a_package_pinned_to_an_index_comes_only_from_it(tmp_path: Path) -> None:
    ws = workspace(tmp_path / "ws", "toolchain-cu130.yaml")
    url = local_index(tmp_path / "idx", "six", "1.16.0", "WHERE = 'the pinned index'\n")
    base = (ws / TOOLCHAIN).read_text()
    write(
        ws / "envspecs" / "pinned.yaml",
        base.replace("name: toolchain-cu130", "name: pinned")
        + f"packages: [six==1.16.0]\nindexes: {{six: {url}}}\n",
    )
    write(
        ws / "envspecs" / "open.yaml",
        base.replace("name: toolchain-cu130", "name: open") + "packages: [six==1.16.0]\n",
    )
    cudaenv("build", "envspecs/pinned.yaml", cwd=ws)
    cudaenv("build", "envspecs/open.yaml", cwd=ws)
    pinned_spec = spec.load(ws / "envspecs" / "pinned.yaml")
    pinned = next(
        p
        for p in lock.read(lock_of(ws / "envspecs" / "pinned.yaml"), spec=pinned_spec).packages
        if p.name == "six"
    )
    opened = next(
        p for p in lock.read(lock_of(ws / "envspecs" / "open.yaml")).packages if p.name == "six"
    )
    assert pinned.index == url
    assert pinned.wheels[0].url == f"{url}/six/six-1.16.0-py3-none-any.whl"
    # An index-neutral project (the workspace's, as this repository's) commits no index host.
    assert opened.index is None and opened.wheels[0].url is None
    assert opened.wheels[0].path == f"wheels/{opened.wheels[0].name}"
    assert pinned.hashes != opened.hashes  # the same name on the public index is another file
    code = "import six; print(getattr(six, 'WHERE', 'public six'))"
    got = subprocess.run(
        [ws / ".envs" / "pinned" / "bin" / "python", "-c", code],
        capture_output=True,
        text=True,
        check=True,
    )
    assert got.stdout.strip() == "the pinned index"
    got = subprocess.run(
        [ws / ".envs" / "open" / "bin" / "python", "-c", code],
        capture_output=True,
        text=True,
        check=True,
    )
    assert got.stdout.strip() == "public six"
    # A file swapped on the pinned index after locking is refused at install, naming it.
    local_index(tmp_path / "idx", "six", "1.16.0", "WHERE = 'swapped'\n")
    done = cudaenv("build", "envspecs/pinned.yaml", "--force", cwd=ws, check=False)
    assert done.returncode == 4, done.stderr
    assert "six" in done.stderr and "hash" in done.stderr.lower()


# --------------------------------------------------------------------------- a full disk, offline

# uv's words for a full disk (uv 0.13, copying from a cache on another filesystem).
UV_ENOSPC = (
    "error: Failed to install: nvidia_cuda_nvcc-13.0.88-py3-none-manylinux2014_x86_64."
    "manylinux_2_17_x86_64.whl (nvidia-cuda-nvcc==13.0.88)\n"
    "  cause: Failed to copy to `{site}/nvidia/cu13/bin/ptxas`\n"
    "  cause: failed to copy file from /cache/archive-v0/x/nvidia/cu13/bin/ptxas to "
    "{site}/nvidia/cu13/bin/.tmpNKR72p: No space left on device (os error 28)\n"
)
NVCC = "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n"
# What each package of the toolchain lock puts below site-packages in the stand-in.
STAND_IN_FILES = {
    "nvidia-cuda-nvcc": {"nvidia/cu13/bin/nvcc": NVCC, "nvidia/cu13/bin/ptxas": NVCC,
                         "nvidia/cu13/bin/nvcc.profile": "TOP = $(_HERE_)/..\n"},
    "nvidia-cuda-runtime": {"nvidia/cu13/include/cuda_runtime.h": "#pragma once\n",
                            "nvidia/cu13/lib/libcudart.so.13": "not an ELF file\n"},
}  # fmt: skip
FAKE_UV = """\
import base64, hashlib, json, os, sys, pathlib
conf = json.loads(pathlib.Path({conf!r}).read_text())
args = sys.argv[1:]
if args[:1] == ["venv"]:
    os.execv(conf["uv"], [conf["uv"], *args])
python = pathlib.Path(args[args.index("--python") + 1])
site = next(python.parent.parent.glob("lib/python3.*/site-packages"))
offline = "--offline" in args

def install(left_out):
    for name, version in conf["packages"]:
        files = dict(conf["files"].get(name, {{}}))
        info = name.replace("-", "_") + "-" + version + ".dist-info"
        files[info + "/METADATA"] = f"Metadata-Version: 2.1\\nName: {{name}}\\nVersion: {{version}}\\n"
        rows = []
        for rel, text in files.items():
            data = text.encode()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append(f"{{rel}},sha256={{digest.decode()}},{{len(data)}}")
            if rel in left_out:
                continue
            path = site / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            if "/bin/" in rel:
                path.chmod(0o755)
        (site / info / "RECORD").write_text("\\n".join([*rows, info + "/RECORD,,"]) + "\\n")

PTXAS = "nvidia/cu13/bin/ptxas"
if conf["mode"] == "complete" and offline:
    install(left_out=set())
elif conf["mode"] == "enospc" and offline:
    install(left_out={{PTXAS}})  # copied until the disk was full
    sys.exit(sys.stderr.write(conf["enospc"].format(site=site)) and 2)
elif conf["mode"] == "cache-miss" and offline:
    sys.exit("error: Network connectivity is disabled, but the requested data wasn't found")
elif conf["mode"] == "cache-miss":
    install(left_out={{PTXAS}})
else:  # online after a failed offline run: uv finds every package "installed" and exits 0
    sys.stderr.write("Audited 6 packages\\n")
"""


def stand_in_uv(tmp_path: Path, ws: Path, mode: str) -> dict[str, str]:
    """A uv that makes real venvs (the real uv) and installs the toolchain lock as a stand-in
    (an nvcc that prints its release), leaving out nvidia/cu13/bin/ptxas, which RECORD names:
    ``enospc``, the offline install fails as uv does on a full disk and the online one finds
    the packages installed (exit 0); ``cache-miss``, offline finds nothing in the cache and
    online "installs" without ptxas (exit 0)."""
    locked = lock.read(lock_of(ws / TOOLCHAIN)).packages
    conf = write(tmp_path / "uv.json", json.dumps({
        "uv": proc.uv_bin(), "mode": mode, "enospc": UV_ENOSPC, "files": STAND_IN_FILES,
        "packages": [(p.name, p.version) for p in locked],
    }))  # fmt: skip
    uv = write(tmp_path / "uv", f"#!{sys.executable}\n" + FAKE_UV.format(conf=str(conf)))
    uv.chmod(0o755)
    return {"CUDAENV_UV": str(uv), "CUDAENV_DRIVER_VERSION": "580.65"}


def good_env(ws: Path) -> Path:
    """An env dir standing for a working env that a failed rebuild must leave alone."""
    env = ws / ENV
    write(env / "bin" / "marker", "the previous env")
    return env


@pytest.mark.slow
def test_the_stand_in_builds_when_nothing_is_missing(tmp_path: Path) -> None:
    """The stand-in is complete enough that only the file it leaves out can fail a build."""
    ws = workspace(tmp_path / "ws", "toolchain-cu130.yaml")
    done = cudaenv("build", TOOLCHAIN, cwd=ws, env=stand_in_uv(tmp_path, ws, "complete"))
    assert "every file of 6 packages' RECORD in place" in done.stderr
    assert (ws / ENV / "cudaenv.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("force", [False, True], ids=["first", "force"])
def test_a_full_disk_never_exits_0_nor_replaces_the_env(tmp_path: Path, force: bool) -> None:
    """uv's offline install meets a full disk: that is said as such (not taken for a cache
    miss and retried online, where uv counts the half-copied packages as installed and exits
    0), exit 4, and the env there stays."""
    ws = workspace(tmp_path / "ws", "toolchain-cu130.yaml")
    env = good_env(ws)
    done = cudaenv("build", TOOLCHAIN, *(["--force"] if force else []), cwd=ws,
                   env=stand_in_uv(tmp_path, ws, "enospc"), check=False)  # fmt: skip
    assert done.returncode == 4, done.stderr
    assert "Traceback" not in done.stderr
    [line] = error_lines(done.stderr)
    assert line.startswith(f"error: no space left on device while building in {ws / '.envs'} ("), (
        line
    )
    site = next((ws / ".envs").glob(".toolchain-cu130.tmp-*/lib/python3.*/site-packages"), None)
    assert site is None  # the half-built tree is gone
    # uv's line naming the file it could not write (the full filesystem may be uv's cache's).
    assert (
        "; the env there now holds 0 MiB of files; uv: cause: failed to copy file from "
        "/cache/archive-v0/x/nvidia/cu13/bin/ptxas to "
    ) in line
    assert ": No space left on device (os error 28)); free space there or pass --env-dir" in line
    assert line.endswith("Nothing was replaced: the previous env, if any, is intact")
    assert (env / "bin" / "marker").read_text() == "the previous env"
    assert no_leftovers(ws)


@pytest.mark.slow
def test_an_install_missing_a_recorded_file_is_refused_before_the_swap(tmp_path: Path) -> None:
    """uv exits 0, yet a file nvcc's RECORD names is not there (ptxas, as a full disk left
    it): the build proves the install against RECORD and keeps the previous env."""
    ws = workspace(tmp_path / "ws", "toolchain-cu130.yaml")
    env = good_env(ws)
    done = cudaenv("build", TOOLCHAIN, "--force", cwd=ws,
                   env=stand_in_uv(tmp_path, ws, "cache-miss"), check=False)  # fmt: skip
    assert done.returncode == 4, done.stderr
    [line] = error_lines(done.stderr)
    assert line.startswith(
        "error: toolchain-cu130: the install is incomplete: 1 file(s) or package(s) are not as "
        "their RECORD says (nvidia_cuda_nvcc-13.0.88.dist-info: nvidia/cu13/bin/ptxas: missing); "
    ), line
    assert line.endswith("Nothing was replaced: the previous env, if any, is intact")
    assert (env / "bin" / "marker").read_text() == "the previous env"
    assert no_leftovers(ws)
