"""The one exception tree. Library code raises these and never exits; the CLI
(builder/cli/main.py, through ``reporter.run_main``) turns each into its one-line ``error:``
message and exit code. Progress goes to a ``Reporter`` (stderr), results to the CLI's stdout.

Each class carries the exit code the CLI returns for it; :data:`EXIT_CODES` says what each code
means, for ``cudaenv --help`` and the generated reference.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from builder.core.statuses import CellStatus

# What a terminal acts on or a reader takes for a new line: C0 controls but the tab, DEL, C1
# controls (0x9b is a CSI on some terminals), Unicode's line and paragraph separators, and the
# bytes that were not UTF-8 (os.fsdecode's surrogateescape gives U+DC80..U+DCFF for them).
_UNPRINTABLE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\udc80-\udcff]")
_NAMED = {"\n": "\\n", "\r": "\\r"}


def _escaped(match: re.Match[str]) -> str:
    c = match.group()
    if "\udc80" <= c <= "\udcff":
        return f"\\x{ord(c) - 0xDC00:02x}"
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def printable(text: str) -> str:
    """``text`` as one line a terminal shows as it is: every control character (newline,
    carriage return, ESC, ...) and every byte that was not UTF-8 written as its escape
    (``\\n``, ``\\x1b``, ``\\xff``). The one formatter every line cudaenv prints to stderr
    passes (an error, a progress line, a warning): an argument or a file's text that holds
    ``\\nerror: forged`` cannot forge a second line, nor an ESC sequence act."""
    return _UNPRINTABLE.sub(_escaped, text)


def printable_block(text: str, indent: str = "  ") -> str:
    """``text`` whose first line is cudaenv's and whose later lines may be a tool's own output:
    each line :func:`printable`, every line after the first indented, so no line of it reads
    as one of cudaenv's (``error:``, ``cudaenv:``) however the text was made."""
    first, *rest = text.split("\n")
    return "\n".join([printable(first), *(indent + printable(line) for line in rest)])


class CudaenvError(Exception):
    """Base of every error the CLI turns into one ``error:`` line."""

    exit_code = 1


class UsageError(CudaenvError):
    """A command-line argument is wrong (a bad ``--archs``, a path that is no interpreter)."""

    exit_code = 2


class SpecError(CudaenvError):
    """A spec or matrix file is unreadable or invalid. Carries every problem found, each
    located; ``what`` names the kind of file for the closing line."""

    exit_code = 2

    def __init__(self, problems: Sequence[str], what: str = "spec") -> None:
        self.problems = list(problems)
        self.what = what
        super().__init__("\n".join(self.problems))


class LockUnreadable(SpecError):
    """A lock file that does not parse as a PEP 751 lock cudaenv wrote (not TOML, not UTF-8,
    a key of the wrong type): bad input, exit 2; a re-lock replaces it."""

    def __init__(self, problem: str) -> None:
        super().__init__([problem], "lock")


class ReportError(CudaenvError):
    """A report or manifest JSON file is missing, not JSON, or not of a known schema."""

    exit_code = 2


class ResolveError(CudaenvError):
    """The resolver failed, or the resolved set breaks the matching policy."""

    exit_code = 3


class BuildError(CudaenvError):
    """Creating the venv, installing the lock or wiring the toolchain failed."""

    exit_code = 4


class VerifyFailed(CudaenvError):
    """A verification check failed."""

    exit_code = 5


class ToolMissing(CudaenvError):
    """A tool the builder needs (uv, a Python, a C compiler, nvcc) is not on this machine.

    ``tool`` names what is missing as the message does (a command, or the path looked at), so
    a check's result can carry it without parsing the message."""

    exit_code = 6

    def __init__(self, message: str, *, tool: str) -> None:
        self.tool = tool
        super().__init__(message)


class DriverTooOld(CudaenvError):
    """This machine's NVIDIA driver cannot run the CUDA of the spec (or of the env's torch):
    `build` and `adopt` refuse before changing anything, unless told ``--no-driver-check``."""

    exit_code = 7


class EnvBusy(CudaenvError):
    """Another cudaenv process held the env's lock for longer than this one waits (``adopt``);
    nothing was changed."""

    exit_code = 3


