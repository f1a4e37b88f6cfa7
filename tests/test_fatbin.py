"""builder.machine.fatbin: device code read from fatbin headers, checked against cuobjdump's listing on
nvcc-built fixtures (tests/data/fatbin/README.md) and, where one is built here, a real env; and
corrupt input, built byte by byte, that must come back as an error, never an exception."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest

from builder.core import proc
from builder.machine.archs import Arch
from builder.machine.fatbin import DeviceCode, Needed, Scan, is_elf, needed, scan
from builder.verify import cubin
from tests.helpers import cudaenv, index_view, workspace

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "data" / "fatbin"


def sass(text: str) -> DeviceCode:
    return DeviceCode(kind="sass", arch=Arch.parse(text), ptx_isa=None)


def ptx(text: str, isa: tuple[int, int] = (9, 0)) -> DeviceCode:
    return DeviceCode(kind="ptx", arch=Arch.parse(text), ptx_isa=isa)


# What cuobjdump 13.2 lists for each fixture (README.md), with the suffix it drops from a
# family cubin's name (sm_120f is listed as sm_120) read back from the entry flags.
EXPECTED = {
    "mixed.o": (
        sass("8.6"), sass("9.0a"), sass("10.0a"), sass("12.0f"),
        ptx("8.0"), ptx("10.0a"), ptx("12.0f"),
    ),
    "family.o": (sass("10.0f"), sass("10.3a"), sass("12.0"), ptx("10.0f"), ptx("12.0")),
    "rdc.o": (sass("9.0a"), sass("12.0f"), ptx("9.0a")),
    "libshared.so": (sass("12.0"),),
}  # fmt: skip


# --------------------------------------------------------------------------- the fixtures


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_fixture_lists_the_code_cuobjdump_lists(name: str) -> None:
    found = scan(FIXTURES / name)
    assert found.error is None
    assert found.elf is True
    assert found.machine == 62
    assert set(found.codes) == set(EXPECTED[name])
    assert list(found.codes) == sorted(found.codes, key=_order)
    assert len(found.codes) == len(set(found.codes))


def _order(code: DeviceCode) -> tuple[bool, Arch, tuple[int, int]]:
    return (code.kind == "ptx", code.arch, code.ptx_isa or (0, 0))


def test_a_shared_library_names_what_it_needs() -> None:
    found = scan(FIXTURES / "libshared.so")
    assert found.needed[0] == "libcudart.so.13"
    assert "libc.so.6" in found.needed
    assert scan(FIXTURES / "mixed.o").needed == ()


def test_the_dynamic_section_alone_reads_what_a_scan_reads(tmp_path: Path) -> None:
    """``needed`` (the doctor's reader of hundreds of files) agrees with ``scan``, under the
    same rules: no symlink followed, a damaged file an error, never an exception."""
    for name in sorted(EXPECTED):
        assert needed(FIXTURES / name) == Needed(
            path=FIXTURES / name, elf=True, needed=scan(FIXTURES / name).needed, error=None
        )
    assert needed(FIXTURES / "libshared.so").needed[0] == "libcudart.so.13"
    link = tmp_path / "libfoo.so"
    link.symlink_to(FIXTURES / "libshared.so")
    assert needed(link).error == "a symlink: not followed"
    assert needed(tmp_path).error == "a directory, not a file"
    write_to = tmp_path / "lib.so"
    write_to.write_bytes(b"#!/bin/sh\n")
    assert needed(write_to) == Needed(path=write_to, elf=False, needed=(), error="not an ELF file")
    good = (FIXTURES / "libshared.so").read_bytes()
    for end in range(0, len(good), 211):
        write_to.write_bytes(good[:end])
        assert isinstance(needed(write_to), Needed)
    for at in range(0, len(good), 53):
        damaged = bytearray(good)
        damaged[at : at + 4] = b"\xff" * 4
        write_to.write_bytes(bytes(damaged))
        found = needed(write_to)
        assert found.error is not None or all(isinstance(n, str) for n in found.needed)


def test_device_code_reads_like_nvcc_spells_it() -> None:
    assert str(sass("12.0f")) == "sm_120f"
    assert str(ptx("10.0a", (8, 8))) == "compute_100a (PTX ISA 8.8)"


def test_is_elf(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    link = tmp_path / "link.so"
    link.symlink_to(FIXTURES / "mixed.o")
    assert is_elf(FIXTURES / "libshared.so")
    assert not is_elf(text)
    assert not is_elf(link)
    assert not is_elf(tmp_path)
    assert not is_elf(tmp_path / "missing")


# --------------------------------------------------------------------------- against cuobjdump


@pytest.fixture(scope="module")
def cuobjdump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cuobjdump on PATH, else NVIDIA's wheel of it (the one verify's cubin check installs)
    fetched here at the committed locks' index view: never a copy an earlier run or test left
    in a cache or under .envs/."""
    on_path = shutil.which("cuobjdump")
    if on_path:
        return Path(on_path)
    target = tmp_path_factory.mktemp("cuobjdump")
    proc.run([proc.uv_bin(), "pip", "install", "--quiet", "--target", str(target),
              "--exclude-newer", index_view(), cubin.TOOL_REQUIREMENT], timeout=600)  # fmt: skip
    tool = target / "nvidia" / "cu13" / "bin" / "cuobjdump"
    assert tool.is_file(), sorted(target.rglob("cuobjdump*"))
    return tool


@pytest.fixture(scope="module")
def real_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default spec's env, built here from its committed lock (uv's cache makes it quick
    after the other e2e tests): never one a user or an earlier run left under .envs/."""
    ws = workspace(tmp_path_factory.mktemp("real-env"), "default.yaml")
    cudaenv("build", "envspecs/default.yaml", "--env-dir", str(ws / "env"), cwd=ws,
            env={"CUDAENV_JIT_STORE": "off"})  # fmt: skip
    return ws / "env"


def cuobjdump_names(tool: Path, path: Path) -> set[str]:
    done = subprocess.run(
        [tool, "--list-elf", "--list-ptx", path], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return {f"{m[0]}.{m[1]}" for m in re.findall(r"\.(sm_\w+)\.(cubin|ptx)$", done.stdout, re.M)}


def as_cuobjdump_names(found: Scan) -> set[str]:
    """The names cuobjdump gives: a PTX name keeps its suffix, a cubin's keeps only 'a'."""
    names = set()
    for code in found.codes:
        if code.kind == "ptx":
            names.add(f"sm_{code.arch.code}.ptx")
        else:
            kept = code.arch.suffix if code.arch.suffix == "a" else ""
            names.add(f"{code.arch.cubin_sm}{kept}.cubin")
    return names


