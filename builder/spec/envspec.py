"""YAML spec file -> :class:`EnvSpec`.

Parse at the edge: nothing past this module touches a raw dict. Every problem in a file is
collected and reported at once as ``FILE:LINE:COL: key.path: message`` (cibuildwheel and
packaging habits), unknown keys get a "did you mean". The file is read by
:mod:`builder.formats.yamldoc` (safe loader only, bounded in size, depth and node count); this module
says what each key means, one validator per top-level key (``_VALIDATORS``). What the
result holds (:class:`EnvSpec`, :class:`Toolchain`, the names a spec may use) is
:mod:`builder.spec.specmodel`'s.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from builder.core import platforms as platforms_mod
from builder.core import remote_cache as remote_cache_mod
from builder.core import variables
from builder.core.cudaversion import CudaVersion
from builder.core.errors import SpecError
from builder.formats.yamldoc import (
    Item,
    Mark,
    Problems,
    compose,
    display,
    kind,
    string,
    strings,
    suggest,
)
from builder.machine import targets as targets_mod
from builder.machine.archs import Arch, cuda_problems
from builder.machine.targets import Target

# The model lives below this module; it is named here too, where every caller reads it.
from builder.spec.specmodel import CHECKS as CHECKS
from builder.spec.specmodel import COMPONENTS as COMPONENTS
from builder.spec.specmodel import DEFAULT_COMPONENTS as DEFAULT_COMPONENTS
from builder.spec.specmodel import TOOLCHAIN_SOURCES as TOOLCHAIN_SOURCES
from builder.spec.specmodel import EnvSpec as EnvSpec
from builder.spec.specmodel import Toolchain as Toolchain
from builder.spec.specmodel import ToolchainSource as ToolchainSource

MAX_SPEC_BYTES = 256 * 1024
MAX_EXTENDS = 8

TOOLCHAIN_KEYS = ("source", "components", "path")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}$")
_PYTHON_RE = re.compile(r"^3\.\d{1,2}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_PACKAGE_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_INDEX_URL_RE = re.compile(r"^(https?|file)://\S+$")


# --------------------------------------------------------------------------- loading


def _load_merged(
    path: Path, problems: Problems, chain: tuple[Path, ...], content: bytes | None = None
) -> dict[str, Item] | None:
    root = compose(path, problems, max_bytes=MAX_SPEC_BYTES, content=content)
    if root is None:
        return None
    assert isinstance(root.value, dict)
    data: dict[str, Item] = dict(root.value)
    ext = data.pop("extends", None)
    if ext is None:
        return data
    if not isinstance(ext.value, str) or not ext.value:
        problems.add(ext.mark, "extends", f"expected a spec file path, got {kind(ext.value)}")
        problems.extends_failed = True
        return data
    try:
        base_path = (path.parent / ext.value).resolve()
        # exists(), not is_file(): a FIFO or a device is there, and compose() says what it
        # is rather than "no such file".
        is_there = base_path.exists()
    except (OSError, ValueError):
        # A NUL byte (ValueError) or a name longer than the OS takes (ENAMETOOLONG) makes these
        # raise where any other bad path is just "no such file"; a spec never ends in a traceback.
        problems.add(ext.mark, "extends", f"not a usable file path: {ext.value!r}")
        problems.extends_failed = True
        return data
    if base_path in chain or base_path == path.resolve():
        problems.add(
            ext.mark, "extends", f"cycle: {ext.value} extends itself (via {display(path)})"
        )
        problems.extends_failed = True
        return data
    if len(chain) >= MAX_EXTENDS:
        problems.add(ext.mark, "extends", f"more than {MAX_EXTENDS} levels of extends")
        problems.extends_failed = True
        return data
    if not is_there:
        problems.add(ext.mark, "extends", f"no such spec file: {ext.value}")
        problems.extends_failed = True
        return data
    base = _load_merged(base_path, problems, (*chain, path.resolve()))
    if base is None:
        problems.extends_failed = True
        return data
    strange = [item for key, item in base.items() if key not in TOP_KEYS]
    if strange:
        first = strange[0]  # the base's own keys, in the file's order
        # `extends: /etc/shadow` reads as a mapping whose keys are its lines: the file is not
        # a spec, and no key or value of it is echoed into a log.
        problems.add(
            ext.mark,
            "extends",
            f"{ext.value} is not a spec: it has {len(strange)} key(s) no spec has, the first "
            f"at {first.key_mark or first.mark} (its text is not shown)",
        )
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


def load(path: str | Path, text: str | None = None) -> EnvSpec:
    """Load and validate one spec file (with its ``extends:`` chain). Raises SpecError.
    ``text``: the file's content, when it is not (or not yet) written at ``path``."""
    path = Path(path)
    problems = Problems()
    data = _load_merged(path, problems, (), None if text is None else text.encode())
    if data is None:
        raise SpecError(problems.messages())
    spec = _validate(data, path, Mark(display(path), 1, 1), problems)
    if problems or spec is None:
        raise SpecError(problems.messages())
    return spec


