"""builder/core/proc.py, the one subprocess seam, driven with real tiny processes (as nox's tests
drive its command runner): timeouts, stderr echo, exit codes, missing tools, atomic writes
and the environment every uv call gets."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.core import proc
from builder.core.errors import CommandFailed, ToolMissing

PY = sys.executable
# Says something on both pipes, then outlives any timeout a test gives it.
TALK_THEN_SLEEP = (
    "import sys, time\n"
    "print('partial stdout', flush=True)\n"
    "sys.stderr.write('still working\\n'); sys.stderr.flush()\n"
    "time.sleep(30)\n"
)


def forks_a_grandchild(pid_file: Path, *, then_sleep: bool) -> str:
    """A child that starts a grandchild holding its stdout and stderr open for 30 s (as a build
    backend or a daemonised server might), records the grandchild's pid, and then exits at
    once or sleeps too."""
    return (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(g.pid))\n"
        "sys.stderr.write('forked\\n'); sys.stderr.flush()\n"
        + ("time.sleep(30)\n" if then_sleep else "")
    )


@pytest.fixture
def pid_file(tmp_path: Path) -> Iterator[Path]:
    """Where a child writes its grandchild's pid; the grandchild is killed after the test."""
    path = tmp_path / "grandchild.pid"
    yield path
    if path.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(path.read_text()), signal.SIGKILL)


def timed_out_run(argv: list[str], *, stream: bool, timeout: float) -> tuple[CommandFailed, float]:
    start = time.monotonic()
    with pytest.raises(CommandFailed) as info:
        proc.run(argv, stream=stream, timeout=timeout)
    return info.value, time.monotonic() - start


# --------------------------------------------------------------------------- timeouts


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "captured"])
def test_timeout_kills_a_child_that_keeps_stderr_open(stream: bool) -> None:
    # Before the fix the streaming path read stderr to its end before waiting, so timeout=1
    # returned only when the child closed stderr (5.1 s for a 5 s child; here it would be 30 s).
    err, took = timed_out_run([PY, "-c", TALK_THEN_SLEEP], stream=stream, timeout=1)
    assert took < 3, f"timeout=1 returned after {took:.1f} s"
    assert err.timed_out == 1
    assert err.returncode == -1
    assert str(err).startswith("command timed out after 1 s: ")
    # The error is all a user sees of a hung uv: its last words must be in it.
    assert "partial stdout" in err.output
    assert "still working" in err.output
    assert str(err).endswith("still working")


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "captured"])
@pytest.mark.parametrize("then_sleep", [True, False], ids=["child-sleeps", "child-exits"])
def test_timeout_holds_when_a_grandchild_keeps_the_pipes_open(
    pid_file: Path, stream: bool, then_sleep: bool
) -> None:
    # The pipes reach EOF only when the grandchild exits (30 s): the deadline must not wait
    # for that, whether the child itself is still running or already gone.
    code = forks_a_grandchild(pid_file, then_sleep=then_sleep)
    err, took = timed_out_run([PY, "-c", code], stream=stream, timeout=1)
    assert took < 3, f"timeout=1 returned after {took:.1f} s"
    assert err.timed_out == 1
    assert pid_file.exists(), "the grandchild was never started"


def test_a_fast_command_is_not_timed_out() -> None:
    for stream in (True, False):
        done = proc.run([PY, "-c", "print('ok')"], stream=stream, timeout=30)
        assert (done.returncode, done.stdout) == (0, "ok\n")


# --------------------------------------------------------------------------- output


def test_streamed_stderr_is_echoed_and_kept(capsys: pytest.CaptureFixture[str]) -> None:
    code = "import sys; print('the answer'); sys.stderr.write('progress 1\\nprogress 2\\n')"
    done = proc.run([PY, "-c", code], stream=True)
    echoed = capsys.readouterr()
    assert echoed.err == "progress 1\nprogress 2\n"
    assert echoed.out == ""  # stdout is captured, never echoed
    assert done.stdout == "the answer\n"
    assert done.stderr == "progress 1\nprogress 2\n"
    assert done.argv == (PY, "-c", code)


def test_captured_stderr_is_not_echoed(capfd: pytest.CaptureFixture[str]) -> None:
    done = proc.run([PY, "-c", "import sys; sys.stderr.write('quiet\\n')"])
    assert capfd.readouterr().err == ""
    assert done.stderr == "quiet\n"


def test_input_text_reaches_the_child() -> None:
    done = proc.run([PY, "-c", "import sys; print(sys.stdin.read().upper())"], input_text="hi")
    assert done.stdout == "HI\n"


# --------------------------------------------------------------------------- exit codes


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "captured"])
def test_check_false_returns_the_exit_code(stream: bool) -> None:
    code = "import sys; print('out'); sys.stderr.write('err\\n'); sys.exit(3)"
    done = proc.run([PY, "-c", code], check=False, stream=stream)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "captured"])
