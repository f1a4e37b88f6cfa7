"""What this machine has, as far as choosing an env goes: its platform, glibc, the GPUs' archs,
the NVIDIA driver and any CUDA toolkit installed on it (read, never asked). `cudaenv init`
chooses from it.
"""

from __future__ import annotations

import contextlib
import os
import platform as _platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from builder.core import platforms, proc, settings
from builder.core.cudaversion import CudaVersion
from builder.core.errors import CudaenvError
from builder.machine import archs, driver, toolkits

# Where a CUDA toolkit is looked for on the box (besides $CUDA_HOME, $CUDA_PATH, nvcc on PATH).
TOOLKIT_GLOBS = ("/usr/local/cuda", "/usr/local/cuda-*", "/opt/cuda", "/opt/nvidia/cuda-*")


@dataclass(frozen=True, kw_only=True)
class Toolkit:
    """A CUDA toolkit installed on the box: its nvcc's release and where it lives."""

    cuda: CudaVersion
    path: Path


@dataclass(frozen=True, kw_only=True)
class Box:
    """What this machine has, as far as choosing an env goes."""

    platform: str  # linux-x86_64
    glibc: str | None  # "2.36"; None where it cannot be read (not glibc)
    gpus: tuple[archs.Gpu, ...] = ()
    gpu_note: str | None = None  # why no GPU is listed
    driver: driver.Driver | None = None
    toolkits: tuple[Toolkit, ...] = ()

    def lines(self) -> list[str]:
        """What was found, one line each, for the progress output."""
        floor = platforms.GLIBC_TAG.removeprefix("manylinux_").replace("_", ".")
        glibc = self.glibc or "unknown (not glibc?)"
        if self.glibc is not None and _older(self.glibc, floor):
            glibc += f": older than {floor}, the locked wheels ({platforms.GLIBC_TAG}) will not install here"
        gpus = ", ".join(g.label for g in self.gpus) or f"none ({self.gpu_note or 'none visible'})"
        found = (
            self.driver.describe()
            if self.driver is not None
            else "none found: every CUDA is a candidate (the env runs where the driver is new enough)"
        )
        kits = ", ".join(f"{t.cuda} at {t.path}" for t in self.toolkits) or "none"
        return [
            f"platform {self.platform}, glibc {glibc}",
            f"GPUs: {gpus}",
            f"NVIDIA driver: {found}",
            f"CUDA toolkits installed: {kits}",
        ]

    def toolkit(self, cuda: CudaVersion) -> Toolkit | None:
        return next((t for t in self.toolkits if t.cuda == cuda), None)


def _older(version: str, than: str) -> bool:
    try:
        return Version(version) < Version(than)
    except InvalidVersion:
        return False


def glibc_version() -> str | None:
    """``2.36``: what the C library says (``confstr``), else what Python read of its binary."""
    with contextlib.suppress(ValueError, OSError, AttributeError):
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""
        if text.startswith("glibc "):
            return text.split()[1]
    name, version = _platform.libc_ver()
    return version if name == "glibc" and version else None


def _toolkit_dirs() -> Iterator[Path]:
    found = settings.current()
    for named in (found.cuda_home, found.cuda_path):
        if named is not None:
            yield named
    nvcc = proc.which("nvcc")
    if nvcc:
        yield Path(nvcc).parent.parent
    for pattern in TOOLKIT_GLOBS:
        root = Path(pattern).parent
        with contextlib.suppress(OSError):
            yield from sorted(root.glob(Path(pattern).name))


def system_toolkits() -> tuple[Toolkit, ...]:
    """Every toolkit on the box with an nvcc that says its release, each directory once."""
    found: list[Toolkit] = []
    seen: set[Path] = set()
    for d in _toolkit_dirs():
        try:
            real = d.resolve()
            # include/ too: /usr/local/bin/nvcc may be a wrapper script, /usr/local no toolkit.
            if real in seen or not (d / "include" / "cuda_runtime.h").is_file():
                continue
            seen.add(real)
            release = toolkits.nvcc_release(d)
        except (OSError, CudaenvError):
            continue  # not a toolkit, or an nvcc that does not run: not one to offer
        cuda = CudaVersion.read(release)
        if cuda is not None:
            found.append(Toolkit(cuda=cuda, path=d.absolute()))
    return tuple(found)


def detect_box() -> Box:
    gpus, why = archs.visible_gpus()
    return Box(
        platform=platforms.host_name(),
        glibc=glibc_version(),
        gpus=tuple(gpus),
        gpu_note=why,
        driver=driver.current(),
        toolkits=system_toolkits(),
    )


# What one nvcc thread of a FlashInfer kernel may take (cicc and ptxas of its larger
# templates peak at 1-2 GB): ninja's jobs are bounded by the memory free for them.
MEMORY_PER_NVCC_THREAD = 2 << 30


def compile_jobs(nvcc_threads: int, *, meminfo: Path = Path("/proc/meminfo")) -> int:
    """How many files ninja compiles at once (``MAX_JOBS``) for a build whose nvcc runs
    ``nvcc_threads`` threads a file: the cores this process may use shared among those
    threads, and no more than the free memory holds; at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    threads = max(1, nvcc_threads)
    jobs = max(1, -(-cores // threads))
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
                jobs = min(jobs, max(1, free // (MEMORY_PER_NVCC_THREAD * threads)))
    return jobs


def compile_environ(flashinfer_archs: str, environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with ``MAX_JOBS`` for a FlashInfer build of ``flashinfer_archs`` (one nvcc
    thread per arch, as the env's hook sets), unless the user set it: ninja's parallelism is
    not in the build command, so it changes no key."""
    if environ.get("MAX_JOBS"):
        return environ
    from builder.machine.archs import nvcc_threads

    return {**environ, "MAX_JOBS": str(compile_jobs(nvcc_threads(flashinfer_archs)))}
