"""Lock -> venv. Built beside its final path and swapped in only when complete.

A failed or interrupted build leaves the previous env untouched: everything happens in
``.envs/.NAME.tmp-PID``; what uv installed there is proven against each distribution's
RECORD (``installproof.problems``), and only then is the finished tree exchanged with the
old one in one ``renameat2(RENAME_EXCHANGE)`` (or two renames where the kernel lacks it,
place.py), then the old tree is removed. A per-env ``flock`` keeps two builds of one env apart; the kernel drops it when
a builder dies, so a killed build never leaves a stale lock. Leftovers of a killed build
(``.NAME.tmp-*``, ``.NAME.old-*``) are removed by the next build of that env.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import errno
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

from builder import __version__
from builder.core import platforms, proc, settings
from builder.core.errors import BuildError
from builder.core.paths import envs_dir, project_root
from builder.core.reporter import Reporter, silent
from builder.env import hooks, installproof, manifest, sdistcheck, sourcebuild, toolchain
from builder.env.manifest import Manifest
from builder.env.place import (
    NO_SPACE_ERRNOS,
    build_lock,
    clean_leftovers,
    no_space,
    out_of_space,
    swap_into_place,
)
from builder.machine import archs, interpreters
from builder.machine.archs import Arch
from builder.spec.envspec import EnvSpec
from builder.spec.lock import Lock, LockedPackage

log = logging.getLogger("cudaenv")


Progress = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class BuildResult:
    path: Path
    manifest: Manifest
    reused: bool = False


@dataclass(frozen=True, kw_only=True)
class Source:
    """Where the lock's files come from: the configured index (default), or only a
    wheelhouse made by `cudaenv export`, with or without network."""

    wheelhouse: Path | None = None
    offline: bool = False


def up_to_date(
    target: Path,
    spec: EnvSpec,
    lock: Lock,
    env_archs: tuple[Arch, ...],
    platform: str | None = None,
    say: Progress | None = None,
) -> Manifest | None:
    """The manifest of ``target`` when it was built from exactly this lock, spec and archs
    (for ``platform``: assembled for that other machine), and, on this machine, still has
    every locked package installed (:func:`_not_installed`; ``say`` hears what is not)."""
    found = manifest.try_read(target)
    if found is None:
        return None
    if platform is not None:
        same = found.assembled and found.platform == platform
    else:
        same = not found.assembled and (target / "bin" / "python").exists()
    same = same and (
        found.lock_hash == lock.content_hash()
        and found.fingerprint == spec.fingerprint()
        and found.archs == env_archs
        and found.env == spec.env
        and found.build_env == spec.build_env
        and found.remote_cache == spec.remote_cache
        and found.cudaenv == __version__
    )
    if not same:
        return None
    changed = _not_installed(target, spec, lock, found) if platform is None else None
    if changed is not None:
        (say or (lambda _m: None))(
            f"{target} is not as it was built ({changed}): building it again"
        )
        return None
    return found


def _not_installed(target: Path, spec: EnvSpec, lock: Lock, found: Manifest) -> str | None:
    """What of the lock the env at ``target`` no longer has installed at its version (a
    package uninstalled or replaced by hand since the build), read from its ``.dist-info``
    directories; None where every locked package that applies here is there. "Up to date" is
    then said from the env itself, not from its manifest alone (a glob: ~1 ms)."""
    sites = sorted(target.glob("lib/python3*/site-packages"))
    if len(sites) != 1:
        return "its site-packages is not there"
    present: dict[str, str] = {}
    for info in sites[0].glob("*.dist-info"):
        name, _, version = info.name.removesuffix(".dist-info").rpartition("-")
        present[canonicalize_name(name)] = version
    marker_env = platforms.get(platforms.host_name()).marker_environment(spec.python)
    marker_env["python_full_version"] = found.python
    for pkg in lock.packages_on(platforms.host_name()):
        if not installproof.applies(pkg, marker_env):
            continue
        have = present.get(canonicalize_name(pkg.name))
        if have is None:
            return f"{pkg.name} {pkg.version} is not installed"
        if not installproof.same_version(have, pkg.version):
            return f"{pkg.name} is {have}, not {pkg.version}"
    return None


# What runs at each named stage of a build or adopt (:func:`fault_point`): nothing in use.
# The interruption tests start cudaenv with their own sitecustomize (tests/faults/), which adds
# the hook that holds the process at a stage so the test can kill it there.
FAULT_HOOKS: list[Callable[[str, Progress], None]] = []


def fault_point(name: str, progress: Progress) -> None:
    """The stage ``name`` is reached: each of :data:`FAULT_HOOKS` is told (none in use)."""
    for hook in FAULT_HOOKS:
        hook(name, progress)


def default_env_dir(spec: EnvSpec) -> Path:
    """Where the env of ``spec`` lives: in the envs dir of the project that holds the spec
    file, wherever the command runs (``cudaenv verify ~/proj/envspecs/x.yaml`` from another
    directory finds the env built in ~/proj); a spec outside any project keeps the current
    directory's."""
    # abspath, not resolve(): `..` is folded as the user typed it, a linked project kept.
    holder = project_root(Path(os.path.abspath(spec.source.parent)))  # noqa: PTH100
    return (envs_dir(holder) if holder is not None else envs_dir()) / spec.name


