"""What an sdist's ``setup.py`` demands of a CUDA build, read without running it: the
``-std=c++NN`` flags, the ``-gencode`` archs and the sources of its extensions, each with its
line, counted only where the file surely reaches them for a CUDA build with this toolkit.

A ``setup.py`` chooses: causal-conv1d 1.7.0 passes ``-std=c++17`` only under
``if HIP_BUILD:`` and asks for ``compute_62`` only under ``if bare_metal_version <=
Version("12.9")``. So the file is parsed (``ast``, nothing executed) and each ``if`` is
judged where its test can be: a name that says HIP or ROCm is false (this is a CUDA build), a
``SKIP_CUDA_BUILD`` switch is false, and a comparison of a ``*version*`` name with
``Version("X")`` (or ``parse("X")``) is decided by the toolkit's nvcc version. Any other test
leaves both of its branches unsure, and nothing found there is held against the release.
Statements inside a function are unsure too (it may never be called).
"""

from __future__ import annotations

import ast
import contextlib
import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

_STD = re.compile(r"^-std=c\+\+(\w+)$")
_ARCH = re.compile(r"\b(?:compute|sm)_(\d+)[a-z]?\b")
_SOURCE = re.compile(r"\.(?:cu|cpp|cc|cxx|c)$")
_VERSION_CALLS = frozenset({"Version", "parse", "LooseVersion", "StrictVersion"})
_EXTENSIONS = frozenset({"CUDAExtension", "CppExtension", "Extension"})
_OPS: dict[type[ast.cmpop], Callable[[Version, Version], bool]] = {
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
}


@dataclass(frozen=True)
class Demands:
    """What the file surely asks for, each with its 1-based line."""

    standards: tuple[tuple[int, str], ...] = ()  # (line, "17")
    archs: tuple[tuple[int, int], ...] = ()  # (line, 53) for compute_53 / sm_53
    sources: tuple[tuple[int, str], ...] = ()  # (line, "csrc/x.cu")
    # Everything the file names anywhere, sure or not ("20" once it says c++20 somewhere).
    any_standards: frozenset[str] = field(default_factory=frozenset)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def _says_hip(name: str) -> bool:
    words = re.split(r"[._]", name.lower())
    return any(w in ("hip", "rocm") for w in words)


def _version_constant(node: ast.expr) -> Version | None:
    if not (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords):
        return None
    func = _dotted(node.func)
    arg = node.args[0]
    if func is None or func.rsplit(".", 1)[-1] not in _VERSION_CALLS:
        return None
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return None
    try:
        return Version(arg.value)
    except InvalidVersion:
        return None


def _compare(node: ast.Compare, nvcc: Version | None) -> bool | None:
    """``bare_metal_version >= Version("12.8")`` decided by the toolkit's version."""
    if nvcc is None or len(node.ops) != 1:
        return None
    left, right, op = node.left, node.comparators[0], node.ops[0]
    fn = _OPS.get(type(op))
    if fn is None:
        return None
    lname, rname = _dotted(left), _dotted(right)
    if lname and "version" in lname.lower() and (const := _version_constant(right)):
        return fn(nvcc, const)
    if rname and "version" in rname.lower() and (const := _version_constant(left)):
        return fn(const, nvcc)
    return None


def truth(node: ast.expr, nvcc: Version | None) -> bool | None:
    """An ``if`` test's value for a CUDA build with nvcc ``nvcc``; None where unknown."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = truth(node.operand, nvcc)
        return None if inner is None else not inner
    if isinstance(node, ast.BoolOp):
        values = [truth(v, nvcc) for v in node.values]
        if isinstance(node.op, ast.And):
            return False if False in values else (True if all(values) else None)
        return True if True in values else (False if all(v is False for v in values) else None)
    if isinstance(node, ast.Compare):
        return _compare(node, nvcc)
    name = _dotted(node)
    if name is not None and (_says_hip(name) or "SKIP_CUDA_BUILD" in name.upper()):
        return False
    return None


def _sure(body: list[ast.stmt], nvcc: Version | None) -> Iterator[ast.AST]:
    """The nodes of ``body`` the file surely reaches (statements, then their expressions)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            value = truth(stmt.test, nvcc)
            if value is True:
                yield from _sure(stmt.body, nvcc)
            elif value is False:
                yield from _sure(stmt.orelse, nvcc)
            continue
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try)):
            inner = [s for s in ast.iter_child_nodes(stmt) if isinstance(s, ast.stmt)]
            # An except clause may never run: what it holds is unsure.
            heads = [
                n
                for n in ast.iter_child_nodes(stmt)
                if not isinstance(n, (ast.stmt, ast.excepthandler))
            ]
            for head in heads:
                yield from ast.walk(head)
            yield from _sure(inner, nvcc)
            continue
        yield from ast.walk(stmt)


