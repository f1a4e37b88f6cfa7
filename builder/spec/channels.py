"""What NVIDIA's wheel channel holds per CUDA major/minor.

The facts that cannot be read from a resolution live here: package names per component,
the prefix layout, which names are CUDA toolkit components at all. The exact component
versions of a CUDA minor are *queried* (``cuda-toolkit[all]==V`` through uv) and cached,
never kept in a table.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from packaging.utils import canonicalize_name

from builder.core import cachefiles
from builder.core.paths import cache_dir

# Packages whose version IS the CUDA version (major.minor.build): they tell the CUDA minor
# of a set. Library packages (cufft 12.0.x ships with CUDA 13.0) do not, so rule 2 compares
# those against the queried pins instead.
CUDA_VERSIONED = (
    "nvidia-cuda-runtime",
    "nvidia-cuda-nvcc",
    "nvidia-cuda-crt",
    "nvidia-nvvm",
    "nvidia-cuda-nvrtc",
    "nvidia-cuda-cupti",
    "nvidia-cuda-runtime-cu12",
    "nvidia-cuda-nvcc-cu12",
    "nvidia-cuda-nvrtc-cu12",
    "nvidia-cuda-cupti-cu12",
    "nvidia-cuda-runtime-cu11",
)

# NVIDIA's Python bindings, versioned by the CUDA major they bind (cuda-bindings 13.5.0 binds
# CUDA 13). cuda-python below 12.8 *is* the bindings and ships the same cuda/bindings/ files,
# so cuda-python 12.6.2.post1 installed beside cuda-bindings 13.5.0 overwrites them and
# `import flashinfer` fails; from 12.8 on cuda-python is a metapackage pinning cuda-bindings
# of its own version. Either way their major must be torch's.
CUDA_BINDINGS = ("cuda-python", "cuda-bindings")

# NVIDIA CUDA runtime/toolkit wheels that carry their CUDA major in the name. Two majors of
# these in one env load two libcudart/libcublas generations (DESIGN rule 3).
_MAJOR_SUFFIXED = re.compile(
    r"^nvidia-(cuda-[a-z0-9-]+|cublas|cufft|curand|cusolver|cusparse|cusparselt|nvjitlink|"
    r"nvtx|nccl|cudnn|nvshmem|cufile|npp|nvjpeg|nvvm)-cu(\d+)$"
)
# Packages that ship one build per CUDA major side by side and pick one at run time; the
# parent requires both (nvidia-cutlass-dsl 4.8 requires libs-cu12 unconditionally and
# libs-cu13 via its "cu13" extra), so two majors there are by design, not a split.
MULTI_MAJOR_BY_DESIGN = ("nvidia-cutlass-dsl-libs-",)

FLASHINFER_COMPANIONS = ("flashinfer-cubin", "flashinfer-jit-cache")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where a CUDA major's wheels put the toolkit inside site-packages."""

    major: int
    prefix: str  # relative to site-packages


def layout(major: int) -> Layout:
    if major >= 13:
        # Every CUDA 13 component installs into ONE prefix.
        return Layout(major=major, prefix=f"nvidia/cu{major}")
    return Layout(major=major, prefix="nvidia")


def has_pip_nvcc(major: int) -> bool:
    """CUDA 12's nvidia-cuda-nvcc-cu12 ships no nvcc driver (NVIDIA/cuda-python#2100)."""
    return major >= 13


def toolkit_extras(components: tuple[str, ...]) -> str:
    return ",".join(sorted(components))


def major_suffix(name: str) -> int | None:
    """The CUDA major a wheel's name declares (``nvidia-cublas-cu12`` -> 12), else None."""
    m = _MAJOR_SUFFIXED.match(canonicalize_name(name))
    return int(m.group(2)) if m else None


def multi_major_by_design(name: str) -> bool:
    return canonicalize_name(name).startswith(MULTI_MAJOR_BY_DESIGN)


def read_cached_pins(key: str) -> dict[str, str] | None:
    """The pins an earlier query cached, under the cache's trust rules (cachefiles: they name
    the versions a lock pins, so a file another user could write is not read)."""
    data = cachefiles.read_json(cache_dir() / "channels" / f"{key}.json")
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        return None
    return {str(k): str(v) for k, v in data.items()}


def write_cached_pins(key: str, pins: dict[str, str]) -> None:
    # A cache that cannot be written (or is refused) only costs a re-query.
    cachefiles.write_text(
        cache_dir() / "channels" / f"{key}.json", json.dumps(pins, sort_keys=True, indent=1)
    )


# A header a compile could not find -> the cuda-toolkit component (extra) that ships it.
# torch 2.15 stopped pulling nvidia-curand, and FlashInfer's sampling.cuh includes <curand.h>;
# CUB, Thrust and libcu++ come with CCCL.
HEADER_COMPONENT = (
    ("cub/", "cccl"),
    ("thrust/", "cccl"),
    ("cuda/", "cccl"),
    ("nv/", "cccl"),
    ("curand", "curand"),
    ("cublas", "cublas"),
    ("cusparse", "cusparse"),
    ("cufft", "cufft"),
    ("cusolver", "cusolver"),
    ("nvrtc", "nvrtc"),
    ("nvtx3/", "nvtx"),
    ("cupti", "cupti"),
)


def missing_header(error: str) -> tuple[str, str | None] | None:
    """(header, the component that ships it) when a compile failed on a missing header."""
    m = re.search(r"(?:fatal error|catastrophic error): (?:cannot open source file )?\"?"
                  r"([\w/.+-]+\.(?:h|hpp|cuh))\"?(?:: No such file)?", error)  # fmt: skip
    if not m:
        return None
    header = m.group(1)
    component = next((c for prefix, c in HEADER_COMPONENT if header.startswith(prefix)), None)
    return header, component


def component_fix(header: str, component: str | None) -> str:
    """The fix for a compile that could not find ``header``."""
    if component is None:
        return f"the toolkit lacks {header}: add the component that ships it"
    return (
        f"add '{component}' to the spec's toolchain.components (it ships {header}), "
        "then `cudaenv lock SPEC` and `cudaenv build SPEC`"
    )
