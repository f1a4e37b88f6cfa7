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
import fcntl
import hashlib
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

VERSION = "v2"  # the entry format; v2: entries say which ninja log format they were built with
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
            with contextlib.suppress(OSError, ValueError):
                loaded = json.loads(memo.read_text())
                if isinstance(loaded, dict):
                    self.memo = {str(k): str(v) for k, v in loaded.items()}

    def sha256(self, path: str | Path) -> str | None:
        try:
            st = os.stat(path)
        except OSError:
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
            with open(path, "rb") as fh:
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
        with contextlib.suppress(OSError):
            self.memo_path.parent.mkdir(parents=True, exist_ok=True)
            kept = dict(list(self.memo.items())[-20000:])
            tmp = self.memo_path.with_name(f".{self.memo_path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(kept))
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


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.hasher = Hasher(root / "identities.json")

    def entries(self, key: str) -> Path:
        return self.root / VERSION / key[:2] / key

    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[None]:
        """Held while one builder looks up, compiles and publishes ``key``: another builder
        of the same key waits here, then finds the result."""
        lock_dir = self.root / "locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        with open(lock_dir / f"{key}.lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def find(self, key: str, root: str) -> tuple[Path, dict[str, Any]] | None:
        """The variant of ``key`` whose every recorded input has the same content in the env
        at ``root``."""
        base = self.entries(key)
        if not base.is_dir():
            return None
        for variant in sorted(base.iterdir()):
            try:
                meta = json.loads((variant / "entry.json").read_text())
            except (OSError, ValueError):
                continue
            inputs = meta.get("inputs")
            if not isinstance(inputs, dict):
                continue
            if all(self.hasher.sha256(localise(p, root)) == h for p, h in inputs.items()):
                return variant, meta
        return None

    def publish(
        self,
        key: str,
        files: Mapping[str, Path],
        inputs: Iterable[str],
        meta: Mapping[str, Any],
        root: str,
    ) -> Path | None:
        """Keep ``files`` (name -> built file) under ``key`` with the content of each input
        (paths normalised with ``@ENV@``); None when an input cannot be read (not kept)."""
        hashes: dict[str, str] = {}
        for name in sorted(set(inputs)):
            digest = self.hasher.sha256(localise(name, root))
            if digest is None:
                return None
            hashes[name] = digest
        variant = hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()[:16]
        final = self.entries(key) / variant
        if final.exists():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".publish-", dir=final.parent))
        try:
            for name, src in files.items():
                dst = tmp / "files" / name
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
            doc = {
                **meta,
                "inputs": hashes,
                "files": sorted(files),
                "first_built": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            }
            (tmp / "entry.json").write_text(json.dumps(doc, indent=1, sort_keys=True))
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.exists():  # a concurrent publisher won: theirs is the same
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final


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
    try:
        used = json.loads((prefix / USED).read_text())
    except (OSError, ValueError):
        return []
    return [str(u) for u in used] if isinstance(used, list) else []


def copy_entries(src_root: Path, dst_root: Path, entries: Iterable[str]) -> list[str]:
    """Copy each entry (``v2/ab/KEY/VARIANT``) of the store at ``src_root`` that ``dst_root``
    lacks, whole (written beside, then renamed); the entries copied. An entry is only ever
    used where its key and every input match, so carrying one to another machine cannot
    place a result built for another toolkit."""
    copied = []
    for rel in entries:
        src, dst = src_root / rel, dst_root / rel
        if not (src / "entry.json").is_file() or dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".import-", dir=dst.parent))
        try:
            shutil.copytree(src, tmp / "entry")
            try:
                os.rename(tmp / "entry", dst)
            except OSError:
                if not dst.exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        copied.append(rel)
    return copied


def all_entries(root: Path) -> list[str]:
    return sorted(str(p.parent.relative_to(root)) for p in root.glob(f"{VERSION}/*/*/*/entry.json"))


def copy_out(src: Path, dst: Path) -> None:
    """A copy, never a hard link: a compiler that rewrites its output in place would change
    the stored file."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)


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


def place_ninja(
    store: Store, key: str, build_dir: Path, prefix: str, ninja: str
) -> dict[str, Any] | None:
    """Put the stored result of ``key`` into ``build_dir`` with ninja logs for this env's own
    commands; the entry's metadata, or None on a miss (nothing placed then)."""
    found = store.find(key, prefix)
    if found is None:
        return None
    variant, meta = found
    header = meta.get("ninja_log")
    if header not in LOG_HASHES:
        return None
    edges = compdb(ninja, build_dir)
    roots = env_roots(prefix)
    by_name = {normalise(e["output"], roots): e for e in edges}
    if set(by_name) != set(meta.get("outputs", [])):
        return None
    deps = meta.get("deps", {})
    latest = 0
    for inputs in deps.values():
        for dep in inputs:
            with contextlib.suppress(OSError):
                latest = max(latest, os.stat(localise(dep, prefix)).st_mtime_ns)
    # Newer than every input, so ninja finds each output up to date.
    stamp = max(latest + 1, time.time_ns())
    log, records = [], []
    for name, edge in by_name.items():
        out = Path(localise(name, prefix))
        if not out.is_absolute():
            out = build_dir / out
        copy_out(variant / "files" / meta["file_of"][name], out)
        os.utime(out, ns=(stamp, stamp))
        log.append((edge["output"], stamp, edge["command"]))
        if name in deps:
            records.append((edge["output"], stamp, [localise(d, prefix) for d in deps[name]]))
    write_log(build_dir / ".ninja_log", header, log)
    write_deps(build_dir / ".ninja_deps", records)
    note_use(store, variant, prefix)
    return meta


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
        "outputs": sorted(file_of),
        "file_of": file_of,
        "deps": deps,
        "ninja_log": header,
    }
    kept = store.publish(key, files, inputs, doc, prefix)
    if kept is not None:
        note_use(store, kept, prefix)
    return kept
