"""`cudaenv add PKG... [--spec SPEC]`: a package into the env in one command, as `uv add` or
`pixi add` do it.

The requirements go into the spec's ``packages:`` with the file's comments and layout kept (a
text edit at the positions the YAML reader reports, never a re-dump of the document), a
requirement for a package already listed replaces that line; then the spec is locked (the
current lock's versions preferred), the env rebuilt from the new lock and verified. A resolve
or build that fails puts the spec and its lock back as they were; the env is untouched then
(a build swaps the new env in whole, or not at all).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from builder.commands import build as buildrun
from builder.commands import pipeline
from builder.commands import verify as verifyrun
from builder.commands.args import BuildArgs
from builder.core import proc
from builder.core.errors import UsageError
from builder.core.reporter import Reporter
from builder.env import specedit
from builder.env.build import fault_point
from builder.formats.yamldoc import Item, Problems, compose, plain_reads_back
from builder.spec import envspec as spec

# A requirement written as a plain YAML scalar: anything else is written double-quoted.
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=<>~!-]*")


def requirements(given: Sequence[str]) -> list[str]:
    """The command line's requirements as written (stripped), each a PEP 508 requirement;
    one line otherwise."""
    out = []
    for text in (g.strip() for g in given):
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            raise UsageError(f"add {text!r}: not a PEP 508 requirement ({exc})") from None
        if canonicalize_name(req.name) == "torch":
            raise UsageError(f"add {text!r}: torch is pinned by the spec's 'torch:' key")
        out.append(text)
    return out


def _scalar(req: str) -> str:
    """``req`` as YAML reads it back as that string: plain where it is one, else
    double-quoted. ``yes``, ``on``, ``null``, ``1_000`` and ``0x10`` are valid package names
    that YAML 1.1 reads as a boolean, null or a number unquoted."""
    if _PLAIN.fullmatch(req) and plain_reads_back(req):
        return req
    return json.dumps(req)


def _name_of(text: str) -> str | None:
    try:
        return canonicalize_name(Requirement(text).name)
    except InvalidRequirement:
        return None


def _scalar_end(line: str, start: int) -> int:
    """Where the scalar starting at ``start`` of ``line`` ends (a quoted one at its closing
    quote, a plain one before a comment or the line's end)."""
    if line[start : start + 1] in ("'", '"'):
        quote = line[start]
        i = start + 1
        while i < len(line):
            if line[i] == "\\" and quote == '"':
                i += 2
                continue
            if line[i] == quote:
                return i + 1
            i += 1
        return len(line)
    comment = line.find(" #", start)
    end = comment if comment >= 0 else len(line.rstrip("\r\n"))
    end = start + len(line[start:end].rstrip())
    flow_end = min((i for i in (line.find(",", start), line.find("]", start)) if i >= 0),
                   default=end)  # fmt: skip
    return min(end, flow_end) if line[:start].rstrip().endswith(("[", ",")) else end


def edit(text: str, root: Item, reqs: Sequence[str], inherited: Sequence[str]) -> str:
    """``text`` (a spec whose top-level mapping is ``root``) with ``reqs`` in ``packages:``.
    ``inherited``: the list the spec has from its ``extends:`` base when the file itself has
    no ``packages:`` (a key here replaces the base's, so the base's entries are written too)."""
    lines = text.splitlines(keepends=True)
    assert isinstance(root.value, dict)
    item = root.value.get("packages")
    new = list(reqs)
    if item is None or item.value is None:
        block = "".join(f"  - {_scalar(r)}\n" for r in [*inherited, *new])
        if item is None:
            tail = "" if not lines or lines[-1].endswith("\n") else "\n"
            return text + tail + "packages:\n" + block
        assert item.key_mark is not None
        at = item.key_mark.line  # the line after `packages:`
        return "".join(lines[:at]) + block + "".join(lines[at:])
    assert isinstance(item.value, list)
    entries = item.value
    for req in list(new):
        # A package listed already: its line takes the new requirement (uv add's behaviour).
        name = canonicalize_name(Requirement(req).name)
        for entry in entries:
            if isinstance(entry.value, str) and _name_of(entry.value) == name:
                i, col = entry.mark.line - 1, entry.mark.col - 1
                line = lines[i]
                lines[i] = line[:col] + _scalar(req) + line[_scalar_end(line, col) :]
                new.remove(req)
                break
    if not new:
        return "".join(lines)
    start_line = lines[item.mark.line - 1]
    if start_line[item.mark.col - 1] == "[":
        # A flow list: the new entries go before its closing bracket.
        flat = "".join(lines)
        offset = sum(len(ln) for ln in lines[: item.mark.line - 1]) + item.mark.col - 1
        close = flat.index("]", offset)
        inner = flat[offset + 1 : close].strip()
        added = ", ".join(_scalar(r) for r in new)
        return flat[:close].rstrip() + (", " if inner else "") + added + flat[close:]
    last = entries[-1]
    prefix = lines[last.mark.line - 1][: last.mark.col - 1]
    at = last.mark.line
    block = "".join(f"{prefix}{_scalar(r)}\n" for r in new)
    if at > 0 and not lines[at - 1].endswith("\n"):
        lines[at - 1] += "\n"
    return "".join(lines[:at]) + block + "".join(lines[at:])


DEFAULT_SPEC = Path("envspecs") / "default.yaml"


def add(
    spec_arg: str | None,
    given: Sequence[str],
    reporter: Reporter,
    *,
    verify: bool = True,
    show: Callable[[str], None] = print,
) -> buildrun.Built:
    """Put ``given`` into the spec's packages, lock, rebuild and verify the env; ``show`` gets
    the env's path and the verify summary (the CLI hands ``print``)."""
    reqs = requirements(given)
    if spec_arg is None:
        if not DEFAULT_SPEC.is_file():
            raise UsageError(f"add: name the spec with --spec SPEC (there is no {DEFAULT_SPEC})")
        spec_arg = str(DEFAULT_SPEC)
    path = Path(spec_arg)
    before = spec.load(path)
    problems = Problems()
    original = path.read_bytes()
    root = compose(path, problems, content=original)
    if root is None:
        raise UsageError(f"{spec_arg}: cannot be edited: {'; '.join(problems.messages())}")
    assert isinstance(root.value, dict)
    inherited = list(before.packages) if "packages" not in root.value else []
    text = edit(original.decode(), root, reqs, inherited)
    spec.load(path, text=text)  # the edited file must still be a valid spec
    lock_path = pipeline.lock_file(before)
    # Journaled before the spec changes: a kill from here on (no handler runs) is settled by
    # the next command that loads the spec (specedit.settle): put back, or kept where the
    # env was already built from the edit.
    journal = specedit.begin(path, original, text, lock_path)
    proc.atomic_write_text(path, text)
    reporter(f"added {', '.join(reqs)} to packages: of {spec_arg}")
    try:
        fault_point("add-edited", reporter)
        pipeline.write_lock(path, upgrade=False, reporter=reporter)
        fault_point("add-locked", reporter)
        request = BuildArgs(specs=(path,), verify=verify)
        built, verified = buildrun.build_and_verify(request, reporter, show=show)
    except BaseException:
        # Nothing half-done: the spec and its lock as they were (the env was not swapped).
        specedit.put_back(path, journal)
        reporter(f"{spec_arg} and {lock_path} are as they were")
        raise
    specedit.end(journal)
    if verified is not None:
        verifyrun.raise_verdict(verified)
    return built
