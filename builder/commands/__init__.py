"""One module per use case, each with its typed request and no printing of results: build,
verify, audit, export, store, warm, add, init (its request and its choosing in
``init_request`` and ``init_choice``), matrix, compat; ``pipeline`` holds the steps
they share (spec -> lock -> env), ``args`` their typed arguments (each declared once, with
``options``' field helpers). Everything below may be
imported; the CLI above calls these.

Entry: ``builder.commands.build.build_and_verify`` (where `cudaenv build` starts).
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "options",
    "args",
    "pipeline",
    "verify",
    "build",
    "audit",
    "export",
    "store",
    "warm",
    "add",
    "init_request",
    "init_choice",
    "init",
    "matrix",
    "compat",
)
