"""``cudaenv adopt``: give an env the user already has the toolchain torch is built for.

Where a user stands: a working venv (uv, venv/pip, virtualenv) or conda env with torch and
FlashInfer, a system ``/usr/local/cuda`` of another release, and a JIT that cannot build.
Adopt reads torch's CUDA from the env itself (torch's own ``cuda-toolkit`` pin), installs the
matching toolkit components with uv into that env (realigning drifted ones: nvcc 13.5 and
cccl 13.3 beside runtime 13.0, flashinfer#3493), then adds what a built env has: the
``cuda-home/`` overlay, the start-up hook, the ``activate`` block, the JIT caches in ``var/``
and a manifest.
Every change is journalled first and undone on failure (builder/adopt/journal.py: the
journal, the env's lock, undo). The start-up hook's ``.pth`` is written last, so until the
very end the interpreter behaves as before. Adopt never touches an env whose cudaenv files it
cannot account for: one ``cudaenv build`` made (its build manages it) or one holding cudaenv's
files without a journal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from builder import __version__
from builder.adopt.journal import (
    JOURNAL,
    Env,
    Journal,
    Progress,
    Refused,
    activation_scripts,
    atomic_leftovers,
    cudaenv_files,
    inspect,
    locked,
    nvidia_files,
    read_journal,
    site_tree,
    tidy,
    undo,
    why,
    write_journal,
)
from builder.core import platforms, proc
from builder.core.cudaversion import CudaVersion
from builder.core.errors import BuildError, CudaenvError
from builder.env import caches, hooks, manifest, toolchain
from builder.env.build import fault_point
from builder.env.manifest import Manifest
from builder.machine import archs, driver, toolkits
from builder.machine.archs import Arch
from builder.spec import channels, policy
from builder.spec.envspec import DEFAULT_COMPONENTS, EnvSpec, Toolchain


@dataclass(frozen=True, kw_only=True)
class Plan:
    env: Env
    cuda: str
    requirements: tuple[str, ...]  # what uv installs ("" for a system toolkit)
    changes: tuple[tuple[str, str | None, str | None], ...]  # name, before, after
    system_toolkit: Path | None
    spec: EnvSpec
    files: tuple[str, ...] = field(default=())
    # Installed again even at the same version (uv --reinstall-package): cuda-bindings, whose
    # files a cuda-python of another major overwrote.
    reinstall: tuple[str, ...] = field(default=())

    def lines(self) -> list[str]:
        out = [f"adopt {self.env.prefix}: torch {self.env.torch} is built for CUDA {self.cuda}"]
        if self.system_toolkit is not None:
            out.append(f"  toolkit: the machine's {self.system_toolkit} (CUDA {self.cuda})")
        for name, before, after in self.changes:
            verb = "install" if before is None else ("remove" if after is None else "replace")
            what = (
                after if before is None else (before if after is None else f"{before} -> {after}")
            )
            out.append(f"  {verb} {name} {what}")
        if not self.changes and self.system_toolkit is None:
            out.append("  packages: nothing to install, the toolkit already matches")
        out += [f"  add {f}" for f in self.files]
        return out


def torch_pin(env: Env) -> tuple[str, str] | None:
    """(name, version) of the CUDA package torch pins exactly on this platform:
    ``cuda-toolkit`` (torch >= 2.10) or ``nvidia-cuda-runtime*`` (older)."""
    marker_env: dict[str, str] = {str(k): str(v) for k, v in default_environment().items()}
    marker_env["python_version"] = env.version
    host = platforms.KNOWN.get(platforms.host_name())
    if host is not None:
        marker_env.update(host.marker_environment(env.version))
    for text in env.torch_requires:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({**marker_env, "extra": ""}):
            continue
        name = req.name.lower()
        if name == "cuda-toolkit" or name.startswith("nvidia-cuda-runtime"):
            pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
            if pins:
                return name, pins[0]
    return None


# Where a CUDA 12 env's toolkit may be, after the env's own CUDA_HOME.
SYSTEM_TOOLKITS = ("/usr/local/cuda-{cuda}", "/usr/local/cuda")


def _system_toolkit(cuda: str, env: Env) -> Path | None:
    """A toolkit on this machine whose nvcc is CUDA ``cuda`` (CUDA 12 has no pip nvcc)."""
    candidates = [env.cuda_home, *(c.format(cuda=cuda) for c in SYSTEM_TOOLKITS)]
    for text in dict.fromkeys(c for c in candidates if c):
        path = Path(text)
        if (path / "bin" / "nvcc").exists():
            with contextlib.suppress(CudaenvError):
                if toolkits.nvcc_release(path) == cuda:
                    return path
    return None


def _refuse(env: Env, why: str) -> Refused:
    return Refused(f"{env.python}: {why}; nothing was changed")


def _built_by(prefix: Path) -> str | None:
    """The spec of an env ``cudaenv build`` made (its manifest names one), else None."""
    found = manifest.try_read(prefix)
    return found.spec if found is not None and found.spec != manifest.ADOPTED_SPEC else None


def preflight(env: Env) -> None:
    """Refused where adopt must not start: an env ``cudaenv build`` made (its spec and build
    manage its toolchain; adopt's rollback would remove the build's wiring), cudaenv's files
    with no adopt journal to account for them (undoing a failure would remove what adopt did
    not write), or a place adopt writes that this user cannot."""
    spec = _built_by(env.prefix)
    if spec is not None:
        raise _refuse(
            env,
            f"{env.prefix} was built by cudaenv from {spec} (its {manifest.FILE}); "
            f"`cudaenv build {spec} --force` rebuilds it, adopt would unwire it",
        )
    if read_journal(env.prefix) is None:
        present = cudaenv_files(env.prefix, env.purelib)
        if present:
            raise _refuse(
                env,
                f"{env.prefix} holds cudaenv's {', '.join(present)} but no adopt journal "
                f"({JOURNAL}) says what they replaced; remove them, then adopt",
            )
    places = [
        env.prefix,
        env.prefix / "bin",
        env.purelib,
        env.prefix / "var",
        env.prefix / "var" / "cudaenv",
    ]
    for place in places:
        if place.exists() and not os.access(place, os.W_OK):
            raise _refuse(env, f"{place} is not writable by this user (a read-only env?)")


def nothing_to_undo(env: Env) -> str:
    """What ``--undo`` says of an env with no adopt journal; Refused where cudaenv's files are
    there all the same (no journal says what they replaced, so undo cannot put it back)."""
    spec = _built_by(env.prefix)
    if spec is not None:
        return (
            f"nothing to undo: {env.prefix} was built by cudaenv from {spec}, not adopted "
            f"(`cudaenv build {spec}` manages it)"
        )
    present = cudaenv_files(env.prefix, env.purelib)
    if present:
        raise _refuse(
            env,
            f"it holds cudaenv's {', '.join(present)} but no adopt journal ({JOURNAL}) says "
            "what they replaced, so undo cannot put it back; remove them by hand",
        )
    tidy(env.prefix)  # the lock file of a run killed before or after its journal
    return f"nothing to undo: {env.prefix} has no adopt journal ({JOURNAL}); it is not adopted"


def plan(env: Env, *, env_archs: tuple[Arch, ...] | None = None, force: bool = False) -> Plan:
    """What adopt will do, or Refused naming why it will not (nothing is changed either way)."""
    preflight(env)
    if not env.is_env and not force:
        raise _refuse(
            env,
            "not inside a virtual environment or conda env (a system or distro Python); "
            "pass --force to change it anyway",
        )
    if env.torch is None:
        raise _refuse(env, "no torch here: adopt matches the toolkit to torch's CUDA")
    if not env.torch_cuda:
        raise _refuse(
            env,
            f"torch {env.torch} is a CPU-only build (torch.version.cuda is None): no CUDA to match",
        )
    cuda = env.torch_cuda
    try:
        version = CudaVersion.parse(cuda)
    except ValueError:
        raise _refuse(
            env,
            f"torch {env.torch} reports torch.version.cuda = {cuda!r}, not a CUDA major.minor "
            'like "13.0": no CUDA to match',
        ) from None
    components = list(DEFAULT_COMPONENTS)
    if "flashinfer-python" in env.dists:
        components.append("curand")  # FlashInfer's sampling kernels include <curand.h>
    chosen = env_archs or archs.DEFAULT_ARCHS
    if env_archs is None and archs.cuda_problems(version, chosen):
        # 12.0f needs CUDA 12.9; before it, the arch-specific 12.0a is what nvcc knows.
        chosen = tuple(dataclasses.replace(a, suffix="a") for a in chosen)
    problems = archs.cuda_problems(version, chosen)
    if problems:
        raise _refuse(env, "; ".join(problems) + " (name the archs with --archs)")
    spec = EnvSpec(
        name=f"adopted-{env.prefix.name}",
        python=env.version,
        cuda=cuda,
        source=env.prefix / "cudaenv-adopted",
        archs=chosen,
        toolchain=Toolchain(source="wheels", components=tuple(components)),
    )
    bindings = policy.binding_repair(env.dists, version.major)
    # Installed again even at the same version: files a cuda-python of another major
    # shared with it go when that cuda-python does.
    reinstall = ("cuda-bindings",) if bindings else ()
    if not channels.has_pip_nvcc(version.major):
        toolkit = _system_toolkit(cuda, env)
        if toolkit is None:
            raise _refuse(
                env,
                f"torch {env.torch} is built for CUDA {cuda}, which has no nvcc on PyPI, and no "
                f"CUDA {cuda} toolkit is on this machine (CUDA_HOME, /usr/local/cuda-{cuda}): "
                f"install CUDA {cuda} there",
            )
        spec = dataclasses.replace(spec, toolchain=Toolchain(source="system", path=toolkit))
        changes = _dry_run(env, bindings, reinstall) if bindings else ()
        return Plan(env=env, cuda=cuda, requirements=bindings, changes=changes,
                    system_toolkit=toolkit, spec=spec, files=_files(env),
                    reinstall=reinstall)  # fmt: skip
    pin = torch_pin(env)
    extras = channels.toolkit_extras(tuple(components))
    if pin is not None and pin[0] == "cuda-toolkit":
        requirements: tuple[str, ...] = (f"cuda-toolkit[{extras}]=={pin[1]}",)
    else:
        requirements = (f"cuda-toolkit[{extras}]>={cuda},<{version.next_minor()}",)
        if pin is not None:
            requirements += (f"{pin[0]}=={pin[1]}",)
    requirements += bindings
    changes = _dry_run(env, requirements, reinstall)
    return Plan(env=env, cuda=cuda, requirements=requirements, changes=changes,
                system_toolkit=None, spec=spec, files=_files(env),
                reinstall=reinstall)  # fmt: skip


def _files(env: Env) -> tuple[str, ...]:
    return (
        "cuda-home/ (the toolkit in CUDA_HOME's shape)",
        f"{env.purelib.relative_to(env.prefix)}/{hooks.HOOK_MODULE}.py and {hooks.PTH_NAME}",
        "bin/activate and each other shell's activation script the env has: the cudaenv block",
        f"var/: the JIT caches ({len(caches.CACHES)} directories) and var/cudaenv/",
        manifest.FILE,
    )


def _reinstall_args(names: Sequence[str]) -> list[str]:
    return [arg for name in names for arg in ("--reinstall-package", name)]


_CHANGE = re.compile(r"^\s*([+-])\s+([A-Za-z0-9._-]+)==(\S+)")


def _dry_run(
    env: Env, requirements: Sequence[str], reinstall: Sequence[str] = ()
) -> tuple[tuple[str, str | None, str | None], ...]:
    argv = [
        proc.uv_bin(),
        "pip",
        "install",
        "--dry-run",
        "--python",
        str(env.python),
        *_reinstall_args(reinstall),
        *requirements,
    ]
    try:
        done = proc.run(argv, env=proc.uv_env(), timeout=1800)
    except proc.CommandFailed as exc:
        lines = [ln for ln in exc.output.strip().splitlines() if ln.strip()][-15:]
        raise _refuse(
            env,
            "uv cannot install the matched toolkit without breaking what this env pins:\n"
            + "\n".join(lines),
        ) from exc
    before: dict[str, str] = {}
    after: dict[str, str] = {}
    for line in (done.stdout + "\n" + done.stderr).splitlines():
        m = _CHANGE.match(line)
        if m:
            (before if m.group(1) == "-" else after)[m.group(2).lower()] = m.group(3)
    names = sorted(set(before) | set(after))
    return tuple((n, before.get(n), after.get(n)) for n in names)


# --------------------------------------------------------------------------- apply


def apply(p: Plan, progress: Progress) -> Manifest:
    """Adopt as planned, with :func:`locked` held. Anything that stops it midway (an error,
    Ctrl-C, SIGTERM) undoes what was done before it is raised again; an error then says
    whether the env is as it was."""
    env = p.env
    # Again, under the lock: the env may have changed since the plan was made.
    preflight(env)
    if read_journal(env.prefix) is not None:
        raise _refuse(env, f"it has an adopt journal ({JOURNAL}): undo that adopt first")
    var_before = sorted(str(c.relative_to(env.prefix)) for c in (env.prefix / "var").glob("*")) if (
        env.prefix / "var").is_dir() else []  # fmt: skip
    fault_point("adopt-start", progress)
    for tmp in atomic_leftovers(env.prefix):  # a run killed mid-write, before its journal
        tmp.unlink()
    journal = _journal(p, var_before)
    try:
        write_journal(env.prefix, journal)
        fault_point("adopt-journal", progress)
        _install(p, progress)
        fault_point("adopt-overlay", progress)
        env_archs = archs.env_archs(p.spec.archs, p.spec.cuda_version)
        if p.system_toolkit is None:
            overlay = toolchain.wheel_overlay(env.prefix, p.spec)
        else:
            overlay = toolchain.system_overlay(env.prefix, p.spec)
        fault_point("adopt-hooks", progress)
        hooks.write_hooks(env.prefix, p.spec, env_archs)
        built = _adopted_manifest(p, overlay.nvcc_release, env_archs)
        fault_point("adopt-manifest", progress)
        manifest.write(built, env.prefix)
        fault_point("adopt-done", progress)
        write_journal(env.prefix, dataclasses.replace(journal, state="done"))
        return built
    except BaseException as exc:
        rollback = _roll_back(env, progress)
        if rollback is not None:
            raise BuildError(
                f"adopting {env.prefix} failed ({why(exc)}) and undoing it failed too "
                f"({rollback}): `cudaenv adopt --undo --python {env.python}` finishes the undo"
            ) from exc
        if isinstance(exc, OSError):
            raise BuildError(f"{why(exc)}; {env.prefix} is as it was before adopt") from exc
        raise


def _journal(p: Plan, var_before: Sequence[str]) -> Journal:
    """The journal of an adopt about to start: the env as it is now, so that undo can put
    back everything apply may change."""
    env = p.env
    return Journal(
        state="started",
        python=str(env.python),
        before=tuple(env.dists.items()),
        changes=p.changes,
        # Every activation script write_hooks may change, as it was: undo puts each back.
        activation=tuple(
            (name, path.read_text()) for name, path in activation_scripts(env.prefix).items()
        ),
        var_before=tuple(var_before),
        var_existed=(env.prefix / "var").exists(),
        started_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        broken_before=env.broken,
        site_before=site_tree(env.purelib),
        nvidia_before=nvidia_files(env.purelib),
    )


def _install(p: Plan, progress: Progress) -> None:
    """The planned toolkit components into the env, with uv, as the plan's dry run resolved them."""
    if not p.requirements:
        return
    env = p.env
    progress(f"installing {', '.join(p.requirements)} into {env.prefix} with uv")
    argv = [proc.uv_bin(), "pip", "install", "--python", str(env.python),
            *_reinstall_args(p.reinstall), *p.requirements]  # fmt: skip
    try:
        proc.run(argv, env=proc.uv_env(), stream=True, timeout=3600)
    except proc.CommandFailed as exc:
        raise BuildError(f"installing the toolkit failed:\n{exc.output.strip()[-2000:]}") from exc