def check_lock(spec: EnvSpec, lock: Lock, lock_file: Path, platform: str | None = None) -> None:
    """The lock is this spec's current one and holds the target platform: this machine's, or
    ``platform`` (``build --platform``)."""
    if lock.fingerprint != spec.fingerprint():
        raise BuildError(
            f"{lock_file} was made from another version of {spec.source} (fingerprint "
            f"{lock.fingerprint[:19]}... != {spec.fingerprint()[:19]}...); re-lock with "
            f"`cudaenv lock {spec.source}`"
        )
    want = platform or platforms.host_name()
    if want not in lock.platforms:
        which = f"{want} (--platform)" if platform else f"this machine ({want})"
        raise BuildError(
            f"{lock_file} is locked for {', '.join(lock.platforms)}, not for {which}: add "
            f"{want} to `platforms:` in {spec.source} and re-lock"
        )


# --------------------------------------------------------------------------- build


def build(
    spec: EnvSpec,
    lock: Lock,
    *,
    lock_file: Path,
    env_dir: Path | None = None,
    force: bool = False,
    source: Source | None = None,
    platform: str | None = None,
    reporter: Reporter | None = None,
) -> BuildResult:
    """Build the env of ``spec`` from ``lock``; with ``platform`` (another machine's than
    this one), assemble its files for that machine instead (:func:`_assemble_into`). The
    reporter gets the progress lines and, as the build goes, what an interrupt would leave."""
    reporter = reporter or silent()
    progress: Progress = reporter
    source = source or Source()
    if platform == platforms.host_name():
        platform = None
    check_lock(spec, lock, lock_file, platform)
    if platform is not None and spec.toolchain.source != "wheels":
        raise BuildError(
            f"{spec.source}: a system toolkit ({spec.toolchain.path}) is this machine's; only "
            "a wheel toolchain can be assembled for another platform"
        )

    def stage(name: str, started: float) -> None:
        progress(f"{name}: {time.monotonic() - started:.1f} s")

    if spec.toolchain.source == "system" and platform is None:
        t = time.monotonic()
        release = toolchain.check_system_toolkit(spec)
        stage(f"system toolkit {spec.toolchain.path} is CUDA {release}", t)
    target = (env_dir or default_env_dir(spec)).absolute()
    if target.is_symlink():
        raise BuildError(
            f"{target} is a symlink (to {target.readlink()}); cudaenv replaces env directories "
            "whole and will not follow or replace a link: remove it or pass --env-dir"
        )
    with build_lock(target, progress):
        for path in clean_leftovers(target):
            progress(f"removed leftover {path}")
        env_archs = archs.env_archs(spec.archs, spec.cuda_version)
        current = up_to_date(target, spec, lock, env_archs, platform, say=progress)
        if current is not None and not force:
            progress(
                f"{target} is up to date with {lock_file.name} (lock {lock.content_hash()[:19]}...)"
            )
            return BuildResult(path=target, manifest=current, reused=True)
        if platform is None and not source.offline:
            # What an sdist says of itself is said before uv installs anything (a release that
            # cannot build was refused only after the whole lock was installed).
            sdistcheck.refuse(lock.packages_on(platforms.host_name()), torch=lock.torch,
                              nvcc=spec.cuda, lock_dir=lock_file.parent, say=progress,
                              done="nothing was installed")  # fmt: skip
        interp = None
        if platform is None:
            t = time.monotonic()
            interp = interpreters.find(spec.python, allow_download=not source.offline)
            stage(f"python {interp.version} ({interp.path}, found by {interp.found_by})", t)
        reporter.leaves(f"{target}: the previous env (if any) is untouched")
        tmp = _new_tree(target)
        try:
            job = _Job(spec=spec, lock=lock, tmp=tmp, target=target, env_archs=env_archs,
                       stage=stage, progress=progress, source=source)  # fmt: skip
            result = _make(job, interp, platform)
            fault_point("swap", progress)
            t = time.monotonic()
            old = swap_into_place(tmp, target)
            reporter.leaves(f"{target} is the new env, complete (built from {lock_file.name})")
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            fault_point("swapped", progress)
            stage(f"swapped into {target}", t)
        except BaseException:
            # Whatever stopped us (error, Ctrl-C, SIGTERM turned into an exception by the
            # CLI), the previous env is untouched; only our own tree goes.
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return BuildResult(path=target, manifest=result)


