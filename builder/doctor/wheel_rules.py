"""The doctor's rules about the CUDA wheels and binaries in an env: toolkit wheels of mixed
minors or majors, FlashInfer's companions, cuda-python/cuda-bindings of another major than
torch's, an nvJitLink older than the runtime, and a prebuilt extension of another CUDA major.

Each rule is one function over :class:`~builder.doctor.facts.Facts`;
:func:`builder.doctor.rules.diagnose` runs them all.
"""

from __future__ import annotations

import re

from packaging.utils import canonicalize_name

from builder.audit import scan as audit
from builder.core.cudaversion import CudaVersion
from builder.doctor.facts import ERROR, Facts, Finding
from builder.doctor.toolkit_rules import adopt_fix, install_command
from builder.env import manifest
from builder.spec import channels, policy


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
                    *((adopt_fix(facts),) if adopt_fix(facts) else ()),
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
                fix=companion_fix(facts, comp, fi),
            )
        )
    return out


def companion_requirement(companion: str, flashinfer: str) -> str:
    """The release of ``companion`` that matches flashinfer-python ``flashinfer``."""
    return f"{companion}=={flashinfer}"


def companion_fix(facts: Facts, companion: str, flashinfer: str | None) -> tuple[str, ...]:
    """The matching release where the env's index holds it, else the companion's removal
    (FlashInfer compiles what a companion would have held: it is optional); where the index
    could not be asked, both, as prose. Never a version the index does not hold."""
    remove = install_command(facts, "uninstall", companion)
    if not flashinfer:
        return (remove,)
    want = companion_requirement(companion, flashinfer)
    held = facts.index_has(want)
    if held is True:
        return (install_command(facts, "install", want),)
    if held is False:
        return (f"{remove}  # the index holds no {want}; FlashInfer compiles what it would hold",)
    return (
        f"the index could not be asked: install `{want}` where it holds that release "
        f"(`{install_command(facts, 'install', want)}`), else remove the companion "
        f"(`{remove}`)",
    )


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
    in_place = adopt_fix(
        facts, f"reinstalls the CUDA {m} bindings, installs torch's matched toolkit"
    )
    if in_place is not None:
        fixes.append(in_place)
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
                    *((adopt_fix(facts),) if adopt_fix(facts) else ()),
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
