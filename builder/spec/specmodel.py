"""What a spec says, once read: :class:`EnvSpec` and its :class:`Toolchain`, the names a spec
may use (toolchain sources, toolkit components, verify checks) and the fingerprint a lock
carries of it.

Reading a spec file into these is :mod:`builder.spec.envspec`'s; nothing here knows YAML.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from builder.core import context
from builder.core import platforms as platforms_mod
from builder.core import remote_cache as remote_cache_mod
from builder.core.cudaversion import CudaVersion
from builder.machine.archs import DEFAULT_ARCHS, Arch
from builder.machine.targets import Target

# Where the env's nvcc comes from: NVIDIA's wheels, or a toolkit already on the machine.
ToolchainSource = Literal["wheels", "system"]
TOOLCHAIN_SOURCES: tuple[ToolchainSource, ...] = get_args(ToolchainSource)
# Extras of NVIDIA's `cuda-toolkit` metapackage that make sense for a JIT toolchain.
COMPONENTS = (
    "nvcc",
    "cudart",
    "crt",
    "nvvm",
    "cccl",
    "cublas",
    "cufft",
    "curand",
    "cusolver",
    "cusparse",
    "nvjitlink",
    "nvrtc",
    "cupti",
    "nvtx",
    "cuobjdump",
    "nvdisasm",
)
CHECKS = (
    "imports",
    "toolchain",
    "binaries",
    "kernel-compile",
    "flashinfer-jit",
    "cubin",
    "sampling",
)
DEFAULT_COMPONENTS = ("nvcc", "cudart", "crt", "nvvm", "cccl")


@dataclass(frozen=True, kw_only=True)
class Toolchain:
    source: ToolchainSource = "wheels"
    components: tuple[str, ...] = DEFAULT_COMPONENTS
    path: Path | None = None


@dataclass(frozen=True, kw_only=True)
class EnvSpec:
    name: str
    python: str
    cuda: str
    source: Path
    summary: str = ""
    torch: str | None = None
    packages: tuple[str, ...] = ()
    toolchain: Toolchain = field(default_factory=Toolchain)
    archs: tuple[Arch, ...] = DEFAULT_ARCHS
    env: tuple[tuple[str, str], ...] = ()
    # Variables for every source build (an sdist-only package compiled at install): part of
    # the built wheel's store key, not of the resolution.
    build_env: tuple[tuple[str, str], ...] = ()
    verify: tuple[str, ...] = CHECKS
    # package -> the only index it may come from (uv explicit index + source, then the exact
    # file URL and hash in the lock): a same-named package elsewhere cannot be substituted.
    indexes: tuple[tuple[str, str], ...] = ()
    # Where the lock must install (platforms.py); each is resolved and policy-checked apart.
    platforms: tuple[str, ...] = platforms_mod.DEFAULT
    # The GPU classes the stack must serve (targets.py): judged from the lock's wheels of each
    # target's platform; the arch list follows from them when `archs:` is left out.
    targets: tuple[Target, ...] = ()
    # Triton's and Inductor's shared cache (remote_cache.py): redis://HOST[:PORT][/DB], no
    # password (it is given at run time); the lock gains the Redis client.
    remote_cache: str | None = None

    @property
    def cuda_version(self) -> CudaVersion:
        return CudaVersion.parse(self.cuda)

    @property
    def cuda_major(self) -> int:
        return self.cuda_version.major

    def fingerprint(self) -> str:
        """sha256 over what decides the resolution; a lock carries it (lock.py). Made once
        per spec object (it is frozen): a `build --verify` compares it three times.

        ``archs``, ``env``, ``verify`` and ``summary`` do not change what is installed, so
        editing them does not force a re-lock.
        """
        return context.kept_on(self, "fingerprint()", self._fingerprint)

    def _fingerprint(self) -> str:
        doc: dict[str, object] = {
            "python": self.python,
            "cuda": self.cuda,
            "torch": self.torch,
            "packages": sorted(self.packages),
            "platforms": sorted(self.platforms),
            "toolchain": {
                "source": self.toolchain.source,
                "components": sorted(self.toolchain.components),
            },
        }
        if self.indexes:  # only when set, so locks of specs without it stay valid
            doc["indexes"] = dict(sorted(self.indexes))
        if self.remote_cache:  # the lock holds the Redis client; the URL is the env's
            doc["remote-cache-client"] = remote_cache_mod.CLIENT
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()
