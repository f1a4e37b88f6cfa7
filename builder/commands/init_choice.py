"""How `cudaenv init` chooses the env it writes: the CUDA candidates tried, newest first, on
the box's driver, toolkits and platform (and the fleet's drivers), each tried with one
resolution of the asked packages and torch held to the candidate's minor; the asked packages'
newest releases tried first; the winner's pins and the notes on what was added.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from builder.commands.init_request import PYTHON, Request
from builder.core import platforms
from builder.core.cudaversion import CudaVersion
from builder.core.errors import ResolveError, UsageError
from builder.core.reporter import Reporter
from builder.machine import archs, driver
from builder.machine import targets as targets_mod
from builder.machine.archs import Arch
from builder.machine.box import Box
from builder.spec import envspec as spec
from builder.spec import resolve
from builder.spec.lock import LockedPackage
from builder.verify.imports import SERVERS

# The CUDA minors torch's PyPI wheels are built for, newest first (each release's own pins:
# torch 2.15 -> 13.2, 2.11-2.14 -> 13.0, 2.8-2.10 -> 12.8). Only the order of trying comes
# from here: whether a set holds on a CUDA is uv's answer and the policy's.
CUDA_CANDIDATES: tuple[CudaVersion, ...] = (
    CudaVersion(major=13, minor=2),
    CudaVersion(major=13, minor=0),
    CudaVersion(major=12, minor=8),
)
# What uv says when a requested name is on no index: the same for every CUDA, so the first
# candidate's answer is the answer.
_UNKNOWN_PACKAGE = ("was not found in the package registry", "not found in the provided package")
# The resolver's own words when the index itself did not answer (resolve.uv_compile).
_NO_INDEX = "the package index did not answer"
# Decoration of uv's error tree, dropped when its reason is put on one line.
# (x, corner, bar, arrow, pipes: written as escapes, they look like letters and dashes.)
_TREE_CHARS = re.compile("^[\\s\u00d7\u2570\u2500\u25b6\u2502\u251c\u252c\u2534\u253c]+")

Outcome = Literal["chosen", "skipped", "refused"]
# One trial resolution: a spec narrowed to one platform, its requirements and constraints ->
# the resolved set (raises ResolveError with uv's reason). Tests pass recorded answers.
Probe = Callable[[spec.EnvSpec, Sequence[str], Sequence[str]], Sequence[LockedPackage]]
# The newest release of one requirement on the index for a spec's platform and Python, or None
# where there is none (raises ResolveError with uv's reason for a name no index has).
Latest = Callable[[spec.EnvSpec, Requirement], "str | None"]
# The serving stacks whose kernels FlashInfer JIT-compiles at their first requests (the table
# verify's imports and flashinfer-jit checks read): a spec for one of them holds FlashInfer,
# asked or not.
JIT_COMPANIONS: dict[str, str] = {
    s.distribution: "flashinfer-python" for s in SERVERS if s.needs_flashinfer
}


# --------------------------------------------------------------------------- choosing


@dataclass(frozen=True, kw_only=True)
class Tried:
    cuda: CudaVersion
    outcome: Outcome
    reason: str

    def line(self) -> str:
        return f"CUDA {self.cuda}: {self.outcome}: {self.reason}"


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The env to write: everything its spec says."""

    cuda: CudaVersion
    torch: str
    packages: tuple[str, ...]  # the spec's packages:, exact pins
    archs: tuple[Arch, ...]
    toolchain: spec.Toolchain
    name: str
    tried: tuple[Tried, ...]
    notes: tuple[str, ...] = ()


def one_line(text: str) -> str:
    """A resolver's or the policy's reason, multi-line as uv and resolve word it, on one line."""
    parts: list[str] = []
    for raw in text.splitlines():
        line = _TREE_CHARS.sub("", raw).strip()
        for prefix in ("- ", "error:", "cause:", "Caused by:"):
            line = line.removeprefix(prefix).strip()
        if not line or line.startswith("No solution found"):
            continue
        parts.append(line)
    return " ".join(parts)


def _uv_reason(exc: ResolveError) -> str:
    """uv's own words from a ResolveError of resolve.uv_compile, without its heading."""
    text = str(exc)
    head, sep, rest = text.partition("\n")
    body = rest if sep and "could not resolve" in head else text
    # resolve's hint about a platform without wheels is for a spec's author; a candidate's
    # refusal is uv's own words only.
    kept = [ln for ln in body.splitlines() if not ln.startswith("(a package without a ")]
    return one_line("\n".join(kept))


