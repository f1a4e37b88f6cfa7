"""What makes an env use its toolkit wherever it starts: the ``.pth`` start-up hook, the block
in every shell's activation script, the stand-in pip, and the remote-cache wiring the hook
renders (``builder.core.remote_cache``'s rules).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from builder.core import proc, remote_cache, settings, variables
from builder.core.errors import BuildError
from builder.env import caches
from builder.machine import archs
from builder.machine.archs import Arch
from builder.spec.envspec import EnvSpec

if TYPE_CHECKING:
    pass
from builder.env import toolchain
from builder.formats import templates

HOOK_MODULE = "_cudaenv_hook"


PTH_NAME = "cudaenv.pth"


def write_pip_guard(venv: Path, spec: EnvSpec) -> list[Path]:
    """A stand-in pip: ``bin/pip`` (pip3, pip3.X) and a ``pip`` module for ``python -m pip``.
    The env holds exactly its lock, so it has no pip that could install around it; the stand-in
    answers ``list``, ``freeze`` and ``show`` from the env's metadata (torch's ``collect_env``
    runs ``python -m pip list --format=freeze``) and says ``cudaenv add PKG --spec SPEC`` for
    anything that would change the env. A real pip installed later replaces both."""
    site = toolchain.site_packages(venv)
    module = site / "pip"
    written = []
    if not module.exists():
        module.mkdir()
        (module / "__init__.py").write_text(
            templates.render("pip_stub.py.j2", {"spec": str(spec.source)})
        )
        (module / "__main__.py").write_text(
            "import sys\n\nfrom pip import main\n\nsys.exit(main())\n"
        )
        written.append(module)
    text = (
        "#!/bin/sh\n"
        "# Written by cudaenv: this env holds exactly the lock of its spec (see python -m pip).\n"
        'exec "$(cd "$(dirname "$0")" && pwd)/python" -m pip "$@"\n'
    )
    for name in ("pip", "pip3", f"pip{spec.python}"):
        path = venv / "bin" / name
        if not path.exists():
            path.write_text(text)
            path.chmod(0o755)
            written.append(path)
    return written


def _append(path: Path, text: str, block: str) -> str:
    return text + block


def _into_nu_export_env(path: Path, text: str, block: str) -> str:
    """Nushell runs only the last ``export-env`` block of a module, so ours goes inside the
    venv's own (the one at column 0), after its ``load-env``. ``deactivate`` is ``overlay
    hide``, which drops everything the overlay set, ours included."""
    found = re.search(r"^export-env \{\n.*?^\}", text, re.MULTILINE | re.DOTALL)
    if found is None:
        raise BuildError(
            f"{path}: no export-env block at the start of a line, so the env's CUDA settings "
            "cannot be added to it (a venv tool that writes activate.nu in another shape)"
        )
    end = found.end() - 1
    return text[:end] + block + text[end:]


def _before_ps_signature(path: Path, text: str, block: str) -> str:
    # The standard library's Activate.ps1 ends with an Authenticode block: code goes above it.
    mark = text.find("\n# SIG # Begin signature block")
    if mark < 0:
        return text.rstrip("\n") + "\n" + block
    return text[:mark] + "\n" + block + text[mark:]


# The first line of the block written into each activation script.
BLOCK_MARK = "# >>> cudaenv "


# (script in bin/, template, where the block goes): every venv writes activate (bash, zsh,
# sh) and activate.fish; uv and virtualenv write activate.nu, activate.ps1 and (not for
# --relocatable) activate.csh; the standard library's venv writes Activate.ps1 and
# activate.csh. activate_this.py needs nothing: its site.addsitedir() runs the hook's .pth.
# The .bat files are for Windows' cmd, which never runs a Linux env.
ACTIVATIONS: tuple[tuple[str, str, Callable[[Path, str, str], str]], ...] = (
    ("activate", "activate.sh.j2", _append),
    ("activate.fish", "activate.fish.j2", _append),
    ("activate.xsh", "activate.xsh.j2", _append),
    ("activate.csh", "activate.csh.j2", _append),
    ("activate.nu", "activate.nu.j2", _into_nu_export_env),
    ("activate.ps1", "activate.ps1.j2", _before_ps_signature),
    ("Activate.ps1", "activate.ps1.j2", _before_ps_signature),
)


def has_redis_client(site: Path) -> bool:
    """The env can reach a Redis cache: redis-py is installed (its lock holds ``redis``)."""
    return (site / remote_cache.CLIENT / "__init__.py").is_file()


def remote_values(url: str | None, client: bool) -> dict[str, object]:
    """What the hook's remote-cache part is rendered with (remote_cache.py's rules): the
    spec's URL, whether the env has the Redis client."""
    return {
        "remote_cache": url or "",
        "redis_client": client,
        "remote_vars": remote_cache.WIRED,
        "manager": remote_cache.MANAGER,
        "backend": remote_cache.BACKEND,
        "timeout": f"{remote_cache.TIMEOUT:g}",
        "default_port": remote_cache.DEFAULT_PORT,
        "db_pattern": remote_cache.DB_PATTERN,
    }


