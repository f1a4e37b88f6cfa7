"""A hand-written YAML file -> located plain data, for every config file cudaenv reads.

Each value keeps the file position it came from, so a problem reads
``FILE:LINE:COL: key.path: message`` and every problem of a file is collected and reported at
once (:class:`Problems`). YAML is composed with the safe loader only and never constructed:
tags, merge keys and duplicate keys are refused, and the input is bounded (size, depth, node
count) so no file can hang or exhaust the builder. ``spec.py`` and the matrix loader read their
files through here; what a key means stays with them. :func:`read_input` is how every input
file (a spec, a matrix file, a lock) is read: a regular file under a size cap, never a FIFO or
a device.

A message quotes a file's text only once the file has read as a YAML mapping (a spec or matrix
file, however wrong): ``extends: /etc/passwd``, or a spec path a pull request points at an SSH
key, must not print that file into a CI log. Until then a message names the file, the position
and the problem, never the text there. A mapping is not enough for a file another names
(``extends:``): ``/etc/shadow`` reads as one whose keys are its lines, so the loader calls a base
with a key no spec has "not a spec" and shows none of it (``spec.py``).
"""

from __future__ import annotations

import difflib
import os
import re
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import yaml

# libyaml's safe loader when PyYAML has it (10x faster, same marks); the pure one otherwise.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

MAX_BYTES = 256 * 1024
MAX_DEPTH = 32
MAX_NODES = 20_000


class Unreadable(Exception):
    """Why an input file is not read: one phrase for ``FILE: <phrase>``."""