@pytest.mark.network
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_fixture_agrees_with_cuobjdump(name: str, cuobjdump: Path) -> None:
    assert as_cuobjdump_names(scan(FIXTURES / name)) == cuobjdump_names(cuobjdump, FIXTURES / name)


# Libraries of the default envs worth comparing and cheap for cuobjdump (each < 100 MB): a
# plain/'a' mix, 'f' cubins, __nv_relfatbin kept in a linked library, PTX of ISA 9.2.
REAL_LIBS = (
    "sgl_kernel/sm100/common_ops.abi3.so",
    "sgl_kernel/flashmla_ops.abi3.so",
    "deep_ep/_C.cpython-*.so",
    "torchvision/_C_stable.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
)


@pytest.mark.network
@pytest.mark.e2e
def test_real_env_libraries_agree_with_cuobjdump(cuobjdump: Path, real_env: Path) -> None:
    libs = [
        lib
        for pattern in REAL_LIBS
        for lib in sorted(real_env.glob(f"lib/python3*/site-packages/{pattern}"))
        if lib.stat().st_size < 100_000_000
    ]
    assert libs, f"the default env holds none of {', '.join(REAL_LIBS)}"
    for lib in libs:
        found = scan(lib)
        assert found.error is None, lib
        assert found.codes, lib
        assert as_cuobjdump_names(found) == cuobjdump_names(cuobjdump, lib), lib


@pytest.mark.network
@pytest.mark.e2e
def test_libtorch_cuda_is_scanned_fast(real_env: Path) -> None:
    libs = sorted(real_env.glob("lib/python3*/site-packages/torch/lib/libtorch_cuda.so"))
    assert libs, "the default env holds no torch/lib/libtorch_cuda.so"
    scan(libs[0])  # the headers into the page cache: what is timed is the parse
    started = time.monotonic()
    found = scan(libs[0])
    assert time.monotonic() - started < 2
    assert found.error is None
    assert sass("12.0") in found.codes


# --------------------------------------------------------------------------- built byte by byte

ET_REL, ET_DYN = 1, 3


