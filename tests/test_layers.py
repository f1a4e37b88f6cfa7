"""The module map of docs/development/architecture.md: every import goes down the layers, the
ones inside a function and under ``TYPE_CHECKING`` included, so no two modules import each
other however lazily (a circle drawn only at run time is still a circle)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILDER = ROOT / "builder"
ARCHITECTURE = ROOT / "docs" / "development" / "architecture.md"

# Bottom first, as docs/development/architecture.md lists them. A package's modules are placed
# one by one ("verify.model", ..., "verify" for its __init__.py), except the packages in WHOLE.
LAYERS = [
    "store.errors", "store.limits", "store.trust", "store.ninja_files", "store.entries",
    "store.hashing", "store.locking", "store.store", "store.ninja_build", "store.plans", "store",
    "probe", "kernels",
    "statuses", "errors", "commandargs", "cudaversion", "indexview", "platforms", "remote_cache",
    "variables",
    "settings",
    "reporter", "cachefiles", "paths", "proc",
    "driver", "archs", "fatbin", "yamldoc", "targets", "jsondoc", "codec", "tomlwriter",
    "jit_signing", "oci", "jit_remote", "jit_share",
    "spec", "matrixfile", "lock", "channels", "project", "policy", "interpreters", "resolve",
    "caches", "manifest", "toolchain", "box", "installproof", "build", "prefetch", "export", "adopt_journal", "adopt",
    "audit",
    "fleet",
    "verify.model", "verify.recorded", "verify.reference", "verify.imports", "verify.toolchain", "verify.binaries",
    "verify.kernel_compile", "verify.flashinfer_jit", "verify.cubin", "verify.sampling", "verify",
    "doctor_facts", "doctor_rules", "doctor", "fingerprint", "report", "envs",
    "pipeline", "verifyrun", "buildrun", "auditrun", "exportrun", "storerun", "warmrun",
    "add", "init", "matrix", "compat", "completion", "cliargs", "docgen", "cli",
]  # fmt: skip
# Packages placed as one unit: the probes run inside a foreign interpreter and import nothing
# of cudaenv; kernels holds CUDA sources.
WHOLE = {"probe", "kernels"}


def module_name(path: Path) -> str:
    """``builder/verify/model.py`` -> ``verify.model``; a package's ``__init__.py`` is the
    package; ``builder/__init__.py`` is ``""``."""
    parts = list(path.relative_to(BUILDER).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit(name: str) -> str:
    """The LAYERS entry a module or an imported name belongs to: the longest placed prefix
    (``verify.CHECKS`` -> ``verify``, ``probe.env_facts`` -> ``probe``), ``""`` for the
    package root (its ``__version__``), the name itself where nothing is placed."""
    placed = set(LAYERS)
    probe = name
    while probe:
        if probe in placed:
            return probe
        probe = probe.rpartition(".")[0]
    head = name.partition(".")[0]
    return "" if head in ("", "__version__") else name


def module_imports(path: Path, name: str) -> set[str]:
    """The LAYERS entries the module ``name`` (read from ``path``) imports anywhere in it: at
    module level, inside a function or class, under ``TYPE_CHECKING``. ``from P import X``
    imports ``P`` and, where ``X`` is a module, ``P.X``."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = ["builder", *name.split(".")] if name else ["builder"]
                package = here if is_package else here[:-1]
                up = package[: len(package) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        for target in targets:
            if target == "builder" or target.startswith("builder."):
                found.add(unit(target.removeprefix("builder").lstrip(".")))
    own = unit(name)
    return {u for u in found if u not in ("", own)}


def files() -> dict[str, Path]:
    """Every module of builder/, by dotted name (the root package excluded)."""
    out = {}
    for path in sorted(BUILDER.rglob("*.py")):
        name = module_name(path)
        if name:
            out[name] = path
    return out


def upward(name: str, path: Path) -> list[str]:
    """Each import of ``name`` that does not go down the layers, as ``name -> used``."""
    rank = {u: i for i, u in enumerate(LAYERS)}
    own = unit(name)
    return [
        f"{own} -> {used}"
        for used in sorted(module_imports(path, name))
        if used not in rank or rank[used] > rank[own]
    ]


def test_every_module_is_placed_and_imports_only_downwards() -> None:
    placed = set()
    for name in files():
        head = name.partition(".")[0]
        placed.add(head if head in WHOLE else name)
    assert sorted(placed) == sorted(LAYERS), "place a new module in LAYERS (and the docs)"
    assert len(LAYERS) == len(set(LAYERS))
    found = [line for name, path in files().items() for line in upward(name, path)]
    assert found == []


def test_the_package_root_imports_nothing() -> None:
    """``builder/__init__.py`` (``__version__``) is below every module."""
    assert module_imports(BUILDER / "__init__.py", "") == set()


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    bad = tmp_path / "archs.py"
    bad.write_text("from builder import cli\nfrom builder.pipeline import Run\n")
    assert upward("archs", bad) == ["archs -> cli", "archs -> pipeline"]


def test_a_lazy_or_type_checking_upward_import_is_caught(tmp_path: Path) -> None:
    """The circles an import at module level alone would hide: a name under TYPE_CHECKING,
    an import inside a function or a method, and a check importing its own package."""
    bad = tmp_path / "errors.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from builder.report import CellStatus\n"
        "def later():\n"
        "    from builder import cli\n"
        "class Late:\n"
        "    def method(self):\n"
        "        import builder.verify.model\n"
    )
    assert upward("errors", bad) == ["errors -> cli", "errors -> report", "errors -> verify.model"]
    check = tmp_path / "cubin.py"
    check.write_text("def check():\n    from builder.verify import FAILED\n")
    assert upward("verify.cubin", check) == ["verify.cubin -> verify"]
    relative = tmp_path / "binaries.py"
    relative.write_text("from . import registry\nfrom .model import Target\n")
    assert upward("verify.binaries", relative) == ["verify.binaries -> verify"]


def test_the_architecture_page_lists_the_layers() -> None:
    """The layer paragraph of docs/development/architecture.md names the modules of LAYERS in
    order, a package once (``verify/``): its modules are one block of the list."""
    blocks: list[str] = []
    for name in LAYERS:
        head = name.partition(".")[0]
        if not blocks or blocks[-1] != head:
            blocks.append(head)
    assert len(blocks) == len(set(blocks)), "keep a package's modules together in LAYERS"
    text = ARCHITECTURE.read_text()
    paragraph = text[text.index("Layers, from the bottom:") : text.index("tests/test_layers.py")]
    assert [n.rstrip("/") for n in re.findall(r"`([\w/]+)`", paragraph)] == blocks
