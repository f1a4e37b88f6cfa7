"""The arch concept, whole: what an arch is, how FlashInfer spells a GPU's capability, what
each CUDA can target, which GPUs are visible now, and the env's arch list in the spellings
FlashInfer and torch read.

Every other module asks here; none parses an arch string, normalises a capability or queries
the GPUs itself (the stdlib probes that run inside a foreign interpreter excepted).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from builder.core import context, proc
from builder.core.cudaversion import CudaVersion
from builder.machine import driver

# The arch an env targets when its spec names none: SM 12.0 (Blackwell RTX PRO / GeForce),
# as a family target so one cubin serves 12.0 and its minor revisions.
DEFAULT_ARCH_TEXT = "12.0f"
# The CUDA assumed when normalising a capability for a toolkit whose version is not known:
# the one the shipped default spec pins. Only spelling depends on it (``f`` needs >= 12.9).
DEFAULT_CUDA = CudaVersion(major=13, minor=0)
# Family targets (sm_XXXf) arrived with CUDA 12.9; so did FlashInfer's "f" spelling of SM 12.x.
FAMILY_CUDA = CudaVersion(major=12, minor=9)

_ARCH_RE = re.compile(r"^(\d{1,2})\.(\d)([af]?)$")
_SEPARATORS = re.compile(r"[\s,;]+")


@dataclass(frozen=True, kw_only=True, order=True)
class Arch:
    """A CUDA target as FlashInfer spells it: ``12.0f`` = major 12, minor 0, suffix ``f``
    (``a`` = arch-specific, ``f`` = family, none = plain)."""

    major: int
    minor: int
    suffix: str = ""

    @classmethod
    def parse(cls, text: str) -> Arch:
        m = _ARCH_RE.match(text.strip())
        if not m:
            raise ValueError(f"expected an arch like '9.0a', '10.0a' or '12.0f', got {text!r}")
        return cls(major=int(m.group(1)), minor=int(m.group(2)), suffix=m.group(3))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{self.suffix}"

    @property
    def code(self) -> str:
        """``120f``: what nvcc's ``compute_``/``sm_`` names carry."""
        return f"{self.major}{self.minor}{self.suffix}"

    @property
    def sm(self) -> str:
        """``sm_120f`` style, as nvcc's ``-arch``/``code=`` take it."""
        return f"sm_{self.code}"

    @property
    def cubin_sm(self) -> str:
        """What ``cuobjdump --list-elf`` names the cubin (the suffix is not kept there)."""
        return f"sm_{self.major}{self.minor}"

    @property
    def capability(self) -> tuple[int, int]:
        return (self.major, self.minor)

    def gencode(self) -> str:
        return f"-gencode=arch=compute_{self.code},code=sm_{self.code}"

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """Whether a cubin of this arch loads on a GPU of ``capability``
        (:data:`COMPATIBILITY`'s SASS rows: SASS is not forward compatible across majors)."""
        return code_runs_on("sass", self, capability)


DEFAULT_ARCHS: tuple[Arch, ...] = (Arch.parse(DEFAULT_ARCH_TEXT),)


# --------------------------------------------------------------------------- what runs where
# NVIDIA's binary compatibility rules (CUDA C++ Programming Guide, "Binary Compatibility",
# "PTX Compatibility" and the arch- and family-specific features of compute capability 9.0 and
# later), one row per kind of code. An arch-specific cubin shipped for 12.0 is why sglang's
# common ops have no kernel on a CC 12.1 DGX Spark (sgl-project/sglang#29317).

CodeKind = Literal["sass", "ptx"]
Reach = Literal["exact", "same major", "any later"]


@dataclass(frozen=True, kw_only=True)
class CompatRule:
    kind: CodeKind
    suffix: str  # "" plain, "a" arch-specific, "f" family-specific
    reach: Reach  # the capabilities X.Z it runs on, from its own X.Y
    text: str


