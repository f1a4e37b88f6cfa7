"""The sequence every front end runs: spec → lock → env → verify → record.

The CLI, a matrix cell and ``adopt`` call these functions with typed requests; none of them
prints a result or exits (the CLI does). Progress goes to the :class:`Reporter` passed in.

    load_spec ──▶ ensure_lock ──▶ build.build ──▶ spec_target ──▶ verify_and_report ──▶ verdict
                                               (or python_target for any interpreter)

A matrix cell runs :func:`build_env` in a child process (``python -m builder.pipeline
REQUEST.json``) rather than in a thread: each cell's uv and nvcc output lands in its own log,
a cell that crashes or is killed costs that cell only, and the children's die-with-parent
setup (proc.py) is only safe to run from a single-threaded process.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder import archs, driver, lock, platforms, spec
from builder.cudaversion import CudaVersion
from builder.errors import (
    BuildError,
    CudaenvError,
    SpecError,
    ToolMissing,
    UsageError,
    VerifyFailed,
)
from builder.paths import project_root
from builder.probe import jit_store
from builder.reporter import NOTHING_BUILT, Reporter, run_main, silent

if TYPE_CHECKING:
    from builder import audit as audit_
    from builder import fleet as fleet_
    from builder import jit_remote, report, verify
    from builder import targets as targets_
    from builder.manifest import Manifest

# resolve, build, verify, report and export are imported where used: a warm `cudaenv build`
# of an up-to-date lock imports neither the resolver nor the verify and report machinery
# (~80 ms of a ~2 s build), and `cudaenv plan` starts in a few milliseconds.


def command_line(argv: Sequence[str]) -> str:
    """How a lock says which command made it."""
    return shlex.join(["cudaenv", *argv])


def load_spec(arg: Path | str, *, write: bool = False) -> spec.EnvSpec:
    """A spec path, or MATRIX.yaml:CELL for one cell of a matrix (what CI runners get). A
    cell's generated spec is written to its path only with ``write`` (by what builds it)."""
    if ":" not in str(arg):
        _spec_file_is_there(Path(arg))
        return spec.load(arg)  # the matrix module (and its imports) only for FILE:CELL
    from builder import matrix

    found = matrix.split_cell_arg(str(arg))
    if found is None:
        _spec_file_is_there(Path(arg))
        return spec.load(arg)
    mx = matrix.load(found[0])
    cell = mx.cell(found[1])
    if write:
        matrix.write_cell_spec(cell)
    return mx.spec_of(cell)


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
    path: Path
    lock: lock.Lock
    seconds: float


def write_lock(
    spec_arg: Path | str,
    *,
    upgrade: bool,
    reporter: Reporter,
    upgrade_packages: Sequence[str] = (),
) -> Locked:
    """Resolve one spec and write its lock, preferring every version of the current lock
    (transitive ones too) but those of ``upgrade_packages``, or none with ``upgrade``.
    Refuses to overwrite the lock of another spec whose name maps there."""
    s = load_spec(spec_arg, write=True)
    out = lock_file(s)
    owner = lock.owner(out)
    if owner is not None and owner != s.name:
        lock.check_owner_name(owner, out, s.name)
    reporter(f"resolving {s.name} ({spec_arg}) with uv")
    from builder import resolve

    plan = resolve.resolve(
        s,
        command=command_line(["lock", str(spec_arg)]),
        previous=None if upgrade else out,
        upgrade_packages=upgrade_packages,
    )
    lock.write(plan.lock, out)
    for note in plan.lock.notes:
        reporter(f"note: {note}")
    return Locked(path=out, lock=plan.lock, seconds=plan.seconds)


