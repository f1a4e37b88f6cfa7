"""How each package that compiles at install is told its archs and to build offline: one row
per known package, each citing the ``setup.py`` line it follows, and the rules every source
build gets (``TORCH_CUDA_ARCH_LIST``, ``MAX_JOBS``, ``NVCC_THREADS``).

A row adds variables; it never removes the generic ones, so a package this table does not
know still builds with the env's toolkit and arch list when it reads the variables torch's
``cpp_extension`` reads. What a release demands that the env cannot give (a C++ standard the
torch headers refuse) is said here before anything compiles, where the ``setup.py`` text
shows it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from builder.env import setuppy
from builder.machine.archs import Arch, torch_spelling

# Bump when a row or the generic variables change what a build makes: it is part of the
# built wheel's store key, so an entry made under the old rules is not taken for the new.
RECIPES_VERSION = 2


def _no_dots(archs: Sequence[Arch]) -> str:
    """``80;90;120``: flash-attn's spelling (major and minor run together, no suffix)."""
    return ";".join(dict.fromkeys(f"{a.major}{a.minor}" for a in archs))


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """One package's switches: constant variables, and the variable (and spelling) its
    ``setup.py`` reads the arch list from, when it reads one."""

    name: str
    switches: tuple[tuple[str, str], ...] = ()
    archs_variable: str | None = None
    spelling: Callable[[Sequence[Arch]], str] = torch_spelling
    # The setup.py line each switch follows, as the release spells it.
    follows: str = ""
    # What the package does with the arch list when no variable narrows it.
    note: str = ""
    # The variable that makes its setup.py build for CUDA on a box without a GPU, as a
    # failed proof names it (builder/env/wheelproof.py).
    cuda_switch: str = "FORCE_CUDA=1"
    # Its extension modules that are host code by design (fnmatch on the file name), which the
    # proof of a CUDA build does not judge: DeepSpeed's CPU optimizers and async I/O.
    host_modules: tuple[str, ...] = ()


RECIPES: tuple[Recipe, ...] = (
    Recipe(
        name="flash-attn",
        switches=(("FLASH_ATTENTION_FORCE_BUILD", "TRUE"),),
        archs_variable="FLASH_ATTN_CUDA_ARCHS",
        spelling=_no_dots,
        follows='setup.py: FORCE_BUILD = os.getenv("FLASH_ATTENTION_FORCE_BUILD", "FALSE") == '
        '"TRUE"; archs from os.getenv("FLASH_ATTN_CUDA_ARCHS", ...).split(";"); nvcc threads '
        'from os.getenv("NVCC_THREADS")',
    ),
    Recipe(
        name="causal-conv1d",
        switches=(("CAUSAL_CONV1D_FORCE_BUILD", "TRUE"),),
        follows='setup.py: FORCE_BUILD = os.getenv("CAUSAL_CONV1D_FORCE_BUILD", "FALSE") == "TRUE"',
        note="its setup.py passes its own -gencode list for the toolkit's CUDA (1.7.0 on 13.0: "
        "75 to 121), which TORCH_CUDA_ARCH_LIST does not narrow",
    ),
    Recipe(
        name="mamba-ssm",
        switches=(("MAMBA_FORCE_BUILD", "TRUE"),),
        follows='setup.py: FORCE_BUILD = os.getenv("MAMBA_FORCE_BUILD", "FALSE") == "TRUE"',
        note="its setup.py passes its own -gencode list, which TORCH_CUDA_ARCH_LIST does not "
        "narrow",
    ),
    Recipe(
        name="deepspeed",
        switches=(("DS_ACCELERATOR", "cuda"),),
        follows='accelerator/real_accelerator.py: accelerator_name = os.environ["DS_ACCELERATOR"] '
        "when set, else detected from torch (cpu where it sees no GPU, as on a build box); "
        "op_builder builds each DS_BUILD_<OP> for that accelerator",
        cuda_switch="DS_ACCELERATOR=cuda",
        # op_builder: cpu_adam, cpu_adagrad, cpu_lion and the AIO ops build host code (ZeRO
        # offload), whatever the accelerator.
        host_modules=(
            "cpu_adam_op*",
            "cpu_adagrad_op*",
            "cpu_lion_op*",
            "async_io_op*",
            "gds_op*",
            "deepspeed_shm_comm_op*",
        ),
    ),
    Recipe(
        name="fast-hadamard-transform",
        switches=(("FAST_HADAMARD_TRANSFORM_FORCE_BUILD", "TRUE"),),
        follows='setup.py: FORCE_BUILD = os.getenv("FAST_HADAMARD_TRANSFORM_FORCE_BUILD", '
        '"FALSE") == "TRUE"',
    ),
)
_BY_NAME = {r.name: r for r in RECIPES}