def _new_tree(target: Path) -> Path:
    """The directory a build of ``target`` fills, beside it (so the swap is one rename)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    # mkdtemp makes it 0700; an env is as readable as any directory the user creates.
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    return tmp


def _make(job: _Job, interp: interpreters.Interpreter | None, platform: str | None) -> Manifest:
    """Build the env in ``job.tmp`` with ``interp``, or assemble it for ``platform``; a full
    disk or quota is said as such (where, how much room), not as the step that met it."""
    try:
        if interp is not None:
            return _build_into(job, interp)
        assert platform is not None
        return _assemble_into(job, platforms.get(platform))
    except OSError as exc:
        if exc.errno in NO_SPACE_ERRNOS:
            quota = exc.errno == errno.EDQUOT
            raise BuildError(no_space(job.tmp, job.target, quota=quota)) from exc
        raise
    except proc.CommandFailed as exc:
        # uv venv, the hook's self-check: a full disk is said as such, not as the command
        # that met it.
        if out_of_space(exc.output):
            raise BuildError(no_space(job.tmp, job.target, said=exc.output)) from exc
        raise


@dataclass(frozen=True, kw_only=True)
class _Job:
    """One env being made in ``tmp`` (to be swapped in at ``target``)."""

    spec: EnvSpec
    lock: Lock
    tmp: Path
    target: Path
    env_archs: tuple[Arch, ...]
    stage: Callable[[str, float], None]  # report a finished stage and its start time
    progress: Progress
    source: Source


def _build_into(job: _Job, interp: interpreters.Interpreter) -> Manifest:
    spec, lock, tmp, stage, progress = job.spec, job.lock, job.tmp, job.stage, job.progress
    source, env_archs = job.source, job.env_archs
    uv = proc.uv_bin()
    t = time.monotonic()
    # --relocatable: built here, used at `target` after the swap (entry points and activate
    # find their env at run time instead of baking the temporary path in).
    proc.run(
        [uv, "venv", "--quiet", "--relocatable", "--python", str(interp.path), str(tmp / "venv")],
        env=proc.uv_env(),
    )
    venv = tmp / "venv"
    # The venv lives one level down only while building so the tmp dir holds nothing else;
    # move its contents up so `target` is the venv itself.
    for child in venv.iterdir():
        child.rename(tmp / child.name)
    venv.rmdir()
    stage("venv", t)
    t = time.monotonic()
    venv_made = sorted(p.name for p in toolchain.site_packages(tmp).iterdir())
    req = tmp / "var" / "requirements.lock.txt"
    req.parent.mkdir(parents=True, exist_ok=True)
    # What compiles at install is built after the toolkit is wired (sourcebuild.py); uv
    # installs the rest, and would build an sdist in an isolated env with any nvcc.
    compiled = sourcebuild.source_packages(lock.packages_on(platforms.host_name()))
    req.write_text(sourcebuild.wheels_only(lock).requirements_txt(platforms.host_name()))
    packages = [p for p in lock.packages_on(platforms.host_name()) if p not in compiled]
    progress(f"installing {len(packages)} packages from the lock of {spec.name} (hashes required)")
    if compiled:
        sourcebuild.client_ahead(spec)
    try:
        argv = [uv, "pip", "sync", "--python", str(tmp / "bin" / "python"), *install_argv(source)]
        if not _sync_from_cache(argv, req):
            proc.run([*argv, str(req)], env=proc.uv_env(), stream=True)
    except proc.CommandFailed as exc:
        if out_of_space(exc.output):
            raise BuildError(no_space(tmp, job.target, said=exc.output)) from exc
        raise BuildError(
            # uv's messages were shown as it ran (streamed): not repeated here.
            f"{spec.name}: installing the lock failed (uv's messages above)"
        ) from exc
    stage(f"install {len(packages)} packages", t)
    t = time.monotonic()
    marker_env = platforms.get(platforms.host_name()).marker_environment(spec.python)
    marker_env["python_full_version"] = interp.version
    site = toolchain.site_packages(tmp)
    proof = installproof.Proof(site, tmp, spec.name, marker_env, venv_made, packages, job.stage)
    if not compiled:
        proof.lock(started=t)
    t = time.monotonic()
    fault_point("overlay", progress)
    if spec.toolchain.source == "wheels":
        overlay = toolchain.wheel_overlay(tmp, spec)
    else:
        overlay = toolchain.system_overlay(tmp, spec)
    fault_point("hooks", progress)
    before = {p.name for p in site.iterdir()}
    hooks.write_hooks(tmp, spec, env_archs)
    hooks.write_pip_guard(tmp, spec)
    proof.made_before += sorted({p.name for p in site.iterdir()} - before)  # the hook's
    note = hooks.remote_cache_note(tmp, spec)
    if note is not None:
        progress(note)
    stage(f"cuda-home overlay (nvcc {overlay.nvcc_release}) and start-up hook", t)
    made = _build_sources(job, compiled, overlay.nvcc_release, proof)
    packages = [*packages, *compiled]
    t = time.monotonic()
    _check_hook(tmp)
    built = _manifest(
        job, packages, overlay.nvcc_release, python=interp.version, platform=platforms.host_name()
    )
    built = dataclasses.replace(
        built,
        source_builds=tuple((m.name, m.version, m.sha256, m.key) for m in made),
        build_env=spec.build_env,
    )
    manifest.write(built, tmp)
    sourcebuild.note_uses(tmp, made)
    stage("manifest and hook self-check", t)
    return built


def _build_sources(
    job: _Job, compiled: Sequence[LockedPackage], nvcc: str, proof: installproof.Proof
) -> tuple[sourcebuild.SourceBuilt, ...]:
    """Build (or take from the store) the packages that compile at install, then prove their
    install: the env's toolkit and hook are in place by now (sourcebuild.py); the lock's
    wheels are proven before the first compile runs, else beside or with them
    (installproof.Proof)."""
    if not compiled:
        return ()
    t = time.monotonic()
    made = sourcebuild.build_all(
        job.tmp, job.spec, job.lock, compiled, nvcc=nvcc, target=job.target,
        progress=job.progress, before_running=proof.lock, beside_install=proof.beside_install,
    )  # fmt: skip
    proof.rest(compiled, [m.apart for m in made])
    job.stage(f"{len(compiled)} package(s) built from source and proven", t)
    return made


def _manifest(
    job: _Job,
    packages: Sequence[LockedPackage],
    nvcc: str,
    *,
    python: str,
    platform: str,
    assembled: bool = False,
) -> Manifest:
    """What the env built (or assembled) at ``job.target`` from ``job.lock`` is."""
    spec, lock, env_archs, target = job.spec, job.lock, job.env_archs, job.target
    return Manifest(
        name=spec.name,
        spec=str(spec.source),
        fingerprint=spec.fingerprint(),
        lock_hash=lock.content_hash(),
        python=python,
        cuda=spec.cuda,
        torch=lock.torch,
        torch_cuda=lock.torch_cuda,
        toolkit=lock.toolkit,
        nvcc=nvcc,
        toolchain_source=spec.toolchain.source,
        archs=env_archs,
        spec_archs=spec.archs,
        packages=tuple((p.name, p.version) for p in packages),
        env=spec.env,
        remote_cache=spec.remote_cache,
        built_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        cudaenv=__version__,
        path=str(target),
        platform=platform,
        assembled=assembled,
    )


def _sync_from_cache(argv: Sequence[str], req: Path) -> bool:
    """Install the lock from uv's cache alone (``--offline``), when every file is there.

    Every line of the requirements names an exact version and its hashes, so the index has
    nothing to add to what uv already holds: online, uv still revalidates each package's
    index page (~0.6 s for the default stack's 207, most of a warm build's own time). Any
    failure (a file not in the cache, an index page never fetched) says nothing: the
    caller installs online, streaming uv's messages as usual. uv's output of a successful
    run is replayed, as the online run would have shown it."""
    if "--offline" in argv or "--no-index" in argv:
        return False
    try:
        done = proc.run([*argv, "--offline", str(req)], env=proc.uv_env())
    except proc.CommandFailed as exc:
        if out_of_space(exc.output):
            # Not a cache miss: installing online would meet the same full disk, or worse,
            # find the half-copied packages "installed" and exit 0 (the caller says it).
            raise
        log.debug("not all of the lock is in uv's cache; installing online: %s", exc)
        return False
    sys.stderr.write(done.stderr)
    sys.stderr.flush()
    return True


def install_argv(source: Source) -> list[str]:
    """Where uv takes the lock's files from: the index, or only an exported wheelhouse."""
    argv = ["--require-hashes"]
    if source.wheelhouse is not None:
        # Only the exported files: no index is asked, hashes still checked (export.py).
        argv += ["--no-index", "--find-links", str(source.wheelhouse)]
    if source.offline:
        argv.append("--offline")
    return argv


