"""Real uv, real NVIDIA wheels, real nvcc and FlashInfer JIT.

`network` tests ask the package index; `e2e` tests build envs (the toolchain spec: ~100 MB,
the default spec: ~9.4 GB, the vLLM spec: ~8.8 GB, hard-linked from uv's cache).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from builder.machine.archs import Arch
from builder.spec import envspec as spec
from builder.spec import lock, resolve
from tests.conftest import Registry
from tests.helpers import ENVSPECS, REPO, cudaenv, env_facts, lock_of, workspace, write

FAKE_NVCC_128 = """#!/bin/sh
echo "nvcc: NVIDIA (R) Cuda compiler driver"
echo "Cuda compilation tools, release 12.8, V12.8.93"
echo "Build cuda_12.8.r12.8/compiler.35583870_0"
"""

KERNEL = r"""
#include <cstdio>
#include <cub/block/block_reduce.cuh>
__global__ void sum(const float* x, float* out) {
  using R = cub::BlockReduce<float, 128>;
  __shared__ typename R::TempStorage tmp;
  float s = R(tmp).Sum(x[threadIdx.x]);
  if (threadIdx.x == 0) *out = s;
}
int main() {
  float *x, *o;
  cudaError_t e = cudaMalloc(&x, 128 * sizeof(float));
  if (e == cudaSuccess) {
    cudaMalloc(&o, sizeof(float));
    sum<<<1, 128>>>(x, o);
    e = cudaDeviceSynchronize();
  }
  std::printf("%s\n", cudaGetErrorName(e));
  return 0;
}
"""


def versions(lk: lock.Lock) -> dict[str, str]:
    return {p.name: p.version for p in lk.packages}


@pytest.fixture
def fake_cuda_128(tmp_path: Path) -> Path:
    home = tmp_path / "cuda-12.8"
    nvcc = write(home / "bin" / "nvcc", FAKE_NVCC_128)
    nvcc.chmod(0o755)
    return home


# --------------------------------------------------------------------------- network


@pytest.mark.network
def test_sglang_alone_resolves_a_mixed_toolkit(tmp_path: Path) -> None:
    s = dataclasses.replace(spec.load(ENVSPECS / "default.yaml"), platforms=("linux-x86_64",))
    res = resolve.uv_compile(s, ["sglang==0.5.23"])
    versions = {p.name: p.version for p in res.packages}
    assert versions["nvidia-cuda-runtime"].startswith("13.0.")
    assert versions["nvidia-cuda-nvcc"].startswith("13.5."), versions["nvidia-cuda-nvcc"]
    assert any(
        "nvidia-cuda-nvcc 13.5" in p
        for p in resolve.policy_problems(s, res.packages, {"nvidia-cuda-nvcc": "13.0.88"})
    )


@pytest.mark.network
def test_lock_the_toolchain_spec(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    lock_of(ws / "envspecs" / "toolchain-cu130.yaml").unlink()
    cudaenv("lock", "envspecs/toolchain-cu130.yaml", cwd=ws)
    fresh = lock.read(lock_of(ws / "envspecs" / "toolchain-cu130.yaml"))
    committed = lock.read(lock_of(ENVSPECS / "toolchain-cu130.yaml"))
    assert versions(fresh) == versions(committed)
    assert fresh.content_hash() == committed.content_hash()
    assert {p.name for p in fresh.packages} == {
        "cuda-toolkit",
        "nvidia-cuda-nvcc",
        "nvidia-cuda-runtime",
        "nvidia-cuda-crt",
        "nvidia-nvvm",
        "nvidia-cuda-cccl",
    }
    plan = cudaenv("plan", "envspecs/toolchain-cu130.yaml", cwd=ws)
    assert "(up to date); nothing installed" in plan.stdout
    assert "nvidia-cuda-nvcc     13.0.88" in plan.stdout


@pytest.mark.network
def test_torch_built_for_another_cuda_is_refused_before_install(tmp_path: Path) -> None:
    write(
        tmp_path / "envspecs" / "wrong.yaml",
        'name: wrong\npython: "3.12"\ncuda: "13.2"\ntorch: "2.14.1"\npackages: []\n',
    )
    done = cudaenv("build", "envspecs/wrong.yaml", cwd=tmp_path, check=False)
    assert done.returncode == 3, done.stderr
    assert (
        "torch 2.14.1 is built for CUDA 13.0 (cuda-toolkit==13.0.3.0) but the spec asks 13.2"
        in done.stderr
    )
    assert "Traceback" not in done.stderr
    assert not (tmp_path / ".envs").exists()
    assert not lock_of(tmp_path / "envspecs" / "wrong.yaml").exists()


VLLM = "vllm-0.33-cu130.yaml"


@pytest.mark.network
def test_the_vllm_lock_is_current_for_its_spec(tmp_path: Path) -> None:
    """Re-locking the vLLM spec (uv preferring the committed versions, as `cudaenv lock` does)
    gives exactly the committed lock: same spec fingerprint, same files on both platforms."""
    ws = workspace(tmp_path, VLLM)
    committed = lock.read(lock_of(ENVSPECS / VLLM))
    assert committed.fingerprint == spec.load(ENVSPECS / VLLM).fingerprint()
    done = cudaenv("lock", f"envspecs/{VLLM}", cwd=ws)
    assert "199 packages for linux-x86_64, 199 packages for linux-aarch64" in done.stderr
    fresh = lock.read(lock_of(ws / "envspecs" / VLLM))
    assert versions(fresh) == versions(committed)
    assert fresh.content_hash() == committed.content_hash()
    assert lock_of(ws / "envspecs" / VLLM).read_text() == lock_of(ENVSPECS / VLLM).read_text()


@pytest.mark.network
@pytest.mark.parametrize(
    ("old", "new", "pin"),
    [
        ('torch: "2.14.0"', 'torch: "2.14.1"', "torch==2.14.0"),
        (
            "flashinfer-python==0.7.2.post1,",  # in packages:, not the comment
            "flashinfer-python==0.7.2,",
            "flashinfer-python==0.7.2.post1",
        ),
    ],
    ids=["torch-2.14.1", "flashinfer-0.7.2"],
)
def test_moving_a_pin_of_vllm_is_refused_naming_it(
    tmp_path: Path, old: str, new: str, pin: str
) -> None:
    """vLLM 0.33.0 pins torch==2.14.0 and flashinfer-python==0.7.2.post1: the default stack's
    torch 2.14.1 or FlashInfer 0.7.2 cannot be locked with it (exit 3, no lock). Asserted on
    what does not drift: the exit code, vllm and the pin named in uv's reason (its phrasing
    moved when vLLM 0.34.0 was published: "vllm>=0.33.0 depends on" became "vllm==0.33.0
    depends on"), never on the words around them."""
    ws = workspace(tmp_path, VLLM)
    path = ws / "envspecs" / VLLM
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))
    lock_of(path).unlink()
    done = cudaenv("lock", f"envspecs/{VLLM}", cwd=ws, check=False)
    assert done.returncode == 3, done.stderr
    reason = done.stderr.split("uv could not resolve", 1)[-1]
    assert pin in reason, done.stderr
    assert "vllm" in reason
    assert "Traceback" not in done.stderr
    assert not lock_of(path).exists()