# --------------------------------------------------------------------------- validation
# One validator per top-level key: it takes the key's item and returns the value of the EnvSpec
# field of the same name, recording every problem it finds (located) in ``problems``. Once any
# problem is recorded no EnvSpec is built, so what a validator returns then is never used
# (None where that is simplest). A key the file leaves out keeps the EnvSpec default.


def _validate(data: dict[str, Item], path: Path, top: Mark, problems: Problems) -> EnvSpec | None:
    strange = [item for key, item in data.items() if key not in TOP_KEYS]
    if strange and len(strange) == len(data):
        # No key a spec has: a file of another kind named by mistake (or by someone who wants
        # its lines printed: /etc/shadow reads as a mapping whose keys are its lines). It is
        # said to be no spec, and none of its text is echoed.
        first = strange[0]
        problems.add(
            top,
            "",
            f"{top.file} is not a spec: none of its {len(strange)} key(s) is a spec's (the "
            f"first at {first.key_mark or first.mark}; its text is not shown)",
        )
        return None
    for key, item in data.items():
        if key not in _VALIDATORS:
            problems.add(item.key_mark or item.mark, key, suggest(key, TOP_KEYS))
    for key in _REQUIRED:
        if key not in data and not problems.extends_failed:
            problems.add(top, key, "required key is missing")
    # Any, not object: EnvSpec's fields are typed per key, which a table cannot carry; the
    # annotations of each validator against its field are checked by a test instead.
    fields: dict[str, Any] = {
        FIELDS.get(key, key): check(data[key], problems)
        for key, check in _VALIDATORS.items()
        if key in data
    }
    fleet = data.get("targets")
    if fleet is not None and isinstance(fleet.value, str):
        # A fleet file's path, relative to this spec: its problems are located in it.
        text = string(fleet, "targets", problems, "a fleet file path")
        if text is not None:
            fields["targets"] = targets_mod.read_file(path.parent / text, problems)
    if problems or any(key not in fields for key in _REQUIRED):
        return None
    if fields.get("targets") and "archs" not in data:
        fields["archs"] = targets_mod.archs_for(
            fields["targets"], CudaVersion.parse(fields["cuda"])
        )
        for problem in cuda_problems(CudaVersion.parse(fields["cuda"]), fields["archs"]):
            problems.add(data["targets"].mark, "targets", problem)
        if problems:
            return None
    return EnvSpec(source=path, **fields)


def _name(item: Item, problems: Problems) -> str | None:
    name = string(item, "name", problems, "a name")
    if name is not None and (not _NAME_RE.fullmatch(name) or ".." in name):
        problems.add(
            item.mark,
            "name",
            f"{name!r} is not a valid env name: letters, digits and '._+-', at most 100, "
            "no '..' or '/' (it names a directory under .envs/)",
        )
        return None
    return name


def _summary(item: Item, problems: Problems) -> str | None:
    return string(item, "summary", problems, "a one-line summary")


