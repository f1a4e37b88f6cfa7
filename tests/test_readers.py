"""One reader for every file a user names: every command's every argument that names an input
file, found in the command table (a new one is tested without editing this), given what a
hostile or careless user could name instead: a 0600 secret in YAML, JSON and TOML shapes, a
FIFO, a symlink loop, /dev/zero, a directory, 50,000-deep nesting and bytes that are not
UTF-8. Each: one error line (and the count after a file's problems), exit 2, none of the file's
text printed, no traceback, within 10 s."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ENVSPECS, command_arguments, cudaenv, lock_of, workspace

SECRET = "AKIA0SECRET0TOKEN"  # noqa: S105 (a marker the output must not hold, no credential)
# Options that name a file cudaenv reads (the other Path options are written: --report, ...).
READ_OPTIONS = ("--targets", "--baseline")


def input_arguments() -> list[tuple[tuple[str, ...], str]]:
    """(command words, the flag or '' for its positional) for every argument that names a file
    cudaenv reads: a Path-typed positional (the specs, a matrix file), a report merge's
    reports, and the read options above."""
    found: list[tuple[tuple[str, ...], str]] = []
    for words, name, option, hint in command_arguments():
        if option.flags and set(option.flags) & set(READ_OPTIONS):
            found.append((words, option.flags[0]))
        elif not option.flags and ("Path" in str(hint) or name == "reports"):
            found.append((words, ""))
    return found


def shapes(tmp: Path) -> dict[str, Path]:
    """Each thing a file argument could name instead of its kind of file."""
    out: dict[str, Path] = {}

    def secret(name: str, text: str) -> Path:
        path = tmp / name
        path.write_text(text)
        path.chmod(0o600)
        return path

    out["secret-yaml"] = secret("s.yaml", f"aws_key: {SECRET}\npassword: {SECRET}\n")
    out["secret-json"] = secret("s.json", f'{{"token": "{SECRET}", "{SECRET}": 1}}')
    out["secret-toml"] = secret("s.toml", f'[creds]\ntoken = "{SECRET}"\n')
    out["shadow"] = secret("shadow", f"root:$6${SECRET}:19000:0:99999:7:::\n")
    fifo = tmp / "fifo.yaml"
    os.mkfifo(fifo)
    out["fifo"] = fifo
    (tmp / "loop-a").symlink_to(tmp / "loop-b")
    (tmp / "loop-b").symlink_to(tmp / "loop-a")
    out["symlink-loop"] = tmp / "loop-a"
    out["dev-zero"] = Path("/dev/zero")
    (tmp / "adir.yaml").mkdir()
    out["directory"] = tmp / "adir.yaml"
    deep = tmp / "deep.yaml"
    deep.write_text("[" * 50_000 + "]" * 50_000 + "\n")
    out["deep-nesting"] = deep
    raw = tmp / "bytes.yaml"
    raw.write_bytes(b"name: \xff\xfe" + SECRET.encode() + b"\n")
    out["not-utf8"] = raw
    return out


SHAPES = ("secret-yaml", "secret-json", "secret-toml", "shadow", "fifo", "symlink-loop",
          "dev-zero", "directory", "deep-nesting", "not-utf8")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    ("words", "flag"), input_arguments(), ids=lambda v: " ".join(v) if isinstance(v, tuple) else v
)
def test_an_input_file_argument_given_what_is_not_its_kind(
    words: tuple[str, ...], flag: str, shape: str, tmp_path: Path
) -> None:
    given = shapes(tmp_path)[shape]
    argv = [*words, *((flag, str(given)) if flag else (str(given),))]
    if flag:
        # The rest of a command line that reads the flag's file: a real spec (or matrix).
        ws = workspace(tmp_path / "ws", "default.yaml")
        shutil.copytree(ENVSPECS / "matrix", ws / "envspecs" / "matrix")
        first = "envspecs/matrix/release.yaml" if words[0] == "matrix" else "envspecs/default.yaml"
        argv = [*words, first, flag, str(given)]
        tmp_path = ws
    try:
        done = cudaenv(*argv, cwd=tmp_path, check=False, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"cudaenv {' '.join(argv)} waited past 10 s")
    out = done.stdout + done.stderr
    assert "Traceback" not in out, out
    assert SECRET not in out, out
    assert done.returncode == 2, out


def _damaged(damage: str, text: str) -> bytes:
    """The committed lock's ``text`` with one kind of damage."""
    if damage == "not-utf8":
        return text.encode() + b"\xff\xfe"
    if damage == "wrong-type":
        return text.replace("size = ", 'size = "big"  # ', 1).encode()
    if damage == "negative-size":
        return re.sub(r"size = \d+", "size = -1", text, count=1).encode()
    if damage == "path-out-of-tree":
        return re.sub(
            r'path = "wheels/[^"]*"', 'path = "../../../../etc/passwd"', text, count=1
        ).encode()
    assert damage == "deep-nesting"
    return (text + "x = " + "[" * 50_000 + "]" * 50_000 + "\n").encode()


LOCK_DAMAGE = ("not-utf8", "wrong-type", "negative-size", "path-out-of-tree", "deep-nesting")


@pytest.mark.parametrize("damage", LOCK_DAMAGE)
def test_a_damaged_lock_is_bad_input_in_one_line(damage: str, tmp_path: Path) -> None:
    """A lock is an input file like a spec: whatever is wrong with it exits 2 (the code the
    exit codes give a bad lock) in one line naming it, before anything is resolved or built."""
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    lock = lock_of(ws / "envspecs" / "toolchain-cu130.yaml")
    lock.write_bytes(_damaged(damage, lock.read_text()))
    done = cudaenv("plan", "envspecs/toolchain-cu130.yaml", cwd=ws, check=False, timeout=30)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    assert lines[-1] == "error: 1 problem(s) in the lock; nothing was done", done.stderr
    assert len(lines) == 2 and lock.name in lines[0], done.stderr
