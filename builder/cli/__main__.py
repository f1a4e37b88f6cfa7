"""``python -m builder.cli``: the ``cudaenv`` command."""

from builder.cli.main import main

raise SystemExit(main())