def host_module(package: str, file_name: str) -> bool:
    """Whether ``file_name`` (an extension module's base name) of ``package`` is host code by
    design (its recipe's ``host_modules``), not a CUDA module built for the CPU."""
    import fnmatch

    return any(fnmatch.fnmatch(file_name, p) for p in recipe_for(package).host_modules)


def recipe_for(name: str) -> Recipe:
    """The row of ``name``, else the generic recipe (torch's own variables only)."""
    found = _BY_NAME.get(canonicalize_name(name))
    return found if found is not None else Recipe(name=canonicalize_name(name))


def variables(
    recipe: Recipe,
    archs: Sequence[Arch],
    *,
    jobs: int,
    nvcc_threads: int,
    build_env: Sequence[tuple[str, str]] = (),
) -> dict[str, str]:
    """The variables a source build of ``recipe`` gets on top of the env's own (its
    ``CUDA_HOME`` and ``PATH``): a CUDA build asked for (``FORCE_CUDA``), the arch list as
    torch and the package read it, the jobs
    and nvcc threads the machine holds, the row's switches, then the spec's ``build-env``
    (which wins: a user may switch a package's optional parts)."""
    out = {
        # A CUDA build where the box has no GPU: the setup.py files that pick
        # CUDAExtension "if torch.cuda.is_available() or os.getenv('FORCE_CUDA', '0') == '1'"
        # (the OpenMMLab packages, torch-scatter) would otherwise build their CPU variant.
        "FORCE_CUDA": "1",
        "TORCH_CUDA_ARCH_LIST": torch_spelling(archs),
        "MAX_JOBS": str(jobs),
        "NVCC_THREADS": str(nvcc_threads),
    }
    if recipe.archs_variable:
        out[recipe.archs_variable] = recipe.spelling(archs)
    out.update(recipe.switches)
    out.update(build_env)
    return out


def key_variables(values: dict[str, str]) -> dict[str, str]:
    """What of :func:`variables` decides what is built: all but the parallelism."""
    return {k: v for k, v in values.items() if k not in ("MAX_JOBS", "NVCC_THREADS")}


# torch's headers need C++20 from 2.13 on: a release that passes -std=c++17 fails inside them
# (flash-attn 2.8.3.post2, flash-attention#2899; nixpkgs patches its setup.py to c++20).
TORCH_CXX20_FROM = Version("2.13")
_OLD_STANDARDS = ("11", "14", "17")


def before_compiling(
    name: str,
    version: str,
    setup_py: str,
    torch: str | None,
    *,
    nvcc: str | None = None,
    members: frozenset[str] | None = None,
) -> str | None:
    """Why ``name`` ``version`` cannot build against torch ``torch`` with nvcc ``nvcc``, known
    from its ``setup.py`` text (and the sdist's file names ``members``, relative to its top
    directory) before anything compiles; None when nothing shows it. Only what the file
    surely does for a CUDA build counts (:mod:`builder.env.setuppy`): a flag under ``if
    HIP_BUILD:`` or an arch under a version test this nvcc fails is not held against it."""
    demands = setuppy.read(setup_py, nvcc)
    if demands is None:
        return None
    prefix = f"{name} {version} cannot build"
    if members is not None:
        for line, source in demands.sources:
            if source.removeprefix("./") not in members:
                return (
                    f"{prefix}: its sdist lacks {source}, which its setup.py (line {line}) "
                    "compiles; the release ships its CUDA sources elsewhere (a prebuilt wheel "
                    "or its repository), so pin a release whose sdist holds them"
                )
    oldest = setuppy.oldest_arch(nvcc) if nvcc else None
    for line, arch in demands.archs:
        if oldest is not None and arch < oldest:
            return (
                f"{prefix} with nvcc {nvcc}: its setup.py (line {line}) asks for "
                f"compute_{arch}, and nvcc {nvcc} compiles for compute_{oldest} and newer; "
                "use a release that asks for no older arch, or a toolkit that still has it"
            )
    return _standard(prefix, demands, torch)


def _standard(prefix: str, demands: setuppy.Demands, torch: str | None) -> str | None:
    """The C++ standard rule: a sure ``-std=c++17`` against a torch whose headers need 20.
    A file that names C++20 anywhere may choose between them: not refused."""
    if torch is None or demands.any_standards & {"20", "2a"}:
        return None
    try:
        needs_20 = Version(torch).release >= TORCH_CXX20_FROM.release
    except InvalidVersion:
        return None
    for line, std in demands.standards if needs_20 else ():
        if std in _OLD_STANDARDS:
            return (
                f"{prefix} against torch {torch}: its setup.py (line {line}) passes "
                f"-std=c++{std}, and torch's headers need C++20 from {TORCH_CXX20_FROM} on; "
                "use a release that builds with C++20 or a torch before 2.13"
            )
    return None
