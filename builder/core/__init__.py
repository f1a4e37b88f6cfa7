"""The ground floor: what every other package may use and what imports none of them.

Errors and exit codes (``errors``), check statuses, CUDA version numbers, the platform
tags, the one subprocess seam (``proc``), two parts of one job on two cores (``forked``), progress output (``reporter``), cudaenv's own cache
files and their trust rules (``cachefiles``), project paths, the settings cascade and every
variable cudaenv reads (``variables``, ``settings``), the index view a resolution sees, and the
remote-cache URL rules. It may import ``builder.store`` and nothing else of cudaenv.

Entry: ``builder.core.errors.CudaenvError`` (everything raised to a user is one).
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "context",
    "forked",
    "descendants",
    "statuses",
    "errors",
    "cudaversion",
    "indexview",
    "platforms",
    "remote_cache",
    "variables",
    "settings",
    "owners",
    "reporter",
    "cachefiles",
    "paths",
    "proc",
)