def current_lock(s: spec.EnvSpec, *, fresh: bool) -> tuple[lock.Lock, str]:
    """The spec's lock when up to date, else a fresh resolution; and which it is."""
    from builder import resolve

    path = lock_file(s)
    if not fresh and path.exists():
        current = lock.read(path, spec=s)
        if current.fingerprint == s.fingerprint():
            return current, f"{path} (up to date)"
        return resolve.resolve(s).lock, f"a fresh resolution ({path} is stale: re-lock)"
    return resolve.resolve(s).lock, "a fresh resolution"


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
    (``driver.detect()``) makes of the spec's CUDA."""
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
        ("archs", archs.flashinfer_spelling(s.archs)),
        ("driver", found.describe() if found is not None else "none found on this machine"),
        ("driver needed", driver_needed(s.cuda_version, found)),
    ]
    interesting = ("nvidia-", "cuda-toolkit", "flashinfer", "sglang", "sgl-kernel", "triton")
    for p in packages:
        if p.name.startswith(interesting) and p.name != "cuda-toolkit":
            rows.append((p.name, p.version))
    rows.append(("packages", str(len(packages))))
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
    reporter(f"{path} {why}: resolving and writing it first")
    from builder import resolve

    plan = resolve.resolve(
        s, command=command_line(["lock", str(spec_arg)]), previous=path if relock else None
    )
    lock.write(plan.lock, path)
    return plan.lock


# --------------------------------------------------------------------------- build


