"""`cudaenv init`: a spec and its lock for a new box, from what the box has and what is asked.

What the box has is read, not asked: its platform, glibc, the GPUs' archs, the NVIDIA driver
and any CUDA toolkit installed on it. The CUDA of the env is chosen by trying the CUDA minors
PyPI's torch wheels are built for, newest first (``--cuda`` fixes one). A candidate the
driver cannot run, whose archs its nvcc cannot target, or that is CUDA 12 without a CUDA 12
toolkit on the box (PyPI has no CUDA 12 nvcc) is skipped without a resolver call; each other
one is one ``uv pip compile`` for this box's platform, of the asked packages and torch with
torch's CUDA held to the candidate's minor, and the first whose set resolves wins. uv decides
which torch that is: a package that pins torch (vllm 0.33.0 pins torch 2.14.0) is followed,
never fought with a pin of our own. The winner is written as a spec of exact pins and locked
by the pipeline, under the whole matching policy, for every platform of the spec; if that
fails, the spec is removed again, so a failed init leaves nothing behind.

The request is checked in builder/commands/init_request.py and the env chosen in
builder/commands/init_choice.py (their names are importable from here); this module writes
the spec, locks it and judges the fleet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from builder.commands import pipeline
from builder.commands.init_choice import CUDA_CANDIDATES as CUDA_CANDIDATES
from builder.commands.init_choice import JIT_COMPANIONS as JIT_COMPANIONS
from builder.commands.init_choice import Choice as Choice
from builder.commands.init_choice import Latest as Latest
from builder.commands.init_choice import Outcome as Outcome
from builder.commands.init_choice import Probe as Probe
from builder.commands.init_choice import Tried as Tried
from builder.commands.init_choice import archs_for as archs_for
from builder.commands.init_choice import choose as choose
from builder.commands.init_choice import companions as companions
from builder.commands.init_choice import newest_releases as newest_releases
from builder.commands.init_choice import one_line as one_line
from builder.commands.init_request import PYTHON as PYTHON
from builder.commands.init_request import Request as Request
from builder.commands.init_request import make_request as make_request
from builder.core import indexview, proc
from builder.core.cudaversion import CudaVersion
from builder.core.errors import ResolveError, SpecError, UsageError, VerifyFailed
from builder.core.reporter import Reporter
from builder.machine import archs, driver
from builder.machine.archs import Arch
from builder.machine.box import Box, detect_box
from builder.machine.targets import Target
from builder.spec import envspec as spec
from builder.spec import lock, resolve
from builder.spec.lock import LockedPackage

# Writes the lock of the spec file at the path (pipeline.write_lock in production).
Locker = Callable[[Path, Reporter], pipeline.Locked]


# --------------------------------------------------------------------------- writing


def render(choice: Choice, request: Request, box: Box) -> str:
    """The spec file's text. Every string is written as JSON, which YAML reads as itself."""

    def q(value: str) -> str:
        return json.dumps(value)

    def seq(values: Sequence[str]) -> str:
        return "[" + ", ".join(q(v) for v in values) + "]"

    command = shlex.join(["cudaenv", "init", *request.argv])
    made = ", ".join(g.label for g in box.gpus) or "no GPU visible"
    asked = ", ".join(choice.packages) or "torch"
    if choice.toolchain.source == "wheels":
        chain = f"{{source: wheels, components: [{', '.join(choice.toolchain.components)}]}}"
    else:
        chain = f"{{source: system, path: {q(str(choice.toolchain.path))}}}"
    lines = [
        f"# Written by `{command}`",
        f"# on {box.platform} ({made}); CUDA {choice.cuda} is the newest that resolved:",
        *(f"#   {t.line()}" for t in choice.tried),
        *(f"# note: {n}" for n in choice.notes),
        f"name: {q(choice.name)}",
        f"summary: {q(f'{asked} on torch {choice.torch} (CUDA {choice.cuda})')}",
        f"python: {q(PYTHON)}",
        f"cuda: {q(str(choice.cuda))}",
        f"torch: {q(choice.torch)}",
        f"packages: {seq(choice.packages)}",
        f"toolchain: {chain}",
        f"archs: {seq(archs.texts(choice.archs))}",
    ]
    if request.targets:
        lines.append("targets:")
        lines += [f"  - {t.yaml()}" for t in request.targets]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, kw_only=True)
