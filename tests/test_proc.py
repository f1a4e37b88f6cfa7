"""builder/core/proc.py, the one subprocess seam, driven with real tiny processes (as nox's tests
drive its command runner): timeouts, stderr echo, exit codes, missing tools, atomic writes
and the environment every uv call gets."""

from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from builder.core import descendants, proc
from builder.core.errors import CommandFailed, ToolMissing
from tests.helpers import REPO

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


# --------------------------------------------------------------------------- descendants


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped yet."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return raw[raw.rindex(b")") + 2 :][:1] in (b"Z", b"X")


def _family(marks: Path) -> str:
    """A child that records whether it leads a session of its own, starts one grandchild in
    its group, one that leaves it (``setsid``, as a daemonising build step does) and one in a
    group of its own whose parent exits at once, records the three pids, then hangs."""
    return (
        "import os, subprocess, sys, time\n"
        f"marks = {str(marks)!r}\n"
        "same = subprocess.Popen(['sleep', '60'])\n"
        "away = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        # A command as ninja starts one (a process group of its own, in the session), left
        # an orphan by its parent's exit: only the session still names it.
        "sh = subprocess.run(['sh', '-c', 'sleep 60 >/dev/null 2>&1 & echo $!'],\n"
        "                    process_group=0, capture_output=True, text=True)\n"
        "orphan = int(sh.stdout)\n"
        "open(marks, 'w').write(\n"
        "    f'{int(os.getsid(0) == os.getpid())} {same.pid} {away.pid} {orphan}')\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )


def _each_runner(tmp_path: Path) -> dict[str, Callable[[list[str]], object]]:
    """Every way proc starts a child, each named by the function of proc.py that calls
    ``_start`` for it, run with a 2 s deadline."""

    def running(argv: list[str]) -> None:
        with proc.running(argv, timeout=2):
            pass

    return {
        "run": lambda argv: proc.run(argv, timeout=2),
        "_run_streaming": lambda argv: proc.run(argv, stream=True, timeout=2),
        "_run_logged": lambda argv: proc.run(argv, timeout=2, log_file=tmp_path / "log"),
        "running": running,
        "run_lines": lambda argv: proc.run_lines(argv, lambda _: None, timeout=2),
        "run_lines merged": lambda argv: proc.run_lines(
            argv, lambda _: None, timeout=2, merged=True
        ),
    }


def test_every_function_that_starts_a_child_is_in_the_runner_table(tmp_path: Path) -> None:
    """The callers of ``_start`` are read from proc.py itself: a way of starting a child added
    later is in the deadline test below or this fails."""
    tree = ast.parse(Path(proc.__file__).read_text())
    callers = {
        fn.name
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef)
        and any(
            isinstance(call, ast.Call) and getattr(call.func, "id", None) == "_start"
            for call in ast.walk(fn)
        )
    }
    assert callers == {name.split()[0] for name in _each_runner(tmp_path)}


def test_only_proc_starts_a_child_in_cudaenvs_own_process() -> None:
    """Outside proc.py, nothing of cudaenv's own process calls subprocess or os to start a
    program (builder/probe and builder/store run in the env's interpreter, standard library
    only, as children that proc started and ends). The one other child is core/forked.py's
    fork of cudaenv itself, which runs no program and is killed and reaped there."""
    starts = {"Popen", "run", "call", "check_call", "check_output", "getoutput", "system",
              "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "spawnv", "spawnl",
              "spawnve", "spawnvp", "execv", "execve", "execvp"}  # fmt: skip
    found = []
    for path in sorted((REPO / "builder").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(("builder/probe/", "builder/store/")) or rel == "builder/core/proc.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(node, ast.Call)
                and isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id in {"subprocess", "os"}
                and func.attr in starts
            ):
                found.append(f"{rel}:{node.lineno}: {func.value.id}.{func.attr}")
    assert [f for f in found if not f.startswith("builder/core/forked.py:")] == []
    assert len(found) == 1, found


