"""A matrix file: its cells, loaded and expanded, and what a cell's spec is.

A matrix file is either a list of spec files (``specs:``) or a base spec plus axes, with
``exclude:`` / ``include:`` as in CI matrices. It is read with the same located YAML reader
as specs (builder/formats/yamldoc.py): every problem is reported at once as ``FILE:LINE:COL: key:
message``, unknown keys and axes with a "did you mean".

Everything a matrix makes lives under ``.envs/.matrix/MATRIX/``: each cell's generated spec
(``extends:`` the base) and its lock (the matrix's own: re-resolved when the base changes),
each cell's env (``envs/CELL``, so two matrices, or two specs of one name in different
folders, never share an env), and the reports. Nothing is written when a matrix is only
loaded (``cudaenv plan FILE:CELL``, ``--emit``): a cell's spec is written when it runs.

The model only: what ``load_spec("M.yaml:CELL")`` and ``--emit github`` need. Running the
cells is builder/commands/matrix.py's.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from builder.core import proc
from builder.core.errors import SpecError
from builder.core.paths import matrix_dir
from builder.formats.yamldoc import (
    Item,
    Mark,
    Problems,
    Unreadable,
    compose,
    display,
    kind,
    not_of_kind,
    read_input,
    suggest,
)
from builder.machine.archs import Arch
from builder.spec import envspec as specs

AXES = ("torch", "cuda", "python", "flashinfer", "sglang", "archs")
MATRIX_KEYS = ("name", "specs", "base", "axes", "exclude", "include", "runners")
SHORT = {
    "torch": "torch",
    "cuda": "cu",
    "python": "py",
    "flashinfer": "fi",
    "sglang": "sglang",
    "archs": "sm",
}
PACKAGE_OF = {"flashinfer": "flashinfer-python", "sglang": "sglang"}
DEFAULT_RUNNER = "ubuntu-latest"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}$")


@dataclass(frozen=True, kw_only=True)
class Cell:
    name: str
    spec_path: Path
    values: tuple[tuple[str, str], ...] = ()
    archs: tuple[Arch, ...] = ()
    runs_on: tuple[str, ...] = ()
    generated: bool = False  # a spec the matrix makes (its lock is the matrix's own)
    spec_text: str | None = None  # a generated spec's content, written only when it runs


@dataclass(frozen=True, kw_only=True)
class Matrix:
    name: str
    source: Path
    cells: tuple[Cell, ...]
    root: Path  # .envs/.matrix/NAME: generated specs, locks, envs, reports

    def cell(self, name: str) -> Cell:
        for c in self.cells:
            if c.name == name:
                return c
        raise SpecError(
            [
                f"{display(self.source)}:1:1: no cell {name!r}; cells: "
                + ", ".join(c.name for c in self.cells)
            ],
            what="matrix file",
        )

    def env_dir(self, cell: Cell) -> Path:
        return self.root / "envs" / cell.name

    def spec_of(self, cell: Cell) -> specs.EnvSpec:
        """The cell's spec, read without writing anything."""
        return specs.load(cell.spec_path, text=cell.spec_text)


def write_cell_spec(cell: Cell) -> Path:
    """Put a generated cell's spec at its path (unchanged files are left alone): done by
    what builds or locks the cell, never by loading the matrix."""
    if cell.spec_text is not None and not _holds(cell.spec_path, cell.spec_text):
        proc.atomic_write_text(cell.spec_path, cell.spec_text)
    return cell.spec_path


def _holds(path: Path, text: str) -> bool:
    """``path`` is a spec file of exactly ``text``. Read as any input is (a FIFO left there
    would block a plain read); anything else there is replaced whole."""
    try:
        return read_input(path, specs.MAX_SPEC_BYTES, "spec").decode() == text
    except (Unreadable, UnicodeDecodeError):
        return False


def _text(value: object) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


def cell_name(values: Mapping[str, object]) -> str:
    parts = []
    for axis in AXES:
        if axis in values:
            v = _text(values[axis]).replace(" ", "+")
            parts.append(f"{SHORT[axis]}{v}")
    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", "-".join(parts))
    return name[:100] or "cell"


def _plain(item: Item) -> Any:
    """An Item tree as plain Python values (axis values are compared and written out)."""
    if isinstance(item.value, list):
        return [_plain(i) for i in item.value]
    if isinstance(item.value, dict):
        return {k: _plain(v) for k, v in item.value.items()}
    return item.value


