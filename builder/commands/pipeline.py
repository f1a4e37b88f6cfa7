"""The steps every use case shares: a SPEC argument (a spec file, or MATRIX.yaml:CELL) →
``EnvSpec`` → its lock (``ensure_lock``, ``write_lock``) → its built env, and `cudaenv plan`.

Each use case has its module above this one, with its typed request: buildrun (spec → lock →
env → verify → record), verifyrun, auditrun, exportrun, storerun. The CLI, a matrix cell,
``add`` and ``init`` call them; none of them prints a result or exits (the CLI does). Progress
goes to the :class:`Reporter` passed in.

    load_spec ──▶ ensure_lock ──▶ build.build ──▶ spec_target ──▶ verify_and_report ──▶ verdict
                                               (or python_target for any interpreter)
"""

from __future__ import annotations

import difflib
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder.core import context, platforms
from builder.core.cudaversion import CudaVersion
from builder.core.errors import BuildError, CudaenvError, UsageError
from builder.core.paths import project_root
from builder.core.reporter import Reporter
from builder.machine import archs, driver, targets
from builder.spec import envspec as spec
from builder.spec import lock, matrixfile
from builder.spec.lockmodel import LockedPackage

if TYPE_CHECKING:
    from builder.audit import fleet as fleet_
    from builder.jit.oci import Remote

# resolve, build, fleet, jit_share and project are imported where used: a warm `cudaenv build`
# of an up-to-date lock imports no resolver (~80 ms of a ~2 s build), and `cudaenv plan`
# starts in a few milliseconds.


def command_line(argv: Sequence[str]) -> str:
    """How a lock says which command made it."""
    return shlex.join(["cudaenv", *argv])


def load_spec(arg: Path | str, *, write: bool = False) -> spec.EnvSpec:
    """A spec path, or MATRIX.yaml:CELL for one cell of a matrix (what CI runners get). A
    cell's generated spec is written to its path only with ``write`` (by what builds it)."""
    found = matrixfile.split_cell_arg(str(arg))
    if found is None:
        _spec_file_is_there(Path(arg))
        _settle_edit(Path(arg))
        return spec.load(arg)
    mx = matrixfile.load(found[0])
    cell = mx.cell(found[1])
    if write:
        matrixfile.write_cell_spec(cell)
    return mx.spec_of(cell)


def _settle_edit(path: Path) -> None:
    """What an interrupted `cudaenv add` left of this spec, settled (env/specedit.py) before
    the spec is read: its journal is there only after a kill."""
    from builder.env import build, specedit

    if not specedit.journal_path(path).exists():
        return

    def env_of() -> Path | None:
        try:
            return build.default_env_dir(spec.load(path))
        except CudaenvError:
            return None

    specedit.settle(path, env_of, Reporter())


def _spec_file_is_there(path: Path) -> None:
    """A spec argument that names no file is refused with the specs there are (in its
    directory, else the project's envspecs/) and the closest name (UsageError, exit 2)."""
    try:
        if path.exists() or path.is_symlink():
            return  # spec.load says what is wrong with anything that is there
    except (OSError, ValueError):
        return
    root = project_root()
    names: list[str] = []
    where: Path | None = None
    for d in (path.parent, root / "envspecs" if root is not None else None):
        if d is not None and d.is_dir():
            where, names = d, sorted(p.name for p in d.glob("*.y*ml") if p.is_file())
            if names:
                break
    stems = {Path(n).stem: n for n in names}
    close = [stems[c] for c in difflib.get_close_matches(path.stem, stems, n=1, cutoff=0.6)]
    said = f"{path}: no such spec file"
    if close:
        said += f"; did you mean {where / close[0] if where else close[0]}?"
    if names:
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        said += f" (specs in {where}: {shown})"
    raise UsageError(said)


def lock_file(s: spec.EnvSpec) -> Path:
    return lock.lock_path(s.source, s.name)


