"""Making and describing an env: the build (venv, locked install, its proof, the swap), the
``cuda-home/`` overlay and start-up hooks (``toolchain``), the JIT cache locations, the
manifest, exported wheelhouses, and the envs of a project (``cudaenv list/remove/run``).
Imports ``core``, ``formats``, ``machine``, ``spec`` and ``store``.

Entry: ``builder.env.build.build``.
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "caches",
    "manifest",
    "toolchain",
    "hooks",
    "recordscan",
    "installproof",
    "place",
    "setuppy",
    "recipes",
    "wheelproof",
    "buildlog",
    "treeguard",
    "sdistbuild",
    "sourcebuild",
    "sdistcheck",
    "build",
    "export",
    "envs",
    "specedit",
)
