"""Packages that compile at install: each locked package that has only an sdist on this
platform is built into a wheel by the env's own interpreter, against the env's torch and its
matched toolkit, then installed like any other file of the lock.

The steps, for each such package, after the lock's wheels are installed and ``cuda-home/``
and the start-up hook are written:

1. The store is asked first, under a key of everything that makes the wheel (:func:`key`):
   the sdist's sha256, the toolkit's and host compiler's content, the locked torch wheel,
   the Python tag, the platform, the arch list, the recipe's and the spec's ``build-env``
   variables. A hit is placed with every byte checked, then installed: no compile.
2. Else the sdist is fetched by pip (the one the interpreter's own ``ensurepip`` bundles:
   the env has no pip, and pip is a tree no single hash vouches for) through the machine's
   index configuration, ``--require-hashes`` against the lock, and checked again here.
3. Its ``setup.py`` is read for what the env cannot give (:func:`recipes.before_compiling`).
4. ``pip wheel --no-build-isolation --no-index`` builds it in the env's interpreter with the
   env's ``CUDA_HOME``/``PATH``, the recipe's variables (:mod:`builder.env.recipes`) and the
   spec's ``build-env``, passed as an environment, never through a shell. The network is
   closed to it (proxies at a port nothing serves: a ``setup.py`` that downloads fails and
   is named), no GPU is visible, and it runs under a deadline that kills its process group.
   Progress comes every :data:`buildlog.HEARTBEAT` seconds; a failure is one line with the first
   compiler error, the whole log kept.
5. The wheel is published to the store and installed with uv (``--no-deps --offline``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder import store as jit_store
from builder.core import platforms, proc
from builder.core.errors import BuildError
from builder.core.paths import jit_store_here
from builder.env import recipes, toolchain
from builder.env.sdistbuild import (
    WORK,
    Guard,
    build_environ,
    bundled_pip,
    compile_sdist,
    fetch_sdist,
    in_use,
    values_for,
)
from builder.machine import archs as archs_mod
from builder.spec.envspec import EnvSpec
from builder.spec.lockmodel import Lock, LockedPackage

if TYPE_CHECKING:
    from builder.jit.oci import Remote

# uv's install of one built wheel: seconds for flash-attn's ~250 MB, unzipped into uv's cache
# and linked; the bound is for a stuck filesystem, never a slow one.
INSTALL_TIMEOUT = 600.0


@dataclass(frozen=True, kw_only=True)
class SourceBuilt:
    """One package built from its sdist (or taken from the store) and installed."""

    name: str
    version: str
    wheel: str  # the wheel's file name
    sha256: str
    key: str
    reused: bool
    seconds: float
    entry: Path | None = None  # the store entry it came from or went into (none: store off)
    # The entries of site-packages it added, installed beside the proof of the lock (none:
    # installed alone, or compiled): only its own RECORD is read to prove it (installproof.Proof).
    apart: tuple[str, ...] = ()


def source_packages(packages: Sequence[LockedPackage]) -> list[LockedPackage]:
    """The locked packages that have no wheel here, only an sdist: the ones compiled."""
    return [p for p in packages if not p.wheels and p.sdist is not None]


def wheels_only(lock: Lock) -> Lock:
    """``lock`` without its source-built packages: what uv installs from the index."""
    return dataclasses.replace(lock, packages=tuple(p for p in lock.packages if p.wheels))


def key(
    pkg: LockedPackage,
    spec: EnvSpec,
    lock: Lock,
    env: Path,
    values: dict[str, str],
    hasher: jit_store.Hasher,
    recorded: jit_store.Recorded | None = None,
) -> str:
    """The built wheel's store key: everything that makes it (see the module docstring).
    ``recorded``: the toolkit's binaries as their wheels' RECORDs state them
    (store.RecordedTools), else they are hashed."""
    assert pkg.sdist is not None
    host = platforms.host_name()
    torch = [(p.version, sorted(p.hashes)) for p in lock.packages_on(host) if p.name == "torch"]
    environ = build_environ(env, spec, values)
    material = {
        "kind": "wheel",
        "recipes": recipes.RECIPES_VERSION,
        "package": [pkg.name, pkg.version, pkg.sdist.sha256],
        "tools": jit_store.tool_identities(
            hasher, str(env / "cuda-home"), ("gcc", "g++", "cc", "c++"), environ, recorded
        ),
        "torch": torch,
        "python": f"cp{spec.python.replace('.', '')}",
        "platform": host,
        "variables": sorted(recipes.key_variables(values).items()),
        "env": sorted(spec.env),
    }
    return jit_store.key_of(material)


def build_all(
    env: Path,
    spec: EnvSpec,
    lock: Lock,
    packages: Sequence[LockedPackage],
    *,
    nvcc: str,
    target: Path,
    progress: Callable[[str], None],
    before_running: Callable[[], None] = lambda: None,
    beside_install: Callable[[Sequence[str]], None] | None = None,
) -> tuple[SourceBuilt, ...]:
    """Build (or take from the store) and install each of ``packages`` into the env at ``env``
    (being built; ``target`` is where it will live). ``before_running`` is called before the
    first fetch or compile runs anything in the env (the build proves its install then);
    ``beside_install`` while a wheel taken from the store installs, with the entries of
    site-packages that install adds meanwhile (:func:`_install_meanwhile`). BuildError names
    the package."""
    store = jit_store_here()
    if store is not None:
        try:
            store.ready()
        except (jit_store.StoreError, OSError) as exc:
            progress(f"warning: the JIT store was not used for source builds: {exc}")
            store = None
    hasher = store.hasher if store is not None else jit_store.Hasher(None)
    tiers = _Tiers(store, hasher, spec, progress, jit_store.RecordedTools.in_env(env))
    done = []
    for pkg in packages:
        done.append(_one(env, spec, lock, pkg, tiers, nvcc=nvcc,
                         target=target, progress=progress,
                         before_running=before_running,
                         beside_install=beside_install))  # fmt: skip
    if store is not None:
        with contextlib.suppress(OSError):
            store.hasher.save()
    return tuple(done)


@dataclass(frozen=True)
class Ahead:
    """What `cudaenv warm` made of one package for one arch list."""

    reused: bool  # the store held it: nothing compiled
    seconds: float
    entry: Path | None  # the store entry; None when it could not be kept (``why`` says)
    why: str = ""


def build_ahead(
    env: Path,
    spec: EnvSpec,
    lock: Lock,
    pkg: LockedPackage,
    archs: tuple[archs_mod.Arch, ...],
    *,
    nvcc: str,
    progress: Callable[[str], None],
) -> Ahead:
    """`cudaenv warm`: the wheel of ``pkg`` for the arch list ``archs`` compiled in the built
    env at ``env`` and kept in the store under the key an env of those archs asks for, unless
    the store holds it already; never installed (the env stays as it is). BuildError as a
    build's, naming the package."""
    store = jit_store_here()
    if store is None:
        raise BuildError(f"{pkg.name}: the JIT store is off, so nothing built ahead is kept")
    aimed = dataclasses.replace(spec, archs=archs)
    values = values_for(aimed, pkg.name)
    k = key(pkg, aimed, lock, env, values, store.hasher)
    found = store.find(k, str(env))
    if found is not None:
        return Ahead(reused=True, seconds=0.0, entry=found.path)
    if archs != spec.archs:
        # The env's start-up hook gives a build the env's own list unless told another.
        values = {**values, "CUDAENV_ARCH_LIST": archs_mod.flashinfer_spelling(archs)}
    work = env / WORK / f"{pkg.name}-{pkg.version}-ahead"
    shutil.rmtree(work, ignore_errors=True)
    (work / "wheel").mkdir(parents=True)
    started = time.monotonic()
    try:
        wheel = _compile(env, aimed, lock, pkg, values, work, nvcc=nvcc, target=env,
                         progress=progress)  # fmt: skip
        seconds = time.monotonic() - started
        kept = _publish(store, k, wheel, pkg, env, env, seconds, progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):
            (env / WORK).rmdir()
    why = "" if kept is not None else "built, but not kept in the JIT store (the warning above)"
    return Ahead(reused=False, seconds=round(seconds, 1), entry=kept, why=why)


