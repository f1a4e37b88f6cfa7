"""The JIT caches of the stack, and where an env keeps them: each in its own ``var/``.

Every library that compiles at run time keeps a cache of its own, by default under the
user's home or /tmp, where envs with different toolkits collide: a CUDA 13 build reused by
CUDA 12.9 workers (flashinfer#5145), a key that ignores the toolkit (flashinfer#3229). The
start-up hook and ``activate`` point each library's own variable into the env (toolchain.py
renders them from :data:`CACHES`), and Triton's tool variables at the env's matched binaries
(Triton's bundled ptxas does not know ``sm_121a`` on DGX Spark, triton#8539). ``doctor``
reports every location and flags one outside a cudaenv env.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Cache:
    variable: str
    subdir: str  # under ENV/var
    owner: str
    read_by: str  # where the library reads the variable (its default when unset)


CACHES: tuple[Cache, ...] = (
    # BASE/.cache/flashinfer/<version>/<archs>/cached_ops (default BASE = $HOME).
    Cache("FLASHINFER_WORKSPACE_BASE", "flashinfer", "FlashInfer", "flashinfer/jit/env.py"),
    # knobs.cache.dir; default $TRITON_HOME/.triton/cache.
    Cache("TRITON_CACHE_DIR", "triton", "Triton", "triton/knobs.py"),
    # load()/load_inline() build root; default ~/.cache/torch_extensions/pyXY_cuNNN.
    Cache("TORCH_EXTENSIONS_DIR", "torch_extensions", "torch", "torch/utils/cpp_extension.py"),
    # FX graph and Inductor caches; default $TMPDIR/torchinductor_$USER.
    Cache(
        "TORCHINDUCTOR_CACHE_DIR",
        "torchinductor",
        "torch Inductor",
        "torch/_inductor/runtime/cache_dir_utils.py",
    ),
    # NVRTC jiterator kernels; default ~/.cache/torch/kernels.
    Cache(
        "PYTORCH_KERNEL_CACHE_PATH",
        "torch_kernels",
        "torch NVRTC",
        "aten/src/ATen/native/cuda/jit_utils.cpp",
    ),
    # build_inline/load_inline output, also sglang's jit_kernel modules; default ~/.cache/tvm-ffi.
    Cache("TVM_FFI_CACHE_DIR", "tvm-ffi", "TVM-FFI", "tvm_ffi/cpp/extension.py"),
    # Read at import; default $TMPDIR/$USER/cutlass_python_cache.
    Cache("CUTE_DSL_CACHE_DIR", "cute-dsl", "CuTe DSL", "cutlass/base_dsl/cache_helpers.py"),
    # sglang's own root (newer releases; ~/.cache/sglang) and its JIT builds (~/.cache/sglang/jit).
    Cache("SGLANG_CACHE_DIR", "sglang", "sglang", "sglang/srt/environ.py"),
    Cache("SGLANG_JIT_CACHE_DIR", "sglang/jit", "sglang", "sglang/srt/environ.py"),
    # sglang overwrites DeepGEMM's DG_JIT_CACHE_DIR with this at import (default
    # ~/.cache/deep_gemm), so this is the one to set.
    Cache(
        "SGLANG_DG_CACHE_DIR",
        "deep_gemm",
        "DeepGEMM (through sglang)",
        "sglang/srt/layers/deep_gemm_wrapper/compile_utils.py",
    ),
    # The driver's PTX-to-SASS cache; default ~/.nv/ComputeCache.
    Cache("CUDA_CACHE_PATH", "nv-compute-cache", "CUDA driver", "CUDA programming guide"),
)

# Triton's tool variables (triton/knobs.py: env_nvidia_tool, "TRITON_<TOOL>_PATH"; the
# Blackwell ptxas of newer Triton as TRITON_PTXAS_BLACKWELL_PATH) -> the binary in
# cuda-home/bin. Triton silently falls back to its bundled binary when the path does not
# run, so only binaries the env has are set (toolchain.write_hooks) and doctor checks them.
TRITON_TOOLS: tuple[tuple[str, str], ...] = (
    ("TRITON_PTXAS_PATH", "ptxas"),
    ("TRITON_PTXAS_BLACKWELL_PATH", "ptxas"),
    ("TRITON_CUOBJDUMP_PATH", "cuobjdump"),
    ("TRITON_NVDISASM_PATH", "nvdisasm"),
)

VARIABLES: tuple[str, ...] = (*(c.variable for c in CACHES), *(v for v, _ in TRITON_TOOLS))


def inside(path: str | Path, root: str | Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def outside_env(prefix: str, env: Mapping[str, str | None]) -> list[str]:
    """``VAR=value`` for each cache of a cudaenv env that is unset or points outside it
    (ENV/var), and each Triton tool variable that names another binary than the env's."""
    out = []
    for cache in CACHES:
        value = env.get(cache.variable)
        if not value:
            out.append(f"{cache.variable} unset ({cache.owner} uses its default, outside the env)")
        elif not inside(value, Path(prefix) / "var"):
            out.append(f"{cache.variable}={value} ({cache.owner})")
    for variable, tool in TRITON_TOOLS:
        value = env.get(variable)
        want = Path(prefix) / "cuda-home" / "bin" / tool
        if value and Path(value).resolve() != want.resolve():
            out.append(f"{variable}={value} (not the env's {tool})")
        elif not value and want.exists():
            out.append(f"{variable} unset (Triton uses its bundled {tool}, not the env's)")
    return out
