"""`cudaenv verify` (and the verify a build or adopt runs): what verifying an env means
(``spec_target`` for a spec's built env, ``python_target`` for any interpreter), the checks
run and the reports written (``verify_and_report``), and the error a report amounts to
(``verdict``)."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.commands.args import VerifyArgs
from builder.commands.pipeline import built_env, jit_remote_for, lock_file, parse_archs
from builder.core import platforms, settings
from builder.core.errors import CudaenvError, ToolMissing, UsageError, VerifyFailed
from builder.core.reporter import NOTHING_BUILT, Reporter
from builder.machine import archs
from builder.spec import envspec as spec
from builder.spec import lock

if TYPE_CHECKING:
    from builder import verify
    from builder.env.manifest import Manifest
    from builder.verify import report

# verify and report are imported where used: a `cudaenv build` without --verify loads
# neither the checks nor the report templates.


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
        jit_remote=_remote_url(s.source),
        packages=(*(("torch",) if s.torch else ()), *s.packages),
        keep_going=keep_going,
    )


def _remote_url(spec_source: Path | None) -> str | None:
    remote = jit_remote_for(spec_source)
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


def request(args: VerifyArgs) -> VerifyRequest:
    """What `cudaenv verify` was asked (its arguments, typed)."""
    from builder import verify

    return VerifyRequest(
        spec=str(args.spec) if args.spec is not None else None,
        python=args.python,
        env_dir=args.env_dir,
        checks=verify.parse_checks(args.checks) if args.checks else None,
        archs=parse_archs(args.archs) if args.archs else None,
        fresh=args.fresh,
        keep_going=args.keep_going,
    )


def verify_target(request: VerifyRequest) -> tuple[verify.Target, Manifest | None]:
    """The target of a :class:`VerifyRequest`, and the env's manifest where it has one."""
    from builder.core.paths import cache_dir
    from builder.env import manifest
    from builder.machine import interpreters

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
    from builder import verify
    from builder.env import manifest

    root = python.absolute().parent.parent
    found = manifest.try_read(root)
    if archs_override is None:
        from_env = settings.current().flashinfer_arch_list
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
        jit_remote=_remote_url(None),
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
    from builder import verify
    from builder.core.proc import atomic_write_text
    from builder.verify import report

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
