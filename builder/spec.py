"""YAML spec file -> :class:`EnvSpec`.

Parse at the edge: nothing past this module touches a raw dict. Every problem in a file is
collected and reported at once as ``FILE:LINE:COL: key.path: message`` (cibuildwheel and
packaging habits), unknown keys get a "did you mean". YAML is composed with the safe loader
only, and the input is bounded (size, depth, node count) so no spec can hang or exhaust the
builder.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import yaml
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from builder.errors import SpecError

# libyaml's safe loader when PyYAML has it (10x faster, same marks); the pure one otherwise.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

MAX_SPEC_BYTES = 256 * 1024
MAX_DEPTH = 32
MAX_NODES = 20_000
MAX_EXTENDS = 8

TOP_KEYS = (
    "name",
    "summary",
    "extends",
    "python",
    "cuda",
    "torch",
    "packages",
    "toolchain",
    "archs",
    "env",
    "verify",
    "indexes",
)
TOOLCHAIN_KEYS = ("source", "components", "path")
TOOLCHAIN_SOURCES = ("wheels", "system")
# Extras of NVIDIA's `cuda-toolkit` metapackage that make sense for a JIT toolchain (FACTS §2).
COMPONENTS = (
    "nvcc",
    "cudart",
    "crt",
    "nvvm",
    "cccl",
    "cublas",
    "cufft",
    "curand",
    "cusolver",
    "cusparse",
    "nvjitlink",
    "nvrtc",
    "cupti",
    "nvtx",
    "cuobjdump",
    "nvdisasm",
)
CHECKS = ("toolchain", "kernel-compile", "flashinfer-jit", "cubin", "sampling")
# Variables the env sets itself (toolchain.py); a spec may not override them.
RESERVED_ENV = (
    "CUDA_HOME",
    "CUDA_PATH",
    "PATH",
    "FLASHINFER_CUDA_ARCH_LIST",
    "TORCH_CUDA_ARCH_LIST",
    "FLASHINFER_WORKSPACE_BASE",
    "VIRTUAL_ENV",
    "PYTHONHOME",
)
DEFAULT_COMPONENTS = ("nvcc", "cudart", "crt", "nvvm", "cccl")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}$")
_PYTHON_RE = re.compile(r"^3\.\d{1,2}$")
_CUDA_RE = re.compile(r"^(\d{2})\.(\d{1,2})$")
_ARCH_RE = re.compile(r"^(\d{1,2})\.(\d)([af]?)$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True, kw_only=True)
class Toolchain:
    source: str = "wheels"
    components: tuple[str, ...] = DEFAULT_COMPONENTS
    path: Path | None = None


@dataclass(frozen=True, kw_only=True)
class Arch:
    """A CUDA target as FlashInfer spells it: ``12.0f`` = major 12, minor 0, suffix ``f``."""

    major: int
    minor: int
    suffix: str = ""

    @classmethod
    def parse(cls, text: str) -> Arch:
        m = _ARCH_RE.match(text)
        if not m:
            raise ValueError(f"expected an arch like '9.0a', '10.0a' or '12.0f', got {text!r}")
        return cls(major=int(m.group(1)), minor=int(m.group(2)), suffix=m.group(3))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{self.suffix}"

    @property
    def sm(self) -> str:
        """``sm_120f`` style, as nvcc's ``-arch``/``code=`` take it."""
        return f"sm_{self.major}{self.minor}{self.suffix}"

    @property
    def cubin_sm(self) -> str:
        """What ``cuobjdump --list-elf`` names the cubin (the suffix is not kept there)."""
        return f"sm_{self.major}{self.minor}"


@dataclass(frozen=True, kw_only=True)
class EnvSpec:
    name: str
    python: str
    cuda: str
    source: Path
    summary: str = ""
    torch: str | None = None
    packages: tuple[str, ...] = ()
    toolchain: Toolchain = field(default_factory=Toolchain)
    archs: tuple[str, ...] = ("12.0f",)
    env: tuple[tuple[str, str], ...] = ()
    verify: tuple[str, ...] = CHECKS
    # package -> the only index it may come from (uv explicit index + source, then the exact
    # file URL and hash in the lock): a same-named package elsewhere cannot be substituted.
    indexes: tuple[tuple[str, str], ...] = ()

    @property
    def cuda_major(self) -> int:
        return int(self.cuda.split(".")[0])

    @property
    def cuda_minor(self) -> int:
        return int(self.cuda.split(".")[1])

    @property
    def arch_list(self) -> tuple[Arch, ...]:
        return tuple(Arch.parse(a) for a in self.archs)

    def fingerprint(self) -> str:
        """sha256 over what decides the resolution; a lock carries it (lock.py).

        ``archs``, ``env``, ``verify`` and ``summary`` do not change what is installed, so
        editing them does not force a re-lock.
        """
        doc = {
            "python": self.python,
            "cuda": self.cuda,
            "torch": self.torch,
            "packages": sorted(self.packages),
            "toolchain": {
                "source": self.toolchain.source,
                "components": sorted(self.toolchain.components),
            },
        }
        if self.indexes:  # only when set, so locks of specs without it stay valid
            doc["indexes"] = dict(sorted(self.indexes))
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()