class Done:
    box: Box
    choice: Choice
    spec_path: Path
    spec: spec.EnvSpec
    locked: pipeline.Locked


def _default_locker(path: Path, say: Reporter) -> pipeline.Locked:
    return pipeline.write_lock(path, upgrade=True, reporter=say)


def _view_locker(path: Path, say: Reporter, *, exclude_newer: str | None) -> pipeline.Locked:
    return pipeline.write_lock(path, upgrade=True, reporter=say, exclude_newer=exclude_newer)


def uv_probe(
    s: spec.EnvSpec,
    requirements: Sequence[str],
    constraints: Sequence[str],
    *,
    view: indexview.View | None = None,
) -> Sequence[LockedPackage]:
    """One ``uv pip compile`` for the candidate's one platform."""
    return resolve.uv_compile(s, requirements, constraints, view=view).packages


def uv_latest(
    s: spec.EnvSpec, req: Requirement, *, view: indexview.View | None = None
) -> str | None:
    """The newest release of ``req`` uv finds for the spec's platform and Python, its
    dependencies left out (one index page, a second or two)."""
    bare = Requirement(str(req))
    bare.marker = None  # the release, wherever the marker would apply
    got = resolve.uv_compile(s, [str(bare)], extra_args=["--no-deps"], view=view).packages
    want = canonicalize_name(req.name)
    return next((p.version for p in got if canonicalize_name(p.name) == want), None)


def asked_gpus(request: Request, box: Box, cuda: CudaVersion) -> tuple[Target, ...]:
    """The GPUs init chose for (``--gpu``, else the visible ones) as targets on this box's
    platform and driver (a driver not found: the oldest that runs ``cuda``, so only the
    binaries are judged)."""
    caps: list[tuple[int, int]] = []
    sources: Sequence[Arch | archs.Gpu] = request.gpus or box.gpus
    for a in sources:
        cap = a.capability
        if cap is not None and cap not in caps:
            caps.append(cap)
    found = box.driver.version if box.driver is not None else None
    version = found or (
        driver.minimum_driver(cuda) if cuda.major in driver.MINIMUM_DRIVER else "580"
    )
    return tuple(
        Target(
            name=f"gpu-{major}.{minor}",
            cc=Arch(major=major, minor=minor),
            platform=box.platform,
            driver=version,
        )
        for major, minor in caps
    )


def _every_target_runs(
    written: spec.EnvSpec, locked: pipeline.Locked, fleet: Sequence[Target], say: Reporter
) -> None:
    """The fleet's verdicts from the new lock's wheels: a stack that cannot run on a target
    is never written (VerifyFailed naming the target and what blocks)."""
    done = pipeline.judge_targets(written, locked.lock, fleet, say)
    for v in done.verdicts:
        say(f"  {v.line()}")
    if done.failures:
        raise VerifyFailed(
            f"{written.name} (the newest stack that resolves here) cannot run on "
            + "; ".join(v.line() for v in done.failures)
            + ": nothing written; drop or change that target, or ask for another stack "
            "(--with, --cuda)"
        )


def _check_free(out: Path, request: Request, name: str) -> Path:
    """Refuse a spec file or a lock that exists already (UsageError); the lock's path."""
    what = "--out " + str(out) if request.out else f"{out} (named by --name or the packages)"
    if out.exists() or out.is_symlink():
        raise UsageError(f"{what}: the file exists; init never overwrites a spec")
    lock_file = lock.lock_path(out, name)
    if lock_file.exists() or lock_file.is_symlink():
        raise UsageError(
            f"{lock_file} exists already: remove it, or pick another --name than {name!r}"
        )
    return lock_file


