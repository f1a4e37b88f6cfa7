"""``python -m builder.cli``: the ``cudaenv`` command."""

from builder.cli.script import entry

raise SystemExit(entry())
