"""Fleet targets: the classes of GPU one stack must serve.

A target is ``name``, ``cc`` (the compute capability, ``"12.1"``), ``platform``
(``linux-x86_64`` / ``linux-aarch64``), ``driver`` (the version installed there,
``"580.95.05"``, or its branch, ``"580"``) and ``required`` (whether ``build`` refuses a stack
that cannot run there). Targets come from a fleet file (a YAML mapping whose one key is
``targets:``, collected from the nodes with ``cudaenv target``) or inline in a spec; errors are
located as every spec error is. The JIT arch list a spec leaves out follows from its targets
(:func:`archs_for`). What a stack does on each target is :mod:`builder.audit.fleet`'s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from builder.core import platforms, proc
from builder.core.cudaversion import CudaVersion
from builder.core.errors import SpecError, UsageError
from builder.formats.yamldoc import (
    Item,
    Problems,
    compose,
    display,
    kind,
    not_of_kind,
    string,
    suggest,
)
from builder.machine import archs
from builder.machine import driver as driver_mod
from builder.machine.archs import Arch

KEYS = ("name", "cc", "platform", "driver", "required")
FILE_KEYS = ("targets",)
# A driver version as nvidia-smi prints it (580.95.05), or its branch (580).
_DRIVER = re.compile(r"^\d{3}(\.\d{1,3}){0,2}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
# A fleet file is a short list: the cap keeps a hostile one from costing anything.
MAX_FLEET_BYTES = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class Target:
    name: str
    cc: Arch  # the GPU's compute capability, as a plain arch (no a/f suffix)
    platform: str  # platforms.KNOWN
    driver: str  # "580.95.05" or a branch "580"
    required: bool = False

    @property
    def capability(self) -> tuple[int, int]:
        return self.cc.capability

    @property
    def cc_text(self) -> str:
        return f"{self.cc.major}.{self.cc.minor}"

    @property
    def label(self) -> str:
        return f"{self.name} ({self.cc_text}, {self.platform}, driver {self.driver})"

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "cc": self.cc_text,
            "platform": self.platform,
            "driver": self.driver,
            "required": self.required,
        }

    def yaml(self) -> str:
        """One flow-mapping line of a fleet file; every string quoted."""
        return (
            f'{{name: "{self.name}", cc: "{self.cc_text}", platform: "{self.platform}", '
            f'driver: "{self.driver}"' + (", required: true" if self.required else "") + "}"
        )


def _scalar_text(item: Item, path: str, problems: Problems, what: str) -> str | None:
    """A string, or a number YAML read from an unquoted one (``cc: 12.1``, ``driver: 580``)."""
    if isinstance(item.value, (int, float)) and not isinstance(item.value, bool):
        return str(item.value)
    return string(item, path, problems, what)


def _cc(item: Item, path: str, problems: Problems) -> Arch | None:
    text = _scalar_text(item, path, problems, 'a compute capability like "12.1"')
    if text is None:
        return None
    try:
        arch = Arch.parse(text)
    except ValueError:
        problems.add(item.mark, path, f'expected a compute capability like "12.1", got {text!r}')
        return None
    if arch.suffix:
        problems.add(
            item.mark,
            path,
            f"{text!r} is an arch spelling, not a GPU's compute capability: write "
            f'"{arch.major}.{arch.minor}" (the arch list follows from the targets)',
        )
        return None
    unknown = archs.known_capability(arch)
    if unknown is not None:
        problems.add(item.mark, path, unknown)
        return None
    return arch


def _one(item: Item, path: str, problems: Problems) -> Target | None:
    if not isinstance(item.value, dict):
        problems.add(
            item.mark, path, f"expected a mapping of {', '.join(KEYS)}, got {kind(item.value)}"
        )
        return None
    fields = item.value
    for key, sub in fields.items():
        if key not in KEYS:
            problems.add(sub.key_mark or sub.mark, f"{path}.{key}", suggest(key, KEYS))
    missing = [k for k in ("name", "cc", "platform", "driver") if k not in fields]
    for key in missing:
        problems.add(item.mark, f"{path}.{key}", "required key is missing")
    name = cc = platform = driver = None
    if "name" in fields:
        name = string(fields["name"], f"{path}.name", problems, "a name")
        if name is not None and not _NAME.fullmatch(name):
            problems.add(
                fields["name"].mark,
                f"{path}.name",
                f"{name!r} is not a target name: letters, digits and '._+-', at most 64",
            )
            name = None
    if "cc" in fields:
        cc = _cc(fields["cc"], f"{path}.cc", problems)
    if "platform" in fields:
        platform = string(fields["platform"], f"{path}.platform", problems, "a platform")
        if platform is not None and platform not in platforms.KNOWN:
            problems.add(
                fields["platform"].mark,
                f"{path}.platform",
                suggest(platform, list(platforms.KNOWN), "platform"),
            )
            platform = None
    if "driver" in fields:
        driver = _scalar_text(fields["driver"], f"{path}.driver", problems, "a driver version")
        if driver is not None and not _DRIVER.fullmatch(driver):
            problems.add(
                fields["driver"].mark,
                f"{path}.driver",
                f'expected a driver version like "580.95.05" or a branch like "580", got {driver!r}',
            )
            driver = None
    required = False
    if "required" in fields:
        value = fields["required"].value
        if not isinstance(value, bool):
            problems.add(
                fields["required"].mark,
                f"{path}.required",
                f"expected true or false, got {kind(value)}",
            )
        else:
            required = value
    if name is None or cc is None or platform is None or driver is None:
        return None
    return Target(name=name, cc=cc, platform=platform, driver=driver, required=required)


def parse(item: Item, path: str, problems: Problems) -> tuple[Target, ...]:
    """A located ``targets:`` list (a spec's or a fleet file's); problems recorded."""
    if not isinstance(item.value, list):
        problems.add(item.mark, path, f"expected a list of targets, got {kind(item.value)}")
        return ()
    out: list[Target] = []
    seen: set[str] = set()
    for i, sub in enumerate(item.value):
        target = _one(sub, f"{path}[{i}]", problems)
        if target is None:
            continue
        if target.name in seen:
            problems.add(sub.mark, f"{path}[{i}].name", f"{target.name!r} is listed twice")
            continue
        seen.add(target.name)
        out.append(target)
    if not item.value:
        problems.add(item.mark, path, "at least one target is needed")
    return tuple(out)


def read_file(path: Path, problems: Problems) -> tuple[Target, ...]:
    """The targets of the fleet file at ``path``; problems recorded (located)."""
    root = compose(path, problems, what="fleet file", max_bytes=MAX_FLEET_BYTES)
    if root is None:
        return ()
    assert isinstance(root.value, dict)
    if not_of_kind(root, FILE_KEYS, "fleet file", problems):
        return ()
    for key, sub in root.value.items():
        if key not in FILE_KEYS:
            problems.add(sub.key_mark or sub.mark, key, suggest(key, FILE_KEYS))
    if "targets" not in root.value:
        problems.add(root.mark, "targets", "required key is missing")
        return ()
    return parse(root.value["targets"], "targets", problems)


def load_file(path: Path) -> tuple[Target, ...]:
    """:func:`read_file`, raising SpecError (exit 2) with every problem."""
    problems = Problems()
    found = read_file(path, problems)
    if problems:
        raise SpecError(problems.messages(), "fleet file")
    return found


def archs_for(targets: Sequence[Target], cuda: CudaVersion) -> tuple[Arch, ...]:
    """The JIT arch list that covers every target, spelled as FlashInfer spells each GPU for
    ``cuda`` (9.0a, 10.0a, 12.0f), except where that spelling would drop another target of the
    same major: an ``a`` target runs on its own capability only, so 10.0 beside 10.3 is the
    family ``10.0f`` where CUDA has families (12.9+), else each minor's own ``a``."""
    by_major: dict[int, list[tuple[int, int]]] = {}
    for t in targets:
        caps = by_major.setdefault(t.cc.major, [])
        if t.capability not in caps:
            caps.append(t.capability)
    out: list[Arch] = []
    for major in sorted(by_major):
        caps = sorted(by_major[major])
        first = archs.normalise(major, caps[0][1], cuda)
        chosen = [first]
        if not all(first.runs_on(c) for c in caps):
            family = Arch(major=major, minor=caps[0][1], suffix="f")
            if archs.min_cuda(family) is not None and cuda >= (archs.min_cuda(family) or cuda):
                chosen = [family]
            else:
                chosen = [archs.normalise(major, c[1], cuda) for c in caps]
        for c in caps:
            if not any(a.runs_on(c) for a in chosen):
                chosen.append(archs.normalise(major, c[1], cuda))
        out += [a for a in chosen if a not in out]
    return tuple(out)