# --------------------------------------------------------------------------- YAML with marks


@dataclass(frozen=True)
class Mark:
    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


Value = Union[None, bool, int, float, str, "list[Item]", "dict[str, Item]"]


@dataclass(frozen=True)
class Item:
    value: Value
    mark: Mark
    key_mark: Mark | None = None


class _Problems:
    def __init__(self) -> None:
        self.items: list[tuple[str, int, int, str]] = []
        # A base that failed to load makes "required key is missing" noise: say it once.
        self.extends_failed = False

    def add(self, mark: Mark, path: str, message: str) -> None:
        prefix = f"{path}: " if path else ""
        self.items.append((mark.file, mark.line, mark.col, f"{mark}: {prefix}{message}"))

    def __bool__(self) -> bool:
        return bool(self.items)

    def messages(self) -> list[str]:
        seen: dict[str, None] = {}
        for item in sorted(self.items, key=lambda t: (t[0], t[1], t[2])):
            seen.setdefault(item[3], None)
        return list(seen)


def _mark(file: str, node: yaml.Node) -> Mark:
    return Mark(file, node.start_mark.line + 1, node.start_mark.column + 1)


class _Composer:
    """yaml.Node -> Item, bounded in depth and node count (alias bombs expand here)."""

    def __init__(self, file: str, problems: _Problems) -> None:
        self.file = file
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
            raise _Abort(mark, path, f"YAML tag {node.tag!r} is not allowed: a spec is plain data")
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


_PLAIN_TAGS = frozenset(
    f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map", "merge")
)


class _Abort(Exception):
    def __init__(self, mark: Mark, path: str, message: str) -> None:
        self.mark, self.path, self.message = mark, path, message


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


