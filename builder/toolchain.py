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
import shlex
import shutil
import struct
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from builder import archs, cachefiles, caches, channels, proc, remote_cache, settings, variables
from builder.archs import Arch
from builder.cudaversion import CudaVersion
from builder.errors import BuildError, ToolMissing
from builder.paths import cache_dir
from builder.platforms import Platform
from builder.spec import EnvSpec

if TYPE_CHECKING:
    import jinja2

HOOK_MODULE = "_cudaenv_hook"
PTH_NAME = "cudaenv.pth"


def _file_identity(path: Path) -> list[int] | None:
    """(device, inode, size, mtime) of the file ``path`` resolves to: the same numbers mean
    the same bytes unless the file was rewritten in place with its mtime forged. None when
    it cannot be read."""
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _nvcc_memo() -> Path:
    return cache_dir() / "nvcc-releases.json"


# Entries kept in the memo: with uv's hard links every env's nvcc is the one file of uv's cache
# (one entry per toolkit); with UV_LINK_MODE=copy each build adds a file nobody asks again.
_NVCC_MEMO_ENTRIES = 32


def _nvcc_release(nvcc: Path) -> str:
    """``release 13.0`` out of ``nvcc --version``, memoised by the identity of the nvcc file.

    A wheel-built env's ``cuda-home/bin/nvcc`` is a hard link to uv's cached copy, so every
    build of a toolkit asks the same file; running it costs ~10 ms of a ~3 s warm build."""
    identity = _file_identity(nvcc)
    key = ":".join(map(str, identity)) if identity else None
    memo: dict[str, str] = {}
    if key is not None:
        doc = cachefiles.read_json(_nvcc_memo())
        if isinstance(doc, dict):
            memo = {str(k): str(v) for k, v in doc.items()}
        if key in memo:
            return memo[key]
    release = _run_nvcc_version(nvcc)
    if key is not None:
        memo.pop(key, None)
        memo[key] = release
        kept = dict(list(memo.items())[-_NVCC_MEMO_ENTRIES:])
        cachefiles.write_text(_nvcc_memo(), json.dumps(kept, indent=1))
    return release


def _run_nvcc_version(nvcc: Path) -> str:
    try:
        done = proc.run([nvcc, "--version"], timeout=60)
    except proc.CommandFailed as exc:
        raise BuildError(f"{nvcc} --version failed:\n{exc.output.strip()}") from exc
    m = re.search(r"release (\d+\.\d+),", done.stdout)
    if not m:
        raise BuildError(f"{nvcc} --version printed no 'release X.Y': {done.stdout.strip()!r}")
    return m.group(1)


def nvcc_release(cuda_home: Path) -> str:
    nvcc = cuda_home / "bin" / "nvcc"
    if not nvcc.exists():
        raise ToolMissing(f"{nvcc}: no nvcc in this toolkit", tool=str(nvcc))
    return _nvcc_release(nvcc)


def templates() -> jinja2.Environment:
    # Imported here, not at the top: it costs ~20 ms and `cudaenv lock` imports this module
    # (through matrix and report) without rendering anything.
    import jinja2

    loader = jinja2.FunctionLoader(_load_template)
    env = jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined,  # a missing value is an error, never an empty string
        # Shell and Python, not HTML: every value goes through shquote / pyrepr below.
        autoescape=False,  # noqa: S701
        keep_trailing_newline=True,
    )
    env.filters["shquote"] = lambda v: shlex.quote(str(v))
    # json.dumps of a str is a valid Python string literal with every control char escaped.
    env.filters["pyrepr"] = lambda v: json.dumps(str(v))
    env.filters["pyrepr_list"] = lambda v: "[" + ", ".join(json.dumps(str(x)) for x in v) + "]"
    # fish: inside single quotes only \\ and \' are escapes.
    env.filters["fishquote"] = lambda v: (
        "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"
    )
    env.filters["nuquote"] = _nuquote
    env.filters["cshquote"] = _cshquote
    env.filters["psquote"] = _psquote
    return env


def _cshquote(value: object) -> str:
    """A csh word: single quotes, where history's ! and a newline still need a backslash and
    a quote is closed, escaped and reopened."""
    text = str(value).replace("'", "'\\''").replace("!", "\\!").replace("\n", "\\\n")
    return f"'{text}'"


def _nuquote(value: object) -> str:
    """A nushell literal: single quotes have no escapes; a value holding one becomes a raw
    string r#'...'# with more #s than any run after a quote in it."""
    text = str(value)
    if "'" not in text:
        return f"'{text}'"
    hashes = "#"
    while "'" + hashes in text:
        hashes += "#"
    return f"r{hashes}'{text}'{hashes}"


# PowerShell takes the typographic single quotes as quotes too; each is escaped by doubling.
_PS_QUOTES = "'\u2018\u2019\u201a\u201b"


def _psquote(value: object) -> str:
    return "'" + "".join(c + c if c in _PS_QUOTES else c for c in str(value)) + "'"


def _load_template(name: str) -> str:
    try:
        return resources.files("builder.templates").joinpath(name).read_text()
    except ModuleNotFoundError:
        # Run from a source tree on PYTHONPATH (not installed): templates/ sits beside builder/.
        return (Path(__file__).resolve().parent.parent / "templates" / name).read_text()