def note_uses(env: Path, made: Sequence[SourceBuilt]) -> None:
    """List the store entries of ``made`` among those the env at ``env`` uses (once its
    manifest is written: only a cudaenv env keeps the list), so `export --with-jit` carries
    the built wheels with the env's other JIT results."""
    store = jit_store_here()
    if store is None:
        return
    for built in made:
        if built.entry is not None:
            jit_store.note_use(store, built.entry, str(env))


def client_ahead(spec: EnvSpec) -> None:
    """Import the registry client in a thread of its own where a JIT remote is configured
    for the spec's project: the build calls this before uv installs the lock, which it
    waits for anyway, so the client (oras, requests, jsonschema: ~0.09 s of imports) is
    ready when a package that compiles at install misses the machine's store."""
    import threading

    from builder.jit import share as jit_share
    from builder.spec import project

    with contextlib.suppress(Exception):  # a bad setting is said where it is used
        if jit_share.remote_url(setting=project.settings_for(spec.source).jit_remote) and (
            jit_store_here() is not None
        ):
            threading.Thread(target=_import_client, name="import-oci", daemon=True).start()


def _import_client() -> None:
    with contextlib.suppress(Exception):  # the build's own import says what is wrong
        import builder.jit.oci  # noqa: F401


class _Tiers:
    """Where a built wheel is looked for and kept: the machine's store, and its registry
    tier, configured when first asked for (a store hit never needs the registry client)."""

    def __init__(
        self,
        store: jit_store.Store | None,
        hasher: jit_store.Hasher,
        spec: EnvSpec,
        progress: Callable[[str], None],
        recorded: jit_store.Recorded,
    ) -> None:
        self.store, self.hasher, self.recorded = store, hasher, recorded
        self._spec, self._progress = spec, progress
        self._remote: Remote | None = None
        self._asked = False

    @property
    def remote(self) -> Remote | None:
        """The store's registry tier for the spec's project, as the JIT's (jit/share.py)."""
        if self.store is None:
            return None
        if not self._asked:
            self._asked = True
            from builder.jit import share as jit_share
            from builder.spec import project

            try:
                self._remote = jit_share.configured(
                    setting=project.settings_for(self._spec.source).jit_remote
                )
            except jit_share.ShareError as exc:
                self._progress(f"warning: the JIT remote was not used for source builds: {exc}")
        return self._remote


