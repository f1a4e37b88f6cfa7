"""Rules over the facts of any interpreter -> Findings (cause, evidence, fix), root cause first.

Every rule is one function over :class:`~builder.doctor.facts.Facts`; :func:`diagnose` runs
them all, puts the root cause first and groups the symptoms it explains under it.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from builder.audit import scan as audit
from builder.core import remote_cache, variables
from builder.core.cudaversion import CudaVersion
from builder.doctor.facts import ERROR, INFO, SEVERITY_ORDER, WARNING, CudaHome, Facts, Finding
from builder.env import caches, manifest
from builder.machine import archs, driver
from builder.spec import channels, policy

# FlashInfer's own gate: "Failed to get device capability: SM 12.x requires CUDA >= 12.9".
SM12_MIN_CUDA = CudaVersion(major=12, minor=9)


def _home_text(home: CudaHome) -> str:
    if home.source.startswith("$"):
        return f"{home.source[1:]}={home.path}"
    return f"{home.path}, from {home.source}"


def _adopt_fix(facts: Facts, does: str = "installs torch's matched toolkit") -> str | None:
    """The first fix for an env cudaenv did not build: repair it where it stands (``does``:
    what adopt changes there)."""
    if facts.manifest is not None and facts.manifest.spec != manifest.ADOPTED_SPEC:
        return None
    python = facts.python or "PATH"
    if facts.manifest is not None:
        return (
            f"adopt it again: `cudaenv adopt --undo --python {python}`, then "
            f"`cudaenv adopt --python {python}`"
        )
    return (
        f"repair this env in place: `cudaenv adopt --python {python}` ({does}, wires "
        "CUDA_HOME; `--dry-run` first, `--undo` reverts)"
    )


def install_command(facts: Facts, verb: str, *requirements: str) -> str:
    """``pip install X`` as it works in the env diagnosed: through its own pip where it has
    one, else through uv (a uv venv has no pip, and a bare ``pip`` is some other env's)."""
    args = " ".join(shlex.quote(r) for r in requirements)
    if "pip" in facts.dists:
        return f"{shlex.quote(facts.python)} -m pip {verb} {args}"
    return f"uv pip {verb} --python {shlex.quote(facts.python)} {args}"


def _matched_fixes(facts: Facts, want: str | None) -> tuple[str, ...]:
    """The exact ways to give the JIT the toolkit of torch's CUDA."""
    fixes: list[str] = []
    adopt_fix = _adopt_fix(facts)
    if adopt_fix is not None and want:
        fixes.append(adopt_fix)
    if want:
        for tk in facts.toolkits:
            if tk.release == want:
                fixes.append(f"export CUDA_HOME={tk.path}")
                break
    if facts.manifest is not None and adopt_fix is None:
        fixes.append(
            f"this env was built by cudaenv: run its own python without CUDAENV_NO_HOOK, or "
            f"rebuild it: `cudaenv build {facts.manifest.spec}`"
        )
    elif want and facts.manifest is None:
        pin = facts.dists.get("cuda-toolkit")
        if pin and CudaVersion.read(pin) == CudaVersion.read(want):
            fixes.append(
                f"install the matched compiler into this env: "
                f"`{install_command(facts, 'install', f'cuda-toolkit[nvcc,cudart,crt,nvvm,cccl]=={pin}')}`"
                ", then build an env "
                'that wires it as CUDA_HOME: `cudaenv build SPEC` with cuda: "' + want + '"'
            )
        else:
            fixes.append(f'the cudaenv way: a spec with cuda: "{want}" and `cudaenv build SPEC`')
    return tuple(fixes)


def rule_nvcc(facts: Facts) -> list[Finding]:
    """No nvcc / a broken nvcc / a JIT toolkit that is not torch's CUDA / SM 12.x too old."""
    home = facts.jit_home
    torch_cuda = facts.torch_cuda
    out: list[Finding] = []
    if home is None:
        if facts.flashinfer or facts.torch_installed:
            out.append(
                Finding(
                    code="no-nvcc",
                    severity=ERROR if facts.flashinfer else WARNING,
                    cause="no nvcc reachable: no CUDA_HOME, CUDA_PATH, nvcc on PATH or /usr/local/cuda"
                    + (
                        f"; FlashInfer silently falls back to torch's CUDA {torch_cuda} and every JIT "
                        "compile fails"
                        if facts.flashinfer
                        else ""
                    ),
                    fix=_matched_fixes(facts, torch_cuda),
                )
            )
        return out
    where = _home_text(home)
    if not home.exists:
        if facts.flashinfer or facts.torch_installed:
            out.append(
                Finding(
                    code="no-nvcc",
                    severity=ERROR if facts.flashinfer else WARNING,
                    cause=f"no nvcc at {home.nvcc} ({where})"
                    + (
                        f": FlashInfer's get_cuda_version() silently falls back to torch's CUDA "
                        f"{torch_cuda}, and its JIT compiles fail"
                        if facts.flashinfer
                        else ""
                    ),
                    evidence=(f"JIT CUDA_HOME: {where}",),
                    fix=_matched_fixes(facts, torch_cuda),
                )
            )
        return out
    if home.error or not home.release:
        out.append(
            Finding(
                code="nvcc-broken",
                severity=ERROR,
                cause=f"{home.nvcc} --version failed: {home.error}",
                evidence=(f"JIT CUDA_HOME: {where}",),
                fix=("repair or replace that toolkit", *_matched_fixes(facts, torch_cuda)),
            )
        )
        return out
    release = home.release
    evidence = [f"JIT CUDA_HOME: {where} (nvcc {release})"]
    if facts.torch_version:
        evidence.append(f"torch {facts.torch_version} built for CUDA {torch_cuda}")
    if Path(home.path).name == "usr":
        evidence.append("a distro /usr/bin/nvcc makes FlashInfer and torch use /usr as CUDA_HOME")
    intent = sm12_intent(facts)
    # Versions another interpreter reported: one that cannot be read is not known, and the
    # rules that need it say nothing.
    jm = CudaVersion.read(release)
    if intent and jm is not None and jm < SM12_MIN_CUDA:
        torch_part = f" but torch is built for CUDA {torch_cuda}" if torch_cuda else ""
        out.append(
            Finding(
                code="sm12x-nvcc-too-old",
                severity=ERROR,
                cause=f"FlashInfer's JIT uses nvcc {release} (from {where}){torch_part}; "
                f"SM 12.x needs {SM12_MIN_CUDA}+",
                evidence=(
                    *evidence,
                    f"SM 12.x intent: {intent}",
                    'FlashInfer then logs "Failed to get device capability: SM 12.x requires '
                    'CUDA >= 12.9" and builds no kernel',
                ),
                fix=_matched_fixes(facts, torch_cuda or str(SM12_MIN_CUDA)),
            )
        )
    tm = CudaVersion.read(torch_cuda)
    if tm is not None and jm is not None and tm != jm:
        major = tm.major != jm.major
        if major and not _has_runtime_of(facts, jm.major):
            # What a module built anyway (FlashInfer's JIT does not ask cpp_extension) then
            # fails with at load: "libcudart.so.12: cannot open shared object file".
            evidence.append(
                f"no CUDA {jm.major} runtime in this env: a module that toolkit builds needs "
                f"libcudart.so.{jm.major}, and torch loads CUDA {tm.major}'s"
            )
        out.append(
            Finding(
                code="jit-toolkit-mismatch",
                severity=ERROR if major else WARNING,
                cause=f"the JIT toolkit is CUDA {release} ({where}) but torch is built for CUDA "
                f"{torch_cuda}"
                + (
                    ": a major mismatch, torch's cpp_extension refuses it"
                    if major
                    else ": a minor mismatch (torch only warns; headers and runtime differ)"
                )
                + (
                    # The origin story on a box with no GPU to say SM 12.x: name it anyway.
                    f'; CUDA {jm} cannot build for SM 12.x either (FlashInfer: "SM 12.x '
                    f'requires CUDA >= {SM12_MIN_CUDA}")'
                    if jm < SM12_MIN_CUDA <= tm
                    else ""
                ),
                evidence=tuple(evidence),
                fix=_matched_fixes(facts, torch_cuda),
            )
        )
    return out


def _has_runtime_of(facts: Facts, major: int) -> bool:
    """Whether the env has a pip CUDA runtime of ``major`` (nvidia-cuda-runtime-cu12, or
    nvidia-cuda-runtime at a version of that major)."""
    for name, version in facts.dists.items():
        if policy.major_of(name, version) == major and "cuda-runtime" in canonicalize_name(name):
            return True
    return False


def sm12_intent(facts: Facts) -> str:
    """Why this env is meant for SM 12.x, if it is: a visible GPU, an arch list in its
    environment, the arch list it was built with (its manifest), or ``--archs``. The box that
    diagnoses it may have no GPU at all."""
    reasons = []
    if facts.manifest is not None and any(a.major == 12 for a in facts.manifest.archs):
        reasons.append(f"the env's arch list is {' '.join(archs.texts(facts.manifest.archs))}")
    if any(a.major == 12 for a in facts.target_archs):
        reasons.append(f"--archs {' '.join(archs.texts(facts.target_archs))}")
    for gpu in facts.gpus:
        if gpu.capability is not None and gpu.capability[0] == 12:
            reasons.append(f"GPU {gpu.index} {gpu.name} is SM {gpu.capability_text}")
    for var in variables.ARCH_LISTS:
        value = facts.env.get(var) or ""
        if any(arch.major == 12 for arch in archs.parse_lenient(value)):
            reasons.append(f"{var}={value}")
    return "; ".join(reasons)


def rule_wheels(facts: Facts) -> list[Finding]:
    """Mixed toolkit minors, more than one CUDA major, FlashInfer companions."""
    out: list[Finding] = []
    minors: dict[CudaVersion, list[str]] = {}
    for name in channels.CUDA_VERSIONED:
        if name in facts.dists:
            m = CudaVersion.read(facts.dists[name])
            if m is not None:
                minors.setdefault(m, []).append(f"{name} {facts.dists[name]}")
    if len(minors) > 1:
        want = facts.torch_cuda or str(max(minors, key=lambda k: len(minors[k])))
        pin = facts.dists.get("cuda-toolkit")
        out.append(
            Finding(
                code="mixed-toolkit-minors",
                severity=ERROR,
                cause=f"NVIDIA toolkit wheels of {len(minors)} CUDA minors are installed "
                f"({', '.join(str(m) for m in sorted(minors))}): nvcc and headers disagree "
                "(flashinfer#3493)",
                evidence=tuple(f"CUDA {m}: {', '.join(v)}" for m, v in sorted(minors.items())),
                fix=(
                    *((_adopt_fix(facts),) if _adopt_fix(facts) else ()),
                    "pin every component to torch's: `"
                    + install_command(
                        facts, "install", f"cuda-toolkit[nvcc,cudart,crt,nvvm,cccl]=={pin}"
                    )
                    + "`"
                    if pin
                    else f"reinstall the toolkit wheels of CUDA {want}",
                    "the cudaenv way: `cudaenv lock SPEC` refuses such a set; `cudaenv build SPEC`",
                ),
            )
        )
    # The bindings have their own finding below (a reinstall, not an uninstall, repairs them).
    split = policy.mixed_majors(
        {n: v for n, v in facts.dists.items() if canonicalize_name(n) not in channels.CUDA_BINDINGS}
    )
    if split is not None:
        majors: dict[int, list[str]] = {}
        for wheel in split.wheels:
            majors.setdefault(wheel.major, []).append(f"{wheel.name} {wheel.version}")
        torch_minor = CudaVersion.read(facts.torch_cuda)
        keep = torch_minor.major if torch_minor is not None else max(split.majors)
        drop = sorted(w.name for w in split.others(keep))
        out.append(
            Finding(
                code="multiple-cuda-majors",
                severity=ERROR,
                cause=f"CUDA {' and '.join(str(m) for m in split.majors)} wheels are installed "
                "together: two libcudart/libcublas generations in one process",
                evidence=tuple(
                    f"CUDA {m}: {', '.join(sorted(v))}" for m, v in sorted(majors.items())
                ),
                fix=(
                    install_command(facts, "uninstall", *drop),
                    "the cudaenv way: `cudaenv build SPEC` "
                    "(one CUDA major per env is a lock-time rule)",
                ),
            )
        )
    for found in policy.companion_mismatches(facts.dists):
        comp, comp_version, fi = found.companion, found.version, found.flashinfer
        out.append(
            Finding(
                code="flashinfer-companion-mismatch",
                severity=ERROR,
                cause=f"{comp} {comp_version} does not match flashinfer-python {fi or '(not installed)'}",
                evidence=(f"{comp} {comp_version}", f"flashinfer-python {fi}"),
                fix=(
                    install_command(facts, "install", f"{comp}=={fi}")
                    if fi
                    else install_command(facts, "uninstall", comp),
                ),
            )
        )
    return out


def rule_bindings(facts: Facts) -> list[Finding]:
    """cuda-python or cuda-bindings of another CUDA major than torch's: cuda-python < 12.8
    ships cuda/bindings/ itself, so installed over torch's cuda-bindings 13 it replaces their
    files (`import flashinfer` fails); a cuda-python 12 metapackage pins cuda-bindings 12."""
    torch = CudaVersion.read(facts.torch_cuda)
    if torch is None:
        return []
    wrong = policy.binding_mismatches(facts.dists, torch.major)
    if not wrong:
        return []
    m = torch.major
    by: dict[str, str] = {canonicalize_name(n): v for n, v in facts.dists.items()}
    wanted = policy.binding_repair(facts.dists, m)
    # Reinstalled, not only upgraded: uninstalling the old cuda-python removes the
    # cuda/bindings/ files it shares with cuda-bindings.
    if "pip" in facts.dists:
        repair = install_command(facts, "install --force-reinstall", *wanted)
    else:
        repair = install_command(facts, "install --reinstall-package cuda-bindings", *wanted)
    fixes: list[str] = []
    adopt_fix = _adopt_fix(
        facts, f"reinstalls the CUDA {m} bindings, installs torch's matched toolkit"
    )
    if adopt_fix is not None:
        fixes.append(adopt_fix)
    if facts.manifest is not None and facts.manifest.spec != manifest.ADOPTED_SPEC:
        fixes.append(
            f"re-lock and rebuild: `cudaenv build {facts.manifest.spec} --relock` (the lock "
            f"now keeps the bindings at CUDA {m})"
        )
    fixes.append(f"`{repair}`")
    names = ", ".join(f"{w.name} {w.version} (CUDA {w.major})" for w in wrong)
    return [
        Finding(
            code="cuda-binding-major",
            severity=ERROR,
            cause=f"{names} binds another CUDA major than torch {facts.torch_version} "
            f"(CUDA {facts.torch_cuda}): "
            + (
                "cuda-python below 12.8 ships cuda/bindings/ itself, the same files as "
                "cuda-bindings: where its copy was written last (installers write in "
                "parallel), `import flashinfer` and anything using cuda.bindings fail"
                if any(canonicalize_name(w.name) == "cuda-python" for w in wrong)
                else f"its driver and runtime calls are CUDA {wrong[0].major}'s"
            ),
            evidence=(
                *(f"{n} {by[n]}" for n in channels.CUDA_BINDINGS if n in by),
                f"torch {facts.torch_version} (CUDA {facts.torch_cuda})",
            ),
            fix=tuple(fixes),
        )
    ]


def rule_nvjitlink(facts: Facts) -> list[Finding]:
    """An nvJitLink older than the CUDA runtime: the libraries of the newer minor (cuSPARSE,
    cuFFT) and any link of LTO-IR or of the device runtime the newer toolkit wrote call its
    versioned entry points ("libcusparse.so.12: undefined symbol: __nvJitLinkComplete_12_4,
    version libnvJitLink.so.12", pytorch/pytorch#111469, #134929)."""
    by: dict[str, str] = {canonicalize_name(n): v for n, v in facts.dists.items()}
    out: list[Finding] = []
    for link_name, runtime_name in (
        ("nvidia-nvjitlink-cu12", "nvidia-cuda-runtime-cu12"),
        ("nvidia-nvjitlink", "nvidia-cuda-runtime"),
    ):
        link, runtime = by.get(link_name), by.get(runtime_name)
        have, need = CudaVersion.read(link), CudaVersion.read(runtime)
        if have is None or need is None or have.major != need.major or have >= need:
            continue
        upper = f"{need.major + 1}"
        out.append(
            Finding(
                code="nvjitlink-too-old",
                severity=ERROR,
                cause=f"{link_name} {link} (nvJitLink {have}) is older than the CUDA runtime "
                f"{runtime} ({need}): CUDA {need}'s cuSPARSE/cuFFT and links of what its "
                f'toolkit compiled call nvJitLink {need} entry points ("undefined symbol: '
                f'__nvJitLinkComplete_{need.major}_{need.minor}" and the like)',
                evidence=(f"{link_name} {link}", f"{runtime_name} {runtime}"),
                fix=(
                    *((_adopt_fix(facts),) if _adopt_fix(facts) else ()),
                    "`" + install_command(facts, "install", f"{link_name}>={need},<{upper}") + "`",
                    "the cudaenv way: `cudaenv lock SPEC` keeps every component at one CUDA "
                    "minor; `cudaenv build SPEC`",
                ),
            )
        )
    return out


# A library of a CUDA major the loader could not find, as an import error says it.
_MISSING_CUDA_LIB = re.compile(
    rf"({'|'.join(audit.CUDA_LIBRARIES)})\.so\.(\d+): cannot open shared object"
)
_SITE_FILE = re.compile(r"site-packages/([^/\s:]+)/")


def rule_other_major_binary(facts: Facts) -> list[Finding]:
    """A prebuilt extension that links another CUDA major's runtime than torch's (an
    sgl-kernel or vLLM wheel built for CUDA 13 beside a cu129 torch, or the reverse): its
    import fails with "libcudart.so.13: cannot open shared object file" (read by --deep)."""
    torch = CudaVersion.read(facts.torch_cuda)
    if torch is None or facts.deep is None:
        return []
    errors: dict[str, str] = {}
    for key in ("torch", "flashinfer"):
        part = facts.deep.get(key)
        if isinstance(part, dict) and part.get("error"):
            errors[key] = str(part["error"])
    imports = facts.deep.get("imports")
    if isinstance(imports, dict):
        errors.update({str(k): str(v) for k, v in imports.items() if v})
    out: list[Finding] = []
    for module, error in sorted(errors.items()):
        m = _MISSING_CUDA_LIB.search(error)
        if m is None or int(m.group(2)) == torch.major:
            continue
        lib, major = m.group(1), int(m.group(2))
        where = _SITE_FILE.search(error)
        package = where.group(1) if where else module.split(".")[0]
        out.append(
            Finding(
                code="built-for-other-cuda-major",
                severity=ERROR,
                cause=f"import {module} failed: {package} is built for CUDA {major} (it needs "
                f"{lib}.so.{major}) but torch {facts.torch_version} is CUDA {facts.torch_cuda}",
                evidence=(error[:300], f"torch {facts.torch_version} (CUDA {facts.torch_cuda})"),
                fix=(
                    f"install {package}'s build for CUDA {torch.major} (the wheel or index its "
                    f"project publishes for cu{torch.major}x), or a torch of CUDA {major} with "
                    "everything else",
                    "do not add the other major's runtime: two libcudart generations in one "
                    "process (`cudaenv audit` lists what every binary links)",
                ),
            )
        )
    return out


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


def rule_driver(facts: Facts) -> list[Finding]:
    if facts.driver is None:
        return [
            Finding(
                code="no-driver",
                severity=INFO,
                cause="no NVIDIA driver (/proc/driver/nvidia/version absent): kernels "
                "compile but cannot run here",
            )
        ]
    tm = CudaVersion.read(facts.torch_cuda)
    if tm is None or tm.major not in driver.MINIMUM_DRIVER:
        return []
    try:
        too_old = not driver.runs(facts.driver, tm)
        fits = driver.newest_cuda_major(facts.driver)
    except ValueError:  # the probe read a version that is not dotted numbers: no judgement
        return []
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
            cause=f"driver {facts.driver} is too old for torch's CUDA {facts.torch_cuda}: "
            f"CUDA {tm.major}.x needs {need}+",
            evidence=(f"driver {facts.driver}", f"torch {facts.torch_version}"),
            fix=(
                f"install NVIDIA driver {need} or newer (or cuda-compat-{tm.major}-{tm.minor} "
                "on a datacenter GPU)",
                older,
            ),
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


def rule_host_compiler(facts: Facts) -> list[Finding]:
    home = facts.jit_home
    if not home or not home.release or home.max_gcc is None or facts.gcc_major is None:
        return []
    if facts.gcc_major > home.max_gcc:
        return [
            Finding(
                code="host-compiler-unsupported",
                severity=ERROR,
                cause=f"nvcc {home.release} accepts GCC up to {home.max_gcc} (its crt/host_config.h) "
                f"but the host compiler is GCC {facts.gcc_major} ({facts.cxx})",
                evidence=(facts.cxx_banner,),
                fix=(
                    f"install g++-{home.max_gcc} and `export NVCC_PREPEND_FLAGS='-ccbin "
                    f"g++-{home.max_gcc}'`",
                    "or use a newer CUDA whose nvcc accepts it",
                ),
            )
        ]
    return []


def rule_glibc(facts: Facts) -> list[Finding]:
    home = facts.jit_home
    try:
        glibc = Version(facts.glibc) if facts.glibc else None
    except InvalidVersion:
        glibc = None
    release = CudaVersion.read(home.release) if home else None
    if (
        glibc
        and glibc >= Version("2.42")
        and release is not None
        and release < CudaVersion(major=13, minor=2)
    ):
        return [
            Finding(
                code="glibc-too-new-for-cuda",
                severity=ERROR,
                cause=f"glibc {facts.glibc} declares math functions (rsqrt, sinpi, ...) that CUDA "
                f"{home.release if home else ''} headers redeclare: nvcc fails with "
                "'exception specification is incompatible'; CUDA 13.2+ fixed it",
                evidence=(f"glibc {facts.glibc}", f"nvcc {home.release if home else ''}"),
                fix=('use CUDA 13.2 or newer (a spec with cuda: "13.2", torch 2.15)',),
            )
        ]
    return []


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


def rule_no_host_compiler(facts: Facts) -> list[Finding]:
    """nvcc hands every host-side file to a C++ compiler: without one no JIT build works."""
    wants_jit = facts.flashinfer or facts.torch_installed or facts.jit_home is not None
    probed = "host_compiler" not in facts.errors  # a crashed step is rule_probe's finding
    if not wants_jit or not probed or (facts.cxx is not None and facts.cxx_error is None):
        return []
    what = (
        f"the host C++ compiler {facts.cxx} does not run ({facts.cxx_error})"
        if facts.cxx
        else f"no host C++ compiler ({facts.cxx_error or 'none found'})"
    )
    return [
        Finding(
            code="no-host-compiler",
            severity=ERROR,
            cause=f"{what}: nvcc needs one, so every JIT compile (FlashInfer, torch "
            "cpp_extension) fails",
            evidence=(f"CXX={facts.env.get('CXX') or '(unset)'}",),
            fix=(
                "install a C++ compiler: `apt-get install g++` (or your distro's equivalent)",
                "or point at one: `export CXX=/path/to/g++` or "
                "`export NVCC_PREPEND_FLAGS='-ccbin /path/to/g++'`",
            ),
        )
    ]


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
                _adopt_fix(facts)
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
                _adopt_fix(facts)
                or f"rebuild the env: cudaenv build {facts.manifest.spec} --force",
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


RULES: tuple[Callable[[Facts], list[Finding]], ...] = (
    rule_probe,
    rule_nvcc,
    rule_wheels,
    rule_bindings,
    rule_nvjitlink,
    rule_other_major_binary,
    rule_driver,
    rule_jit_cache,
    rule_caches,
    rule_activation,
    rule_drift,
    rule_remote_cache,
    rule_host_compiler,
    rule_no_host_compiler,
    rule_glibc,
    rule_gpu_archs,
    rule_last_verify,
)
ROOT_FIRST = (
    "probe-failed",
    "cuda-binding-major",
    "built-for-other-cuda-major",
    "torch-import-failed",
    "flashinfer-import-failed",
    "sm12x-nvcc-too-old",
    "nvcc-broken",
    "no-nvcc",
    "jit-toolkit-mismatch",
    "glibc-too-new-for-cuda",
    "no-host-compiler",
    "host-compiler-unsupported",
    "nvjitlink-too-old",
    "mixed-toolkit-minors",
    "multiple-cuda-majors",
    "flashinfer-companion-mismatch",
    "driver-too-old",
    "stale-jit-cache",
    "cache-outside-env",
    "activation-unwired",
    "env-drift",
    "remote-cache-auth",
    "remote-cache-unwired",
    "remote-cache-down",
    "gpu-arch-missing",
    "old-jit-cache",
    "no-driver",
    "last-verify-failed",  # after every cause the doctor can name itself
    "rule-crashed",  # a doctor bug, not the env's: after every finding about the env
)
# root -> the symptoms it explains (grouped under it when both fire).
EXPLAINS = {
    "sm12x-nvcc-too-old": ("jit-toolkit-mismatch",),
    "nvcc-broken": ("jit-toolkit-mismatch",),
    "mixed-toolkit-minors": ("jit-toolkit-mismatch",),
    "built-for-other-cuda-major": (
        "flashinfer-import-failed",
        "torch-import-failed",
        "last-verify-failed",
    ),
    "cuda-binding-major": ("flashinfer-import-failed", "torch-import-failed", "last-verify-failed"),
}


def _apply(rule: Callable[[Facts], list[Finding]], facts: Facts) -> list[Finding]:
    """One rule; a rule that raises becomes a Finding so the others still report."""
    try:
        return rule(facts)
    except Exception as exc:  # any bug in one rule must not hide the other findings
        return [
            Finding(
                code="rule-crashed",
                severity=ERROR,
                cause=f"the doctor's rule {rule.__name__} crashed: {type(exc).__name__}: {exc}",
                fix=(
                    "the findings above are still valid; report this cudaenv bug with the "
                    "output of `cudaenv doctor --json`",
                ),
            )
        ]


def diagnose(facts: Facts) -> list[Finding]:
    found = [f for rule in RULES for f in _apply(rule, facts)]
    by_code = {f.code: f for f in found}
    grouped: list[Finding] = []
    absorbed: set[str] = set()
    for f in found:
        for code in EXPLAINS.get(f.code, ()):
            if code in by_code and code not in absorbed:
                absorbed.add(code)
                f = replace(f, symptoms=(*f.symptoms, by_code[code]))
        grouped.append(f)
    grouped = [f for f in grouped if f.code not in absorbed]
    rank = {code: i for i, code in enumerate(ROOT_FIRST)}
    return sorted(grouped, key=lambda f: (SEVERITY_ORDER[f.severity], rank.get(f.code, 99)))