@dataclass(frozen=True, kw_only=True)
class BuildRequest:
    """One env to build (and verify): what `cudaenv build` takes for each spec, and what a
    matrix cell is."""

    spec: str  # a spec path, or MATRIX.yaml:CELL
    env_dir: Path | None = None
    force: bool = False
    verify: bool = False
    report: Path | None = None  # with verify: the JSON report
    record: Path | None = None  # a report.BuildRecord, written however the run ends
    relock: bool = False
    wheelhouse: Path | None = None
    offline: bool = False
    platform: str | None = None  # another machine's (assemble only); None: this one's
    no_driver_check: bool = False  # build even where this machine's driver cannot run the CUDA
    keep_going: bool = False  # with verify: run every check after a cheap one failed
    no_target_check: bool = False  # build even where a required fleet target cannot run it

    def to_json(self) -> dict[str, Any]:
        return {
            k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_json(cls, doc: object, where: str) -> BuildRequest:
        from builder.jsondoc import Reader

        r = Reader(doc, where, "build request")

        def path(key: str) -> Path | None:
            text = r.opt_text(key)
            return Path(text) if text is not None else None

        return cls(
            spec=r.text("spec"),
            env_dir=path("env_dir"),
            force=r.flag("force"),
            verify=r.flag("verify"),
            report=path("report"),
            record=path("record"),
            relock=r.flag("relock"),
            wheelhouse=path("wheelhouse"),
            offline=r.flag("offline"),
            platform=r.opt_text("platform"),
            no_driver_check=r.opt_flag("no_driver_check"),
            keep_going=r.opt_flag("keep_going"),
            no_target_check=r.opt_flag("no_target_check"),
        )


@dataclass(frozen=True, kw_only=True)
class Built:
    """An env :class:`Run` built (or reused, or assembled for another machine)."""

    spec: spec.EnvSpec
    lock: lock.Lock
    path: Path
    manifest: Manifest
    reused: bool
    platform: str | None  # another machine's, when assembled for it
    seconds: float

    def to_json(self, verified: report.VerifyReport | None = None) -> dict[str, object]:
        return {
            "spec": str(self.spec.source),
            "env": str(self.path),
            "reused": self.reused,
            "platform": self.platform or platforms.host_name(),
            "assembled": self.platform is not None,
            "seconds": round(self.seconds, 1),
            "verify": verified.to_json() if verified is not None else None,
        }


def cross_platform(request: BuildRequest) -> str | None:
    """``build --platform``: None for this machine's own, else the other platform's name."""
    if known_platform(request.platform) is None or request.platform == platforms.host_name():
        return None
    if request.verify:
        raise UsageError(
            f"--verify runs the env, and an env assembled for {request.platform} cannot run on "
            f"this {platforms.host_name()} machine; verify it there"
        )
    if request.env_dir is None:
        # .envs/NAME is this machine's env of the spec; another machine's goes elsewhere.
        raise UsageError(
            f"--platform {request.platform} needs --env-dir DIR (where to assemble it)"
        )
    return request.platform


def build_and_verify(
    request: BuildRequest, reporter: Reporter, show: Callable[[str], None]
) -> tuple[Built, report.VerifyReport | None]:
    """The whole :class:`Run`: build, ``show`` the env's path, verify when asked and ``show``
    the summary. The verdict is the caller's (:func:`raise_verdict`)."""
    with Run(request, reporter) as run:
        built = run.build()
        show(str(built.path))
        verified = run.verify(built) if request.verify else None
        if verified is not None:
            from builder import report

            show(report.terminal(verified))
    return built, verified


class Run:
    """One :class:`BuildRequest` going through resolve → build → verify. Used as a context
    manager: with ``request.record`` it leaves a build record (report.BuildRecord) saying at
    which stage and how the run ended, whatever stopped it (an error, Ctrl-C)."""

    def __init__(self, request: BuildRequest, reporter: Reporter | None = None) -> None:
        self.request = request
        self.reporter = reporter or silent()
        self.stage = "resolve"
        self.verified: report.VerifyReport | None = None

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if self.request.record is None:
            return
        if exc is None:
            ended = verdict(self.verified) if self.verified is not None else None
            write_record(self.request.record, self.stage, ended, self.verified)
        elif isinstance(exc, CudaenvError | KeyboardInterrupt):
            write_record(self.request.record, self.stage, exc, self.verified)

    def build(self) -> Built:
        """Resolve the lock if needed, then build (or reuse, or assemble) the env."""
        from builder import build

        request, say = self.request, self.reporter
        if request.wheelhouse is not None and not request.wheelhouse.is_dir():
            # Before the lock or the driver is looked at: a mistyped argument, said as one.
            what = "does not exist" if not request.wheelhouse.exists() else "is not a directory"
            raise UsageError(
                f"--wheelhouse {request.wheelhouse}: {what}; name the directory "
                "`cudaenv export --wheelhouse DIR` filled"
            )
        self.stage = "resolve"
        cross = cross_platform(request)
        s = load_spec(request.spec, write=True)
        if cross is None and not request.no_driver_check:
            # Before the lock is resolved or anything installed: a cu130 torch installs fine
            # on a 570 driver and fails only at its first kernel (pie-project/pie#327).
            say(driver.require(s.cuda_version, driver.detect(), needs=request.spec, older="a spec"))
        lk = ensure_lock(
            s, request.spec, offline=request.offline, relock=request.relock, reporter=say
        )
        required = [t for t in s.targets if t.required]
        if required and not request.no_target_check:
            # Before anything is installed: a stack that cannot run on a class the spec must
            # serve is refused here, not found out at that class's first request.
            done = judge_targets(s, lk, required, say)
            if done.failures:
                raise VerifyFailed(
                    f"{s.name} cannot run on {len(done.failures)} required target(s), nothing "
                    "was installed: "
                    + "; ".join(v.line() for v in done.failures)
                    + " (--no-target-check builds anyway)"
                )
            say(f"every required target runs it: {', '.join(t.name for t in required)}")
        self.stage = "build"
        started = time.monotonic()
        say(
            f"building {s.name}: python {s.python}, torch {lk.torch or '-'}, CUDA {s.cuda} "
            f"({s.toolchain.source} toolchain), archs {archs.flashinfer_spelling(s.archs)}"
        )
        wheelhouse = request.wheelhouse.absolute() if request.wheelhouse else None
        if wheelhouse is not None:
            from builder import export

            export.check_wheelhouse(lk, wheelhouse, cross)  # before anything is built
            imported, trouble = export.import_jit(wheelhouse)
            if trouble:
                say(f"warning: {trouble}")
            if imported:
                say(
                    f"{imported} JIT result(s) from {wheelhouse / export.JIT_DIR} added to the "
                    "store; each is used only where its toolkit, flags and inputs match"
                )
        result = build.build(
            s,
            lk,
            lock_file=lock_file(s),
            env_dir=request.env_dir,
            force=request.force,
            source=build.Source(wheelhouse=wheelhouse, offline=request.offline),
            platform=cross,
            reporter=say,
        )
        verb = "reused" if result.reused else ("assembled" if cross else "built")
        if cross:
            verb += f" (for {cross}, not runnable here)"
        seconds = time.monotonic() - started
        say(f"{verb} {result.path} in {seconds:.1f} s")
        return Built(
            spec=s,
            lock=lk,
            path=result.path,
            manifest=result.manifest,
            reused=result.reused,
            platform=cross,
            seconds=seconds,
        )

    def verify(self, built: Built) -> report.VerifyReport:
        """Verify the env just built; the report is written (``request.report``, else the
        env's own), the verdict is the caller's (:func:`verdict`)."""
        self.stage = "verify"
        target = spec_target(
            built.spec,
            built.path,
            built.lock,
            built.manifest,
            keep_going=self.request.keep_going,
        )
        self.verified = verify_and_report(
            target, built.manifest, self.reporter, report_path=self.request.report
        )
        return self.verified


def write_record(
    path: Path,
    stage: str,
    exc: BaseException | None,
    verified: report.VerifyReport | None = None,
) -> None:
    from builder import report
    from builder.errors import STATUS_OF_EXIT

    if exc is None:
        code, reason = 0, ""
    elif isinstance(exc, CudaenvError):
        code = exc.exit_code
        reason = "; ".join(exc.problems) if isinstance(exc, SpecError) else str(exc)
    else:
        code, reason = 130, "interrupted"
    status = STATUS_OF_EXIT.get(code, "error")
    if isinstance(exc, VerifyFailed | ToolMissing) and stage == "verify":
        status = "failed"
    record = report.BuildRecord(
        stage=stage, status=status, reason=reason, exit_code=code, verify=verified
    )
    report.write_json(record, path)


# --------------------------------------------------------------------------- verify


def spec_target(
    s: spec.EnvSpec,
    env_dir: Path,
    lk: lock.Lock | None,
    manifest: Manifest,
    *,
    checks: tuple[str, ...] | None = None,
    archs_override: tuple[archs.Arch, ...] | None = None,
    fresh: bool = False,
    keep_going: bool = False,
) -> verify.Target:
    """What verifying the env of ``s`` at ``env_dir`` means. The env must be the one this spec
    (and its current lock) describes: an env built from another spec of the same name, or
    from an older lock, is refused with the rebuild command."""
    from builder import verify

    rebuild = f"rebuild it: `cudaenv build {s.source}`"
    if manifest.fingerprint != s.fingerprint():
        raise VerifyFailed(
            f"{env_dir} was built from another spec than {s.source} (spec {manifest.spec}, "
            f"fingerprint {manifest.fingerprint[:19]}... != {s.fingerprint()[:19]}...); {rebuild}"
        )
    if lk is not None and manifest.lock_hash != lk.content_hash():
        raise VerifyFailed(
            f"{env_dir} was built from another lock than {lock_file(s)} (lock "
            f"{manifest.lock_hash[:19]}... != {lk.content_hash()[:19]}...); {rebuild}"
        )
    chosen = archs_override or manifest.archs
    # Another list than the env's: the start-up hook takes it from CUDAENV_ARCH_LIST, so
    # FlashInfer JIT-builds those archs into the env's own cache for this run.
    extra = (
        (("CUDAENV_ARCH_LIST", archs.flashinfer_spelling(chosen)),)
        if chosen != manifest.archs
        else ()
    )
    return verify.Target(
        python=env_dir / "bin" / "python",
        archs=chosen,
        work=env_dir / "var" / "cudaenv",
        env_dir=env_dir,
        expected_cuda=s.cuda,
        spec_name=s.name,
        spec_path=str(s.source),
        checks=checks or s.verify,
        extra_env=extra,
        fresh=fresh,
        jit_remote=jit_remote_for(s.source),
        packages=(*(("torch",) if s.torch else ()), *s.packages),
        keep_going=keep_going,
    )


def jit_remote_for(spec_source: Path | None) -> str | None:
    """The JIT store's registry tier for a spec's project (``CUDAENV_JIT_REMOTE`` wins),
    checked now: a malformed one is the user's error, not a warning mid-verify."""
    from builder import jit_share, project

    setting = project.settings_for(spec_source).jit_remote if spec_source else None
    try:
        remote = jit_share.configured(setting=setting)
    except jit_share.ShareError as exc:
        raise UsageError(str(exc)) from None
    return remote.url if remote is not None else None


@dataclass(frozen=True, kw_only=True)
class VerifyRequest:
    """What `cudaenv verify` takes: a spec's built env, or any interpreter."""

    spec: str | None = None
    python: str | None = None
    env_dir: Path | None = None
    checks: tuple[str, ...] | None = None
    archs: tuple[archs.Arch, ...] | None = None
    fresh: bool = False
    keep_going: bool = False  # run every check after a cheap one failed


def built_env(spec_arg: str, env_dir: Path | None) -> tuple[spec.EnvSpec, Path]:
    """A spec and its built env (``env_dir``, default .envs/NAME); refused when not built."""
    from builder import build, manifest

    s = load_spec(spec_arg)
    env = (env_dir or build.default_env_dir(s)).absolute()
    if not manifest.exists(env):
        raise BuildError(f"{env} is not built; run `cudaenv build {spec_arg}` first")
    return s, env


def verify_target(request: VerifyRequest) -> tuple[verify.Target, Manifest | None]:
    """The target of a :class:`VerifyRequest`, and the env's manifest where it has one."""
    from builder import interpreters, manifest
    from builder.paths import cache_dir

    if request.spec is None and request.python is None:
        raise UsageError("verify needs a SPEC or --python PATH (see `cudaenv verify --help`)")
    if request.spec is not None:
        if request.python is not None:
            raise UsageError("verify takes a SPEC or --python PATH, not both")
        s, env_dir = built_env(request.spec, request.env_dir)
        found = manifest.read(env_dir)
        host = platforms.host_name()
        if found.platform is not None and found.platform != host:
            raise UsageError(
                f"{env_dir} was assembled for {found.platform} and cannot run on this {host} "
                f"machine: copy it to a {found.platform} machine, make it a venv there "
                f"(`python{found.python} -m venv {env_dir}`) and verify it there"
            )
        path = lock_file(s)
        lk = lock.read(path, spec=s) if path.exists() else None
        target = spec_target(
            s,
            env_dir,
            lk,
            found,
            checks=request.checks,
            archs_override=request.archs,
            fresh=request.fresh,
            keep_going=request.keep_going,
        )
        return target, found
    assert request.python is not None
    plain, manifest_found = python_target(
        interpreters.python_arg(request.python),
        checks=request.checks,
        archs_override=request.archs,
        fresh=request.fresh,
        work_root=cache_dir() / "verify",
    )
    return dataclasses.replace(plain, keep_going=request.keep_going), manifest_found


def python_target(
    python: Path,
    *,
    checks: tuple[str, ...] | None,
    archs_override: tuple[archs.Arch, ...] | None,
    fresh: bool,
    work_root: Path,
) -> tuple[verify.Target, Manifest | None]:
    """Verifying any interpreter: an env cudaenv built or adopted (its manifest gives the
    arch list), or a plain one (FLASHINFER_CUDA_ARCH_LIST, else the default list)."""
    from builder import manifest, verify

    root = python.absolute().parent.parent
    found = manifest.try_read(root)
    if archs_override is None:
        from_env = os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
        archs_override = (
            found.archs
            if found
            else (
                parse_archs(from_env, "FLASHINFER_CUDA_ARCH_LIST")
                if from_env
                else archs.DEFAULT_ARCHS
            )
        )
    key = hashlib.sha256(str(python.absolute()).encode()).hexdigest()[:12]
    spelled = archs.flashinfer_spelling(archs_override)
    # Both: a plain env's FlashInfer reads the first, a cudaenv env's hook the second.
    extra = (("FLASHINFER_CUDA_ARCH_LIST", spelled), ("CUDAENV_ARCH_LIST", spelled))
    target = verify.Target(
        python=python,
        archs=archs_override,
        work=work_root / key,
        env_dir=root if found else None,
        checks=checks or verify.CHECKS,
        extra_env=extra,
        fresh=fresh,
        jit_remote=jit_remote_for(None),
    )
    return target, found


def verify_and_report(
    target: verify.Target,
    found: Manifest | None,
    reporter: Reporter,
    *,
    report_path: Path | None = None,
    markdown_path: Path | None = None,
) -> report.VerifyReport:
    """Run the target's checks and write the reports (JSON: ``report_path``, else the env's
    own ``var/cudaenv/verify.json``; Markdown where asked and to a CI step summary)."""
    from builder import report, verify
    from builder.proc import atomic_write_text

    started = time.monotonic()
    # An interrupt now stops a verify: the env is as it was (a build before it said what it
    # left), and no report is written.
    left = reporter.interrupt_note
    stopped = "verify stopped before its report was written"
    reporter.leaves(
        f"{stopped}; {target.env_dir or target.python} is unchanged"
        if left == NOTHING_BUILT
        else f"{left}; {stopped}"
    )
    facts, results = verify.run_checks(target, target.checks, reporter)
    rep = report.verify_report(target, facts, results, time.monotonic() - started, found)
    out = report_path
    if out is None and target.env_dir is not None:
        out = target.env_dir / "var" / "cudaenv" / "verify.json"
    if out is not None:
        report.write_json(rep, out)
        reporter(f"report: {out}")
    md = report.markdown(rep)
    if markdown_path:
        atomic_write_text(markdown_path, md)
    report.append_step_summary(md)
    return rep


def verdict(rep: report.VerifyReport) -> CudaenvError | None:
    """The error a report amounts to: a missing tool first (exit 6), else failed checks (5)."""
    failed = [c for c in rep.checks if c.status == "failed"]
    if not failed:
        return None
    missing = [(c, c.missing_tool) for c in failed if c.missing_tool]
    if missing:
        c, tool = missing[0]
        return ToolMissing(f"{c.name}: no {tool}: {c.fix}", tool=tool)
    return VerifyFailed(f"{len(failed)} check(s) failed: {', '.join(c.name for c in failed)}")


def raise_verdict(rep: report.VerifyReport) -> None:
    found = verdict(rep)
    if found is not None:
        raise found


# --------------------------------------------------------------------------- export


@dataclass(frozen=True, kw_only=True)
class ExportRequest:
    """What `cudaenv export` takes: fill a wheelhouse (and carry the env's JIT results), and/or
    write a PEP 751 lock with this machine's index URLs."""

    spec: str
    wheelhouse: Path | None = None
    pylock: Path | None = None
    with_jit: bool = False
    env_dir: Path | None = None
    platform: str | None = None


def export(request: ExportRequest, reporter: Reporter) -> None:
    from builder import build
    from builder import export as exporting

    if request.pylock is not None:
        exporting.check_pylock_name(request.pylock)  # before any work
    s = load_spec(request.spec)
    path = lock_file(s)
    lk = lock.read(path, spec=s)
    build.check_lock(s, lk, path)
    wheelhouse = request.wheelhouse.absolute() if request.wheelhouse else None
    if wheelhouse is None and request.pylock is None:
        # The directory the index-neutral lock's paths name: filled, the lock installs as is.
        wheelhouse = exporting.lock_wheelhouse(s, lk, path)
        if wheelhouse is None:
            raise UsageError(
                f"export needs --wheelhouse DIR or --pylock FILE: {path} names its files by "
                "URL, so it has no wheelhouse of its own"
            )
    if request.with_jit and wheelhouse is None:
        raise UsageError(
            "--with-jit puts the env's JIT results into a wheelhouse: add --wheelhouse DIR"
        )
    if wheelhouse is not None:
        platform = known_platform(request.platform)
        out = exporting.export(s, lk, wheelhouse, reporter, platform=platform)
        reporter(f"wrote {out}: {len(lk.packages)} files, every sha256 checked against {path}")
    if request.with_jit:
        assert wheelhouse is not None
        env_dir = (request.env_dir or build.default_env_dir(s)).absolute()
        carried = exporting.export_jit(env_dir, wheelhouse)
        reporter(
            f"carried {carried} JIT result(s) of {env_dir} into "
            f"{wheelhouse / exporting.JIT_DIR}: `cudaenv build --offline --wheelhouse` places "
            "them in the machine's store"
        )
    if request.pylock is not None:
        reporter(f"asking uv for the URL of every file of {path} on this machine's index")
        command = command_line(["export", request.spec, "--pylock", str(request.pylock)])
        exporting.export_pylock(s, lk, request.pylock, command=command)
        reporter(f"wrote {request.pylock}: {len(lk.packages)} packages, every sha256 as in {path}")


# --------------------------------------------------------------------------- the JIT store


def jit_store_here() -> jit_store.Store:
    """This machine's JIT store, made and checked; UsageError when it is off or unusable."""
    from builder.paths import jit_store_dir

    root = jit_store_dir()
    if root is None:
        raise UsageError("the JIT store is off (CUDAENV_JIT_STORE=off)")
    store = jit_store.Store(root)
    try:
        store.ready()
    except jit_store.StoreError as exc:
        raise UsageError(f"the JIT store cannot be used: {exc}") from None
    return store


def _remote_for(s: spec.EnvSpec) -> jit_remote.Remote:
    from builder import jit_share, project

    try:
        remote = jit_share.configured(setting=project.settings_for(s.source).jit_remote)
    except jit_share.ShareError as exc:
        raise UsageError(str(exc)) from None
    if remote is None:
        raise UsageError(
            "no JIT remote: set CUDAENV_JIT_REMOTE=oci://HOST[:PORT]/REPO, or jit-remote in "
            "[tool.cudaenv] of the project's pyproject.toml"
        )
    return remote


def _index_tag(s: spec.EnvSpec) -> str:
    from builder import jit_share

    lk = lock.read(lock_file(s), spec=s)
    return jit_share.index_tag(lk.content_hash().removeprefix("sha256:"), platforms.host_name())


def store_push(spec_arg: str, env_dir: Path | None) -> tuple[int, list[str], str]:
    """Push every store entry the built env of ``spec_arg`` used (a warmer's job), and the
    list of their keys under the tag of the spec's lock; (pushed, warnings, tag)."""
    from builder import jit_share

    s, env = built_env(spec_arg, env_dir)
    used = jit_store.used_entries(env)
    if not used:
        raise BuildError(
            f"{env} has used no JIT results from the store: verify it first (`cudaenv verify "
            f"{spec_arg}`) with the store on"
        )
    remote, tag = _remote_for(s), _index_tag(s)
    pushed, warnings = jit_share.push_env(jit_store_here(), used, remote, tag)
    return pushed, warnings, tag


def store_pull(spec_arg: str) -> tuple[int, list[str], str]:
    """Add to this machine's store every entry a warmer pushed for the spec's lock."""
    from builder import jit_share

    s = load_spec(spec_arg)
    remote, tag = _remote_for(s), _index_tag(s)
    added, warnings = jit_share.pull_env(jit_store_here(), remote, tag)
    return added, warnings, tag


# --------------------------------------------------------------------------- audit


@dataclass(frozen=True, kw_only=True)
class AuditRequest:
    """What `cudaenv audit` takes: a spec's built env, or any interpreter's env."""

    spec: str | None = None
    python: str | None = None
    env_dir: Path | None = None
    archs: tuple[archs.Arch, ...] | None = None
    probe: bool = True  # import the stack in the env and read what its process maps


def audit(request: AuditRequest, reporter: Reporter) -> audit_.Audit:
    """Audit an env for its target archs: ``request.archs``, else (a spec's env) the env's own
    list, else each visible GPU's; the driver's CUDA bounds which PTX counts."""
    from builder import audit as auditing
    from builder import driver, interpreters, manifest
    from builder.cudaversion import CudaVersion

    if (request.spec is None) == (request.python is None):
        raise UsageError("audit takes a SPEC or --python PATH (one of them)")
    if request.spec is not None:
        _, env = built_env(request.spec, request.env_dir)
    else:
        assert request.python is not None
        env = interpreters.python_arg(request.python).absolute().parent.parent
    found = manifest.try_read(env)
    targets = request.archs
    if targets is None and found is not None and request.spec is not None:
        targets = found.archs
    if targets is None:
        gpus, why = archs.visible_gpus()
        targets = tuple(a for g in gpus if (a := g.arch(None)) is not None)
        if not targets:
            raise UsageError(f"audit needs --archs here: {why or 'no GPU is visible'}")
    seen = driver.detect()
    driver_cuda = seen.newest_cuda() if seen is not None else None
    probe = None
    if request.probe and (env / "bin" / "python").exists():
        modules = auditing.import_names(env)
        probe = (env / "bin" / "python", modules, None)
        reporter(f"importing {', '.join(modules)} in {env} to read what one process maps")
    reporter(f"reading the device code of every binary in {env}")
    cache = auditing.ScanCache.default()
    env_cuda = CudaVersion.read(found.cuda) if found is not None else None
    major = env_cuda.major if env_cuda is not None else None
    return auditing.run(
        env, targets, driver_cuda=driver_cuda, cache=cache, major=major, probe=probe
    )


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


def fleet_of(s: spec.EnvSpec, targets_file: Path | None) -> tuple[targets_.Target, ...]:
    """The targets a command judges: ``--targets FILE``, else the spec's own."""
    from builder import targets

    return targets.load_file(targets_file) if targets_file is not None else s.targets


def judge_targets(
    s: spec.EnvSpec,
    lk: lock.Lock,
    fleet: Sequence[targets_.Target],
    reporter: Reporter,
) -> Judged:
    """Each target's verdict from the lock's wheels of its platform: the exported wheelhouse
    of an index-neutral lock when it holds files, else the index uv is configured with."""
    from builder import fleet as fleet_mod

    house = None
    if lk.wheelhouse is not None:
        d = lock_file(s).parent / lk.wheelhouse
        house = d if d.is_dir() and any(d.glob("*.whl")) else None
    verdicts = fleet_mod.judge(s, lk, fleet, reporter, wheelhouse=house)
    return Judged(spec=s, lock=lk, verdicts=tuple(verdicts))


def audit_targets(spec_arg: Path | str, targets_file: Path | None, reporter: Reporter) -> Judged:
    """`cudaenv audit SPEC` with targets: every target judged from the spec's current lock."""
    s = load_spec(spec_arg)
    fleet = fleet_of(s, targets_file)
    if not fleet:
        raise UsageError(f"{spec_arg}: no targets: give --targets FILE or a `targets:` key")
    path = lock_file(s)
    if not path.exists():
        raise BuildError(f"{path} does not exist: `cudaenv lock {spec_arg}` first")
    lk = lock.read(path, spec=s)
    if lk.fingerprint != s.fingerprint():
        raise BuildError(f"{path} is stale for {spec_arg}: re-lock with `cudaenv lock {spec_arg}`")
    return judge_targets(s, lk, fleet, reporter)


# --------------------------------------------------------------------------- a matrix cell


def cell_main(argv: Sequence[str]) -> int:
    """``python -m builder.pipeline REQUEST.json``: one matrix cell's process. Runs the
    :class:`BuildRequest` as `cudaenv build` would, its output on this process's stdout and
    stderr (the cell's log), and exits with the code `cudaenv build` would."""
    say = Reporter()

    def body() -> int:
        from builder import jsondoc

        if len(argv) != 1:
            raise UsageError("usage: python -m builder.pipeline REQUEST.json")
        request = BuildRequest.from_json(jsondoc.load(Path(argv[0]), "build request"), argv[0])
        _, verified = build_and_verify(request, say, show=print)
        if verified is not None:
            raise_verdict(verified)
        return 0

    return run_main(body, say)


if __name__ == "__main__":
    sys.exit(cell_main(sys.argv[1:]))
