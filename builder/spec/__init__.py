"""What an env should be: the spec file (``envspec``), matrix files, the PEP 751 lock and its
resolution with uv, NVIDIA's wheel channels, the matching policy that refuses a mismatched
set, and the project's own settings in ``pyproject.toml``. Imports ``core``, ``formats`` and
``machine``.

Entry: ``builder.spec.envspec.load`` and ``builder.spec.resolve.resolve``.
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "envspec",
    "matrixfile",
    "lock",
    "channels",
    "project",
    "policy",
    "resolve",
)