def _render(name: str, values: Mapping[str, object]) -> str:
    """Template ``name`` rendered with ``values``, memoised by what decides the text: the
    template's source, this module's source (the filters and Environment options) and the
    values. A warm build then neither imports jinja2 nor compiles a template (~35 ms). Only a
    successful render is stored, so a template error is raised every time."""
    try:
        material = json.dumps(
            [name, _load_template(name), Path(__file__).read_text(), values], sort_keys=True
        )
    except OSError:  # no source beside the module (a .pyc-only install): no memo
        return templates().get_template(name).render(values)
    memo = cache_dir() / "rendered" / f"{hashlib.sha256(material.encode()).hexdigest()}.txt"
    # The hook runs in every interpreter start of the env, as whoever starts it: a memo is
    # taken only under the cache's trust rules (cachefiles), else rendered afresh.
    kept = cachefiles.read_text(memo)
    if kept is not None:
        return kept
    text = templates().get_template(name).render(values)
    cachefiles.write_text(memo, text)
    return text


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
    identity = _file_identity(real)
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
    release = nvcc_release(home) if platform is None else _nvcc_wheel_release(site)
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
    release = nvcc_release(path)
    if release != spec.cuda:
        raise BuildError(
            f"{spec.source}: toolchain.path {path} holds nvcc {release} but the spec asks "
            f"CUDA {spec.cuda}"
        )
    return release


def write_pip_guard(venv: Path, spec: EnvSpec) -> list[Path]:
    """A stand-in pip: ``bin/pip`` (pip3, pip3.X) and a ``pip`` module for ``python -m pip``.
    The env holds exactly its lock, so it has no pip that could install around it; the stand-in
    answers ``list``, ``freeze`` and ``show`` from the env's metadata (torch's ``collect_env``
    runs ``python -m pip list --format=freeze``) and says ``cudaenv add PKG --spec SPEC`` for
    anything that would change the env. A real pip installed later replaces both."""
    site = site_packages(venv)
    module = site / "pip"
    written = []
    if not module.exists():
        module.mkdir()
        (module / "__init__.py").write_text(_render("pip_stub.py.j2", {"spec": str(spec.source)}))
        (module / "__main__.py").write_text(
            "import sys\n\nfrom pip import main\n\nsys.exit(main())\n"
        )
        written.append(module)
    text = (
        "#!/bin/sh\n"
        "# Written by cudaenv: this env holds exactly the lock of its spec (see python -m pip).\n"
        'exec "$(cd "$(dirname "$0")" && pwd)/python" -m pip "$@"\n'
    )
    for name in ("pip", "pip3", f"pip{spec.python}"):
        path = venv / "bin" / name
        if not path.exists():
            path.write_text(text)
            path.chmod(0o755)
            written.append(path)
    return written


def _append(path: Path, text: str, block: str) -> str:
    return text + block


def _into_nu_export_env(path: Path, text: str, block: str) -> str:
    """Nushell runs only the last ``export-env`` block of a module, so ours goes inside the
    venv's own (the one at column 0), after its ``load-env``. ``deactivate`` is ``overlay
    hide``, which drops everything the overlay set, ours included."""
    found = re.search(r"^export-env \{\n.*?^\}", text, re.MULTILINE | re.DOTALL)
    if found is None:
        raise BuildError(
            f"{path}: no export-env block at the start of a line, so the env's CUDA settings "
            "cannot be added to it (a venv tool that writes activate.nu in another shape)"
        )
    end = found.end() - 1
    return text[:end] + block + text[end:]


def _before_ps_signature(path: Path, text: str, block: str) -> str:
    # The standard library's Activate.ps1 ends with an Authenticode block: code goes above it.
    mark = text.find("\n# SIG # Begin signature block")
    if mark < 0:
        return text.rstrip("\n") + "\n" + block
    return text[:mark] + "\n" + block + text[mark:]


# The first line of the block written into each activation script.
BLOCK_MARK = "# >>> cudaenv "

# (script in bin/, template, where the block goes): every venv writes activate (bash, zsh,
# sh) and activate.fish; uv and virtualenv write activate.nu, activate.ps1 and (not for
# --relocatable) activate.csh; the standard library's venv writes Activate.ps1 and
# activate.csh. activate_this.py needs nothing: its site.addsitedir() runs the hook's .pth.
# The .bat files are for Windows' cmd, which never runs a Linux env.
ACTIVATIONS: tuple[tuple[str, str, Callable[[Path, str, str], str]], ...] = (
    ("activate", "activate.sh.j2", _append),
    ("activate.fish", "activate.fish.j2", _append),
    ("activate.xsh", "activate.xsh.j2", _append),
    ("activate.csh", "activate.csh.j2", _append),
    ("activate.nu", "activate.nu.j2", _into_nu_export_env),
    ("activate.ps1", "activate.ps1.j2", _before_ps_signature),
    ("Activate.ps1", "activate.ps1.j2", _before_ps_signature),
)


