"""Will it run there? A stack judged for each fleet target from the lock's own wheels.

Each target is judged from the wheels of its own platform (the aarch64 sgl_kernel holds
sm_121a where the x86_64 one does not), without building an env: the lock's files for that
platform are unpacked, hash-checked, by ``uv pip install --target --python-platform`` into a
directory of cudaenv's cache (hard links from uv's cache: a second time costs nothing), laid
out as an env's site-packages, and read by the audit's ELF scan (:mod:`builder.audit.scan`: fatbin
headers, the packages' loaders, what they link). Nothing there is ever run.

One verdict per target, from the binaries the stack loads on that GPU:

- ``runs``: every required binary holds SASS for the target's compute capability;
- ``runs-after-ptx-jit``: some only through PTX, which the driver compiles at first start;
- ``no-kernel``: a required binary has no code for it (package, file, what it holds);
- ``driver-too-old``: the target's driver cannot run the CUDA torch is built for;
- ``no-wheel``: the lock has no wheels for the target's platform.

A binary that could not be read is never counted as covering a target.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from builder.audit import scan as audit
from builder.core import cachefiles, platforms, proc
from builder.core.cudaversion import CudaVersion
from builder.core.errors import BuildError, CudaenvError, ReportError
from builder.core.paths import cache_dir
from builder.core.reporter import Reporter
from builder.env import build, place
from builder.formats import codec
from builder.machine import archs, driver
from builder.machine.targets import Target
from builder.spec.envspec import EnvSpec
from builder.spec.lock import Lock

Kind = Literal["runs", "runs-after-ptx-jit", "no-kernel", "driver-too-old", "no-wheel"]
FAILING: tuple[Kind, ...] = ("no-kernel", "driver-too-old", "no-wheel")
# How each kind reads in a table cell.
SHORT: dict[Kind, str] = {
    "runs": "runs",
    "runs-after-ptx-jit": "runs after PTX JIT",
    "no-kernel": "no kernel",
    "driver-too-old": "driver too old",
    "no-wheel": "no wheel",
}


@dataclass(frozen=True, kw_only=True)
class Verdict:
    target: Target
    kind: Kind = field(metadata=codec.meta(key="verdict"))
    detail: str  # one line: why
    evidence: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.kind not in FAILING

    @property
    def compiles_at_start(self) -> bool:
        """Runs, but FlashInfer JIT-builds its modules at the first start there (the spec's
        arch list has nothing for this class: :func:`_with_jit_archs`)."""
        return JIT_NOTE in self.detail

    def line(self) -> str:
        return f"{self.target.label}: {SHORT[self.kind]}: {self.detail}"

    def to_json(self) -> dict[str, object]:
        return codec.to_json(self)


# --------------------------------------------------------------------------- the lock's files


def unpacked_root(spec: EnvSpec, lk: Lock, platform: str) -> Path:
    """Where the lock's files for ``platform`` are unpacked: named by everything they depend
    on (what is installed, the platform, the Python)."""
    key = hashlib.sha256(f"{lk.content_hash()}|{platform}|{spec.python}".encode()).hexdigest()
    return cache_dir() / "fleet" / f"{spec.name}-{platform}-{key[:16]}"


def unpack(
    spec: EnvSpec, lk: Lock, platform: str, reporter: Reporter, *, wheelhouse: Path | None = None
) -> Path:
    """The lock's files for ``platform`` unpacked (hash-checked, nothing run) under an env-like
    root (``lib/pythonX.Y/site-packages``); reused when complete. ``wheelhouse``: take the files
    only from there (an exported lock), else from the index uv is configured with."""
    root = unpacked_root(spec, lk, platform)
    parent = root.parent
    try:
        # The cache's rules: unpacked files decide verdicts, so no directory another user
        # could write.
        cachefiles.check_dirs(parent, make=True)
    except cachefiles.Refused as exc:
        raise BuildError(f"the lock audit cannot unpack wheels there: {exc}") from None
    done = root / "complete"
    if done.is_file() and not root.is_symlink() and done.read_text() == lk.content_hash():
        return root
    tmp = parent / f".{root.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    site = tmp / "lib" / f"python{spec.python}" / "site-packages"
    site.mkdir(parents=True)
    req = tmp / "requirements.lock.txt"
    req.write_text(lk.requirements_txt(platform))
    packages = lk.packages_on(platform)
    reporter(
        f"unpacking {len(packages)} wheels of the lock of {spec.name} for {platform} "
        "(hashes required; nothing is run)"
    )
    argv = [proc.uv_bin(), "pip", "install", "--quiet", "--no-deps", "--target", str(site),
            "--python-platform", platforms.get(platform).uv_tag, "--python-version", spec.python,
            *build.install_argv(build.Source(wheelhouse=wheelhouse))]  # fmt: skip
    started = time.monotonic()
    try:
        try:
            # Every file in uv's cache: no index page asked (as a warm build does).
            proc.run([*argv, "--offline", "-r", str(req)], env=proc.uv_env())
        except proc.CommandFailed as exc:
            if place.out_of_space(exc.output):
                raise  # a full disk, not a cache miss: online would meet it too
            proc.run([*argv, "-r", str(req)], env=proc.uv_env(), timeout=3600)
    except proc.CommandFailed as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        said = " ".join(
            line.strip().removeprefix("error: ").removeprefix("cause: ")
            for line in exc.output.splitlines()
            if line.strip()
        )
        raise BuildError(
            f"{spec.name}: the lock's wheels for {platform} could not be unpacked: "
            f"uv: {said[:600] or 'failed'}"
        ) from exc
    (tmp / "complete").write_text(lk.content_hash())
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    reporter(
        f"unpacked {len(packages)} wheels for {platform} in {time.monotonic() - started:.1f} s"
    )
    return root


# --------------------------------------------------------------------------- judging


def lock_cuda(spec: EnvSpec, lk: Lock) -> CudaVersion:
    """The CUDA the stack runs: torch's, else the spec's."""
    return CudaVersion.parse(lk.torch_cuda or spec.cuda)


def driver_verdict(
    target: Target,
    cuda: CudaVersion,
    whose: str = "torch's",
    others: Sequence[tuple[str, CudaVersion, tuple[str, ...]]] = (),
) -> Verdict | None:
    """``driver-too-old`` when the target's driver cannot run ``cuda`` (``whose`` CUDA it is),
    else None. ``others``: the stacks beside this one (:func:`stacks_beside`), of which those
    the driver runs are named as what to serve there instead."""
    if cuda.major not in driver.MINIMUM_DRIVER or driver.runs(target.driver, cuda):
        return None
    need = driver.minimum_driver(cuda)
    runs = sorted(
        name for name, c, where in others if target.platform in where and _runs(target.driver, c)
    )
    if runs:
        instead = f", or serve it {', '.join(runs)}, which it runs"
    elif others:
        instead = " (no stack beside this one runs there either)"
    else:
        instead = ", or serve it a stack of a CUDA it runs"
    return Verdict(
        target=target,
        kind="driver-too-old",
        detail=f"driver {target.driver} cannot run CUDA {cuda} ({whose}), which needs driver "
        f"{need} or newer: install driver {need}+ there{instead}",
        evidence=(f"CUDA {cuda.major}.x needs driver {need}+ (minor-version compatibility)",),
    )


def _runs(driver_version: str, cuda: CudaVersion) -> bool:
    return cuda.major not in driver.MINIMUM_DRIVER or driver.runs(driver_version, cuda)


@functools.cache
def stacks_beside(spec_dir: Path) -> tuple[tuple[str, CudaVersion, tuple[str, ...]], ...]:
    """Each stack whose spec and lock sit in ``spec_dir`` (a project's envspecs/), with the
    CUDA it runs and the platforms its lock covers; specs or locks that do not load are left
    out (a table, not a check)."""
    from builder.spec import envspec as spec_mod
    from builder.spec import lock as lock_mod

    out: list[tuple[str, CudaVersion, tuple[str, ...]]] = []
    for path in sorted(spec_dir.glob("*.yaml")):
        try:
            s = spec_mod.load(path)
            lk = lock_mod.read(lock_mod.lock_path(s.source, s.name), spec=s)
            out.append((s.name, lock_cuda(s, lk), lk.platforms))
        except (CudaenvError, ValueError):
            continue
    return tuple(out)


def judge_binaries(target: Target, found: Sequence[audit.Binary]) -> Verdict:
    """The verdict of the scanned binaries of the target's platform."""
    drv = driver.Driver(version=target.driver, cuda=None, source=f"target {target.name}")
    judged = audit.judge(found, [target.cc], drv.newest_cuda())
    required = [j for j in judged if j.required is not None]
    missing = [j for j in required if not j.covered]
    if missing:
        evidence = tuple(
            f"{j.binary.package}: {_site_path(j.binary)} "
            + (
                f"could not be read ({j.binary.scan.error})"
                if j.verdict == "unreadable"
                else f"holds {j.binary.holds}"
            )
            + f" (needed: {j.required})"
            for j in missing
        )
        first = missing[0]
        return Verdict(
            target=target,
            kind="no-kernel",
            detail=f"{first.binary.package}: {_site_path(first.binary)} has no code for "
            f"{target.cc_text} ({first.binary.holds})"
            + (f", and {len(missing) - 1} more" if len(missing) > 1 else ""),
            evidence=evidence,
        )
    if not required:
        return Verdict(
            target=target,
            kind="runs",
            detail="no prebuilt GPU binary is loaded there (everything JIT-builds)",
        )
    jit = [j for j in required if j.verdict == "ptx"]
    if jit:
        return Verdict(
            target=target,
            kind="runs-after-ptx-jit",
            detail=f"{len(jit)} of {len(required)} required binaries run through PTX: the driver "
            "compiles their kernels at the first start (minutes; kept in its cache after)",
            evidence=tuple(
                f"{j.binary.package}: {_site_path(j.binary)} ({j.binary.holds})" for j in jit
            ),
        )
    return Verdict(
        target=target,
        kind="runs",
        detail=f"{len(required)} required binaries hold SASS for {target.cc_text}",
    )


def _site_path(b: audit.Binary) -> str:
    parts = b.path.parts
    return "/".join(parts[3:]) if len(parts) > 3 and parts[2] == "site-packages" else str(b.path)


def judge(
    spec: EnvSpec,
    lk: Lock,
    targets: Sequence[Target],
    reporter: Reporter,
    *,
    cache: audit.ScanCache | None = None,
    wheelhouse: Path | None = None,
) -> list[Verdict]:
    """One verdict per target, in the targets' order."""
    cuda = lock_cuda(spec, lk)
    cache = cache if cache is not None else audit.ScanCache.default()
    out: dict[str, Verdict] = {}
    scans: dict[str, list[audit.Binary]] = {}
    for t in targets:
        if t.platform not in lk.platforms:
            out[t.name] = Verdict(
                target=t,
                kind="no-wheel",
                detail=f"the lock of {spec.name} has no wheels for {t.platform} (it covers "
                f"{', '.join(lk.platforms)}): add it to `platforms:` and re-lock, if the stack "
                "exists there",
            )
            continue
        too_old = driver_verdict(
            t,
            cuda,
            "torch's" if lk.torch_cuda else "the spec's",
            [o for o in stacks_beside(spec.source.parent.resolve()) if o[0] != spec.name],
        )
        if too_old is not None:
            out[t.name] = too_old
            continue
        if t.platform not in scans:
            root = unpack(spec, lk, t.platform, reporter, wheelhouse=wheelhouse)
            scans[t.platform] = audit.binaries(root, cache)
            cache.save()
        out[t.name] = _with_jit_archs(judge_binaries(t, scans[t.platform]), spec, cuda)
    return [out[t.name] for t in targets]


JIT_NOTE = "the spec's JIT arch list"


def _with_jit_archs(verdict: Verdict, spec: EnvSpec, cuda: CudaVersion) -> Verdict:
    """A class the prebuilt binaries run on, but for which the spec's JIT arch list builds
    nothing (an H100 beside a spec for 12.0f alone): what FlashInfer does there is said,
    since `warm` warmed nothing for it."""
    if not verdict.ok or not spec.archs:
        return verdict
    if any(a.runs_on(verdict.target.capability) for a in spec.archs):
        return verdict
    listed = " ".join(archs.texts(spec.archs))
    want = archs.normalise(*verdict.target.capability, cuda)
    return replace(
        verdict,
        detail=f"{verdict.detail}; {JIT_NOTE} ({listed}) has nothing for "
        f"{verdict.target.cc_text}: FlashInfer compiles its modules at the first start there "
        "(an env built on such a node adds its GPU's arch; nothing was warmed for it), or add "
        f"{archs.texts([want])[0]} to `archs:`",
    )


def render(spec: EnvSpec, verdicts: Sequence[Verdict]) -> str:
    bad = [v for v in verdicts if not v.ok]
    lines = [
        f"targets of {spec.name}: {'FAILED' if bad else 'PASSED'} "
        f"({len(verdicts) - len(bad)}/{len(verdicts)} run)"
    ]
    for v in verdicts:
        lines.append(f"  {v.line()}")
        if not v.ok:
            lines += [f"      {e}" for e in v.evidence[:5]]
    return "\n".join(lines)


def to_json(spec: EnvSpec, lk: Lock, verdicts: Sequence[Verdict]) -> dict[str, object]:
    return {
        "spec": spec.name,
        "lock": lk.content_hash(),
        "cuda": str(lock_cuda(spec, lk)),
        "status": "failed" if any(not v.ok for v in verdicts) else "passed",
        "targets": [v.to_json() for v in verdicts],
    }


def markdown(spec: EnvSpec, verdicts: Sequence[Verdict]) -> str:
    bad = [v for v in verdicts if not v.ok]
    lines = [
        f"# {spec.name} on its targets: {'FAILED' if bad else 'PASSED'}",
        "",
        "| target | cc | platform | driver | verdict | why |",
        "|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        t = v.target
        why = v.detail.replace("|", "\\|")
        lines.append(
            f"| {t.name} | {t.cc_text} | {t.platform} | {t.driver} | {SHORT[v.kind]} | {why} |"
        )
    return "\n".join(lines) + "\n"


def from_json(doc: dict[str, object], where: str = "verdict") -> Verdict:
    """A verdict as :meth:`Verdict.to_json` wrote it (the compatibility table's data file);
    ValueError naming the key of anything else."""
    try:
        return codec.from_json(Verdict, doc, where)
    except ReportError as exc:
        raise ValueError(str(exc)) from exc
