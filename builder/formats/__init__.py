"""The file formats cudaenv reads and writes, each with line-and-key errors: YAML documents
(``yamldoc``), JSON documents (``jsondoc``), typed decoding into dataclasses (``codec``), TOML
writing (``tomlwriter``) and the jinja environment the env's scripts are rendered with
(``templates``). Imports ``builder.core`` only.

Entry: ``builder.formats.codec.from_json``.
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "yamldoc",
    "jsondoc",
    "codec",
    "tomlwriter",
    "templates",
)