def _python(item: Item, problems: Problems) -> str | None:
    if isinstance(item.value, float):
        problems.add(
            item.mark,
            "python",
            f'expected a quoted version like "3.12", got the number '
            f"{item.value} (YAML reads 3.10 as 3.1: quote it)",
        )
        return None
    python = string(item, "python", problems, 'a Python version like "3.12"')
    if python is not None and not _PYTHON_RE.fullmatch(python):
        problems.add(item.mark, "python", f'expected a Python version like "3.12", got {python!r}')
        return None
    return python


def _cuda(item: Item, problems: Problems) -> str | None:
    if isinstance(item.value, (int, float)) and not isinstance(item.value, bool):
        problems.add(
            item.mark,
            "cuda",
            f'expected a quoted CUDA major.minor like "13.0", got the number {item.value}',
        )
        return None
    cuda = string(item, "cuda", problems, 'a CUDA major.minor like "13.0"')
    if cuda is None:
        return None
    try:
        version = CudaVersion.parse(cuda)
    except ValueError:
        problems.add(item.mark, "cuda", f'expected a CUDA major.minor like "13.0", got {cuda!r}')
        return None
    if version.major not in (12, 13):
        problems.add(item.mark, "cuda", f"CUDA {cuda} is not supported: 12.x and 13.x are")
        return None
    return cuda


def _torch(item: Item, problems: Problems) -> str | None:
    raw = item.value
    if raw is None:  # `torch:` left empty: no torch, as when the key is absent
        return None
    # Only a string: YAML reads an unquoted 2.10 as the number 2.1.
    if isinstance(raw, str):
        try:
            if len(Version(raw).release) >= 3:
                return raw
        except InvalidVersion:
            pass
    shown = repr(raw) if isinstance(raw, str) else kind(raw)
    problems.add(
        item.mark, "torch", f'expected an exact torch version like "2.14.1" (quoted), got {shown}'
    )
    return None


def _packages(item: Item, problems: Problems) -> tuple[str, ...]:
    packages: list[str] = []
    seen: dict[str, str] = {}
    for text, sub, sub_path in strings(item, "packages", problems, "PEP 508 requirements"):
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            problems.add(sub.mark, sub_path, f"not a valid requirement: {exc}")
            continue
        cname = canonicalize_name(req.name)
        if cname == "torch":
            problems.add(sub.mark, sub_path, "torch is pinned by the 'torch:' key, not in packages")
            continue
        if cname in seen:
            problems.add(sub.mark, sub_path, f"{req.name} is listed twice (also {seen[cname]!r})")
            continue
        if req.url:
            problems.add(
                sub.mark, sub_path, "direct URL requirements cannot be locked by hash here"
            )
            continue
        seen[cname] = text
        packages.append(text)
    return tuple(packages)


def _toolchain(item: Item, problems: Problems) -> Toolchain | None:
    if not isinstance(item.value, dict):
        problems.add(item.mark, "toolchain", f"expected a mapping, got {kind(item.value)}")
        return None
    data = item.value
    ok = True
    for key, sub in data.items():
        if key not in TOOLCHAIN_KEYS:
            problems.add(sub.key_mark or sub.mark, f"toolchain.{key}", suggest(key, TOOLCHAIN_KEYS))
            ok = False
    source: ToolchainSource = "wheels"
    if "source" in data:
        text = string(data["source"], "toolchain.source", problems, "'wheels' or 'system'")
        known = next((s for s in TOOLCHAIN_SOURCES if s == text), None)
        if known is not None:
            source = known
        else:
            if text is not None:
                problems.add(
                    data["source"].mark,
                    "toolchain.source",
                    f"expected 'wheels' or 'system', got {text!r}",
                )
            ok = False
    components: list[str] = []
    if "components" in data:
        for text, sub, sub_path in strings(
            data["components"], "toolchain.components", problems, "component names"
        ):
            if text not in COMPONENTS:
                problems.add(sub.mark, sub_path, suggest(text, COMPONENTS, "component"))
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
        text = string(data["path"], "toolchain.path", problems, "a toolkit directory")
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