def _free_name(choice: Choice, request: Request, say: Reporter) -> Choice:
    """``choice`` under the first of its name, ``NAME-2``, ``NAME-3``, ... whose spec and lock
    are free: the name init chose itself may be a shipped spec's (the default spec is the
    newest sglang stack, which is what ``init --with sglang`` chooses too). The user's own
    ``--name`` is never changed: taken, it is refused."""
    base = choice.name
    for n in range(1, 100):
        name = base if n == 1 else f"{base}-{n}"
        out = request.out or Path("envspecs") / f"{name}.yaml"
        if out.exists() or out.is_symlink():
            continue
        lock_file = lock.lock_path(out, name)
        if lock_file.exists() or lock_file.is_symlink():
            continue
        if n > 1:
            say(f"named {name}: {base} is taken (its spec or lock exists); --name chooses another")
        return dataclasses.replace(choice, name=name)
    return choice  # all taken: _check_free says which


def _made_dirs(path: Path) -> list[Path]:
    """The directories above ``path`` that do not exist yet, deepest first."""
    out: list[Path] = []
    d = path.parent
    while not d.exists():
        out.append(d)
        d = d.parent
    return out


def init(
    request: Request,
    say: Reporter,
    *,
    box: Box | None = None,
    probe: Probe = uv_probe,
    locker: Locker = _default_locker,
    latest: Latest | None = uv_latest,
) -> Done:
    """Detect the box, choose the env, write its spec and lock it. On any failure the spec
    (and any directory made for it) is removed again: nothing is left written."""
    if request.out is None and request.name is not None:
        # Known before any resolution: refuse an existing file now, not after uv's minutes.
        _check_free(Path("envspecs") / f"{request.name}.yaml", request, request.name)
    box = box if box is not None else detect_box()
    for line in box.lines():
        say(line)
    # One view for every trial and the lock, so two boxes given the same time agree.
    view = resolve.fresh_view(request.exclude_newer)
    say(f"index view: {view.describe()}")
    if probe is uv_probe:
        probe = functools.partial(uv_probe, view=view)
    if latest is uv_latest:
        latest = functools.partial(uv_latest, view=view)
    if locker is _default_locker:
        locker = functools.partial(_view_locker, exclude_newer=view.at)
    out = request.out or Path("envspecs") / f"{request.name or 'init'}.yaml"
    choice = choose(request, box, probe, say, out.absolute(), latest)
    for note in choice.notes:
        say(f"note: {note}")
    if request.name is None:
        choice = _free_name(choice, request, say)
    out = request.out or Path("envspecs") / f"{choice.name}.yaml"
    lock_file = _check_free(out, request, choice.name)
    text = render(choice, request, box)
    try:
        written = spec.load(out, text=text)  # refused here, before anything is written
    except SpecError as exc:
        raise UsageError(one_line("\n".join(exc.problems))) from None
    made = _made_dirs(lock_file)  # locks/ beside the spec, and any missing parents of both
    try:
        proc.atomic_write_text(out, text)
        say(f"wrote {out}; locking it for {', '.join(written.platforms)}")
        locked = locker(out, say)
        fleet = request.targets or asked_gpus(request, box, choice.cuda)
        if fleet and locked.lock.packages:
            _every_target_runs(written, locked, fleet, say)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            out.unlink()
        if "locked" in locals():
            with contextlib.suppress(OSError):
                locked.path.unlink()  # a lock init wrote (it refused one that existed)
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()  # only if empty: never a directory that holds anything else
        if isinstance(exc, ResolveError):
            raise ResolveError(f"{out} not written: {one_line(str(exc))}") from None
        raise
    return Done(box=box, choice=choice, spec_path=out, spec=written, locked=locked)