def describe(targets: Iterable[Target]) -> str:
    return ", ".join(t.label for t in targets)


def where(path: Path) -> str:
    return display(path)


# --------------------------------------------------------------------------- this node


def this_node(
    *,
    name: str | None = None,
    cc: str | None = None,
    driver_version: str | None = None,
    required: bool = False,
    platform: str | None = None,
) -> list[Target]:
    """This node's GPU classes (one per distinct compute capability), as fleet targets: its
    GPUs and driver as every other command reads them, or ``cc`` / ``driver_version`` given.
    ``platform``: another platform's class (a DGX Spark's, written from an x86_64 box), whose
    GPU and driver cannot be read here, so ``cc`` and ``driver_version`` must be given.
    UsageError (exit 2) for what cannot be read or is not valid."""
    here = platforms.host_name()
    if platform is not None and platform not in platforms.KNOWN:
        raise UsageError(f"--platform {platform!r}: fleet targets are {', '.join(platforms.KNOWN)}")
    if platform is not None and platform != here and (cc is None or driver_version is None):
        raise UsageError(
            f"--platform {platform}: not this node's ({here}), so its GPU and driver cannot be "
            "read here: give --cc and --driver too"
        )
    platform = platform or here
    if platform not in platforms.KNOWN:
        raise UsageError(f"this node is {platform}: fleet targets are {', '.join(platforms.KNOWN)}")
    if driver_version is None:
        found = driver_mod.current()
        if found is None or found.version is None:
            raise UsageError(
                "no NVIDIA driver version found on this node: give it with --driver VERSION"
            )
        driver_version = found.version
    if not _DRIVER.fullmatch(driver_version):
        raise UsageError(f"--driver {driver_version!r}: expected a version like 580.95.05")
    caps: list[Arch] = []
    if cc is not None:
        try:
            arch = Arch.parse(cc)
        except ValueError as exc:
            raise UsageError(f"--cc {cc!r}: {exc}") from None
        unknown = archs.known_capability(arch)
        if arch.suffix or unknown is not None:
            raise UsageError(f"--cc {cc!r}: {unknown or 'a compute capability, like 12.0'}")
        caps.append(arch)
    else:
        gpus, why = archs.visible_gpus()
        for gpu in gpus:
            if gpu.capability is not None:
                arch = Arch(major=gpu.capability[0], minor=gpu.capability[1])
                if arch not in caps:
                    caps.append(arch)
        if not caps:
            raise UsageError(f"no GPU's compute capability is readable here ({why}): give --cc")
    out: list[Target] = []
    for arch in caps:
        label = name or f"sm{arch.major}{arch.minor}-{platform.removeprefix('linux-')}"
        if name is not None and len(caps) > 1:
            label = f"{name}-sm{arch.major}{arch.minor}"
        if not _NAME.fullmatch(label):
            raise UsageError(f"--name {name!r}: letters, digits and '._+-', at most 64")
        out.append(
            Target(name=label, cc=arch, platform=platform, driver=driver_version, required=required)
        )
    return out


