"""The command line: the parser (``parser``), the dispatch and exit codes (``main``), shell
completion and the generated reference pages (``docgen``). The only package that prints a
result and exits. ``python -m builder.cli`` is ``cudaenv``.

Entry: ``builder.cli.main.main``.
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "completion",
    "parser",
    "docgen",
    "main",
    "__main__",
)
