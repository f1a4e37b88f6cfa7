"""ninja's own files, read and written as ninja does: ``.ninja_log`` (formats 5 and 7, each
with the hash ninja keys a command by), ``.ninja_deps`` (format 4), and what ``ninja -t
compdb`` and ``ninja --version`` say."""

from __future__ import annotations

import functools
import json
import struct
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

DEPS_SIGNATURE = b"# ninjadeps\n"
DEPS_VERSION = 4


def murmur64a(data: bytes, seed: int = 0xDECAFBADDECAFBAD) -> int:
    """MurmurHash64A, what ninja hashes a command line with for ``.ninja_log``."""
    m, r, mask = 0xC6A4A7935BD1E995, 47, (1 << 64) - 1
    h = (seed ^ (len(data) * m)) & mask
    end = len(data) - len(data) % 8
    for i in range(0, end, 8):
        k = (int.from_bytes(data[i : i + 8], "little") * m) & mask
        k = ((k ^ (k >> r)) * m) & mask
        h = ((h ^ k) * m) & mask
    if len(data) % 8:
        h = ((h ^ int.from_bytes(data[end:], "little")) * m) & mask
    h = ((h ^ (h >> r)) * m) & mask
    return h ^ (h >> r)


_SECRET = (0x2D358DCCAA6C78A5, 0x8BB84B93962EACC9, 0x4B33A62ED433D4A3)
_MASK = (1 << 64) - 1


def _mix(a: int, b: int) -> int:
    r = a * b
    return (r & _MASK) ^ (r >> 64)


def rapidhash(data: bytes, seed: int = 0xBDD89AA982704029) -> int:
    """rapidhash (v1), what ninja >= 1.13 hashes a command line with (log format 7)."""
    s0, s1, s2 = _SECRET
    n = len(data)

    def r64(i: int) -> int:
        return int.from_bytes(data[i : i + 8], "little")

    def r32(i: int) -> int:
        return int.from_bytes(data[i : i + 4], "little")

    seed ^= _mix(seed ^ s0, s1) ^ n
    if n <= 16:
        if n >= 4:
            delta = (n & 24) >> (n >> 3)
            a = (r32(0) << 32) | r32(n - 4)
            b = (r32(delta) << 32) | r32(n - 4 - delta)
        elif n > 0:
            a, b = (data[0] << 56) | (data[n >> 1] << 32) | data[n - 1], 0
        else:
            a = b = 0
    else:
        i, o = n, 0
        if i > 48:
            see1 = see2 = seed
            while i >= 48:
                seed = _mix(r64(o) ^ s0, r64(o + 8) ^ seed)
                see1 = _mix(r64(o + 16) ^ s1, r64(o + 24) ^ see1)
                see2 = _mix(r64(o + 32) ^ s2, r64(o + 40) ^ see2)
                o, i = o + 48, i - 48
            seed ^= see1 ^ see2
        if i > 16:
            seed = _mix(r64(o) ^ s2, r64(o + 8) ^ seed ^ s1)
            if i > 32:
                seed = _mix(r64(o + 16) ^ s2, r64(o + 24) ^ seed)
        a, b = r64(o + i - 16), r64(o + i - 8)
    r = (a ^ s1) * (b ^ seed)
    a, b = r & _MASK, r >> 64
    return _mix(a ^ s0 ^ n, b ^ s1)


# The .ninja_log formats cudaenv writes, each with the hash ninja keys a command by:
# MurmurHash64A up to ninja 1.11 (v5), rapidhash from 1.13 (v7).
LOG_HASHES = {"# ninja log v5": murmur64a, "# ninja log v7": rapidhash}
# A build directory's log holds a few records a command: more than this is not a log of ours.
MAX_LOG = 16 << 20


def command_hash(command: str, header: str = "# ninja log v5") -> str:
    return format(LOG_HASHES[header](command.encode()), "x")


