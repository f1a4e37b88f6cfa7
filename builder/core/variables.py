"""Every environment variable cudaenv sets, refuses, reports or hashes, in one table.

A name kept in several lists drifts: the start-up hook set ``TVM_FFI_CUDA_ARCH_LIST`` while the
fingerprint did not hash it, so two envs that differed there fingerprinted equal. Each row
says who reads the variable and what cudaenv does with it, and every list is taken from here:
what the start-up hook and each shell's activation save and give back (toolchain.py passes
them to the templates), the JIT caches and Triton's tools (caches.py), what a spec's ``env:``
may not set (spec.py), what doctor's and verify's probes report (the probes run inside
foreign interpreters and import nothing of cudaenv: they are given the names on their command
line, :func:`probe_arg`), what the fingerprint hashes, the arch lists doctor reads, and what
cudaenv itself reads as configuration (a row's :class:`Setting`: the ``settings.Settings``
field it fills, its type and default; ``builder/core/settings.py`` is the one reader of those).

The hook's and the activation scripts' code still spells the toolkit and arch-list names, as
each is set its own way; tests run the hook and ``bin/activate`` and compare what they set
with :data:`SET_BY_HOOK`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass


class Kind(enum.Enum):
    TOOLKIT = "toolkit"  # where the JIT finds the CUDA toolkit
    ARCHS = "arch list"  # the archs a JIT build targets
    CACHE = "JIT cache"  # where a library keeps what it compiled
    TOOL = "Triton tool"  # which binary Triton runs instead of its bundled one
    REMOTE = "remote cache"  # Triton's and Inductor's shared cache on Redis (remote_cache.py)
    NVCC = "nvcc"  # what nvcc reads on top of its command line
    COMPILE = "compile"  # what picks the host compiler of a JIT build
    RUNTIME = "runtime"  # what the loader and the driver read
    CUDAENV = "cudaenv"  # cudaenv's own switches and records
    OUTSIDE = "read by cudaenv"  # another tool's or the system's, which cudaenv reads
    VENV = "venv"  # the venv's and the interpreter's own


class Hook(enum.Enum):
    """What the start-up hook does with a variable."""

    # Set to the env's value, whatever the shell had; every activation script sets it too
    # and its deactivate gives the shell's value back.
    SETS = "sets"
    # The env's cuda-home/bin put first and its bin/ next, the rest kept (the venv's activate
    # restores PATH).
    PREPENDS = "prepends"
    # What the shell had, kept for doctor to show what the hook overrides (the hook only).
    RECORDS = "records"
    # Set by the hook from another of its values at each interpreter start (the hook only:
    # only Python reads it).
    DERIVES = "derives"
    # Set where the env names a remote cache (a spec's `remote-cache:`, CUDAENV_REMOTE_CACHE)
    # and it may be wired (remote_cache.py): the hook at each interpreter start, activation
    # from the spec's URL; removed by the hook where one is named and refused or `off`.
    REMOTE = "remote"


@dataclass(frozen=True, kw_only=True)
class Number:
    """What the value of a numeric variable must be, checked once at start-up
    (``settings.establish``): a value that is not one would crash a check deep inside a
    verify (``float("nan")`` passes ``float()``; requests refuses a timeout of 0, a socket one
    of ``inf``) or wait forever (``nan`` compares false to every deadline)."""

    unit: str  # "seconds" (a finite number) or "size" (10G, 500M or bytes)
    zero: bool = False  # whether 0 is a value (a lock wait of 0: do not wait)
    example: str = ""


@dataclass(frozen=True, kw_only=True)
class Setting:
    """A variable cudaenv itself reads as configuration: the field of ``settings.Settings``
    it fills, the type of that field and its default (as the variable would spell it)."""

    field: str
    # "text" (str | None), "path" (Path | None), "switch" (1: on), "remote" (a URL, or `off`:
    # none), "redis" (a redis:// URL remote_cache.parse takes, or `off`), "time" (a moment
    # indexview.parse takes); a numeric row's type is its Number's unit.
    type: str = "text"
    default: str = ""
    pyproject: str | None = None  # the [tool.cudaenv] key that sets it too, below the variable
    secret: bool = False  # may hold a password: `--debug` never prints it


SECONDS_MAX = 1_000_000.0  # ~11 days: past it a socket or a timer refuses the value

# The kinds of value the numeric rows below take.
_SECONDS = Number(unit="seconds", example="30")
_SECONDS_OR_ZERO = Number(unit="seconds", zero=True, example="900")
_SIZE = Number(unit="size", example="10G, 500M or 1048576")


@dataclass(frozen=True, kw_only=True)
class Variable:
    name: str
    kind: Kind
    reader: str  # who reads it
    read_at: str = ""  # where the reader reads it (its default when unset), when one place
    hook: Hook | None = None
    cache: str | None = None  # a JIT cache: the hook's value is ENV/var/<cache>
    # A Triton tool: the hook's value is ENV/cuda-home/bin/<tool>, set only where the env has it.
    tool: str | None = None
    fingerprint: bool = False  # its value is part of `cudaenv fingerprint`
    reserved: bool = False  # a spec's `env:` may not set it
    doctor: bool = False  # doctor's probe reports it (the fingerprint reads those facts)
    verify: bool = False  # verify's probe reports it
    number: Number | None = None  # a numeric value, checked at start-up
    setting: Setting | None = None  # read by cudaenv itself: the Settings field it fills


def _cache(
    name: str, subdir: str, reader: str, read_at: str, *, reserved: bool = False,
    verify: bool = False,
) -> Variable:  # fmt: skip
    return Variable(name=name, kind=Kind.CACHE, reader=reader, read_at=read_at, hook=Hook.SETS,
                    cache=subdir, fingerprint=True, reserved=reserved, doctor=True,
                    verify=verify)  # fmt: skip


def _remote(name: str, reader: str, read_at: str, *, doctor: bool = True) -> Variable:
    return Variable(name=name, kind=Kind.REMOTE, reader=reader, read_at=read_at,
                    hook=Hook.REMOTE, reserved=True, doctor=doctor)  # fmt: skip


def _triton_tool(name: str, tool: str) -> Variable:
    # triton/knobs.py: env_nvidia_tool reads TRITON_<TOOL>_PATH.
    return Variable(name=name, kind=Kind.TOOL, reader="Triton", read_at="triton/knobs.py",
                    hook=Hook.SETS, tool=tool, fingerprint=True, doctor=True)  # fmt: skip


# The order is the order of the hook's and activation's save lists and of the probes' reports.
TABLE: tuple[Variable, ...] = (
    Variable(name="CUDA_HOME", kind=Kind.TOOLKIT,
             reader="FlashInfer's JIT, torch's cpp_extension, TVM-FFI",
             read_at="get_cuda_path() (FlashInfer), _find_cuda_home() (torch)",
             hook=Hook.SETS, fingerprint=True, reserved=True, doctor=True, verify=True,
             setting=Setting(field="cuda_home", type="path")),
    Variable(name="CUDA_PATH", kind=Kind.TOOLKIT,
             reader="FlashInfer's JIT, torch's cpp_extension (where CUDA_HOME is unset)",
             hook=Hook.SETS, fingerprint=True, reserved=True, doctor=True, verify=True,
             setting=Setting(field="cuda_path", type="path")),
    Variable(name="PATH", kind=Kind.TOOLKIT,
             reader="FlashInfer and torch (nvcc on it when no CUDA_HOME is set; ninja), nvcc "
             "(the host compiler)",
             hook=Hook.PREPENDS, reserved=True),
    Variable(name="FLASHINFER_CUDA_ARCH_LIST", kind=Kind.ARCHS, reader="FlashInfer's JIT",
             read_at="flashinfer/compilation_context.py",
             hook=Hook.SETS, fingerprint=True, reserved=True, doctor=True, verify=True,
             setting=Setting(field="flashinfer_arch_list")),
    Variable(name="TORCH_CUDA_ARCH_LIST", kind=Kind.ARCHS, reader="torch's cpp_extension",
             read_at="_get_cuda_arch_flags() (torch/utils/cpp_extension.py)",
             hook=Hook.SETS, fingerprint=True, reserved=True, doctor=True, verify=True),
    # Without it TVM-FFI's extension builder asks nvidia-smi, and fails without a GPU.
    Variable(name="TVM_FFI_CUDA_ARCH_LIST", kind=Kind.ARCHS,
             reader="TVM-FFI's extension builder (tvm_ffi.cpp, under sglang's JIT kernels)",
             hook=Hook.SETS, fingerprint=True, reserved=True, doctor=True),
    # One nvcc thread per arch of FlashInfer's list (nvcc --threads): the gencodes of a file
    # compile side by side. The hook derives it at each start; only Python reads it.
    Variable(name="FLASHINFER_NVCC_THREADS", kind=Kind.COMPILE,
             reader="FlashInfer's JIT (nvcc --threads)", read_at="flashinfer/jit/cpp_ext.py",
             hook=Hook.DERIVES, fingerprint=True, reserved=True, doctor=True, verify=True),
    # Every library that compiles at run time keeps a cache of its own, by default under the
    # user's home or /tmp, where envs of different toolkits collide (caches.py).
    # BASE/.cache/flashinfer/<version>/<archs>/cached_ops (default BASE = $HOME).
    _cache("FLASHINFER_WORKSPACE_BASE", "flashinfer", "FlashInfer", "flashinfer/jit/env.py",
           reserved=True, verify=True),
    # knobs.cache.dir; default $TRITON_HOME/.triton/cache.
    _cache("TRITON_CACHE_DIR", "triton", "Triton", "triton/knobs.py"),
    # load()/load_inline() build root; default ~/.cache/torch_extensions/pyXY_cuNNN.
    _cache("TORCH_EXTENSIONS_DIR", "torch_extensions", "torch", "torch/utils/cpp_extension.py"),
    # FX graph and Inductor caches; default $TMPDIR/torchinductor_$USER.
    _cache("TORCHINDUCTOR_CACHE_DIR", "torchinductor", "torch Inductor",
           "torch/_inductor/runtime/cache_dir_utils.py"),
    # NVRTC jiterator kernels; default ~/.cache/torch/kernels.
    _cache("PYTORCH_KERNEL_CACHE_PATH", "torch_kernels", "torch NVRTC",
           "aten/src/ATen/native/cuda/jit_utils.cpp"),
    # build_inline/load_inline output, also sglang's jit_kernel modules; default ~/.cache/tvm-ffi.
    _cache("TVM_FFI_CACHE_DIR", "tvm-ffi", "TVM-FFI", "tvm_ffi/cpp/extension.py"),
    # Read at import; default $TMPDIR/$USER/cutlass_python_cache.
    _cache("CUTE_DSL_CACHE_DIR", "cute-dsl", "CuTe DSL", "cutlass/base_dsl/cache_helpers.py"),
    # sglang's own root (newer releases; ~/.cache/sglang) and its JIT builds (~/.cache/sglang/jit).
    _cache("SGLANG_CACHE_DIR", "sglang", "sglang", "sglang/srt/environ.py"),
    _cache("SGLANG_JIT_CACHE_DIR", "sglang/jit", "sglang", "sglang/srt/environ.py"),
    # sglang overwrites DeepGEMM's DG_JIT_CACHE_DIR with this at import (default
    # ~/.cache/deep_gemm), so this is the one to set.
    _cache("SGLANG_DG_CACHE_DIR", "deep_gemm", "DeepGEMM (through sglang)",
           "sglang/srt/layers/deep_gemm_wrapper/compile_utils.py"),
    # DeepGEMM's own (default ~/.deep_gemm), read where sglang does not set it: vLLM and
    # DeepGEMM alone. The same directory as sglang's, which writes its value here.
    _cache("DG_JIT_CACHE_DIR", "deep_gemm", "DeepGEMM", "deep_gemm/jit/compiler.py"),
    # vLLM's root: its torch.compile cache (~24 s of every cold start), its DeepGEMM and
    # other JIT caches; default ~/.cache/vllm.
    _cache("VLLM_CACHE_ROOT", "vllm", "vLLM", "vllm/envs.py"),
    # The driver's PTX-to-SASS cache; default ~/.nv/ComputeCache.
    _cache("CUDA_CACHE_PATH", "nv-compute-cache", "CUDA driver", "CUDA programming guide"),
    # The Blackwell ptxas of newer Triton is TRITON_PTXAS_BLACKWELL_PATH.
    _triton_tool("TRITON_PTXAS_PATH", "ptxas"),
    _triton_tool("TRITON_PTXAS_BLACKWELL_PATH", "ptxas"),
    _triton_tool("TRITON_CUOBJDUMP_PATH", "cuobjdump"),
    _triton_tool("TRITON_NVDISASM_PATH", "nvdisasm"),
    # Triton's and Inductor's remote caches on a shared Redis (builder/core/remote_cache.py).
    # Triton's own backend takes only a host and a port, with no timeout: the env's backend
    # module reads TORCHINDUCTOR_REDIS_URL (password, database, TLS, timeouts) instead.
    _remote("TRITON_CACHE_MANAGER", "Triton", "triton/knobs.py (cache_knobs.manager_class)"),
    _remote("TRITON_REMOTE_CACHE_BACKEND", "Triton (RemoteCacheManager's backend class)",
            "triton/knobs.py (cache_knobs.remote_manager_class)"),
    _remote("TRITON_REDIS_HOST", "Triton's own Redis backend", "triton/knobs.py (redis_knobs)"),
    _remote("TRITON_REDIS_PORT", "Triton's own Redis backend", "triton/knobs.py (redis_knobs)"),
    _remote("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "torch Inductor (1: FX graphs from Redis)",
            "torch/_inductor/config.py"),
    _remote("TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE", "torch Inductor (1: autotuning results from Redis)",
            "torch/_inductor/config.py"),
    _remote("TORCHINDUCTOR_REDIS_HOST", "torch Inductor (where no URL is set)",
            "torch/_inductor/remote_cache.py"),
    _remote("TORCHINDUCTOR_REDIS_PORT", "torch Inductor (where no URL is set)",
            "torch/_inductor/remote_cache.py"),
    # Holds the password where one is given: not reported by doctor.
    _remote("TORCHINDUCTOR_REDIS_URL", "torch Inductor and the env's Triton backend "
            "(redis-py's from_url, with timeouts)", "torch/_inductor/remote_cache.py",
            doctor=False),
    _remote("CUDAENV_REMOTE_CACHE_WIRING", "cudaenv doctor (the hook's decision: `wired URL`, "
            "the password shown as ***, or `not wired: WHY`)", "builder/doctor/env_rules.py"),
    # nvcc documentation, "NVCC_PREPEND_FLAGS".
    Variable(name="NVCC_PREPEND_FLAGS", kind=Kind.NVCC, reader="nvcc", fingerprint=True,
             doctor=True),
    Variable(name="NVCC_APPEND_FLAGS", kind=Kind.NVCC, reader="nvcc", fingerprint=True,
             doctor=True),
    Variable(name="NVCC_CCBIN", kind=Kind.NVCC, reader="nvcc", fingerprint=True, doctor=True),
    Variable(name="CXX", kind=Kind.COMPILE, reader="torch's cpp_extension (the host compiler)",
             doctor=True),
    Variable(name="LD_LIBRARY_PATH", kind=Kind.RUNTIME, reader="the dynamic loader", doctor=True),
    Variable(name="CUDA_VISIBLE_DEVICES", kind=Kind.RUNTIME, reader="the CUDA driver",
             doctor=True),
    Variable(name="CUDAENV_SHELL_CUDA_HOME", kind=Kind.CUDAENV, reader="cudaenv doctor",
             hook=Hook.RECORDS, doctor=True),
    Variable(name="CUDAENV_NO_HOOK", kind=Kind.CUDAENV,
             reader="the start-up hook (1: it does nothing)"),
    Variable(name="CUDAENV_ARCH_LIST", kind=Kind.CUDAENV,
             reader="the start-up hook and activation (an arch list instead of the env's)"),
    Variable(name="CUDAENV_CACHE_DIR", kind=Kind.CUDAENV,
             reader="cudaenv (its cache; default $XDG_CACHE_HOME/cudaenv or ~/.cache/cudaenv)",
             reserved=True,
             setting=Setting(field="cache_dir", type="path")),
    # The JIT store (builder/store/) and its remote tier (builder/jit/share.py).
    # Reserved: a spec from a pull request must not point the store elsewhere or push.
    Variable(name="CUDAENV_JIT_STORE", kind=Kind.CUDAENV,
             reader="cudaenv (the JIT store's directory; `off`: no store)", reserved=True,
             setting=Setting(field="jit_store")),
    Variable(name="CUDAENV_JIT_STORE_MAX", kind=Kind.CUDAENV,
             reader="cudaenv (the store's size cap, like 10G; default 10G)", reserved=True,
             number=_SIZE,
             setting=Setting(field="jit_store_max", default="10G")),
    Variable(name="CUDAENV_JIT_LOCK_TIMEOUT", kind=Kind.CUDAENV,
             reader="cudaenv (seconds to wait for another builder of one key; default 900)",
             reserved=True, number=_SECONDS_OR_ZERO,
             setting=Setting(field="jit_lock_timeout", default="900")),
    Variable(name="CUDAENV_SOURCE_BUILD_TIMEOUT", kind=Kind.CUDAENV,
             reader="cudaenv (seconds one package's compile from its sdist may run before it "
             "is stopped and the build fails; default 14400)",
             reserved=True, number=_SECONDS,
             setting=Setting(field="source_build_timeout", default="14400")),
    Variable(name="CUDAENV_JIT_REMOTE", kind=Kind.CUDAENV,
             reader="cudaenv (oci://HOST[:PORT]/REPO: the store's registry tier; `off`: none)",
             reserved=True,
             # oci://USER:PASSWORD@HOST/REPO is a URL a registry's login can be written in.
             setting=Setting(field="jit_remote", type="remote", pyproject="jit-remote",
                             secret=True)),
    Variable(name="CUDAENV_JIT_PUSH", kind=Kind.CUDAENV,
             reader="cudaenv (1: push compiled and used entries to the remote)", reserved=True,
             setting=Setting(field="jit_push", type="switch")),
    Variable(name="CUDAENV_NO_PREFETCH", kind=Kind.CUDAENV,
             reader="cudaenv (1: build and adopt place no warmed JIT entries into the env)",
             reserved=True, setting=Setting(field="no_prefetch", type="switch")),
    Variable(name="CUDAENV_JIT_REMOTE_INSECURE", kind=Kind.CUDAENV,
             reader="cudaenv (1: plain http to a remote that is not on loopback)",
             reserved=True,
             setting=Setting(field="jit_remote_insecure", type="switch")),
    Variable(name="CUDAENV_JIT_REMOTE_TIMEOUT", kind=Kind.CUDAENV,
             reader="cudaenv (seconds one registry request may wait for an answer; a whole "
             "transfer may take that plus 1 s per MiB it carries; default 30)",
             reserved=True, number=_SECONDS,
             setting=Setting(field="jit_remote_timeout", default="30")),
    # Signed entries (builder/jit/signing.py): off unless one is set.
    Variable(name="CUDAENV_JIT_SIGNING_KEY", kind=Kind.CUDAENV,
             reader="cudaenv (an SSH private key: a warmer signs each entry it pushes with it)",
             read_at="builder/jit/signing.py", reserved=True,
             setting=Setting(field="jit_signing_key", type="path")),
    Variable(name="CUDAENV_JIT_ALLOWED_SIGNERS", kind=Kind.CUDAENV,
             reader="cudaenv (an ssh-keygen allowed-signers file: an entry pulled from the "
             "remote is placed only if one of its principals signed it)",
             read_at="builder/jit/signing.py", reserved=True,
             setting=Setting(field="jit_allowed_signers", type="path")),
    Variable(name="CUDAENV_JIT_REQUIRE_SIGNED", kind=Kind.CUDAENV,
             reader="cudaenv (1: take nothing from the remote unless "
             "CUDAENV_JIT_ALLOWED_SIGNERS names the signers to check)",
             read_at="builder/jit/signing.py", reserved=True,
             setting=Setting(field="jit_require_signed", type="switch")),
    Variable(name="CUDAENV_REMOTE_CACHE", kind=Kind.CUDAENV,
             reader="the start-up hook and cudaenv (redis://[USER[:PASSWORD]@]HOST[:PORT][/DB] "
             "or rediss://: Triton's and Inductor's shared cache, over a spec's "
             "`remote-cache:`; `off`: none)", read_at="builder/core/remote_cache.py", reserved=True,
             setting=Setting(field="remote_cache", type="redis", secret=True)),
    Variable(name="CUDAENV_REMOTE_CACHE_PASSWORD", kind=Kind.CUDAENV,
             reader="the start-up hook and cudaenv (the remote cache's password where its URL "
             "names none; never written into the env)", read_at="builder/core/remote_cache.py",
             reserved=True,
             setting=Setting(field="remote_cache_password", secret=True)),
    Variable(name="CUDAENV_JIT_SHARE", kind=Kind.CUDAENV,
             reader="verify's probe (the command that reaches the remote; set by cudaenv)",
             reserved=True),
    # Read by cudaenv itself (not by the env): which uv, which driver, how long a probe waits.
    Variable(name="CUDAENV_UV", kind=Kind.CUDAENV,
             reader="cudaenv (the uv binary to run; default the one installed with cudaenv, "
             "else PATH's)", read_at="builder/core/proc.py", reserved=True,
             setting=Setting(field="uv")),
    Variable(name="CUDAENV_SAFE_DIRECTORIES", kind=Kind.CUDAENV,
             reader="cudaenv (directories, separated by `:`, whose programs, envs and project "
             "files cudaenv uses although another user owns or can write them, as git's "
             "`safe.directory`; `*`: every directory; default none)",
             read_at="builder/core/owners.py", reserved=True,
             setting=Setting(field="safe_directories")),
    Variable(name="CUDAENV_EXCLUDE_NEWER", kind=Kind.CUDAENV,
             reader="cudaenv lock, init and a build that locks (the index view of a resolution "
             "that keeps none: a new lock, `--upgrade`; a UTC time like 2026-12-01T05:23:12Z "
             "or a date; default the index as it is now; a lock's own view and "
             "`--exclude-newer` come first)",
             read_at="builder/spec/relock.py", reserved=True,
             setting=Setting(field="exclude_newer", type="time")),
    Variable(name="CUDAENV_DRIVER_VERSION", kind=Kind.CUDAENV,
             reader="cudaenv (the NVIDIA driver version to assume, like 580.65; default read "
             "from the kernel module, nvidia-smi or libcuda)", read_at="builder/machine/driver.py",
             reserved=True,
             setting=Setting(field="driver_version")),
    Variable(name="CUDAENV_PROBE_TIMEOUT", kind=Kind.CUDAENV,
             reader="doctor's probe (seconds one `nvcc --version` may take; default 10)",
             read_at="builder/probe/doctor_probe.py", reserved=True, number=_SECONDS,
             setting=Setting(field="probe_timeout", default="10")),
    Variable(name="CUDAENV_HEARTBEAT_SECONDS", kind=Kind.CUDAENV,
             reader="verify (seconds between its \"still probing\" lines; default 15)",
             read_at="builder/verify/__init__.py", reserved=True, number=_SECONDS,
             setting=Setting(field="heartbeat_seconds", default="15")),
    Variable(name="CUDAENV_GPU_CHECK", kind=Kind.CUDAENV,
             reader="verify's sampling check (1: no GPU, or a half that did not run, fails "
             "instead of skipping; the GPU check sets it)",
             read_at="builder/verify/sampling.py", reserved=True,
             setting=Setting(field="gpu_check", type="switch")),
    Variable(name="CUDA_DEVICE_ORDER", kind=Kind.RUNTIME,
             reader="the CUDA runtime (the sampling check sets PCI_BUS_ID, as nvidia-smi "
             "numbers GPUs)", read_at="builder/verify/sampling.py"),
    Variable(name="GITHUB_STEP_SUMMARY", kind=Kind.OUTSIDE,
             reader="verify, matrix (the Markdown report is appended to this file)",
             read_at="builder/verify/report.py",
             setting=Setting(field="github_step_summary", type="path")),
    Variable(name="DOCKER_CONFIG", kind=Kind.OUTSIDE,
             reader="the store's registry tier (credentials: $DOCKER_CONFIG/config.json, "
             "default ~/.docker/config.json)", read_at="builder/jit/oci.py",
             setting=Setting(field="docker_config", type="path")),
    Variable(name="XDG_CACHE_HOME", kind=Kind.OUTSIDE,
             reader="cudaenv (its cache is $XDG_CACHE_HOME/cudaenv when CUDAENV_CACHE_DIR is "
             "unset)", read_at="builder/core/paths.py",
             setting=Setting(field="xdg_cache_home", type="path")),
    Variable(name="CC", kind=Kind.OUTSIDE,
             reader="cudaenv (the C compiler of the libcuda.so link stub; default cc, else gcc)",
             read_at="builder/env/toolchain.py", setting=Setting(field="cc")),
    Variable(name="PYENV_ROOT", kind=Kind.OUTSIDE,
             reader="cudaenv (where pyenv's interpreters are looked for; default ~/.pyenv)",
             read_at="builder/machine/interpreters.py", setting=Setting(field="pyenv_root", type="path")),
    Variable(name="CONDA_PREFIX", kind=Kind.OUTSIDE,
             reader="cudaenv (a conda environment whose interpreters are looked for)",
             read_at="builder/machine/interpreters.py", setting=Setting(field="conda_prefix")),
    Variable(name="CONDA_EXE", kind=Kind.OUTSIDE,
             reader="cudaenv (the conda whose environments' interpreters are looked for)",
             read_at="builder/machine/interpreters.py", setting=Setting(field="conda_exe")),
    Variable(name="VIRTUAL_ENV", kind=Kind.VENV, reader="the venv's activation", reserved=True,
             setting=Setting(field="virtual_env", type="path")),
    Variable(name="VIRTUAL_ENV_PROMPT", kind=Kind.VENV, reader="the venv's activation",
             reserved=True),
    Variable(name="PYTHONHOME", kind=Kind.VENV, reader="the Python interpreter", reserved=True),
)  # fmt: skip


def names(rows: Iterable[Variable]) -> tuple[str, ...]:
    return tuple(v.name for v in rows)


# What the hook and every activation script set (and deactivate gives back).
SET_BY_HOOK = names(v for v in TABLE if v.hook is Hook.SETS)
FINGERPRINT = names(v for v in TABLE if v.fingerprint)
RESERVED = names(v for v in TABLE if v.reserved)
DOCTOR_PROBE = names(v for v in TABLE if v.doctor)
VERIFY_PROBE = names(v for v in TABLE if v.verify)
ARCH_LISTS = names(v for v in TABLE if v.kind is Kind.ARCHS)
NVCC = names(v for v in TABLE if v.kind is Kind.NVCC)
# What the activation scripts keep for deactivate: the venv's (_OLD_VIRTUAL_PATH, ...) and
# ours (_CUDAENV_OLD_CUDA_HOME, ...). A spec value there would be restored in their place.
RESERVED_PREFIXES = ("_OLD_VIRTUAL_", "_CUDAENV_")


def number_problem(number: Number, text: str) -> str | None:
    """Why ``text`` is not a value of ``number``, or None when it is one."""
    if number.unit == "size":
        from builder.store import parse_size

        try:
            parse_size(text)
        except ValueError:
            return f"not a size (like {number.example})"
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    low = "0 or more" if number.zero else "above 0"
    if not (math.isfinite(value) and (value >= 0 if number.zero else value > 0)) or (
        value > SECONDS_MAX
    ):
        return f"not a number of seconds (a finite number {low} and at most {SECONDS_MAX:.0f}, like {number.example})"
    return None


def probe_arg(variables: Iterable[str]) -> str:
    """The argument that tells a probe (doctor_probe.py, env_facts.py) which variables to
    report: they run in another interpreter and import nothing of cudaenv."""
    return "--env=" + ",".join(variables)