def parse_archs(text: str, what: str = "--archs") -> tuple[archs.Arch, ...]:
    try:
        return archs.parse_list(text)
    except ValueError as exc:
        raise UsageError(f"{what} {text!r}: {exc}") from exc


def known_platform(given: str | None) -> str | None:
    """A ``--platform`` value, refused in one line unless cudaenv knows the platform."""
    if given is not None and given not in platforms.KNOWN:
        raise UsageError(
            f"--platform {given!r}: unknown platform; expected one of: {', '.join(platforms.KNOWN)}"
        )
    return given


# --------------------------------------------------------------------------- lock, plan


@dataclass(frozen=True, kw_only=True)
class Locked:
    spec: spec.EnvSpec
    path: Path
    lock: lock.Lock
    seconds: float


def write_lock(
    spec_arg: Path | str,
    *,
    upgrade: bool,
    reporter: Reporter,
    upgrade_packages: Sequence[str] = (),
    exclude_newer: str | None = None,
) -> Locked:
    """Resolve one spec and write its lock, preferring every version of the current lock
    (transitive ones too) but those of ``upgrade_packages``, or none with ``upgrade``; against
    the index view the current lock records (resolve.choose_view), moved to now with
    ``upgrade`` (for ``upgrade_packages`` alone with those) or to ``exclude_newer``. Says the
    view and, for a re-lock, what moved. Refuses to overwrite the lock of another spec whose
    name maps there."""
    s = load_spec(spec_arg, write=True)
    out = lock_file(s)
    owner = lock.owner(out)
    if owner is not None and owner != s.name:
        lock.check_owner_name(owner, out, s.name)
    from builder.spec import resolve

    before = resolve.previous_versions(out, s)
    view = resolve.choose_view(
        before, s, upgrade=upgrade, upgrade_packages=upgrade_packages, given=exclude_newer
    )
    reporter(f"resolving {s.name} ({spec_arg}) with uv; index view: {view.describe()}")
    plan = resolve.resolve(
        s,
        command=command_line(["lock", str(spec_arg)]),
        previous=None if upgrade else out,
        upgrade_packages=upgrade_packages,
        view=view,
    )
    refuse_unbuildable(s, plan.lock, out, reporter, done="the lock was not written")
    lock.write(plan.lock, out)
    for note in plan.lock.notes:
        reporter(f"note: {note}")
    if plan.lock.exclude_newer is not None and plan.lock.exclude_newer != view.at:
        reporter(f"the lock records the index view {plan.lock.view().describe()}")
    if before is not None:
        changes = resolve.moved(before, plan.lock)
        reporter(
            "moved: " + "; ".join(changes) if changes else "moved: nothing (every version kept)"
        )
    return Locked(spec=s, path=out, lock=plan.lock, seconds=plan.seconds)


def lock_spec(
    spec_arg: Path | str,
    upgrade: bool,
    packages: Sequence[str],
    exclude_newer: str | None,
    reporter: Reporter,
) -> Locked:
    """`cudaenv lock SPEC`: :func:`write_lock`, said in one line, and a warning for each of
    the spec's targets the new set cannot serve (a lock is never refused for its targets;
    build refuses the required ones)."""
    done = write_lock(
        spec_arg,
        upgrade=upgrade,
        upgrade_packages=packages,
        reporter=reporter,
        exclude_newer=exclude_newer,
    )
    lk = done.lock
    per_platform = ", ".join(f"{len(lk.packages_on(p))} packages for {p}" for p in lk.platforms)
    reporter(
        f"wrote {done.path} ({per_platform}), torch {lk.torch or '-'} "
        f"(CUDA {lk.torch_cuda or '-'}), cuda-toolkit {lk.toolkit or '-'} "
        f"in {done.seconds:.1f} s"
    )
    if done.spec.targets:
        for v in judge_targets(done.spec, lk, done.spec.targets, reporter).failures:
            reporter(f"warning: target {v.line()}")
    return done