def _one(
    env: Path,
    spec: EnvSpec,
    lock: Lock,
    pkg: LockedPackage,
    tiers: _Tiers,
    *,
    nvcc: str,
    target: Path,
    progress: Callable[[str], None],
    before_running: Callable[[], None],
    beside_install: Callable[[Sequence[str]], None] | None,
) -> SourceBuilt:
    values = values_for(spec, pkg.name)
    k = key(pkg, spec, lock, env, values, tiers.hasher, tiers.recorded)
    work = env / WORK / f"{pkg.name}-{pkg.version}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "wheel").mkdir(parents=True)
    started = time.monotonic()
    placed, where = _from_tiers(tiers, k, env, work / "wheel", pkg, progress)
    entry: Path | None = None
    if placed is not None:
        progress(f"{pkg.name} {pkg.version}: taken from {where} (built once for this key)")
        wheel, entry, digest = placed
        apart = _install_meanwhile(env, wheel, pkg, beside_install)
    else:
        apart = ()
        before_running()
        wheel = _compile(env, spec, lock, pkg, values, work, nvcc=nvcc, target=target,
                         progress=progress)  # fmt: skip
        if tiers.store is not None and _toolkit_as_recorded(k, pkg, spec, lock, env, values,
                                                             tiers, progress):  # fmt: skip
            seconds = time.monotonic() - started
            entry = _publish(tiers.store, k, wheel, pkg, env, target, seconds, progress)
            if entry is not None:
                _push(tiers, k, entry, progress)
        try:  # read in blocks (flash-attn's wheel is ~250 MB), never through a link
            digest = jit_store.sha256_file(wheel, trusted=False)[1]
        except jit_store.EntryError as exc:
            raise BuildError(f"{pkg.name} {pkg.version}: the built wheel: {exc}") from None
        _install(env, wheel, pkg)
    shutil.rmtree(work, ignore_errors=True)
    with contextlib.suppress(OSError):
        (env / WORK).rmdir()  # the last build's: an env keeps no empty scratch
    return SourceBuilt(
        name=pkg.name,
        version=pkg.version,
        wheel=wheel.name,
        sha256=digest,
        key=k,
        reused=placed is not None,
        entry=entry,
        seconds=round(time.monotonic() - started, 1),
        apart=apart,
    )


def _toolkit_as_recorded(
    k: str,
    pkg: LockedPackage,
    spec: EnvSpec,
    lock: Lock,
    env: Path,
    values: dict[str, str],
    tiers: _Tiers,
    progress: Callable[[str], None],
) -> bool:
    """Whether ``k``, looked up with the toolkit's RECORD digests, is also the key of the
    toolkit's real bytes (hashed now): a wheel is never kept under a key that names another
    toolkit than the one that built it (see store.recorded_tools)."""
    if not tiers.recorded or key(pkg, spec, lock, env, values, tiers.hasher) == k:
        return True
    progress(
        f"warning: {pkg.name}'s wheel was not kept in the JIT store: the toolkit's binaries "
        f"in {env / 'cuda-home'} are not what their wheels' RECORD says (changed since uv "
        "unpacked them)"
    )
    return False