def elf64(sections: dict[str, bytes], *, e_type: int = ET_REL, machine: int = 62) -> bytes:
    """A little-endian ELF64 file holding ``sections`` (PROGBITS) and a name table."""
    names = b"\0"
    offsets = []
    for name in [*sections, ".shstrtab"]:
        offsets.append(len(names))
        names += name.encode() + b"\0"
    body = b""
    headers = [b"\0" * 64]
    at = 64
    for i, data in enumerate([*sections.values(), names]):
        sh_type = 3 if i == len(sections) else 1
        headers.append(
            struct.pack("<IIQQQQIIQQ", offsets[i], sh_type, 0, 0, at, len(data), 0, 0, 8, 0)
        )
        body += data
        at += len(data)
    shoff = 64 + len(body)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + b"\0" * 9
    header = ident + struct.pack(
        "<HHIQQQIHHHHHH",
        e_type,
        machine,
        1,
        0,
        0,
        shoff,
        0,
        64,
        0,
        0,
        64,
        len(headers),
        len(headers) - 1,
    )
    return header + body + b"".join(headers)


def entry(
    kind: int = 2,
    sm: int = 120,
    *,
    version: tuple[int, int] = (1, 8),
    flags: int = 0x11,
    header_size: int = 64,
    payload: bytes = b"\xaa" * 32,
    payload_size: int | None = None,
) -> bytes:
    size = len(payload) if payload_size is None else payload_size
    head = struct.pack(
        "<HHIQIIHHIQQ", kind, 0x101, header_size, size, 0, 0, version[1], version[0], sm, 0, flags
    )
    return head.ljust(max(header_size, 48), b"\0") + payload


def container(*entries: bytes, size: int | None = None) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body) if size is None else size) + body


def scan_bytes(tmp_path: Path, data: bytes, name: str = "lib.so") -> Scan:
    path = tmp_path / name
    path.write_bytes(data)
    return scan(path)


def test_version_arch_and_suffix_come_from_the_entry_header(tmp_path: Path) -> None:
    fatbin = container(
        entry(1, 75, version=(8, 3), flags=0x2011),
        entry(2, 121, flags=0x1200011, header_size=112),
        entry(2, 90, flags=0x100011),
        entry(1, 100, version=(9, 3), flags=0x108011, header_size=80),
    )
    found = scan_bytes(tmp_path, elf64({".nv_fatbin": fatbin}))
    assert found.error is None
    assert found.codes == (sass("9.0a"), sass("12.1f"), ptx("7.5", (8, 3)), ptx("10.0a", (9, 3)))


def test_padding_between_containers_is_skipped(tmp_path: Path) -> None:
    fatbin = container(entry(2, 80)) + b"\0" * 40 + container(entry(2, 90))
    found = scan_bytes(tmp_path, elf64({".nv_fatbin": fatbin}))
    assert found.error is None
    assert found.codes == (sass("8.0"), sass("9.0"))


@pytest.mark.parametrize("pad", [4, 8, 12])
def test_padding_shorter_than_a_header_is_skipped(tmp_path: Path, pad: int) -> None:
    """The aarch64 wheels (sglang-kernel 0.4.10's common_ops, torch 2.14.1's libtorch_cuda)
    pad some containers by 8 bytes: a 16-byte read there is zeros, then the next magic."""
    fatbin = container(entry(2, 90)) + b"\0" * pad + container(entry(2, 121, flags=0x100000))
    found = scan_bytes(tmp_path, elf64({".nv_fatbin": fatbin}))
    assert found.error is None
    assert found.codes == (sass("9.0"), sass("12.1a"))


def test_relocatable_fatbin_of_a_linked_library_is_not_counted(tmp_path: Path) -> None:
    sections = {".nv_fatbin": container(entry(2, 90)), "__nv_relfatbin": container(entry(2, 120))}
    assert scan_bytes(tmp_path, elf64(sections, e_type=ET_DYN)).codes == (sass("9.0"),)
    assert scan_bytes(tmp_path, elf64(sections, e_type=ET_REL)).codes == (sass("9.0"), sass("12.0"))


def test_an_elf_without_device_code_is_no_error(tmp_path: Path) -> None:
    found = scan_bytes(tmp_path, elf64({".text": b"\x90" * 16}, machine=183))
    assert (found.elf, found.codes, found.error, found.machine) == (True, (), None, 183)


