"""Each command's arguments as a typed, frozen dataclass, filled from what the parser
(builder/cli/parser.py) read, field by field (as pypa/build fills its ``_CliArgs``): a handler
reads ``args.env_dir``, never an untyped ``Namespace``. A field's name is its argument's
``dest``; a test holds each dataclass to its command's arguments."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar


@dataclass(frozen=True, kw_only=True)
class Command:
    """What every command's arguments are."""

    def picks_env(self) -> bool:
        """Whether the command may pick an env in the project's .envs/ for the user (the
        CLI then names the project root where it is not the current directory)."""
        return False


C = TypeVar("C", bound=Command)


def fill(kind: type[C], parsed: argparse.Namespace) -> C:
    """``kind`` from the parsed arguments: each field from the ``dest`` of its name, lists
    (``nargs``, ``append``) as tuples, a text as a Path where the field is one."""
    hints = typing.get_type_hints(kind)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(kind):
        value = getattr(parsed, f.name)
        if isinstance(value, str) and hints[f.name] in (Path, Path | None):
            value = Path(value)
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return kind(**values)


@dataclass(frozen=True, kw_only=True)
class LockArgs(Command):
    specs: tuple[Path, ...]
    upgrade: bool
    upgrade_package: tuple[str, ...]
    exclude_newer: str | None


@dataclass(frozen=True, kw_only=True)
class InitArgs(Command):
    with_: tuple[str, ...]
    gpu: tuple[str, ...]
    cuda: str | None
    name: str | None
    out: str | None
    targets: str | None
    exclude_newer: str | None

    def argv(self) -> list[str]:
        """The arguments as given, for the spec's note of the command that wrote it."""
        argv = [f"--with={w}" for w in self.with_] + [f"--gpu={g}" for g in self.gpu]
        named = (("cuda", self.cuda), ("name", self.name), ("out", self.out))
        tail = (("targets", self.targets), ("exclude-newer", self.exclude_newer))
        return argv + [f"--{k}={v}" for k, v in (*named, *tail) if v]


@dataclass(frozen=True, kw_only=True)
class PlanArgs(Command):
    spec: Path
    fresh: bool
    json: bool
    platform: str | None
    targets: Path | None


@dataclass(frozen=True, kw_only=True)
class BuildArgs(Command):
    specs: tuple[Path, ...]
    env_dir: Path | None
    force: bool
    verify: bool
    report: Path | None
    keep_going: bool
    json: bool
    record: Path | None
    relock: bool
    wheelhouse: Path | None
    offline: bool
    platform: str | None
    no_driver_check: bool
    no_target_check: bool

    def picks_env(self) -> bool:
        return self.env_dir is None


@dataclass(frozen=True, kw_only=True)
class ExportArgs(Command):
    spec: Path
    with_jit: bool
    env_dir: Path | None
    platform: str | None
    wheelhouse: Path | None
    pylock: Path | None

    def picks_env(self) -> bool:
        return self.env_dir is None


@dataclass(frozen=True, kw_only=True)
class VerifyArgs(Command):
    spec: Path | None
    python: str | None
    env_dir: Path | None
    checks: str | None
    archs: str | None
    fresh: bool
    keep_going: bool
    report: Path | None
    markdown: Path | None

    def picks_env(self) -> bool:
        return self.env_dir is None and self.python is None


@dataclass(frozen=True, kw_only=True)
class DoctorArgs(Command):
    python: str | None
    archs: str | None
    deep: bool
    json: bool


@dataclass(frozen=True, kw_only=True)
class AdoptArgs(Command):
    python: str
    archs: str | None
    dry_run: bool
    undo: bool
    force: bool
    no_verify: bool
    no_driver_check: bool


@dataclass(frozen=True, kw_only=True)
class ListArgs(Command):
    json: bool


@dataclass(frozen=True, kw_only=True)
class RemoveArgs(Command):
    names: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class RunArgs(Command):
    name: str
    command: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class CompletionArgs(Command):
    shell: str | None
    env_names: bool


@dataclass(frozen=True, kw_only=True)
class FingerprintArgs(Command):
    python: str | None
    json: bool
    compare: tuple[str, ...] | None


@dataclass(frozen=True, kw_only=True)
class AuditArgs(Command):
    spec: Path | None
    python: str | None
    env_dir: Path | None
    archs: str | None
    json: bool
    markdown: Path | None
    no_probe: bool
    targets: Path | None

    def picks_env(self) -> bool:
        return self.env_dir is None and self.python is None


@dataclass(frozen=True, kw_only=True)
class TargetArgs(Command):
    name: str | None
    out: Path | None
    required: bool
    cc: str | None
    driver: str | None
    platform: str | None = None


@dataclass(frozen=True, kw_only=True)
class CompatArgs(Command):
    specs: tuple[Path, ...]
    targets: Path | None
    json: bool
    markdown: Path | None
    html: Path | None


@dataclass(frozen=True, kw_only=True)
class MatrixArgs(Command):
    file: Path
    jobs: int
    fail_fast: bool
    out: Path | None
    baseline: Path | None
    emit: str | None
    cell: str | None

    def picks_env(self) -> bool:
        return True


@dataclass(frozen=True, kw_only=True)
class AddArgs(Command):
    packages: tuple[str, ...]
    spec: str | None
    no_verify: bool


@dataclass(frozen=True, kw_only=True)
class StoreListArgs(Command):
    spec: str | None
    json: bool


@dataclass(frozen=True, kw_only=True)
class WarmArgs(Command):
    spec: str
    archs: tuple[str, ...]
    modules: tuple[str, ...]
    head_dim: tuple[int, ...]
    dtype: tuple[str, ...]
    env_dir: Path | None
    json: bool

    def picks_env(self) -> bool:
        return self.env_dir is None


@dataclass(frozen=True, kw_only=True)
class StoreVerifyArgs(Command):
    pass


@dataclass(frozen=True, kw_only=True)
class StoreGcArgs(Command):
    max: str | None


@dataclass(frozen=True, kw_only=True)
class StorePushArgs(Command):
    spec: str
    env_dir: Path | None

    def picks_env(self) -> bool:
        return self.env_dir is None


@dataclass(frozen=True, kw_only=True)
class StorePullArgs(Command):
    spec: str


@dataclass(frozen=True, kw_only=True)
class ReportMergeArgs(Command):
    reports: tuple[str, ...]
    out: str
    name: str