# --------------------------------------------------------------------------- loading


class _Loader:
    """One matrix file -> cells, collecting every located problem before failing."""

    def __init__(self, path: Path, out_root: Path | None) -> None:
        self.path = path
        self.out_root = out_root or matrix_dir()
        self.problems = Problems()

    def add(self, item: Item, where: str, message: str, *, key: bool = False) -> None:
        mark = (item.key_mark or item.mark) if key else item.mark
        self.problems.add(mark, where, message)

    def load(self) -> Matrix:
        root = compose(self.path, self.problems, what="matrix file")
        if root is None or not isinstance(root.value, dict):
            raise SpecError(self.problems.messages(), what="matrix file")
        if not_of_kind(root, MATRIX_KEYS, "matrix file", self.problems):
            raise SpecError(self.problems.messages(), what="matrix file")
        data: dict[str, Item] = root.value
        for key, item in data.items():
            if key not in MATRIX_KEYS:
                self.add(item, key, suggest(key, MATRIX_KEYS), key=True)
        name = self.path.stem
        if "name" in data:
            given = data["name"].value
            if isinstance(given, str) and _NAME_RE.fullmatch(given) and ".." not in given:
                name = given
            else:
                self.add(data["name"], "name", f"expected a directory-safe name, got {kind(given)}")
        runners = self._runners(data.get("runners"))
        out_dir = self.out_root / name
        cells: list[Cell] = []
        if "specs" in data:
            cells += self._spec_cells(data["specs"], runners)
        if "base" in data:
            cells += self._axis_cells(data, runners, out_dir)
        elif "axes" in data:
            self.add(data["axes"], "axes", "axes need a `base:` spec to vary")
        if not cells and not self.problems:
            self.problems.add(root.mark, "", "a matrix needs `specs:` or `base:` with `axes:`")
        seen: dict[str, Cell] = {}
        for cell in cells:
            if cell.name in seen:
                self.problems.add(
                    Mark(display(self.path), 1, 1),
                    "cells",
                    f"two cells are named {cell.name!r} ({display(seen[cell.name].spec_path)} "
                    f"and {display(cell.spec_path)}); give the specs different names",
                )
            seen[cell.name] = cell
        if self.problems:
            raise SpecError(self.problems.messages(), what="matrix file")
        return Matrix(name=name, source=self.path, cells=tuple(cells), root=out_dir)

    def _runners(self, item: Item | None) -> dict[str, tuple[str, ...]]:
        if item is None:
            return {}
        if not isinstance(item.value, dict):
            self.add(
                item,
                "runners",
                f"expected a mapping of arch -> runner labels, got {kind(item.value)}",
            )
            return {}
        out: dict[str, tuple[str, ...]] = {}
        for key, sub in item.value.items():
            where = f"runners.{key}"
            if key != "default":
                try:
                    key = str(Arch.parse(key))
                except ValueError as exc:
                    self.add(sub, where, f"{exc} (or 'default')", key=True)
                    continue
            labels = sub.value if isinstance(sub.value, list) else [sub]
            texts = [str(_plain(x)) for x in labels if isinstance(x, Item)]
            if not isinstance(sub.value, list) or not texts:
                self.add(sub, where, f"expected a list of runner labels, got {kind(sub.value)}")
                continue
            out[key] = tuple(texts)
        return out

    def _spec_cells(self, item: Item, runners: Mapping[str, Sequence[str]]) -> list[Cell]:
        if not isinstance(item.value, list) or not item.value:
            self.add(
                item, "specs", f"expected a non-empty list of spec files, got {kind(item.value)}"
            )
            return []
        cells = []
        for i, sub in enumerate(item.value):
            if not isinstance(sub.value, str) or not sub.value:
                self.add(sub, f"specs[{i}]", f"expected a spec file path, got {kind(sub.value)}")
                continue
            spec_path = (self.path.parent / sub.value).resolve()
            # exists(): a FIFO or a device there is named as such by the spec's reader.
            if not spec_path.exists():
                self.add(sub, f"specs[{i}]", f"no such spec file: {sub.value}")
                continue
            try:
                s = specs.load(spec_path)
            except SpecError as exc:
                self.add(sub, f"specs[{i}]", f"{sub.value} is not a valid spec (below)")
                self.problems.include(exc.problems)
                continue
            cells.append(
                Cell(
                    name=s.name,
                    spec_path=spec_path,
                    values=(("spec", s.name),),
                    archs=s.archs,
                    runs_on=runs_on(runners, s.archs),
                )
            )
        return cells

    def _axis_cells(
        self, data: dict[str, Item], runners: Mapping[str, Sequence[str]], out_dir: Path
    ) -> list[Cell]:
        base_item = data["base"]
        if not isinstance(base_item.value, str) or not base_item.value:
            self.add(base_item, "base", f"expected a spec file path, got {kind(base_item.value)}")
            return []
        base_path = (self.path.parent / base_item.value).resolve()
        if not base_path.exists():
            self.add(base_item, "base", f"no such spec file: {base_item.value}")
            return []
        try:
            base = specs.load(base_path)
        except SpecError as exc:
            self.add(base_item, "base", f"{base_item.value} is not a valid spec (below)")
            self.problems.include(exc.problems)
            return []
        combos = self._expand(data.get("axes"), data.get("exclude"), data.get("include"))
        if self.problems:
            return []
        cells = []
        seen: set[str] = set()
        for values in combos:
            cname = cell_name(values)
            if cname in seen:
                continue
            seen.add(cname)
            spec_path = out_dir / f"{cname}.yaml"
            cell_archs = base.archs
            if "archs" in values:
                raw = values["archs"] if isinstance(values["archs"], list) else [values["archs"]]
                cell_archs = tuple(Arch.parse(str(a)) for a in raw)
            cells.append(
                Cell(
                    name=cname,
                    spec_path=spec_path,
                    values=tuple((k, _text(v)) for k, v in values.items()),
                    archs=cell_archs,
                    runs_on=runs_on(runners, cell_archs),
                    generated=True,
                    spec_text=cell_spec_text(out_dir, cname, base, base_path, values),
                )
            )
        return cells

    def _axis_value(self, axis: str, item: Item, where: str) -> Any:
        value = _plain(item)
        if axis == "archs":
            subs = item.value if isinstance(item.value, list) else [item]
            for j, sub in enumerate(subs):
                try:
                    Arch.parse(str(sub.value))
                except ValueError as exc:
                    self.add(sub, f"{where}[{j}]" if sub is not item else where, str(exc))
            return [str(_plain(sub)) for sub in subs]
        if isinstance(value, (dict, list)) or value is None or isinstance(value, bool):
            self.add(item, where, f"expected a version, got {kind(item.value)}")
            return None
        if isinstance(value, float) and axis in ("cuda", "python"):
            self.add(item, where, f'expected a quoted version like "13.0", got the number {value}')
            return None
        return str(value)

    def _check_keys(self, item: Item, where: str, keys: Sequence[str]) -> bool:
        ok = True
        assert isinstance(item.value, dict)
        for key, sub in item.value.items():
            if key not in keys:
                self.add(sub, f"{where}.{key}", suggest(key, keys, what="axis"), key=True)
                ok = False
        return ok

    def _expand(
        self, axes: Item | None, exclude: Item | None, include: Item | None
    ) -> list[dict[str, Any]]:
        if axes is None or not isinstance(axes.value, dict) or not axes.value:
            where = axes if axes is not None else None
            if where is not None:
                self.add(
                    where, "axes", f"expected a mapping of axis -> values, got {kind(where.value)}"
                )
            return []
        lists: list[list[dict[str, Any]]] = []
        for axis, values in axes.value.items():
            keys = axis.split("+")
            bad = [k for k in keys if k not in AXES]
            for k in bad:
                self.add(values, f"axes.{axis}", suggest(k, AXES, what="axis"), key=True)
            if bad:
                continue
            if not isinstance(values.value, list) or not values.value:
                self.add(
                    values, f"axes.{axis}", f"expected a non-empty list, got {kind(values.value)}"
                )
                continue
            options = []
            for i, value in enumerate(values.value):
                at = f"axes.{axis}[{i}]"
                if len(keys) > 1:
                    if not isinstance(value.value, dict) or sorted(value.value) != sorted(keys):
                        self.add(value, at, f"expected a mapping with keys {', '.join(keys)}")
                        continue
                    options.append(
                        {k: self._axis_value(k, value.value[k], f"{at}.{k}") for k in keys}
                    )
                else:
                    options.append({keys[0]: self._axis_value(keys[0], value, at)})
            lists.append(options)
        combos = [
            dict(kv for part in product for kv in part.items())
            for product in itertools.product(*lists)
        ]
        rules: list[dict[str, Any]] = []
        for i, (rule, rule_map) in enumerate(self._mappings(exclude, "exclude")):
            if self._check_keys(rule, f"exclude[{i}]", AXES):
                rules.append(
                    {k: self._axis_value(k, v, f"exclude[{i}].{k}") for k, v in rule_map.items()}
                )
        combos = [
            c
            for c in combos
            if not any(all(_text(c.get(k)) == _text(v) for k, v in r.items()) for r in rules)
        ]
        for i, (extra, extra_map) in enumerate(self._mappings(include, "include")):
            if self._check_keys(extra, f"include[{i}]", AXES):
                combos.append(
                    {k: self._axis_value(k, v, f"include[{i}].{k}") for k, v in extra_map.items()}
                )
        return combos

    def _mappings(self, item: Item | None, key: str) -> list[tuple[Item, dict[str, Item]]]:
        if item is None or item.value is None:
            return []
        if not isinstance(item.value, list):
            self.add(item, key, f"expected a list of mappings, got {kind(item.value)}")
            return []
        out = []
        for i, sub in enumerate(item.value):
            if isinstance(sub.value, dict):
                out.append((sub, sub.value))
            else:
                self.add(sub, f"{key}[{i}]", f"expected a mapping of axes, got {kind(sub.value)}")
        return out


