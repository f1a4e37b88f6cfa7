"""`cudaenv audit`: an env's binaries judged for its target archs, or (with targets) a
spec's stack judged per fleet target from its lock."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.commands.args import AuditArgs
from builder.commands.pipeline import (
    Judged,
    built_env,
    committed_lock,
    fleet_of,
    judge_targets,
    load_spec,
    parse_archs,
)
from builder.core.errors import UsageError
from builder.core.reporter import Reporter
from builder.machine import archs
from builder.spec import envspec as spec

if TYPE_CHECKING:
    from builder.audit import scan as audit_


@dataclass(frozen=True, kw_only=True)
class AuditRequest:
    """What `cudaenv audit` takes: a spec's built env, or any interpreter's env."""

    spec: str | None = None
    python: str | None = None
    env_dir: Path | None = None
    archs: tuple[archs.Arch, ...] | None = None
    probe: bool = True  # import the stack in the env and read what its process maps


def request(args: AuditArgs) -> AuditRequest:
    """What `cudaenv audit` was asked (its arguments, typed)."""
    return AuditRequest(
        spec=str(args.spec) if args.spec is not None else None,
        python=args.python,
        env_dir=args.env_dir,
        archs=parse_archs(args.archs) if args.archs else None,
        probe=not args.no_probe,
    )


def audit(request: AuditRequest, reporter: Reporter) -> audit_.Audit:
    """Audit an env for its target archs: ``request.archs``, else (a spec's env) the env's own
    list, else each visible GPU's; the driver's CUDA bounds which PTX counts."""
    from builder.audit import scan as auditing
    from builder.core.cudaversion import CudaVersion
    from builder.env import manifest
    from builder.machine import driver, interpreters

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
    seen = driver.current()
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


def audit_targets(
    s: spec.EnvSpec, spec_arg: Path | str, targets_file: Path | None, reporter: Reporter
) -> Judged:
    """`cudaenv audit SPEC` with targets: every target judged from the spec's current lock."""
    fleet = fleet_of(s, targets_file)
    if not fleet:
        raise UsageError(f"{spec_arg}: no targets: give --targets FILE or a `targets:` key")
    return judge_targets(s, committed_lock(s, spec_arg), fleet, reporter)


@dataclass(frozen=True, kw_only=True)
class Audited:
    """What `cudaenv audit` found: an env's binaries judged (``env``), or a stack judged per
    fleet target from its lock (``fleet``)."""

    env: audit_.Audit | None = None
    fleet: Judged | None = None

    def text(self, *, as_json: bool) -> str:
        from builder.audit import fleet
        from builder.audit import scan as auditing

        if self.fleet is not None:
            done = self.fleet
            if as_json:
                return json.dumps(fleet.to_json(done.spec, done.lock, done.verdicts), indent=2)
            return fleet.render(done.spec, done.verdicts)
        assert self.env is not None
        return json.dumps(self.env.to_json(), indent=2) if as_json else auditing.render(self.env)

    def markdown(self) -> str:
        from builder.audit import fleet
        from builder.audit import scan as auditing

        if self.fleet is not None:
            return fleet.markdown(self.fleet.spec, self.fleet.verdicts)
        assert self.env is not None
        return auditing.markdown(self.env)

    def failure(self) -> str | None:
        """Why the audit fails (exit 5), None where it passes."""
        if self.fleet is not None and self.fleet.failures:
            names = ", ".join(v.target.name for v in self.fleet.failures)
            return f"{self.fleet.spec.name} cannot run on {len(self.fleet.failures)} target(s): {names}"
        if self.env is not None and self.env.failures:
            return f"audit: {len(self.env.failures)} required binary problem(s); see above"
        return None


def run_audit(request: AuditRequest, targets_file: Path | None, reporter: Reporter) -> Audited:
    """`cudaenv audit`: a SPEC alone with fleet targets (``--targets FILE`` or its own) is
    judged per target from its lock (no env needed); otherwise its built env (or
    ``--python``'s) is audited for its archs."""
    alone = request.python is None and request.env_dir is None and request.archs is None
    if request.spec is not None and alone:
        s = load_spec(request.spec)
        if targets_file is not None or s.targets:
            return Audited(fleet=audit_targets(s, request.spec, targets_file, reporter))
    if targets_file is not None:
        raise UsageError(
            "--targets judges a SPEC's lock: it takes no --python, --env-dir or --archs"
        )
    return Audited(env=audit(request, reporter))
