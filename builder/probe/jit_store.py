"""A machine-wide store of compiled JIT results: a compile done once per toolchain.

Standard library only: ``env_facts.py`` imports it inside a target env (FlashInfer's ninja
build), cudaenv imports it as ``builder.probe.jit_store`` (its own kernel).

An entry is found in two steps, like ccache's direct mode. The *key* hashes what the build
is asked to do with which tools: the build description with the env's own path replaced by
``@ENV@`` (flags, gencode, include order, sources), the content of each compiler binary
(nvcc, cicc, ptxas, ... and the host compiler nvcc drives), the NVCC_* variables and the
ninja version. Under a key, each *variant* records every file the compile read (the depfile:
headers of CUDA, CCCL, FlashInfer, the C library) with its sha256; a variant is used only if
every one of those files has the same content in the new env. So a changed nvcc, CCCL, arch or
host compiler misses, and nothing is ever reused stale.

A ninja build (FlashInfer) checks more than files: it rebuilds an output whose command line
differs from the one in ``.ninja_log`` (the env's path is in every command: flashinfer#4884)
or whose depfile record is missing from ``.ninja_deps``. Placing an entry therefore writes
both logs for the new env's own commands (``ninja -t compdb``), after which ninja has no work
to do. Any mismatch makes ninja rebuild, which is slow but never wrong.

Concurrent builders of one key wait for each other (``flock`` on the key), so two matrix
cells of one toolchain compile once. Entries are written beside their final place and renamed
into it whole.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = "v3"  # the entry format; v3: each file's size and sha256 recorded, inputs required
ENV = "@ENV@"
# What nvcc reads from the environment on top of its command line. Written out: this module
# runs inside the env's interpreter and imports nothing of cudaenv; a test keeps it equal to
# builder/variables.py's NVCC.
NVCC_ENV = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")
# The binaries nvcc runs (bin/ and nvvm/bin/ of CUDA_HOME): their content is in the key.
TOOLKIT_TOOLS = ("bin/nvcc", "bin/ptxas", "bin/fatbinary", "bin/nvlink", "bin/cudafe++",
                 "bin/bin2c", "nvvm/bin/cicc")  # fmt: skip
DEPS_SIGNATURE = b"# ninjadeps\n"
DEPS_VERSION = 4


# --------------------------------------------------------------------------- ninja's files


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


def ninja_version(ninja: str) -> str:
    done = subprocess.run([ninja, "--version"], capture_output=True, text=True, timeout=60)
    return done.stdout.strip()


# --------------------------------------------------------------------------- content


class Hasher:
    """sha256 of files, memoised by (device, inode, size, mtime): an env's toolkit files are
    hard links into uv's cache, so every env of one toolkit asks about the same inodes."""

    def __init__(self, memo: Path | None) -> None:
        self.memo_path = memo
        self.memo: dict[str, str] = {}
        self.dirty = False
        if memo is not None:
            # A memo another user could write would make a changed header look unchanged:
            # read only from a directory and a file no one else can write.
            with contextlib.suppress(OSError, ValueError, StoreError):
                check_dir(memo.parent)
                loaded = read_doc(memo, trusted=True)
                if isinstance(loaded, dict):
                    self.memo = {str(k): str(v) for k, v in loaded.items()}

    def sha256(self, path: str | Path, limit: int | None = None) -> str | None:
        """The content of the regular file at ``path`` (links followed: a toolkit's headers
        are links into the wheel prefix); None for anything else, or one over ``limit``."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or (limit is not None and st.st_size > limit):
            return None
        ident = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
        # A file changed in the last seconds may change again within one timestamp tick
        # without its identity changing (ccache's "too new" rule): hashed, never memoised.
        recent = time.time_ns() - st.st_mtime_ns < 2 * 10**9
        found = None if recent else self.memo.get(ident)
        if found is not None:
            return found
        h = hashlib.sha256()
        try:
            # O_NONBLOCK: a path swapped for a FIFO since the stat never blocks the build.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        except OSError:
            return None
        if recent:
            return h.hexdigest()
        self.memo[ident] = h.hexdigest()
        self.dirty = True
        return self.memo[ident]

    def save(self) -> None:
        if self.memo_path is None or not self.dirty:
            return
        with contextlib.suppress(OSError, StoreError):
            self.memo_path.parent.mkdir(parents=True, exist_ok=True)
            check_dir(self.memo_path.parent)
            kept = dict(list(self.memo.items())[-20000:])
            tmp = self.memo_path.with_name(f".{self.memo_path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(kept))
            tmp.chmod(0o644)  # whatever the umask: a memo others can write is never read
            tmp.replace(self.memo_path)


def which(name: str, path: str | None) -> str | None:
    return shutil.which(name, path=path)


def tool_identities(
    hasher: Hasher, cuda_home: str, compilers: Sequence[str], env: Mapping[str, str]
) -> dict[str, str | None]:
    """Content of the toolkit's binaries and of each host compiler (found on the env's PATH
    as nvcc and ninja find them), and the NVCC_* variables."""
    out: dict[str, str | None] = {}
    for rel in TOOLKIT_TOOLS:
        out[rel] = hasher.sha256(os.path.join(cuda_home, rel))
    for name in compilers:
        found = which(name, env.get("PATH"))
        out[f"host:{name}"] = hasher.sha256(os.path.realpath(found)) if found else None
    for key in NVCC_ENV:
        out[f"env:{key}"] = env.get(key, "")
    return out


def normalise(text: str, roots: Iterable[str], placeholder: str = ENV) -> str:
    """``text`` with each spelling of the env's root replaced by ``placeholder``."""
    for root in sorted({r.rstrip("/") for r in roots if r and r != "/"}, key=len, reverse=True):
        text = text.replace(root, placeholder)
    return text


