"""The doctor's rules about the machine and the env's own state: the driver and the GPUs, the
JIT caches, the env's wiring (cache settings, activation scripts, the remote cache), drift
from its lock, the probe itself and the env's last verify.

Each rule is one function over :class:`~builder.doctor.facts.Facts`;
:func:`builder.doctor.rules.diagnose` runs them all.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from packaging.utils import canonicalize_name

from builder.core import remote_cache
from builder.core.cudaversion import CudaVersion
from builder.doctor.facts import ERROR, INFO, WARNING, Facts, Finding
from builder.doctor.toolkit_rules import adopt_fix
from builder.env import caches, manifest
from builder.machine import archs, driver


def rule_probe(facts: Facts) -> list[Finding]:
    out = [
        Finding(
            code="probe-failed",
            severity=ERROR,
            cause=f"probing {step} failed: {error}",
            fix=("reinstall the package named in the error",),
        )
        for step, error in sorted(facts.errors.items())
    ]
    if facts.deep:
        for key in ("torch", "flashinfer"):
            part = facts.deep.get(key)
            if isinstance(part, dict) and part.get("error") and part.get("installed") is not False:
                out.append(
                    Finding(
                        code=f"{key}-import-failed",
                        severity=ERROR,
                        cause=f"import {key} failed: {part['error']}",
                        fix=(f"reinstall {key} in this env",),
                    )
                )
    return out


def rule_driver(facts: Facts) -> list[Finding]:
    """The driver as machine/driver.py read it (every command's one reading) against torch's
    CUDA, by the one table of minimum drivers."""
    libcuda = CudaVersion.read(facts.driver_cuda) if facts.driver is None else None
    if facts.driver is None and libcuda is None:
        return [
            Finding(
                code="no-driver",
                severity=INFO,
                cause=f"{driver.not_found()}: kernels compile but cannot run here",
            )
        ]
    tm = CudaVersion.read(facts.torch_cuda)
    if tm is None or tm.major not in driver.MINIMUM_DRIVER:
        return []
    fits: int | None
    if facts.driver is None:
        # Only libcuda answered: the newest CUDA it runs, no version (a WSL2 box may have
        # neither /proc nor /sys: uv#14647).
        assert libcuda is not None
        seen = driver.Driver(version=None, cuda=libcuda, source=facts.driver_source)
        too_old, fits = not seen.runs(tm), libcuda.major
        said = f"driver for CUDA {libcuda}"
    else:
        try:
            too_old = not driver.runs(facts.driver, tm)
            fits = driver.newest_cuda_major(facts.driver)
        except ValueError:  # a version that is not dotted numbers: no judgement
            return []
        said = f"driver {facts.driver}"
    if not too_old:
        return []
    need = driver.minimum_driver(tm)
    older = (
        f"or use a torch/spec built for CUDA {fits}.x, which this driver runs"
        if fits is not None
        else "or use a torch/spec built for an older CUDA"
    )
    return [
        Finding(
            code="driver-too-old",
            severity=ERROR,
            cause=f"{said} is too old for torch's CUDA {facts.torch_cuda}: "
            f"CUDA {tm.major}.x needs {need}+",
            evidence=(
                f"{said} (read from {facts.driver_source or 'the probe'})",
                f"torch {facts.torch_version}",
            ),
            fix=(
                f"install NVIDIA driver {need} or newer (or cuda-compat-{tm.major}-{tm.minor} "
                "on a datacenter GPU)",
                older,
            ),
        )
    ]


def rule_gpu_archs(facts: Facts) -> list[Finding]:
    """A visible GPU no arch of the env's list runs on. A GPU whose capability is unknown is
    not reported: nothing says it is missing."""
    built = facts.manifest
    if built is None:
        return []
    missing = [gpu for gpu in facts.gpus if archs.uncovered(built.archs, gpu)]
    if not missing:
        return []
    first = missing[0]
    return [
        Finding(
            code="gpu-arch-missing",
            severity=WARNING,
            cause=f"GPU {first.name} (SM {first.capability_text}) is not in this env's arch "
            f"list ({archs.flashinfer_spelling(built.archs)}): FlashInfer would build no "
            "kernel for it",
            # Spelled as FlashInfer would target it with the env's nvcc.
            evidence=tuple(
                f"GPU {g.index} {g.name}: {g.arch(CudaVersion.read(built.nvcc))}" for g in missing
            ),
            fix=(f"rebuild so the arch list picks it up: `cudaenv build {built.spec}`",),
        )
    ]


def rule_jit_cache(facts: Facts) -> list[Finding]:
    home = facts.jit_home
    out: list[Finding] = []
    if not facts.jit_entries:
        return out
    current = os.path.realpath(home.path) if home else None
    other_toolkit = [
        e
        for e in facts.jit_entries
        if e.version == facts.flashinfer
        and e.cuda_home
        and current
        and os.path.realpath(e.cuda_home) != current
    ]
    if other_toolkit:
        homes = sorted({str(e.cuda_home) for e in other_toolkit})
        version_dir = f"{facts.jit_root}/{facts.flashinfer}"
        out.append(
            Finding(
                code="stale-jit-cache",
                severity=ERROR,
                cause=f"FlashInfer's JIT cache holds {len(other_toolkit)} op(s) built with another "
                f"toolkit ({', '.join(homes)}) than the one it now uses ({home.path if home else '?'}); "
                "FlashInfer reuses them: the toolkit is not in its cache key (flashinfer#3229)",
                evidence=tuple(
                    f"{e.version}/{e.archs}/{e.op}: cuda_home={e.cuda_home}"
                    for e in other_toolkit[:8]
                ),
                fix=(
                    f"rm -rf {version_dir}",
                    "the cudaenv way: each env has its own cache "
                    "(FLASHINFER_WORKSPACE_BASE=ENV/var/flashinfer)",
                ),
            )
        )
    other_version = sorted({e.version for e in facts.jit_entries if e.version != facts.flashinfer})
    if other_version and facts.flashinfer:
        out.append(
            Finding(
                code="old-jit-cache",
                severity=WARNING,
                cause=f"FlashInfer's JIT cache holds builds of FlashInfer {', '.join(other_version)}, "
                f"not the installed {facts.flashinfer}: unused, only disk",
                evidence=(f"cache: {facts.jit_root}",),
                fix=tuple(f"rm -rf {facts.jit_root}/{v}" for v in other_version),
            )
        )
    return out


def rule_caches(facts: Facts) -> list[Finding]:
    """A cudaenv env keeps every JIT cache in its own var/ and Triton's tools at its own
    binaries; a cache elsewhere is shared with envs of other toolkits (flashinfer#5145)."""
    if facts.manifest is None or not facts.prefix:
        return []
    # Only the variables the probe was asked for: a probe of an older cudaenv reports none.
    if not any(v in facts.env for v in caches.VARIABLES):
        return []
    wrong = caches.outside_env(facts.prefix, facts.env)
    if not wrong:
        return []
    return [
        Finding(
            code="cache-outside-env",
            severity=WARNING,
            cause=f"{len(wrong)} JIT cache setting(s) of this env point outside it: compiled "
            "results are shared with envs of other toolkits and can be reused stale "
            "(flashinfer#5145)",
            evidence=tuple(wrong),
            fix=(
                adopt_fix(facts)
                or f"rebuild the env so its hook sets them: cudaenv build {facts.manifest.spec} "
                "--force",
                "or remove the override from the spec's `env:` / the code that sets it",
            ),
        )
    ]


def rule_activation(facts: Facts) -> list[Finding]:
    """Every shell's activation script of a cudaenv env carries its settings. bin/activate
    holding the block shows the env was wired; another shell's script without it (an env
    built before cudaenv patched that shell, or a script added since) activates with whatever
    CUDA_HOME the shell had."""
    if facts.manifest is None or not facts.prefix:
        return []
    # Here, not at the top: toolchain brings the spec loader and YAML (~30 ms) that a doctor
    # run needs only for a cudaenv env.
    from builder.env.hooks import ACTIVATIONS, BLOCK_MARK

    bin_dir = Path(facts.prefix) / "bin"

    def marked(name: str) -> bool | None:
        try:
            return BLOCK_MARK in (bin_dir / name).read_text(errors="replace")
        except OSError:
            return None  # the env has no such script

    if not marked("activate"):
        return []
    bare = [name for name, _, _ in ACTIVATIONS if marked(name) is False]
    if not bare:
        return []
    return [
        Finding(
            code="activation-unwired",
            severity=WARNING,
            cause=f"{len(bare)} shell activation script(s) of this env lack its CUDA settings: "
            "a shell activated with them keeps its own CUDA_HOME and PATH (the Python hook "
            "still applies to the env's interpreter)",
            evidence=tuple(f"bin/{name}" for name in bare),
            fix=(
                adopt_fix(facts) or f"rebuild the env: cudaenv build {facts.manifest.spec} --force",
            ),
        )
    ]


def rule_drift(facts: Facts) -> list[Finding]:
    """A built env holds exactly its lock: a package added, removed or changed since (a
    `uv pip install` into it, say) is named, with how to make it part of the spec."""
    built = facts.manifest
    if built is None or built.spec == manifest.ADOPTED_SPEC or not facts.dists:
        return []
    locked = {canonicalize_name(n): v for n, v in built.packages}
    now = {canonicalize_name(n): v for n, v in facts.dists.items()}
    added = sorted(f"{n}=={v}" for n, v in now.items() if n not in locked)
    removed = sorted(f"{n}=={v}" for n, v in locked.items() if n not in now)
    changed = sorted(
        f"{n} {locked[n]} -> {v}" for n, v in now.items() if n in locked and locked[n] != v
    )
    if not (added or removed or changed):
        return []
    evidence = [*(f"added {a}" for a in added), *(f"removed {r}" for r in removed),
                *(f"changed {c}" for c in changed)]  # fmt: skip
    return [
        Finding(
            code="env-drift",
            severity=WARNING,
            cause=f"this env no longer holds exactly its lock: {len(added)} added, "
            f"{len(removed)} removed, {len(changed)} changed since it was built",
            evidence=tuple(evidence[:20]),
            fix=(
                f"put what you need in `packages:` of {built.spec}, then `cudaenv build "
                f"{built.spec} --force` (re-locks and rebuilds exactly)",
            ),
        )
    ]


def rule_remote_cache(facts: Facts) -> list[Finding]:
    """The Redis cache Triton and Inductor are to share: wired by the env's hook (or why not),
    and whether it answers PING (AUTH first where a password is given). A cache that is down
    costs local compiles, never a failure; one that refuses the password is a setting to fix."""
    if facts.remote_cache is None:
        return []
    url = facts.remote_cache
    said = facts.env.get(remote_cache.WIRING_VAR) or ""
    rebuild = (
        f"cudaenv build {facts.manifest.spec} --force" if facts.manifest else "cudaenv build SPEC"
    )
    if not said.startswith("wired "):
        no_client = canonicalize_name(remote_cache.CLIENT) not in {
            canonicalize_name(n) for n in facts.dists
        }
        if no_client:
            cause = (
                f"the remote cache {url} is named but this env has no Redis client "
                f"(`{remote_cache.CLIENT}` is not installed): Triton and Inductor compile locally"
            )
            fix = f"add `remote-cache: {url}` to the env's spec (its lock gains `redis`), then {rebuild}"
        elif said:
            cause = f"the remote cache is {said}"
            fix = (
                "give the server's password in CUDAENV_REMOTE_CACHE_PASSWORD (or the URL of "
                "CUDAENV_REMOTE_CACHE), or name a server on loopback"
                if "password" in said
                else "correct CUDAENV_REMOTE_CACHE or the spec's `remote-cache:`"
            )
        else:
            cause = (
                f"the remote cache {url} is named but this interpreter's start-up hook does not "
                "wire it (an env built by an older cudaenv, or not by cudaenv)"
            )
            fix = rebuild
        return [Finding(code="remote-cache-unwired", severity=WARNING, cause=cause,
                        evidence=(said,) if said else (), fix=(fix,))]  # fmt: skip
    answer = facts.remote_answer
    if answer is None:
        return []
    if answer.status == "answers":
        return [Finding(code="remote-cache", severity=INFO,
                        cause=f"Triton and Inductor share the remote cache {url}: it answers",
                        evidence=(answer.detail,))]  # fmt: skip
    if answer.status == "auth-refused":
        return [
            Finding(
                code="remote-cache-auth",
                severity=ERROR,
                cause=f"the remote cache {url} refuses this password: every compile asks it "
                "in vain and compiles locally",
                evidence=(answer.detail,),
                fix=("set the server's password in CUDAENV_REMOTE_CACHE_PASSWORD (or the URL)",),
            )
        ]
    return [
        Finding(
            code="remote-cache-down",
            severity=WARNING,
            cause=f"the remote cache {url} does not answer: Triton and Inductor compile "
            f"locally (a request waits at most {remote_cache.TIMEOUT:g} s for it)",
            evidence=(answer.detail,),
            fix=("start the server or correct the URL; `CUDAENV_REMOTE_CACHE=off` stops asking",),
        )
    ]


def rule_last_verify(facts: Facts) -> list[Finding]:
    """An env is not healthy while its own last verify failed (the doctor reads less than the
    verify ran: an import, a compile)."""
    last = facts.last_verify
    if last is None or not last.failed or not last.current:
        return []
    if facts.manifest is not None and facts.manifest.spec != manifest.ADOPTED_SPEC:
        again = f"cudaenv verify {facts.manifest.spec} --env-dir {shlex.quote(facts.prefix)}"
    else:
        again = f"cudaenv verify --python {shlex.quote(facts.python)}"
    first_name, first_summary = last.failed[0]
    more = f" (and {len(last.failed) - 1} more failed check(s))" if len(last.failed) > 1 else ""
    return [
        Finding(
            code="last-verify-failed",
            severity=ERROR,
            cause=f"this env's last verify ({last.created}) failed: {first_name}: "
            f"{first_summary}{more}",
            evidence=(*(f"{n}: failed: {w}" for n, w in last.failed), f"report: {last.path}"),
            fix=(
                "the findings above name a cause where the doctor sees one; repair that first",
                f"then verify again: `{again}` (the report names each failed check's fix)",
            ),
        )
    ]