class CommandFailed(CudaenvError):
    """A command exited non-zero or ran past its timeout. A stage that runs a command maps
    this to its own error class (and so its exit code); unmapped, it exits 1."""

    exit_code = 1

    def __init__(
        self, argv: Sequence[str], returncode: int, output: str, *, timed_out: float | None = None
    ) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.output = output
        self.timed_out = timed_out
        tail = "\n".join(output.strip().splitlines()[-30:])
        head = (
            f"command timed out after {timed_out:g} s"
            if timed_out is not None
            else f"command failed (exit {returncode})"
        )
        super().__init__(f"{head}: {shlex.join(self.argv)}\n{tail}".rstrip())


# Exit code -> what the matrix grid calls a cell that ended with it.
STATUS_OF_EXIT: dict[int, CellStatus] = {
    0: "passed",
    UsageError.exit_code: "error",
    ResolveError.exit_code: "refused",
    BuildError.exit_code: "failed",
    VerifyFailed.exit_code: "failed",
    ToolMissing.exit_code: "error",
    DriverTooOld.exit_code: "refused",
}


def error_lines(exc: CudaenvError) -> list[str]:
    """What a command prints for an error: one line each (a spec's problems, then a count)."""
    if isinstance(exc, SpecError):
        return [f"error: {printable(str(p))}" for p in exc.problems] + [
            f"error: {len(exc.problems)} problem(s) in the {exc.what}; nothing was done"
        ]
    if isinstance(exc, UsageError):
        # Bad input is one line, whatever the argument or the file held.
        return [f"error: {printable(str(exc))}"]
    # Other errors may carry a tool's own output (uv's, nvcc's, after the line that says what
    # failed): its lines are kept, each escaped and indented, so none reads as an error line.
    return [f"error: {printable_block(str(exc))}"]


# Every exit status cudaenv has, with a short form (``cudaenv --help``) and the meaning the
# reference gives. The error classes above carry their codes; the others come from the CLI
# itself (`run`, an interrupt, a reader that left).
EXIT_CODES: tuple[tuple[int, str, str], ...] = (
    (0, "ok", "done"),
    (CudaenvError.exit_code, "other",
     "anything else; for `doctor`, an error was found; for `fingerprint --compare`, the two "
     "differ"),
    (UsageError.exit_code, "bad input (spec, matrix, lock, report, argument)",
     "bad input: a spec, matrix file, lock, report or argument, each problem located as "
     "`FILE:LINE:COL: key: message` (a lock entry naming an index the spec does not pin, a file "
     "path outside the wheelhouse, a file that is not a regular file or is over its cap)"),
    (ResolveError.exit_code, "refused or unresolvable set",
     "refused by the matching policy, or unresolvable, or the index did not answer; `adopt` "
     "refused the env, or waited too long for another cudaenv working on it"),
    (BuildError.exit_code, "build failed",
     "the build failed: a wheelhouse or downloaded file whose hash differs from the lock's, a "
     "full disk, a stale lock; `adopt --undo` could not put something back"),
    (VerifyFailed.exit_code, "a check failed",
     "verification failed, or the env is not the one the spec describes; `store verify` "
     "discarded a damaged entry"),
    (ToolMissing.exit_code, "a tool is missing",
     "a tool is missing: uv (`CUDAENV_UV` picks one), a C compiler, the spec's Python"),
    (DriverTooOld.exit_code, "the NVIDIA driver is too old for the CUDA (build, adopt)",
     "`build`, `adopt`: this machine's NVIDIA driver cannot run the CUDA (13.x needs 580+, 12.x "
     "525+); the driver is read from `CUDAENV_DRIVER_VERSION`, else the kernel module, else "
     "`nvidia-smi` or libcuda; `--no-driver-check` goes on"),
    (126, "run: the command is not executable",
     "`run`: the command could not be run (not executable, a directory), as a shell says"),
    (127, "run: the command was not found",
     "`run`: the command was not found, as a shell says; otherwise `run` exits with the "
     "command's own status"),
    (130, "interrupted", "interrupted (Ctrl-C, SIGTERM); a build or repair leaves the previous "
     "env as it was"),
    (141, "the reader of the output left",
     "the reader of cudaenv's output left early (`cudaenv list --json | head -1`); nothing is "
     "printed about it"),
)  # fmt: skip


def exit_summary() -> str:
    """The exit codes in one paragraph, for ``cudaenv --help``."""
    return "; ".join(f"{code} {short}" for code, short, _ in EXIT_CODES) + "."