def render_file(found: Sequence[Target]) -> str:
    lines = ["# GPU classes this stack serves (`cudaenv target --out FILE` on a node adds one)"]
    lines.append("targets:")
    lines += [f"  - {t.yaml()}" for t in found]
    return "\n".join(lines) + "\n"


def add_to_file(path: Path, new: Sequence[Target]) -> tuple[list[Target], list[Target]]:
    """``new`` added to the fleet file at ``path`` (made when missing); returns (added, kept):
    a target equal to one there is kept once; one whose name is taken by another class is
    refused (SpecError, naming both)."""
    if path.is_symlink() or (path.exists() and not path.is_file()):
        # A link is never followed: one to /etc/shadow would be read (and its lines echoed as
        # problems), then replaced by a fleet file.
        what = "a symbolic link" if path.is_symlink() else "not a regular file"
        raise UsageError(f"--out {where(path)}: {what}; name the fleet file itself")
    have = list(load_file(path)) if path.exists() else []
    added: list[Target] = []
    kept: list[Target] = []
    problems: list[str] = []
    for t in new:
        same = next((h for h in have if h.name == t.name), None)
        if same is None:
            have.append(t)
            added.append(t)
        elif same == t:
            kept.append(t)
        else:
            problems.append(
                f"{where(path)}: a target named {t.name!r} is already there ({same.label}); "
                f"this node is {t.label}: pick another --name"
            )
    if problems:
        raise SpecError(problems, "fleet file")
    if added:
        proc.atomic_write_text(path, render_file(have))
    return added, kept
