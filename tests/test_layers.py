"""The layers of builder/: every import goes down, the ones inside a function and under
``TYPE_CHECKING`` included, so no two modules import each other however lazily (a circle
drawn only at run time is still a circle).

The order lives in the code, not here: ``builder.PACKAGES`` orders the packages, and each
package's ``MODULES`` (in its ``__init__.py``) orders its own modules, its ``__init__`` above
them all. A module may import any module of a package below its own, and, inside its own
package, the modules listed before it. Adding a module to a package edits that package's
tuple only; docs/development/layers.md is generated from the same data (docgen)."""

from __future__ import annotations

import ast
from pathlib import Path

from builder import PACKAGES
from builder.cli import docgen

ROOT = Path(__file__).resolve().parent.parent
BUILDER = ROOT / "builder"
# Packages placed as one unit: the probes run inside a foreign interpreter and import nothing
# of cudaenv; kernels holds CUDA sources.
WHOLE = {"probe", "kernels"}


def modules_of(package: str) -> tuple[str, ...]:
    """The MODULES tuple of ``builder/PACKAGE/__init__.py``, read without importing it."""
    return docgen.package_modules(BUILDER / package)


def module_name(path: Path) -> str:
    """``builder/verify/model.py`` -> ``verify.model``; a package's ``__init__.py`` is the
    package; ``builder/__init__.py`` is ``""``."""
    parts = list(path.relative_to(BUILDER).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def files() -> dict[str, Path]:
    """Every module of builder/, by dotted name (the root package excluded)."""
    out = {}
    for path in sorted(BUILDER.rglob("*.py")):
        name = module_name(path)
        if name:
            out[name] = path
    return out


def place(name: str) -> tuple[int, int] | None:
    """Where a module (or an imported name) sits: (its package's rank, its rank inside the
    package; a package's ``__init__`` above its modules, a WHOLE package one unit); None for
    the root package (``__version__``, ``PACKAGES``) and anything outside builder/."""
    head, _, rest = name.partition(".")
    if head not in PACKAGES:
        return None
    if head in WHOLE:
        return PACKAGES.index(head), 0
    mods = modules_of(head)
    sub = rest.partition(".")[0]
    return PACKAGES.index(head), (mods.index(sub) if sub in mods else len(mods))


def imported(path: Path, name: str) -> set[str]:
    """The modules of builder/ that ``name`` (read from ``path``) imports anywhere in it: at
    module level, inside a function or class, under ``TYPE_CHECKING``. ``from P import X``
    imports ``P.X`` where ``X`` is a module of ``P``, else ``P`` itself (a name of its
    ``__init__``); relative imports are resolved against the module's package."""
    is_package = path.name == "__init__.py"
    known = set(files())
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
            for a in node.names:
                sub = f"{base}.{a.name}"
                targets.append(sub if sub.removeprefix("builder.") in known else base)
        for target in targets:
            if target.startswith("builder."):
                found.add(target.removeprefix("builder."))
    return {t for t in found if t != name}


def upward(name: str, path: Path) -> list[str]:
    """Each import of ``name`` that does not go down the layers, as ``name -> used``."""
    own = place(name)
    assert own is not None, name
    bad = []
    for used in sorted(imported(path, name)):
        at = place(used)
        if at is None:
            continue
        if at[0] == own[0] and name.partition(".")[0] in WHOLE:
            continue  # inside a package placed whole
        if at >= own:
            bad.append(f"{name} -> {used}")
    return bad


def test_every_package_is_ordered_and_every_module_placed() -> None:
    on_disk = sorted(p.name for p in BUILDER.iterdir() if (p / "__init__.py").is_file())
    assert sorted(PACKAGES) == on_disk, "name a new package in builder.PACKAGES"
    assert len(PACKAGES) == len(set(PACKAGES))
    for package in PACKAGES:
        if package in WHOLE:
            continue
        mods = modules_of(package)
        here = sorted(p.stem for p in (BUILDER / package).glob("*.py") if p.stem != "__init__")
        assert sorted(mods) == here, f"list builder/{package}'s modules in its MODULES"
        assert len(mods) == len(set(mods))


def test_every_import_goes_down() -> None:
    found = [line for name, path in files().items() for line in upward(name, path)]
    assert found == []


def test_the_top_level_is_packages() -> None:
    """A newcomer reads the tree: builder/ holds packages, each with a docstring saying what
    it owns, and nothing at the top but the root's ``__init__``."""
    loose = sorted(p.name for p in BUILDER.glob("*.py"))
    assert loose == ["__init__.py"]
    for package in PACKAGES:
        if package in WHOLE:
            continue
        doc = ast.get_docstring(ast.parse((BUILDER / package / "__init__.py").read_text()))
        assert (doc and "Entry" in doc) or package in ("store", "verify"), package


def test_the_package_root_imports_nothing() -> None:
    """``builder/__init__.py`` (``__version__``, ``PACKAGES``) is below every module."""
    assert imported(BUILDER / "__init__.py", "") == set()


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    bad = tmp_path / "archs.py"
    bad.write_text("from builder.cli import main\nfrom builder.commands.pipeline import Run\n")
    assert upward("machine.archs", bad) == [
        "machine.archs -> cli.main",
        "machine.archs -> commands.pipeline",
    ]
    # Inside one package: a module listed later, and the package's own __init__.
    inside = tmp_path / "errors.py"
    inside.write_text("from builder.core import proc\nfrom builder.core import MODULES\n")
    assert upward("core.errors", inside) == ["core.errors -> core", "core.errors -> core.proc"]


def test_a_lazy_or_type_checking_upward_import_is_caught(tmp_path: Path) -> None:
    """The circles an import at module level alone would hide: a name under TYPE_CHECKING,
    an import inside a function or a method, and a check importing its own package."""
    bad = tmp_path / "errors.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from builder.verify.report import CellStatus\n"
        "def later():\n"
        "    from builder.cli import main\n"
        "class Late:\n"
        "    def method(self):\n"
        "        import builder.verify.model\n"
    )
    assert upward("core.errors", bad) == [
        "core.errors -> cli.main",
        "core.errors -> verify.model",
        "core.errors -> verify.report",
    ]
    check = tmp_path / "cubin.py"
    check.write_text("def check():\n    from builder.verify import FAILED\n")
    assert upward("verify.cubin", check) == ["verify.cubin -> verify"]
    relative = tmp_path / "binaries.py"
    relative.write_text("from . import registry\nfrom .report import Target\n")
    assert upward("verify.binaries", relative) == ["verify.binaries -> verify", "verify.binaries -> verify.report"]  # fmt: skip


def test_the_layers_page_is_made_from_the_same_data() -> None:
    """docs/development/layers.md lists the packages in PACKAGES order and each package's
    modules in its MODULES order (docgen writes it; test_docs checks it is fresh)."""
    page = docgen.layers_page()
    at = [page.index(f"## `{p}/`") for p in PACKAGES]
    assert at == sorted(at)
    for package in PACKAGES:
        if package in WHOLE:
            continue
        section = page[page.index(f"## `{package}/`") :]
        rows = [section.index(f"`builder/{package}/{m}.py`") for m in modules_of(package)]
        assert rows == sorted(rows), package