def _compose(path: Path, display: str, problems: _Problems) -> Item | None:
    try:
        size = path.stat().st_size
        if size > MAX_SPEC_BYTES:
            problems.add(
                Mark(display, 1, 1), "", f"file is {size} bytes; a spec is at most {MAX_SPEC_BYTES}"
            )
            return None
        raw = path.read_bytes()
    except OSError as exc:
        problems.add(Mark(display, 1, 1), "", f"cannot read: {exc.strerror}")
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        problems.add(Mark(display, line, col), "", f"not UTF-8 (byte 0x{raw[exc.start]:02x})")
        return None
    try:
        node = yaml.compose(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as exc:
        m = exc.problem_mark or exc.context_mark
        mark = Mark(display, m.line + 1, m.column + 1) if m else Mark(display, 1, 1)
        problems.add(mark, "", f"invalid YAML: {exc.problem or exc.context}")
        return None
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        problems.add(Mark(display, 1, 1), "", f"invalid YAML: {exc}")
        return None
    if node is None:
        problems.add(Mark(display, 1, 1), "", "the file is empty; a spec is a YAML mapping")
        return None
    composer = _Composer(display, problems)
    try:
        root = composer.convert(node, "")
    except _Abort as abort:
        problems.add(abort.mark, abort.path, abort.message)
        return None
    except RecursionError:
        problems.add(Mark(display, 1, 1), "", f"nested deeper than {MAX_DEPTH} levels")
        return None
    if not isinstance(root.value, dict):
        problems.add(root.mark, "", f"a spec is a YAML mapping, got {_kind(root.value)}")
        return None
    return root


def _kind(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return f"the number {v}"
    if isinstance(v, float):
        return f"the number {v}"
    if isinstance(v, str):
        return f"the string {v!r}"
    if isinstance(v, list):
        return "a list"
    return "a mapping"


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------- loading


def _load_merged(
    path: Path, problems: _Problems, chain: tuple[Path, ...]
) -> dict[str, Item] | None:
    display = _display(path)
    root = _compose(path, display, problems)
    if root is None:
        return None
    assert isinstance(root.value, dict)
    data: dict[str, Item] = dict(root.value)
    ext = data.pop("extends", None)
    if ext is None:
        return data
    if not isinstance(ext.value, str) or not ext.value:
        problems.add(ext.mark, "extends", f"expected a spec file path, got {_kind(ext.value)}")
        problems.extends_failed = True
        return data
    base_path = (path.parent / ext.value).resolve()
    if base_path in chain or base_path == path.resolve():
        problems.add(ext.mark, "extends", f"cycle: {ext.value} extends itself (via {display})")
        problems.extends_failed = True
        return data
    if len(chain) >= MAX_EXTENDS:
        problems.add(ext.mark, "extends", f"more than {MAX_EXTENDS} levels of extends")
        problems.extends_failed = True
        return data
    if not base_path.is_file():
        problems.add(ext.mark, "extends", f"no such spec file: {ext.value}")
        problems.extends_failed = True
        return data
    base = _load_merged(base_path, problems, (*chain, path.resolve()))
    if base is None:
        problems.extends_failed = True
        return data
    merged = dict(base)
    for key, item in data.items():
        old = merged.get(key)
        # Mappings merge one level deep (toolchain, env); everything else replaces.
        if old is not None and isinstance(old.value, dict) and isinstance(item.value, dict):
            merged[key] = Item({**old.value, **item.value}, item.mark, item.key_mark)
        else:
            merged[key] = item
    return merged


def load(path: str | Path) -> EnvSpec:
    """Load and validate one spec file (with its ``extends:`` chain). Raises SpecError."""
    path = Path(path)
    problems = _Problems()
    data = _load_merged(path, problems, ())
    if data is None:
        raise SpecError(problems.messages())
    spec = _validate(data, path, Mark(_display(path), 1, 1), problems)
    if problems or spec is None:
        raise SpecError(problems.messages())
    return spec


def _suggest(key: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean '{close[0]}'?"
    return f"unknown key; expected one of: {', '.join(known)}"


def _string(item: Item, path: str, problems: _Problems, what: str) -> str | None:
    if isinstance(item.value, str) and item.value.strip():
        return item.value.strip()
    problems.add(item.mark, path, f"expected {what}, got {_kind(item.value)}")
    return None


def _strings(
    item: Item, path: str, problems: _Problems, what: str
) -> Iterator[tuple[str, Item, str]]:
    if not isinstance(item.value, list):
        problems.add(item.mark, path, f"expected a list of {what}, got {_kind(item.value)}")
        return
    for i, sub in enumerate(item.value):
        sub_path = f"{path}[{i}]"
        text = _string(sub, sub_path, problems, what)
        if text is not None:
            yield text, sub, sub_path


def _validate(data: dict[str, Item], path: Path, top: Mark, problems: _Problems) -> EnvSpec | None:
    for key, top_item in data.items():
        if key not in TOP_KEYS:
            problems.add(top_item.key_mark or top_item.mark, key, _suggest(key, TOP_KEYS))

    def need(key: str) -> Item | None:
        if key not in data:
            if not problems.extends_failed:
                problems.add(top, key, "required key is missing")
            return None
        return data[key]

    name = python = cuda = None
    if (item := need("name")) is not None:
        name = _string(item, "name", problems, "a name")
        if name is not None and (not _NAME_RE.match(name) or ".." in name):
            problems.add(
                item.mark,
                "name",
                f"{name!r} is not a valid env name: letters, digits and '._+-', at most 100, "
                "no '..' or '/' (it names a directory under .envs/)",
            )
            name = None
    summary = ""
    if "summary" in data:
        summary = _string(data["summary"], "summary", problems, "a one-line summary") or ""
    if (item := need("python")) is not None:
        if isinstance(item.value, float):
            problems.add(
                item.mark,
                "python",
                f'expected a quoted version like "3.12", got the number '
                f"{item.value} (YAML reads 3.10 as 3.1: quote it)",
            )
        else:
            python = _string(item, "python", problems, 'a Python version like "3.12"')
            if python is not None and not _PYTHON_RE.match(python):
                problems.add(
                    item.mark, "python", f'expected a Python version like "3.12", got {python!r}'
                )
                python = None
    if (item := need("cuda")) is not None:
        if isinstance(item.value, (int, float)) and not isinstance(item.value, bool):
            problems.add(
                item.mark,
                "cuda",
                f'expected a quoted CUDA major.minor like "13.0", got the number {item.value}',
            )
        else:
            cuda = _string(item, "cuda", problems, 'a CUDA major.minor like "13.0"')
            m = _CUDA_RE.match(cuda or "")
            if cuda is not None and not m:
                problems.add(
                    item.mark, "cuda", f'expected a CUDA major.minor like "13.0", got {cuda!r}'
                )
                cuda = None
            elif m and int(m.group(1)) not in (12, 13):
                problems.add(item.mark, "cuda", f"CUDA {cuda} is not supported: 12.x and 13.x are")
                cuda = None
    torch = None
    if "torch" in data and data["torch"].value is not None:
        entry = data["torch"]
        raw = entry.value
        text = (
            str(raw) if isinstance(raw, (int, float, str)) and not isinstance(raw, bool) else None
        )
        try:
            if text is None or not isinstance(raw, str):
                raise InvalidVersion(str(raw))
            version = Version(text)
            if len(version.release) < 3:
                raise InvalidVersion(text)
            torch = text
        except InvalidVersion:
            shown = repr(raw) if isinstance(raw, str) else _kind(raw)
            problems.add(
                entry.mark,
                "torch",
                f'expected an exact torch version like "2.14.1" (quoted), got {shown}',
            )
    packages: list[str] = []
    if "packages" in data:
        seen: dict[str, str] = {}
        for text, sub, sub_path in _strings(
            data["packages"], "packages", problems, "PEP 508 requirements"
        ):
            try:
                req = Requirement(text)
            except InvalidRequirement as exc:
                problems.add(sub.mark, sub_path, f"not a valid requirement: {exc}")
                continue
            cname = canonicalize_name(req.name)
            if cname == "torch":
                problems.add(
                    sub.mark, sub_path, "torch is pinned by the 'torch:' key, not in packages"
                )
                continue
            if cname in seen:
                problems.add(
                    sub.mark, sub_path, f"{req.name} is listed twice (also {seen[cname]!r})"
                )
                continue
            if req.url:
                problems.add(
                    sub.mark, sub_path, "direct URL requirements cannot be locked by hash here"
                )
                continue
            seen[cname] = text
            packages.append(text)
    toolchain = _toolchain(data.get("toolchain"), problems)
    archs: list[str] = []
    if "archs" in data:
        entry = data["archs"]
        if isinstance(entry.value, list):
            for i, sub in enumerate(entry.value):
                sub_path = f"archs[{i}]"
                if isinstance(sub.value, (int, float)) and not isinstance(sub.value, bool):
                    problems.add(
                        sub.mark,
                        sub_path,
                        f'expected a quoted arch like "12.0f", got the number {sub.value}',
                    )
                    continue
                text = _string(sub, sub_path, problems, 'an arch like "12.0f"')
                if text is None:
                    continue
                try:
                    arch = str(Arch.parse(text))
                except ValueError as exc:
                    problems.add(sub.mark, sub_path, str(exc))
                    continue
                if arch in archs:
                    problems.add(sub.mark, sub_path, f"{arch} is listed twice")
                    continue
                archs.append(arch)
            if not entry.value:
                problems.add(entry.mark, "archs", "at least one arch is needed")
        else:
            problems.add(entry.mark, "archs", f"expected a list of archs, got {_kind(entry.value)}")
    env: list[tuple[str, str]] = []
    if "env" in data:
        entry = data["env"]
        if isinstance(entry.value, dict):
            for key, sub in entry.value.items():
                sub_path = f"env.{key}"
                where = sub.key_mark or sub.mark
                if not _ENV_NAME_RE.match(key):
                    problems.add(where, sub_path, "not a valid environment variable name")
                    continue
                if key in RESERVED_ENV:
                    problems.add(
                        where, sub_path, f"{key} is set by cudaenv itself and cannot be overridden"
                    )
                    continue
                value = sub.value
                if isinstance(value, bool) or not isinstance(value, (str, int)):
                    problems.add(sub.mark, sub_path, f"expected a string value, got {_kind(value)}")
                    continue
                if "\x00" in str(value):
                    problems.add(sub.mark, sub_path, "a value cannot hold a NUL byte")
                    continue
                env.append((key, str(value)))
        elif entry.value is not None:
            problems.add(
                entry.mark, "env", f"expected a mapping of variables, got {_kind(entry.value)}"
            )
    indexes: list[tuple[str, str]] = []
    if "indexes" in data:
        entry = data["indexes"]
        if isinstance(entry.value, dict):
            for key, sub in entry.value.items():
                sub_path = f"indexes.{key}"
                where = sub.key_mark or sub.mark
                if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", key):
                    problems.add(where, sub_path, "not a package name")
                    continue
                url = sub.value
                if not isinstance(url, str) or not re.match(r"^(https?|file)://\S+$", url):
                    problems.add(
                        sub.mark,
                        sub_path,
                        f"expected an index URL (https://.../simple), got {_kind(url)}",
                    )
                    continue
                indexes.append((str(canonicalize_name(key)), url.rstrip("/")))
        else:
            problems.add(
                entry.mark,
                "indexes",
                f"expected a mapping of package -> index URL, got {_kind(entry.value)}",
            )
    verify: list[str] = []
    if "verify" in data:
        for text, sub, sub_path in _strings(data["verify"], "verify", problems, "check names"):
            if text not in CHECKS:
                close = difflib.get_close_matches(text, CHECKS, n=1, cutoff=0.6)
                hint = (
                    f"; did you mean '{close[0]}'?"
                    if close
                    else f"; expected one of: {', '.join(CHECKS)}"
                )
                problems.add(sub.mark, sub_path, f"unknown check {text!r}{hint}")
            elif text not in verify:
                verify.append(text)
    if problems or name is None or python is None or cuda is None or toolchain is None:
        return None
    return EnvSpec(
        name=name,
        summary=summary,
        python=python,
        cuda=cuda,
        torch=torch,
        packages=tuple(packages),
        toolchain=toolchain,
        archs=tuple(archs) if "archs" in data else ("12.0f",),
        env=tuple(env),
        verify=tuple(verify) if "verify" in data else CHECKS,
        indexes=tuple(indexes),
        source=path,
    )


def _toolchain(item: Item | None, problems: _Problems) -> Toolchain | None:
    if item is None:
        return Toolchain()
    if not isinstance(item.value, dict):
        problems.add(item.mark, "toolchain", f"expected a mapping, got {_kind(item.value)}")
        return None
    data = item.value
    ok = True
    for key, sub in data.items():
        if key not in TOOLCHAIN_KEYS:
            problems.add(
                sub.key_mark or sub.mark, f"toolchain.{key}", _suggest(key, TOOLCHAIN_KEYS)
            )
            ok = False
    source = "wheels"
    if "source" in data:
        text = _string(data["source"], "toolchain.source", problems, "'wheels' or 'system'")
        if text is not None and text not in TOOLCHAIN_SOURCES:
            problems.add(
                data["source"].mark,
                "toolchain.source",
                f"expected 'wheels' or 'system', got {text!r}",
            )
            ok = False
        elif text is None:
            ok = False
        else:
            source = text
    components: list[str] = []
    if "components" in data:
        for text, sub, sub_path in _strings(
            data["components"], "toolchain.components", problems, "component names"
        ):
            if text not in COMPONENTS:
                close = difflib.get_close_matches(text, COMPONENTS, n=1, cutoff=0.6)
                hint = (
                    f"; did you mean '{close[0]}'?"
                    if close
                    else f"; expected one of: {', '.join(COMPONENTS)}"
                )
                problems.add(sub.mark, sub_path, f"unknown component {text!r}{hint}")
                ok = False
            elif text not in components:
                components.append(text)
        if source == "wheels" and components and "nvcc" not in components:
            problems.add(
                data["components"].mark, "toolchain.components", "a wheels toolchain needs 'nvcc'"
            )
            ok = False
    tool_path: Path | None = None
    if "path" in data:
        text = _string(data["path"], "toolchain.path", problems, "a toolkit directory")
        if text is not None:
            if not text.startswith("/"):
                problems.add(
                    data["path"].mark, "toolchain.path", f"expected an absolute path, got {text!r}"
                )
                ok = False
            tool_path = Path(text)
        else:
            ok = False
    if source == "system" and tool_path is None and "path" not in data:
        problems.add(item.mark, "toolchain.path", "required when source is 'system'")
        ok = False
    if source == "wheels" and "path" in data:
        problems.add(data["path"].mark, "toolchain.path", "only used when source is 'system'")
        ok = False
    if not ok:
        return None
    return Toolchain(
        source=source,
        components=tuple(components) if components else DEFAULT_COMPONENTS,
        path=tool_path,
    )
