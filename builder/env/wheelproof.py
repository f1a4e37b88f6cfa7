"""The proof of a source build by what it built: a package whose sdist is a CUDA build (it
ships ``.cu`` sources, or its ``setup.py`` declares a ``CUDAExtension``) must install
extension modules that hold device code, for every arch of the spec, read from the built
wheel's own ELF headers (builder/machine/fatbin.py) before the wheel is stored or installed.

Why: many ``setup.py`` files pick a CUDA or a CPU build from what the build box sees
(``CUDAExtension if torch.cuda.is_available() or os.getenv("FORCE_CUDA") == "1" else
CppExtension``: the OpenMMLab packages, torch-scatter; DeepSpeed's accelerator, from torch's
view of the GPU), and the boxes fleets build on have no GPU. Such a build succeeds and installs
a CPU module; only the module itself says so. cudaenv tells every build its target
(``FORCE_CUDA=1``, the arch list, each known package's own switch: builder/env/recipes.py) and
then reads the result.

A wheel with no extension module at all passes (nothing was compiled: DeepSpeed with no op
prebuilt JIT-compiles its ops at run time), as does one some of whose modules are host code
beside others that hold device code (a CPU helper next to the CUDA op), and the modules a
recipe names as host code by design (DeepSpeed's CPU Adam) are not judged. Each arch of the
spec must be held by some module, not by each: a package may build a module for some archs.
"""

from __future__ import annotations

import shutil
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from builder.env import recipes
from builder.env.recordscan import is_shared_object
from builder.machine import fatbin
from builder.machine.archs import Arch, code_runs_on

CUDA_SOURCES = (".cu", ".cuh")
# One extension module read at a time, from the wheel into the build's scratch directory:
# flash-attn's is ~1 GB unpacked; a member claiming more is not a module this reads.
MODULE_LIMIT = 8 << 30


@dataclass(frozen=True, kw_only=True)
class Module:
    """One extension module of a wheel: its path inside the wheel and what it holds."""

    name: str
    codes: tuple[fatbin.DeviceCode, ...]
    error: str | None


def cuda_build(setup_py: str, members: frozenset[str]) -> str | None:
    """Why the sdist is a CUDA build, as a clause ("its sdist ships csrc/add.cu"); None where
    nothing in it says so."""
    sources = sorted(m for m in members if m.endswith(CUDA_SOURCES))
    if sources:
        more = f" and {len(sources) - 1} more" if len(sources) > 1 else ""
        return f"its sdist ships CUDA sources ({sources[0]}{more})"
    if "CUDAExtension" in setup_py:
        return "its setup.py declares a CUDAExtension"
    return None


def extension_modules(wheel: Path, scratch: Path) -> list[Module]:
    """Each ELF shared object the wheel installs (``*.so``, ``*.so.N``), read one at a time
    from a copy under ``scratch``; nothing of the wheel is run or installed."""
    found: list[Module] = []
    scratch.mkdir(parents=True, exist_ok=True)
    copy = scratch / "module.so"
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if info.is_dir() or not is_shared_object(info.filename):
                continue
            if info.file_size > MODULE_LIMIT:
                found.append(Module(name=info.filename, codes=(), error="too large to read"))
                continue
            with archive.open(info) as src, copy.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            if fatbin.is_elf(copy):
                read = fatbin.scan(copy)
                found.append(Module(name=info.filename, codes=read.codes, error=read.error))
            copy.unlink()
    return found


def covers(codes: Sequence[fatbin.DeviceCode], arch: Arch) -> bool:
    """Whether ``codes`` hold code a GPU of the spec's ``arch`` runs (SASS, or PTX it JITs)."""
    return any(code_runs_on(c.kind, c.arch, arch.capability, ptx_isa=c.ptx_isa) for c in codes)


def judge(
    name: str,
    version: str,
    wheel: Path,
    *,
    setup_py: str,
    members: frozenset[str],
    archs: Sequence[Arch],
    values: Mapping[str, str],
    scratch: Path,
) -> str | None:
    """The one line that fails the build of ``name`` ``version`` from what its ``wheel`` holds,
    or None when it holds what the spec asked for. ``values``: the variables the build got;
    the line names the package's own switch for a CUDA build (its recipe's ``cuda_switch``)."""
    why = cuda_build(setup_py, members)
    if why is None:
        return None
    modules = [
        m for m in extension_modules(wheel, scratch)
        if not recipes.host_module(name, m.name.rsplit("/", 1)[-1])
    ]  # fmt: skip
    if not modules:
        return None
    unread = [m for m in modules if m.error is not None]
    if unread:
        return (
            f"{name} {version}: its built extension module {unread[0].name} could not be read "
            f"({unread[0].error}); nothing was kept"
        )
    with_code = [m for m in modules if m.codes]
    if not with_code:
        names = ", ".join(m.name.rsplit("/", 1)[-1] for m in modules[:3])
        told = f"FORCE_CUDA={values.get('FORCE_CUDA', '(unset)')}"
        switch = recipes.recipe_for(name).cuda_switch
        return (
            f"{name} {version} was built without CUDA: {why}, and its extension module(s) "
            f"({names}) hold no device code (its setup.py chose a CPU build; the build had "
            f"{told}); set {switch} in the spec's build-env, and nothing was kept"
        )
    # Each arch by some module: a package may build one module for some archs only (an op
    # for 9.0a alone, a kernel its setup.py filters to 8.0 and newer).
    every = [c for m in with_code for c in m.codes]
    for arch in archs:
        if not covers(every, arch):
            held = ", ".join(sorted({str(c) for c in every}))
            return (
                f"{name} {version} was built without code for {arch}: its extension modules "
                f"hold {held}; the build had "
                f"TORCH_CUDA_ARCH_LIST={values.get('TORCH_CUDA_ARCH_LIST', '(unset)')}; "
                "nothing was kept"
            )
    return None