def _file_type(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a special file"


def read_input(path: Path, max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file at ``path`` (symlinks followed), at most ``max_bytes``.
    Raises :class:`Unreadable` for anything else: ``/dev/zero`` would be read until memory
    runs out, a FIFO would block the command forever, a directory is a mistake."""

    def refuse(st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"{_file_type(st.st_mode)}, not a file; a {what} is a regular file")
        if st.st_size > max_bytes:
            raise Unreadable(f"file is {st.st_size} bytes; a {what} is at most {max_bytes}")

    try:
        # stat first: a device is refused without being opened (opening one can act).
        refuse(path.stat())
        # O_NONBLOCK: a path swapped for a FIFO since the stat opens at once instead of
        # waiting for a writer; fstat then says what was opened.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise Unreadable(f"cannot read: {exc.strerror}") from exc
    except ValueError as exc:  # a NUL byte in the path
        raise Unreadable("not a usable file path") from exc
    try:
        refuse(os.fstat(fd))
        chunks, size = [], 0
        while size <= max_bytes:  # a file that grows after the fstat is still bounded
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise Unreadable(f"cannot read: {exc.strerror}") from exc
    finally:
        os.close(fd)
    if size > max_bytes:
        raise Unreadable(f"file is more than {max_bytes} bytes; a {what} is at most {max_bytes}")
    return b"".join(chunks)


@dataclass(frozen=True)
class Mark:
    """A 1-based position in a file, as editors and ``FILE:LINE:COL`` links count."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


Value = Union[None, bool, int, float, str, "list[Item]", "dict[str, Item]"]


@dataclass(frozen=True)
class Item:
    """One YAML value and where it starts; a mapping's values also carry their key's mark, so
    a problem with the key itself (unknown, reserved) points at the key, not the value."""

    value: Value
    mark: Mark
    key_mark: Mark | None = None


class Problems:
    """Every located problem in one load, reported together."""

    def __init__(self) -> None:
        self.items: list[tuple[str, int, int, str]] = []
        # Set by a loader whose base file (`extends:`) failed: the keys the base would have given
        # then read as "required key is missing" noise, so the loader says it once instead.
        self.extends_failed = False

    def add(self, mark: Mark, path: str, message: str) -> None:
        prefix = f"{path}: " if path else ""
        self.items.append((mark.file, mark.line, mark.col, f"{mark}: {prefix}{message}"))

    def include(self, messages: Iterable[str]) -> None:
        """Problems already located in another file (a spec a matrix names), listed after
        this file's own."""
        for message in messages:
            self.items.append(("\uffff", 0, 0, message))

    def __bool__(self) -> bool:
        return bool(self.items)

    def messages(self) -> list[str]:
        """Sorted by file, line and column; each distinct message once."""
        seen: dict[str, None] = {}
        for item in sorted(self.items, key=lambda t: (t[0], t[1], t[2])):
            seen.setdefault(item[3], None)
        return list(seen)


def display(path: Path) -> str:
    """The name a message gives ``path``: relative to the cwd when it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError, RuntimeError):
        # Not below the cwd; or a symlink loop (RuntimeError before Python 3.13, OSError
        # after): the read says why it is no file, in one line.
        return str(path)


def not_of_kind(root: Item, known: Sequence[str], what: str, problems: Problems) -> bool:
    """Whether the mapping ``root`` has no key a ``what`` has (a file of another kind named by
    mistake, or by someone who wants it printed: ``/etc/shadow`` reads as a mapping whose
    keys are its lines, a JSON secrets file as one whose keys are its names). Then it is said
    to be no ``what``, at its first key's position, and none of its text is shown."""
    assert isinstance(root.value, dict)
    strange = [item for key, item in root.value.items() if key not in known]
    if not strange or len(strange) < len(root.value):
        return False
    if any(difflib.get_close_matches(str(key), known, n=1, cutoff=0.6) for key in root.value):
        return False  # a mistyped key of a file of this kind: "did you mean" says which
    first = strange[0]
    problems.add(
        root.mark,
        "",
        f"{root.mark.file} is not a {what}: none of its {len(strange)} key(s) is a {what}'s "
        f"(the first at {first.key_mark or first.mark}; its text is not shown)",
    )
    return True


def kind(v: object) -> str:
    """What a value is, for "expected X, got <kind>"."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return f"the number {v}"
    if isinstance(v, str):
        return f"the string {v!r}"
    if isinstance(v, list):
        return "a list"
    return "a mapping"


def suggest(word: str, known: Sequence[str], what: str = "key") -> str:
    """The "did you mean" for an unknown ``what``: the closest of ``known``, or all of them.

    A key is not repeated in the text: the key path in front of the message names it already
    (``pakages: unknown key; ...``). A value (a check, a component) is, since its path is only
    an index (``verify[0]: unknown check 'cubins'; ...``).
    """
    head = "unknown key" if what == "key" else f"unknown {what} {word!r}"
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    if close:
        return f"{head}; did you mean '{close[0]}'?"
    return f"{head}; expected one of: {', '.join(known)}"


def plain_reads_back(text: str) -> bool:
    """Whether ``text`` written as a plain YAML scalar is read back as that string: ``yes``,
    ``on``, ``null``, ``1_000`` and ``0x10`` are not (YAML 1.1 resolves them to a boolean, null
    or a number), so a writer quotes them. Composed only, never constructed."""
    try:
        node = yaml.compose(text, Loader=_LOADER)
    except (yaml.YAMLError, ValueError):
        return False
    return (
        isinstance(node, yaml.ScalarNode)
        and node.tag == "tag:yaml.org,2002:str"
        and node.value == text
    )


def string(item: Item, path: str, problems: Problems, what: str) -> str | None:
    """``item`` as a non-blank string (stripped), or None with the problem recorded."""
    if isinstance(item.value, str) and item.value.strip():
        return item.value.strip()
    problems.add(item.mark, path, f"expected {what}, got {kind(item.value)}")
    return None


def strings(
    item: Item, path: str, problems: Problems, what: str
) -> Iterator[tuple[str, Item, str]]:
    """The good entries of a list of strings as ``(text, item, path)``; the rest recorded."""
    if not isinstance(item.value, list):
        problems.add(item.mark, path, f"expected a list of {what}, got {kind(item.value)}")
        return
    for i, sub in enumerate(item.value):
        sub_path = f"{path}[{i}]"
        text = string(sub, sub_path, problems, what)
        if text is not None:
            yield text, sub, sub_path


def compose(
    path: Path,
    problems: Problems,
    *,
    what: str = "spec",
    max_bytes: int = MAX_BYTES,
    content: bytes | None = None,
) -> Item | None:
    """Read ``path`` into located plain data whose root is a mapping, or None with every
    problem recorded. ``what`` names the kind of file in the messages ("a spec is ...").
    ``content``: the file's bytes as they would be at ``path`` (a matrix cell's generated
    spec, read before it is written, or never written)."""
    name = display(path)
    start = Mark(name, 1, 1)
    if content is not None and len(content) > max_bytes:
        problems.add(start, "", f"file is {len(content)} bytes; a {what} is at most {max_bytes}")
        return None
    try:
        raw = content if content is not None else read_input(path, max_bytes, what)
    except Unreadable as exc:
        problems.add(start, "", str(exc))
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        problems.add(Mark(name, line, col), "", f"not UTF-8 (byte 0x{raw[exc.start]:02x})")
        return None
    try:
        node = yaml.compose(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as exc:
        m = exc.problem_mark or exc.context_mark
        mark = Mark(name, m.line + 1, m.column + 1) if m else start
        problems.add(mark, "", f"invalid YAML: {_without_text(exc.problem or exc.context)}")
        return None
    except yaml.reader.ReaderError as exc:
        # Its str() spans two lines and names "<unicode string>"; the position says where.
        line = text.count("\n", 0, exc.position) + 1
        col = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        # The code point, an int from both loaders (typed loosely upstream, hence the guard).
        char = (
            exc.character if isinstance(exc.character, int) else ord(str(exc.character)[:1] or "\0")
        )
        problems.add(
            Mark(name, line, col), "", f"invalid YAML: unacceptable character #x{char:04x}"
        )
        return None
    except (yaml.YAMLError, RecursionError, ValueError):
        problems.add(start, "", "invalid YAML: cannot parse it")
        return None
    if node is None:
        problems.add(start, "", f"the file is empty; a {what} is a YAML mapping")
        return None
    if not isinstance(node, yaml.MappingNode):
        # Judged on the node, before any of it is converted (a tag or a value in a message
        # would be the file's text): this file is no spec, so nothing of it is shown.
        shape = "a list" if isinstance(node, yaml.SequenceNode) else "a single value (not shown)"
        problems.add(_mark(name, node), "", f"a {what} is a YAML mapping, got {shape}")
        return None
    composer = _Composer(name, what, problems)
    try:
        root = composer.convert(node, "")
    except _Abort as abort:
        problems.add(abort.mark, abort.path, abort.message)
        return None
    except RecursionError:
        problems.add(start, "", f"nested deeper than {MAX_DEPTH} levels")
        return None
    assert isinstance(root.value, dict)  # a MappingNode converts to a mapping
    return root


# A quoted fragment of a YAML error message. The pure-Python loader quotes the file's text
# (an alias or tag handle, a character); libyaml quotes nothing of it.
_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
# What may stay: one character (its repr), or a token name such as '<stream end>'.
_HARMLESS = re.compile(
    r"[^\\]|\\(?:[abfnrtv0\\'\"]|x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})|<[a-z ]+>"
)


def _without_text(message: str | None) -> str:
    """A YAML syntax error's message with any quoted text of the file left out: the file may
    be no spec at all, and the line and column already say where."""
    if not message:
        return "cannot parse it"

    def keep(m: re.Match[str]) -> str:
        return m.group(0) if _HARMLESS.fullmatch(m.group(0)[1:-1]) else "(text not shown)"

    return _QUOTED.sub(keep, message)


# --------------------------------------------------------------------------- composing


_PLAIN_TAGS = frozenset(
    f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map", "merge")
)


class _Abort(Exception):
    """A problem after which the rest of the document is not worth reading."""

    def __init__(self, mark: Mark, path: str, message: str) -> None:
        self.mark, self.path, self.message = mark, path, message


def _mark(file: str, node: yaml.Node) -> Mark:
    return Mark(file, node.start_mark.line + 1, node.start_mark.column + 1)


class _Composer:
    """yaml.Node -> Item, bounded in depth and node count (alias bombs expand here)."""

    def __init__(self, file: str, what: str, problems: Problems) -> None:
        self.file = file
        self.what = what
        self.problems = problems
        self.count = 0

    def convert(self, node: yaml.Node, path: str, depth: int = 0) -> Item:
        self.count += 1
        mark = _mark(self.file, node)
        if self.count > MAX_NODES:
            raise _Abort(mark, path, f"too many YAML nodes (more than {MAX_NODES})")
        if depth > MAX_DEPTH:
            raise _Abort(mark, path, f"nested deeper than {MAX_DEPTH} levels")
        if node.tag not in _PLAIN_TAGS:
            # compose() builds no objects, but a tagged node is never plain data: refuse it
            # rather than silently reading `!!python/object` as a list.
            raise _Abort(
                mark, path, f"YAML tag {node.tag!r} is not allowed: a {self.what} is plain data"
            )
        if isinstance(node, yaml.ScalarNode):
            return Item(_scalar(node), mark)
        if isinstance(node, yaml.SequenceNode):
            return Item(
                [self.convert(n, f"{path}[{i}]", depth + 1) for i, n in enumerate(node.value)],
                mark,
            )
        if isinstance(node, yaml.MappingNode):
            out: dict[str, Item] = {}
            for knode, vnode in node.value:
                kmark = _mark(self.file, knode)
                if not isinstance(knode, yaml.ScalarNode):
                    self.problems.add(kmark, path, "keys must be plain strings")
                    continue
                key = str(_scalar(knode)) if knode.tag != "tag:yaml.org,2002:merge" else "<<"
                sub = f"{path}.{key}" if path else key
                if key == "<<":
                    self.problems.add(kmark, path, "YAML merge keys ('<<') are not supported")
                    continue
                if key in out:
                    self.problems.add(kmark, sub, "duplicate key (YAML would keep only the last)")
                    continue
                item = self.convert(vnode, sub, depth + 1)
                out[key] = Item(item.value, item.mark, kmark)
            return Item(out, mark)
        raise _Abort(mark, path, "unsupported YAML node")


def _scalar(node: yaml.ScalarNode) -> Value:
    # Resolve with the safe constructor's rules (int, float, bool, null, str), nothing else:
    # timestamps and binary stay strings.
    tag = node.tag
    text = str(node.value)
    if tag == "tag:yaml.org,2002:null":
        return None
    if tag == "tag:yaml.org,2002:bool":
        return text.lower() in ("true", "yes", "on", "y")
    if tag == "tag:yaml.org,2002:int":
        try:
            return int(text.replace("_", ""), 0)
        except ValueError:
            return text
    if tag == "tag:yaml.org,2002:float":
        try:
            return float(text.replace("_", ""))
        except ValueError:
            return text
    return text
