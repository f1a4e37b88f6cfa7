"""`cubin`: `cuobjdump --list-elf` on what was built lists an sm_XX cubin for each arch: our
kernel, FlashInfer's sampling module, and every extension module with device code of the
packages the env built from their sdists (builder/env/sourcebuild.py).

cuobjdump comes from CUDA_HOME when the toolkit has it, else from the
`nvidia-cuda-cuobjdump` wheel (published from CUDA 13.2 on; a newer cuobjdump reads older
fatbins), installed once with uv into cudaenv's cache, outside every env. The cached copy runs
only while its sha256 is the one recorded when this user installed it (cachefiles).
"""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
from pathlib import Path

from builder.core import cachefiles, proc
from builder.core.paths import cache_dir
from builder.core.statuses import FAILED, PASSED, SKIPPED
from builder.machine.archs import Arch
from builder.verify.kernel_compile import build_kernel, nvcc_of
from builder.verify.model import CheckResult, EnvFacts, Target, env_of

TOOL_REQUIREMENT = "nvidia-cuda-cuobjdump>=13.2,<14"
# A RECORD larger than this is not read for the extensions it names (torch's is 1.3 MiB).
RECORD_LIMIT = 64 << 20


def find_cuobjdump(facts: EnvFacts) -> tuple[Path | None, str]:
    own = Path(facts.cuda_home) / "bin" / "cuobjdump"
    if own.exists():
        return own, f"{own} (the env's toolkit)"
    tools = cachefiles.own_dir(cache_dir() / "tools")
    if tools is not None:
        tool_dir = tools / "cuobjdump"
        record = tools / "cuobjdump.sha256.json"
        if cachefiles.vouched(tool_dir / _EXE, record):
            return tool_dir / _EXE, _described(tool_dir)
        # Nothing vouches for what is there (never installed, a damaged or a planted file):
        # it is never run; a fresh install replaces it and records its sha256.
        try:
            if tool_dir.is_symlink() or tool_dir.is_file():
                tool_dir.unlink()
            elif tool_dir.exists():
                shutil.rmtree(tool_dir)  # removes links in the tree, never what they point to
            return _install(tool_dir, record)
        except OSError:
            pass
    # No cache to keep it in (refused: cachefiles warned): this run's own copy, gone at exit.
    scratch = Path(tempfile.mkdtemp(prefix="cudaenv-cuobjdump-"))
    atexit.register(shutil.rmtree, scratch, True)
    return _install(scratch / "cuobjdump", None)


# Where the nvidia-cuda-cuobjdump wheel puts the tool, below the install target.
_EXE = Path("nvidia") / "cu13" / "bin" / "cuobjdump"


def _install(tool_dir: Path, record: Path | None) -> tuple[Path | None, str]:
    exe = tool_dir / _EXE
    done = proc.run(
        [proc.uv_bin(), "pip", "install", "--quiet", "--target", tool_dir, TOOL_REQUIREMENT],
        env=proc.uv_env(),
        check=False,
        timeout=600,
    )
    if done.returncode != 0 or not exe.exists():
        return (
            None,
            f"no cuobjdump in CUDA_HOME and `uv pip install {TOOL_REQUIREMENT}` failed: "
            + (done.stderr.strip().splitlines() or ["?"])[-1],
        )
    if record is not None:
        cachefiles.record_tool(exe, record)
    return exe, _described(tool_dir)


def _described(tool_dir: Path) -> str:
    dists = sorted(tool_dir.glob("nvidia_cuda_cuobjdump-*.dist-info"))
    version = dists[-1].name.removesuffix(".dist-info").split("-")[1] if dists else "?"
    return f"{tool_dir / _EXE} (nvidia-cuda-cuobjdump {version})"