def load(path: Path, out_root: Path | None = None) -> Matrix:
    """Expand a matrix file (writing nothing: a generated cell's spec is written when the cell
    runs). Raises SpecError with every located problem of the file (and of the specs it
    names)."""
    return _Loader(path, out_root).load()


def cell_spec_text(
    out_dir: Path, name: str, base: specs.EnvSpec, base_path: Path, values: Mapping[str, Any]
) -> str:
    """A generated cell's spec: ``extends:`` the base (relative to where it is written)."""
    doc: dict[str, Any] = {"extends": os.path.relpath(base_path, out_dir), "name": name}
    for key in ("torch", "cuda", "python"):
        if key in values:
            doc[key] = str(values[key])
    if "archs" in values:
        raw = values["archs"] if isinstance(values["archs"], list) else [values["archs"]]
        doc["archs"] = [str(a) for a in raw]
    packages = list(base.packages)
    for axis, package in PACKAGE_OF.items():
        if axis in values:
            pin = f"{package}=={values[axis]}"
            replaced = [pin if _req_name(p) == package else p for p in packages]
            packages = replaced if pin in replaced else [*packages, pin]
    if packages != list(base.packages):
        doc["packages"] = packages
    return "# Generated by cudaenv matrix; do not edit.\n" + yaml.safe_dump(doc, sort_keys=False)


