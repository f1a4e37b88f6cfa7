"""The one place a subprocess is started.

Every command is logged, its output captured, and replayed only on failure (as pypa/build
does). Tests replace :func:`run` or drive it with real tiny processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

from builder.core import descendants, settings
from builder.core.errors import CommandFailed, CudaenvError, ToolMissing
from builder.core.owners import planted_why, refused

__all__ = [
    "CommandFailed",
    "Completed",
    "atomic_write_text",
    "replace_process",
    "run",
    "running",
    "uv_bin",
    "uv_env",
    "which",
]

log = logging.getLogger("cudaenv")


def _prctl() -> object | None:
    """libc's ``prctl``, looked up once in cudaenv's own process: looking it up in each child
    (``ctypes.util.find_library`` runs ``ldconfig -p``) cost ~5 ms per command."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl() if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """PR_SET_PDEATHSIG: if cudaenv is SIGKILLed, its uv/nvcc children die with it instead of
    writing on into a build directory the next build is removing.

    The signal comes when the *thread* that started the child ends, not only the process: a
    child started from a worker thread (a lock's platforms, resolve.each_platform; a matrix
    cell; the warm's modules) must be waited for before that thread returns, as each of
    those does. Python calls a preexec_fn unsafe where threads run (a lock another thread
    held at the fork stays held in the child); this one only calls prctl through a function
    looked up before any fork, and imports and locks nothing."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL, 0, 0, 0)  # type: ignore[operator]  # 1 = PR_SET_PDEATHSIG


_PREEXEC = _die_with_parent if _PRCTL is not None else None


@dataclass(frozen=True, kw_only=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    check: bool = True,
    timeout: float | None = None,
    stream: bool = False,
    input_text: str | None = None,
    log_file: Path | None = None,
) -> Completed:
    """Run ``argv`` (never through a shell).

    ``stream`` passes the child's stderr through to ours (used for uv's progress), stdout is
    always captured. ``log_file`` sends stdout and stderr, merged, to that file as they come
    (a matrix cell's log, readable while it runs); the result then holds no output.
    ``check`` raises :class:`CommandFailed` with the output tail.
    """
    args = [os.fspath(a) for a in argv]
    log.debug("$ %s", shlex.join(args))
    if stream:
        return _run_streaming(args, env=env, cwd=cwd, check=check, timeout=timeout)
    if log_file is not None:
        return _run_logged(args, env=env, cwd=cwd, check=check, timeout=timeout, log_file=log_file)
    child = _start(
        args,
        env=env,
        cwd=cwd,
        stdin=subprocess.PIPE if input_text is not None else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = child.communicate(input_text, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        # Not communicate() again: a grandchild holding the pipes would keep it waiting for
        # EOF past the deadline. The output so far is on the exception, as bytes even in text
        # mode (CPython's _communicate), as subprocess.run does.
        descendants.end(child)
        out, err = (
            b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            for b in (exc.stdout, exc.stderr)
        )
        raise _timed_out(args, timeout, f"{out}\n{err}") from exc
    except BaseException:
        descendants.end(child)
        raise
    return _completed(args, child.returncode, out, err, check=check)


@contextlib.contextmanager
def running(
    argv: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float,
) -> Iterator[None]:
    """Run ``argv`` while the body of the ``with`` runs here, then wait for it: CommandFailed
    as :func:`run`'s check, or once ``timeout`` seconds from its start have passed (it is
    killed). A body that raises kills it first. Its stdout and stderr, merged, go to an
    unnamed file, never a pipe: a child writing more than a pipe holds would wait for a body
    that is not reading."""
    args = [os.fspath(a) for a in argv]
    log.debug("$ %s", shlex.join(args))
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryFile("w+", errors="replace") as out:
        child = _start(
            args, env=env, cwd=None, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            yield
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as exc:
            descendants.end(child)
            out.seek(0)
            raise _timed_out(args, timeout, out.read()[-4000:]) from exc
        except BaseException:
            descendants.end(child)
            raise
        if child.returncode != 0:
            out.seek(0)
            raise CommandFailed(args, child.returncode, out.read()[-4000:])


def _start(
    args: list[str],
    *,
    env: Mapping[str, str] | None,
    cwd: Path | None,
    stdin: int | IO[Any] | None,
    stdout: int | IO[Any],
    stderr: int | IO[Any],
) -> subprocess.Popen[str]:
    """The one place a child starts: text mode, die-with-parent, a missing program named, and
    a program named without a directory found only where no other user could have put it
    (:func:`which`), one named by its path only where no other user could have written it
    (owners.refused), and uv from ``/`` (:func:`_uv_cwd`)."""
    if args and os.sep in args[0]:
        refusal = refused(args[0])
        if refusal is not None:
            raise refusal
    elif args:
        path = (env if env is not None else settings.child_environ()).get("PATH")
        found = which(args[0], path)
        if found is None:
            planted = _untrusted_on_path(args[0], path)
            if planted is not None:
                raise ToolMissing(
                    f"{args[0]}: only {planted} is on PATH, and {planted_why(planted)}: "
                    "cudaenv runs no program another user could have written",
                    tool=args[0],
                )
        else:
            args = [found, *args[1:]]
    if args and cwd is None and _is_uv(args[0]):
        # Named by its path or found on PATH (CUDAENV_UV=uv): every uv runs from /.
        cwd, args = _uv_cwd(args)
    try:
        child = subprocess.Popen(
            args,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            text=True,
            errors="replace",
            preexec_fn=_PREEXEC,  # prctl alone, safe beside other threads: see _die_with_parent
            # A session of its own: a terminal's Ctrl-C reaches cudaenv, which ends the
            # child's whole tree and waits for it (descendants.end); nothing the child started
            # runs on unseen, and a child cannot read a prompt from the terminal.
            start_new_session=True,
        )
    except FileNotFoundError as exc:
        raise ToolMissing(f"{args[0]}: not found ({exc.strerror})", tool=args[0]) from exc
    step = getattr(_yielding, "step", 0)
    if step:
        # Set from here, not in the child (a preexec_fn beside threads is unsafe): the child
        # runs its first instructions at cudaenv's priority, and all it starts at the lower.
        with contextlib.suppress(OSError):  # it may have exited already
            os.setpriority(os.PRIO_PROCESS, child.pid, os.getpriority(os.PRIO_PROCESS, 0) + step)
    return descendants.track(child)


# What this thread's children yield to the others' (a niceness step; 0: none).
_yielding = threading.local()


@contextlib.contextmanager
def yielding(step: int = 10) -> Iterator[None]:
    """The children this thread starts in the block run ``step`` nicer than cudaenv (and so
    does all they start): work beside a longer job that decides when a run ends (verify's
    imports beside FlashInfer's JIT) fills the cores that job leaves, and does not slow it."""
    before = getattr(_yielding, "step", 0)
    _yielding.step = step
    try:
        yield
    finally:
        _yielding.step = before


def _is_uv(program: str) -> bool:
    return Path(program).name == "uv" or program == settings.current().uv


def _uv_cwd(args: list[str]) -> tuple[Path, list[str]]:
    """Where uv runs, and its arguments: from ``/``, each relative path that names something
    here made absolute. uv reads a ``uv.toml`` and a ``pyproject.toml`` ``[tool.uv]`` from its
    working directory and every directory above it (its settings: the index it resolves
    against among them); a project's, or one planted in a shared parent such as ``/tmp``, would
    choose for cudaenv, and a FIFO there hangs it. ``/`` is root's: nothing above it, and its
    files are the system's. cudaenv's settings reach uv as arguments and variables; the
    user's own uv.toml (``~/.config/uv``) and the system's (``/etc/uv``) still apply."""
    out = [args[0]]
    for arg in args[1:]:
        if arg.startswith("--") and "=" in arg:
            flag, _, value = arg.partition("=")
            out.append(f"{flag}={_absolute(value)}")
        else:
            out.append(arg if arg.startswith("-") else _absolute(arg))
    return Path("/"), out


def _absolute(value: str) -> str:
    """``value`` made absolute where it is a relative path (it has a ``/`` or starts with
    ``.``) to something here; a bare name (``six``) is a requirement to uv, never a path."""
    path = Path(value)
    if ("/" in value or value.startswith(".")) and not path.is_absolute() and path.exists():
        return str(path.absolute())
    return value


def _timed_out(args: list[str], timeout: float | None, output: str) -> CommandFailed:
    return CommandFailed(args, -1, output, timed_out=timeout)


def _completed(
    args: list[str], returncode: int, stdout: str, stderr: str, *, check: bool
) -> Completed:
    """The result; with ``check``, CommandFailed for a non-zero exit, with the output."""
    if check and returncode != 0:
        raise CommandFailed(args, returncode, stdout + "\n" + stderr)
    return Completed(argv=tuple(args), returncode=returncode, stdout=stdout, stderr=stderr)


def _run_logged(
    args: list[str],
    *,
    env: Mapping[str, str] | None,
    cwd: Path | None,
    check: bool,
    timeout: float | None,
    log_file: Path,
) -> Completed:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("w") as fh:
        child = _start(
            args, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT
        )
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            descendants.end(child)
            raise _timed_out(args, timeout, f"see {log_file}") from exc
        except BaseException:
            descendants.end(child)
            raise
    if check and child.returncode != 0:
        tail = log_file.read_text(errors="replace")[-4000:]
        raise CommandFailed(args, child.returncode, tail)
    return Completed(argv=tuple(args), returncode=child.returncode, stdout="", stderr="")


def _run_streaming(
    args: list[str],
    *,
    env: Mapping[str, str] | None,
    cwd: Path | None,
    check: bool,
    timeout: float | None,
) -> Completed:
    """Echo the child's stderr live (uv's progress) and keep it for the error message.

    The timeout is a deadline on the whole run, enforced while the child still holds its
    pipes open: both pipes are read by threads and the main thread only waits, so a child
    that keeps stderr open past the deadline is killed there (not when it closes the pipe).
    """
    child = _start(
        args, env=env, cwd=cwd, stdin=None, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    err_lines: list[str] = []
    out_parts: list[str] = []
    assert child.stderr is not None and child.stdout is not None
    out_pipe, err_pipe = child.stdout, child.stderr

    def pump_out() -> None:
        out_parts.append(out_pipe.read())

    def pump_err() -> None:
        for line in err_pipe:
            err_lines.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    readers = [threading.Thread(target=f, daemon=True) for f in (pump_out, pump_err)]
    for reader in readers:
        reader.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        child.wait(timeout=None if deadline is None else max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired as exc:
        descendants.end(child)
        _join(readers, until=time.monotonic() + 1)
        raise _timed_out(args, timeout, "".join(out_parts) + "\n" + "".join(err_lines)) from exc
    except BaseException:
        descendants.end(child)
        raise
    # The child is gone; a grandchild that inherited the pipes may hold them a little longer:
    # 5 s, or up to the deadline, past which the run timed out (as subprocess.run's would).
    _join(readers, until=time.monotonic() + 5 if deadline is None else deadline)
    if deadline is not None and any(reader.is_alive() for reader in readers):
        descendants.end(child)  # what it left holding the pipes
        raise _timed_out(args, timeout, "".join(out_parts) + "\n" + "".join(err_lines))
    return _completed(args, child.returncode, "".join(out_parts), "".join(err_lines), check=check)


def run_lines(
    argv: Sequence[str | os.PathLike[str]],
    on_line: Callable[[str], None],
    *,
    env: Mapping[str, str] | None = None,
    input_text: str = "",
    timeout: float,
    merged: bool = False,
    cwd: Path | None = None,
) -> Completed:
    """Run ``argv``, handing each line of its stdout to ``on_line`` as it comes (a probe's
    progress events); stderr is kept for the result. Never raises for a non-zero exit: the
    caller reads the lines. The timeout is a deadline on the whole run: past it the child
    is killed and CommandFailed says so. ``merged`` (a build's log): stderr comes in the
    lines too."""
    args = [os.fspath(a) for a in argv]
    log.debug("$ %s", shlex.join(args))
    child = _start(
        args,
        env=env,
        cwd=cwd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
    )
    assert child.stdin is not None and child.stdout is not None
    out_pipe: IO[str] = child.stdout
    err_parts: list[str] = []
    threads: list[threading.Thread] = []
    if child.stderr is not None:
        err_pipe = child.stderr
        threads.append(threading.Thread(target=lambda: err_parts.append(err_pipe.read())))
        threads[0].daemon = True
        threads[0].start()

    # The lines are read in a thread and the wait is on the child, against the deadline: a
    # grandchild that left the process group (its own session, a daemon) and holds stdout
    # would keep a read here waiting for EOF long past it.
    lines = _Lines(out_pipe, on_line)
    deadline = time.monotonic() + timeout
    expired = False
    try:
        with contextlib.suppress(BrokenPipeError):
            child.stdin.write(input_text)
            child.stdin.close()
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            expired = True
            descendants.end(child)
        # The child is gone; what it printed is read to EOF, up to the deadline (or 5 s once
        # it ended on its own): a grandchild holding the pipe does not hold this call.
        left = max(deadline - time.monotonic(), 0.0)
        lines.thread.join(timeout=1.0 if expired else min(left, 5.0))
        _join(threads, until=time.monotonic() + 5)
    except BaseException:
        descendants.end(child)
        raise
    finally:
        lines.stop()
    if expired and child.returncode != 0:
        raise _timed_out(args, timeout, "".join(err_parts)[-4000:])
    if lines.thread.is_alive():
        log.debug("%s: a process it left holds its output; not read further", args[0])
    return Completed(
        argv=tuple(args), returncode=child.returncode, stdout="", stderr="".join(err_parts)
    )


class _Lines:
    """Each line of ``pipe`` handed to ``on_line`` from a thread of its own, until
    :meth:`stop`: a line that comes once its caller has returned is not handed on."""

    def __init__(self, pipe: IO[str], on_line: Callable[[str], None]) -> None:
        self._gate = threading.Lock()
        self._stopped = False
        self.thread = threading.Thread(target=self._pump, args=(pipe, on_line), daemon=True)
        self.thread.start()

    def _pump(self, pipe: IO[str], on_line: Callable[[str], None]) -> None:
        for line in pipe:
            with self._gate:
                if self._stopped:
                    return
                on_line(line.rstrip("\n"))

    def stop(self) -> None:
        with self._gate:
            self._stopped = True


def _join(threads: Sequence[threading.Thread], *, until: float) -> None:
    """Join each thread, all against one deadline (not one timeout each)."""
    for thread in threads:
        thread.join(timeout=max(until - time.monotonic(), 0))


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` so a reader sees the old file or the new one, never half
    (temp file in the same directory + fsync + ``os.replace``, as pypa/build writes its
    reports). Creates the parent directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp makes 0600; a report or lock is as readable as any file the user writes.
        umask = os.umask(0)
        os.umask(umask)
        Path(tmp).chmod(0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            Path(tmp).unlink()
        raise
    return path


def delete(path: Path) -> None:
    """Delete what cudaenv made at ``path``, whatever its kind: a link or a file unlinked
    (whatever a link points to is left), a directory whole without following a link inside it
    (shutil.rmtree's own rule). CudaenvError where any of it is still there: an undo or a
    clean-up that left a file behind says so (``shutil.rmtree(file, ignore_errors=True)``
    leaves a file in silence, which is how an adopt's undo once kept a file its prefetch
    wrote, and the env's ``var/`` with it)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    if path.is_symlink() or path.exists():
        raise CudaenvError(f"{path}: could not delete all of it (permissions?); delete it by hand")


def replace_process(argv: Sequence[str], env: Mapping[str, str]) -> NoReturn:
    """Become ``argv`` (``cudaenv run``): signals and the exit status are the command's own,
    with no cudaenv process left in between."""
    log.debug("exec %s", shlex.join(argv))
    refusal = refused(argv[0])
    if refusal is not None:
        raise refusal
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], list(argv), dict(env))  # noqa: S606 - argv is an exact program path


def which(name: str, path: str | None = None) -> str | None:
    """``name`` on ``path`` (default: PATH) as the shell finds it, skipping every candidate
    that another user owns or can write, or that lies in a directory another user can write
    (the program, where its link leads, and the directories holding both): a planted
    ``ssh-keygen`` or ``cc`` in a shared directory on root's PATH is never run. git refuses
    another user's repository for the same reason (its safe.directory rule)."""
    if os.sep in name:
        return shutil.which(name, path=path)
    for directory in _path_dirs(path):
        found = shutil.which(name, path=directory or ".")
        if found is not None and planted_why(found) is None:
            return found
    return None


def _untrusted_on_path(name: str, path: str | None) -> str | None:
    """The first ``name`` on ``path`` that :func:`which` skipped, if any."""
    for directory in _path_dirs(path):
        found = shutil.which(name, path=directory or ".")
        if found is not None:
            return found
    return None


def _path_dirs(path: str | None) -> list[str]:
    """The directories of ``path``, else of this process's PATH."""
    return (path if path is not None else settings.child_environ().get("PATH", "")).split(
        os.pathsep
    )


def uv_bin() -> str:
    """The uv executable: $CUDAENV_UV, else the one installed with cudaenv, else PATH's."""
    chosen = settings.current().uv
    if chosen:
        if shutil.which(chosen):
            return chosen
        raise ToolMissing(
            f"CUDAENV_UV={chosen} is not an executable; unset it or install uv: "
            f"`{sys.executable} -m pip install uv`",
            tool=chosen,
        )
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        pass
    found = which("uv")
    if found:
        return found
    raise ToolMissing(
        f"uv: not found; install it with `{sys.executable} -m pip install uv`", tool="uv"
    )


def uv_env() -> dict[str, str]:
    """The environment every uv call gets: never a managed-Python download (it fails slowly
    offline), and hard links from uv's cache where the filesystem allows (a warm
    build is ~2.5 s). A user's own setting of either wins."""
    env = settings.child_environ()
    env.setdefault("UV_PYTHON_DOWNLOADS", "never")
    env.setdefault("UV_LINK_MODE", "hardlink")
    return env
