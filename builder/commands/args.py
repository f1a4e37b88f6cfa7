"""Each command's arguments as a typed, frozen dataclass: the one declaration of every
argument (its flags, help and how it is read) from which the parser, the help, the shell
completion, the reference docs and a matrix cell's command line are derived
(commands/options.py). A handler reads ``args.env_dir``, never an untyped ``Namespace``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from builder.commands.options import Command, flag, many, option, positional
from builder.core import indexview
from builder.spec import envspec

SPEC_HELP = "a spec file (envspecs/NAME.yaml), or MATRIX.yaml:CELL"
TARGETS_HELP = "a fleet file (targets: [{name, cc, platform, driver}])"
KEEP_GOING_HELP = (
    "run every check even after a cheaper one failed (by default a failed check leaves the "
    "later, costlier stages not run)"
)
# build and adopt refuse (exit 7) a CUDA this machine's driver cannot run; this says go on.
NO_DRIVER_CHECK_HELP = (
    "go on even where this machine's NVIDIA driver is too old for the CUDA (exit 7 otherwise)"
)


def _view_time(text: str) -> str:
    """An ``--exclude-newer`` value, as a lock writes it; argparse's one-line error (exit 2)
    otherwise."""
    try:
        return indexview.canonical(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class LockArgs(Command):
    specs: tuple[Path, ...] = positional(nargs="+", metavar="SPEC", help=SPEC_HELP)
    upgrade: bool = flag(
        "--upgrade", help="resolve afresh instead of preferring the versions of the current lock"
    )
    upgrade_package: tuple[str, ...] = many(
        "--upgrade-package",
        metavar="NAME",
        help="let NAME move to its newest allowed version while every other locked version "
        "is kept (repeatable)",
    )
    exclude_newer: str | None = option(
        "--exclude-newer",
        type=_view_time,
        metavar="TIME",
        help="resolve against the index as it stood at TIME (UTC, like 2026-12-01T05:23:12Z, "
        "or a date: its 00:00 UTC), and record it; default: the view the current lock "
        "records, the index as it is now for a new lock or with --upgrade "
        "(CUDAENV_EXCLUDE_NEWER sets that default)",
    )


@dataclass(frozen=True, kw_only=True)
class InitArgs(Command):
    with_: tuple[str, ...] = many(
        "--with",
        metavar="PKG",
        help="a package to install (PEP 508: vllm==0.33.0, sglang); repeat for more",
    )
    gpu: tuple[str, ...] = many(
        "--gpu",
        metavar="ARCH",
        help="a GPU the env is for: 12.0, 9.0 (spelled as FlashInfer spells it for the chosen "
        "CUDA) or with its suffix, 12.0f; repeat for more (default: this box's GPUs; needed "
        "where none is visible)",
    )
    cuda: str | None = option(
        "--cuda", metavar="X.Y", help="this CUDA only (default: the newest that fits)"
    )
    name: str | None = option(
        "--name", help="the env's name (default: the first package, its version and the CUDA)"
    )
    out: str | None = option(
        "--out", metavar="FILE", help="the spec file to write (default: envspecs/NAME.yaml)"
    )
    targets: str | None = option(
        "--targets", metavar="FILE", help=TARGETS_HELP + "; the spec gets them"
    )
    exclude_newer: str | None = option(
        "--exclude-newer",
        type=_view_time,
        metavar="TIME",
        help="choose from the index as it stood at TIME (as `cudaenv lock --exclude-newer`), "
        "so two boxes agree; default CUDAENV_EXCLUDE_NEWER, else now (init says which)",
    )


@dataclass(frozen=True, kw_only=True)
class PlanArgs(Command):
    spec: Path = positional(metavar="SPEC", help=SPEC_HELP)
    fresh: bool = flag("--fresh", help="resolve even if the lock is up to date")
    json: bool = flag("--json", help="print JSON, for scripts")
    platform: str | None = option(
        "--platform",
        metavar="PLATFORM",
        help="the platform whose packages to show: linux-x86_64 or linux-aarch64 (default: "
        "this machine's)",
    )
    targets: Path | None = option(
        "--targets", metavar="FILE", help=TARGETS_HELP + "; shows each one's verdict"
    )


@dataclass(frozen=True, kw_only=True)
class BuildArgs(Command):
    specs: tuple[Path, ...] = positional(nargs="+", metavar="SPEC", help=SPEC_HELP)
    env_dir: Path | None = option(
        "--env-dir", help="where the env goes (default .envs/NAME); one spec only"
    )
    force: bool = flag("--force", help="rebuild even if the env is up to date")
    verify: bool = flag("--verify", help="run `cudaenv verify` on each env built")
    report: Path | None = option("--report", help="with --verify: write the JSON report here")
    keep_going: bool = flag("--keep-going", help="with --verify: " + KEEP_GOING_HELP)
    json: bool = flag("--json", help="print one JSON object per env (with its verify report)")
    record: Path | None = option(
        "--record",
        help="write a JSON build record here (stage, status, reason, exit code, verify report)",
    )
    relock: bool = flag("--relock", help="re-resolve the lock first when it is stale")
    wheelhouse: Path | None = option(
        "--wheelhouse", help="install only from this directory (made by `cudaenv export`)"
    )
    offline: bool = flag("--offline", help="no network: uv --offline, no Python download")
    platform: str | None = option(
        "--platform",
        metavar="PLATFORM",
        help="assemble the env for another machine (linux-x86_64, linux-aarch64); needs "
        "--env-dir, not --verify",
    )
    no_driver_check: bool = flag("--no-driver-check", help=NO_DRIVER_CHECK_HELP)
    no_target_check: bool = flag(
        "--no-target-check",
        help="build even when a target the spec marks required cannot run the stack",
    )

    @property
    def spec(self) -> str:
        """The spec of a build of one env (commands.build.requests): a path, or
        MATRIX.yaml:CELL."""
        if len(self.specs) != 1:
            raise ValueError(f"one spec expected, not {len(self.specs)}")
        return str(self.specs[0])

    def picks_env(self) -> bool:
        return self.env_dir is None


@dataclass(frozen=True, kw_only=True)
class ExportArgs(Command):
    spec: Path = positional(metavar="SPEC", help=SPEC_HELP)
    with_jit: bool = flag(
        "--with-jit",
        help="also carry the env's compiled JIT results (from its last verify) in the "
        "wheelhouse, so the first verify on an air-gapped machine compiles nothing",
    )
    env_dir: Path | None = option(
        "--env-dir", help="with --with-jit: where the spec's env is (default .envs/NAME)"
    )
    platform: str | None = option(
        "--platform",
        metavar="PLATFORM",
        help="download the files of another machine (linux-aarch64 or linux-x86_64), for "
        "that machine or for `cudaenv build --platform ... --offline --wheelhouse DIR`",
    )
    wheelhouse: Path | None = option(
        "--wheelhouse",
        help="directory to fill (default: an index-neutral lock's own wheelhouse beside it)",
    )
    pylock: Path | None = option(
        "--pylock",
        metavar="FILE",
        help="write a PEP 751 lock with this machine's index URLs (pylock.toml or pylock.NAME.toml)",
    )

    def picks_env(self) -> bool:
        return self.env_dir is None


@dataclass(frozen=True, kw_only=True)
class VerifyArgs(Command):
    spec: Path | None = positional(nargs="?", metavar="SPEC", help=SPEC_HELP)
    python: str | None = option(
        "--python", help="verify this interpreter (or env directory) instead"
    )
    env_dir: Path | None = option("--env-dir", help="where the spec's env is (default .envs/NAME)")
    checks: str | None = option(
        "--checks", help="comma or space separated, of: " + ", ".join(envspec.CHECKS)
    )
    archs: str | None = option(
        "--archs", help='comma or space separated, e.g. "9.0a,12.0f" (default: the env\'s)'
    )
    fresh: bool = flag("--fresh", help="rebuild what a check would reuse")
    keep_going: bool = flag("--keep-going", help=KEEP_GOING_HELP)
    report: Path | None = option("--report", help="write the JSON report here")
    markdown: Path | None = option("--markdown", help="write the Markdown report here")

    def picks_env(self) -> bool:
        return self.env_dir is None and self.python is None


@dataclass(frozen=True, kw_only=True)
class DoctorArgs(Command):
    python: str | None = option(
        "--python",
        help="the interpreter or env directory to diagnose (default: $VIRTUAL_ENV's, else python3)",
    )
    archs: str | None = option(
        "--archs",
        help="the archs the env is for (e.g. 12.0), when this box has not those GPUs: the SM 12.x "
        "rules then apply as on the target",
    )
    deep: bool = flag("--deep", help="also import FlashInfer and torch there")
    json: bool = flag("--json", help="print JSON instead of the report")


@dataclass(frozen=True, kw_only=True)
class AdoptArgs(Command):
    python: str = option("--python", required=True, help="the env's interpreter or directory")
    archs: str | None = option(
        "--archs", help="arch list for the JIT (default: 12.0f plus visible GPUs)"
    )
    dry_run: bool = flag("--dry-run", help="print the plan, change nothing")
    undo: bool = flag("--undo", help="put the env back as before adopt")
    rebuild: str | None = option(
        "--rebuild",
        metavar="PKG[,PKG]",
        help="also build these installed packages again from their sdists with the matched "
        "nvcc (undone by --undo)",
    )
    build_env: tuple[str, ...] = many(
        "--build-env",
        metavar="KEY=VALUE",
        help="a variable for the --rebuild compiles (a package's own switch)",
    )
    force: bool = flag("--force", help="also adopt a system or distro Python")
    no_verify: bool = flag("--no-verify", help="skip the verify that follows")
    no_driver_check: bool = flag("--no-driver-check", help=NO_DRIVER_CHECK_HELP)


@dataclass(frozen=True, kw_only=True)
class ListArgs(Command):
    json: bool = flag("--json", help="print JSON, for scripts")


@dataclass(frozen=True, kw_only=True)
class RemoveArgs(Command):
    names: tuple[str, ...] = positional(
        nargs="+", metavar="NAME", help="an env's name (`cudaenv list`)"
    )


@dataclass(frozen=True, kw_only=True)
class RunArgs(Command):
    name: str = positional(metavar="NAME", help="an env's name (`cudaenv list`)")
    command: tuple[str, ...] = positional(nargs=argparse.REMAINDER, metavar="-- CMD ...", help=None)


@dataclass(frozen=True, kw_only=True)
class CompletionArgs(Command):
    shell: str | None = positional(nargs="?", choices=["bash", "zsh", "fish"], help=None)
    env_names: bool = flag("--env-names", help=argparse.SUPPRESS)


@dataclass(frozen=True, kw_only=True)
class FingerprintArgs(Command):
    python: str | None = option(
        "--python", help="the interpreter or env directory (default: $VIRTUAL_ENV's, else python3)"
    )
    json: bool = flag("--json", help="print the parts as JSON too")
    compare: tuple[str, ...] | None = option(
        "--compare", nargs=2, metavar=("A.json", "B.json"), help="name the differences"
    )


@dataclass(frozen=True, kw_only=True)
class AuditArgs(Command):
    spec: Path | None = positional(nargs="?", metavar="SPEC", help=SPEC_HELP)
    python: str | None = option(
        "--python", help="audit the env of this interpreter (or env directory)"
    )
    env_dir: Path | None = option("--env-dir", help="where the spec's env is (default .envs/NAME)")
    archs: str | None = option(
        "--archs",
        help='target archs, e.g. "12.1f,9.0a" (default: the env\'s list, else each visible GPU)',
    )
    json: bool = flag("--json", help="print JSON, for scripts")
    markdown: Path | None = option(
        "--markdown", metavar="FILE", help="also write a Markdown report here"
    )
    no_probe: bool = flag("--no-probe", help="do not import the stack to read what it maps")
    targets: Path | None = option(
        "--targets",
        metavar="FILE",
        help=TARGETS_HELP + ": judge each from the lock's wheels of its platform (no env needed)",
    )

    def picks_env(self) -> bool:
        return self.env_dir is None and self.python is None


@dataclass(frozen=True, kw_only=True)
class TargetArgs(Command):
    name: str | None = option(
        "--name", help="the class's name (default: from the GPU and platform)"
    )
    out: Path | None = option(
        "--out", metavar="FILE", help="add to this fleet file instead of printing"
    )
    required: bool = flag("--required", help="mark the class required")
    cc: str | None = option(
        "--cc", help='the compute capability, e.g. "12.0" (default: the GPUs\')'
    )
    driver: str | None = option(
        "--driver", help='the driver version, e.g. "580.95.05" (default: found)'
    )
    platform: str | None = option(
        "--platform",
        help='the platform, e.g. "linux-aarch64" for a DGX Spark class written from an x86_64 '
        "box (default: this node's; needs --cc and --driver when it is not this node's)",
    )


@dataclass(frozen=True, kw_only=True)
class CompatArgs(Command):
    specs: tuple[Path, ...] = positional(nargs="+", metavar="SPEC", help="specs or matrix files")
    targets: Path | None = option(
        "--targets", metavar="FILE", help=TARGETS_HELP + " (default: common classes)"
    )
    json: bool = flag("--json", help="print JSON, for scripts")
    markdown: Path | None = option(
        "--markdown", metavar="FILE", help="also write the table as Markdown here"
    )
    html: Path | None = option(
        "--html", metavar="FILE", help="also write a self-contained HTML page here"
    )


@dataclass(frozen=True, kw_only=True)
class MatrixArgs(Command):
    file: Path = positional(metavar="FILE", help="a matrix file (envspecs/matrix/NAME.yaml)")
    jobs: int = option("-j", "--jobs", type=int, default=2, help="cells at once (default 2)")
    fail_fast: bool = flag("--fail-fast", help="stop starting cells after a failure")
    out: Path | None = option("--out", help="report directory (default .envs/.matrix/NAME/report)")
    baseline: Path | None = option(
        "--baseline", help="an earlier matrix.json: exit non-zero for regressions only"
    )
    emit: str | None = option(
        "--emit", choices=["github"], help="print a GitHub Actions strategy.matrix"
    )
    cell: str | None = option(
        "--cell",
        metavar="NAME",
        help="run only this cell, judged as in the whole matrix (one CI job per cell)",
    )

    def picks_env(self) -> bool:
        return True


@dataclass(frozen=True, kw_only=True)
class AddArgs(Command):
    packages: tuple[str, ...] = positional(nargs="+", metavar="PKG", help="PEP 508 requirements")
    spec: str | None = option("--spec", help="the spec to add to (default envspecs/default.yaml)")
    no_verify: bool = flag("--no-verify", help="lock and rebuild, skip the verify")


@dataclass(frozen=True, kw_only=True)
class StoreListArgs(Command):
    spec: str | None = positional(
        nargs="?", metavar="SPEC", help="only what this spec's env would get"
    )
    json: bool = flag("--json", help="print JSON, for scripts")


@dataclass(frozen=True, kw_only=True)
class WarmArgs(Command):
    spec: str = positional(metavar="SPEC", help=SPEC_HELP)
    archs: tuple[str, ...] = many(
        "--archs",
        metavar="A,B",
        help="an arch list to warm (repeat for several; default: the spec's archs)",
    )
    modules: tuple[str, ...] = many(
        "--modules",
        nargs="+",
        action="extend",
        metavar="PATTERN",
        help="only modules whose FlashInfer name (or packages, compiled from their sdists, "
        "whose name) matches one of these fnmatch patterns",
    )
    head_dim: tuple[int, ...] = many(
        "--head-dim",
        type=int,
        metavar="N",
        help="attention head dim (repeat for several; default 128)",
    )
    dtype: tuple[str, ...] = many(
        "--dtype",
        choices=("bf16", "fp16"),
        help="attention dtype (repeat for several; default bf16)",
    )
    env_dir: Path | None = option("--env-dir", help="the env (default .envs/NAME)")
    json: bool = flag("--json", help="print JSON, for scripts")

    def picks_env(self) -> bool:
        return self.env_dir is None


@dataclass(frozen=True, kw_only=True)
class StoreVerifyArgs(Command):
    pass


@dataclass(frozen=True, kw_only=True)
class StoreGcArgs(Command):
    max: str | None = option(
        "--max", metavar="SIZE", help="the size to trim to, like 5G or 500M (default: the cap)"
    )


@dataclass(frozen=True, kw_only=True)
class StorePushArgs(Command):
    spec: str = positional(metavar="SPEC", help=SPEC_HELP)
    env_dir: Path | None = option("--env-dir", help="the env (default .envs/NAME)")

    def picks_env(self) -> bool:
        return self.env_dir is None


@dataclass(frozen=True, kw_only=True)
class StorePullArgs(Command):
    spec: str = positional(metavar="SPEC", help=SPEC_HELP)


@dataclass(frozen=True, kw_only=True)
class ReportMergeArgs(Command):
    reports: tuple[str, ...] = positional(nargs="+", metavar="REPORT", help=None)
    out: str = option("--out", default="merged-report", help="directory for the merged reports")
    name: str = option("--name", default="merged", help=None)
