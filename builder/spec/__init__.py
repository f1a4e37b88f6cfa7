"""What an env should be: the spec (``specmodel``) and its file (``envspec``), matrix files,
the PEP 751 lock (``lockmodel``, ``lock``) and its resolution with uv (``uvcompile``,
``relock``, ``resolve``), NVIDIA's wheel channels, the matching policy that refuses a
mismatched set, and the project's own settings in ``pyproject.toml``. Imports ``core``,
``formats`` and ``machine``.

Entry: ``builder.spec.envspec.load`` and ``builder.spec.resolve.resolve``.
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "specmodel",
    "envspec",
    "matrixfile",
    "lockmodel",
    "lock",
    "channels",
    "project",
    "policy",
    "uvconfig",
    "uvcompile",
    "relock",
    "resolve",
)