def archs_for(request: Request, box: Box, cuda: CudaVersion) -> tuple[Arch, ...]:
    """``--gpu`` (a bare capability spelled as FlashInfer spells it for ``cuda``; a suffix
    given is kept), else each visible GPU's arch for ``cuda``."""
    out: list[Arch] = []
    if request.targets and not request.gpus:
        return targets_mod.archs_for(request.targets, cuda)
    if request.gpus:
        for a in request.gpus:
            arch = a if a.suffix else archs.normalise(a.major, a.minor, cuda)
            if arch not in out:
                out.append(arch)
        return tuple(out)
    for gpu in box.gpus:
        found = gpu.arch(cuda)
        if found is not None and found not in out:
            out.append(found)
    return tuple(out)


def _constraints(cuda: CudaVersion) -> list[str]:
    """Hold torch's CUDA to one minor: as constraints, so they bind only what torch itself
    requires (torch >= 2.11 pins cuda-toolkit, older releases nvidia-cuda-runtime-cu12)."""
    nxt = cuda.next_minor()
    names: tuple[str, ...] = (
        ("cuda-toolkit", "nvidia-cuda-runtime")
        if cuda.major >= 13
        else (f"nvidia-cuda-runtime-cu{cuda.major}",)
    )
    return [f"{n}>={cuda},<{nxt}" for n in names]


def _pin(req: Requirement, version: str) -> str:
    """``vllm`` -> ``vllm==0.33.0``; a requirement with a marker is kept as written (it may
    not even be in the set on this platform)."""
    if req.marker is not None:
        return str(req)
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}=={version}"


def _cuda_tag(cuda: CudaVersion) -> str:
    return f"cu{cuda.major}{cuda.minor}"


def _default_name(request: Request, found: dict[str, str], torch: str, cuda: CudaVersion) -> str:
    if request.packages:
        first = request.packages[0]
        version = found.get(canonicalize_name(first.name))
        stem = (
            f"{canonicalize_name(first.name)}-{version}"
            if version
            else str(canonicalize_name(first.name))
        )
    else:
        stem = f"torch-{torch}"
    return f"{stem}-{_cuda_tag(cuda)}"


def _spec_packages(
    request: Request, found: dict[str, str], cuda: CudaVersion
) -> tuple[list[str], list[str]]:
    """The spec's ``packages:`` (each asked package at the version uv chose, and FlashInfer:
    what the JIT compiles), and notes on what was added."""
    out: list[str] = []
    notes: list[str] = []
    asked = {canonicalize_name(r.name) for r in request.packages}
    for req in request.packages:
        version = found.get(canonicalize_name(req.name))
        out.append(_pin(req, version) if version else str(req))
    fi = found.get("flashinfer-python")
    if fi is not None and "flashinfer-python" not in asked:
        out.append(f"flashinfer-python=={fi}")
        notes.append(f"pinned flashinfer-python=={fi} (what the JIT compiles; chosen by uv)")
    cp = found.get("cuda-python")
    cp_cuda = CudaVersion.read(cp)
    if (
        cp is not None
        and cp_cuda is not None
        and cp_cuda.major != cuda.major
        and "cuda-python" not in asked
    ):
        # FlashInfer asks only cuda-python>=12.0; uv then picks 12.6.2.post1, the old one-piece
        # wheel whose CUDA 12 cuda/bindings/ files overwrite torch's cuda-bindings 13, and
        # `import flashinfer` fails (no cuda.bindings.runtime.cudaLibrary_t).
        want = f"cuda-python>={cuda.major}.0,<{cuda.major + 1}"
        out.append(want)
        notes.append(f"added {want}: uv chose cuda-python {cp}, a CUDA {cp_cuda.major} build")
    return out, notes


def _exact(req: Requirement) -> str | None:
    """The version ``req`` pins exactly (``==1.2``, no wildcard), else None."""
    pins = [sp.version for sp in req.specifier if sp.operator in ("==", "===")]
    return pins[0] if len(pins) == 1 and "*" not in pins[0] else None


def companions(request: Request) -> list[str]:
    """The JIT companions the asked stacks need and the request does not name."""
    asked = {canonicalize_name(r.name) for r in request.packages}
    out: list[str] = []
    for name in sorted(asked):
        want = JIT_COMPANIONS.get(name)
        if want is not None and want not in asked and want not in out:
            out.append(want)
    return out


