"""`cudaenv warm`: JIT-build, for each target arch list, the FlashInfer modules a server loads
at its first requests, into the JIT store, and push them to the JIT remote when one is set
(with the spec's warm list, the index tag of its lock and platform, that ``build`` on a node
pulls and places: builder/jit/prefetch.py).

The modules come from FlashInfer's own generators (builder/probe/jit_warm.py runs in the env's
interpreter, one process per arch list): the parts of its AOT list a server uses (norm, rope,
page, sampling, cascade, quantization, top-k, each fused activation) and the batch prefill
and decode attention of each head dim and dtype asked for. An arch list is one target because
FlashInfer compiles one module for the whole list it is given (``FLASHINFER_CUDA_ARCH_LIST``),
and an env's start-up hook gives it the spec's whole list: that list is the default.

Each finished module is in the store at once, so an interrupted warm keeps it and a rerun
says "already warm" for it. A module FlashInfer cannot build for a list is listed with
FlashInfer's own reason, and the exit code is 4 (BuildError) when one was.
"""

from __future__ import annotations

import fnmatch
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder.commands.args import WarmArgs
from builder.commands.pipeline import built_env, jit_remote_for, parse_archs
from builder.commands.store import index_tag_for, jit_store_here
from builder.core import proc, settings
from builder.core.errors import BuildError, UsageError
from builder.core.reporter import Reporter
from builder.jit import prefetch
from builder.jit import share as jit_share
from builder.machine import archs, box

if TYPE_CHECKING:
    from builder.jit.oci import Remote
    from builder.spec.envspec import EnvSpec
    from builder.spec.lockmodel import Lock, LockedPackage

# One module may compile for half an hour on a big box (flashinfer#4884's fused MoE): a whole
# warm of one arch list is bounded, generously, by a day.
WARM_TIMEOUT = 24 * 3600.0
DTYPES = ("bf16", "fp16")
DEFAULT_HEAD_DIMS = (128,)
DEFAULT_DTYPES = ("bf16",)
BUILT, WARM, FAILED = "built", "warm", "failed"


@dataclass(frozen=True, kw_only=True)
class WarmRequest:
    spec: str
    env_dir: Path | None = None
    archs: tuple[str, ...] = ()  # arch lists, each one target; () the spec's
    modules: tuple[str, ...] = ()  # fnmatch patterns; () all of the default set
    head_dims: tuple[int, ...] = DEFAULT_HEAD_DIMS
    dtypes: tuple[str, ...] = DEFAULT_DTYPES


def request(args: WarmArgs) -> WarmRequest:
    for head_dim in args.head_dim:
        if not 16 <= head_dim <= 1024:
            raise UsageError(f"--head-dim {head_dim}: expected a head dim from 16 to 1024")
    return WarmRequest(
        spec=args.spec,
        env_dir=args.env_dir,
        archs=args.archs,
        modules=args.modules,
        head_dims=tuple(dict.fromkeys(args.head_dim)) or DEFAULT_HEAD_DIMS,
        dtypes=tuple(dict.fromkeys(args.dtype)) or DEFAULT_DTYPES,
    )


@dataclass(frozen=True, kw_only=True)
class ModuleResult:
    target: str  # the arch list, as FlashInfer spells it
    module: str
    status: str  # BUILT, WARM or FAILED
    seconds: float
    reason: str = ""
    entry: str | None = None  # v3/ab/KEY/VARIANT in the store

    def line(self) -> str:
        if self.status == FAILED:
            return f"{self.module} ({self.target}): failed: {self.reason}"
        how = "already warm" if self.status == WARM else f"built in {self.seconds:.1f} s"
        return f"{self.module} ({self.target}): {how}"


