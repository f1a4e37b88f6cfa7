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
from pathlib import Path

from builder import proc
from builder.cudaversion import CudaVersion

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
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")


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
        """Whether a cubin of this arch loads on a GPU of ``capability``: ``a`` targets run on
        exactly that capability, ``f`` on the same major with an equal or higher minor, plain
        ones on the same major (SASS is not forward compatible across majors)."""
        major, minor = capability
        if self.suffix == "a":
            return (self.major, self.minor) == capability
        return self.major == major and minor >= self.minor


DEFAULT_ARCHS: tuple[Arch, ...] = (Arch.parse(DEFAULT_ARCH_TEXT),)


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
    """The GPUs this process can see, or (nothing, why not). One ``nvidia-smi`` query; it
    honours ``CUDA_VISIBLE_DEVICES`` no more than the driver does, so callers that pin a GPU
    pass its index on."""
    if not DRIVER_VERSION_FILE.exists():
        return [], f"no NVIDIA driver ({DRIVER_VERSION_FILE} is absent)"
    smi = proc.which("nvidia-smi")
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