COMPATIBILITY: tuple[CompatRule, ...] = (
    CompatRule(kind="sass", suffix="", reach="same major",
               text="an sm_XY cubin runs on CC X.Z for Z >= Y"),
    CompatRule(kind="sass", suffix="a", reach="exact",
               text="an sm_XYa cubin runs on CC X.Y only"),
    CompatRule(kind="sass", suffix="f", reach="same major",
               text="an sm_XYf cubin runs on the members of its family at or above X.Y"),
    CompatRule(kind="ptx", suffix="", reach="any later",
               text="compute_XY PTX is compiled by the driver for any CC >= X.Y, when the "
               "driver is at least as new as the PTX ISA"),
    CompatRule(kind="ptx", suffix="a", reach="exact",
               text="compute_XYa PTX is compiled for CC X.Y only"),
    CompatRule(kind="ptx", suffix="f", reach="same major",
               text="compute_XYf PTX is compiled for the members of its family at or above X.Y"),
)  # fmt: skip

# The CUDA release that introduced each PTX ISA version (PTX ISA "Release Notes"): a driver
# compiles PTX of an ISA no newer than its own CUDA; newer PTX fails with "the provided PTX
# was compiled with an unsupported toolchain". 8.5 serves CUDA 12.5 and 12.6.
PTX_ISA_CUDA: dict[tuple[int, int], CudaVersion] = {
    **{(7, m): CudaVersion(major=11, minor=m) for m in range(9)},
    **{(8, m): CudaVersion(major=12, minor=m) for m in range(6)},
    (8, 6): CudaVersion(major=12, minor=7),
    (8, 7): CudaVersion(major=12, minor=8),
    (8, 8): CudaVersion(major=12, minor=9),
    (9, 0): CudaVersion(major=13, minor=0),
    (9, 1): CudaVersion(major=13, minor=1),
    (9, 2): CudaVersion(major=13, minor=2),
}


def compat_rule(kind: CodeKind, suffix: str) -> CompatRule:
    for rule in COMPATIBILITY:
        if (rule.kind, rule.suffix) == (kind, suffix):
            return rule
    raise ValueError(f"no compatibility rule for {kind} code with suffix {suffix!r}")


def code_runs_on(
    kind: CodeKind,
    arch: Arch,
    capability: tuple[int, int],
    *,
    ptx_isa: tuple[int, int] | None = None,
    driver_cuda: CudaVersion | None = None,
) -> bool:
    """Whether code of ``kind`` built for ``arch`` runs on a GPU of ``capability``, by
    :data:`COMPATIBILITY`. For PTX, with ``driver_cuda`` (the newest CUDA the driver runs)
    known, its ISA must be one that driver compiles: an ISA cudaenv does not know is newer
    than every CUDA it knows, so it is not counted as runnable."""
    rule = compat_rule(kind, arch.suffix)
    if rule.reach == "exact":
        fits = capability == arch.capability
    elif rule.reach == "same major":
        fits = capability[0] == arch.major and capability[1] >= arch.minor
    else:
        fits = capability >= arch.capability
    if not fits or kind == "sass" or driver_cuda is None:
        return fits
    if ptx_isa is None:
        return False  # PTX whose ISA was not read is never counted as runnable
    made_by = PTX_ISA_CUDA.get(ptx_isa)
    return made_by is not None and made_by <= driver_cuda


def parse_list(text: str) -> tuple[Arch, ...]:
    """``"12.0f,9.0a"``, ``"12.0f 9.0a"`` or ``"12.0f;9.0a"`` -> archs, duplicates dropped.
    Raises ValueError naming the bad entry."""
    out: list[Arch] = []
    for part in _SEPARATORS.split(text.strip()):
        if not part:
            continue
        arch = Arch.parse(part)
        if arch not in out:
            out.append(arch)
    if not out:
        raise ValueError(f"expected one or more archs like '12.0f 9.0a', got {text!r}")
    return tuple(out)


def parse_lenient(text: str) -> tuple[Arch, ...]:
    """The archs a list cudaenv did not write names (a shell's ``TORCH_CUDA_ARCH_LIST``), for
    doctor to read, never to refuse: torch's ``+PTX`` is dropped from its entry, an entry that
    is no arch (torch's ``Hopper``) is skipped, and nothing is an empty tuple."""
    out: list[Arch] = []
    for part in _SEPARATORS.split(text.strip()):
        try:
            arch = Arch.parse(part.removesuffix("+PTX"))
        except ValueError:
            continue
        if arch not in out:
            out.append(arch)
    return tuple(out)