def _strings(nodes: Iterator[ast.AST]) -> Iterator[tuple[int, str]]:
    for node in nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def _sources(nodes: list[ast.AST]) -> Iterator[tuple[int, str]]:
    """The constant source paths of each extension the file surely makes."""
    for node in nodes:
        if not isinstance(node, ast.Call):
            continue
        func = _dotted(node.func)
        if func is None or func.rsplit(".", 1)[-1] not in _EXTENSIONS:
            continue
        given = [k.value for k in node.keywords if k.arg == "sources"] + node.args[1:2]
        for listed in given:
            if isinstance(listed, (ast.List, ast.Tuple)):
                for item in listed.elts:
                    if isinstance(item, ast.Constant) and isinstance(item.value, str):
                        yield item.lineno, item.value


def read(text: str, nvcc: str | None) -> Demands | None:
    """The demands of the ``setup.py`` ``text`` for nvcc ``nvcc`` ("13.0"); None when the
    file does not parse (then nothing can be said before compiling)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    try:
        version = Version(nvcc) if nvcc else None
    except InvalidVersion:
        version = None
    sure = list(_sure(tree.body, version))
    standards, archs = [], []
    for line, value in _strings(iter(sure)):
        std = _STD.match(value.strip())
        if std:
            standards.append((line, std.group(1)))
        if "arch=" in value or value.startswith(("-arch", "--gpu-architecture")):
            archs += [(line, n) for n in sorted({int(x) for x in _ARCH.findall(value)})]
    every = {m.group(1) for _, v in _strings(ast.walk(tree)) if (m := _STD.match(v.strip()))}
    sources = [(line, s) for line, s in _sources(sure) if _SOURCE.search(s)]
    return Demands(
        standards=tuple(standards),
        archs=tuple(archs),
        sources=tuple(sources),
        any_standards=frozenset(every),
    )


# The oldest arch each CUDA major's nvcc still compiles for: CUDA 13.0 dropped offline
# compilation for Maxwell, Pascal and Volta (sm_50 to sm_72; its release notes), CUDA 12.0
# dropped Kepler (sm_35, sm_37).
_OLDEST = {13: 75, 12: 50, 11: 35}


def oldest_arch(nvcc: str) -> int | None:
    """The oldest ``compute_NN`` nvcc ``nvcc`` accepts, None for a CUDA this table lacks."""
    try:
        return _OLDEST.get(Version(nvcc).major)
    except InvalidVersion:
        return None


# A setup.py is a page or two; one of a megabyte is not read (and nothing is held against it).
_SETUP_LIMIT = 1 << 20


def from_sdist(sdist: Path) -> tuple[str, frozenset[str]]:
    """The sdist's top-level ``setup.py`` text ('' when it has none or it is unreadable) and
    the names of the regular files it holds, relative to its top directory; read from the
    archive, nothing extracted."""
    import tarfile  # only where something compiles: every build imports the modules above

    text, names = "", set()
    with (
        contextlib.suppress(OSError, tarfile.TarError, UnicodeDecodeError),
        tarfile.open(sdist) as tar,
    ):
        for member in tar:
            parts = member.name.split("/", 1)
            if len(parts) != 2 or not member.isfile():
                continue
            names.add(parts[1])
            if parts[1] == "setup.py" and member.size <= _SETUP_LIMIT:
                fh = tar.extractfile(member)
                if fh is not None:
                    text = fh.read().decode("utf-8")
    return text, frozenset(names)