def read_deps(path: Path) -> dict[str, tuple[int, list[str]]]:
    """``.ninja_deps`` (format 4): output -> (mtime in ns, its dependencies). The last record
    of an output wins, as in ninja."""
    data = path.read_bytes()
    head = len(DEPS_SIGNATURE)
    if data[:head] != DEPS_SIGNATURE or struct.unpack_from("<i", data, head)[0] != DEPS_VERSION:
        raise ValueError(f"{path}: not a ninja deps log of format {DEPS_VERSION}")
    pos = head + 4
    paths: list[str] = []
    out: dict[str, tuple[int, list[str]]] = {}
    while pos + 4 <= len(data):
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        is_deps, size = bool(size & 0x80000000), size & 0x7FFFFFFF
        record = data[pos : pos + size]
        pos += size
        if len(record) < size:
            break  # a truncated tail, as ninja tolerates
        if is_deps:
            ids = struct.unpack_from(f"<{size // 4}I", record)
            output, mtime = paths[ids[0]], ids[1] | (ids[2] << 32)
            out[output] = (mtime, [paths[i] for i in ids[3:]])
        else:
            paths.append(record[:-4].rstrip(b"\0").decode())
    return out


def write_deps(path: Path, records: Sequence[tuple[str, int, Sequence[str]]]) -> None:
    """A ``.ninja_deps`` holding ``(output, mtime_ns, dependencies)`` records."""
    ids: dict[str, int] = {}
    chunks = [DEPS_SIGNATURE, struct.pack("<i", DEPS_VERSION)]

    def node(name: str) -> int:
        if name not in ids:
            raw = name.encode()
            padding = (4 - len(raw) % 4) % 4
            chunks.append(struct.pack("<I", len(raw) + padding + 4))
            chunks.append(raw + b"\0" * padding)
            chunks.append(struct.pack("<I", ~len(ids) & 0xFFFFFFFF))
            ids[name] = len(ids)
        return ids[name]

    for output, mtime, deps in records:
        numbers = [node(output), mtime & 0xFFFFFFFF, (mtime >> 32) & 0xFFFFFFFF]
        numbers += [node(d) for d in deps]
        chunks.append(struct.pack("<I", (4 * len(numbers)) | 0x80000000))
        chunks.append(struct.pack(f"<{len(numbers)}I", *numbers))
    path.write_bytes(b"".join(chunks))


def write_log(path: Path, header: str, records: Iterable[tuple[str, int, str]]) -> None:
    """A ``.ninja_log`` of format ``header`` saying each ``(output, mtime_ns, command)`` was
    built by it."""
    lines = [header]
    lines += [
        f"0\t0\t{mtime}\t{output}\t{command_hash(cmd, header)}" for output, mtime, cmd in records
    ]
    path.write_text("\n".join(lines) + "\n")


def log_records(path: Path) -> frozenset[str] | None:
    """The records of a ``.ninja_log``, each line as ninja wrote it; None where there is no
    readable log. ninja appends one record for every command it runs, so the records a build
    added are the commands it ran: the evidence of whether anything compiled (a file's age is
    not: an output placed or left earlier looks as new as one compiled now)."""
    try:
        with path.open("rb") as f:
            text = f.read(MAX_LOG).decode("utf-8", "replace")
    except OSError:
        return None
    lines = text.splitlines()
    if not lines or lines[0] not in LOG_HASHES:
        return None
    return frozenset(line for line in lines[1:] if line.strip())


def commands_run(before: frozenset[str] | None, after: frozenset[str] | None) -> list[str]:
    """The outputs whose commands ninja ran between two reads of its log (:func:`log_records`),
    in its order; an unreadable log after the build counts every output as run."""
    if after is None:
        return ["(ninja kept no log)"]
    new = after - (before or frozenset())
    return sorted({line.split("\t")[3] for line in new if line.count("\t") >= 4})


def compdb(ninja: str, build_dir: Path) -> list[dict[str, str]]:
    """Every edge of ``build_dir/build.ninja`` with its evaluated command (``-t compdb``)."""
    done = subprocess.run(
        [ninja, "-C", str(build_dir), "-t", "compdb"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return [e for e in json.loads(done.stdout) if e.get("output") and e.get("command")]


@functools.lru_cache(maxsize=8)
def ninja_version(ninja: str) -> str:
    """``ninja --version``, asked once per binary in a process (a prefetch asks for each
    module it places)."""
    done = subprocess.run([ninja, "--version"], capture_output=True, text=True, timeout=60)
    return done.stdout.strip()