def normalise(major: int, minor: int, cuda: CudaVersion | None) -> Arch:
    """A GPU capability spelled as FlashInfer's ``compilation_context.py`` spells it for a
    toolkit of CUDA ``cuda`` (None: not known, assume :data:`DEFAULT_CUDA`): SM 12.x is a
    family target (``f``) from CUDA 12.9 on and arch-specific (``a``) before; SM 9.0 and up
    are arch-specific; older GPUs plain."""
    if major >= 12 and (DEFAULT_CUDA if cuda is None else cuda) >= FAMILY_CUDA:
        return Arch(major=major, minor=minor, suffix="f")
    if major >= 9:
        return Arch(major=major, minor=minor, suffix="a")
    return Arch(major=major, minor=minor)


# Every compute capability an nvcc of CUDA 12.x or 13.x targets (`nvcc --list-gpu-code`; 10.1
# is Thor's number before CUDA 13 renamed it 11.0): a capability outside it is a typo.
CAPABILITIES: tuple[tuple[int, int], ...] = (
    (5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5), (8, 0), (8, 6),
    (8, 7), (8, 8), (8, 9), (9, 0), (10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1),
)  # fmt: skip


def known_capability(arch: Arch) -> str | None:
    """None when ``arch`` is of a capability some GPU has (:data:`CAPABILITIES`), else why
    not, in one phrase."""
    if arch.capability in CAPABILITIES:
        return None
    return (
        f"no NVIDIA GPU has compute capability {arch.major}.{arch.minor} (known: "
        + ", ".join(f"{a}.{b}" for a, b in CAPABILITIES)
        + ")"
    )


def min_cuda(arch: Arch) -> CudaVersion | None:
    """The oldest CUDA whose nvcc targets ``arch`` (nvcc release notes)."""
    if arch.suffix == "f":
        return FAMILY_CUDA
    if arch.capability == (12, 0) or (arch.major == 10 and arch.minor < 3):
        return CudaVersion(major=12, minor=8)
    if arch.major in (11, 12) or (arch.major == 10 and arch.minor >= 3):
        return CudaVersion(major=12, minor=9)
    return None


def cuda_problems(cuda: CudaVersion, archs: Iterable[Arch]) -> list[str]:
    """What a CUDA cannot target among ``archs`` (resolution policy rule 5), one line each."""
    problems = []
    for arch in archs:
        need = min_cuda(arch)
        if need is not None and cuda < need:
            problems.append(f"arch {arch} needs CUDA >= {need} but the spec asks {cuda}")
        if cuda.major >= 13 and arch.capability < (7, 5):
            problems.append(f"arch {arch}: CUDA 13 dropped targets below SM 7.5")
    return problems


# --------------------------------------------------------------------------- GPUs


@dataclass(frozen=True, kw_only=True)
class Gpu:
    """One visible NVIDIA GPU. ``capability`` is None when the driver did not say."""

    index: int  # nvidia-smi's, which is PCI bus order
    uuid: str
    name: str
    capability: tuple[int, int] | None
    mig: bool = False  # in MIG mode: CUDA sees its MIG instances, not the GPU itself

    @property
    def capability_text(self) -> str:
        return f"{self.capability[0]}.{self.capability[1]}" if self.capability else "unknown"

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.name}, SM {self.capability_text})"

    def arch(self, cuda: CudaVersion | None) -> Arch | None:
        if self.capability is None:
            return None
        return normalise(*self.capability, cuda)


_QUERY = ("index", "uuid", "name", "compute_cap", "mig.mode.current")