def _adopted_manifest(p: Plan, nvcc: str, env_archs: tuple[Arch, ...]) -> Manifest:
    """The manifest of the adopted env; its packages are read back from the env as uv left
    it, not taken from the plan."""
    env = p.env
    after = inspect(env.python).dists
    return Manifest(
        name=p.spec.name,
        spec=manifest.ADOPTED_SPEC,
        fingerprint="adopted",
        lock_hash="sha256:"
        + hashlib.sha256(json.dumps(after, sort_keys=True).encode()).hexdigest(),
        python=env.version,
        cuda=p.cuda,
        torch=env.torch,
        torch_cuda=env.torch_cuda,
        toolkit=next(
            (v for n, _, v in p.changes if n == "cuda-toolkit" and v),
            env.dists.get("cuda-toolkit"),
        ),
        nvcc=nvcc,
        toolchain_source=p.spec.toolchain.source,
        archs=env_archs,
        spec_archs=p.spec.archs,
        packages=tuple(sorted(after.items())),
        env=(),
        built_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        cudaenv=__version__,
        path=str(env.prefix),
        platform=platforms.host_name(),
    )


def _roll_back(env: Env, progress: Progress) -> str | None:
    """Undo a failed adopt; None when the env is as it was, else why not (the journal stays
    for ``--undo``)."""
    try:
        if read_journal(env.prefix) is not None:
            undo(env.prefix, env.python, progress)
        else:
            # The journal itself could not be written (it makes no directory): at most its
            # temporary file is there.
            for tmp in atomic_leftovers(env.prefix):
                tmp.unlink(missing_ok=True)
    except Exception as exc:  # reported with the failure it was undoing
        return why(exc)
    return None


