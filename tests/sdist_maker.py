"""A test sdist like the packages that compile at install (flash-attn, causal-conv1d): its
``setup.py`` imports torch, builds a ``CUDAExtension`` from one ``.cu``, and, like the
Dao-AILab packages, first tries to download a prebuilt wheel unless its FORCE_BUILD variable
says TRUE. Its PKG-INFO is static (Metadata-Version 2.4), so a resolver reads it unbuilt."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

NAME = "cudaenv-testext"
MODULE = "cudaenv_testext"
FORCE = "CUDAENV_TESTEXT_FORCE_BUILD"

SETUP_PY = f'''\
import os
import urllib.request

import torch  # noqa: F401 - like flash-attn: setup.py needs the env's torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

FORCE_BUILD = os.getenv("{FORCE}", "FALSE") == "TRUE"
EXTRA = [{{extra}}]
{{prelude}}


class CachedWheels(BuildExtension):
    def run(self):
        if not FORCE_BUILD:
            # The Dao-AILab pattern: a prebuilt wheel from the project's releases first.
            urllib.request.urlretrieve("https://example.invalid/{MODULE}.whl", "prebuilt.whl")
        super().run()


setup(
    name="{NAME}",
    version="{{version}}",
    packages=["{MODULE}"],
    ext_modules=[
        CUDAExtension(
            "{MODULE}._C",
            ["csrc/add_one.cu"],
            extra_compile_args={{{{"cxx": ["-O1"], "nvcc": ["-O1", *EXTRA]}}}},
        )
    ],
    cmdclass={{{{"build_ext": CachedWheels}}}},
    install_requires=["torch"],
)
'''

KERNEL = """\
#include <torch/extension.h>

__global__ void add_one_kernel(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}

torch::Tensor add_one(torch::Tensor x) {
  auto y = x.clone();
  int n = y.numel();
  add_one_kernel<<<(n + 255) / 256, 256>>>(y.data_ptr<float>(), n);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add_one", &add_one); }
"""

INIT = "from . import _C  # noqa: F401\n"

# The FORCE_CUDA kind (mmcv, torch-scatter and many more): a CUDA build only where the build
# sees a GPU or FORCE_CUDA=1 says so, else a CppExtension of the host code alone. On a box
# without a GPU it builds, installs and imports either way; only the module tells them apart.
FORCE_CUDA_SETUP_PY = f'''\
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

if torch.cuda.is_available() or os.getenv("FORCE_CUDA", "0") == "1":
    ext = CUDAExtension(
        "{MODULE}._C", ["csrc/bind.cpp", "csrc/add_one.cu"], define_macros=[("WITH_CUDA", None)]
    )
else:
    ext = CppExtension("{MODULE}._C", ["csrc/bind.cpp"])

setup(
    name="{NAME}",
    version="{{version}}",
    packages=["{MODULE}"],
    ext_modules=[ext],
    cmdclass={{{{"build_ext": BuildExtension}}}},
    install_requires=["torch"],
)
'''

FORCE_CUDA_BIND = """\
#include <torch/extension.h>

#ifdef WITH_CUDA
torch::Tensor add_one_cuda(torch::Tensor x);
#endif

torch::Tensor add_one(torch::Tensor x) {
#ifdef WITH_CUDA
  if (x.is_cuda()) return add_one_cuda(x);
#endif
  return x + 1;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add_one", &add_one); }
"""

# The same kernel under another name, its binding in bind.cpp.
FORCE_CUDA_KERNEL = KERNEL.replace("torch::Tensor add_one(", "torch::Tensor add_one_cuda(").split(
    "\nPYBIND11_MODULE"
)[0]


def make_sdist(
    where: Path,
    *,
    version: str = "0.1.0",
    extra_nvcc: str = "",
    prelude: str = "",
    force_cuda: bool = False,
) -> Path:
    """The sdist ``cudaenv_testext-VERSION.tar.gz`` written into ``where``; ``extra_nvcc``: more
    nvcc arguments as Python list items (``'"-std=c++17"'`` to make one that cannot build);
    ``prelude``: statements its setup.py runs before ``setup()``; ``force_cuda``: the
    FORCE_CUDA kind instead (FORCE_CUDA_SETUP_PY)."""
    base = f"{MODULE}-{version}"
    files = {
        "setup.py": SETUP_PY.format(version=version, extra=extra_nvcc, prelude=prelude),
        "PKG-INFO": f"Metadata-Version: 2.4\nName: {NAME}\nVersion: {version}\nRequires-Dist: torch\n",
        "pyproject.toml": '[build-system]\nrequires = ["setuptools>=70"]\n'
        'build-backend = "setuptools.build_meta"\n',
        "csrc/add_one.cu": KERNEL,
        f"{MODULE}/__init__.py": INIT,
    }
    if force_cuda:
        files["setup.py"] = FORCE_CUDA_SETUP_PY.format(version=version)
        files["csrc/add_one.cu"] = FORCE_CUDA_KERNEL
        files["csrc/bind.cpp"] = FORCE_CUDA_BIND
    where.mkdir(parents=True, exist_ok=True)
    out = where / f"{base}.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for rel, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{base}/{rel}")
            info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
            tar.addfile(info, io.BytesIO(data))
    return out
