"""`cudaenv build` (and a matrix cell, and ``add``'s rebuild): one :class:`BuildArgs` of one spec
through resolve → build → verify, leaving a build record (report.BuildRecord) however it
ends."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.commands.args import BuildArgs
from builder.commands.pipeline import (
    ensure_lock,
    judge_targets,
    known_platform,
    load_spec,
    lock_file,
)
from builder.commands.verify import spec_target, verdict, verify_and_report
from builder.core import platforms
from builder.core.errors import CudaenvError, SpecError, ToolMissing, UsageError, VerifyFailed
from builder.core.reporter import Reporter, silent
from builder.machine import archs, driver
from builder.spec import envspec as spec
from builder.spec import lock

if TYPE_CHECKING:
    from builder.env.manifest import Manifest
    from builder.verify import report

# build, export and report are imported where used: `cudaenv lock` and `plan` load none of
# them.


def requests(args: BuildArgs) -> list[BuildArgs]:
    """One build of one env per spec of `cudaenv build` (each is what a matrix cell runs)."""
    if args.env_dir and len(args.specs) > 1:
        raise UsageError("--env-dir takes one spec")
    return [dataclasses.replace(args, specs=(path,)) for path in args.specs]


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


def cross_platform(request: BuildArgs) -> str | None:
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
    request: BuildArgs, reporter: Reporter, show: Callable[[str], None]
) -> tuple[Built, report.VerifyReport | None]:
    """The whole :class:`Run`: build, ``show`` the env's path, verify when asked and ``show``
    the summary. The verdict is the caller's (:func:`raise_verdict`)."""
    with Run(request, reporter) as run:
        built = run.build()
        show(str(built.path))
        verified = run.verify(built) if request.verify else None
        if verified is not None:
            from builder.verify import report

            show(report.terminal(verified))
    return built, verified


def _gate_required_targets(s: spec.EnvSpec, lk: lock.Lock, say: Reporter) -> None:
    """Before anything is installed: a stack that cannot run on a class the spec must serve
    is refused here (VerifyFailed), not found out at that class's first request."""
    required = [t for t in s.targets if t.required]
    if not required:
        return
    done = judge_targets(s, lk, required, say)
    if done.failures:
        raise VerifyFailed(
            f"{s.name} cannot run on {len(done.failures)} required target(s), nothing "
            "was installed: "
            + "; ".join(v.line() for v in done.failures)
            + " (--no-target-check builds anyway)"
        )
    say(f"every required target runs it: {', '.join(t.name for t in required)}")


def _take_wheelhouse(lk: lock.Lock, wheelhouse: Path, cross: str | None, say: Reporter) -> None:
    """``--wheelhouse``: checked to hold the lock's files before anything is built, and the
    JIT results `cudaenv export --with-jit` carried in it added to the store."""
    from builder.env import export

    export.check_wheelhouse(lk, wheelhouse, cross)
    imported, trouble = export.import_jit(wheelhouse)
    if trouble:
        say(f"warning: {trouble}")
    if imported:
        say(
            f"{imported} JIT result(s) from {wheelhouse / export.JIT_DIR} added to the "
            "store; each is used only where its toolkit, flags and inputs match"
        )


class Run:
    """One :class:`BuildArgs` going through resolve → build → verify. Used as a context
    manager: with ``request.record`` it leaves a build record (report.BuildRecord) saying at
    which stage and how the run ended, whatever stopped it (an error, Ctrl-C)."""

    def __init__(self, request: BuildArgs, reporter: Reporter | None = None) -> None:
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
        from builder.env import build

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
            say(
                driver.require(s.cuda_version, driver.current(), needs=request.spec, older="a spec")
            )
        lk = ensure_lock(
            s, request.spec, offline=request.offline, relock=request.relock, reporter=say
        )
        if not request.no_target_check:
            _gate_required_targets(s, lk, say)
        self.stage = "build"
        started = time.monotonic()
        say(
            f"building {s.name}: python {s.python}, torch {lk.torch or '-'}, CUDA {s.cuda} "
            f"({s.toolchain.source} toolchain), archs {archs.flashinfer_spelling(s.archs)}"
        )
        wheelhouse = request.wheelhouse.absolute() if request.wheelhouse else None
        if wheelhouse is not None:
            _take_wheelhouse(lk, wheelhouse, cross, say)
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
        if cross is None:  # a reused env is judged only for entries warmed since its last
            prefetch_into(s, lk, result.path, say, only_new=result.reused)
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


def env_archs(env: Path, s: spec.EnvSpec) -> tuple[archs.Arch, ...]:
    """The arch list the env was built for (its manifest), else the spec's."""
    from builder.env import manifest

    found = manifest.try_read(env)
    return found.archs if found is not None else s.archs


def prefetch_into(
    s: spec.EnvSpec, lk: lock.Lock, env: Path, say: Reporter, *, only_new: bool = False
) -> None:
    """Place the warmed FlashInfer modules that fit the env just built (builder/jit/prefetch.py):
    one line, at most one warning, never a failed build. ``only_new`` (an env reused as it
    was): silent unless the store holds modules its last prefetch did not judge."""
    from builder.commands.pipeline import jit_remote_for
    from builder.jit import prefetch
    from builder.jit import share as jit_share

    versions = [
        p.version for p in lk.packages_on(platforms.host_name()) if p.name == "flashinfer-python"
    ]
    if not versions:
        return
    try:
        remote = jit_remote_for(s.source)
    except UsageError as exc:  # a malformed remote: said, and the local store still serves
        say(f"warning: the JIT remote was not used for prefetch: {exc}")
        remote = None
    tag = jit_share.index_tag(lk.content_hash())
    done = prefetch.prefetch(
        env / "bin" / "python",
        flashinfer=versions[0],
        remote=remote,
        tag=tag,
        only_new=only_new,
        archs=archs.flashinfer_spelling(env_archs(env, s)),
        variables=s.env,
    )
    if not (only_new and done.skipped is not None and not done.warnings):
        prefetch.say_prefetched(done, say)


def write_record(
    path: Path,
    stage: str,
    exc: BaseException | None,
    verified: report.VerifyReport | None = None,
) -> None:
    from builder.core.errors import STATUS_OF_EXIT
    from builder.verify import report

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