def refuse_unbuildable(
    s: spec.EnvSpec, lk: lock.Lock, path: Path, reporter: Reporter, *, done: str
) -> None:
    """`lock` and `plan`: sdistcheck.refuse for every platform of the lock at ``path``."""
    from builder.env import sdistcheck

    sdistcheck.refuse(lk.packages, torch=lk.torch, nvcc=s.cuda, lock_dir=path.parent,
                      say=reporter, done=done)  # fmt: skip


def current_lock(s: spec.EnvSpec, *, fresh: bool) -> tuple[lock.Lock, str]:
    """The spec's lock when up to date, else a fresh resolution; and which it is."""
    from builder.spec import resolve

    path = lock_file(s)
    if not fresh and path.exists():
        current = lock.read(path, spec=s)
        if current.fingerprint == s.fingerprint():
            return current, f"{path} (up to date)"
        view = resolve.choose_view(current, s)
        return (
            resolve.resolve(s, previous=path, view=view).lock,
            f"a fresh resolution ({path} is stale: re-lock)",
        )
    return resolve.resolve(s, view=resolve.choose_view(None, s)).lock, "a fresh resolution"


def plan_platform(s: spec.EnvSpec, lk: lock.Lock, given: str | None) -> str:
    """``--platform`` (default: this machine's, else the lock's first), one of the lock's."""
    known_platform(given)
    if given is not None and given not in lk.platforms:
        raise UsageError(
            f"--platform {given}: {s.source} is locked for {', '.join(lk.platforms)} only; add "
            f"{given} to its `platforms:` and re-lock"
        )
    if given is not None:
        return given
    host = platforms.host_name()
    return host if host in lk.platforms else lk.platforms[0]


def plan_table(
    s: spec.EnvSpec, lk: lock.Lock, platform: str, found: driver.Driver | None
) -> list[tuple[str, str]]:
    """The lock as installed on ``platform`` (one of the lock's), and what the ``found`` driver
    (``driver.current()``) makes of the spec's CUDA."""
    packages = lk.packages_on(platform)
    others = [p for p in lk.platforms if p != platform]
    rows: list[tuple[str, str]] = [
        ("spec", f"{s.name} ({s.source})"),
        ("python", lk.python),
        ("platform", platform + (f" (the lock also holds {', '.join(others)})" if others else "")),
        ("cuda (spec)", str(s.cuda)),
        ("torch", lk.torch or "-"),
        ("torch's CUDA", lk.torch_cuda or "-"),
        (
            "cuda-toolkit",
            lk.toolkit or ("system: " + str(s.toolchain.path) if s.toolchain.path else "-"),
        ),
        ("index view", lk.view().describe()),
        ("archs", archs.flashinfer_spelling(s.archs)),
        ("driver", found.describe() if found is not None else "none found on this machine"),
        ("driver needed", driver_needed(s.cuda_version, found)),
    ]
    interesting = ("nvidia-", "cuda-toolkit", "flashinfer", "sglang", "sgl-kernel", "triton")
    for p in packages:
        if p.name.startswith(interesting) and p.name != "cuda-toolkit":
            rows.append((p.name, p.version))
    rows += compile_rows(packages, lk.toolkit, archs.flashinfer_spelling(s.archs))
    rows.append(("packages", str(len(packages))))
    return rows


def compile_rows(
    packages: Sequence[LockedPackage], toolkit: str | None, arch_list: str
) -> list[tuple[str, str]]:
    """A row for each package that compiles at install: the toolkit and archs it builds for,
    and how long its last build took where this machine's store holds one."""
    from builder.env import sourcebuild

    rows = []
    for p in sourcebuild.source_packages(packages):
        text = f"{p.version}, compiled from its sdist at build (nvcc of cuda-toolkit " \
            f"{toolkit or '-'}, archs {arch_list})"  # fmt: skip
        seconds = sourcebuild.last_build_seconds(p)
        if seconds is not None:
            text += f"; the store holds a build of it that took {seconds:.0f} s"
        rows.append((f"{p.name} (source)", text))
    return rows


