"""An entry's format: keys and variants, the document that records an entry's content, files
and inputs (checked as it is read), and where an entry lies in the store."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import EntryError
from .ninja_files import LOG_HASHES
from .trust import is_file_name

VERSION = "v3"  # the entry format; v3: each file's size and sha256 recorded, inputs required


# What an entry says about where and when it was made: kept locally, not part of its
# content (two machines that compile one key publish the same content).
PROVENANCE = ("env", "first_built", "origin")
KINDS = ("ninja", "topk_topp", "wheel")

_HEX = frozenset("0123456789abcdef")


def is_key(text: str) -> bool:
    return len(text) == 64 and set(text) <= _HEX


def is_variant(text: str) -> bool:
    return len(text) == 16 and set(text) <= _HEX


@dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str


@dataclass(frozen=True)
class Entry:
    """One variant of a key as read back and checked: its content (what two machines that
    compiled it publish alike), its files' records, and where and when it was made."""

    key: str
    path: Path
    content: dict[str, Any]
    files: dict[str, FileRecord]
    inputs: dict[str, str]
    provenance: dict[str, str]

    @property
    def meta(self) -> dict[str, Any]:
        return {**self.content, **self.provenance}

    @property
    def variant(self) -> str:
        return self.path.name


def variant_of(inputs: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(inputs), sort_keys=True).encode()).hexdigest()[:16]


def parse_entry(doc: Any) -> tuple[dict[str, Any], dict[str, FileRecord], dict[str, str]]:
    """An entry document checked: its content, files and inputs; EntryError naming the key."""
    if not isinstance(doc, dict):
        raise EntryError("an entry is a JSON object")
    content = {k: v for k, v in doc.items() if k not in PROVENANCE}
    files_doc, inputs = content.get("files"), content.get("inputs")
    if not isinstance(files_doc, dict) or not files_doc:
        raise EntryError("'files': an entry records at least one file")
    files: dict[str, FileRecord] = {}
    for name, record in files_doc.items():
        if not is_file_name(name):
            raise EntryError(f"'files': {name!r} is not a file name inside the entry")
        if not (
            isinstance(record, dict)
            and isinstance(record.get("size"), int)
            and record["size"] >= 0
            and isinstance(record.get("sha256"), str)
            and is_key(record["sha256"])
        ):
            raise EntryError(f"'files': {name!r} needs a size and a sha256")
        files[name] = FileRecord(record["size"], record["sha256"])
    if not isinstance(inputs, dict) or not inputs:
        raise EntryError("'inputs': an entry records at least one input it was compiled from")
    for path, digest in inputs.items():
        if not (isinstance(path, str) and path and isinstance(digest, str) and is_key(digest)):
            raise EntryError(f"'inputs': {path!r} needs a sha256")
    kind = content.get("kind")
    if kind not in KINDS:
        raise EntryError(f"'kind': {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "topk_topp" and "kernel" not in files:
        raise EntryError("'files': a kernel entry holds 'kernel'")
    if kind == "wheel" and (
        set(files) != {"wheel"} or not _is_wheel_name(content.get("wheel_name"))
    ):
        raise EntryError("'files': a wheel entry holds 'wheel' alone, named by 'wheel_name'")
    if kind == "ninja":
        outputs, file_of, deps = content.get("outputs"), content.get("file_of"), content.get("deps")
        if content.get("ninja_log") not in LOG_HASHES:
            raise EntryError(f"'ninja_log': {content.get('ninja_log')!r} is not a known format")
        if not (
            isinstance(outputs, list)
            and isinstance(file_of, dict)
            and all(isinstance(o, str) for o in outputs)
            and set(file_of) == set(outputs)
            and all(f in files for f in file_of.values())
        ):
            raise EntryError("'outputs', 'file_of': each output is one of the entry's files")
        if not (
            isinstance(deps, dict)
            and all(
                isinstance(v, list) and all(isinstance(d, str) for d in v) for v in deps.values()
            )
        ):
            raise EntryError("'deps': lists of file names")
    return content, files, {str(k): str(v) for k, v in inputs.items()}


def split_entry(rel: str) -> tuple[str, str] | None:
    """``v3/ab/KEY/VARIANT`` -> (KEY, VARIANT); None for anything else."""
    parts = rel.split("/")
    if len(parts) != 4 or parts[0] != VERSION:
        return None
    _, shard, key, variant = parts
    if not (is_key(key) and shard == key[:2] and is_variant(variant)):
        return None
    return key, variant


def _is_wheel_name(name: object) -> bool:
    """A wheel's file name (PEP 427: five or six dash-separated parts), nothing that could
    name another directory."""
    if not (isinstance(name, str) and name.endswith(".whl") and len(name) <= 200):
        return False
    return (
        "/" not in name
        and "\0" not in name
        and not name.startswith(".")
        and name.count("-") in (4, 5)
    )
