"""The JIT caches of the stack, and where an env keeps them: each in its own ``var/``.

Every library that compiles at run time keeps a cache of its own, by default under the
user's home or /tmp, where envs with different toolkits collide: a CUDA 13 build reused by
CUDA 12.9 workers (flashinfer#5145), a key that ignores the toolkit (flashinfer#3229). The
start-up hook and ``activate`` point each library's own variable into the env (toolchain.py
renders them from :data:`CACHES`, the cache rows of builder/core/variables.py), and Triton's tool
variables at the env's matched binaries (Triton's bundled ptxas does not know ``sm_121a`` on
DGX Spark, triton#8539). ``doctor`` reports every location and flags one outside a cudaenv
env.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from builder.core import variables


@dataclass(frozen=True)
class Cache:
    variable: str
    subdir: str  # under ENV/var
    owner: str
    read_by: str  # where the library reads the variable (its default when unset)


# The JIT cache rows of the variable table (builder/core/variables.py says who reads each, where,
# and where it defaults to).
CACHES: tuple[Cache, ...] = tuple(
    Cache(v.name, v.cache, v.reader, v.read_at) for v in variables.TABLE if v.cache is not None
)

# Triton's tool variables -> the binary in cuda-home/bin. Triton silently falls back to its
# bundled binary when the path does not run, so only binaries the env has are set
# (hooks.write_hooks) and doctor checks them.
TRITON_TOOLS: tuple[tuple[str, str], ...] = tuple(
    (v.name, v.tool) for v in variables.TABLE if v.tool is not None
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
