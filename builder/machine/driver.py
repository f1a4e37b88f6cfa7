"""This machine's NVIDIA driver, read without starting a CUDA context, and the one table of
the oldest driver that runs each CUDA.

A cu130 torch installs fine on a 570 driver and fails only at its first kernel
(pie-project/pie#327); an install meant for CUDA 12.9 that resolved to CUDA 13 does the same
(vllm-project/vllm#42338). `build` and `adopt` compare the driver with this table before
changing anything; `plan` shows both; `doctor` judges torch's CUDA with the same table.

Where the version is read, first answer wins (uv's ``--torch-backend=auto`` reads the same
places after its ``UV_CUDA_DRIVER_VERSION``): ``CUDAENV_DRIVER_VERSION``, the kernel module's
``/sys/module/nvidia/version`` and ``/proc/driver/nvidia/version``, ``nvidia-smi``, then the
user-mode driver's ``cuDriverGetVersion`` called in a child Python, as conda does: loading
libcuda into cudaenv's own process is what this module avoids.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from builder.core import context, proc, settings
from builder.core.cudaversion import CudaVersion
from builder.core.errors import DriverTooOld, UsageError

OVERRIDE = "CUDAENV_DRIVER_VERSION"
SYS_VERSION = Path("/sys/module/nvidia/version")
PROC_VERSION = Path("/proc/driver/nvidia/version")
LIBCUDA = "libcuda cuDriverGetVersion"
# The one program asked about the driver and the GPUs (here and by archs.visible_gpus); others
# may name it in messages.
NVIDIA_SMI = "nvidia-smi"

# CUDA major -> the oldest Linux driver branch that runs it under minor-version compatibility
# (NVIDIA's CUDA Compatibility guide): any driver of at least this branch runs every minor of
# that major, so no minor needs a row of its own. An older datacenter driver can still run a
# newer CUDA through the forward-compatibility package cuda-compat-<major>-<minor>, which only
# the user-mode driver (libcuda, the last source below) reflects.
MINIMUM_DRIVER: dict[int, str] = {13: "580", 12: "525", 11: "450"}

# 580.65.06, 525.60.13, 580: a driver version is dotted whole numbers.
_VERSION_RE = re.compile(r"\d{2,4}(?:\.\d{1,4}){0,3}")
# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 ...", or for the open
# modules "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build".
_PROC_RE = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)")

# Run by a child Python: cuDriverGetVersion needs no cuInit and makes no context. It prints
# nothing where there is no libcuda (a build node) or the call fails.
_LIBCUDA_PROBE = """\
import ctypes
try:
    lib = ctypes.CDLL("libcuda.so.1")
except OSError:
    raise SystemExit(0)
v = ctypes.c_int(0)
if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
    print(v.value)
