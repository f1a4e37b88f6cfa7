"""What CUDA device code an ELF file carries, read from headers alone.

A library built by nvcc keeps its kernels in fatbin containers in the ``.nv_fatbin`` section
(``__nv_relfatbin`` in a relocatable ``-rdc`` object). Each container is a 16-byte header and a
run of entries; each entry header names its kind, its SM arch, its code version and flags, and
is followed by its (often compressed) payload. Walking those headers by seeking, never reading
a payload, lists a 1 GB library's SASS and PTX archs in milliseconds where ``cuobjdump
--list-elf`` reads every byte.

The layout below was established against cuobjdump 13.2 on nvcc 13.0 objects and on every
fatbin in the sglang and vLLM envs; NVIDIA does not document it. All little-endian:

container header (16 bytes)
    u32 magic 0xBA55ED50, u16 version 1, u16 header size 16, u64 size of the entries.
entry header (64 to 144 bytes seen)
    +0 u16 kind (1 PTX, 2 ELF cubin), +2 u16 (0x0101), +4 u32 header size, +8 u64 payload
    size (the next entry starts at entry + header size + payload size), +24 u16 minor and
    +26 u16 major of the code version (``code version = [9,0]`` in cuobjdump: for PTX the PTX
    ISA, the ``.version`` line of the PTX text), +28 u32 SM arch (120 = 12.0),
    +40 u64 flags: 0x100000 = arch-specific (``sm_90a``), 0x200000 = family (``sm_120f``).

Files are untrusted input: every size and offset is checked against the file, each read is
bounded, and a file that cannot be read whole comes back with ``error`` set, never an exception.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from builder.machine.archs import Arch, CodeKind

__all__ = ["CodeKind", "DeviceCode", "Needed", "Scan", "is_elf", "needed", "scan"]

ELF_MAGIC = b"\x7fELF"
# Bumped whenever what a scan finds in the same file could change (cached scans are keyed by it).
READER_VERSION = 2
CONTAINER_MAGIC = 0xBA55ED50
CONTAINER_VERSION = 1
# Where nvcc puts fatbin containers: the code the CUDA runtime loads, and in a relocatable
# (-rdc) object its device-linkable code. A linked library keeps its objects'
# __nv_relfatbin too, as input for a later device link that the runtime never loads (deep_ep
# holds sm_120 there, but only sm_90/100/103 in .nv_fatbin); like cuobjdump without -all,
# it is read in relocatable objects only.
FATBIN_SECTION = ".nv_fatbin"
RELOCATABLE_FATBIN_SECTION = "__nv_relfatbin"
ET_REL = 1

ENTRY_PTX = 1
ENTRY_ELF = 2
# The entry header fields read (kind .. flags); every header seen is longer.
ENTRY_PREFIX = 48
FLAG_ARCH_SPECIFIC = 0x100000
FLAG_FAMILY = 0x200000

SHT_NOBITS = 8
SHT_DYNAMIC = 6
DT_NULL = 0
DT_NEEDED = 1
SHN_XINDEX = 0xFFFF

# Bounds on what one read may allocate, far above any real library's: a header claiming
# more is corrupt, not a reason to allocate gigabytes.
MAX_SECTIONS = 1 << 18
MAX_DYNAMIC_BYTES = 1 << 20
MAX_SHSTRTAB_BYTES = 16 << 20
MAX_SONAME = 4096
NAMES_WINDOW = 64 << 10
ZERO_CHUNK = 1 << 16


@dataclass(frozen=True, kw_only=True)
class DeviceCode:
    """One kind of code for one arch: ``sass`` (a cubin) or ``ptx`` (with its ISA version)."""

    kind: CodeKind
    arch: Arch
    ptx_isa: tuple[int, int] | None  # PTX: the ISA version, (9, 0); SASS: None

    def __str__(self) -> str:
        if self.kind == "sass":
            return self.arch.sm
        isa = "" if self.ptx_isa is None else f" (PTX ISA {self.ptx_isa[0]}.{self.ptx_isa[1]})"
        return f"compute_{self.arch.code}{isa}"


@dataclass(frozen=True, kw_only=True)
class Scan:
    """What :func:`scan` read from one file. ``error`` set means the file was not read whole:
    ``codes`` then holds what was found before it, and no caller counts the file as covered."""

    path: Path
    elf: bool
    codes: tuple[DeviceCode, ...]  # deduplicated, sorted
    needed: tuple[str, ...]  # DT_NEEDED sonames, in the dynamic section's order
    machine: int | None  # e_machine: 62 x86_64, 183 aarch64
    error: str | None

    @property
    def links_torch(self) -> bool:
        """Whether the ELF links torch's own libraries (an extension module built against it)."""
        return any(name.startswith(("libc10", "libtorch")) for name in self.needed)

    def to_json(self) -> dict[str, object]:
        """What a scan cache keeps (the path is the cache's key, not stored)."""
        return {
            "elf": self.elf,
            "codes": [
                [c.kind, str(c.arch), list(c.ptx_isa) if c.ptx_isa else None] for c in self.codes
            ],
            "needed": list(self.needed),
            "machine": self.machine,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, doc: object, path: Path) -> Scan | None:
        """A cached scan of ``path``; None for anything not written by :meth:`to_json` (the
        file is then scanned again: a cache never decides what a binary holds by itself)."""
        try:
            assert isinstance(doc, dict)
            codes = []
            for kind, arch, isa in doc["codes"]:
                assert kind in ("sass", "ptx")
                ptx_isa = None
                if isa is not None:
                    major, minor = isa
                    assert isinstance(major, int) and isinstance(minor, int)
                    ptx_isa = (major, minor)
                codes.append(DeviceCode(kind=kind, arch=Arch.parse(arch), ptx_isa=ptx_isa))
            needed, machine, error = doc["needed"], doc["machine"], doc["error"]
            assert isinstance(needed, list) and all(isinstance(n, str) for n in needed)
            assert machine is None or isinstance(machine, int)
            assert error is None or isinstance(error, str)
            assert isinstance(doc["elf"], bool)
            return cls(
                path=path,
                elf=doc["elf"],
                codes=tuple(codes),
                needed=tuple(needed),
                machine=machine,
                error=error,
            )
        except (AssertionError, KeyError, TypeError, ValueError):
            return None


