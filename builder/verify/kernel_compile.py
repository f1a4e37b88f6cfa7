"""`kernel-compile`: cudaenv's own top-k/top-p kernel (CUB from the toolkit's CCCL) compiles
for every arch with the env's nvcc, static cudart, into the env's own work dir.

A build is keyed by the kernel source, the nvcc binary and its version, the flags and the
arch: an unchanged env reuses it (and says so in the evidence).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from builder import proc
from builder.spec import Arch
from builder.verify import FAILED, PASSED, CheckResult, EnvFacts, Target

FLAGS = ("-O2", "--fmad=false", "-std=c++17")


@dataclass(frozen=True, kw_only=True)
class KernelBuild:
    arch: Arch
    path: Path
    seconds: float
    reused: bool
    error: str | None = None


def source() -> str:
    return resources.files("builder.kernels").joinpath("topk_topp.cu").read_text()


def gencode(arch: Arch) -> str:
    code = f"{arch.major}{arch.minor}{arch.suffix}"
    return f"-gencode=arch=compute_{code},code=sm_{code}"


def nvcc_of(facts: EnvFacts) -> Path:
    return Path(facts.cuda_home) / "bin" / "nvcc"


def build_kernel(nvcc: Path, arch: Arch, work: Path, *, fresh: bool = False) -> KernelBuild:
    src = source()
    version = proc.run([nvcc, "--version"], timeout=60).stdout
    real = os.path.realpath(nvcc)
    stat = Path(real).stat()
    key = hashlib.sha256(
        "\0".join(
            [src, version, real, str(stat.st_size), str(stat.st_mtime_ns), *FLAGS, gencode(arch)]
        ).encode()
    ).hexdigest()[:16]
    out_dir = work / "kernels" / key
    out = out_dir / f"topk_topp.{arch.sm}"
    if out.exists() and not fresh:
        return KernelBuild(arch=arch, path=out, seconds=0.0, reused=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "topk_topp.cu").write_text(src)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    started = time.monotonic()
    done = proc.run(
        [nvcc, *FLAGS, gencode(arch), "-o", tmp, out_dir / "topk_topp.cu"],
        check=False,
        timeout=1800,
    )
    seconds = time.monotonic() - started
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        message = (done.stderr + done.stdout).strip().splitlines()
        return KernelBuild(
            arch=arch,
            path=out,
            seconds=seconds,
            reused=False,
            error="\n".join(message[-8:]) or f"nvcc exited {done.returncode}",
        )
    os.replace(tmp, out)
    return KernelBuild(arch=arch, path=out, seconds=seconds, reused=False)


def check(target: Target, facts: EnvFacts) -> CheckResult:
    nvcc = nvcc_of(facts)
    if not nvcc.exists():
        return CheckResult(
            name="kernel-compile",
            status=FAILED,
            summary=f"no nvcc at {nvcc}",
            fix="build the env with a wheels toolchain that includes 'nvcc', or set CUDA_HOME",
        )
    evidence: list[tuple[str, str]] = [("nvcc", str(nvcc))]
    failures = []
    total = 0.0
    for text in target.archs:
        arch = Arch.parse(text)
        built = build_kernel(nvcc, arch, target.work)
        total += built.seconds
        if built.error:
            failures.append(f"{arch}: {built.error}")
            evidence.append((str(arch), f"failed after {built.seconds:.1f} s"))
        else:
            how = (
                "reused (unchanged source, nvcc and flags)"
                if built.reused
                else (f"compiled in {built.seconds:.1f} s")
            )
            evidence.append((str(arch), f"{built.path} {how}"))
    if failures:
        return CheckResult(
            name="kernel-compile",
            status=FAILED,
            summary=f"nvcc {facts.nvcc_release} cannot build " + "; ".join(failures),
            evidence=tuple(evidence),
            seconds=total,
            fix="drop the arch from the spec's archs, or use a CUDA that supports it "
            "(12.0f needs 12.9+, 12.0a 12.8+)",
        )
    return CheckResult(
        name="kernel-compile",
        status=PASSED,
        summary=f"top-k/top-p kernel built for {' '.join(target.archs)} "
        f"with nvcc {facts.nvcc_release}",
        evidence=tuple(evidence),
        seconds=total,
    )
