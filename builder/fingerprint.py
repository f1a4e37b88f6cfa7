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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from builder import caches, doctor
from builder.errors import ReportError
from builder.paths import jit_store_dir
from builder.probe import jit_store

SCHEMA_VERSION = 1
# What changes a compile or the kernels' behaviour besides the packages and the toolkit.
VARIABLES = (
    "FLASHINFER_CUDA_ARCH_LIST",
    "TORCH_CUDA_ARCH_LIST",
    "NVCC_PREPEND_FLAGS",
    "NVCC_APPEND_FLAGS",
    "NVCC_CCBIN",
    "CUDA_HOME",
    *caches.VARIABLES,
)


def _relative(value: str | None, prefix: str) -> str | None:
    """``value`` with the env's own path written as ``ENV``: the same env at another path
    (another node, another --env-dir) gives the same text."""
    if not value or not prefix:
        return value
    return jit_store.normalise(value, jit_store.env_roots(prefix), placeholder="ENV")


def parts_of(facts: doctor.Facts) -> dict[str, Any]:
    """The fingerprint's parts, each a plain JSON value, from the doctor probe's facts."""
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
    return {
        "python": facts.python_version,
        "distributions": dict(sorted(facts.dists.items())),
        "toolkit": {
            "cuda_home": _relative(home.path if home else None, facts.prefix),
            "nvcc_release": home.release if home else None,
            "binaries": tools,
        },
        "variables": {v: _relative(facts.env.get(v), facts.prefix) for v in VARIABLES},
    }


def digest(parts: Mapping[str, Any]) -> str:
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def document(python: Path | str, facts: doctor.Facts) -> dict[str, Any]:
    parts = parts_of(facts)
    return {
        "schema_version": SCHEMA_VERSION,
        "python": str(python),
        "fingerprint": digest(parts),
        "parts": parts,
    }


def read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ReportError(f"{path}: cannot read ({exc.strerror})") from exc
    except ValueError as exc:
        raise ReportError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION:
        raise ReportError(
            f"{path}: not a fingerprint of this cudaenv (write it with `cudaenv fingerprint --json`)"
        )
    if not isinstance(doc.get("parts"), dict):
        raise ReportError(f"{path}: parts: expected an object")
    return doc


def differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Each difference of two fingerprints' parts, one line each: ``KEY: A -> B``."""
    out: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for key in sorted(set(x) | set(y)):
                walk(x.get(key), y.get(key), f"{path}.{key}" if path else str(key))
        elif x != y:
            out.append(f"{path}: {_show(x)} -> {_show(y)}")

    walk(a, b, "")
    return out


def _show(value: Any) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]  # a content hash: enough to tell two apart
    return str(value)