# --------------------------------------------------------------------------- e2e: toolchain


@pytest.fixture(scope="module")
def toolchain_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    ws = workspace(tmp_path_factory.mktemp("tc"), "toolchain-cu130.yaml")
    cudaenv("build", "envspecs/toolchain-cu130.yaml", cwd=ws)
    yield ws / ".envs" / "toolchain-cu130"


@pytest.mark.network
@pytest.mark.e2e
def test_toolchain_env_compiles_for_sm120f(toolchain_env: Path, tmp_path: Path) -> None:
    home = toolchain_env / "cuda-home"
    assert (home / "lib64" / "libcudart.so").exists()
    assert (home / "lib64" / "stubs" / "libcuda.so").exists()
    src = write(tmp_path / "k.cu", KERNEL)
    out = tmp_path / "k"
    # The env's nvcc is first on PATH inside the env's interpreter, whatever the shell says.
    shell_env = {**os.environ, "CUDA_HOME": "/usr/local/cuda", "PATH": "/usr/bin:/bin"}
    which = subprocess.run(
        [toolchain_env / "bin" / "python", "-c", "import shutil; print(shutil.which('nvcc'))"],
        env=shell_env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert which.stdout.strip() == str(home / "bin" / "nvcc")
    subprocess.run(
        [home / "bin" / "nvcc", "-arch=sm_120f", "-o", out, src], check=True, env=shell_env
    )
    run = subprocess.run([out], capture_output=True, text=True, check=False)
    # No GPU here: the binary starts, links cudart statically and reports the missing driver.
    assert run.stdout.strip() in {"cudaErrorInsufficientDriver", "cudaErrorNoDevice", "cudaSuccess"}
    listed = subprocess.run(
        [home / "bin" / "nvcc", "--list-gpu-code"], capture_output=True, text=True, check=True
    )
    assert "sm_120" in listed.stdout.split()
    blob = out.read_bytes()
    assert b"sm_120" in blob  # the embedded fatbin names its target


@pytest.mark.network
@pytest.mark.e2e
def test_failed_rebuild_leaves_the_old_env_working(toolchain_env: Path) -> None:
    ws = toolchain_env.parent.parent
    lock_file = lock_of(ws / "envspecs" / "toolchain-cu130.yaml")
    good = lock_file.read_text()
    manifest = (toolchain_env / "cudaenv.json").read_text()
    lk = lock.read(lock_file)
    nvcc_hash = next(p for p in lk.packages if p.name == "nvidia-cuda-nvcc")
    lock_file.write_text(good.replace(nvcc_hash.hashes[0], "0" * 64))
    try:
        done = cudaenv("build", "envspecs/toolchain-cu130.yaml", cwd=ws, check=False)
    finally:
        lock_file.write_text(good)
    assert done.returncode == 4, done.stderr
    assert "installing the lock failed (uv's messages above)" in done.stderr
    assert "nvidia-cuda-nvcc" in done.stderr
    # uv's words once: streamed as it ran, not repeated in the error.
    assert done.stderr.count("Hash mismatch for `nvidia-cuda-nvcc") == 1, done.stderr
    assert (toolchain_env / "cudaenv.json").read_text() == manifest
    version = subprocess.run(
        [toolchain_env / "cuda-home" / "bin" / "nvcc", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "release 13.0" in version.stdout
    assert not list((ws / ".envs").glob(".toolchain-cu130.tmp-*"))


@pytest.mark.network
@pytest.mark.e2e
def test_an_env_a_package_was_removed_from_is_not_up_to_date(toolchain_env: Path) -> None:
    """ "Up to date" is said from the env itself: a package uninstalled by hand since the build
    (its .dist-info gone) makes the next build say so and build the env again, whole; the build
    after that is up to date."""
    ws = toolchain_env.parent.parent
    site = next(toolchain_env.glob("lib/python3*/site-packages"))
    (info,) = site.glob("nvidia_cuda_nvcc-*.dist-info")
    version = info.name.removesuffix(".dist-info").rpartition("-")[2]
    shutil.rmtree(info)
    done = cudaenv("build", "envspecs/toolchain-cu130.yaml", cwd=ws)
    said = (
        f"is not as it was built (nvidia-cuda-nvcc {version} is not installed): building it again"
    )
    assert said in done.stderr, done.stderr
    assert "is up to date" not in done.stderr
    assert list(site.glob("nvidia_cuda_nvcc-*.dist-info"))
    again = cudaenv("build", "envspecs/toolchain-cu130.yaml", cwd=ws)
    assert "is up to date" in again.stderr, again.stderr


def _kill_during_install(ws: Path, sig: int, cache: Path) -> tuple[int, bool]:
    """Start a cold-cache build, send ``sig`` once the install is under way."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "builder.cli", "build", "envspecs/toolchain-cu130.yaml"],
        cwd=ws,
        env={**os.environ, "PYTHONPATH": str(REPO), "UV_CACHE_DIR": str(cache)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if list((ws / ".envs").glob(".toolchain-cu130.tmp-*/var/requirements.lock.txt")):
            break
        time.sleep(0.02)
    still_running = proc.poll() is None  # uv is downloading ~100 MB into a cold cache now
    proc.send_signal(sig)
    return proc.wait(timeout=120), still_running


@pytest.mark.network
@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_killed_build_leaves_no_half_env(tmp_path: Path, sig: int) -> None:
    ws = workspace(tmp_path / "ws", "toolchain-cu130.yaml")
    rc, was_running = _kill_during_install(ws, sig, tmp_path / "cold-cache")
    assert was_running, "the build finished before it could be interrupted"
    target = ws / ".envs" / "toolchain-cu130"
    leftovers = list((ws / ".envs").glob(".toolchain-cu130.tmp-*"))
    if target.exists():
        # A fast index can finish the install before the signal lands; then the signal may
        # arrive after the swap, and what is at the target must be the whole env, never half.
        assert (target / "cudaenv.json").is_file() and (target / "cuda-home/bin/nvcc").exists()
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL
    else:
        assert rc in (130, 0)
        assert leftovers == []  # cleaned up on the way out
    done = cudaenv("build", "envspecs/toolchain-cu130.yaml", cwd=ws)
    assert (target / "cuda-home" / "bin" / "nvcc").exists()
    assert not list((ws / ".envs").glob(".toolchain-cu130.tmp-*"))
    if leftovers:
        assert "removed leftover" in done.stderr


# --------------------------------------------------------------------------- e2e: vLLM


@pytest.mark.network
@pytest.mark.e2e
def test_vllm_env_builds_verifies_and_imports_vllm(tmp_path: Path) -> None:
    """The vLLM spec from its committed lock (~8.8 GB hard-linked from uv's cache): built,
    verified with its own nvcc, and `import vllm` works without a GPU on torch's CUDA 13.0.
    All of FlashInfer is imported (verify imports only flashinfer.jit): a cuda-python 12 wheel
    overwriting cuda-bindings 13 breaks it there (see the spec)."""
    ws = workspace(tmp_path, VLLM)
    env = ws / ".envs" / "vllm-0.33-cu130"
    done = cudaenv("build", "--verify", f"envspecs/{VLLM}", cwd=ws)
    doc = json.loads((env / "var" / "cudaenv" / "verify.json").read_text())
    status = {c["name"]: c["status"] for c in doc["checks"]}
    # sampling runs on a GPU (`passed`) and is `skipped` without a driver; build exits 5 on a fail.
    assert status == {
        "imports": "passed",
        "toolchain": "passed",
        "kernel-compile": "passed",
        "flashinfer-jit": "passed",
        "cubin": "passed",
        "binaries": "passed",
        "sampling": status["sampling"],
    }, done.stdout + done.stderr
    assert status["sampling"] in ("passed", "skipped")
    cubin = next(c for c in doc["checks"] if c["name"] == "cubin")
    assert cubin["evidence"]["flashinfer sampling"].endswith(": sm_120"), cubin
    code = (
        "import flashinfer, torch, vllm; "
        "print(vllm.__version__, torch.__version__, torch.version.cuda, flashinfer.__version__)"
    )
    probe = subprocess.run(
        [env / "bin" / "python", "-c", code], capture_output=True, text=True, check=False
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["0.33.0", "2.14.0+cu130", "13.0", "0.7.2.post1"], probe.stdout


# --------------------------------------------------------------------------- e2e: default


@pytest.fixture(scope="module")
def default_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    ws = workspace(tmp_path_factory.mktemp("default"), "default.yaml")
    cudaenv("build", "envspecs/default.yaml", cwd=ws)
    yield ws / ".envs" / "sglang-0.5.23-cu130"


@pytest.mark.network
@pytest.mark.e2e
def test_default_env_uses_its_own_nvcc_over_the_shells(
    default_env: Path, fake_cuda_128: Path
) -> None:
    code = (
        "from flashinfer.jit.cpp_ext import get_cuda_version, get_cuda_path; import torch; "
        "print(get_cuda_version(), torch.version.cuda); print(get_cuda_path())"
    )
    done = subprocess.run(
        [default_env / "bin" / "python", "-c", code],
        env={**os.environ, "CUDA_HOME": str(fake_cuda_128)},
        capture_output=True,
        text=True,
        check=True,
    )
    first, second = done.stdout.strip().splitlines()[-2:]
    assert first == "13.0 13.0"
    assert second == str(default_env / "cuda-home")
    # Triton, torch extensions and the rest compile into the env, with the env's ptxas.
    cache_code = (
        "import os; print(os.environ['TRITON_CACHE_DIR'], os.environ['TORCH_EXTENSIONS_DIR'], "
        "os.environ['TRITON_PTXAS_PATH'])"
    )
    cached = subprocess.run(
        [default_env / "bin" / "python", "-c", cache_code],
        env={**os.environ, "TRITON_CACHE_DIR": "/srv/shared/triton"},
        capture_output=True,
        text=True,
        check=True,
    )
    triton, extensions, ptxas = cached.stdout.split()
    assert triton == str(default_env / "var" / "triton")
    assert extensions == str(default_env / "var" / "torch_extensions")
    assert ptxas == str(default_env / "cuda-home" / "bin" / "ptxas")
    assert Path(ptxas).samefile(
        next(default_env.glob("lib/python3.*/site-packages/nvidia/cu13/bin/ptxas"))
    )
    # Without the hook the same interpreter is fooled: the test would catch a broken hook.
    done = subprocess.run(
        [default_env / "bin" / "python", "-c", code],
        env={**os.environ, "CUDA_HOME": str(fake_cuda_128), "CUDAENV_NO_HOOK": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip().splitlines()[-2] == "12.8 13.0"


@pytest.mark.network
@pytest.mark.e2e
def test_default_env_jit_builds_flashinfer_sampling_for_sm120f(
    default_env: Path, fake_cuda_128: Path
) -> None:
    code = (
        "import os; from flashinfer.jit.sampling import gen_sampling_module; "
        "s = gen_sampling_module(); s.build(verbose=False); "
        "print(os.environ['FLASHINFER_CUDA_ARCH_LIST']); print(s.get_library_path())"
    )
    done = subprocess.run(
        [default_env / "bin" / "python", "-c", code],
        env={**os.environ, "CUDA_HOME": str(fake_cuda_128)},
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "cannot find -lcudart" not in done.stderr
    assert "cannot find -lcuda" not in done.stderr
    archs, library = done.stdout.strip().splitlines()[-2:]
    assert archs == "12.0f"
    lib = Path(library)
    assert lib.is_file()
    assert lib.is_relative_to(default_env / "var" / "flashinfer")
    assert "/120f/" in library


def cubins(env: Path, artifact: Path) -> list[str]:
    """The sm_XX cubins in ``artifact``, listed as the cubin check lists them."""
    from builder.verify import cubin

    tool, where = cubin.find_cuobjdump(env_facts(cuda_home=str(env / "cuda-home")))
    assert tool is not None, where
    return cubin.list_elf(tool, artifact)


@pytest.mark.network
@pytest.mark.e2e
def test_torchs_own_extension_builder_uses_the_envs_nvcc(
    default_env: Path, fake_cuda_128: Path
) -> None:
    """torch.utils.cpp_extension.load_inline, as a user calls it, with the shell's CUDA_HOME at
    a 12.8 toolkit: it finds the env's toolkit, builds into the env's cache for the env's
    arch, and the module imports (no GPU needed to build or import)."""
    code = (
        "from torch.utils.cpp_extension import load_inline, CUDA_HOME\n"
        "cuda = r'''\n"
        "__global__ void twice(float* x, int n) {\n"
        "    int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= 2.0f; }\n"
        "void run(torch::Tensor x) {\n"
        "    twice<<<(x.numel() + 255) / 256, 256>>>(x.data_ptr<float>(), (int)x.numel()); }\n"
        "'''\n"
        "m = load_inline(name='cudaenv_twice', cpp_sources='void run(torch::Tensor x);',\n"
        "                cuda_sources=cuda, functions=['run'])\n"
        "print(CUDA_HOME); print(m.__file__)\n"
    )
    done = subprocess.run(
        [default_env / "bin" / "python", "-c", code],
        env={**os.environ, "CUDA_HOME": str(fake_cuda_128)},
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    home, module = done.stdout.strip().splitlines()[-2:]
    assert home == str(default_env / "cuda-home")
    assert Path(module).is_relative_to(default_env / "var" / "torch_extensions")
    assert cubins(default_env, Path(module)) == ["sm_120"]


@pytest.mark.network
@pytest.mark.e2e
def test_tvm_ffis_extension_builder_uses_the_envs_nvcc_and_archs(default_env: Path) -> None:
    """tvm_ffi.cpp.build_inline (what sglang's JIT kernels build on) on a machine without a
    GPU: it reads TVM_FFI_CUDA_ARCH_LIST, else asks nvidia-smi and fails. The env's hook gives
    it the env's arch list and cache, so it builds with the env's nvcc for 12.0f."""
    code = (
        "import tvm_ffi.cpp\n"
        "cuda = r'''\n"
        "#include <tvm/ffi/container/tensor.h>\n"
        "#include <tvm/ffi/function.h>\n"
        "__global__ void twice(float* x, int n) {\n"
        "    int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= 2.0f; }\n"
        "void run(tvm::ffi::TensorView x) {\n"
        "    twice<<<1, 256>>>(static_cast<float*>(x.data_ptr()), (int)x.size(0)); }\n"
        "'''\n"
        "print(tvm_ffi.cpp.build_inline(name='cudaenv_twice', cuda_sources=cuda, "
        "functions=['run']))\n"
    )
    done = subprocess.run(
        [default_env / "bin" / "python", "-c", code],
        env={k: v for k, v in os.environ.items() if k != "TVM_FFI_CUDA_ARCH_LIST"},
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    module = Path(done.stdout.strip().splitlines()[-1])
    assert module.is_relative_to(default_env / "var" / "tvm-ffi")
    assert cubins(default_env, module) == ["sm_120"]


# --------------------------------------------------------------------------- e2e: verify


@pytest.mark.network
@pytest.mark.e2e
def test_verify_toolchain_env(toolchain_env: Path) -> None:
    ws = toolchain_env.parent.parent
    done = cudaenv("verify", "envspecs/toolchain-cu130.yaml", "--report", "r.json", cwd=ws)
    doc = json.loads((ws / "r.json").read_text())
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status == {"kernel-compile": "passed", "cubin": "passed", "sampling": "skipped"}
    cubin = next(c for c in doc["checks"] if c["name"] == "cubin")
    assert any(v.endswith(": sm_120") for v in cubin["evidence"].values()), cubin
    sampling = next(c for c in doc["checks"] if c["name"] == "sampling")
    assert sampling["summary"].startswith("no NVIDIA driver"), sampling
    assert "SKIPPED" in done.stdout


@pytest.mark.network
@pytest.mark.e2e
def test_build_json_is_one_object_with_its_verify_report(toolchain_env: Path) -> None:
    ws = toolchain_env.parent.parent
    done = cudaenv("build", "envspecs/toolchain-cu130.yaml", "--verify", "--json", cwd=ws)
    doc = json.loads(done.stdout)
    assert (doc["env"], doc["reused"], doc["assembled"]) == (str(toolchain_env), True, False)
    assert doc["verify"]["kind"] == "verify"
    assert {c["name"] for c in doc["verify"]["checks"]} == {"kernel-compile", "cubin", "sampling"}


@pytest.mark.network
@pytest.mark.e2e
def test_build_verify_asks_for_the_driver_and_the_project_once(
    toolchain_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One `build --verify` (the driver gate, the visible GPUs, the sampling check's skip; the
    project root, the lock mode, the JIT remote) looks for this machine's driver once and
    reads the project's pyproject.toml once: core/context.py."""
    from builder.cli import main as cli
    from builder.machine import driver

    ws = toolchain_env.parent.parent
    counts = {"detect": 0, "pyproject.toml": 0}
    real_detect, real_read = driver.detect, Path.read_text

    def detect(**kw: Any) -> driver.Driver | None:
        counts["detect"] += 1
        return real_detect(**kw)

    def read_text(self: Path, *args: Any, **kw: Any) -> str:
        if self.name == "pyproject.toml":
            counts["pyproject.toml"] += 1
        return real_read(self, *args, **kw)

    monkeypatch.setattr(driver, "detect", detect)
    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.chdir(ws)
    # --debug: the settings' sources are shown too, one more asker of the project's settings.
    argv = ["--quiet", "--debug", "build", "--verify", "envspecs/toolchain-cu130.yaml"]
    assert cli.main(argv) == 0
    assert counts == {"detect": 1, "pyproject.toml": 1}
    # Each command asks afresh: a second one in the same process is not answered from the first.
    assert cli.main(["--quiet", "verify", "envspecs/toolchain-cu130.yaml"]) == 0
    assert counts == {"detect": 2, "pyproject.toml": 2}


@pytest.mark.network
@pytest.mark.e2e
def test_two_envs_of_one_lock_have_one_fingerprint(toolchain_env: Path, tmp_path: Path) -> None:
    ws = toolchain_env.parent.parent
    other = tmp_path / "same-lock"
    cudaenv("build", "envspecs/toolchain-cu130.yaml", "--env-dir", str(other), cwd=ws)
    prints = [
        cudaenv("fingerprint", "--python", str(env / "bin" / "python"), cwd=ws).stdout.strip()
        for env in (toolchain_env, other)
    ]
    assert prints[0] == prints[1] and prints[0].startswith("sha256:")


@pytest.mark.network
@pytest.mark.e2e
def test_kernel_compile_fails_for_an_arch_the_toolkit_cannot_build(toolchain_env: Path) -> None:
    ws = toolchain_env.parent.parent
    done = cudaenv(
        "verify",
        "envspecs/toolchain-cu130.yaml",
        "--checks",
        "kernel-compile",
        "--archs",
        "12.0f 7.0",
        cwd=ws,
        check=False,
    )
    assert done.returncode == 5, done.stderr
    assert "kernel-compile  FAILED" in done.stdout
    assert "nvcc 13.0 cannot build 7.0:" in done.stdout
    assert "compute_70" in done.stdout
    assert done.stderr.strip().splitlines()[-1] == "error: 1 check(s) failed: kernel-compile"


@pytest.mark.network
@pytest.mark.e2e
def test_checks_run_with_the_envs_own_environment(toolchain_env: Path) -> None:
    """A spec's env variables reach nvcc: NVCC_APPEND_FLAGS=--bogus must fail the compile
    (env changes do not change the lock, so the committed lock still applies)."""
    ws = toolchain_env.parent.parent
    body = (ws / "envspecs" / "toolchain-cu130.yaml").read_text()
    write(ws / "envspecs" / "bogus.yaml", body + 'env: {NVCC_APPEND_FLAGS: "--bogus"}\n')
    done = cudaenv(
        "build", "--verify", "envspecs/bogus.yaml", "--env-dir", ".envs/bogus", cwd=ws, check=False
    )
    assert done.returncode == 5, done.stdout + done.stderr
    assert "kernel-compile  FAILED" in done.stdout
    assert "--bogus" in done.stdout


@pytest.mark.network
@pytest.mark.e2e
def test_no_host_compiler_exits_6_even_with_a_cached_kernel(toolchain_env: Path) -> None:
    ws = toolchain_env.parent.parent
    args = ("verify", "envspecs/toolchain-cu130.yaml", "--checks", "kernel-compile")
    cudaenv(*args, cwd=ws)  # a build is in the env's cache now
    bare = ws / "bare-bin"  # a PATH with no gcc or cc at all
    bare.mkdir(exist_ok=True)
    done = cudaenv(*args, cwd=ws, check=False, env={"PATH": str(bare)})
    assert done.returncode == 6, done.stdout + done.stderr
    assert "kernel-compile  FAILED" in done.stdout
    assert "fix (kernel-compile): install a C++ compiler" in done.stdout
    assert "drop the arch" not in done.stdout


@pytest.mark.network
@pytest.mark.e2e
def test_a_toolkit_without_cccl_is_named_and_another_specs_env_is_refused(
    toolchain_env: Path, tmp_path: Path
) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    body = (ws / "envspecs" / "toolchain-cu130.yaml").read_text()
    assert "cccl" in body
    # Same env name, another folder, another toolkit: the components without CCCL.
    other = write(
        ws / "other" / "toolchain-cu130.yaml",
        body.replace(", cccl]", "]").replace(",cccl]", "]"),
    )
    assert "cccl" not in other.read_text()
    done = cudaenv("build", "--verify", "other/toolchain-cu130.yaml", cwd=ws, check=False)
    assert done.returncode == 5, done.stdout + done.stderr
    assert "kernel-compile  FAILED" in done.stdout and "cannot find " in done.stdout
    assert "fix (kernel-compile): add 'cccl' to the spec's toolchain.components" in done.stdout
    # .envs/toolchain-cu130 now holds the other spec's env: verifying this spec refuses it.
    refused = cudaenv("verify", "envspecs/toolchain-cu130.yaml", cwd=ws, check=False)
    assert refused.returncode == 5
    assert "was built from another spec than envspecs/toolchain-cu130.yaml" in refused.stderr
    assert "rebuild it: `cudaenv build envspecs/toolchain-cu130.yaml`" in refused.stderr


@pytest.mark.network
@pytest.mark.e2e
def test_cubin_check_fails_on_a_cubin_for_the_wrong_arch(
    toolchain_env: Path, tmp_path: Path
) -> None:
    from builder.core.statuses import FAILED
    from builder.verify import cubin, kernel_compile
    from builder.verify.model import Target

    home = toolchain_env / "cuda-home"
    built = kernel_compile.build_kernel(home / "bin" / "nvcc", Arch.parse("9.0a"), tmp_path)
    assert built.error is None
    facts = env_facts(cuda_home=str(home), torch_installed=False, jit={"library": str(built.path)})
    # A real sm_90a binary standing in for a FlashInfer library asked to hold 12.0f.
    target = Target(python=Path(sys.executable), archs=(Arch.parse("12.0f"),), work=tmp_path)
    result = cubin.check(target, facts)
    assert result.status == FAILED
    assert result.summary == "flashinfer sampling has no sm_120 cubin for 12.0f (it holds sm_90a)"
    assert result.evidence[1][1].endswith(": sm_120")  # our own kernel, built for 12.0f


@pytest.mark.network
@pytest.mark.e2e
def test_verify_default_env(default_env: Path) -> None:
    ws = default_env.parent.parent
    done = cudaenv("verify", "envspecs/default.yaml", cwd=ws)
    doc = json.loads((default_env / "var" / "cudaenv" / "verify.json").read_text())
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status == {
        "imports": "passed",
        "toolchain": "passed",
        "kernel-compile": "passed",
        "flashinfer-jit": "passed",
        "cubin": "passed",
        "binaries": "passed",
        "sampling": "skipped",
    }, done.stdout
    imports = next(c for c in doc["checks"] if c["name"] == "imports")
    assert "sglang.srt.entrypoints.engine" in json.dumps(imports["evidence"]), imports
    cubin = next(c for c in doc["checks"] if c["name"] == "cubin")
    assert cubin["evidence"]["flashinfer sampling"].endswith(": sm_120"), cubin
    toolchain = next(c for c in doc["checks"] if c["name"] == "toolchain")
    assert toolchain["evidence"]["flashinfer import"] == "flashinfer.jit only"
    assert cubin["evidence"]["topk_topp 12.0f"].endswith(": sm_120"), cubin


@pytest.mark.network
@pytest.mark.e2e
def test_what_verify_put_in_the_store_is_warm_for_every_reader(
    default_env: Path, registry: Registry, tmp_path: Path
) -> None:
    """One meaning of "warm": verify (above) left the sampling module and cudaenv's top-k
    kernel in the store, unmarked. `warm` finds them there ("already warm", nothing built),
    marks them, and pushes them: `store list SPEC` lists sampling, and a second node with an
    empty store of its own builds the env with both placed from the registry, nothing
    compiled by its verify."""
    from builder.core import paths

    ws = default_env.parent.parent
    # A copy of the session's store (its files linked; conftest's session_jit_store): what this
    # test marks, the later tests, which expect an unmarked store (nothing prefetched), never see.
    shared = paths.jit_store_dir()
    assert shared is not None and shared.is_dir(), shared
    mine = tmp_path / "store-a"
    shutil.copytree(shared, mine, copy_function=os.link, symlinks=True)
    here = {"CUDAENV_JIT_STORE": str(mine)}
    remote = {**here, "CUDAENV_JIT_REMOTE": registry.url, "CUDAENV_JIT_PUSH": "1"}
    warm = cudaenv("warm", "envspecs/default.yaml", "--modules", "sampling", "topk_topp",
                   "--json", cwd=ws, env=remote)  # fmt: skip
    doc = json.loads(warm.stdout)
    assert (doc["built"], doc["warm"], doc["failed"], doc["pushed"]) == (0, 2, 0, 2), doc
    listed = json.loads(
        cudaenv("store", "list", "envspecs/default.yaml", "--json", cwd=ws, env=here).stdout
    )
    names = {e["module"]["name"] for e in listed["entries"] if e.get("module")}
    assert "sampling" in names, listed
    other = {**remote, "CUDAENV_JIT_STORE": str(tmp_path / "store-b"), "CUDAENV_JIT_PUSH": "0"}
    b = cudaenv("build", "--verify", "envspecs/default.yaml", "--env-dir", str(tmp_path / "b"),
                cwd=ws, env=other)  # fmt: skip
    assert "prefetched 1 of 1 warmed FlashInfer module(s)" in b.stderr, b.stderr
    sampling = list((tmp_path / "b" / "var" / "flashinfer").rglob("cached_ops/sampling/*.so"))
    assert len(sampling) == 1, b.stderr
    checks = json.loads((tmp_path / "b" / "var" / "cudaenv" / "verify.json").read_text())
    for check in checks["checks"]:
        if check["name"] in ("kernel-compile", "flashinfer-jit"):
            assert "compiled in" not in check["summary"], check


@pytest.mark.network
@pytest.mark.e2e
def test_audit_names_sglangs_common_ops_on_a_dgx_spark(default_env: Path) -> None:
    ws = default_env.parent.parent
    # CC 12.1 (DGX Spark): sgl_kernel's loader takes sm100/common_ops, which holds sm_120a
    # only: an arch-specific cubin for 12.0 (sgl-project/sglang#29317).
    spark = cudaenv("audit", "envspecs/default.yaml", "--archs", "12.1f", "--json", cwd=ws,
                    check=False)  # fmt: skip
    assert spark.returncode == 5, spark.stderr
    doc = json.loads(spark.stdout)
    assert doc["status"] == "failed"
    assert any(
        "sgl_kernel/sm100/common_ops" in f and "sm_120a" in f and "12.1f" in f
        for f in doc["failures"]
    ), doc["failures"]
    # The cu12 CuTe DSL libraries of a CUDA 13 env, named with what requires them.
    assert any(
        "nvidia-cutlass-dsl-libs-cu12" in w and "required by nvidia-cutlass-dsl" in w
        for w in doc["warnings"]
    ), doc["warnings"]
    # The env's own archs pass, and a second audit reads no binary again.
    started = time.monotonic()
    blackwell = cudaenv("audit", "envspecs/default.yaml", "--archs", "12.0f", "--no-probe",
                        cwd=ws, check=False)  # fmt: skip
    assert blackwell.returncode == 0, blackwell.stdout + blackwell.stderr
    assert time.monotonic() - started < 10
    assert "PASSED for 12.0f" in blackwell.stdout


@pytest.mark.network
@pytest.mark.e2e
def test_a_second_env_of_the_toolchain_reuses_the_stores_compiles(
    default_env: Path, tmp_path: Path
) -> None:
    """The main job's env has compiled (or offers what it compiled to the store); a second
    env of the same lock at another path, built and verified, reuses FlashInfer's sampling
    module and our kernel from the machine-wide store: ninja has nothing to do."""
    ws = default_env.parent.parent
    checks = "kernel-compile,flashinfer-jit,cubin"
    cudaenv("verify", "envspecs/default.yaml", "--checks", checks, cwd=ws)
    other = tmp_path / "second-env"
    report = tmp_path / "second.json"
    cudaenv("build", "envspecs/default.yaml", "--env-dir", str(other), cwd=ws)
    cudaenv("verify", "envspecs/default.yaml", "--env-dir", str(other), "--checks", checks,
            "--report", str(report), cwd=ws)  # fmt: skip
    got = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    assert {n: c["status"] for n, c in got.items()} == dict.fromkeys(checks.split(","), "passed")
    jit = got["flashinfer-jit"]
    assert "reused from the store (first built " in jit["summary"], jit
    assert jit["evidence"]["library"].startswith(str(other))
    assert "reused from the store: 12.0f: first built " in got["kernel-compile"]["summary"]
    # The placed module is what ninja (the one on PATH, which FlashInfer runs) now considers
    # built: a rebuild has no work to do.
    build_dir = Path(jit["evidence"]["library"]).parent
    ninja = shutil.which("ninja")
    assert ninja is not None
    done = subprocess.run(
        [ninja, "-C", str(build_dir), "-n"], capture_output=True, text=True, check=True
    )
    assert "no work to do" in done.stdout


@pytest.mark.network
@pytest.mark.e2e
def test_a_second_node_reuses_the_compiles_a_first_node_pushed_to_a_registry(
    default_env: Path, tmp_path: Path, registry: Registry
) -> None:
    """Node A (this machine's store) verifies the default env and pushes what it used to a
    real registry; node B (an empty store, the same registry) builds the spec and verifies
    it, reusing FlashInfer's module and our kernel from the registry. A kernel blob changed
    in the registry's storage is refused and rebuilt; a registry that is down costs a local
    compile and one warning, never the verify."""
    ws = default_env.parent.parent
    checks = "kernel-compile,flashinfer-jit,cubin"
    remote = {"CUDAENV_JIT_REMOTE": registry.url}

    def verify(env_dir: Path, store: str, which: str, extra: dict[str, str]) -> dict[str, Any]:
        report = tmp_path / f"{env_dir.name}-{store}.json"
        if not (env_dir / "cudaenv.json").exists():
            cudaenv("build", "envspecs/default.yaml", "--env-dir", str(env_dir), cwd=ws)
        env = {"CUDAENV_JIT_STORE": str(tmp_path / store), **remote, **extra}
        if store == "node-a":
            env.pop("CUDAENV_JIT_STORE")  # the session's store, warm from the tests before
        cudaenv("verify", "envspecs/default.yaml", "--env-dir", str(env_dir), "--checks",
                which, "--report", str(report), cwd=ws, env=env)  # fmt: skip
        got = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
        assert {n: c["status"] for n, c in got.items()} == dict.fromkeys(which.split(","), "passed")
        return got

    a = verify(default_env, "node-a", checks, {"CUDAENV_JIT_PUSH": "1"})
    assert not a["flashinfer-jit"]["warnings"] and not a["kernel-compile"]["warnings"], a
    # What the probe kept, pushed by cudaenv once the probe answered.
    assert f"; pushed to {registry.url} (CUDAENV_JIT_PUSH=1)" in a["flashinfer-jit"]["summary"]
    b = verify(tmp_path / "env-b", "node-b", checks, {})
    assert "reused from the store (first built " in b["flashinfer-jit"]["summary"]
    assert f"for {registry.url})" in b["flashinfer-jit"]["summary"], b["flashinfer-jit"]
    assert f"for {registry.url})" in b["kernel-compile"]["summary"], b["kernel-compile"]
    assert not b["flashinfer-jit"]["warnings"] and not b["kernel-compile"]["warnings"]
    # A blob of the registry's storage changed: our kernel's (a cubin, starting with ELF).
    kernel = next((tmp_path / "env-b" / "var" / "cudaenv" / "kernels").rglob("topk_topp.sm_*"))
    blobs = (registry.root / "docker" / "registry" / "v2" / "blobs").rglob("data")
    (changed,) = [b for b in blobs if b.read_bytes() == kernel.read_bytes()]
    changed.write_bytes(b"\x7fELF" + b"\0" * (changed.stat().st_size - 4))
    c = verify(tmp_path / "env-c", "node-c", "kernel-compile,flashinfer-jit", {})
    assert f"for {registry.url})" in c["flashinfer-jit"]["summary"]  # still sound: reused
    assert "reused" not in c["kernel-compile"]["summary"], c["kernel-compile"]
    (warning,) = c["kernel-compile"]["warnings"]
    assert registry.url in warning and "compiled locally" in warning
    registry.stop()
    d = verify(tmp_path / "env-d", "node-d", "kernel-compile", {"CUDAENV_JIT_PUSH": "1"})
    assert [registry.url in w for w in d["kernel-compile"]["warnings"]] in ([True], [True, True])


@pytest.mark.network
@pytest.mark.e2e
def test_verify_archs_builds_the_extra_arch_into_the_envs_cache(default_env: Path) -> None:
    """An env built for 12.0f, verified for 9.0a (an H200): FlashInfer's sampling module is
    JIT-built for 9.0a in the env's own cache (the hook honours the explicit list) and the
    cubin check finds sm_90a in both our kernel and FlashInfer's library."""
    ws = default_env.parent.parent
    done = cudaenv(
        "verify",
        "envspecs/default.yaml",
        "--archs",
        "9.0a",
        "--checks",
        "kernel-compile,flashinfer-jit,cubin",
        "--report",
        "r90.json",
        cwd=ws,
    )
    doc = json.loads((ws / "r90.json").read_text())
    assert doc["archs"] == ["9.0a"]
    checks = {c["name"]: c for c in doc["checks"]}
    assert {n: c["status"] for n, c in checks.items()} == {
        "kernel-compile": "passed",
        "flashinfer-jit": "passed",
        "cubin": "passed",
    }, done.stdout
    # Built here, or placed from the machine-wide store where an env of this toolchain built
    # 9.0a before (an earlier run): either way into this env's own cache, checked below.
    assert checks["flashinfer-jit"]["summary"].startswith(
        ("sampling module for 9.0a: built in", "sampling module for 9.0a: reused from the store")
    )
    assert "/90a/" in checks["flashinfer-jit"]["evidence"]["library"]
    assert str(default_env) in checks["flashinfer-jit"]["evidence"]["library"]
    assert checks["cubin"]["evidence"]["flashinfer sampling"].endswith(": sm_90a")
    assert checks["cubin"]["evidence"]["topk_topp 9.0a"].endswith(": sm_90a")


@pytest.mark.network
@pytest.mark.e2e
def test_toolchain_check_fails_when_the_jit_sees_nvcc_12_8(
    default_env: Path, fake_cuda_128: Path
) -> None:
    ws = default_env.parent.parent
    done = cudaenv(
        "verify",
        "--python",
        str(default_env / "bin" / "python"),
        "--checks",
        "toolchain",
        cwd=ws,
        check=False,
        env={"CUDA_HOME": str(fake_cuda_128), "CUDAENV_NO_HOOK": "1"},
    )
    assert done.returncode == 5, done.stderr
    assert (
        f"nvcc in CUDA_HOME ({fake_cuda_128}/bin/nvcc) is 12.8 but torch.version.cuda is 13.0"
        in done.stdout
    )


# --------------------------------------------------------------------------- e2e: doctor


@pytest.mark.network
@pytest.mark.e2e
def test_doctor_default_env_is_healthy(default_env: Path) -> None:
    from builder.doctor import diagnose as doctor

    facts, findings, _ = doctor.probe(str(default_env / "bin" / "python"), deep=True)
    assert facts is not None
    assert [f.code for f in findings if f.severity == doctor.ERROR] == []
    # Every JIT cache in the env, Triton on the env's ptxas: nothing to flag.
    assert "cache-outside-env" not in [f.code for f in findings]
    assert facts.env["TRITON_PTXAS_PATH"] == str(default_env / "cuda-home" / "bin" / "ptxas")
    assert facts.deep is not None
    assert facts.deep["flashinfer"]["cuda_version"] == "13.0"
    assert facts.deep["flashinfer"]["cuda_path"] == str(default_env / "cuda-home")


@pytest.mark.network
@pytest.mark.e2e
def test_doctor_blackwell_case_in_a_real_env(default_env: Path, fake_cuda_128: Path) -> None:
    # The env's start-up hook would fix CUDA_HOME; without it this is any venv holding
    # torch 2.14.1 (CUDA 13.0) whose shell points CUDA_HOME at a 12.8 toolkit.
    done = cudaenv(
        "doctor",
        "--python",
        str(default_env / "bin" / "python"),
        cwd=default_env,
        check=False,
        env={
            "CUDAENV_NO_HOOK": "1",
            "CUDA_HOME": str(fake_cuda_128),
            "FLASHINFER_CUDA_ARCH_LIST": "12.0",
        },
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines()[0] == (
        f"FlashInfer's JIT uses nvcc 12.8 (from CUDA_HOME={fake_cuda_128}) but torch is built for "
        "CUDA 13.0; SM 12.x needs 12.9+"
    )
    assert "    fix: this env was built by cudaenv" in done.stdout


# --------------------------------------------------------------------------- other platforms


@pytest.mark.network
def test_the_toolchain_env_is_assembled_for_aarch64_on_another_machine(tmp_path: Path) -> None:
    """`build --platform linux-aarch64`: the aarch64 wheels unpacked hash-checked, cuda-home/
    made of aarch64 binaries, a manifest marked assembled; verify refuses to run it here; a
    lock whose aarch64 hash is wrong fails and leaves the assembled env as it was."""
    from builder.core import platforms
    from builder.env import manifest, toolchain

    if platforms.host_name() == "linux-aarch64":
        pytest.skip("this machine is aarch64: --platform linux-aarch64 is a plain build")
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    dest = tmp_path / "arm-env"
    argv = ("build", "envspecs/toolchain-cu130.yaml", "--platform", "linux-aarch64",
            "--env-dir", str(dest))  # fmt: skip
    cudaenv(*argv, cwd=ws)
    home = dest / "cuda-home"
    for rel in ("bin/nvcc", "bin/ptxas", "nvvm/bin/cicc", "lib64/stubs/libcuda.so"):
        assert toolchain.elf_machine(home / rel) == 183, rel
    assert (home / "lib64" / "libcudart.so").resolve().is_relative_to(dest.resolve())
    built = manifest.read(dest)
    assert (built.platform, built.assembled, built.nvcc) == ("linux-aarch64", True, "13.0")
    committed = lock.read(lock_of(ENVSPECS / "toolchain-cu130.yaml"))
    assert dict(built.packages) == {
        p.name: p.version for p in committed.packages_on("linux-aarch64")
    }
    again = cudaenv(*argv, cwd=ws)
    assert "is up to date" in again.stderr
    refused = cudaenv(
        "verify", "envspecs/toolchain-cu130.yaml", "--env-dir", str(dest), cwd=ws, check=False
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: {dest} was assembled for linux-aarch64 and cannot run on this "
        f"{platforms.host_name()} machine: copy it to a linux-aarch64 machine, make it a venv "
        f"there (`python3.12 -m venv {dest}`) and verify it there"
    ]
    # A wrong aarch64 hash in the lock: uv refuses the file, the assembled env stays.
    lock_file = lock_of(ws / "envspecs" / "toolchain-cu130.yaml")
    text = lock_file.read_text()
    line = next(ln for ln in text.splitlines() if "nvidia_cuda_nvcc-" in ln and "aarch64" in ln)
    bad = line.split('sha256 = "')[0] + 'sha256 = "' + "0" * 64 + '" } },'
    lock_file.write_text(text.replace(line, bad))
    before = sorted(p.relative_to(dest) for p in dest.rglob("*"))
    failed = cudaenv(*argv, "--force", cwd=ws, check=False)
    assert failed.returncode == 4, failed.stderr
    assert "unpacking the lock for linux-aarch64 failed" in failed.stderr
    assert "hash" in failed.stderr.lower()
    assert sorted(p.relative_to(dest) for p in dest.rglob("*")) == before


def _no_aarch64_emulation() -> str | None:
    """Why this machine cannot run aarch64 binaries, or None where it can (qemu-user with
    binfmt, and a cross g++ as nvcc's host compiler)."""
    handler = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not handler.exists() or "enabled" not in handler.read_text():
        return "no qemu-aarch64 binfmt handler (Debian: qemu-user-static binfmt-support)"
    if not shutil.which("aarch64-linux-gnu-g++"):
        return "no aarch64-linux-gnu-g++ (Debian: g++-aarch64-linux-gnu)"
    if not Path("/usr/aarch64-linux-gnu/lib").is_dir():
        return "no aarch64 C library at /usr/aarch64-linux-gnu (Debian: libc6-arm64-cross)"
    return None


@pytest.mark.network
@pytest.mark.e2e
def test_the_assembled_aarch64_nvcc_compiles_our_kernel_for_dgx_spark(tmp_path: Path) -> None:
    """Stretch: where this machine runs aarch64 binaries under qemu-user, the assembled
    aarch64 nvcc compiles and links our top-k/top-p kernel for 12.1f (DGX Spark, GB10)
    against the env's own static cudart."""
    from builder.core import platforms
    from builder.env import toolchain
    from builder.verify import cubin, kernel_compile

    why = _no_aarch64_emulation()
    if why is not None:
        pytest.skip(why)
    if platforms.host_name() == "linux-aarch64":
        pytest.skip("this machine is aarch64: the plain e2e builds cover it")
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    dest = tmp_path / "arm-env"
    cudaenv("build", "envspecs/toolchain-cu130.yaml", "--platform", "linux-aarch64",
            "--env-dir", str(dest), cwd=ws)  # fmt: skip
    env = {
        "PATH": f"{dest / 'cuda-home' / 'bin'}:{os.environ['PATH']}",
        "QEMU_LD_PREFIX": "/usr/aarch64-linux-gnu",
        "NVCC_CCBIN": str(shutil.which("aarch64-linux-gnu-g++")),
        "HOME": os.environ.get("HOME", str(tmp_path)),
    }
    built = kernel_compile.build_kernel(
        dest / "cuda-home" / "bin" / "nvcc", Arch.parse("12.1f"), tmp_path / "work", env=env
    )
    assert built.error is None, built.error
    assert toolchain.elf_machine(built.path) == 183
    # This machine's cuobjdump reads the aarch64 executable's fatbin: sm_121 cubins only.
    cuobjdump, where = cubin.find_cuobjdump(env_facts(cuda_home=str(tmp_path / "none")))
    assert cuobjdump is not None, where
    assert cubin.list_elf(cuobjdump, built.path) == ["sm_121"]


@pytest.mark.network
def test_an_aarch64_wheelhouse_is_exported_here_and_assembles_offline(tmp_path: Path) -> None:
    """For an air-gapped aarch64 cluster: `export --platform linux-aarch64` on this machine
    downloads that machine's files (hash-checked); `build --platform linux-aarch64 --offline
    --wheelhouse` assembles the env from them alone, with an empty uv cache."""
    from builder.core import platforms
    from builder.env import toolchain

    if platforms.host_name() == "linux-aarch64":
        pytest.skip("this machine is aarch64: its own export covers it")
    ws = workspace(tmp_path, "toolchain-cu130.yaml", "torch2.9-cu128-system.yaml")
    wheelhouse = tmp_path / "aarch64-wheels"
    cudaenv("export", "envspecs/toolchain-cu130.yaml", "--wheelhouse", str(wheelhouse),
            "--platform", "linux-aarch64", cwd=ws)  # fmt: skip
    names = sorted(p.name for p in wheelhouse.glob("*.whl"))
    assert any(n.startswith("nvidia_cuda_nvcc-13.0.88") and "aarch64" in n for n in names), names
    assert not any("x86_64" in n for n in names), names
    offline = {"UV_OFFLINE": "1", "UV_CACHE_DIR": str(tmp_path / "empty-cache")}
    dest = tmp_path / "arm-env"
    cudaenv("build", "envspecs/toolchain-cu130.yaml", "--platform", "linux-aarch64", "--offline",
            "--wheelhouse", str(wheelhouse), "--env-dir", str(dest), cwd=ws, env=offline)  # fmt: skip
    assert toolchain.elf_machine(dest / "cuda-home" / "bin" / "nvcc") == 183
    # A platform the lock does not hold is refused, naming the ones it has.
    done = cudaenv("export", "envspecs/torch2.9-cu128-system.yaml", "--wheelhouse",
                   str(tmp_path / "none"), "--platform", "linux-aarch64", cwd=ws, check=False)  # fmt: skip
    assert done.returncode == 4
    assert "is for linux-x86_64, not linux-aarch64" in done.stderr