def _assemble_into(job: _Job, platform: platforms.Platform) -> Manifest:
    """The files of the env for another machine, none of them run: the lock's wheels for
    ``platform`` unpacked hash-checked into ``lib/pythonX.Y/site-packages`` (uv
    ``--python-platform`` + ``--target``), the ``cuda-home/`` overlay, the start-up hook, and
    a manifest marked ``assembled``. Exit 0 only if :func:`toolchain.assembly_problems` finds
    nothing. There is no interpreter: on that machine ``pythonX.Y -m venv DIR`` adds one."""
    spec, lock, tmp, stage, progress = job.spec, job.lock, job.tmp, job.stage, job.progress
    source, env_archs = job.source, job.env_archs
    uv = proc.uv_bin()
    t = time.monotonic()
    site = tmp / "lib" / f"python{spec.python}" / "site-packages"
    site.mkdir(parents=True)
    req = tmp / "var" / "requirements.lock.txt"
    req.parent.mkdir(parents=True, exist_ok=True)
    req.write_text(lock.requirements_txt(platform.name))
    packages = lock.packages_on(platform.name)
    compiled = sourcebuild.source_packages(packages)
    if compiled:
        raise BuildError(
            f"{spec.name}: {', '.join(p.name for p in compiled)} compile(s) at install, which "
            f"only an env built on {platform.name} itself can do (an assembled env runs nothing)"
        )
    progress(
        f"unpacking {len(packages)} packages of the lock of {spec.name} for {platform.name} "
        "(hashes required; nothing is run)"
    )
    argv = [uv, "pip", "install", "--quiet", "--no-deps", "--target", str(site),
            "--python-platform", platform.uv_tag, "--python-version", spec.python,
            *install_argv(source), "-r", str(req)]  # fmt: skip
    try:
        proc.run(argv, env=proc.uv_env(), stream=True)
    except proc.CommandFailed as exc:
        if out_of_space(exc.output):
            raise BuildError(no_space(tmp, job.target, said=exc.output)) from exc
        raise BuildError(
            f"{spec.name}: unpacking the lock for {platform.name} failed (uv's messages above)"
        ) from exc
    stage(f"unpack {len(packages)} packages for {platform.name}", t)
    t = time.monotonic()
    # uv locks a --target directory with an empty `.lock` it leaves there (no RECORD has it).
    marker_env = platform.marker_environment(spec.python)
    installproof.prove(site, tmp, spec.name, packages, marker_env, [".lock"])
    overlay = toolchain.wheel_overlay(tmp, spec, platform)
    hooks.write_hooks(tmp, spec, env_archs)
    problems = toolchain.assembly_problems(tmp, platform)
    if problems:
        raise BuildError(
            f"{spec.name}: the env assembled for {platform.name} is not usable there: "
            + "; ".join(problems)
        )
    stage(f"cuda-home overlay (nvcc {overlay.nvcc_release}, {platform.name} ELF files checked)", t)
    built = _manifest(
        job, packages, overlay.nvcc_release, python=spec.python, platform=platform.name,
        assembled=True,
    )  # fmt: skip
    manifest.write(built, tmp)
    return built


def _check_hook(venv: Path) -> None:
    """The start-up hook must win over a CUDA_HOME exported by the shell."""
    env = settings.child_environ(CUDA_HOME="/nonexistent/cudaenv-probe")
    env.pop("CUDAENV_NO_HOOK", None)
    done = proc.run(
        [venv / "bin" / "python", "-c", "import os; print(os.environ.get('CUDA_HOME', ''))"],
        env=env,
        timeout=60,
    )
    got = done.stdout.strip()
    if os.path.realpath(got) != os.path.realpath(venv / "cuda-home"):
        raise BuildError(f"{venv}: the start-up hook did not set CUDA_HOME (got {got!r})")