def built_extensions(env: Path | None) -> list[tuple[str, Path]]:
    """(label, path) of each shared object with device code that a package the env built
    from its sdist installed (its RECORD's, inside site-packages, no link followed): built
    for the env's archs alone, so each must hold them."""
    if env is None:
        return []
    from packaging.utils import canonicalize_name

    from builder.env import manifest, recipes
    from builder.env.recordscan import shared_objects
    from builder.machine import fatbin

    built = manifest.source_built(env)
    found: list[tuple[str, Path]] = []
    for site in sorted(env.glob("lib/python3*/site-packages")) if built else []:
        for info in sorted(site.glob("*.dist-info")):
            name = canonicalize_name(info.name.removesuffix(".dist-info").partition("-")[0])
            if name not in built or info.is_symlink():
                continue
            modules: list[tuple[str, Path, fatbin.Scan]] = []
            for rel in shared_objects(info / "RECORD", RECORD_LIMIT):
                path = site / rel
                if rel.startswith("/") or ".." in rel.split("/") or path.is_symlink():
                    continue
                if path.is_file():
                    modules.append((f"{name} {rel}", path, fatbin.scan(path)))
            with_code = [(label, path) for label, path, read in modules if read.codes]
            # None holds device code while one links torch: a CPU build of a CUDA package
            # (audit.scan.built_without_cuda), checked (and failed), never skipped.
            found.extend(
                with_code
                or [
                    (label, path)
                    for label, path, read in modules
                    if read.links_torch and not recipes.host_module(name, path.name)
                ]
            )
    return found


def list_elf(cuobjdump: Path, artifact: Path) -> list[str]:
    """The sm_XX names of the cubins embedded in ``artifact``."""
    done = proc.run([cuobjdump, "--list-elf", artifact], check=False, timeout=300)
    return sorted(set(re.findall(r"\.(sm_\d+[af]?)\.cubin", done.stdout)))


def check(target: Target, facts: EnvFacts) -> CheckResult:
    """Each artifact against each arch it must hold: our kernel's binary per requested arch,
    FlashInfer's sampling library for every requested arch. A pair that is missing fails,
    naming both; the summary claims only the pairs it looked at."""
    cuobjdump, where = find_cuobjdump(facts)
    if cuobjdump is None:
        return CheckResult(name="cubin", status=SKIPPED, summary=where)
    evidence: list[tuple[str, str]] = [("cuobjdump", where)]
    artifacts: list[tuple[str, Path, tuple[Arch, ...]]] = []
    problems: list[str] = []
    nvcc = nvcc_of(facts)
    env = env_of(target, facts)
    if nvcc.exists():
        for arch in target.archs:
            built = build_kernel(nvcc, arch, target.work, env=env)
            if built.error is None:
                artifacts.append((f"topk_topp {arch}", built.path, (arch,)))
            else:
                problems.append(f"topk_topp {arch}: not built (see kernel-compile)")
    library = facts.jit.library
    if library and Path(library).exists():
        artifacts.append(("flashinfer sampling", Path(library), target.archs))
    for label, path in built_extensions(target.env_dir):
        artifacts.append((label, path, target.archs))
    if not artifacts:
        return CheckResult(
            name="cubin",
            status=SKIPPED,
            evidence=tuple(evidence),
            summary="nothing was built to inspect (kernel-compile and flashinfer-jit "
            "produced no artifact)",
        )
    checked = 0
    for label, path, wanted in artifacts:
        listed = list_elf(cuobjdump, path)
        evidence.append((label, f"{path}: {' '.join(listed) or 'no cubin'}"))
        held = {re.sub(r"[af]$", "", s) for s in listed}
        for arch in wanted:
            checked += 1
            if arch.cubin_sm not in held:
                problems.append(
                    f"{label} has no {arch.cubin_sm} cubin for {arch} "
                    f"(it holds {' '.join(listed) or 'none'})"
                )
    if problems:
        return CheckResult(
            name="cubin",
            status=FAILED,
            summary="; ".join(problems),
            evidence=tuple(evidence),
            fix="the build targeted other archs: check FLASHINFER_CUDA_ARCH_LIST "
            "and the spec's archs, then verify again",
        )
    return CheckResult(
        name="cubin",
        status=PASSED,
        summary=f"{checked} artifact/arch pair(s) checked: "
        + "; ".join(
            f"{label} holds {' '.join(a.cubin_sm for a in wanted)}"
            for label, _, wanted in artifacts
        ),
        evidence=tuple(evidence),
    )