def driver_needed(cuda: CudaVersion, found: driver.Driver | None) -> str:
    """``580 or newer for CUDA 13.0``, and whether the ``found`` driver is."""
    if cuda.major not in driver.MINIMUM_DRIVER:
        return f"not known for CUDA {cuda}"
    need = f"{driver.minimum_driver(cuda)} or newer for CUDA {cuda}"
    if found is None:
        return need
    return need + ("" if found.runs(cuda) else ": this driver is too old (`build` refuses)")


def ensure_lock(
    s: spec.EnvSpec, spec_arg: Path | str, *, offline: bool, relock: bool, reporter: Reporter
) -> lock.Lock:
    """The spec's lock: resolved first when missing (or, with ``relock``, when stale)."""
    path = lock_file(s)
    if path.exists():
        lk = lock.read(path, spec=s)
        if not relock or lk.fingerprint == s.fingerprint():
            return lk
        why = "is stale"
    else:
        why = "does not exist"
    if offline:
        raise BuildError(f"{path} {why} and --offline cannot resolve one")
    from builder.spec import resolve

    before = resolve.previous_versions(path, s) if relock else None
    view = resolve.choose_view(before, s)
    reporter(f"{path} {why}: resolving and writing it first (index view: {view.describe()})")
    plan = resolve.resolve(
        s,
        command=command_line(["lock", str(spec_arg)]),
        previous=path if relock else None,
        view=view,
    )
    lock.write(plan.lock, path)
    return plan.lock


@dataclass(frozen=True, kw_only=True)
class Planned:
    """`cudaenv plan`: what a spec's lock (or a fresh resolution) installs on a platform, and
    what this machine's driver and the fleet targets make of it."""

    spec: spec.EnvSpec
    lock: lock.Lock
    origin: str  # which lock: the written one (up to date) or a fresh resolution
    platform: str
    driver: driver.Driver | None
    verdicts: tuple[fleet_.Verdict, ...]

    def rows(self) -> list[tuple[str, str]]:
        path = lock_file(self.spec)
        rows = [("lock", str(path) if path.exists() else f"{path} (not written yet)")]
        rows += plan_table(self.spec, self.lock, self.platform, self.driver)
        return rows + [
            (f"target {v.target.name}", v.line().split(": ", 1)[1]) for v in self.verdicts
        ]

    def to_json(self) -> dict[str, Any]:
        s, lk, found = self.spec, self.lock, self.driver
        known = s.cuda_major in driver.MINIMUM_DRIVER
        return {
            "spec": str(s.source),
            "name": s.name,
            "lock": str(lock_file(s)),
            "lock_written": lock_file(s).exists(),
            "from": self.origin,
            "platform": self.platform,
            "platforms": list(lk.platforms),
            "python": lk.python,
            "cuda": str(s.cuda),
            "torch": lk.torch,
            "torch_cuda": lk.torch_cuda,
            "toolkit": lk.toolkit,
            "archs": archs.texts(s.archs),
            "index_view": lk.view().at,
            "driver": found.to_json() if found is not None else None,
            "driver_needed": driver.minimum_driver(s.cuda_version) if known else None,
            "driver_runs": found.runs(s.cuda_version) if found is not None and known else None,
            "packages": {p.name: p.version for p in lk.packages_on(self.platform)},
            "targets": [v.to_json() for v in self.verdicts],
        }


