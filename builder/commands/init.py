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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from builder.commands import pipeline
from builder.core import indexview, platforms, proc
from builder.core.cudaversion import CudaVersion
from builder.core.errors import ResolveError, SpecError, UsageError, VerifyFailed
from builder.core.reporter import Reporter
from builder.machine import archs, driver
from builder.machine import targets as targets_mod
from builder.machine.archs import Arch
from builder.machine.box import Box, detect_box
from builder.machine.targets import Target
from builder.spec import envspec as spec
from builder.spec import lock, resolve
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
# The Python of every shipped spec: the one the measured stacks resolve for.
PYTHON = "3.12"
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
# Writes the lock of the spec file at the path (pipeline.write_lock in production).
Locker = Callable[[Path, Reporter], pipeline.Locked]
# The newest release of one requirement on the index for a spec's platform and Python, or None
# where there is none (raises ResolveError with uv's reason for a name no index has).
Latest = Callable[[spec.EnvSpec, Requirement], "str | None"]
# The serving stacks whose kernels FlashInfer JIT-compiles at their first requests (the table
# verify's imports and flashinfer-jit checks read): a spec for one of them holds FlashInfer,
# asked or not.
JIT_COMPANIONS: dict[str, str] = {
    s.distribution: "flashinfer-python" for s in SERVERS if s.needs_flashinfer
}


# --------------------------------------------------------------------------- the request


@dataclass(frozen=True, kw_only=True)
class Request:
    """What `cudaenv init` was asked, checked."""

    packages: tuple[Requirement, ...] = ()  # --with, torch excepted
    torch: Requirement | None = None  # a --with naming torch
    gpus: tuple[Arch, ...] = ()  # --gpu, as given (a bare 12.0 is spelled per CUDA later)
    cuda: CudaVersion | None = None
    name: str | None = None
    out: Path | None = None
    argv: tuple[str, ...] = ()  # the command line, for the spec's first comment
    targets: tuple[Target, ...] = ()  # --targets: the fleet the stack must run on
    exclude_newer: str | None = None  # --exclude-newer: the index view to choose from


def _check_name(name: str) -> None:
    """The spec's own rule for a name (spec.py), worded for ``--name``."""
    probe = f'name: {json.dumps(name)}\npython: {json.dumps(PYTHON)}\ncuda: "13.0"\n'
    try:
        spec.load(Path("--name.yaml"), text=probe)
    except SpecError as exc:
        said = exc.problems[0].split(": name: ", 1)[-1] if exc.problems else str(exc)
        raise UsageError(f"--name {name!r}: {said}") from None


def make_request(
    *,
    with_: Sequence[str] = (),
    gpu: Sequence[str] = (),
    cuda: str | None = None,
    name: str | None = None,
    out: str | None = None,
    argv: Sequence[str] = (),
    targets_file: str | None = None,
    exclude_newer: str | None = None,
) -> Request:
    """The arguments, each refused in one line naming it (UsageError, exit 2); a fleet file's
    problems located in it (SpecError, exit 2)."""
    packages: list[Requirement] = []
    torch: Requirement | None = None
    seen: set[str] = set()
    for text in with_:
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            first = str(exc).splitlines()[0]  # packaging adds the text and a caret below
            raise UsageError(f"--with {text!r}: not a valid requirement: {first}") from None
        if req.url:
            raise UsageError(f"--with {text!r}: a direct URL cannot be locked by hash here")
        cname = canonicalize_name(req.name)
        if cname in seen:
            raise UsageError(f"--with {text!r}: {req.name} is asked twice")
        seen.add(cname)
        if cname == "torch":
            torch = req
        else:
            packages.append(req)
    gpus: list[Arch] = []
    for text in gpu:
        for part in re.split(r"[\s,;]+", text.strip()):
            if not part:
                continue
            try:
                arch = Arch.parse(part)
            except ValueError as exc:
                raise UsageError(f"--gpu {text!r}: {exc}") from None
            unknown = archs.known_capability(arch)
            if unknown is not None:
                raise UsageError(f"--gpu {text!r}: {unknown}")
            if arch not in gpus:
                gpus.append(arch)
    version: CudaVersion | None = None
    if cuda is not None:
        try:
            version = CudaVersion.parse(cuda)
        except ValueError as exc:
            raise UsageError(f"--cuda {cuda!r}: {exc}") from None
        if version.major not in (12, 13):
            raise UsageError(f"--cuda {cuda}: CUDA 12.x and 13.x are supported")
    if name is not None:
        _check_name(name)
    path = Path(out) if out else None
    if path is not None and (path.exists() or path.is_symlink()):
        raise UsageError(f"--out {out}: the file exists; init never overwrites a spec")
    return Request(
        packages=tuple(packages),
        torch=torch,
        gpus=tuple(gpus),
        cuda=version,
        name=name,
        out=path,
        argv=tuple(argv),
        targets=targets_mod.load_file(Path(targets_file)) if targets_file else (),
        exclude_newer=exclude_newer,
    )


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
        if (
            box.driver is not None
            and cuda.major in driver.MINIMUM_DRIVER
            and not box.driver.runs(cuda)
        ):
            need = driver.minimum_driver(cuda)
            record(Tried(cuda=cuda, outcome="skipped",
                         reason=f"{box.driver.describe()} does not run it (needs {need} or newer)"))  # fmt: skip
            continue
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
            record(Tried(cuda=cuda, outcome="skipped",
                         reason=f"the fleet's {names} does not run it (needs {need} or newer)"))  # fmt: skip
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
        cand = spec.EnvSpec(
            name=request.name or f"init-{_cuda_tag(cuda)}",
            python=PYTHON,
            cuda=str(cuda),
            source=source,
            packages=tuple(str(r) for r in request.packages),
            toolchain=chain,
            archs=found_archs or archs.DEFAULT_ARCHS,
            platforms=(box.platform,),
        )
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