def _archs(item: Item, problems: Problems) -> tuple[Arch, ...] | None:
    if not isinstance(item.value, list):
        problems.add(item.mark, "archs", f"expected a list of archs, got {kind(item.value)}")
        return None
    if not item.value:
        problems.add(item.mark, "archs", "at least one arch is needed")
        return None
    archs: list[Arch] = []
    for i, sub in enumerate(item.value):
        sub_path = f"archs[{i}]"
        if isinstance(sub.value, (int, float)) and not isinstance(sub.value, bool):
            problems.add(
                sub.mark,
                sub_path,
                f'expected a quoted arch like "12.0f", got the number {sub.value}',
            )
            continue
        text = string(sub, sub_path, problems, 'an arch like "12.0f"')
        if text is None:
            continue
        try:
            arch = Arch.parse(text)
        except ValueError as exc:
            problems.add(sub.mark, sub_path, str(exc))
            continue
        if arch in archs:
            problems.add(sub.mark, sub_path, f"{arch} is listed twice")
            continue
        archs.append(arch)
    return tuple(archs)


def _env(item: Item, problems: Problems) -> tuple[tuple[str, str], ...] | None:
    def refused(key: str) -> str | None:
        # The env's own variables (builder/core/variables.py), and the names activation keeps.
        if key in variables.RESERVED or key.upper().startswith(variables.RESERVED_PREFIXES):
            return f"{key} is set by cudaenv itself and cannot be overridden"
        return None

    return _variables(item, problems, "env", refused, "\x00")


# What a source build's own variables may not set: the toolkit, the interpreter and the
# loader are the env's (a spec that moved them would build against another CUDA, or run code
# of its choosing in the build), and the installers' settings belong to the machine.
BUILD_ENV_DENIED = ("PATH", "CUDA_HOME", "CUDA_PATH", "CUDACXX", "BASH_ENV", "ENV", "HOME")
BUILD_ENV_DENIED_PREFIXES = ("LD_", "PYTHON", "PIP_", "UV_", "DYLD_")


def _build_env(item: Item, problems: Problems) -> tuple[tuple[str, str], ...] | None:
    """``build-env:``: variables for every source build of the spec (builder/env/sourcebuild.py),
    read like ``env:`` and passed literally, never through a shell."""

    def refused(key: str) -> str | None:
        if key.upper() in BUILD_ENV_DENIED or key.upper().startswith(BUILD_ENV_DENIED_PREFIXES):
            return (
                f"{key} is the env's own (its toolkit, interpreter or loader) and cannot be "
                "set for a source build"
            )
        return None

    return _variables(item, problems, "build-env", refused, "\x00\n\r")


def _variables(
    item: Item,
    problems: Problems,
    name: str,
    refused: Callable[[str], str | None],
    forbidden: str,
) -> tuple[tuple[str, str], ...] | None:
    """A mapping of variables under the key ``name``: each name valid and not ``refused``,
    each value a string or a number holding none of ``forbidden``."""
    if item.value is None:  # the key left empty: no variables
        return ()
    if not isinstance(item.value, dict):
        problems.add(item.mark, name, f"expected a mapping of variables, got {kind(item.value)}")
        return None
    out: list[tuple[str, str]] = []
    for key, sub in item.value.items():
        # A name with a newline or a control character is quoted: the error stays one line.
        sub_path = f"{name}.{key}" if str(key).isprintable() else f"{name}.{key!r}"
        where = sub.key_mark or sub.mark
        if not _ENV_NAME_RE.fullmatch(key):
            problems.add(where, sub_path, "not a valid environment variable name")
            continue
        why = refused(key)
        if why is not None:
            problems.add(where, sub_path, why)
            continue
        value = sub.value
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            problems.add(sub.mark, sub_path, f"expected a string value, got {kind(value)}")
            continue
        if any(c in str(value) for c in forbidden):
            said = "a NUL byte" if forbidden == "\x00" else "a NUL byte or a line break"
            problems.add(sub.mark, sub_path, f"a value cannot hold {said}")
            continue
        out.append((key, str(value)))
    return tuple(out)