"""


@dataclass(frozen=True, kw_only=True)
class Driver:
    """The driver found: its version where a source gives one (libcuda gives only the highest
    CUDA it runs), and where it was read."""

    version: str | None  # "580.65.06"
    cuda: CudaVersion | None  # the highest CUDA it runs, when the source says (libcuda)
    source: str  # CUDAENV_DRIVER_VERSION, a file's path, nvidia-smi, or LIBCUDA

    def describe(self) -> str:
        """``driver 580.65.06 (read from /sys/module/nvidia/version)``."""
        what = self.version if self.version is not None else f"for CUDA {self.cuda}"
        return f"driver {what} (read from {self.source})"

    def runs(self, cuda: CudaVersion) -> bool:
        """Whether this driver runs ``cuda`` (a CUDA major in :data:`MINIMUM_DRIVER`)."""
        if self.version is not None:
            return runs(self.version, cuda)
        # libcuda reports the newest CUDA it runs (13000 = 13.0); minor-version compatibility
        # runs every minor of that major, and of older majors.
        return self.cuda is not None and self.cuda.major >= cuda.major

    def newest_cuda(self) -> CudaVersion | None:
        """The newest CUDA this driver runs, as far as it is known: libcuda's answer, else the
        first minor of the newest major its version runs (which minors exactly is not known
        from the version alone, so newer PTX is not counted as runnable: never when unsure)."""
        if self.cuda is not None:
            return self.cuda
        major = newest_cuda_major(self.version) if self.version is not None else None
        return CudaVersion(major=major, minor=0) if major is not None else None

    def to_json(self) -> dict[str, str | None]:
        return {
            "version": self.version,
            "cuda": str(self.cuda) if self.cuda is not None else None,
            "source": self.source,
        }


def _numbers(version: str) -> tuple[int, ...]:
    if not _VERSION_RE.fullmatch(version):
        raise ValueError(f"expected a driver version like 580.65.06, got {version!r}")
    return tuple(int(part) for part in version.split("."))


def minimum_driver(cuda: CudaVersion) -> str:
    """The oldest driver branch that runs ``cuda`` (``"580"`` for 13.x). ValueError for a CUDA
    major the table does not hold."""
    try:
        return MINIMUM_DRIVER[cuda.major]
    except KeyError:
        known = ", ".join(f"{m}.x" for m in sorted(MINIMUM_DRIVER))
        raise ValueError(f"no minimum driver known for CUDA {cuda} (known: {known})") from None


def runs(driver_version: str, cuda: CudaVersion) -> bool:
    """Whether driver ``driver_version`` runs ``cuda``, compared part by part as numbers:
    570.86.15 is older than 580, 580.65.06 is not. ValueError for a version that is not
    dotted numbers or a CUDA the table does not hold."""
    return _numbers(driver_version) >= _numbers(minimum_driver(cuda))


def newest_cuda_major(driver_version: str) -> int | None:
    """The newest CUDA major ``driver_version`` runs, or None when it runs none of the table's."""
    have = _numbers(driver_version)
    fits = [m for m, need in MINIMUM_DRIVER.items() if have >= _numbers(need)]
    return max(fits) if fits else None


# --------------------------------------------------------------------------- finding it


def from_override(environ: Mapping[str, str]) -> Driver | None:
    """``CUDAENV_DRIVER_VERSION``: a driver version, as uv's ``UV_CUDA_DRIVER_VERSION``.
    Anything else is refused naming the variable; set and empty counts as unset."""
    text = environ.get(OVERRIDE, "").strip()
    if not text:
        return None
    if not _VERSION_RE.fullmatch(text):
        raise UsageError(
            f"{OVERRIDE}={environ[OVERRIDE]!r}: expected a driver version like 580.65.06"
        )
    return Driver(version=text, cuda=None, source=OVERRIDE)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:  # absent (no driver), or unreadable: the next source is asked
        return None


def from_sys(path: Path = SYS_VERSION) -> Driver | None:
    """The loaded kernel module's version, the whole of ``/sys/module/nvidia/version``."""
    text = (_read(path) or "").strip()
    return (
        Driver(version=text, cuda=None, source=str(path)) if _VERSION_RE.fullmatch(text) else None
    )


def from_proc(path: Path = PROC_VERSION) -> Driver | None:
    """The version on ``/proc/driver/nvidia/version``'s "Kernel Module" line."""
    m = _PROC_RE.search(_read(path) or "")
    if m is None or not _VERSION_RE.fullmatch(m.group(1)):
        return None
    return Driver(version=m.group(1), cuda=None, source=str(path))


def smi_driver_version() -> str | None:
    """What ``nvidia-smi --query-gpu=driver_version`` says for the first GPU, as printed, or
    None (no nvidia-smi, no GPU, no answer in 10 s)."""
    smi = proc.which(NVIDIA_SMI)
    if not smi:
        return None
    try:
        done = proc.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], check=False, timeout=10
        )
    except proc.CommandFailed:
        return None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return lines[0] if done.returncode == 0 and lines else None


def from_smi() -> Driver | None:
    """The driver version nvidia-smi reports for the first GPU, where PATH has nvidia-smi."""
    text = smi_driver_version()
    if text is None or not _VERSION_RE.fullmatch(text):
        return None
    return Driver(version=text, cuda=None, source=NVIDIA_SMI)