def parse_capability(text: str) -> tuple[int, int] | None:
    m = re.match(r"^\s*(\d+)\.(\d+)\s*$", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_gpu_query(stdout: str, fields: Sequence[str] = _QUERY) -> list[Gpu]:
    """The CSV of ``nvidia-smi --query-gpu=index,uuid,name,compute_cap[,mig.mode.current]``;
    rows it cannot read are skipped, a capability it cannot read is None (never a crash)."""
    with_mig = fields[-1] == "mig.mode.current"
    tail = 2 if with_mig else 1
    gpus = []
    for line in stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < len(fields) or not parts[0].isdigit():
            continue
        # A GPU name may hold a comma: it is everything between the uuid and the last fields.
        gpus.append(
            Gpu(
                index=int(parts[0]),
                uuid=parts[1],
                name=", ".join(parts[2:-tail]),
                capability=parse_capability(parts[-tail]),
                mig=with_mig and parts[-1] == "Enabled",
            )
        )
    return gpus


def visible_gpus() -> tuple[list[Gpu], str | None]:
    """The GPUs this process can see, or (nothing, why not): asked once per command
    (core/context.py), so a `build --verify` (the env's arch list, then the sampling check's
    GPU) runs one ``nvidia-smi``. A copy of the list: a caller may change its own."""
    gpus, why = context.once("visible-gpus", _visible_gpus)
    return list(gpus), why


def _visible_gpus() -> tuple[list[Gpu], str | None]:
    """The GPUs this process can see, or (nothing, why not). One ``nvidia-smi`` query; it
    honours ``CUDA_VISIBLE_DEVICES`` no more than the driver does, so callers that pin a GPU
    pass its index on. Whether there is a driver at all is ``driver.detect``'s answer, the
    one the gate gets: a sandbox without ``/proc/driver/nvidia`` still has its GPUs."""
    if driver.current() is None:
        return [], driver.not_found()
    smi = proc.which(driver.NVIDIA_SMI)
    if not smi:
        return [], "NVIDIA driver present but no nvidia-smi to list GPUs"
    fields: Sequence[str] = _QUERY
    try:
        done = proc.run(
            [smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            check=False,
            timeout=30,
        )
        if done.returncode != 0 and "not a valid field" in done.stdout + done.stderr:
            fields = _QUERY[:-1]  # a driver too old to know MIG
            done = proc.run(
                [smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                check=False,
                timeout=30,
            )
    except proc.CommandFailed as exc:
        return [], f"nvidia-smi did not answer: {exc}"
    gpus = parse_gpu_query(done.stdout, fields)
    if not gpus:
        said = done.stdout.strip() or done.stderr.strip() or f"exit {done.returncode}"
        return [], f"no visible NVIDIA GPU (nvidia-smi: {said[:200]})"
    return gpus, None


# --------------------------------------------------------------------------- the env's list


def env_archs(
    spec_archs: Sequence[Arch], cuda: CudaVersion, gpus: Iterable[Gpu] | None = None
) -> tuple[Arch, ...]:
    """The spec's archs plus every visible GPU's, normalised for ``cuda``: pinning only the
    spec's list would compile ``12.0f`` alone on an H100 box and fail there with "no kernel
    image". ``gpus`` None: query them now."""
    if gpus is None:
        gpus = visible_gpus()[0]
    out = list(spec_archs)
    for gpu in gpus:
        arch = gpu.arch(cuda)
        if arch is not None and arch not in out:
            out.append(arch)
    return tuple(out)


def uncovered(archs: Sequence[Arch], gpu: Gpu) -> bool:
    """True when no arch of ``archs`` produces code that runs on ``gpu``."""
    if gpu.capability is None:
        return False
    return not any(a.runs_on(gpu.capability) for a in archs)


def flashinfer_spelling(archs: Iterable[Arch]) -> str:
    """``FLASHINFER_CUDA_ARCH_LIST``: space separated, suffixes kept."""
    return " ".join(str(a) for a in archs)


def torch_spelling(archs: Iterable[Arch]) -> str:
    """``TORCH_CUDA_ARCH_LIST``: ``major.minor`` entries separated by ``;``; plain numbers are
    valid in every torch release, suffixed ones are not."""
    seen: dict[str, None] = {}
    for a in archs:
        seen.setdefault(f"{a.major}.{a.minor}", None)
    return ";".join(seen)


def texts(archs: Iterable[Arch]) -> list[str]:
    """For JSON and YAML: ``["12.0f", "9.0a"]``."""
    return [str(a) for a in archs]


# nvcc's threads for one file (FLASHINFER_NVCC_THREADS, which the env's hook sets from the arch
# list): one per gencode, at most this many; each thread is a cicc of 1-2 GB for FlashInfer's
# larger kernels, and ninja runs several files at once.
MAX_NVCC_THREADS = 8


def nvcc_threads(flashinfer_list: str) -> int:
    """The hook's FLASHINFER_NVCC_THREADS for an arch list as FlashInfer spells it."""
    return max(1, min(len(flashinfer_list.split()), MAX_NVCC_THREADS))
