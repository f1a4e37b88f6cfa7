"""``cudaenv adopt``: repairing an env a user already has, every change journalled first and
undone on failure (``journal``), an installed package kept as a wheel for undo (``saved``), a package rebuilt
against the matched toolkit (``rebuild``), the plan and its execution (``repair``). Imports the layers
below it up to ``env`` and ``jit``.

Entry: ``builder.adopt.repair.adopt``.
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "saved",
    "journal",
    "rebuild",
    "repair",
)
