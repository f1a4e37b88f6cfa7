"""The ``cuda-home/`` overlay, the ``libcuda`` stub, the start-up hook and activation.

A pip-installed CUDA 13 prefix (``site-packages/nvidia/cu13``) is not a usable CUDA_HOME:
it has ``lib/`` not ``lib64/``, only the versioned ``libcudart.so.13`` and no ``libcuda.so``
stub, so FlashInfer's link step fails with ``cannot find -lcudart`` / ``-lcuda``
(flashinfer#5064). The overlay gives it that shape with relative symlinks, so the
env can be built beside its final path and renamed into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.core import cachefiles, proc, settings
from builder.core.cudaversion import CudaVersion
from builder.core.errors import BuildError, ToolMissing
from builder.core.paths import cache_dir
from builder.core.platforms import Platform
from builder.spec import channels
from builder.spec.envspec import EnvSpec

if TYPE_CHECKING:
    pass
from builder.machine import toolkits


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3.*/site-packages"))
    if not found:
        raise BuildError(f"{venv}: no lib/python3.*/site-packages; not a venv?")
    return found[0]


@dataclass(frozen=True, kw_only=True)
class Overlay:
    cuda_home: Path
    prefix: Path  # what bin/include/nvvm point into
    nvcc_release: str


def _rel_symlink(target: Path, link: Path) -> None:
    link.symlink_to(os.path.relpath(target, link.parent))


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


# The stub's source and flags; part of the cache key, so a change here builds a new stub.
_STUB_SOURCE = "/* link-time stand-in for the driver's libcuda.so.1 */\n"
_STUB_FLAGS = ("-shared", "-nostdlib", "-Wl,-soname,libcuda.so.1")
# The stub is ~14 KB; a cached file far larger is not one cudaenv compiled.
_STUB_MAX = 1 << 20


def _c_compiler() -> str:
    cc = settings.current().cc or proc.which("cc") or proc.which("gcc")
    if not cc:
        raise ToolMissing(
            "no C compiler (cc/gcc) to build the libcuda.so link stub; install one "
            "(`apt-get install gcc`); nvcc needs it as host compiler anyway",
            tool="cc",
        )
    return cc


def _stub_cache(cc: str) -> Path | None:
    """Where the stub built by this compiler is kept, keyed by the compiler's identity (the
    file ``cc`` resolves to, and its inode, size and mtime), the flags and the source; None
    when the compiler cannot be found (the compile then fails with its own message)."""
    exe = proc.which(cc)
    if exe is None:
        return None
    real = Path(exe).resolve()
    identity = toolkits.file_identity(real)
    if identity is None:
        return None
    material = json.dumps([str(real), identity, _STUB_FLAGS, _STUB_SOURCE])
    digest = hashlib.sha256(material.encode()).hexdigest()[:32]
    return cache_dir() / "stubs" / digest / "libcuda.so"


def build_libcuda_stub(stubs: Path) -> Path:
    """An empty shared object with soname ``libcuda.so.1``: links fine, the real driver
    library is found at run time.

    Compiled once per C compiler and kept in cudaenv's cache: running ``cc`` costs ~25 ms of
    a ~3 s warm build, and the object depends on nothing but the compiler, the flags and the
    source. Each env gets a copy of the cached file, taken only under the cache's trust rules
    (cachefiles)."""
    cc = _c_compiler()
    stubs.mkdir(parents=True, exist_ok=True)
    out = stubs / "libcuda.so"
    cached = _stub_cache(cc)
    kept = cachefiles.read_bytes(cached, _STUB_MAX) if cached is not None else None
    if kept is not None and kept[:4] == b"\x7fELF":
        out.unlink(missing_ok=True)
        out.write_bytes(kept)
        out.chmod(0o755)
        return out
    _compile_stub(cc, out)
    if cached is not None:
        with contextlib.suppress(OSError):  # only a cache
            cachefiles.write_bytes(cached, out.read_bytes(), mode=0o755)
    return out


def _compile_stub(cc: str, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="cudaenv-stub-") as tmp:
        src = Path(tmp) / "libcuda_stub.c"
        src.write_text(_STUB_SOURCE)
        try:
            proc.run([cc, *_STUB_FLAGS, "-o", str(out), str(src)])
        except ToolMissing as exc:
            raise ToolMissing(
                f"C compiler {cc} not found: it builds the libcuda.so link stub and is nvcc's "
                "host compiler; install one (`apt-get install gcc`) or point CC at it",
                tool=cc,
            ) from exc


def elf_libcuda_stub(e_machine: int) -> bytes:
    """The link stub for another machine, written without its C compiler: a 64-bit
    little-endian ELF shared object (x86_64 = 62, aarch64 = 183) whose only content is the
    soname ``libcuda.so.1`` (what ``cc -shared -nostdlib -Wl,-soname,libcuda.so.1`` of an
    empty file gives: GNU ld and lld read the soname from .dynamic and record it as NEEDED).
    """
    dynstr = b"\0libcuda.so.1\0"
    shstrtab = b"\0.hash\0.dynsym\0.dynstr\0.dynamic\0.shstrtab\0"
    ehdr_size, phdr_size, shdr_size = 64, 56, 64

    def align(n: int) -> int:
        return (n + 7) & ~7

    off_dynstr = ehdr_size + 2 * phdr_size
    off_dynsym = align(off_dynstr + len(dynstr))
    off_hash = off_dynsym + 24  # one (null) symbol
    off_dynamic = align(off_hash + 16)  # nbucket, nchain, bucket[0], chain[0]
    dt = [(14, 1), (4, off_hash), (5, off_dynstr), (6, off_dynsym), (10, len(dynstr)),
          (11, 24), (0, 0)]  # fmt: skip  # SONAME HASH STRTAB SYMTAB STRSZ SYMENT NULL
    dynamic = b"".join(struct.pack("<qQ", tag, value) for tag, value in dt)
    off_shstrtab = off_dynamic + len(dynamic)
    off_shdrs = align(off_shstrtab + len(shstrtab))
    end = off_dynamic + len(dynamic)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # 64-bit, little-endian, SysV
    ehdr = ident + struct.pack(
        "<HHIQQQIHHHHHH", 3, e_machine, 1, 0, ehdr_size, off_shdrs, 0,
        ehdr_size, phdr_size, 2, shdr_size, 6, 5,
    )  # fmt: skip  # ET_DYN; six sections, .shstrtab the last
    phdrs = struct.pack("<IIQQQQQQ", 1, 6, 0, 0, 0, end, end, 0x10000)  # PT_LOAD, RW
    phdrs += struct.pack(
        "<IIQQQQQQ", 2, 6, off_dynamic, off_dynamic, off_dynamic, len(dynamic), len(dynamic), 8
    )  # PT_DYNAMIC

    def shdr(name: bytes, kind: int, flags: int, off: int, size: int, link: int, info: int,
             addralign: int, entsize: int) -> bytes:  # fmt: skip
        index = shstrtab.index(b"\0" + name + b"\0") + 1 if name else 0
        addr = off if flags & 2 else 0
        return struct.pack(
            "<IIQQQQIIQQ", index, kind, flags, addr, off, size, link, info, addralign, entsize
        )

    shdrs = b"".join([
        shdr(b"", 0, 0, 0, 0, 0, 0, 0, 0),
        shdr(b".hash", 5, 2, off_hash, 16, 2, 0, 8, 4),
        shdr(b".dynsym", 11, 2, off_dynsym, 24, 3, 1, 8, 24),
        shdr(b".dynstr", 3, 2, off_dynstr, len(dynstr), 0, 0, 1, 0),
        shdr(b".dynamic", 6, 3, off_dynamic, len(dynamic), 3, 0, 8, 16),
        shdr(b".shstrtab", 3, 0, off_shstrtab, len(shstrtab), 0, 0, 1, 0),
    ])  # fmt: skip
    body = bytearray(off_shdrs)
    body[: len(ehdr)] = ehdr
    body[ehdr_size : ehdr_size + len(phdrs)] = phdrs
    body[off_dynstr : off_dynstr + len(dynstr)] = dynstr
    body[off_hash : off_hash + 16] = struct.pack("<IIII", 1, 1, 0, 0)
    body[off_dynamic : off_dynamic + len(dynamic)] = dynamic
    body[off_shstrtab : off_shstrtab + len(shstrtab)] = shstrtab
    return bytes(body) + shdrs


def wheel_overlay(venv: Path, spec: EnvSpec, platform: Platform | None = None) -> Overlay:
    """cuda-home/ from the CUDA 13 wheels' single prefix. With ``platform`` (another
    machine's: ``cudaenv build --platform``) nothing in it is run: the link stub is written
    for that machine and the release is read from the nvcc wheel's metadata. The aarch64
    wheels unpack to the same ``nvidia/cu13/{bin,include,lib,nvvm}`` as x86_64 (no
    ``targets/sbsa-linux`` as in NVIDIA's installers)."""
    site = site_packages(venv)
    prefix = site / channels.layout(spec.cuda_major).prefix
    missing = [d for d in ("bin/nvcc", "include", "lib") if not (prefix / d).exists()]
    if missing:
        raise BuildError(
            f"{prefix}: the toolkit wheels lack {', '.join(missing)}; is 'nvcc' among "
            "toolchain.components?"
        )
    home = venv / "cuda-home"
    home.mkdir()
    for name in ("include", "nvvm"):
        if (prefix / name).exists():
            _rel_symlink(prefix / name, home / name)
    # bin/ is a real directory of hard links, not a symlink: nvcc.profile says
    # TOP = $(_HERE_)/.. and the kernel resolves "bin/.." through a symlinked bin to the wheel
    # prefix, whose lib/ has no lib64/ (cannot find -lcudadevrt). Hard links cost no space.
    bin_dir = home / "bin"
    bin_dir.mkdir()
    for item in sorted((prefix / "bin").iterdir()):
        if item.is_dir():
            _rel_symlink(item, bin_dir / item.name)
        else:
            _link_or_copy(item, bin_dir / item.name)
    lib64 = home / "lib64"
    lib64.mkdir()
    libs = sorted(
        p
        for p in (prefix / "lib").iterdir()
        if p.is_file() and (".so" in p.name or p.suffix == ".a")
    )
    for lib in libs:
        _rel_symlink(lib, lib64 / lib.name)
    # Unversioned names for the linker (-lcudart): wheels ship only libcudart.so.13.
    for lib in libs:
        m = re.match(r"^(lib[\w+-]+\.so)\.\d+$", lib.name)
        if m and not (lib64 / m.group(1)).exists():
            (lib64 / m.group(1)).symlink_to(lib.name)
    if not (lib64 / "libcudart.so").exists():
        raise BuildError(
            f"{prefix / 'lib'}: no libcudart.so.*; is 'cudart' among toolchain.components?"
        )
    if platform is None:
        build_libcuda_stub(lib64 / "stubs")
    else:
        (lib64 / "stubs").mkdir()
        (lib64 / "stubs" / "libcuda.so").write_bytes(elf_libcuda_stub(platform.elf_machine))
    (home / "lib").symlink_to("lib64")
    release = toolkits.nvcc_release(home) if platform is None else _nvcc_wheel_release(site)
    if release != spec.cuda:
        raise BuildError(f"{home}/bin/nvcc is CUDA {release} but the spec asks {spec.cuda}")
    return Overlay(cuda_home=home, prefix=prefix, nvcc_release=release)


def _nvcc_wheel_release(site: Path) -> str:
    """``13.0`` from the installed nvidia-cuda-nvcc wheel's version (13.0.88): what its nvcc
    prints as ``release``, read without running a binary of another machine."""
    for dist in sorted(site.glob("nvidia_cuda_nvcc-*.dist-info")):
        version = dist.name.removesuffix(".dist-info").split("-", 1)[1]
        release = CudaVersion.read(version)
        if release is not None:
            return str(release)
    raise BuildError(
        f"{site}: no nvidia_cuda_nvcc-*.dist-info; is 'nvcc' among toolchain.components?"
    )


def elf_machine(path: Path) -> int | None:
    """e_machine of the 64-bit little-endian ELF file ``path`` (62 x86_64, 183 aarch64);
    None for anything else or an unreadable file."""
    try:
        with path.open("rb") as fh:
            head = fh.read(20)
    except OSError:
        return None
    if len(head) < 20 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return None
    return int(struct.unpack_from("<H", head, 18)[0])


# Headers FlashInfer's JIT and our kernel include from CUDA_HOME (with -isystem include/cccl).
ASSEMBLY_INCLUDES = ("include/cuda_runtime.h", "include/cuda.h", "include/crt/host_config.h",
                     "include/cccl/cuda/std/cstdint", "nvvm/libdevice")  # fmt: skip


def assembly_problems(venv: Path, platform: Platform) -> list[str]:
    """What makes an env assembled for ``platform`` unusable there, checked without running
    anything: the compiler's binaries are that machine's, the runtime library and the link
    stub resolve inside the tree, the include directories the JIT needs exist."""
    home = venv / "cuda-home"
    problems: list[str] = []
    want = platform.elf_machine
    for rel in ("bin/nvcc", "bin/ptxas", "nvvm/bin/cicc", "lib64/stubs/libcuda.so"):
        got = elf_machine(home / rel)
        if got != want:
            what = "missing or not an ELF file" if got is None else f"an ELF file for machine {got}"
            problems.append(f"cuda-home/{rel} is {what}, not {platform.name} (machine {want})")
    tree = venv.resolve()
    cudart = (home / "lib64" / "libcudart.so").resolve()
    if not cudart.is_relative_to(tree) or elf_machine(cudart) != want:
        problems.append(
            f"cuda-home/lib64/libcudart.so resolves to {cudart}, not a {platform.name} library "
            "inside the env"
        )
    problems += [
        f"cuda-home/{rel} is missing" for rel in ASSEMBLY_INCLUDES if not (home / rel).exists()
    ]
    return problems


def system_overlay(venv: Path, spec: EnvSpec) -> Overlay:
    """cuda-home -> an existing toolkit (CUDA 12: PyPI has no nvcc), version-checked."""
    release = check_system_toolkit(spec)
    assert spec.toolchain.path is not None
    home = venv / "cuda-home"
    home.symlink_to(spec.toolchain.path)
    return Overlay(cuda_home=home, prefix=spec.toolchain.path, nvcc_release=release)


def check_system_toolkit(spec: EnvSpec) -> str:
    """Before anything is built: the named toolkit exists and is the spec's CUDA."""
    path = spec.toolchain.path
    assert path is not None
    if not (path / "bin" / "nvcc").exists():
        raise ToolMissing(
            f"{spec.source}: toolchain.path {path}/bin/nvcc not found; install CUDA "
            f"{spec.cuda} there or point toolchain.path at it",
            tool=str(path / "bin" / "nvcc"),
        )
    release = toolkits.nvcc_release(path)
    if release != spec.cuda:
        raise BuildError(
            f"{spec.source}: toolchain.path {path} holds nvcc {release} but the spec asks "
            f"CUDA {spec.cuda}"
        )
    return release