def newest_releases(
    request: Request, box: Box, latest: Latest, source: Path
) -> dict[str, str | None]:
    """Each asked package's newest release on the index for this box (its exact pin when it
    has one), by canonical name."""
    base = spec.EnvSpec(
        name=request.name or "init", python=PYTHON, cuda=str(request.cuda or CUDA_CANDIDATES[0]),
        source=source,
        platforms=(box.platform,),
    )  # fmt: skip
    out: dict[str, str | None] = {}
    for req in request.packages:
        try:
            out[canonicalize_name(req.name)] = _exact(req) or latest(base, req)
        except ResolveError as exc:
            # An unknown name, or no index: the same answer on every candidate.
            raise ResolveError(f"uv: {_uv_reason(exc)}") from None
    return out


def _at(req: Requirement, version: str | None) -> str:
    """``req`` held to ``version`` (the phase that tries the newest release)."""
    return _pin(req, version) if version is not None and _exact(req) is None else str(req)


def choose(
    request: Request,
    box: Box,
    probe: Probe,
    say: Reporter,
    source: Path,
    latest: Latest | None = None,
) -> Choice:
    """What the user asked comes first: the newest release of each asked package (``latest``
    finds it), on the newest CUDA candidate that release resolves with here; only when no
    candidate takes the newest releases, the newest CUDA whose set resolves with any release,
    saying why the newest was passed over. Each candidate tried is reported through ``say``
    as it is decided. Raises ResolveError (one line) when none does."""
    if not request.gpus and not box.gpus and not request.targets:
        raise UsageError(
            f"no NVIDIA GPU is visible here ({box.gpu_note or 'none listed'}): name the GPUs "
            "the env is for with --gpu ARCH (e.g. --gpu 12.0 --gpu 9.0)"
        )
    if box.platform not in platforms.KNOWN:
        raise ResolveError(
            f"this box is {box.platform}: cudaenv locks {', '.join(platforms.KNOWN)} only"
        )
    newest = newest_releases(request, box, latest, source) if latest is not None else {}
    extra = companions(request)
    torch_req = str(request.torch) if request.torch is not None else "torch"
    held = [_at(r, newest.get(canonicalize_name(r.name))) for r in request.packages]
    loose = [str(r) for r in request.packages]
    if newest:
        shown = ", ".join(
            f"{n} {v or '(none for ' + box.platform + ')'}" for n, v in newest.items()
        )
        say(f"newest releases for {box.platform}: {shown}")
    phases = [held] if held == loose else [held, loose]
    failed: list[Tried] = []
    for reqs in phases:
        if reqs is loose and reqs is not held:
            say("no CUDA takes the newest releases here; trying every release, newest CUDA first:")
        try:
            choice = _choose_cuda(request, box, probe, say, source, [*reqs, *extra, torch_req])
        except _NoneFits as exc:
            failed += exc.tried
            continue
        return _with_versions(choice, request, newest, failed, extra, say)
    why = "; ".join(t.line() for t in failed)
    asked = ", ".join([*loose, *extra, torch_req])
    raise ResolveError(f"no CUDA fits [{asked}] on this box: {why}")


class _NoneFits(Exception):
    def __init__(self, tried: Sequence[Tried]) -> None:
        super().__init__("no candidate")
        self.tried = tuple(tried)


def _with_versions(
    choice: Choice,
    request: Request,
    newest: dict[str, str | None],
    passed_over: Sequence[Tried],
    extra: Sequence[str],
    say: Reporter,
) -> Choice:
    """Say each asked package's chosen release beside the newest one, and why they differ;
    note the JIT companion added, or missing."""
    notes = list(choice.notes)
    chosen = {str(canonicalize_name(Requirement(p).name)): p for p in choice.packages if "==" in p}
    for req in request.packages:
        cname = str(canonicalize_name(req.name))
        got = chosen.get(cname, str(req)).partition("==")[2] or "(as asked)"
        top = newest.get(cname)
        if top is None or got == top:
            say(f"{req.name}: {got}" + (" (the newest release)" if top is not None else ""))
            continue
        why = "; ".join(t.line() for t in passed_over) or "not chosen by uv"
        line = f"{req.name}: {got}, not the newest {top}: {top} does not resolve here ({why})"
        say(line)
        notes.append(line)
    for want in extra:
        if not any(p.startswith(f"{want}==") for p in choice.packages):
            needing = [
                r.name
                for r in request.packages
                if JIT_COMPANIONS.get(canonicalize_name(r.name)) == want
            ]
            notes.append(
                f"{want} is not in the set uv chose: {', '.join(needing)} JIT-builds its kernels "
                "with it, so verify's flashinfer-jit check of this env will fail"
            )
    return replace(choice, notes=tuple(notes))


