"""The one place a subprocess is started.

Every command is logged, its output captured, and replayed only on failure (as pypa/build
does). Tests replace :func:`run` or drive it with real tiny processes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from builder.errors import CudaenvError, ToolMissing

log = logging.getLogger("cudaenv")


class CommandFailed(CudaenvError):
    """A command exited non-zero or ran past its timeout."""

    exit_code = 1

    def __init__(self, argv: Sequence[str], returncode: int, output: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.output = output
        tail = "\n".join(output.strip().splitlines()[-30:])
        super().__init__(f"command failed (exit {returncode}): {shlex.join(self.argv)}\n{tail}")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """PR_SET_PDEATHSIG: if cudaenv is SIGKILLed, its uv/nvcc children die with it instead of
    writing on into a build directory the next build is removing."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_PREEXEC = _die_with_parent if sys.platform.startswith("linux") else None


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
) -> Completed:
    """Run ``argv`` (never through a shell).

    ``stream`` passes the child's stderr through to ours (used for uv's progress), stdout is
    always captured. ``check`` raises :class:`CommandFailed` with the output tail.
    """
    args = [os.fspath(a) for a in argv]
    log.debug("$ %s", shlex.join(args))
    if stream:
        return _run_streaming(args, env=env, cwd=cwd, check=check, timeout=timeout)
    try:
        proc = subprocess.run(
            args,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=None if stream else subprocess.PIPE,
            text=True,
            errors="replace",
            timeout=timeout,
            input=input_text,
            check=False,
            preexec_fn=_PREEXEC,  # single-threaded at spawn: see _die_with_parent
        )
    except FileNotFoundError as exc:
        raise ToolMissing(f"{args[0]}: not found ({exc.strerror})") from exc
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        raise CommandFailed(args, -1, f"{out}\ntimed out after {timeout} s") from exc
    done = Completed(
        argv=tuple(args), returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr or ""
    )
    if check and proc.returncode != 0:
        raise CommandFailed(args, proc.returncode, done.stdout + "\n" + done.stderr)
    return done


def _run_streaming(
    args: list[str],
    *,
    env: Mapping[str, str] | None,
    cwd: Path | None,
    check: bool,
    timeout: float | None,
) -> Completed:
    """Echo the child's stderr live (uv's progress) and keep it for the error message."""
    try:
        child = subprocess.Popen(
            args,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            preexec_fn=_PREEXEC,
        )
    except FileNotFoundError as exc:
        raise ToolMissing(f"{args[0]}: not found ({exc.strerror})") from exc
    err_lines: list[str] = []
    out_parts: list[str] = []
    assert child.stderr is not None and child.stdout is not None
    import threading

    def pump_out() -> None:
        assert child.stdout is not None
        out_parts.append(child.stdout.read())

    reader = threading.Thread(target=pump_out, daemon=True)
    reader.start()
    try:
        for line in child.stderr:
            err_lines.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()
        child.wait(timeout=timeout)
    except BaseException:
        child.kill()
        child.wait()
        raise
    reader.join(timeout=5)
    done = Completed(
        argv=tuple(args),
        returncode=child.returncode,
        stdout="".join(out_parts),
        stderr="".join(err_lines),
    )
    if check and child.returncode != 0:
        raise CommandFailed(args, child.returncode, done.stdout + "\n" + done.stderr)
    return done


def which(name: str, path: str | None = None) -> str | None:
    return shutil.which(name, path=path)


def uv_bin() -> str:
    """The uv executable: $CUDAENV_UV, else the one installed with cudaenv, else PATH's."""
    chosen = os.environ.get("CUDAENV_UV")
    if chosen:
        if shutil.which(chosen):
            return chosen
        raise ToolMissing(
            f"CUDAENV_UV={chosen} is not an executable; unset it or install uv: "
            f"`{sys.executable} -m pip install uv`"
        )
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("uv")
    if found:
        return found
    raise ToolMissing(f"uv: not found; install it with `{sys.executable} -m pip install uv`")
