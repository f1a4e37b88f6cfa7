"""``cudaenv adopt --rebuild PKG``: a package the user's env compiled at install, built again
from its sdist against the toolkit adopt gave the env, undoably.

An env adopted after the fact usually holds such packages (causal-conv1d, flash-attn, ...)
compiled by whatever nvcc the shell had then: doctor names one built by another CUDA than
torch's. Rebuilding it is the compile of a build's source packages
(:mod:`builder.env.sdistbuild`: the env's interpreter, no build isolation, the env's
``CUDA_HOME``, the recipe's variables, no network, a deadline), with two differences:

- there is no lock, so the sdist's sha256 comes from the index the machine is set up with
  (``uv pip compile --no-deps --generate-hashes``, which reads no metadata and builds
  nothing), and pip fetches it ``--require-hashes`` against that;
- the package is already installed, and the index cannot give it back as it was (it was
  built here). So its files are first kept as a wheel (:mod:`builder.adopt.saved`), the
  journal records that wheel and its sha256 before the new one is installed, and
  ``adopt --undo`` reinstalls it.

A failed fetch or compile changes nothing in the env; a failed install puts the saved wheel
back. Each rebuilt package is listed in the manifest's ``source_builds``, so ``verify``'s
imports check imports it and the audit reads its ``.so`` files as built for this env.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

from packaging.utils import canonicalize_name

from builder.adopt import saved as saving
from builder.adopt.journal import Env, Journal, Progress, Refused, write_journal
from builder.core import proc
from builder.core.errors import BuildError, UsageError
from builder.env import manifest, recordscan
from builder.env.manifest import Manifest
from builder.env.sdistbuild import (
    WORK,
    Guard,
    build_environ,
    bundled_pip,
    compile_sdist,
    fetch_sdist,
    values_for,
)
from builder.spec.envspec import (
    BUILD_ENV_DENIED,
    BUILD_ENV_DENIED_PREFIXES,
    DEFAULT_COMPONENTS,
    EnvSpec,
    Toolchain,
)

_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def names(text: str) -> tuple[str, ...]:
    """``--rebuild``'s comma-separated names, canonical, in order, each once."""
    return tuple(dict.fromkeys(canonicalize_name(n.strip()) for n in text.split(",") if n.strip()))


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def arguments(
    rebuild: str | None, build_env: Sequence[str], *, undo: bool
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """``--rebuild`` and ``--build-env`` as adopt takes them (the names, the variables), or
    UsageError naming the argument that does not fit with the others."""
    if undo and rebuild is not None:
        raise UsageError("--rebuild and --undo: give one (--undo also undoes a rebuild)")
    wanted = names(rebuild) if rebuild is not None else ()
    if rebuild is not None and not wanted:
        raise UsageError("--rebuild: name at least one installed package (--rebuild flash-attn)")
    if build_env and not wanted:
        raise UsageError("--build-env: only the compiles of --rebuild take variables")
    return wanted, build_env_arg(build_env)


def build_env_arg(given: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``--build-env KEY=VALUE`` values, held to the rules of a spec's ``build-env:`` (no
    variable of the env's toolkit, interpreter, loader or installers); UsageError naming the
    argument otherwise."""
    out: dict[str, str] = {}
    for text in given:
        key, eq, value = text.partition("=")
        if not eq or not _NAME.fullmatch(key):
            raise UsageError(f"--build-env {text!r}: expected KEY=VALUE, KEY a variable name")
        upper = key.upper()
        if upper in BUILD_ENV_DENIED or upper.startswith(BUILD_ENV_DENIED_PREFIXES):
            raise UsageError(
                f"--build-env {key}: the env's own (its toolkit, interpreter or loader); "
                "it cannot be set for a source build"
            )
        if any(c in value for c in "\x00\n\r"):
            raise UsageError(f"--build-env {key}: a value holds no NUL or line break")
        out[key] = value
    return tuple(out.items())


def _spec(built: Manifest, prefix: Path, build_env: tuple[tuple[str, str], ...]) -> EnvSpec:
    """What the compile reads of a spec, from the adopted env's manifest: its archs (spelled
    for each consumer by the recipe), its Python and CUDA, and ``--build-env``."""
    return EnvSpec(
        build_env=build_env,
        name=built.name,
        python=built.python,
        cuda=built.cuda,
        source=prefix / "cudaenv-adopted",
        archs=built.spec_archs or built.archs,
        toolchain=Toolchain(source="wheels", components=DEFAULT_COMPONENTS),
    )


def index_hashes(python: Path, name: str, version: str, work: Path) -> tuple[str, ...]:
    """The sha256 of each sdist of ``name`` ``version`` the machine's index lists, as uv
    reads them (no metadata read, nothing built); BuildError where it lists none."""
    req = work / "rebuild.in"
    req.write_text(f"{name}=={version}\n")
    argv = [proc.uv_bin(), "pip", "compile", "--quiet", "--no-deps", "--generate-hashes",
            "--no-header", "--no-annotate", "--no-binary", name, "--python", str(python),
            str(req)]  # fmt: skip
    try:
        done = proc.run(argv, env=proc.uv_env(), timeout=600)
    except proc.CommandFailed as exc:
        said = [ln.strip() for ln in exc.output.strip().splitlines() if ln.strip()]
        raise BuildError(
            f"{name} {version}: the index this machine uses has no sdist of it to rebuild "
            f"from ({said[-1] if said else 'uv found none'})"
        ) from exc
    found = tuple(dict.fromkeys(_HASH.findall(done.stdout)))
    if not found:
        raise BuildError(
            f"{name} {version}: the index lists its sdist with no sha256 to fetch it against "
            "(a find-links directory gives none); serve it from an index page that does "
            "(PEP 503 links ending #sha256=...)"
        )
    return found


# A RECORD is the user's file: read bounded, as the doctor reads one (recordscan).
_MAX_RECORD_BYTES = 64 << 20


def _compiled(site: Path, name: str, version: str) -> bool:
    """Whether the installed distribution holds a compiled extension (a shared object)."""
    info = saving.dist_info(site, name, version)
    if info is None:
        return False
    return bool(recordscan.shared_objects(info / "RECORD", _MAX_RECORD_BYTES))


def rebuild(
    env: Env,
    journal: Journal,
    wanted: Sequence[str],
    progress: Progress,
    *,
    build_env: tuple[tuple[str, str], ...] = (),
) -> tuple[Journal, list[tuple[str, str, str, str]]]:
    """Rebuild each of ``wanted`` in the adopted env (with its lock held, the journal marked
    done); the journal as now written, and a manifest row per package rebuilt."""
    built = manifest.try_read(env.prefix)
    if built is None or built.spec != manifest.ADOPTED_SPEC:
        raise Refused(f"{env.prefix}: not adopted (no adopted {manifest.FILE}); nothing rebuilt")
    for name in wanted:  # every name checked before anything is compiled
        if name not in env.dists:
            raise Refused(f"{env.prefix}: {name} is not installed there; nothing was changed")
        if not _compiled(env.purelib, name, env.dists[name]):
            raise Refused(
                f"{name} {env.dists[name]} installed no compiled extension (.so) in "
                f"{env.prefix}: nothing to rebuild; nothing was changed"
            )
    spec = _spec(built, env.prefix, build_env)
    rows = []
    for name in wanted:
        journal, row = _one(env, journal, spec, built, name, progress)
        rows.append(row)
    return journal, rows


def _one(
    env: Env, journal: Journal, spec: EnvSpec, built: Manifest, name: str, progress: Progress
) -> tuple[Journal, tuple[str, str, str, str]]:
    version = env.dists[name]
    python = env.prefix / "bin" / "python"
    earlier = next((r for r in journal.rebuilt if r[0] == name), None)
    # Rebuilt before: the saved wheel is the install as the user had it; it is kept.
    saved = (
        saving.Saved(*earlier) if earlier else saving.save(env.prefix, env.purelib, name, version)
    )
    work = env.prefix / WORK / f"{name}-{version}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        values = values_for(spec, name)
        pip = bundled_pip(python)
        hashes = index_hashes(env.python, name, version, work)
        guard = Guard(env.prefix, work, live=True)
        sdist = fetch_sdist(env.prefix, pip, name, version, hashes,
                            build_environ(env.prefix, spec, values), work,
                            guard=guard)  # fmt: skip
        wheel = compile_sdist(env.prefix, spec, name, version, sdist, values, work, pip=pip,
                              torch=env.torch, nvcc=built.nvcc, target=env.prefix,
                              progress=progress, guard=guard)  # fmt: skip
    except BaseException:
        if earlier is None:
            (env.prefix / saved.wheel).unlink(missing_ok=True)  # no journal names it yet
        shutil.rmtree(work, ignore_errors=True)
        raise
    if earlier is None:
        row = (saved.name, saved.version, saved.wheel, saved.sha256, saved.origin)
        journal = dataclasses.replace(journal, rebuilt=(*journal.rebuilt, row))
        write_journal(env.prefix, journal)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    try:
        _install(python, name, wheel)
    except BuildError:
        _install(python, name, saving.checked(env.prefix, saved))  # as it was
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress(f"{name} {version}: rebuilt with nvcc {built.nvcc} and installed ({wheel.name})")
    return journal, (name, version, digest, "")


def _install(python: Path, name: str, wheel: Path) -> None:
    argv = [proc.uv_bin(), "pip", "install", "--quiet", "--no-deps", "--offline",
            "--reinstall-package", name, "--python", str(python), str(wheel)]  # fmt: skip
    try:
        proc.run(argv, env=proc.uv_env(), timeout=1800)
    except proc.CommandFailed as exc:
        raise BuildError(
            f"{name}: installing {wheel.name} failed: {exc.output.strip()[-300:]}"
        ) from exc