def _driver_refusal(request: Request, box: Box, cuda: CudaVersion) -> str | None:
    """Why ``cuda`` is skipped for a driver, this box's or the fleet's, before any resolver
    call; None when every driver runs it."""
    if box.driver is not None and cuda.major in driver.MINIMUM_DRIVER and not box.driver.runs(cuda):
        need = driver.minimum_driver(cuda)
        return f"{box.driver.describe()} does not run it (needs {need} or newer)"
    # The fleet's drivers too: a stack this box could build but a target cannot run is
    # refused by the judgement after the lock, so the CUDA is chosen to fit them first.
    behind = [
        t
        for t in request.targets
        if cuda.major in driver.MINIMUM_DRIVER and not driver.runs(t.driver, cuda)
    ]
    if behind:
        need = driver.minimum_driver(cuda)
        names = ", ".join(f"{t.name} (driver {t.driver})" for t in behind)
        return f"the fleet's {names} does not run it (needs {need} or newer)"
    return None


def _candidate_spec(
    request: Request,
    box: Box,
    source: Path,
    cuda: CudaVersion,
    chain: spec.Toolchain,
    found_archs: tuple[Arch, ...],
) -> spec.EnvSpec:
    """The spec one candidate is tried as: the asked packages on ``cuda``, for this box's
    platform only, and the archs found (the default ones where no GPU is known)."""
    return spec.EnvSpec(
        name=request.name or f"init-{_cuda_tag(cuda)}",
        python=PYTHON,
        cuda=str(cuda),
        source=source,
        packages=tuple(str(r) for r in request.packages),
        toolchain=chain,
        archs=found_archs or archs.DEFAULT_ARCHS,
        platforms=(box.platform,),
    )


def _choose_cuda(
    request: Request,
    box: Box,
    probe: Probe,
    say: Reporter,
    source: Path,
    requirements: list[str],
) -> Choice:
    """The newest CUDA candidate on which ``requirements`` resolve here; _NoneFits with the
    candidates tried when none does."""
    candidates = (request.cuda,) if request.cuda is not None else CUDA_CANDIDATES
    tried: list[Tried] = []

    def record(t: Tried) -> None:
        tried.append(t)
        say(f"  {t.line()}")

    say(f"choosing a CUDA for [{', '.join(requirements)}], newest first:")
    for cuda in candidates:
        found_archs = archs_for(request, box, cuda)
        blocked = _driver_refusal(request, box, cuda)
        if blocked is not None:
            record(Tried(cuda=cuda, outcome="skipped", reason=blocked))
            continue
        chain = spec.Toolchain()
        if cuda.major < 13:
            kit = box.toolkit(cuda)
            if kit is None:
                record(Tried(cuda=cuda, outcome="skipped",
                             reason=f"no CUDA {cuda} toolkit installed here, and PyPI has no CUDA "
                             f"{cuda.major} nvcc (NVIDIA/cuda-python#2100)"))  # fmt: skip
                continue
            chain = spec.Toolchain(source="system", path=kit.path)
        cand = _candidate_spec(request, box, source, cuda, chain, found_archs)
        problems = resolve.spec_problems(cand)
        if problems:
            record(Tried(cuda=cuda, outcome="skipped", reason="; ".join(problems)))
            continue
        try:
            got = probe(cand, requirements, _constraints(cuda))
        except ResolveError as exc:
            reason = _uv_reason(exc)
            if _NO_INDEX in str(exc) or any(m in reason for m in _UNKNOWN_PACKAGE):
                # Not a matter of CUDA: every other candidate would get the same answer.
                raise ResolveError(f"uv: {reason}") from None
            record(Tried(cuda=cuda, outcome="refused", reason=f"uv: {reason}"))
            continue
        versions = {str(canonicalize_name(p.name)): p.version for p in got}
        torch = versions.get("torch")
        tcuda, evidence = resolve.torch_cuda(got)
        if torch is None or tcuda != str(cuda):
            what = (
                "no torch in the set" if torch is None
                else f"torch {torch} is built for CUDA {tcuda} ({evidence})" if tcuda
                else f"torch {torch} pins no CUDA runtime (a CPU-only build)"
            )  # fmt: skip
            record(Tried(cuda=cuda, outcome="refused", reason=what))
            continue
        packages, notes = _spec_packages(request, versions, cuda)
        name = request.name or _default_name(request, versions, torch, cuda)
        record(Tried(cuda=cuda, outcome="chosen", reason=f"torch {torch} ({evidence})"))
        return Choice(
            cuda=cuda,
            torch=torch,
            packages=tuple(packages),
            archs=cand.archs,
            toolchain=chain,
            name=name,
            tried=tuple(tried),
            notes=tuple(notes),
        )
    raise _NoneFits(tried)