def _from_tiers(
    tiers: _Tiers,
    k: str,
    env: Path,
    out: Path,
    pkg: LockedPackage,
    progress: Callable[[str], None],
) -> tuple[tuple[Path, Path, str] | None, str]:
    """The stored wheel of ``k`` placed into ``out``, its entry and its sha256: from the
    machine's store,
    else pulled from its registry tier (checked like any entry, signatures where the node
    asks)."""
    store = tiers.store
    if store is None:
        return None, ""
    placed = _from_store(store, k, env, out, pkg)
    if placed is not None or tiers.remote is None:
        return placed, "the store"
    from builder.jit import share as jit_share

    _entry, warning = jit_share.pull(store, k, str(env), tiers.remote)
    if warning:
        progress(f"warning: {warning}")
    return _from_store(store, k, env, out, pkg), f"the JIT remote {tiers.remote.url}"


def _push(tiers: _Tiers, k: str, kept: Path, progress: Callable[[str], None]) -> None:
    """The new entry pushed to the registry tier where this machine is a warmer."""
    from builder.jit import share as jit_share

    if tiers.store is None or tiers.remote is None or not jit_share.pushing():
        return
    try:
        entry = tiers.store.load(k, kept)
    except (jit_store.EntryError, jit_store.StoreError, OSError):
        return
    warning = jit_share.push(tiers.store, entry, tiers.remote)
    progress(f"warning: {warning}" if warning else f"pushed {k[:16]} to {tiers.remote.url}")


def last_build_seconds(pkg: LockedPackage) -> float | None:
    """How long the newest stored build of ``pkg`` took (any key), None when the store holds
    none or is off."""
    store = jit_store_here()
    if store is None:
        return None
    found: list[tuple[str, float]] = []
    with contextlib.suppress(jit_store.StoreError, OSError):
        for k, variant in store.all():
            try:
                entry = store.load(k, variant)
            except (jit_store.EntryError, jit_store.StoreError, OSError):
                continue
            content = entry.content
            if content.get("kind") != "wheel" or content.get("package") != pkg.name:
                continue
            seconds = content.get("seconds")
            if content.get("version") == pkg.version and isinstance(seconds, (int, float)):
                found.append((entry.provenance.get("first_built", ""), float(seconds)))
    return max(found)[1] if found else None


def _torch_input(env: Path) -> str | None:
    """The file of the env's torch a stored wheel's variant is judged by (its version file:
    the key holds the locked torch wheel, this holds the one installed)."""
    found = sorted(env.glob("lib/python3*/site-packages/torch/version.py"))
    return jit_store.normalise(str(found[0]), jit_store.env_roots(str(env))) if found else None


def _from_store(
    store: jit_store.Store, k: str, env: Path, out: Path, pkg: LockedPackage
) -> tuple[Path, Path, str] | None:
    """The stored wheel of key ``k`` placed into ``out`` (every byte checked: its sha256 is
    the entry's record, never read again), the entry it came from and that sha256, or None.
    An entry whose wheel is not this package's is discarded."""
    entry = None
    try:
        entry = store.find(k, str(env))
        if entry is None:
            return None
        name = str(entry.content.get("wheel_name"))
        if not _is_wheel_of(name, pkg):
            raise jit_store.EntryError(f"{name} is not a wheel of {pkg.name} {pkg.version}")
        dst = out / name
        store.place(entry, "wheel", dst)
        return dst, entry.path, entry.files["wheel"].sha256
    except jit_store.EntryError as exc:
        if entry is not None:
            store.discard(entry.path, str(exc))
        return None
    except (jit_store.StoreError, OSError):
        return None


def _is_wheel_of(name: str, pkg: LockedPackage) -> bool:
    from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

    try:
        dist, version, _build, _tags = parse_wheel_filename(name)
    except (InvalidWheelFilename, ValueError):
        return False
    return dist == canonicalize_name(pkg.name) and str(version) == pkg.version


def _publish(
    store: jit_store.Store,
    k: str,
    wheel: Path,
    pkg: LockedPackage,
    env: Path,
    target: Path,
    seconds: float,
    progress: Callable[[str], None],
) -> Path | None:
    torch_input = _torch_input(env)
    if torch_input is None:
        return None
    meta = {
        "kind": "wheel",
        "wheel_name": wheel.name,
        "package": pkg.name,
        "version": pkg.version,
        "seconds": round(seconds, 1),
        "env": str(target),
    }
    try:
        return store.publish(k, {"wheel": wheel}, [torch_input], meta, str(env))
    except (jit_store.StoreError, jit_store.EntryError, OSError) as exc:
        progress(f"warning: {pkg.name}'s wheel was not kept in the JIT store: {exc}")
        return None