class _Corrupt(Exception):
    """A header that does not hold; becomes :attr:`Scan.error`."""


class _Reader:
    """Bounded positional reads of one open file: a read past its end is corruption."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    def read(self, offset: int, length: int, what: str) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise _Corrupt(
                f"{what} at offset {offset:#x} ({length} bytes) lies past the end of the file "
                f"({self.size} bytes)"
            )
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise _Corrupt(f"{what} at offset {offset:#x}: short read (the file shrank?)")
        return data


@dataclass(frozen=True)
class _Section:
    name_offset: int
    type: int
    offset: int
    size: int
    link: int


@dataclass(frozen=True)
class _Elf:
    endian: str  # struct prefix, "<" or ">"
    is64: bool
    type: int
    machine: int
    shoff: int
    shentsize: int
    shnum: int
    shstrndx: int


def is_elf(path: Path) -> bool:
    """Whether ``path`` is a regular file starting with the ELF magic (symlinks not followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.pread(fd, 4, 0) == ELF_MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)


def scan(path: Path) -> Scan:
    """The device code, DT_NEEDED sonames and machine of the ELF file at ``path``.

    ``path`` itself must be a regular file; a symlink is refused, not followed, so a scan of a
    tree never reads outside it."""
    return _read(path, lambda reader: _scan_fd(path, reader), lambda error: _failed(path, error))


@dataclass(frozen=True, kw_only=True)
class Needed:
    """What :func:`needed` read: the DT_NEEDED sonames, or why they could not be read."""

    path: Path
    elf: bool
    needed: tuple[str, ...]  # in the dynamic section's order
    error: str | None


def needed(path: Path) -> Needed:
    """Only the DT_NEEDED sonames of the ELF file at ``path``, under :func:`scan`'s rules (a
    symlink is refused, every read bounded). It reads the ELF header, the section header table
    and the dynamic section, never a fatbin: what links a library is asked of hundreds of
    files where their device code is wanted of a few (a full scan of a 207-package env's 700
    shared objects takes 1.5 s, this 20 ms)."""
    return _read(
        path,
        lambda reader: _needed_fd(path, reader),
        lambda error: Needed(path=path, elf=False, needed=(), error=error),
    )


_T = TypeVar("_T")