def has_redis_client(site: Path) -> bool:
    """The env can reach a Redis cache: redis-py is installed (its lock holds ``redis``)."""
    return (site / remote_cache.CLIENT / "__init__.py").is_file()


def remote_values(url: str | None, client: bool) -> dict[str, object]:
    """What the hook's remote-cache part is rendered with (remote_cache.py's rules): the
    spec's URL, whether the env has the Redis client."""
    return {
        "remote_cache": url or "",
        "redis_client": client,
        "remote_vars": remote_cache.WIRED,
        "manager": remote_cache.MANAGER,
        "backend": remote_cache.BACKEND,
        "timeout": f"{remote_cache.TIMEOUT:g}",
        "default_port": remote_cache.DEFAULT_PORT,
        "db_pattern": remote_cache.DB_PATTERN,
    }


def remote_cache_note(venv: Path, spec: EnvSpec) -> str | None:
    """A warning for the build where the remote cache this process names (CUDAENV_REMOTE_CACHE,
    which wins, else the spec's) would not be wired: the env's lock has no Redis client, the
    URL is not one, or a server off loopback has no password here; None when all is well."""
    found = settings.current()
    if found.remote_cache is None and found.origin("remote_cache") == "CUDAENV_REMOTE_CACHE":
        return None  # `off`: the hook wires nothing, whatever the spec names
    url = found.remote_cache or spec.remote_cache
    if not url:
        return None
    where = "CUDAENV_REMOTE_CACHE" if found.remote_cache else f"remote-cache of {spec.source}"
    if not has_redis_client(site_packages(venv)):
        return (
            f"warning: {where} names a Redis cache but {spec.name}'s lock has no Redis client "
            f"(`{remote_cache.CLIENT}`): Triton and Inductor are not wired to it; add "
            f"`remote-cache:` to {spec.source} and build again"
        )
    # Checked where it was read (the spec's loader, the settings): it parses.
    cache = remote_cache.parse(url).with_password(found.remote_cache_password)
    # A server off loopback gets its password at run time: say now, not at the first
    # compile, that a process without one runs unwired.
    why = remote_cache.refusal(cache)
    return (
        None if why is None else f"warning: {where}: {why}; a process without one compiles locally"
    )


def write_hooks(venv: Path, spec: EnvSpec, env_archs: Sequence[Arch]) -> list[Path]:
    """The .pth start-up hook and the block in every shell's activation script the venv has,
    values quoted by the templates."""
    site = site_packages(venv)
    depth = len(site.relative_to(venv).parts)
    client = has_redis_client(site)
    # Activation exports the spec's wiring (the hook decides again at each interpreter start:
    # CUDAENV_REMOTE_CACHE, the password, the rules); never a password, as a spec holds none.
    # So a server off loopback is exported by no script: a process that skips the hook
    # (CUDAENV_NO_HOOK=1) would be wired to it unauthenticated, the one thing refused.
    named = remote_cache.parse(spec.remote_cache) if spec.remote_cache and client else None
    wired = (
        remote_cache.wiring(named)
        if named is not None and remote_cache.refusal(named) is None
        else ()
    )
    values = {
        "name": spec.name,
        "pth_name": PTH_NAME,
        "depth": depth,
        "flashinfer_archs": archs.flashinfer_spelling(env_archs),
        "torch_archs": archs.torch_spelling(env_archs),
        "max_nvcc_threads": archs.MAX_NVCC_THREADS,
        "env": [*spec.env, *wired],
        "caches": [(c.variable, c.subdir) for c in caches.CACHES],
        # Only binaries the toolkit has: Triton falls back to its own silently otherwise.
        "tools": [
            (v, t) for v, t in caches.TRITON_TOOLS if (venv / "cuda-home" / "bin" / t).exists()
        ],
        # What activation saves and deactivate gives back: every variable it sets.
        "saved": list(
            dict.fromkeys([*variables.SET_BY_HOOK, *[k for k, _ in [*spec.env, *wired]]])
        ),
    }
    hook = site / f"{HOOK_MODULE}.py"
    # The hook sets the remote cache's variables in code of its own, at each start.
    hook_values = {**values, "env": list(spec.env), **remote_values(spec.remote_cache, client)}
    hook.write_text(_render("hook.py.j2", hook_values))
    pth = site / PTH_NAME
    written = [hook, pth]
    if client:
        backend = site / f"{remote_cache.BACKEND_MODULE}.py"
        backend.write_text(
            _render("remote_cache.py.j2", {"name": spec.name, "backend": remote_cache.BACKEND})
        )
        written.append(backend)
    for script, template, place in ACTIVATIONS:
        path = venv / "bin" / script
        if path.exists():
            proc.atomic_write_text(path, place(path, path.read_text(), _render(template, values)))
            written.append(path)
    # Made now: not every library creates its cache directory before writing into it.
    for cache in caches.CACHES:
        (venv / "var" / cache.subdir).mkdir(parents=True, exist_ok=True)
    # Last, and whole: until this file exists the interpreter starts as before (what an
    # interrupted `cudaenv adopt` relies on).
    proc.atomic_write_text(pth, f"import {HOOK_MODULE}\n")
    return written