def test_a_failed_command_raises_with_its_output(stream: bool) -> None:
    code = "import sys; print('out'); sys.stderr.write('it broke\\n'); sys.exit(3)"
    with pytest.raises(CommandFailed) as info:
        proc.run([PY, "-c", code], stream=stream)
    err = info.value
    assert (err.returncode, err.timed_out) == (3, None)
    assert err.argv == [PY, "-c", code]
    assert str(err).startswith("command failed (exit 3): ")
    assert str(err).endswith("out\n\nit broke")


def test_env_and_cwd_reach_the_child(tmp_path: Path) -> None:
    code = "import os; print(os.getcwd(), os.environ['CUDAENV_TEST_VALUE'])"
    for stream in (True, False):
        done = proc.run(
            [PY, "-c", code], env={"CUDAENV_TEST_VALUE": "x y"}, cwd=tmp_path, stream=stream
        )
        assert done.stdout == f"{tmp_path} x y\n"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "captured"])
@pytest.mark.parametrize("tool", ["/nonexistent/bin/cudaenv-no-such-tool", "cudaenv-no-such-tool"])
def test_a_missing_executable_is_tool_missing(stream: bool, tool: str) -> None:
    message = f"{tool}: not found (No such file or directory)"
    with pytest.raises(ToolMissing, match=f"^{re.escape(message)}$") as info:
        proc.run([tool, "--version"], stream=stream)
    assert info.value.tool == tool


# --------------------------------------------------------------------------- atomic_write_text


def test_atomic_write_creates_the_parent_and_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "report.json"
    assert proc.atomic_write_text(target, "new\n") == target
    assert target.read_text() == "new\n"
    assert list(target.parent.iterdir()) == [target]