def _compile(
    env: Path,
    spec: EnvSpec,
    lock: Lock,
    pkg: LockedPackage,
    values: dict[str, str],
    work: Path,
    *,
    nvcc: str,
    target: Path,
    progress: Callable[[str], None],
) -> Path:
    assert pkg.sdist is not None
    python = env / "bin" / "python"
    pip = bundled_pip(python)
    guard = Guard(env, work, in_use(env, target))  # the fetch's last record: the compile's first
    sdist = fetch_sdist(env, pip, pkg.name, pkg.version, (pkg.sdist.sha256,),
                        build_environ(env, spec, values), work, guard=guard)  # fmt: skip
    return compile_sdist(env, spec, pkg.name, pkg.version, sdist, values, work, pip=pip,
                         torch=lock.torch, nvcc=nvcc, target=target, progress=progress,
                         guard=guard)  # fmt: skip


def _install_meanwhile(
    env: Path, wheel: Path, pkg: LockedPackage, meanwhile: Callable[[Sequence[str]], None] | None
) -> tuple[str, ...]:
    """Install ``wheel`` (taken from the store: nothing compiles) while ``meanwhile`` runs: the
    proof of the lock's wheels, which no compile asked for yet, is ~0.1 s of ``lstat`` for a
    torch env and uv's install ~25 ms of another process, a fifth of what a second env or
    node adds for such a package. Only where everything the wheel writes goes into new
    top-level entries of site-packages (``meanwhile`` is told their names: they may appear
    while it lists the directory, and what they hold is the wheel's alone): a file the lock's
    wheels hold too, or one under ``bin/`` or the env's root (a ``.data`` scheme, an entry
    point's script), would be read by the proof half-way through being replaced. Else the
    install alone, and the proof after it (installproof.Proof). The entries added beside the
    proof, or none."""
    tops = _new_site_tops(env, wheel) if meanwhile is not None else None
    if meanwhile is None or tops is None:
        _install(env, wheel, pkg)
        return ()
    try:
        with proc.running(_install_argv(env, wheel), env=proc.uv_env(), timeout=INSTALL_TIMEOUT):
            meanwhile(tops)
    except proc.CommandFailed as exc:
        raise _install_failed(pkg, exc) from exc
    return tops


def _new_site_tops(env: Path, wheel: Path) -> tuple[str, ...] | None:
    """The entries of site-packages that installing ``wheel`` adds, or None where it writes
    anything else: into an entry already there, or outside site-packages (the ``scripts``,
    ``data`` and ``headers`` schemes of PEP 427's ``.data`` directory, the scripts an
    installer writes for ``entry_points.txt``)."""
    import zipfile

    site = toolchain.site_packages(env)
    tops: set[str] = set()
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return None  # uv says what is wrong with it
    infos = {name.split("/", 1)[0] for name in names if ".dist-info/" in name}
    if len(infos) != 1 or not next(iter(infos)).endswith(".dist-info"):
        return None  # uv says what is wrong with it
    # PEP 427: the wheel's own NAME-VERSION.data, not any top-level directory named so.
    data = next(iter(infos))[: -len(".dist-info")] + ".data"
    for name in names:
        parts = name.split("/")
        if parts[0] == data:
            if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                return None
            parts = parts[2:]
        if not parts[0] or parts[0] in (".", ".."):
            return None
        if parts[0].endswith(".dist-info") and parts[1:] == ["entry_points.txt"]:
            return None
        tops.add(parts[0])
    if any(os.path.lexists(site / top) for top in tops):
        return None
    return tuple(sorted(tops))


def _install(env: Path, wheel: Path, pkg: LockedPackage) -> None:
    try:
        proc.run(_install_argv(env, wheel), env=proc.uv_env(), timeout=INSTALL_TIMEOUT)
    except proc.CommandFailed as exc:
        raise _install_failed(pkg, exc) from exc


def _install_argv(env: Path, wheel: Path) -> list[str]:
    return [proc.uv_bin(), "pip", "install", "--quiet", "--no-deps", "--offline",
            "--python", str(env / "bin" / "python"), str(wheel)]  # fmt: skip


def _install_failed(pkg: LockedPackage, exc: proc.CommandFailed) -> BuildError:
    how = f"ran past {exc.timed_out:g} s" if exc.timed_out else "failed"
    return BuildError(
        f"{pkg.name} {pkg.version}: installing the wheel built from its sdist {how}: "
        f"{exc.output.strip()[-300:]}"
    )