# --------------------------------------------------------------------------- the command


@dataclass(frozen=True, kw_only=True)
class AdoptRequest:
    """What `cudaenv adopt` takes (its ``--undo`` is :func:`undo_adopt`)."""

    python: Path  # the env's interpreter
    given: str  # --python as the user typed it, for the commands a message suggests
    env_archs: tuple[Arch, ...] | None = None
    dry_run: bool = False
    force: bool = False
    driver_check: bool = True
    # --rebuild: packages compiled at install to build again against the matched toolkit.
    rebuild: tuple[str, ...] = ()
    build_env: tuple[tuple[str, str], ...] = ()  # --build-env: variables for those compiles


def adopt(request: AdoptRequest, progress: Progress, show: Progress) -> Manifest | None:
    """Adopt the env (``show`` the plan), under its lock from reading its journal to the last
    change; an adopt a kill left unfinished is undone first. None where nothing was adopted
    now: a dry run, or an env adopted already."""
    python = request.python
    found = inspect(python)
    if not request.dry_run:
        preflight(found)  # a read-only env named as such, not by the lock it cannot make
    # A dry run changes nothing, so it takes no lock (which would add the lock file).
    with contextlib.nullcontext() if request.dry_run else locked(found.prefix, progress):
        if not request.dry_run:
            found = inspect(python)  # as it is now that no other adopt changes it
        journal = read_journal(found.prefix)
        if journal is not None and journal.state == "done" and request.rebuild:
            return _rebuild(request, found, journal, progress, show)
        if journal is not None and journal.state == "done":
            progress(
                f"{found.prefix} is adopted already; `cudaenv adopt --undo --python "
                f"{request.given}` first to adopt it again"
            )
            return None
        if journal is not None and request.dry_run:
            progress(f"a previous adopt of {found.prefix} did not finish: adopt undoes it first")
        elif journal is not None:
            # A run killed outright: put the env back as it was, then adopt from there.
            progress(f"a previous adopt of {found.prefix} did not finish: undoing it first")
            undo(found.prefix, python, progress)
            found = inspect(python)
        planned = plan(found, env_archs=request.env_archs, force=request.force)
        if request.driver_check:
            # Before anything changes, as build does: torch's CUDA is what the env must run.
            progress(
                driver.require(
                    planned.spec.cuda_version,
                    driver.current(),
                    needs=f"torch {found.torch} in {found.prefix}",
                    older="a torch built",
                )
            )
        for line in planned.lines():
            show(line)
        for name in request.rebuild:
            show(f"  rebuild {name} from its sdist with the matched nvcc")
        if request.dry_run:
            show("(dry run: nothing changed)")
            return None
        built = apply(planned, progress)
        if request.rebuild:
            journal = read_journal(found.prefix)
            assert journal is not None  # apply wrote it, marked done
            built = _rebuild(request, inspect(python), journal, progress, show) or built
    progress(
        f"adopted {found.prefix}: nvcc {built.nvcc} in cuda-home/, archs "
        f"{archs.flashinfer_spelling(built.archs)}; `cudaenv adopt --undo` reverts"
    )
    if "flashinfer-python" in found.dists:
        from builder.jit import prefetch

        # From this machine's store only: an adopted env has no lock to name a warm list by.
        done = prefetch.prefetch(python, flashinfer=found.dists["flashinfer-python"])
        prefetch.say_prefetched(done, progress)
    return built