def _read(path: Path, read: Callable[[_Reader], _T], failed: Callable[[str], _T]) -> _T:
    """``read`` over the regular file at ``path``, opened without following a symlink; what
    keeps it from being read becomes ``failed(why)``, never an exception."""
    try:
        # O_NONBLOCK: a FIFO planted in the tree must not hang the open.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return failed("a symlink: not followed")
        return failed(f"cannot open: {e.strerror or e}")
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return failed("a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            return failed("not a regular file")
        return read(_Reader(fd, st.st_size))
    except OSError as e:
        return failed(f"read failed: {e.strerror or e}")
    finally:
        os.close(fd)


def _needed_fd(path: Path, reader: _Reader) -> Needed:
    if reader.size < 4 or reader.read(0, 4, "ELF magic") != ELF_MAGIC:
        return Needed(path=path, elf=False, needed=(), error="not an ELF file")
    try:
        elf = _elf_header(reader)
        if elf.shoff == 0:
            raise _Corrupt("no section headers: the dynamic section cannot be located")
        raw, count = _section_table(reader, elf)
        # Only the dynamic section's header is made: building all of them (a library has up
        # to ~100) cost two thirds of this reader's time.
        dynamic = next(
            (
                _section_header(raw, i * elf.shentsize, elf)
                for i in range(count)
                if struct.unpack_from(elf.endian + "I", raw, i * elf.shentsize + 4)[0]
                == SHT_DYNAMIC
            ),
            None,
        )
        names = []
        if dynamic is not None:
            if dynamic.link >= count:
                raise _Corrupt(
                    f"dynamic section links to section {dynamic.link}, which does not exist"
                )
            strtab = _section_header(raw, dynamic.link * elf.shentsize, elf)
            names = _needed(reader, elf, dynamic, strtab)
    except _Corrupt as e:
        return Needed(path=path, elf=True, needed=(), error=str(e))
    return Needed(path=path, elf=True, needed=tuple(names), error=None)


def _failed(path: Path, error: str, *, elf: bool = False) -> Scan:
    return Scan(path=path, elf=elf, codes=(), needed=(), machine=None, error=error)


def _scan_fd(path: Path, reader: _Reader) -> Scan:
    if reader.size < 4 or reader.read(0, 4, "ELF magic") != ELF_MAGIC:
        return _failed(path, "not an ELF file")
    found: set[DeviceCode] = set()
    needed: list[str] = []
    machine: int | None = None
    error: str | None = None
    try:
        elf = _elf_header(reader)
        machine = elf.machine
        if elf.shoff == 0:
            # Without section headers the containers cannot be found, nor their absence shown.
            raise _Corrupt("no section headers: device code cannot be located")
        sections = _section_headers(reader, elf)
        named = list(zip(_section_names(reader, elf, sections), sections, strict=True))
        dynamic = next((s for _, s in named if s.type == SHT_DYNAMIC), None)
        if dynamic is not None:
            if dynamic.link >= len(sections):
                raise _Corrupt(
                    f"dynamic section links to section {dynamic.link}, which does not exist"
                )
            needed = _needed(reader, elf, dynamic, sections[dynamic.link])
        wanted = {FATBIN_SECTION}
        if elf.type == ET_REL:
            wanted.add(RELOCATABLE_FATBIN_SECTION)
        for name, section in named:
            if name in wanted and section.type != SHT_NOBITS:
                _walk_fatbin(reader, section, name, found)
    except _Corrupt as e:
        error = str(e)
    codes = tuple(sorted(found, key=_order))
    return Scan(
        path=path, elf=True, codes=codes, needed=tuple(needed), machine=machine, error=error
    )


def _order(code: DeviceCode) -> tuple[bool, Arch, tuple[int, int]]:
    """SASS before PTX (as cuobjdump lists them), then by arch and ISA."""
    return (code.kind == "ptx", code.arch, code.ptx_isa or (0, 0))


def _elf_header(reader: _Reader) -> _Elf:
    ident = reader.read(0, 16, "ELF identification")
    if ident[4] not in (1, 2):
        raise _Corrupt(f"unknown ELF class {ident[4]}")
    if ident[5] not in (1, 2):
        raise _Corrupt(f"unknown ELF data encoding {ident[5]}")
    is64 = ident[4] == 2
    endian = "<" if ident[5] == 1 else ">"
    if is64:
        raw = reader.read(16, 48, "ELF header")
        typ, machine, shoff, shentsize, shnum, shstrndx = (
            struct.unpack_from(endian + "HH", raw, 0)
            + struct.unpack_from(endian + "Q", raw, 24)
            + struct.unpack_from(endian + "HHH", raw, 42)
        )
        min_entsize = 64
    else:
        raw = reader.read(16, 36, "ELF header")
        typ, machine, shoff, shentsize, shnum, shstrndx = (
            struct.unpack_from(endian + "HH", raw, 0)
            + struct.unpack_from(endian + "I", raw, 16)
            + struct.unpack_from(endian + "HHH", raw, 30)
        )
        min_entsize = 40
    if shoff and shentsize < min_entsize:
        raise _Corrupt(f"section header entry size {shentsize} is below {min_entsize}")
    return _Elf(endian, is64, typ, machine, shoff, shentsize, shnum, shstrndx)


def _section_header(raw: bytes, at: int, elf: _Elf) -> _Section:
    if elf.is64:
        name, typ, _, _, offset, size, link = struct.unpack_from(elf.endian + "IIQQQQI", raw, at)
    else:
        name, typ, _, _, offset, size, link = struct.unpack_from(elf.endian + "IIIIIII", raw, at)
    return _Section(name, typ, offset, size, link)


def _section_headers(reader: _Reader, elf: _Elf) -> list[_Section]:
    if elf.shoff == 0:
        return []
    raw, count = _section_table(reader, elf)
    return [_section_header(raw, i * elf.shentsize, elf) for i in range(count)]


def _section_table(reader: _Reader, elf: _Elf) -> tuple[bytes, int]:
    """The section header table's bytes and its number of entries."""
    first = _section_header(reader.read(elf.shoff, elf.shentsize, "section header 0"), 0, elf)
    # ELF extended numbering: past 0xff00 sections the count lives in section 0's size.
    count = elf.shnum or first.size
    if not 0 < count <= MAX_SECTIONS:
        raise _Corrupt(f"section count {count} is out of range")
    return reader.read(elf.shoff, count * elf.shentsize, "section header table"), count


def _section_names(reader: _Reader, elf: _Elf, sections: list[_Section]) -> list[str]:
    if not sections:
        return []
    index = sections[0].link if elf.shstrndx == SHN_XINDEX else elf.shstrndx
    if index >= len(sections):
        raise _Corrupt(f"section name table index {index} is out of range")
    table = sections[index]
    if table.size > MAX_SHSTRTAB_BYTES:
        raise _Corrupt(f"section name table of {table.size} bytes is implausibly large")
    strings = reader.read(table.offset, table.size, "section name table")
    names = []
    for section in sections:
        end = strings.find(b"\0", section.name_offset)
        if section.name_offset >= len(strings) or end < 0:
            raise _Corrupt(f"section name offset {section.name_offset} is out of range")
        names.append(strings[section.name_offset : end].decode("latin-1"))
    return names


def _needed(reader: _Reader, elf: _Elf, dynamic: _Section, strtab: _Section) -> list[str]:
    if dynamic.size > MAX_DYNAMIC_BYTES:
        raise _Corrupt(f"dynamic section of {dynamic.size} bytes is implausibly large")
    raw = reader.read(dynamic.offset, dynamic.size, "dynamic section")
    fmt, step = (elf.endian + "qQ", 16) if elf.is64 else (elf.endian + "iI", 8)
    offsets = []
    for tag, value in struct.iter_unpack(fmt, raw[: len(raw) - len(raw) % step]):
        if tag == DT_NULL:
            break
        if tag != DT_NEEDED:
            continue
        if value >= strtab.size:
            raise _Corrupt(f"DT_NEEDED name offset {value} lies outside the string table")
        offsets.append(value)
    if not offsets:
        return []
    # One read for every name where they lie close together (in each library seen), not one
    # per name: the doctor reads the names of hundreds of files.
    low, high = min(offsets), min(max(offsets) + MAX_SONAME, strtab.size)
    if high - low <= NAMES_WINDOW:
        window = reader.read(strtab.offset + low, high - low, "DT_NEEDED names")
        texts = [window[v - low : v - low + MAX_SONAME] for v in offsets]
    else:
        texts = [
            reader.read(strtab.offset + v, min(MAX_SONAME, strtab.size - v), "DT_NEEDED name")
            for v in offsets
        ]
    needed = []
    for value, text in zip(offsets, texts, strict=True):
        end = text.find(b"\0")
        if end < 0:
            raise _Corrupt(f"DT_NEEDED name at {value} is not terminated")
        needed.append(text[:end].decode("utf-8", "replace"))
    return needed


def _walk_fatbin(reader: _Reader, section: _Section, name: str, found: set[DeviceCode]) -> None:
    if section.offset + section.size > reader.size:
        raise _Corrupt(
            f"{name}: section at {section.offset:#x} ({section.size} bytes) lies past the end "
            f"of the file ({reader.size} bytes)"
        )
    start = section.offset
    end = start + section.size
    at = start
    while end - at >= 16:
        magic, version, header_size, size = struct.unpack(
            "<IHHQ", reader.read(at, 16, f"{name} container header")
        )
        where = f"{name}+{at - start:#x}"
        if magic == 0:
            # Alignment padding between containers: zeros up to the next container's magic,
            # whose first byte (0x50) is never zero. The aarch64 wheels (sglang-kernel 0.4.10,
            # torch 2.14.1) pad some containers by 8 bytes only, less than a header.
            nxt = _skip_zeros(reader, at, end, name)
            if nxt == at:  # pragma: no cover - a zero magic means at least one zero byte
                raise _Corrupt(f"{where}: not a fatbin container (magic {magic:#010x})")
            at = nxt
            continue
        if magic != CONTAINER_MAGIC:
            raise _Corrupt(f"{where}: not a fatbin container (magic {magic:#010x})")
        if version != CONTAINER_VERSION:
            raise _Corrupt(f"{where}: fatbin container version {version} is unknown")
        if header_size < 16:
            raise _Corrupt(f"{where}: fatbin container header size {header_size} is below 16")
        body = at + header_size
        if size > end - body:
            raise _Corrupt(
                f"{where}: fatbin container claims {size} bytes, but only {max(end - body, 0)} "
                f"remain in the section"
            )
        _walk_entries(reader, body, body + size, name, start, found)
        at = body + size
    if at < end and any(reader.read(at, end - at, f"{name} tail")):
        raise _Corrupt(f"{name}+{at - start:#x}: {end - at} stray bytes after the last container")


def _skip_zeros(reader: _Reader, at: int, end: int, name: str) -> int:
    """The offset of the first non-zero byte at or after ``at`` (``end`` if none)."""
    while at < end:
        chunk = reader.read(at, min(ZERO_CHUNK, end - at), f"{name} padding")
        stripped = chunk.lstrip(b"\0")
        if stripped:
            return at + len(chunk) - len(stripped)
        at += len(chunk)
    return end


def _walk_entries(
    reader: _Reader, at: int, end: int, name: str, start: int, found: set[DeviceCode]
) -> None:
    while at < end:
        where = f"{name}+{at - start:#x}"
        if end - at < ENTRY_PREFIX:
            raise _Corrupt(f"{where}: {end - at} bytes left in the container, too few for an entry")
        raw = reader.read(at, ENTRY_PREFIX, f"{name} entry header")
        kind, header_size, payload_size = struct.unpack_from("<H2xIQ", raw, 0)
        minor, major, sm = struct.unpack_from("<HHI", raw, 24)
        (flags,) = struct.unpack_from("<Q", raw, 40)
        if header_size < ENTRY_PREFIX:
            raise _Corrupt(f"{where}: fatbin entry header size {header_size} is too small")
        if header_size + payload_size > end - at:
            raise _Corrupt(
                f"{where}: fatbin entry claims {header_size + payload_size} bytes, but only "
                f"{end - at} remain in the container"
            )
        found.add(_device_code(kind, sm, (major, minor), flags, where))
        at += header_size + payload_size


def _device_code(
    kind: int, sm: int, version: tuple[int, int], flags: int, where: str
) -> DeviceCode:
    if kind == ENTRY_ELF:
        code_kind: CodeKind = "sass"
    elif kind == ENTRY_PTX:
        code_kind = "ptx"
    else:
        # Only kinds 1 and 2 were seen and checked against cuobjdump; guessing at another would
        # let a caller count code it cannot run.
        raise _Corrupt(f"{where}: fatbin entry kind {kind} is unknown")
    if not 10 <= sm <= 999:
        raise _Corrupt(f"{where}: fatbin entry arch {sm} is out of range")
    specific, family = bool(flags & FLAG_ARCH_SPECIFIC), bool(flags & FLAG_FAMILY)
    if specific and family:
        raise _Corrupt(f"{where}: fatbin entry flags {flags:#x} mark both 'a' and 'f'")
    suffix = "a" if specific else "f" if family else ""
    arch = Arch(major=sm // 10, minor=sm % 10, suffix=suffix)
    return DeviceCode(kind=code_kind, arch=arch, ptx_isa=version if kind == ENTRY_PTX else None)