def localise(text: str, root: str) -> str:
    return text.replace(ENV, root.rstrip("/"))


def env_roots(prefix: str) -> list[str]:
    """How the env's path can be spelt in what its tools write (as given and resolved)."""
    return [prefix, os.path.realpath(prefix)]


def key_of(material: Mapping[str, Any]) -> str:
    blob = json.dumps({"store": VERSION, **material}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


# --------------------------------------------------------------------------- the store
#
# The store can hand a root process a binary to run, so it is read like a package index:
# an entry is named by what made it (the key) and checked by what it is (the size and sha256
# of every file, recorded when it was published and checked each time it is placed). It reads
# nothing another user could have written (as ssh's StrictModes does with ~/.ssh), never
# follows a symbolic link inside its tree, keeps every file name inside its entry, and bounds
# every wait. Whatever goes wrong with the store, the caller compiles without it.

# A file a compile read is a header or a source: one larger than this is not, and a compile
# that read it is not kept (a recorded input of /dev/zero or a huge file cannot stall a build).
MAX_INPUT = 64 << 20
MAX_DOC = 16 << 20  # an entry.json
# The store's size cap (CUDAENV_JIT_STORE_MAX): past it the least recently used entries go.
DEFAULT_MAX = 10 << 30
# How long a builder waits for another builder of the same key (CUDAENV_JIT_LOCK_TIMEOUT):
# FlashInfer's sampling module takes ~2 minutes on two cores.
DEFAULT_LOCK_TIMEOUT = 900.0
# What an entry says about where and when it was made: kept locally, not part of its
# content (two machines that compile one key publish the same content).
PROVENANCE = ("env", "first_built", "origin")
KINDS = ("ninja", "topk_topp")

_HEX = frozenset("0123456789abcdef")


def is_key(text: str) -> bool:
    return len(text) == 64 and set(text) <= _HEX


def is_variant(text: str) -> bool:
    return len(text) == 16 and set(text) <= _HEX


def is_file_name(name: object) -> bool:
    """One path component an entry's file may be named by: nothing that leaves the entry."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 200
        and "/" not in name
        and "\0" not in name
        and not name.startswith(".")
    )


class StoreError(Exception):
    """The store cannot be used now (a directory others can write, a lock held too long, a
    read-only or full disk): the caller compiles without it and says why once."""


class EntryError(ValueError):
    """One entry is malformed, or a file differs from its record: it is discarded and the
    result compiled (and published) again."""


def _mode(st: os.stat_result) -> str:
    return format(stat.S_IMODE(st.st_mode), "04o")


def _trusted(st: os.stat_result) -> bool:
    return st.st_uid in (os.geteuid(), 0) and not st.st_mode & 0o022


def _untrusted_why(path: Path | str, st: os.stat_result) -> str:
    if st.st_uid not in (os.geteuid(), 0):
        return (
            f"{path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}) or root: "
            f"the JIT store reads nothing another user could have written (chown -R "
            f"{os.geteuid()} {path}, or point CUDAENV_JIT_STORE at a directory of your own)"
        )
    return (
        f"{path} can be written by other users (mode {_mode(st)}): the JIT store reads nothing "
        f"another user could have written (chmod go-w {path})"
    )


def check_dir(path: Path) -> None:
    """``path`` is a directory of the store: a real directory (not a link) that only the
    invoking user or root owns and can write."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise StoreError(f"{path}: {exc.strerror}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(f"{path} is a symbolic link: the JIT store never follows one")
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"{path} is not a directory")
    if not _trusted(st):
        raise StoreError(_untrusted_why(path, st))


