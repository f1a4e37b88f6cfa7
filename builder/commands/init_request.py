"""The request of `cudaenv init`: its arguments (``--with``, ``--gpu``, ``--cuda``, ``--name``,
``--out``, ``--targets``, ``--exclude-newer``) checked, each refused in one line naming it,
and the Python every spec init writes is for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from builder.core.cudaversion import CudaVersion
from builder.core.errors import SpecError, UsageError
from builder.machine import archs
from builder.machine import targets as targets_mod
from builder.machine.archs import Arch
from builder.machine.targets import Target
from builder.spec import envspec as spec

# The Python of every shipped spec: the one the measured stacks resolve for.
PYTHON = "3.12"


# --------------------------------------------------------------------------- the request


@dataclass(frozen=True, kw_only=True)
class Request:
    """What `cudaenv init` was asked, checked."""

    packages: tuple[Requirement, ...] = ()  # --with, torch excepted
    torch: Requirement | None = None  # a --with naming torch
    gpus: tuple[Arch, ...] = ()  # --gpu, as given (a bare 12.0 is spelled per CUDA later)
    cuda: CudaVersion | None = None
    name: str | None = None
    out: Path | None = None
    argv: tuple[str, ...] = ()  # the command line, for the spec's first comment
    targets: tuple[Target, ...] = ()  # --targets: the fleet the stack must run on
    exclude_newer: str | None = None  # --exclude-newer: the index view to choose from


def _check_name(name: str) -> None:
    """The spec's own rule for a name (spec.py), worded for ``--name``."""
    probe = f'name: {json.dumps(name)}\npython: {json.dumps(PYTHON)}\ncuda: "13.0"\n'
    try:
        spec.load(Path("--name.yaml"), text=probe)
    except SpecError as exc:
        said = exc.problems[0].split(": name: ", 1)[-1] if exc.problems else str(exc)
        raise UsageError(f"--name {name!r}: {said}") from None


def make_request(
    *,
    with_: Sequence[str] = (),
    gpu: Sequence[str] = (),
    cuda: str | None = None,
    name: str | None = None,
    out: str | None = None,
    argv: Sequence[str] = (),
    targets_file: str | None = None,
    exclude_newer: str | None = None,
) -> Request:
    """The arguments, each refused in one line naming it (UsageError, exit 2); a fleet file's
    problems located in it (SpecError, exit 2)."""
    packages: list[Requirement] = []
    torch: Requirement | None = None
    seen: set[str] = set()
    for text in with_:
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            first = str(exc).splitlines()[0]  # packaging adds the text and a caret below
            raise UsageError(f"--with {text!r}: not a valid requirement: {first}") from None
        if req.url:
            raise UsageError(f"--with {text!r}: a direct URL cannot be locked by hash here")
        cname = canonicalize_name(req.name)
        if cname in seen:
            raise UsageError(f"--with {text!r}: {req.name} is asked twice")
        seen.add(cname)
        if cname == "torch":
            torch = req
        else:
            packages.append(req)
    gpus: list[Arch] = []
    for text in gpu:
        for part in re.split(r"[\s,;]+", text.strip()):
            if not part:
                continue
            try:
                arch = Arch.parse(part)
            except ValueError as exc:
                raise UsageError(f"--gpu {text!r}: {exc}") from None
            unknown = archs.known_capability(arch)
            if unknown is not None:
                raise UsageError(f"--gpu {text!r}: {unknown}")
            if arch not in gpus:
                gpus.append(arch)
    version: CudaVersion | None = None
    if cuda is not None:
        try:
            version = CudaVersion.parse(cuda)
        except ValueError as exc:
            raise UsageError(f"--cuda {cuda!r}: {exc}") from None
        if version.major not in (12, 13):
            raise UsageError(f"--cuda {cuda}: CUDA 12.x and 13.x are supported")
    if name is not None:
        _check_name(name)
    path = Path(out) if out else None
    if path is not None and (path.exists() or path.is_symlink()):
        raise UsageError(f"--out {out}: the file exists; init never overwrites a spec")
    return Request(
        packages=tuple(packages),
        torch=torch,
        gpus=tuple(gpus),
        cuda=version,
        name=name,
        out=path,
        argv=tuple(argv),
        targets=targets_mod.load_file(Path(targets_file)) if targets_file else (),
        exclude_newer=exclude_newer,
    )
