"""Plain helpers shared by the test modules: import them from here, never from conftest.py
(pytest's to load, not ours) or from another test module."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from builder import archs, spec
from builder.manifest import Manifest
from builder.verify import EnvFacts

REPO = Path(__file__).resolve().parent.parent
ENVSPECS = REPO / "envspecs"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def cudaenv(
    *args: str, cwd: Path, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """The CLI in a child process, on this checkout's sources."""
    done = subprocess.run(
        [sys.executable, "-m", "builder.cli", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"cudaenv {' '.join(args)} -> {done.returncode}\n{done.stderr}")
    return done


def workspace(tmp: Path, *names: str) -> Path:
    """A copy of the named specs with their committed locks, so builds land under tmp."""
    (tmp / "envspecs" / "locks").mkdir(parents=True)
    for name in names:
        s = spec.load(ENVSPECS / name)
        shutil.copy(ENVSPECS / name, tmp / "envspecs" / name)
        lock_name = f"pylock.{s.name}.toml"
        shutil.copy(ENVSPECS / "locks" / lock_name, tmp / "envspecs" / "locks" / lock_name)
    return tmp


def env_facts(**changes: Any) -> EnvFacts:
    """The facts of a healthy default env (torch 2.14.1, CUDA 13.0, FlashInfer 0.7.2), with
    ``changes`` applied: what a check reads, without a probe."""
    base = EnvFacts(
        python="/env/bin/python",
        python_version="3.12.1",
        cuda_home="/env/cuda-home",
        env={"FLASHINFER_CUDA_ARCH_LIST": "12.0f"},
        nvcc_release="13.0",
        nvcc_path="/env/cuda-home/bin/nvcc",
        nvcc_error=None,
        cudart_version="13.0",
        cudart_error=None,
        torch_installed=True,
        torch_version="2.14.1+cu130",
        torch_cuda="13.0",
        torch_error=None,
        flashinfer_installed=True,
        flashinfer_version="0.7.2",
        flashinfer_cuda_path="/env/cuda-home",
        flashinfer_cuda_version="13.0",
        flashinfer_error=None,
        jit={"library": "/env/var/flashinfer/x/sampling.so", "reused": True, "seconds": 0.1},
        seconds=1.0,
    )
    return dataclasses.replace(base, **changes)


def a_manifest(**changes: Any) -> Manifest:
    """A built env's manifest, with ``changes`` applied."""
    base = Manifest(
        name="x",
        spec="envspecs/x.yaml",
        fingerprint="sha256:f",
        lock_hash="sha256:l",
        python="3.12.1",
        cuda="13.0",
        torch="2.14.1",
        torch_cuda="13.0",
        toolkit="13.0.3.0",
        nvcc="13.0",
        toolchain_source="wheels",
        archs=archs.DEFAULT_ARCHS,
        spec_archs=archs.DEFAULT_ARCHS,
        packages=(("torch", "2.14.1"),),
        env=(),
        built_at="2026-11-30T00:00:00+00:00",
        cudaenv="0.1.0",
        path="/env",
    )
    return dataclasses.replace(base, **changes)
