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


def make_sdist(
    where: Path, *, version: str = "0.1.0", extra_nvcc: str = "", prelude: str = ""
) -> Path:
    """The sdist ``cudaenv_testext-VERSION.tar.gz`` written into ``where``; ``extra_nvcc``: more
    nvcc arguments as Python list items (``'"-std=c++17"'`` to make one that cannot build);
    ``prelude``: statements its setup.py runs before ``setup()``."""
    base = f"{MODULE}-{version}"
    files = {
        "setup.py": SETUP_PY.format(version=version, extra=extra_nvcc, prelude=prelude),
        "PKG-INFO": f"Metadata-Version: 2.4\nName: {NAME}\nVersion: {version}\nRequires-Dist: torch\n",
        "pyproject.toml": '[build-system]\nrequires = ["setuptools>=70"]\n'
        'build-backend = "setuptools.build_meta"\n',
        "csrc/add_one.cu": KERNEL,
        f"{MODULE}/__init__.py": INIT,
    }
    where.mkdir(parents=True, exist_ok=True)
    out = where / f"{base}.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for rel, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{base}/{rel}")
            info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
            tar.addfile(info, io.BytesIO(data))
    return out