def from_libcuda(python: str = sys.executable) -> Driver | None:
    """libcuda's ``cuDriverGetVersion`` (13000 = CUDA 13.0), called by a child ``python``."""
    try:
        done = proc.run([python, "-I", "-S", "-c", _LIBCUDA_PROBE], check=False, timeout=20)
    except proc.CommandFailed:
        return None
    text = done.stdout.strip()
    if done.returncode != 0 or not text.isdigit() or int(text) < 1000:
        return None
    value = int(text)
    return Driver(
        version=None,
        cuda=CudaVersion(major=value // 1000, minor=value % 1000 // 10),
        source=LIBCUDA,
    )


def detect(
    *,
    environ: Mapping[str, str] | None = None,
    sys_file: Path | None = None,
    proc_file: Path | None = None,
    python: str = sys.executable,
) -> Driver | None:
    """This machine's driver from the first source that answers, or None where none does (a
    build node). The one place the driver is looked for: the gate, the visible GPUs (and so
    the sampling check's skip) and the test suite's ``gpu`` marker all ask here, so a sandbox
    that hides ``/proc/driver/nvidia`` but has ``nvidia-smi`` is not taken for a build node.
    The paths (default :data:`SYS_VERSION`, :data:`PROC_VERSION`, read when called) and the
    child's Python are there for tests."""
    found = from_override(
        environ if environ is not None else {OVERRIDE: settings.current().driver_version or ""}
    )
    found = found or from_sys(SYS_VERSION if sys_file is None else sys_file)
    found = found or from_proc(PROC_VERSION if proc_file is None else proc_file)
    return found or from_smi() or from_libcuda(python)


def current() -> Driver | None:
    """This machine's driver, as :func:`detect` finds it, looked for once per command
    (core/context.py): the gate, the visible GPUs and the checks of one `build --verify`
    share one answer, and none of them starts a second child Python to get it."""
    return context.once("driver", lambda: detect())


def not_found() -> str:
    """Why :func:`detect` found nothing, naming every place it asked."""
    return f"no NVIDIA driver (none at {SYS_VERSION}, {PROC_VERSION}, nvidia-smi or libcuda)"


# --------------------------------------------------------------------------- the gate


def require(
    cuda: CudaVersion,
    found: Driver | None,
    *,
    needs: str,
    older: str,
    bypass: str | None = "pass --no-driver-check",
) -> str:
    """The progress line for a ``found`` driver that runs ``cuda`` (or for no driver: a build
    node builds, its envs run elsewhere). A driver too old raises DriverTooOld in one line:
    the driver and where it was read, the minimum, and the ways out. ``needs`` names what
    asks for ``cuda`` ("envspecs/x.yaml"), ``older`` what to pick instead ("a spec"),
    ``bypass`` the last way out (None where there is none: verify runs kernels, it cannot
    go on without a driver that runs them)."""
    if cuda.major not in MINIMUM_DRIVER:
        return f"no minimum driver known for CUDA {cuda}: the driver is not checked"
    need = minimum_driver(cuda)
    if found is None:
        return (
            f"no NVIDIA driver on this machine: going on; the env runs where the driver is "
            f"{need} or newer (CUDA {cuda})"
        )
    if found.runs(cuda):
        return f"{found.describe()} runs CUDA {cuda} (needs {need} or newer)"
    if found.version is not None:
        fits = newest_cuda_major(found.version)
    else:
        fits = found.cuda.major if found.cuda is not None else None
    instead = (
        f"{older} for CUDA {fits}.x (which it runs)"
        if fits is not None
        else f"{older} for an older CUDA"
    )
    install = (
        f"install driver {need} or newer (or cuda-compat-{cuda.major}-{cuda.minor} on a "
        "datacenter GPU)"
    )
    ways = f"use {instead}, {install}, or {bypass}" if bypass else f"use {instead} or {install}"
    raise DriverTooOld(
        f"{needs} needs CUDA {cuda}, which needs NVIDIA driver {need} or newer; this machine "
        f"has {found.describe()}: {ways}"
    )