@pytest.mark.parametrize(
    ("fatbin", "error"),
    [
        (container(entry(2, 90), size=1 << 62),
         ".nv_fatbin+0x0: fatbin container claims 4611686018427387904 bytes, but only 96 remain in the section"),
        (container(entry(2, 90, header_size=0)),
         ".nv_fatbin+0x10: fatbin entry header size 0 is too small"),
        (container(entry(2, 90, payload_size=1 << 40)),
         ".nv_fatbin+0x10: fatbin entry claims 1099511627840 bytes, but only 96 remain in the container"),
        (container(entry(16, 90)), ".nv_fatbin+0x10: fatbin entry kind 16 is unknown"),
        (container(entry(2, 9)), ".nv_fatbin+0x10: fatbin entry arch 9 is out of range"),
        (container(entry(2, 120, flags=0x300011)),
         ".nv_fatbin+0x10: fatbin entry flags 0x300011 mark both 'a' and 'f'"),
        (b"\x01" * 24, ".nv_fatbin+0x0: not a fatbin container (magic 0x01010101)"),
        (b"\x01" * 8, ".nv_fatbin+0x0: 8 stray bytes after the last container"),
        (struct.pack("<IHHQ", 0xBA55ED50, 2, 16, 0), ".nv_fatbin+0x0: fatbin container version 2 is unknown"),
        (container(b"\0" * 20), ".nv_fatbin+0x10: 20 bytes left in the container, too few for an entry"),
    ],
)  # fmt: skip
def test_a_corrupt_fatbin_is_an_error(tmp_path: Path, fatbin: bytes, error: str) -> None:
    found = scan_bytes(tmp_path, elf64({".nv_fatbin": container(entry(2, 80)) + fatbin}))
    # The first container is sound: what it holds is kept, the file is still not whole.
    assert found.codes == (sass("8.0"),)
    assert found.error == _shift(error, len(container(entry(2, 80))))


def _shift(error: str, by: int) -> str:
    """``error`` with its ``.nv_fatbin+0xN`` offset moved past the sound leading container."""
    return re.sub(r"\+0x([0-9a-f]+)", lambda m: f"+{int(m.group(1), 16) + by:#x}", error, count=1)


def test_corrupt_files_are_errors(tmp_path: Path) -> None:
    good = (FIXTURES / "mixed.o").read_bytes()
    assert scan_bytes(tmp_path, b"#!/bin/sh\n").error == "not an ELF file"
    assert scan_bytes(tmp_path, b"#!/bin/sh\n").elf is False
    assert scan_bytes(tmp_path, b"").error == "not an ELF file"
    truncated = scan_bytes(tmp_path, good[: len(good) // 2])
    assert truncated.elf is True
    assert truncated.error is not None
    assert "lies past the end of the file" in truncated.error
    no_sections = bytearray(elf64({}))
    no_sections[0x28:0x30] = bytes(8)  # e_shoff = 0
    assert scan_bytes(tmp_path, bytes(no_sections)).error == (
        "no section headers: device code cannot be located"
    )
    huge_table = bytearray(elf64({}))
    huge_table[0x3C:0x3E] = struct.pack("<H", 0xFFFF)  # e_shnum past the file
    assert "section header table" in (scan_bytes(tmp_path, bytes(huge_table)).error or "")
    odd_class = bytearray(good)
    odd_class[4] = 9
    assert scan_bytes(tmp_path, bytes(odd_class)).error == "unknown ELF class 9"


def test_what_is_no_regular_file_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "libfoo.so"
    link.symlink_to(FIXTURES / "mixed.o")
    assert scan(link).error == "a symlink: not followed"
    assert scan(link).codes == ()
    assert scan(tmp_path).error == "a directory, not a file"
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert scan(fifo).error == "not a regular file"
    assert (scan(tmp_path / "missing").error or "").startswith("cannot open: ")


def test_no_damage_to_a_real_object_raises(tmp_path: Path) -> None:
    good = (FIXTURES / "mixed.o").read_bytes()
    path = tmp_path / "damaged.o"
    for at in range(0, len(good), 37):
        for value in (0x00, 0xFF, 0x7F):
            damaged = bytearray(good)
            damaged[at : at + 4] = bytes([value]) * 4
            path.write_bytes(bytes(damaged))
            assert isinstance(scan(path), Scan)
    for end in range(0, len(good), 211):
        path.write_bytes(good[:end])
        assert isinstance(scan(path), Scan)
