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