@dataclass(kw_only=True)
class WarmReport:
    results: list[ModuleResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    pushed: int = 0
    remote: str | None = None
    tag: str | None = None
    seconds: float = 0.0

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def compile_seconds(self) -> float:
        return sum(r.seconds for r in self.results if r.status == BUILT)

    def summary(self) -> str:
        share = f"{self.pushed} pushed to {self.remote} ({self.tag})" if self.remote else ""
        return (
            f"{len(self.results)} module(s): {self.count(BUILT)} built, {self.count(WARM)} "
            f"already warm, {self.count(FAILED)} failed, in {self.seconds:.1f} s "
            f"({self.compile_seconds:.1f} s compiling)" + (f"; {share}" if share else "")
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "modules": [vars(r) for r in self.results],
            "built": self.count(BUILT),
            "warm": self.count(WARM),
            "failed": self.count(FAILED),
            "seconds": round(self.seconds, 3),
            "compile_seconds": round(self.compile_seconds, 3),
            "pushed": self.pushed,
            "remote": self.remote,
            "tag": self.tag,
            "warnings": self.warnings,
        }


def clock_text(seconds: float) -> str:
    whole = max(round(seconds), 0)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


class Progress:
    """The count and the ETA of one target's modules, said on stderr (``--quiet``: not).
    The ETA is the mean time of the modules compiled so far times those left; a module the
    store already held costs no time and does not count towards the mean."""

    def __init__(self, target: str, say: Reporter, clock: Callable[[], float] = time.monotonic):
        self.target, self.say, self.clock = target, say, clock
        self.total = 0
        self.done = 0
        self.compiled: list[float] = []
        self.begun = 0  # modules started: several run at once
        self.workers = 1

    def eta(self) -> float | None:
        if not self.compiled:
            return None
        left = sum(self.compiled) / len(self.compiled) * (self.total - self.done)
        return left / max(1, min(self.workers, self.total - self.done))

    def event(self, doc: dict[str, Any]) -> None:
        kind = doc.get("event")
        if kind == "plan":
            self.total = int(doc.get("total") or 0)
            self.workers = max(1, int(doc.get("workers") or 1))
            at_once = f", {self.workers} at once" if self.workers > 1 else ""
            slots = int(doc.get("slots") or 0)
            jobs = f" ({slots} compile slots)" if slots else ""
            self.say(f"warming {self.total} FlashInfer module(s) for {self.target}{at_once}{jobs}")
        elif kind == "waiting":
            since = float(doc.get("since") or 0.0)
            ago = f", started {clock_text(time.time() - since)} ago" if since > 0 else ""
            what = doc.get("what") or "the same module"
            holder = f"pid {doc.get('pid')}'s compile of {what}"
            if what == "a free compile slot":
                holder = "a free compile slot"
                ago = ""
            self.say(f"{doc.get('module')} ({self.target}): waiting for {holder}{ago}")
        elif kind == "start":
            eta = self.eta()
            left = f", ETA {clock_text(eta)}" if eta is not None else ""
            self.begun += 1
            self.say(f"[{self.begun}/{self.total}{left}] {doc.get('module')} ({self.target})")
        elif kind == "done":
            self.done += 1
            if doc.get("status") == BUILT:
                self.compiled.append(float(doc.get("seconds") or 0.0))


def targets(spec_archs: tuple[archs.Arch, ...], given: tuple[str, ...]) -> list[str]:
    """The arch lists to warm, each spelled as FlashInfer reads it."""
    lists = [parse_archs(text) for text in given] or [spec_archs]
    return list(dict.fromkeys(archs.flashinfer_spelling(a) for a in lists))


def warm(req: WarmRequest, say: Reporter) -> WarmReport:
    """Every target of ``req`` warmed, in turn; what each module came to."""
    for pattern in req.modules:
        if not pattern.strip():
            raise UsageError("--modules: an empty pattern")
    for dtype in req.dtypes:
        if dtype not in DTYPES:
            raise UsageError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    s, env = built_env(req.spec, req.env_dir)
    store = jit_store_here()
    remote = jit_remote_for(s.source)
    report = WarmReport(remote=remote.url if remote is not None else None)
    report.tag = index_tag_for(s) if remote is not None else None
    started = time.monotonic()
    own = archs.flashinfer_spelling(s.archs)
    lk, sources, flashinfer = _what_compiles(s, env, req)
    for target in targets(s.archs, req.archs):
        planned: list[dict[str, Any]] = []
        results: list[ModuleResult] = []
        warnings: list[str] = []
        if flashinfer:
            results, warnings = warm_target(
                env, store.root, target, req, remote, say, planned, sources=bool(sources)
            )
            mine, notes = warm_own_kernel(env, target, req, s.env, say)
            results, warnings = results + mine, warnings + notes
        results += warm_sources(env, s, lk, sources, target, store.root, say)
        if target == own:
            # What the env's own servers generate (its hook's arch list): the plan the next
            # env like this one is placed from without FlashInfer (builder/store/plans.py).
            prefetch.keep_plans(store, env, planned)
        report.results += results
        report.warnings += warnings
        entries = [r.entry for r in results if r.entry is not None]
        if remote is not None and report.tag is not None and entries:
            pushed, failed = jit_share.push_env(store, entries, remote, report.tag)
            report.pushed += pushed
            report.warnings += failed
            if target == own:
                # With the entries, the plan that places them: a node's first env of this
                # signature then needs no FlashInfer import to take them.
                warning = jit_share.push_plan(store, env, remote)
                report.warnings += [warning] if warning else []
    report.seconds = time.monotonic() - started
    return report


def _what_compiles(
    s: EnvSpec, env: Path, req: WarmRequest
) -> tuple[Lock, list[LockedPackage], bool]:
    """The spec's lock, the packages of it compiled from their sdists that ``req`` chose,
    and whether the env has FlashInfer (an env without it warms its source builds alone)."""
    from builder.commands.pipeline import lock_file
    from builder.core import platforms
    from builder.env import manifest, sourcebuild
    from builder.spec import lock

    lk = lock.read(lock_file(s), spec=s)
    sources = sourcebuild.source_packages(lk.packages_on(platforms.host_name()))
    if req.modules:
        sources = [p for p in sources if any(fnmatch.fnmatchcase(p.name, m) for m in req.modules)]
    found = manifest.try_read(env)
    flashinfer = found is None or any(name == "flashinfer-python" for name, _ in found.packages)
    if not flashinfer and req.modules and not sources:
        raise UsageError(
            f"--modules {' '.join(req.modules)}: {env} has no FlashInfer, and no package the "
            "spec compiles from its sdist matches"
        )
    return lk, sources, flashinfer


def warm_sources(
    env: Path,
    s: EnvSpec,
    lk: Lock,
    sources: list[LockedPackage],
    target: str,
    store_root: Path,
    say: Reporter,
) -> list[ModuleResult]:
    """Each package of ``sources`` compiled for ``target`` into the store (builder/env/
    sourcebuild.py ``build_ahead``), so an env of those archs installs it with no compile."""
    from builder.env import manifest, sourcebuild

    results = []
    nvcc = manifest.read(env).nvcc
    for pkg in sources:
        name = f"{pkg.name} {pkg.version} (sdist)"
        try:
            ahead = sourcebuild.build_ahead(
                env, s, lk, pkg, parse_archs(target), nvcc=nvcc, progress=say
            )
        except BuildError as exc:
            result = ModuleResult(
                target=target, module=name, status=FAILED, seconds=0.0, reason=str(exc)
            )
        else:
            status = WARM if ahead.reused else BUILT if ahead.entry is not None else FAILED
            entry = str(ahead.entry.relative_to(store_root)) if ahead.entry else None
            result = ModuleResult(target=target, module=name, status=status,
                                  seconds=ahead.seconds, reason=ahead.why, entry=entry)  # fmt: skip
        results.append(result)
        say(result.line())
    return results


def compile_slots(target: str) -> int:
    """The compiles a warm of ``target`` runs at once (shared by the modules it builds
    together: builder/probe/jit_warm.py's jobserver); 0 when the user set MAX_JOBS, which
    then holds for each module built one after another."""
    if settings.child_environ().get("MAX_JOBS"):
        return 0
    return box.compile_jobs(archs.nvcc_threads(target))


def probe_env(store_root: Path, target: str, remote: Remote | None) -> dict[str, str]:
    """The warm probe's environment: the arch list for this process, the store, and (with a
    remote) this interpreter to pull a miss through; cudaenv pushes afterwards itself. The
    compile slots are in the request (:func:`compile_slots`), not in MAX_JOBS."""
    env = settings.child_environ(
        CUDAENV_ARCH_LIST=target.replace(" ", ","),
        CUDAENV_JIT_STORE=str(store_root),
        CUDAENV_JIT_PUSH=None,
        CUDAENV_JIT_SHARE=None,
        CUDAENV_JIT_REMOTE="off",
    )
    if remote is not None:
        env["CUDAENV_JIT_REMOTE"] = remote.url
        env["CUDAENV_JIT_SHARE"] = json.dumps([sys.executable, "-m", "builder.jit.share"])
    return env


def warm_target(
    env: Path,
    store_root: Path,
    target: str,
    req: WarmRequest,
    remote: Remote | None,
    say: Reporter,
    planned: list[dict[str, Any]] | None = None,
    sources: bool = False,
) -> tuple[list[ModuleResult], list[str]]:
    """One probe process warming ``target`` (an arch list): its results and warnings.
    ``sources``: the patterns of ``req`` also chose packages compiled from their sdists."""
    script = prefetch.probe_script()
    progress = Progress(target, say)
    results: list[ModuleResult] = []
    warnings: list[str] = []
    ended: dict[str, Any] = {}

    def on_line(line: str) -> None:
        try:
            doc = json.loads(line)
        except ValueError:
            return  # FlashInfer or a library printed to stdout: not an event
        if not isinstance(doc, dict):
            return
        progress.event(doc)
        if doc.get("event") == "done":
            result = ModuleResult(
                target=target,
                module=str(doc.get("module")),
                status=str(doc.get("status")) if doc.get("status") in (BUILT, WARM) else FAILED,
                seconds=float(doc.get("seconds") or 0.0),
                reason=str(doc.get("reason") or ""),
                entry=str(doc["entry"]) if isinstance(doc.get("entry"), str) else None,
            )
            results.append(result)
            say(result.line())
            if planned is not None and isinstance(doc.get("planned"), dict):
                planned.append(doc["planned"])
            warnings.extend(str(w) for w in doc.get("warnings") or [])
        elif doc.get("event") == "end":
            ended.update(doc)

    request_doc = {
        "modules": list(req.modules),
        "head_dims": list(req.head_dims),
        "dtypes": list(req.dtypes),
        "jobs": compile_slots(target),
    }
    done = proc.run_lines(
        [env / "bin" / "python", script, "warm"],
        on_line,
        env=prefetch.with_env_bin(env / "bin", probe_env(store_root, target, remote)),
        input_text=json.dumps(request_doc),
        timeout=WARM_TIMEOUT,
    )
    if ended.get("error") or not ended:
        why = str(ended.get("error") or done.stderr.strip()[-2000:] or f"exit {done.returncode}")
        raise BuildError(f"warming {target} in {env} failed: {why}")
    mine = any(fnmatch.fnmatchcase(OWN_KERNEL, p) for p in req.modules)
    if req.modules and not progress.total and not mine and not sources:
        raise UsageError(
            f"--modules {' '.join(req.modules)}: no module of the default set matches "
            f"(FlashInfer's names, like silu_and_mul, norm, batch_decode_*, {OWN_KERNEL}: "
            "cudaenv's own kernel, or a package the spec compiles from its sdist)"
        )
    return results, jit_share.summarised(list(dict.fromkeys(warnings)))


# cudaenv's own top-k/top-p kernel (builder/kernels/), which verify compiles for each arch.
OWN_KERNEL = "topk_topp"


def warm_own_kernel(
    env: Path,
    target: str,
    req: WarmRequest,
    variables: tuple[tuple[str, str], ...],
    say: Reporter,
) -> tuple[list[ModuleResult], list[str]]:
    """cudaenv's own kernel for each arch of ``target``, compiled through the store as
    verify compiles it (the same key: the env's nvcc, host compiler and NVCC_* variables),
    so a node's verify reuses it like FlashInfer's modules; a ``--modules`` list leaves it
    out unless a pattern matches ``topk_topp``."""
    import tempfile

    from builder.verify.kernel_compile import build_kernel

    if req.modules and not any(fnmatch.fnmatchcase(OWN_KERNEL, p) for p in req.modules):
        return [], []
    environ = prefetch.runtime_environ(env, variables)
    environ.update(CUDAENV_JIT_PUSH="0", CUDAENV_JIT_REMOTE="off")  # cudaenv pushes after
    nvcc = env / "cuda-home" / "bin" / "nvcc"
    results: list[ModuleResult] = []
    notes: list[str] = []
    # A work directory of its own: the kernel an earlier verify left in the env would be
    # reused from there, never from (or into) the store.
    with tempfile.TemporaryDirectory(prefix="cudaenv-warm-kernel-") as work:
        for arch in parse_archs(target):
            built = build_kernel(nvcc, arch, Path(work), env=environ, owner=str(env))
            notes += [n for n in built.notes if n not in notes]
            status = FAILED if built.error else WARM if built.stored is not None else BUILT
            why = built.error or ""
            if status != FAILED and built.entry is None:
                status = FAILED
                why = "built, but not kept in the JIT store: " + ("; ".join(built.notes) or "?")
            result = ModuleResult(
                target=target,
                module=f"{OWN_KERNEL} {arch}",
                status=status,
                seconds=built.seconds,
                reason=why,
                entry=built.entry,
            )
            results.append(result)
            say(result.line())
    return results, notes


def outcome(
    report: WarmReport, say: Reporter, as_json: bool, show: Callable[[str], None] = print
) -> int:
    """``show`` the report (JSON with ``as_json``; the CLI hands ``print``), then the verdict:
    BuildError (exit 4) when a module could not be built for a target, naming how many."""
    for w in report.warnings:
        say(f"warning: {w}")
    if as_json:
        show(json.dumps(report.to_json(), indent=2))
    else:
        for r in report.results:
            if r.status == FAILED:
                show(r.line())
        show(report.summary())
    failed = report.count(FAILED)
    if failed:
        raise BuildError(
            f"{failed} of {len(report.results)} FlashInfer module(s) could not be built (each "
            "listed with FlashInfer's reason); the others are in the store"
        )
    return 0