def test_atomic_write_replaces_an_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "lock.toml"
    target.write_text("old, and longer than the new text\n")
    proc.atomic_write_text(target, "new\n")
    assert target.read_text() == "new\n"
    assert list(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_atomic_write_mode_honours_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    old = os.umask(umask)
    try:
        proc.atomic_write_text(tmp_path / "f", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == mode


def test_a_failure_mid_write_leaves_the_old_content(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_text("old\n")
    # A lone surrogate cannot be encoded: the write fails after the temp file exists.
    with pytest.raises(UnicodeEncodeError):
        proc.atomic_write_text(target, "half written \udcff")
    assert target.read_text() == "old\n"
    assert list(tmp_path.iterdir()) == [target]


def test_a_failed_fsync_leaves_the_old_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "report.json"
    target.write_text("old\n")

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        proc.atomic_write_text(target, "new\n")
    assert target.read_text() == "old\n"
    assert list(tmp_path.iterdir()) == [target]


# --------------------------------------------------------------------------- uv_env


def test_uv_env_sets_offline_safe_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UV_PYTHON_DOWNLOADS", raising=False)
    monkeypatch.delenv("UV_LINK_MODE", raising=False)
    monkeypatch.setenv("CUDAENV_TEST_VALUE", "kept")
    env = proc.uv_env()
    assert env["UV_PYTHON_DOWNLOADS"] == "never"
    assert env["UV_LINK_MODE"] == "hardlink"
    assert env["CUDAENV_TEST_VALUE"] == "kept"
    assert "UV_LINK_MODE" not in os.environ  # a copy: our own environment is untouched


def test_uv_env_keeps_the_users_own_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UV_PYTHON_DOWNLOADS", "automatic")
    monkeypatch.setenv("UV_LINK_MODE", "copy")
    env = proc.uv_env()
    assert (env["UV_PYTHON_DOWNLOADS"], env["UV_LINK_MODE"]) == ("automatic", "copy")


def test_a_program_another_user_could_have_written_is_never_run(tmp_path: Path) -> None:
    """Root's PATH with a shared directory first (as /tmp, writable by all): a planted
    `ssh-keygen` there is skipped for the real one, and run nowhere when it is the only one,
    with one line naming it. A directory of the user's own is used as before."""
    planted = tmp_path / "shared"
    planted.mkdir()
    marker = tmp_path / "ran"
    tool = planted / "cudaenv-test-tool"
    tool.write_text(f"#!/bin/sh\ntouch {marker}\n")
    tool.chmod(0o755)
    planted.chmod(0o777)
    path = f"{planted}:/usr/bin:/bin"
    assert proc.which("sh", path) in ("/usr/bin/sh", "/bin/sh")  # past the shared directory
    assert proc.which("cudaenv-test-tool", path) is None
    with pytest.raises(ToolMissing, match=r"only .*cudaenv-test-tool is on PATH, and .* can be "
                       r"written by other users: cudaenv runs no program another user"):  # fmt: skip
        proc.run(["cudaenv-test-tool"], env={"PATH": path})
    assert not marker.exists()
    # The file itself writable by others, in a directory of ours: skipped too.
    planted.chmod(0o755)
    tool.chmod(0o777)
    assert proc.which("cudaenv-test-tool", path) is None
    tool.chmod(0o755)
    assert proc.which("cudaenv-test-tool", path) == str(tool)
    proc.run(["cudaenv-test-tool"], env={"PATH": path})
    assert marker.exists()


def test_running_waits_for_its_child_after_the_body_and_says_a_failure() -> None:
    """A child run beside the caller's own work: its exit is checked after the body, its
    output (merged) comes with the failure."""
    order: list[str] = []
    with proc.running([PY, "-c", "import time; time.sleep(0.3)"], timeout=30):
        order.append("body")
    order.append("after")
    assert order == ["body", "after"]
    argv = [PY, "-c", "import sys; print('out'); sys.exit('boom')"]
    with pytest.raises(CommandFailed) as caught, proc.running(argv, timeout=30):
        pass
    assert caught.value.returncode == 1 and "out" in caught.value.output
    assert "boom" in caught.value.output


@pytest.mark.slow
def test_running_kills_its_child_past_the_deadline_and_when_the_body_raises(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    with pytest.raises(CommandFailed) as caught, proc.running([PY, "-c", TALK_THEN_SLEEP],
                                                             timeout=1):  # fmt: skip
        pass
    assert caught.value.timed_out == 1 and time.monotonic() - started < 10
    pid_file = tmp_path / "pid"
    body = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(30)"
    with pytest.raises(RuntimeError), proc.running([PY, "-c", body], timeout=60):
        deadline = time.monotonic() + 10
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("the body failed")
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped: no such process
        os.kill(pid, 0)


@pytest.mark.slow
def test_run_lines_keeps_its_deadline_when_a_grandchild_leaves_the_group() -> None:
    """A child starts a grandchild in a session of its own that holds stdout for 45 s, then
    hangs: the deadline (3 s) ends the call, though killing the child's group does not reach
    the grandchild and the pipe stays open."""
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen(['sleep', '45'], start_new_session=True)\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    seen: list[str] = []
    started = time.monotonic()
    with pytest.raises(CommandFailed, match="timed out after 3 s"):
        proc.run_lines([sys.executable, "-c", code], seen.append, timeout=3, merged=True)
    assert time.monotonic() - started < 10
    assert seen == ["started"]


@pytest.mark.slow
def test_run_lines_returns_when_the_child_ends_and_a_grandchild_keeps_its_output() -> None:
    """The child ends at once, its daemon (another session) holds stdout for 45 s: the call
    returns the child's result within seconds, not when the daemon lets go."""
    code = (
        "import subprocess\n"
        "subprocess.Popen(['sleep', '45'], start_new_session=True)\n"
        "print('done', flush=True)\n"
    )
    seen: list[str] = []
    started = time.monotonic()
    done = proc.run_lines([sys.executable, "-c", code], seen.append, timeout=60, merged=True)
    assert done.returncode == 0 and seen == ["done"]
    assert time.monotonic() - started < 15


def test_uv_runs_from_the_root_with_relative_paths_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uv reads uv.toml and pyproject.toml from its working directory and every one above it:
    every uv cudaenv starts runs from /, and a relative path it was given still names the
    same file; a bare name stays a requirement."""
    uv = tmp_path / "bin" / "uv"
    uv.parent.mkdir()
    uv.write_text('#!/bin/sh\npwd\nfor a in "$@"; do echo "$a"; done\n')
    uv.chmod(0o755)
    (tmp_path / "reqs").mkdir()
    (tmp_path / "reqs" / "r.txt").write_text("six\n")
    (tmp_path / "six").write_text("a file named like a package\n")
    monkeypatch.chdir(tmp_path)
    done = proc.run([str(uv), "pip", "install", "-r", "reqs/r.txt", "--target=./reqs", "six"])
    assert done.stdout.splitlines() == [
        "/", "pip", "install", "-r", str(tmp_path / "reqs" / "r.txt"),
        f"--target={tmp_path / 'reqs'}", "six",
    ]  # fmt: skip


@pytest.mark.network
def test_a_fifo_uv_toml_in_the_project_neither_hangs_nor_steers_a_lock(tmp_path: Path) -> None:
    """A FIFO uv.toml (or one another user planted) where cudaenv runs: uv never reads it."""
    import subprocess

    from tests.helpers import cudaenv, workspace

    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    os.mkfifo(ws / "uv.toml")
    try:
        done = cudaenv("lock", "envspecs/toolchain-cu130.yaml", cwd=ws, check=False, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("cudaenv lock waited on the FIFO")
    assert done.returncode == 0, done.stderr


def test_a_uv_found_on_path_runs_from_the_root_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDAENV_UV=uv names it without a directory: found on PATH, it runs from / as well."""
    uv = tmp_path / "bin" / "uv"
    uv.parent.mkdir()
    uv.write_text("#!/bin/sh\npwd\n")
    uv.chmod(0o755)
    monkeypatch.setenv("PATH", f"{uv.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    assert proc.run(["uv", "pip", "list"]).stdout.strip() == "/"
