"""The doctor's rules about the toolchain a JIT compile uses: the nvcc it finds against torch's
CUDA (and SM 12.x), the host C++ compiler and glibc; and the fixes every rule shares (adopt the
env in place, install as the env does).

Each rule is one function over :class:`~builder.doctor.facts.Facts`;
:func:`builder.doctor.rules.diagnose` runs them all.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from builder.core import variables
from builder.core.cudaversion import CudaVersion
from builder.doctor.facts import ERROR, WARNING, CudaHome, Facts, Finding
from builder.env import manifest
from builder.machine import archs
from builder.spec import policy

# FlashInfer's own gate: "Failed to get device capability: SM 12.x requires CUDA >= 12.9".
SM12_MIN_CUDA = CudaVersion(major=12, minor=9)


def _home_text(home: CudaHome) -> str:
    if home.source.startswith("$"):
        return f"{home.source[1:]}={home.path}"
    return f"{home.path}, from {home.source}"


def adopt_fix(facts: Facts, does: str = "installs torch's matched toolkit") -> str | None:
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
    in_place = adopt_fix(facts)
    if in_place is not None and want:
        fixes.append(in_place)
    if want:
        for tk in facts.toolkits:
            if tk.release == want:
                fixes.append(f"export CUDA_HOME={tk.path}")
                break
    if facts.manifest is not None and in_place is None:
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
    if home is None or not home.exists:
        return _no_nvcc(facts, home)
    where = _home_text(home)
    if home.error or not home.release:
        return [
            Finding(
                code="nvcc-broken",
                severity=ERROR,
                cause=f"{home.nvcc} --version failed: {home.error}",
                evidence=(f"JIT CUDA_HOME: {where}",),
                fix=("repair or replace that toolkit", *_matched_fixes(facts, torch_cuda)),
            )
        ]
    release = home.release
    evidence = [f"JIT CUDA_HOME: {where} (nvcc {release})"]
    if facts.torch_version:
        evidence.append(f"torch {facts.torch_version} built for CUDA {torch_cuda}")
    if Path(home.path).name == "usr":
        evidence.append("a distro /usr/bin/nvcc makes FlashInfer and torch use /usr as CUDA_HOME")
    out: list[Finding] = []
    intent = sm12_intent(facts)
    # Versions another interpreter reported: one that cannot be read is not known, and the
    # rules that need it say nothing.
    jm = CudaVersion.read(release)
    if intent and jm is not None and jm < SM12_MIN_CUDA:
        out.append(_sm12_too_old(facts, home, evidence, intent))
    tm = CudaVersion.read(torch_cuda)
    if tm is not None and jm is not None and tm != jm:
        out.append(_toolkit_mismatch(facts, home, evidence, jm, tm))
    return out


def _no_nvcc(facts: Facts, home: CudaHome | None) -> list[Finding]:
    """No nvcc where the JIT looks (no toolkit named, or one named that has none): an error
    where FlashInfer would compile, a warning where only torch's cpp_extension would."""
    if not (facts.flashinfer or facts.torch_installed):
        return []
    torch_cuda = facts.torch_cuda
    evidence: tuple[str, ...] = ()
    if home is None:
        cause = "no nvcc reachable: no CUDA_HOME, CUDA_PATH, nvcc on PATH or /usr/local/cuda" + (
            f"; FlashInfer silently falls back to torch's CUDA {torch_cuda} and every JIT "
            "compile fails"
            if facts.flashinfer
            else ""
        )
    else:
        where = _home_text(home)
        cause = f"no nvcc at {home.nvcc} ({where})" + (
            f": FlashInfer's get_cuda_version() silently falls back to torch's CUDA "
            f"{torch_cuda}, and its JIT compiles fail"
            if facts.flashinfer
            else ""
        )
        evidence = (f"JIT CUDA_HOME: {where}",)
    return [
        Finding(
            code="no-nvcc",
            severity=ERROR if facts.flashinfer else WARNING,
            cause=cause,
            evidence=evidence,
            fix=_matched_fixes(facts, torch_cuda),
        )
    ]


def _sm12_too_old(facts: Facts, home: CudaHome, evidence: list[str], intent: str) -> Finding:
    """The JIT's nvcc cannot target the SM 12.x the env is meant for (``intent``: why it is)."""
    torch_cuda = facts.torch_cuda
    release, where = home.release, _home_text(home)
    torch_part = f" but torch is built for CUDA {torch_cuda}" if torch_cuda else ""
    return Finding(
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


def _toolkit_mismatch(
    facts: Facts, home: CudaHome, evidence: list[str], jm: CudaVersion, tm: CudaVersion
) -> Finding:
    """The JIT toolkit (CUDA ``jm``) is not torch's CUDA (``tm``): a major apart, torch's
    cpp_extension refuses it; a minor apart, it only warns."""
    torch_cuda = facts.torch_cuda
    release, where = home.release, _home_text(home)
    major = tm.major != jm.major
    if major and not _has_runtime_of(facts, jm.major):
        # What a module built anyway (FlashInfer's JIT does not ask cpp_extension) then
        # fails with at load: "libcudart.so.12: cannot open shared object file".
        evidence = [
            *evidence,
            f"no CUDA {jm.major} runtime in this env: a module that toolkit builds needs "
            f"libcudart.so.{jm.major}, and torch loads CUDA {tm.major}'s",
        ]
    return Finding(
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