def plan(
    spec_arg: Path | str,
    *,
    fresh: bool,
    platform: str | None,
    targets_file: Path | None,
    reporter: Reporter,
) -> Planned:
    """What the spec installs, nothing installed: its lock when up to date, else (or with
    ``fresh``) a fresh resolution; each fleet target judged (``--targets FILE``, else the
    spec's own)."""
    s = load_spec(spec_arg)
    lk, origin = current_lock(s, fresh=fresh)
    refuse_unbuildable(s, lk, lock_file(s), reporter, done="it cannot be built as locked")
    chosen = plan_platform(s, lk, platform)
    fleet = fleet_of(s, targets_file)
    verdicts = judge_targets(s, lk, fleet, reporter).verdicts if fleet else ()
    return Planned(
        spec=s, lock=lk, origin=origin, platform=chosen, driver=driver.current(), verdicts=verdicts
    )


def built_env(spec_arg: str, env_dir: Path | None) -> tuple[spec.EnvSpec, Path]:
    """A spec and its built env (``env_dir``, default .envs/NAME); refused when not built."""
    from builder.env import build, manifest

    s = load_spec(spec_arg)
    env = (env_dir or build.default_env_dir(s)).absolute()
    if not manifest.exists(env):
        raise BuildError(f"{env} is not built; run `cudaenv build {spec_arg}` first")
    return s, env


def jit_remote_for(spec_source: Path | None) -> Remote | None:
    """The JIT store's registry tier for a spec's project (``CUDAENV_JIT_REMOTE`` wins over
    ``[tool.cudaenv] jit-remote``), None where none is set; checked now: a malformed one is
    the user's error (UsageError), not a warning mid-verify."""
    from builder.jit import share as jit_share
    from builder.spec import project

    def resolve() -> Remote | None:
        setting = project.settings_for(spec_source).jit_remote if spec_source else None
        try:
            return jit_share.configured(setting=setting)
        except jit_share.ShareError as exc:
            raise UsageError(str(exc)) from None

    # Once per command: a build and the verify that follows ask for the same spec's remote.
    where = str(spec_source.absolute()) if spec_source else None
    return context.once(("jit-remote", where), resolve)


# --------------------------------------------------------------------------- fleet targets


@dataclass(frozen=True, kw_only=True)
class Judged:
    """A stack judged for its fleet targets from its lock (no env needed)."""

    spec: spec.EnvSpec
    lock: lock.Lock
    verdicts: tuple[fleet_.Verdict, ...]

    @property
    def failures(self) -> list[fleet_.Verdict]:
        return [v for v in self.verdicts if not v.ok]


def fleet_of(s: spec.EnvSpec, targets_file: Path | None) -> tuple[targets.Target, ...]:
    """The targets a command judges: ``--targets FILE``, else the spec's own."""
    return targets.load_file(targets_file) if targets_file is not None else s.targets


def committed_lock(s: spec.EnvSpec, spec_arg: Path | str) -> lock.Lock:
    """The spec's lock as it is written, for judging its wheels (which never resolves):
    BuildError when it is missing or no longer the spec's."""
    path = lock_file(s)
    if not path.exists():
        raise BuildError(f"{path} does not exist: `cudaenv lock {spec_arg}` first")
    lk = lock.read(path, spec=s)
    if lk.fingerprint != s.fingerprint():
        raise BuildError(f"{path} is stale for {spec_arg}: re-lock with `cudaenv lock {spec_arg}`")
    return lk


def judge_targets(
    s: spec.EnvSpec,
    lk: lock.Lock,
    fleet: Sequence[targets.Target],
    reporter: Reporter,
) -> Judged:
    """Each target's verdict from the lock's wheels of its platform: the exported wheelhouse
    of an index-neutral lock when it holds files, else the index uv is configured with."""
    from builder.audit import fleet as fleet_mod

    house = None
    if lk.wheelhouse is not None:
        d = lock_file(s).parent / lk.wheelhouse
        house = d if d.is_dir() and any(d.glob("*.whl")) else None
    verdicts = fleet_mod.judge(s, lk, fleet, reporter, wheelhouse=house)
    return Judged(spec=s, lock=lk, verdicts=tuple(verdicts))