def check_ancestors(root: Path) -> None:
    """Every directory above the store's root: owned by the user or root, and writable by
    others only with the sticky bit (``/tmp``), so no one else can swap the store."""
    for parent in root.parents:
        st = os.stat(parent)
        if st.st_uid not in (os.geteuid(), 0) or (
            st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
        ):
            raise StoreError(_untrusted_why(parent, st))


def open_regular(path: Path | str, *, trusted: bool) -> tuple[int, os.stat_result]:
    """``path`` opened for reading without following a link, which must be a regular file
    (a FIFO or a device never blocks us: O_NONBLOCK); when ``trusted``, one that only the user
    or root can write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise EntryError(f"{path} is a symbolic link") from exc
        raise EntryError(f"{path}: {exc.strerror}") from exc
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = f"{path} is not a regular file"
    elif trusted and not _trusted(st):
        why = _untrusted_why(path, st)
    if why is not None:
        os.close(fd)
        raise EntryError(why)
    return fd, st


def sha256_file(path: Path | str, *, trusted: bool) -> tuple[int, str]:
    """Size and sha256 of the regular file at ``path`` (a link or a FIFO is an EntryError)."""
    fd, _ = open_regular(path, trusted=trusted)
    h, total = hashlib.sha256(), 0
    with os.fdopen(fd, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
            total += len(block)
    return total, h.hexdigest()


def read_doc(path: Path, *, trusted: bool) -> Any:
    fd, st = open_regular(path, trusted=trusted)
    with os.fdopen(fd, "rb") as fh:
        if st.st_size > MAX_DOC:
            raise EntryError(f"{path} is larger than {MAX_DOC >> 20} MiB")
        data = fh.read(MAX_DOC + 1)
    try:
        return json.loads(data)
    except ValueError as exc:
        raise EntryError(f"{path} is not JSON ({exc})") from exc


def stored_identity(st: os.stat_result) -> str | None:
    """What names one version of a stored file for the memo of checked hashes: inode, size,
    mtime and ctime (no process but root can set a ctime back: any write, chmod or utime moves
    it). None for a file changed in the last 2 s, which may change again within one timestamp
    tick (ccache's "too new" rule)."""
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < 2 * 10**9:
        return None
    return f"stored:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def copy_checked(
    src: Path | str,
    dst: Path,
    size: int | None,
    sha256: str | None,
    *,
    trusted: bool,
    memo: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Copy ``src`` to ``dst`` (written beside it: a ``.NAME.PID.tmp`` file the caller renames)
    hashing as it goes; raise EntryError when the size or sha256 differs from the record.

    ``memo``: the checked hashes of stored files by :func:`stored_identity`. A file whose
    identity says it is the version already hashed against this record is copied by the kernel
    without being read here (placing costs what copying costs); any other is read once,
    hashed as it is copied, and remembered."""
    fd, st = open_regular(src, trusted=trusted)
    if size is not None and st.st_size != size:
        os.close(fd)
        raise EntryError(f"{src} holds {st.st_size} bytes, its record says {size}")
    ident = stored_identity(st) if memo is not None else None
    known = memo.get(ident) if memo is not None and ident is not None else None
    h, total = hashlib.sha256(), 0
    with contextlib.suppress(FileNotFoundError):
        os.unlink(dst)
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "rb") as fh, os.fdopen(out, "wb") as sink:
            if known is not None and known == sha256:
                while total < st.st_size:
                    sent = os.sendfile(out, fd, total, st.st_size - total)
                    if sent == 0:
                        break
                    total += sent
                digest = known
            else:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
                    sink.write(block)
                    total += len(block)
                    if size is not None and total > size:
                        break
                digest = h.hexdigest()
    except BaseException:
        os.unlink(dst)
        raise
    if (size is not None and total != size) or (sha256 is not None and digest != sha256):
        os.unlink(dst)
        raise EntryError(f"{src}: content differs from its record (sha256 {digest[:16]}...)")
    if memo is not None and ident is not None and known is None:
        memo[ident] = digest
    return total, digest


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


def parse_size(text: str) -> int:
    """``10G``, ``500M``, ``2048K`` or bytes (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in units else ""
    number = raw[: len(raw) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (like 10G, 500M or 1048576)") from None
    # "nan" and "inf" pass float(): neither is a size.
    if not (0 <= value < 1 << 60):
        raise ValueError(f"{text!r} is not a size (like 10G, 500M or 1048576)")
    return int(value * units[unit])


def store_max(environ: Mapping[str, str] | None = None) -> int:
    text = (environ if environ is not None else os.environ).get("CUDAENV_JIT_STORE_MAX", "")
    try:
        return parse_size(text) if text else DEFAULT_MAX
    except ValueError as exc:
        raise StoreError(f"CUDAENV_JIT_STORE_MAX: {exc}") from None


def lock_timeout(environ: Mapping[str, str] | None = None) -> float:
    text = (environ if environ is not None else os.environ).get("CUDAENV_JIT_LOCK_TIMEOUT", "")
    try:
        value = float(text) if text else DEFAULT_LOCK_TIMEOUT
    except ValueError:
        value = -1.0
    # nan compares false with every deadline: a wait of nan seconds would never end.
    if not 0 <= value <= 1e6:
        raise StoreError(f"CUDAENV_JIT_LOCK_TIMEOUT={text}: not a number of seconds (0 to 1000000)")
    return value


@dataclass(frozen=True, kw_only=True)
class Listed:
    """One line of ``cudaenv store list``."""

    key: str
    variant: str
    kind: str
    size: int
    last_used: float
    first_built: str | None
    made_for: str | None


class Lock:
    """A key's lock, held: released with :meth:`release`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


class Store:
    def __init__(self, root: Path) -> None:
        # The root the user named may be a link (their choice); nothing inside is followed.
        self.root = Path(os.path.realpath(root))
        self.hasher = Hasher(self.root / "identities.json")
        # What this process did to the store that the user should hear of (an entry
        # discarded), and why it could not be used.
        self.notes: list[str] = []
        self._ready = False

    def entries(self, key: str) -> Path:
        return self.root / VERSION / key[:2] / key

    def ready(self) -> None:
        """Made if missing, then checked: the root, the directories above it, its tree."""
        if self._ready:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o755)
        except OSError as exc:
            raise StoreError(f"{self.root}: {exc.strerror}") from exc
        check_ancestors(self.root)
        check_dir(self.root)
        self._ready = True

    def _dir(self, path: Path, *, make: bool) -> bool:
        """Each directory from the root down to ``path`` checked (and made when ``make``);
        False when one is missing."""
        self.ready()
        current = self.root
        for part in path.relative_to(self.root).parts:
            current = current / part
            if make:
                with contextlib.suppress(FileExistsError):
                    current.mkdir(mode=0o755)
            elif not os.path.lexists(current):
                return False
            check_dir(current)
        return True

    def acquire(self, key: str, timeout: float | None = None) -> Lock:
        """The key's lock: one builder looks up, compiles and publishes ``key`` while another
        builder of the same key waits here. StoreError after ``timeout`` seconds, naming the
        process that holds it."""
        if not is_key(key):
            raise StoreError(f"{key!r} is not a store key")
        lock_dir = self.root / "locks"
        self._dir(lock_dir, make=True)
        path = lock_dir / f"{key}.lock"
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            why = "is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise StoreError(f"{path} {why}: the store was not used") from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _trusted(st):
            os.close(fd)
            raise StoreError(
                _untrusted_why(path, st) if stat.S_ISREG(st.st_mode) else f"{path} is not a file"
            )
        wait = lock_timeout() if timeout is None else timeout
        deadline = time.monotonic() + wait
        delay = 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    os.close(fd)
                    raise StoreError(
                        f"waited {wait:.0f} s for the JIT store's lock {path} (held by pid "
                        f"{holder}); compiled without the store"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return Lock(fd)

    @contextlib.contextmanager
    def locked(self, key: str, timeout: float | None = None) -> Iterator[None]:
        lock = self.acquire(key, timeout)
        try:
            yield
        finally:
            lock.release()

    def variants(self, key: str) -> list[Path]:
        base = self.entries(key)
        if not is_key(key) or not self._dir(base, make=False):
            return []
        return sorted(p for p in base.iterdir() if is_variant(p.name))

    def load(self, key: str, variant: Path) -> Entry:
        """The entry at ``variant`` read and checked (not its files' content: placing checks
        that); EntryError for a malformed one, StoreError for one that may not be read."""
        check_dir(variant)
        check_dir(variant / "files")
        doc = read_doc(variant / "entry.json", trusted=True)
        content, files, inputs = parse_entry(doc)
        if variant_of(inputs) != variant.name:
            raise EntryError(f"{variant.name} is not the variant its inputs make")
        provenance = {k: str(doc[k]) for k in PROVENANCE if k in doc}
        return Entry(key, variant, content, files, inputs, provenance)

    def discard(self, entry: Path, why: str) -> bool:
        """Remove a bad entry (it is compiled and published again) and say so: what was
        done, never a removal that did not happen (a read-only store). Whether it is gone."""
        rel = entry.relative_to(self.root) if entry.is_relative_to(self.root) else entry
        failed = remove_tree(entry)
        if failed is None:
            self.notes.append(f"discarded the store entry {rel}: {why}; compiled again")
            return True
        self.notes.append(
            f"the store entry {rel} is bad ({why}) and could not be removed ({failed}); "
            "it is not used"
        )
        return False

    def input_matches(self, path: str, digest: str) -> bool:
        return self.hasher.sha256(path, limit=MAX_INPUT) == digest

    def find(self, key: str, root: str) -> Entry | None:
        """The variant of ``key`` whose every recorded input has the same content in the env
        at ``root``. A malformed entry is discarded on the way."""
        for variant in self.variants(key):
            try:
                entry = self.load(key, variant)
            except EntryError as exc:
                self.discard(variant, str(exc))
                continue
            if all(self.input_matches(localise(p, root), h) for p, h in entry.inputs.items()):
                with contextlib.suppress(OSError):
                    os.utime(variant)  # used now: the last to be evicted
                return entry
        return None

    def stage(self, entry: Entry, name: str, dst: Path) -> Path:
        """The entry's file ``name`` copied beside ``dst`` and checked against its record;
        the staged file (rename it onto ``dst``). EntryError when it differs."""
        record = entry.files[name]
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        copy_checked(
            entry.path / "files" / name,
            tmp,
            record.size,
            record.sha256,
            trusted=True,
            memo=self.hasher.memo,
        )
        self.hasher.dirty = True
        return tmp

    def place(self, entry: Entry, name: str, dst: Path) -> None:
        os.replace(self.stage(entry, name, dst), dst)

    def publish(
        self,
        key: str,
        files: Mapping[str, Path],
        inputs: Iterable[str],
        meta: Mapping[str, Any],
        root: str,
    ) -> Path | None:
        """Keep ``files`` (name -> built file) under ``key`` with the content of each input
        (paths normalised with ``@ENV@``); None when there is no input or one cannot be read
        as a regular file under the size cap (not kept)."""
        hashes: dict[str, str] = {}
        for name in sorted(set(inputs)):
            digest = self.hasher.sha256(localise(name, root), limit=MAX_INPUT)
            if digest is None:
                return None
            hashes[name] = digest
        if not hashes:
            return None
        content = {k: v for k, v in meta.items() if k not in PROVENANCE}
        provenance = {k: str(v) for k, v in meta.items() if k in PROVENANCE}
        provenance.setdefault(
            "first_built", dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        )
        return self._write(key, {**content, "inputs": hashes}, files, provenance)

    def import_entry(
        self,
        key: str,
        doc: Mapping[str, Any],
        files: Mapping[str, Path],
        provenance: Mapping[str, str],
    ) -> Path:
        """An entry that came from elsewhere (a registry, a wheelhouse) added to the store:
        checked as any entry is, every file against its recorded size and sha256."""
        if not is_key(key):
            raise EntryError(f"{key!r} is not a store key")
        content, records, _ = parse_entry(dict(doc))
        if set(files) != set(records):
            raise EntryError("the files carried are not the files the entry records")
        # When it came here: where it was first built is not part of what is shared.
        arrived = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        path = self._write(key, content, files, {"first_built": arrived, **provenance})
        assert path is not None
        return path

    def _write(
        self,
        key: str,
        content: Mapping[str, Any],
        files: Mapping[str, Path],
        provenance: Mapping[str, str],
    ) -> Path | None:
        records = content.get("files")
        final = self.entries(key) / variant_of(content["inputs"])
        if final.exists():
            return final
        self._dir(final.parent, make=True)
        tmp = Path(tempfile.mkdtemp(prefix=".publish-", dir=final.parent))
        try:
            (tmp / "files").mkdir(mode=0o755)
            written: dict[str, dict[str, Any]] = {}
            for name, src in sorted(files.items()):
                if not is_file_name(name):
                    raise EntryError(f"{name!r} is not a file name inside the entry")
                want = records.get(name) if isinstance(records, dict) else None
                size, digest = copy_checked(
                    src,
                    tmp / "files" / name,
                    want["size"] if want else None,
                    want["sha256"] if want else None,
                    # A build's own output or a download: taken by content, not owner.
                    trusted=False,
                )
                written[name] = {"size": size, "sha256": digest}
            doc = {**content, "files": written, **provenance}
            parse_entry(doc)
            (tmp / "entry.json").write_text(json.dumps(doc, indent=1, sort_keys=True))
            (tmp / "entry.json").chmod(0o644)  # whatever the umask (see check_dir)
            tmp.chmod(0o755)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.exists():  # a concurrent publisher won: theirs is the same
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.evict(keep=final)
        return final

    def export_entry(self, entry: Entry) -> tuple[dict[str, Any], dict[str, Path]]:
        """What another store needs of ``entry``: its content and its files, every file
        checked against its record first (a damaged entry is never passed on)."""
        for name, record in entry.files.items():
            if sha256_file(entry.path / "files" / name, trusted=True) != (
                record.size,
                record.sha256,
            ):
                raise EntryError(f"{entry.path / 'files' / name}: content differs from its record")
        return dict(entry.content), {n: entry.path / "files" / n for n in entry.files}

    def all(self) -> list[tuple[str, Path]]:
        """Every (key, variant dir) in the store, for listing, checking and eviction."""
        top = self.root / VERSION
        if not os.path.isdir(top):
            return []
        found = []
        for shard in sorted(os.scandir(top), key=lambda e: e.name):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for key in sorted(os.scandir(shard.path), key=lambda e: e.name):
                if not (is_key(key.name) and key.is_dir(follow_symlinks=False)):
                    continue
                for variant in sorted(os.scandir(key.path), key=lambda e: e.name):
                    if is_variant(variant.name) and variant.is_dir(follow_symlinks=False):
                        found.append((key.name, Path(variant.path)))
        return found

    def size_of(self, variant: Path) -> int:
        total = 0
        for path in (variant / "entry.json", *sorted((variant / "files").glob("*"))):
            with contextlib.suppress(OSError):
                total += os.lstat(path).st_size
        return total

    def evict(self, keep: Path | None = None, cap: int | None = None) -> list[Path]:
        """The least recently used entries removed until the store is under its cap
        (``CUDAENV_JIT_STORE_MAX``); never ``keep``, the entry just written."""
        limit = store_max() if cap is None else cap
        sized = []
        for _, variant in self.all():
            with contextlib.suppress(OSError):
                sized.append((os.lstat(variant).st_mtime_ns, variant, self.size_of(variant)))
        total = sum(size for _, _, size in sized)
        removed = []
        for _, variant, size in sorted(sized, key=lambda t: (t[0], str(t[1]))):
            if total <= limit:
                break
            if variant == keep:
                continue
            failed = remove_tree(variant)
            if failed is not None:
                self._unremoved(variant, failed)
                continue
            total -= size
            removed.append(variant)
        return removed

    def _unremoved(self, path: Path, why: str) -> None:
        note = f"could not remove {path} ({why})"
        if note not in self.notes:
            self.notes.append(note)

    def listing(self) -> list[Listed]:
        """Every entry, least recently used first."""
        rows = []
        for key, variant in self.all():
            try:
                entry = self.load(key, variant)
                kind, made = str(entry.content.get("kind")), entry.provenance
            except (EntryError, StoreError) as exc:
                kind, made = f"unreadable ({exc})", {}
            with contextlib.suppress(OSError):
                rows.append(
                    Listed(
                        key=key,
                        variant=variant.name,
                        kind=kind,
                        size=self.size_of(variant),
                        last_used=os.lstat(variant).st_mtime,
                        first_built=made.get("first_built"),
                        made_for=made.get("env") or made.get("origin"),
                    )
                )
        return sorted(rows, key=lambda r: (r.last_used, r.key))

    def check(self, key: str, variant: Path) -> str | None:
        """What is wrong with one entry (its record, or a file against its record), or None."""
        try:
            self.export_entry(self.load(key, variant))
        except (EntryError, StoreError) as exc:
            return str(exc)
        return None

    def gc(self, cap: int) -> tuple[list[Path], int]:
        """What ``cudaenv store gc`` removes: entries of another format, what interrupted
        publishers left (an hour old), locks of keys no longer held by anyone, then the least
        recently used entries until the store is under ``cap``; (removed, bytes freed)."""
        self.ready()
        removed: list[Path] = []
        freed = 0
        hour_ago = time.time() - 3600
        old = [
            child
            for child in sorted(self.root.iterdir())
            if child.name.startswith("v") and child.name[1:].isdigit() and child.name != VERSION
        ]
        stale = [
            p
            for p in [*self.root.glob(".pull-*"), *self.root.glob(f"{VERSION}/*/*/.publish-*")]
            if os.lstat(p).st_mtime < hour_ago
        ]
        for path in [*old, *stale]:
            size = _tree_size(path)
            failed = remove_tree(path)
            if failed is not None:
                self._unremoved(path, failed)
                continue
            freed += size
            removed.append(path)
        locks = self.root / "locks"
        if locks.is_dir():
            check_dir(locks)
            for lock in sorted(locks.glob("*.lock")):
                if self.variants(lock.name.removesuffix(".lock")):
                    continue
                with contextlib.suppress(OSError, StoreError):
                    held = self.acquire(lock.name.removesuffix(".lock"), timeout=0)
                    try:
                        lock.unlink()
                    except OSError as exc:
                        self._unremoved(lock, exc.strerror or type(exc).__name__)
                    finally:
                        held.release()
        before = {v: self.size_of(v) for _, v in self.all()}
        for variant in self.evict(cap=cap):
            freed += before.get(variant, 0)
            removed.append(variant)
        return removed, freed


def remove_tree(path: Path) -> str | None:
    """Remove the tree at ``path`` (a link is removed, never followed); None when it is
    gone, else why it is not (the OS's words: "Read-only file system")."""
    try:
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
            return None
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            os.rmdir(path)  # what is left says why it stays
    except FileNotFoundError:
        pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


# Where a cudaenv env lists the store entries it uses (`cudaenv export --with-jit` carries them).
USED = Path("var") / "cudaenv" / "jit-entries.json"


def note_use(store: Store, variant: Path, prefix: str) -> None:
    """Add ``variant`` to the entries the env at ``prefix`` uses; only a cudaenv env (one with
    a ``cudaenv.json``) is written to."""
    if not os.path.exists(os.path.join(prefix, "cudaenv.json")):
        return
    path = Path(prefix) / USED
    with contextlib.suppress(OSError, ValueError):
        rel = str(variant.relative_to(store.root))
        used = json.loads(path.read_text()) if path.exists() else []
        if not isinstance(used, list):
            used = []
        if rel not in used:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps([*used, rel], indent=1))
            tmp.replace(path)


def used_entries(prefix: Path) -> list[str]:
    """The entries (``v3/ab/KEY/VARIANT``) the env at ``prefix`` used, of this format."""
    try:
        used = json.loads((prefix / USED).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(used, list):
        return []
    return [str(u) for u in used if split_entry(str(u)) is not None]


def split_entry(rel: str) -> tuple[str, str] | None:
    """``v3/ab/KEY/VARIANT`` -> (KEY, VARIANT); None for anything else."""
    parts = rel.split("/")
    if len(parts) != 4 or parts[0] != VERSION:
        return None
    _, shard, key, variant = parts
    if not (is_key(key) and shard == key[:2] and is_variant(variant)):
        return None
    return key, variant


# --------------------------------------------------------------------------- a ninja build


def ninja_material(
    store: Store, build_dir: Path, prefix: str, ninja: str, env: Mapping[str, str]
) -> dict[str, Any]:
    """What a ninja build's key is made of; ``build.ninja`` must be written."""
    text = (build_dir / "build.ninja").read_text()
    variables = dict(
        (line.split("=", 1)[0].strip(), line.split("=", 1)[1].strip())
        for line in text.splitlines()
        if "=" in line and not line.startswith((" ", "\t", "#", "build ", "rule "))
    )
    cuda_home = variables.get("cuda_home", env.get("CUDA_HOME", ""))
    compilers = [c for c in (variables.get("cxx", "c++"), "gcc", "g++") if c]
    return {
        "kind": "ninja",
        "build.ninja": normalise(text, env_roots(prefix)),
        "tools": tool_identities(store.hasher, cuda_home, compilers, env),
        "ninja": ninja_version(ninja),
    }


def place_ninja(store: Store, key: str, build_dir: Path, prefix: str, ninja: str) -> Entry | None:
    """Put the stored result of ``key`` into ``build_dir`` with ninja logs for this env's own
    commands; the entry placed, or None on a miss (nothing placed then). Every file is
    checked against its record before any is placed: an entry that differs is discarded."""
    entry = store.find(key, prefix)
    if entry is None:
        return None
    header = str(entry.content["ninja_log"])
    edges = compdb(ninja, build_dir)
    roots = env_roots(prefix)
    by_name = {normalise(e["output"], roots): e for e in edges}
    if set(by_name) != set(entry.content["outputs"]):
        return None
    deps = entry.content["deps"]
    latest = 0
    for inputs in deps.values():
        for dep in inputs:
            with contextlib.suppress(OSError):
                latest = max(latest, os.stat(localise(dep, prefix)).st_mtime_ns)
    # Newer than every input, so ninja finds each output up to date.
    stamp = max(latest + 1, time.time_ns())
    staged: list[tuple[Path, Path]] = []
    try:
        for name in by_name:
            out = Path(localise(name, prefix))
            if not out.is_absolute():
                out = build_dir / out
            staged.append((store.stage(entry, entry.content["file_of"][name], out), out))
    except EntryError as exc:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        store.discard(entry.path, str(exc))
        return None
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    log, records = [], []
    for (tmp, out), (name, edge) in zip(staged, by_name.items(), strict=True):
        os.replace(tmp, out)
        os.utime(out, ns=(stamp, stamp))
        log.append((edge["output"], stamp, edge["command"]))
        if name in deps:
            records.append((edge["output"], stamp, [localise(d, prefix) for d in deps[name]]))
    write_log(build_dir / ".ninja_log", header, log)
    write_deps(build_dir / ".ninja_deps", records)
    note_use(store, entry.path, prefix)
    return entry


def publish_ninja(
    store: Store, key: str, build_dir: Path, prefix: str, ninja: str, meta: Mapping[str, Any]
) -> Path | None:
    """Keep what ninja just built in ``build_dir`` under ``key``. Only a build whose logs
    cudaenv can write again (:data:`LOG_HASHES`, deps format 4) is kept."""
    log = build_dir / ".ninja_log"
    try:
        header = log.read_text().splitlines()[0]
        if header not in LOG_HASHES:
            return None
        recorded = read_deps(build_dir / ".ninja_deps")
    except (OSError, ValueError, IndexError):
        return None
    roots = env_roots(prefix)
    files: dict[str, Path] = {}
    file_of: dict[str, str] = {}
    deps: dict[str, list[str]] = {}
    inputs: list[str] = []
    for edge in compdb(ninja, build_dir):
        name = normalise(edge["output"], roots)
        path = Path(edge["output"])
        path = path if path.is_absolute() else build_dir / path
        if not path.is_file():
            return None
        stored = f"{len(files)}-{path.name}"
        files[stored], file_of[name] = path, stored
        found = recorded.get(edge["output"])
        if found is not None:
            deps[name] = [normalise(d, roots) for d in found[1]]
            inputs += deps[name]
    doc = {
        **meta,
        "kind": "ninja",
        "outputs": sorted(file_of),
        "file_of": file_of,
        "deps": deps,
        "ninja_log": header,
    }
    kept = store.publish(key, files, inputs, doc, prefix)
    if kept is not None:
        note_use(store, kept, prefix)
    return kept
