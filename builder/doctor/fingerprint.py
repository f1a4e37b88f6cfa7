"""``cudaenv fingerprint``: one hash of what decides JIT results and kernel behaviour.

A multi-node deployment runs it on every node before launch: a CUDA 13 JIT cache reused by
CUDA 12.9 Ray workers (flashinfer#5145) or a cache shared over NFS across different envs
(sglang#31347) shows up as two fingerprints, and ``--compare`` names each difference.

The parts: the installed distributions and versions, the toolkit the JIT uses (its release
and the content of nvcc, cicc, ptxas and the other binaries), the host compiler's content,
the arch lists and the variables that change a compile. Paths inside the env are written
relative to it, so two envs of one lock at different paths (or on different nodes) agree.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from builder import store as jit_store
from builder.core import variables
from builder.core.errors import ReportError
from builder.core.paths import jit_store_dir
from builder.doctor import diagnose as doctor
from builder.formats import codec, jsondoc

SCHEMA_VERSION = 1
# What changes a compile or the kernels' behaviour besides the packages and the toolkit: every
# variable the start-up hook sets among them (builder/core/variables.py).
VARIABLES = variables.FINGERPRINT


@dataclass(frozen=True, kw_only=True)
class Toolkit:
    cuda_home: str | None  # relative to the env: ENV/cuda-home
    nvcc_release: str | None
    binaries: tuple[tuple[str, str | None], ...]  # bin/nvcc, host:c++, env:NVCC_* -> content


@dataclass(frozen=True, kw_only=True)
class Parts:
    """What the hash is taken of, each part a plain JSON value once written."""

    python: str
    distributions: tuple[tuple[str, str], ...]
    toolkit: Toolkit
    variables: tuple[tuple[str, str | None], ...]

    def to_json(self) -> dict[str, Any]:
        return codec.to_json(self)


@dataclass(frozen=True, kw_only=True)
class Fingerprint:
    """What ``cudaenv fingerprint --json`` writes and ``--compare`` reads."""

    python: str  # the interpreter it was taken of
    fingerprint: str  # "sha256:..." of the parts
    parts: Parts

    json_form: ClassVar[codec.Form] = codec.Form(head={"schema_version": SCHEMA_VERSION})

    def to_json(self) -> dict[str, Any]:
        return codec.to_json(self)

    @classmethod
    def from_json(cls, doc: object, where: str) -> Fingerprint:
        return codec.from_json(cls, doc, where)


def _relative(value: str | None, prefix: str) -> str | None:
    """``value`` with the env's own path written as ``ENV``: the same env at another path
    (another node, another --env-dir) gives the same text."""
    if not value or not prefix:
        return value
    return jit_store.normalise(value, jit_store.env_roots(prefix), placeholder="ENV")


def parts_of(facts: doctor.Facts) -> Parts:
    """The fingerprint's parts, from the doctor probe's facts."""
    home = facts.jit_home
    root = jit_store_dir()
    hasher = jit_store.Hasher(root / "identities.json" if root else None)
    tools: dict[str, str | None] = {}
    if home is not None and home.path:
        compilers = [facts.cxx] if facts.cxx else []
        env = {k: v for k, v in facts.env.items() if v is not None}
        tools = jit_store.tool_identities(hasher, home.path, compilers, env)
        # The host compiler by content, not by where it sits on this node.
        tools = {("host:c++" if k.startswith("host:") else k): v for k, v in tools.items()}
    hasher.save()
    return Parts(
        python=facts.python_version,
        distributions=tuple(sorted(facts.dists.items())),
        toolkit=Toolkit(
            cuda_home=_relative(home.path if home else None, facts.prefix),
            nvcc_release=home.release if home else None,
            binaries=tuple(tools.items()),
        ),
        variables=tuple((v, _relative(facts.env.get(v), facts.prefix)) for v in VARIABLES),
    )


def digest(parts: Parts) -> str:
    blob = json.dumps(parts.to_json(), sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def document(python: Path | str, facts: doctor.Facts) -> Fingerprint:
    parts = parts_of(facts)
    return Fingerprint(python=str(python), fingerprint=digest(parts), parts=parts)


def read(path: Path) -> Fingerprint:
    doc = jsondoc.load(path, "fingerprint")
    if not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION:
        raise ReportError(
            f"{path}: not a fingerprint of this cudaenv (write it with `cudaenv fingerprint --json`)"
        )
    return Fingerprint.from_json(doc, str(path))


def differences(a: Parts, b: Parts) -> list[str]:
    """Each difference of two fingerprints' parts, one line each: ``KEY: A -> B``."""
    out: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for key in sorted(set(x) | set(y)):
                walk(x.get(key), y.get(key), f"{path}.{key}" if path else str(key))
        elif x != y:
            out.append(f"{path}: {_show(x)} -> {_show(y)}")

    walk(a.to_json(), b.to_json(), "")
    return out


def _show(value: Any) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]  # a content hash: enough to tell two apart
    return str(value)