def _req_name(text: str) -> str:
    try:
        return str(canonicalize_name(Requirement(text).name))
    except InvalidRequirement:
        return text


def runs_on(runners: Mapping[str, Sequence[str]], cell_archs: Sequence[Arch]) -> tuple[str, ...]:
    labels: list[str] = []
    for arch in cell_archs:
        for label in runners.get(str(arch), ()):
            if label not in labels:
                labels.append(label)
    if not labels:
        labels = list(runners.get("default", (DEFAULT_RUNNER,)))
    return tuple(labels)


def split_cell_arg(arg: str) -> tuple[Path, str] | None:
    """``MATRIX.yaml:CELL`` -> (matrix file, cell), else None (a plain spec path)."""
    if ":" not in arg:
        return None
    file, _, cell = arg.rpartition(":")
    if file.endswith((".yaml", ".yml")) and Path(file).is_file() and cell:
        return Path(file), cell
    return None


def _in_repository(path: Path) -> str:
    """``path`` relative to the repository it is in (the nearest directory above it with a
    ``.git``), as a CI job's checkout sees it; relative to here outside any repository."""
    absolute = path.absolute()
    for parent in absolute.parents:
        if (parent / ".git").exists():
            return absolute.relative_to(parent).as_posix()
    return os.path.relpath(absolute)


def github_matrix(matrix: Matrix) -> dict[str, Any]:
    return {
        "include": [
            {
                "cell": c.name,
                "spec": f"{_in_repository(matrix.source)}:{c.name}"
                if c.generated
                else _in_repository(c.spec_path),
                "runs-on": list(c.runs_on),
            }
            for c in matrix.cells
        ]
    }
