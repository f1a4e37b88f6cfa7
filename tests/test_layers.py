"""The module map of docs/development/architecture.md: a module-level import only goes down
the layers."""

from __future__ import annotations

import ast
from pathlib import Path

BUILDER = Path(__file__).resolve().parent.parent / "builder"

# Bottom first, as docs/development/architecture.md lists them.
LAYERS = [
    "errors", "cudaversion", "platforms", "variables", "reporter", "cachefiles", "paths", "proc",
    "archs", "fatbin", "driver", "yamldoc", "targets", "jsondoc", "jit_signing", "jit_remote",
    "jit_share", "spec", "lock", "channels", "project", "policy", "interpreters", "resolve",
    "caches", "manifest", "toolchain", "build", "export", "adopt", "audit", "fleet",
    "verify", "doctor", "fingerprint", "report", "envs",
    "pipeline", "add", "init", "matrix", "compat", "completion", "cliargs", "docgen", "cli",
]  # fmt: skip
NOT_MODULES = {"__version__", "probe", "kernels", "templates"}


def module_imports(path: Path) -> set[str]:
    """The builder modules ``path`` imports at module level (lazy imports are not counted)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("builder"):
            if node.module == "builder":
                found.update(a.name for a in node.names)
            else:
                found.add(node.module.split(".")[1])
    return found - NOT_MODULES


def test_every_module_is_placed_and_imports_only_downwards() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    files = {p.stem: p for p in BUILDER.glob("*.py") if p.stem != "__init__"}
    files["verify"] = BUILDER / "verify" / "__init__.py"
    assert sorted(files) == sorted(LAYERS), "place a new module in LAYERS (and the docs)"
    upward = [
        f"{name} -> {used}"
        for name, path in sorted(files.items())
        for used in sorted(module_imports(path))
        if used != name and rank[used] > rank[name]
    ]
    assert upward == []


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    bad = tmp_path / "archs.py"
    bad.write_text("from builder import cli\nfrom builder.pipeline import Run\n")
    assert module_imports(bad) == {"cli", "pipeline"}
