"""The command line: the parser (``parser``), the dispatch and exit codes (``main``), shell
completion and the generated reference pages (``docgen``). The only package that exits, and
the one that writes results to stdout: a command that shows one as it goes is handed ``show``
(``print``) from here; progress goes to a ``Reporter`` on stderr. ``python -m builder.cli`` is ``cudaenv``.

Entry: ``builder.cli.script.entry`` (the script and ``python -m builder.cli``).
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "completion",
    "parser",
    "docgen",
    "main",
    "script",
    "__main__",
)
