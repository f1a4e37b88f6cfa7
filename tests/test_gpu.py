"""Needs a visible NVIDIA GPU: skipped here with the reason (conftest.gpu_reason).

Run on a GPU box: `nox -s tests -- -m gpu`, or `bash .ci/gpu-check.sh`. The toolchain env needs nothing but the
driver; the FlashInfer half needs an env with torch and FlashInfer (the default spec's).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from builder.core.statuses import PASSED
from builder.machine import archs
from builder.verify import probe, sampling
from builder.verify import reference as ref
from builder.verify.kernel_compile import build_kernel
from builder.verify.model import EnvFacts, Target
from tests.helpers import ENVSPECS, REPO


def env_python(name: str) -> Path:
    """The env's python; on a box with no package index (the lent GPU machine), the
    interpreter named by CUDAENV_GPU_PYTHON, whose CUDA_HOME holds an nvcc, stands in."""
    given = os.environ.get("CUDAENV_GPU_PYTHON")
    if given:
        return Path(given)
    path = REPO / ".envs" / name / "bin" / "python"
    if not path.exists():
        subprocess.run(
            [sys.executable, "-m", "builder.cli", "build", str(ENVSPECS / f"{name}.yaml")],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            check=True,
        )
    return path


@pytest.mark.gpu
def test_our_kernel_is_exact_on_every_visible_gpu(tmp_path: Path) -> None:
    gpus, why = archs.visible_gpus()
    assert gpus, why
    python = env_python("toolchain-cu130")
    target = Target(python=python, archs=(), work=tmp_path)
    facts = probe(target, jit=False)
    env = dict(facts.environ)
    cases = ref.make_cases()
    us = sampling.uniforms(7, len(cases))
    for gpu in gpus:
        arch = gpu.arch(facts.nvcc_cuda)
        assert arch is not None, gpu
        built = build_kernel(Path(facts.cuda_home) / "bin" / "nvcc", arch, tmp_path, env=env)
        assert built.error is None, built.error
        device = sampling.Device(gpu=gpu, select=gpu.uuid)
        samples, error = sampling.run_kernel(built.path, device, cases, us, tmp_path, env)
        assert samples is not None, error
        verdicts = sampling.judge_kernel(cases, us, samples)
        assert [v.detail for v in verdicts if not v.passed] == []


@pytest.mark.gpu
def test_sampling_check_passes_in_the_default_env(tmp_path: Path) -> None:
    python = env_python("sglang-0.5.23-cu130")
    target = Target(python=python, archs=(), work=tmp_path, env_dir=python.parent.parent)
    facts: EnvFacts = probe(target, jit=False)
    if not facts.flashinfer_installed:
        pytest.skip(f"FlashInfer is not installed in {python}")
    # Verified for the GPUs at hand, as `cudaenv verify --archs` would be.
    gpus, _ = archs.visible_gpus()
    here = archs.env_archs((), facts.nvcc_cuda or archs.DEFAULT_CUDA, gpus)
    target = dataclasses.replace(target, archs=here)
    result = sampling.check(target, facts)
    assert result.status == PASSED, (result.summary, result.evidence)


# The source build's promise on hardware: what the audit reads in a built extension's fatbin
# (SASS for the GPU, PTX the driver can JIT, or nothing) is what happens when it runs there.
RUN_ADD_ONE = """
import json, sys, torch
import cudaenv_testext._C as C
x = torch.arange(4096, dtype=torch.float32, device="cuda")
y = C.add_one(x)
torch.cuda.synchronize()
error = ""
try:  # a launch with no kernel for the GPU fails quietly: the error is read, not raised
    error = str(torch.cuda.cudart().cudaGetErrorString(torch.cuda.cudart().cudaGetLastError()))
except Exception as exc:  # noqa: BLE001 - the error text is evidence, not a verdict
    error = f"(not read: {exc})"
print(json.dumps({"ran": bool(torch.equal(y, x + 1)), "error": error}))
"""


def _pip(python: Path) -> list[str]:
    """The pip that cudaenv's source build runs (the one the interpreter's ensurepip
    bundles), else the interpreter's own ``-m pip`` (a cudaenv env has only a stand-in)."""
    from builder.core.errors import ToolMissing
    from builder.env import sdistbuild

    try:
        return [str(python), str(sdistbuild.bundled_pip(python) / "pip")]
    except ToolMissing:
        return [str(python), "-m", "pip"]