def _verify(item: Item, problems: Problems) -> tuple[str, ...]:
    verify: list[str] = []
    for text, sub, sub_path in strings(item, "verify", problems, "check names"):
        if text not in CHECKS:
            problems.add(sub.mark, sub_path, suggest(text, CHECKS, "check"))
        elif text not in verify:
            verify.append(text)
    return tuple(verify)


def _indexes(item: Item, problems: Problems) -> tuple[tuple[str, str], ...] | None:
    if not isinstance(item.value, dict):
        problems.add(
            item.mark,
            "indexes",
            f"expected a mapping of package -> index URL, got {kind(item.value)}",
        )
        return None
    indexes: list[tuple[str, str]] = []
    for key, sub in item.value.items():
        sub_path = f"indexes.{key}"
        where = sub.key_mark or sub.mark
        if not _PACKAGE_KEY_RE.fullmatch(key):
            problems.add(where, sub_path, "not a package name")
            continue
        url = sub.value
        if not isinstance(url, str) or not _INDEX_URL_RE.fullmatch(url):
            problems.add(
                sub.mark, sub_path, f"expected an index URL (https://.../simple), got {kind(url)}"
            )
            continue
        indexes.append((str(canonicalize_name(key)), url.rstrip("/")))
    return tuple(indexes)


def _platforms(item: Item, problems: Problems) -> tuple[str, ...] | None:
    found: list[str] = []
    for text, sub, sub_path in strings(item, "platforms", problems, "platform names"):
        if text not in platforms_mod.KNOWN:
            problems.add(sub.mark, sub_path, suggest(text, platforms_mod.DEFAULT, "platform"))
        elif text not in found:
            found.append(text)
    if not found and isinstance(item.value, list) and not item.value:
        problems.add(item.mark, "platforms", "name at least one platform")
    return tuple(found)


def _remote_cache(item: Item, problems: Problems) -> str | None:
    """A Redis URL. Its password, if the server asks one, is given at run time: what a spec
    says is shared with it and written into the env's activation scripts."""
    text = string(item, "remote-cache", problems, "a redis://HOST[:PORT][/DB] URL")
    if text is None:
        return None
    try:
        found = remote_cache_mod.parse(text)
    except remote_cache_mod.RemoteCacheError as exc:
        problems.add(item.mark, "remote-cache", str(exc))
        return None
    if found.password:
        problems.add(
            item.mark,
            "remote-cache",
            "a password in a spec is shared with the spec and written into the env's "
            "activation scripts: leave it out and give it at run time in "
            "CUDAENV_REMOTE_CACHE_PASSWORD",
        )
        return None
    return text


def _targets(item: Item, problems: Problems) -> tuple[Target, ...] | None:
    """An inline list of targets. A fleet file's path (a string) is read by _validate, which
    knows the spec's directory."""
    if isinstance(item.value, str):
        return None
    return targets_mod.parse(item, "targets", problems)


# Keyed by the EnvSpec field each fills; the order is the one "expected one of: ..." lists.
_VALIDATORS: dict[str, Callable[[Item, Problems], object]] = {
    "name": _name,
    "summary": _summary,
    "python": _python,
    "cuda": _cuda,
    "torch": _torch,
    "packages": _packages,
    "toolchain": _toolchain,
    "archs": _archs,
    "env": _env,
    "build-env": _build_env,
    "verify": _verify,
    "indexes": _indexes,
    "platforms": _platforms,
    "targets": _targets,
    "remote-cache": _remote_cache,
}
# A key whose EnvSpec field is spelled otherwise.
FIELDS = {"remote-cache": "remote_cache", "build-env": "build_env"}
_REQUIRED = ("name", "python", "cuda")
# `extends` is the loader's: _load_merged consumes it while merging the base, before validation.
# It is listed after name and summary, where it has always stood in "expected one of: ...".
_KEYS = tuple(_VALIDATORS)
TOP_KEYS = (*_KEYS[:2], "extends", *_KEYS[2:])