@pytest.mark.slow
@pytest.mark.parametrize(
    "runner",
    ["run", "_run_streaming", "_run_logged", "running", "run_lines", "run_lines merged"],
)
def test_a_deadline_ends_every_descendant(runner: str, tmp_path: Path) -> None:
    """Each way of starting a child: the child leads a session of its own, and past the
    deadline it, the grandchild in its group and the one that left it are all gone when the
    call returns, within seconds."""
    marks = tmp_path / "marks"
    started = time.monotonic()
    with pytest.raises(CommandFailed, match="timed out after 2 s"):
        _each_runner(tmp_path)[runner]([PY, "-c", _family(marks)])
    assert time.monotonic() - started < 2 + descendants.GRACE + 3
    own_session, same, away, orphan = (int(x) for x in marks.read_text().split())
    try:
        assert own_session == 1
        assert _gone(same) and _gone(away) and _gone(orphan), (same, away, orphan)
    finally:
        for pid in (same, away, orphan):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_an_interrupt_ends_a_child_a_worker_thread_waits_for(tmp_path: Path) -> None:
    """At an interrupt the CLI ends every child still running (descendants.end_all): a child
    started from a worker thread, whose wait no signal reaches now that the child has its own
    session, ends with its descendants and the thread's call returns."""
    marks = tmp_path / "marks"
    failures: list[BaseException] = []

    def worker() -> None:
        try:
            proc.run([PY, "-c", _family(marks)], timeout=120)
        except CommandFailed as exc:
            failures.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    deadline = time.monotonic() + 30
    while not (marks.exists() and len(marks.read_text().split()) == 4):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _, same, away, _orphan = (int(x) for x in marks.read_text().split())
    try:
        assert descendants.end_all() == 1
        thread.join(timeout=10)
        assert not thread.is_alive() and len(failures) == 1
        assert _gone(same) and _gone(away)
    finally:
        for pid in (same, away):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_a_sigterm_while_the_command_starts_is_said_as_an_interrupt(tmp_path: Path) -> None:
    """SIGTERM sent the moment the command catches it, during its imports (the entry point
    holds it before they run): one ``error: interrupted`` line and exit 130, not 143 in
    silence."""
    child = subprocess.Popen(
        [PY, "-m", "builder.cli", "list"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    status = Path(f"/proc/{child.pid}/status")
    deadline = time.monotonic() + 30
    while True:
        caught = next(
            (int(line.split()[1], 16) for line in status.read_text().splitlines()
             if line.startswith("SigCgt:")), 0,
        )  # fmt: skip
        if caught & (1 << (signal.SIGTERM - 1)):
            break
        assert time.monotonic() < deadline
        time.sleep(0.002)
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 130, (out, err)
    assert err.splitlines()[-1].startswith("error: interrupted"), err


@pytest.mark.slow
def test_ctrl_c_ends_the_children_a_thread_pool_waits_on_before_it_joins(tmp_path: Path) -> None:
    """A command's main (reporter.run_main) whose body waits in a thread pool on a worker that
    waits on a child (a matrix cell, a lock's platforms): Ctrl-C ends the child and what it
    started first, so the pool's exit, which joins its threads before any handler further out
    runs, returns at once and the main says it was interrupted (130)."""
    from concurrent.futures import ThreadPoolExecutor

    from builder.core import reporter

    marks = tmp_path / "marks"

    def body() -> int:
        with ThreadPoolExecutor(max_workers=1) as pool:
            running = pool.submit(proc.run, [PY, "-c", _family(marks)], timeout=120)
            while not (marks.exists() and len(marks.read_text().split()) == 4):
                time.sleep(0.05)
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            running.result()
        return 0

    started = time.monotonic()
    code = reporter.run_main(body, reporter.silent())
    assert code == 130 and time.monotonic() - started < 30
    _, same, away, orphan = (int(x) for x in marks.read_text().split())
    assert _gone(same) and _gone(away) and _gone(orphan)
    assert signal.getsignal(signal.SIGINT) is not reporter._on_interrupt  # given back


def test_children_started_while_yielding_run_nicer_and_so_do_theirs(tmp_path: Path) -> None:
    """What verify runs beside FlashInfer's JIT yields the CPU to it: the child and what it
    starts run ``step`` nicer; outside the block, and in another thread, nothing changes."""
    code = (
        "import os, subprocess, sys, time; time.sleep(0.3); "
        "inner = subprocess.run([sys.executable, '-c', 'import os; print(os.nice(0))'], "
        "capture_output=True, text=True).stdout.strip(); print(os.nice(0), inner)"
    )
    base = os.nice(0)
    with proc.yielding(5):
        done = proc.run([sys.executable, "-c", code])
        other: list[str] = []
        t = threading.Thread(
            target=lambda: other.append(proc.run([sys.executable, "-c", code]).stdout)
        )
        t.start()
        t.join()
    assert done.stdout.split() == [str(base + 5), str(base + 5)]
    assert other[0].split() == [str(base), str(base)]
    assert proc.run([sys.executable, "-c", code]).stdout.split() == [str(base), str(base)]