def remote_cache_note(venv: Path, spec: EnvSpec) -> str | None:
    """A warning for the build where the remote cache this process names (CUDAENV_REMOTE_CACHE,
    which wins, else the spec's) would not be wired: the env's lock has no Redis client, the
    URL is not one, or a server off loopback has no password here; None when all is well."""
    found = settings.current()
    if found.remote_cache is None and found.origin("remote_cache") == "CUDAENV_REMOTE_CACHE":
        return None  # `off`: the hook wires nothing, whatever the spec names
    url = found.remote_cache or spec.remote_cache
    if not url:
        return None
    where = "CUDAENV_REMOTE_CACHE" if found.remote_cache else f"remote-cache of {spec.source}"
    if not has_redis_client(toolchain.site_packages(venv)):
        return (
            f"warning: {where} names a Redis cache but {spec.name}'s lock has no Redis client "
            f"(`{remote_cache.CLIENT}`): Triton and Inductor are not wired to it; add "
            f"`remote-cache:` to {spec.source} and build again"
        )
    # Checked where it was read (the spec's loader, the settings): it parses.
    cache = remote_cache.parse(url).with_password(found.remote_cache_password)
    # A server off loopback gets its password at run time: say now, not at the first
    # compile, that a process without one runs unwired.
    why = remote_cache.refusal(cache)
    return (
        None if why is None else f"warning: {where}: {why}; a process without one compiles locally"
    )


def write_hooks(venv: Path, spec: EnvSpec, env_archs: Sequence[Arch]) -> list[Path]:
    """The .pth start-up hook and the block in every shell's activation script the venv has,
    values quoted by the templates."""
    site = toolchain.site_packages(venv)
    depth = len(site.relative_to(venv).parts)
    client = has_redis_client(site)
    # Activation exports the spec's wiring (the hook decides again at each interpreter start:
    # CUDAENV_REMOTE_CACHE, the password, the rules); never a password, as a spec holds none.
    # So a server off loopback is exported by no script: a process that skips the hook
    # (CUDAENV_NO_HOOK=1) would be wired to it unauthenticated, the one thing refused.
    named = remote_cache.parse(spec.remote_cache) if spec.remote_cache and client else None
    wired = (
        remote_cache.wiring(named)
        if named is not None and remote_cache.refusal(named) is None
        else ()
    )
    values = {
        "name": spec.name,
        "pth_name": PTH_NAME,
        "depth": depth,
        "flashinfer_archs": archs.flashinfer_spelling(env_archs),
        "torch_archs": archs.torch_spelling(env_archs),
        "max_nvcc_threads": archs.MAX_NVCC_THREADS,
        "env": [*spec.env, *wired],
        "caches": [(c.variable, c.subdir) for c in caches.CACHES],
        # Only binaries the toolkit has: Triton falls back to its own silently otherwise.
        "tools": [
            (v, t) for v, t in caches.TRITON_TOOLS if (venv / "cuda-home" / "bin" / t).exists()
        ],
        # What activation saves and deactivate gives back: every variable it sets.
        "saved": list(
            dict.fromkeys([*variables.SET_BY_HOOK, *[k for k, _ in [*spec.env, *wired]]])
        ),
    }
    hook = site / f"{HOOK_MODULE}.py"
    # The hook sets the remote cache's variables in code of its own, at each start.
    hook_values = {**values, "env": list(spec.env), **remote_values(spec.remote_cache, client)}
    hook.write_text(templates.render("hook.py.j2", hook_values))
    pth = site / PTH_NAME
    written = [hook, pth]
    if client:
        backend = site / f"{remote_cache.BACKEND_MODULE}.py"
        backend.write_text(
            templates.render(
                "remote_cache.py.j2", {"name": spec.name, "backend": remote_cache.BACKEND}
            )
        )
        written.append(backend)
    for script, template, place in ACTIVATIONS:
        path = venv / "bin" / script
        if path.exists():
            proc.atomic_write_text(
                path, place(path, path.read_text(), templates.render(template, values))
            )
            written.append(path)
    # Made now: not every library creates its cache directory before writing into it.
    for cache in caches.CACHES:
        (venv / "var" / cache.subdir).mkdir(parents=True, exist_ok=True)
    # Last, and whole: until this file exists the interpreter starts as before (what an
    # interrupted `cudaenv adopt` relies on).
    proc.atomic_write_text(pth, f"import {HOOK_MODULE}\n")
    return written