@pytest.mark.gpu
def test_a_source_built_extension_runs_where_the_audit_says(tmp_path: Path) -> None:
    import json
    import zipfile

    from builder.audit import scan as audit_scan
    from builder.machine import driver, fatbin
    from tests import sdist_maker

    gpus, why = archs.visible_gpus()
    assert gpus, why
    python = env_python("sglang-0.5.23-cu130")  # torch's extension builder, as users have it
    facts = probe(Target(python=python, archs=(), work=tmp_path), jit=False)
    seen_driver = driver.current()
    driver_cuda = seen_driver.newest_cuda() if seen_driver is not None else None
    gpu = gpus[0]
    arch = gpu.arch(facts.nvcc_cuda)
    assert arch is not None, gpu
    foreign = "80" if arch.major == 12 else "120"  # SASS of another major never runs
    # Each build's `-gencode`s hard-coded in its setup.py, as causal-conv1d does (torch then
    # adds no arch flags of its own, and no env's TORCH_CUDA_ARCH_LIST changes them), and
    # what each must hold for this GPU by the audit's reading.
    cases = {
        "native": (f"arch=compute_{arch.code},code=sm_{arch.code}", "sass"),
        "ptx": ("arch=compute_80,code=compute_80", "ptx"),
        "foreign": (f"arch=compute_{foreign},code=sm_{foreign}", "none"),
    }
    base = {**os.environ, "CUDA_HOME": facts.cuda_home, sdist_maker.FORCE: "TRUE",
            "CUDA_VISIBLE_DEVICES": "", "MAX_JOBS": "4", "PIP_NO_INPUT": "1"}  # fmt: skip
    builds = {}
    for name, (gencode, _) in cases.items():
        sdist = sdist_maker.make_sdist(
            tmp_path / f"{name}-sdist", extra_nvcc=f'"-gencode={gencode}"'
        )
        argv = [*_pip(python), "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                "-w", str(tmp_path / name), str(sdist)]  # fmt: skip
        builds[name] = subprocess.Popen(
            argv,
            env=base,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    seen = {}
    for name, (gencode, _) in cases.items():
        output, _ = builds[name].communicate(timeout=400)
        assert builds[name].returncode == 0, output[-3000:]
        (wheel,) = (tmp_path / name).glob("*.whl")
        site = tmp_path / f"{name}-site"
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
        (so,) = site.glob("cudaenv_testext/_C*.so")
        read = fatbin.scan(so)
        verdict = audit_scan.verdict(read, arch, driver_cuda)
        env = {**os.environ, "PYTHONPATH": str(site), "CUDA_VISIBLE_DEVICES": gpu.uuid}
        done = subprocess.run([str(python), "-c", RUN_ADD_ONE], env=env, capture_output=True,
                              text=True, timeout=180, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        run = json.loads(done.stdout.strip().splitlines()[-1])
        seen[name] = (gencode, sorted(f"{c.kind}:{c.arch}" for c in read.codes), verdict, run)
        print(
            f"{name}: -gencode={gencode} holds {seen[name][1]}: audit "
            f"{verdict!r} for {arch} ({gpu.name}); ran={run['ran']} ({run['error']})"
        )
    if os.environ.get("OUT"):  # the GPU check's report folder: the evidence kept beside it
        rows = {n: {"gencode": g, "holds": h, "audit": v, **r} for n, (g, h, v, r) in seen.items()}
        doc = {"gpu": gpu.name, "arch": str(arch), "nvcc": str(facts.nvcc_cuda), "builds": rows}
        (Path(os.environ["OUT"]) / "source-build.json").write_text(json.dumps(doc, indent=1))
    # The audit's verdict is what the hardware did, both ways, and each build is as expected.
    assert {n: s[2] for n, s in seen.items()} == {n: c[1] for n, c in cases.items()}, seen
    assert {n: s[3]["ran"] for n, s in seen.items()} == {
        n: c[1] != "none" for n, c in cases.items()
    }, seen