def _rebuild(
    request: AdoptRequest, env: Env, journal: Journal, progress: Progress, show: Progress
) -> Manifest | None:
    """``--rebuild`` on an adopted env (its lock held): each package built again and the
    manifest's ``source_builds`` updated; None for a dry run."""
    from builder.adopt import rebuild

    if request.dry_run:
        for name in request.rebuild:
            show(f"rebuild {name} {env.dists.get(name, '(not installed)')} from its sdist")
        show("(dry run: nothing changed)")
        return None
    _journal_now, rows = rebuild.rebuild(
        env, journal, request.rebuild, progress, build_env=request.build_env
    )
    built = manifest.read(env.prefix)
    mine = {r[0] for r in rows}
    kept = tuple(r for r in built.source_builds if canonicalize_name(r[0]) not in mine)
    built = dataclasses.replace(built, source_builds=(*kept, *rows))
    manifest.write(built, env.prefix)
    return built


def undo_adopt(python: Path, progress: Progress) -> None:
    """`cudaenv adopt --undo`: put the env back as it was before adopt, finishing an undo a
    kill cut short. No journal: nothing to put back, the end state asked for holds (as uv
    and pixi answer a removal of what is not there; a script may run --undo twice)."""
    found = inspect(python)
    if read_journal(found.prefix) is None:
        progress(nothing_to_undo(found))
        return
    with locked(found.prefix, progress, holder="cudaenv adopt --undo"):
        journal = read_journal(found.prefix)
        if journal is None:  # the holder waited for undid it
            progress(nothing_to_undo(found))
            return
        if journal.state == "undoing":
            progress(f"an undo of {found.prefix} did not finish: finishing it")
        for line in undo(found.prefix, python, progress):
            progress(line)
    progress(f"{found.prefix} is as it was before adopt")
