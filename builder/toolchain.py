"""The ``cuda-home/`` overlay, the ``libcuda`` stub, the start-up hook and activation.

A pip-installed CUDA 13 prefix (``site-packages/nvidia/cu13``) is not a usable CUDA_HOME:
it has ``lib/`` not ``lib64/``, only the versioned ``libcudart.so.13`` and no ``libcuda.so``
stub, so FlashInfer's link step fails with ``cannot find -lcudart`` / ``-lcuda``
(flashinfer#5064, FACTS.md §3). The overlay gives it that shape with relative symlinks, so the
env can be built beside its final path and renamed into place.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2

from builder import archs, channels, proc
from builder.archs import Arch
from builder.errors import BuildError, ToolMissing
from builder.spec import EnvSpec

HOOK_MODULE = "_cudaenv_hook"
PTH_NAME = "cudaenv.pth"


def _nvcc_release(nvcc: Path) -> str:
    """``release 13.0`` out of ``nvcc --version``."""
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
        raise ToolMissing(f"{nvcc}: no nvcc in this toolkit")
    return _nvcc_release(nvcc)


def templates() -> jinja2.Environment:
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
    return env


def _load_template(name: str) -> str:
    try:
        return resources.files("builder.templates").joinpath(name).read_text()
    except ModuleNotFoundError:
        # Run from a source tree on PYTHONPATH (not installed): templates/ sits beside builder/.
        return (Path(__file__).resolve().parent.parent / "templates" / name).read_text()


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


def build_libcuda_stub(stubs: Path) -> Path:
    """An empty shared object with soname ``libcuda.so.1``: links fine, the real driver
    library is found at run time (FACTS §3)."""
    cc = os.environ.get("CC") or proc.which("cc") or proc.which("gcc")
    if not cc:
        raise ToolMissing(
            "no C compiler (cc/gcc) to build the libcuda.so link stub; install one "
            "(`apt-get install gcc`); nvcc needs it as host compiler anyway"
        )
    stubs.mkdir(parents=True, exist_ok=True)
    out = stubs / "libcuda.so"
    with tempfile.TemporaryDirectory(prefix="cudaenv-stub-") as tmp:
        src = Path(tmp) / "libcuda_stub.c"
        src.write_text("/* link-time stand-in for the driver's libcuda.so.1 */\n")
        try:
            proc.run(
                [cc, "-shared", "-nostdlib", "-Wl,-soname,libcuda.so.1", "-o", str(out), str(src)]
            )
        except ToolMissing as exc:
            raise ToolMissing(
                f"C compiler {cc} not found: it builds the libcuda.so link stub and is nvcc's "
                "host compiler; install one (`apt-get install gcc`) or point CC at it"
            ) from exc
    return out


def wheel_overlay(venv: Path, spec: EnvSpec) -> Overlay:
    """cuda-home/ from the CUDA 13 wheels' single prefix."""
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
    build_libcuda_stub(lib64 / "stubs")
    (home / "lib").symlink_to("lib64")
    release = nvcc_release(home)
    if release != spec.cuda:
        raise BuildError(f"{home}/bin/nvcc is CUDA {release} but the spec asks {spec.cuda}")
    return Overlay(cuda_home=home, prefix=prefix, nvcc_release=release)


def system_overlay(venv: Path, spec: EnvSpec) -> Overlay:
    """cuda-home -> an existing toolkit (CUDA 12: PyPI has no nvcc, FACTS §2), version-checked."""
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
            f"{spec.cuda} there or point toolchain.path at it"
        )
    release = nvcc_release(path)
    if release != spec.cuda:
        raise BuildError(
            f"{spec.source}: toolchain.path {path} holds nvcc {release} but the spec asks "
            f"CUDA {spec.cuda}"
        )
    return release


def write_hooks(venv: Path, spec: EnvSpec, env_archs: Sequence[Arch]) -> list[Path]:
    """The .pth start-up hook and the bin/activate block, values quoted by the templates."""
    env = templates()
    site = site_packages(venv)
    depth = len(site.relative_to(venv).parts)
    values = {
        "name": spec.name,
        "pth_name": PTH_NAME,
        "depth": depth,
        "flashinfer_archs": archs.flashinfer_spelling(env_archs),
        "torch_archs": archs.torch_spelling(env_archs),
        "env": list(spec.env),
        "saved": [
            "CUDA_HOME",
            "CUDA_PATH",
            "FLASHINFER_CUDA_ARCH_LIST",
            "TORCH_CUDA_ARCH_LIST",
            "FLASHINFER_WORKSPACE_BASE",
            *[k for k, _ in spec.env],
        ],
    }
    hook = site / f"{HOOK_MODULE}.py"
    hook.write_text(env.get_template("hook.py.j2").render(values))
    pth = site / PTH_NAME
    pth.write_text(f"import {HOOK_MODULE}\n")
    activate = venv / "bin" / "activate"
    if activate.exists():
        with activate.open("a") as fh:
            fh.write(env.get_template("activate.sh.j2").render(values))
    (venv / "var" / "flashinfer").mkdir(parents=True, exist_ok=True)
    return [hook, pth, activate]
