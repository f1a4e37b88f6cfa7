"""The command table: every command, its help and its arguments (argparse).

Kept apart from cli.py, which holds what each command does: the table is read by the CLI,
by `cudaenv completion` and by the reference docs, and none of them needs the handlers.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from builder import __version__
from builder.commands import args as commandargs
from builder.commands.args import Command
from builder.core import errors, indexview
from builder.spec import envspec as spec

DESCRIPTION = """\
cudaenv puts a matched CUDA toolchain next to torch, FlashInfer and sglang in an isolated
venv, from one declarative spec file, and proves it works by compiling and running real
kernels.

SPEC is a spec file (envspecs/NAME.yaml): the torch / CUDA / FlashInfer / sglang combination,
the Python, the toolkit components and the GPU archs. Wherever a SPEC is taken, FILE:CELL
names one cell of a matrix file instead (envspecs/matrix/release.yaml:sm12.0f), as CI
runners get it from `cudaenv matrix FILE --emit github`.

"""


# build and adopt refuse (exit 7) a CUDA this machine's driver cannot run; this says go on.
NO_DRIVER_CHECK_HELP = (
    "go on even where this machine's NVIDIA driver is too old for the CUDA (exit 7 otherwise)"
)


class Parser(argparse.ArgumentParser):
    """argparse, with cudaenv's errors: one ``error:`` line (after the usage of the command it
    concerns), and an empty value refused wherever it is given."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {self.prog}: {message}\n")

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        # Every value goes through here. An empty one is a mistake wherever it is given
        # (`lock ""` would read the current directory as a spec, `--checks ""` run every
        # check, `--python ""` diagnose python3), except in `run`'s command, which is the
        # command's own, and in what a subcommand gets (PARSER), which it checks itself.
        exempt = (argparse.REMAINDER, argparse.PARSER)
        if not arg_string.strip() and action.nargs not in exempt:
            raise argparse.ArgumentError(action, "must not be empty")
        return super()._get_value(action, arg_string)


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command parser that ``args`` ran: ``cudaenv store gc`` -> store gc's."""
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if isinstance(name, str) and name in action.choices:
                return _chosen(action.choices[name], args)
    return parser


@dataclass(frozen=True, kw_only=True)
class Parsed:
    """A command line, read: the command's arguments and the options every command takes."""

    args: Command
    debug: bool
    quiet: bool


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> Parsed:
    """``parser.parse_args(argv)``, typed, except that an argument nothing takes is reported
    by the command it was given to, with that command's usage: argparse hands a subcommand's
    unknown arguments up to the top-level parser, which would show the top-level usage."""
    _known_command(parser, sys.argv[1:] if argv is None else argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        _chosen(parser, args).error(f"unrecognized arguments: {' '.join(extras)}")
    # --debug and --quiet are absent where given neither before nor after the subcommand
    # (each subcommand's copy is SUPPRESS, so that it keeps a value given before it).
    return Parsed(
        args=commandargs.fill(args.args_type, args),
        debug=bool(getattr(args, "debug", False)),
        quiet=bool(getattr(args, "quiet", False)),
    )


def _known_command(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """A command nothing is named is refused with the closest one (argparse lists all of
    them, and only Python 3.14's suggests one)."""
    commands = next(
        (a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None
    )
    given = next((a for a in argv if not a.startswith("-")), None)
    if not commands or given is None or given in commands:
        return
    close = difflib.get_close_matches(given, list(commands), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else "see `cudaenv --help` for the commands"
    parser.error(f"unknown command {given!r}: {hint}")


def _view_time(text: str) -> str:
    """An ``--exclude-newer`` value, as a lock writes it; argparse's one-line error (exit 2)
    otherwise."""
    try:
        return indexview.canonical(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def _sub(
    sub: argparse._SubParsersAction[Parser],
    name: str,
    summary: str,
    description: str,
    example: str,
) -> Parser:
    p = sub.add_parser(
        name,
        help=summary,
        description=f"{description}\n\nexample:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Accepted after the subcommand too (`cudaenv build --debug SPEC`); SUPPRESS keeps a value
    # given before the subcommand.
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    p.add_argument(
        "--quiet", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    return p


SPEC_HELP = "a spec file (envspecs/NAME.yaml), or MATRIX.yaml:CELL"
TARGETS_HELP = "a fleet file (targets: [{name, cc, platform, driver}])"
KEEP_GOING_HELP = (
    "run every check even after a cheaper one failed (by default a failed check leaves the "
    "later, costlier stages not run)"
)


def make_parser() -> argparse.ArgumentParser:
    """Every command and its arguments; each command sets ``args_type``, the dataclass of its
    arguments (builder/commands/args.py), which cli.py maps to its handler."""
    p = Parser(
        prog="cudaenv",
        description=DESCRIPTION + "\n" + textwrap.fill("Exit codes: " + errors.exit_summary(), 94),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"cudaenv {__version__}")
    p.add_argument("--debug", action="store_true", help="log every command; tracebacks on errors")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr (CI logs)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    lk = _sub(
        sub,
        "lock",
        "resolve specs and write their PEP 751 locks",
        "Resolve each spec with uv under the matching policy (torch's CUDA = the spec's, every "
        "toolkit component of that CUDA minor, one CUDA major, FlashInfer companions matched) "
        "and write locks/pylock.NAME.toml beside it (dots in NAME become '-'): file URLs, or "
        'wheelhouse paths where pyproject.toml says [tool.cudaenv] locks = "index-neutral". '
        "A set the policy refuses exits 3.",
        "cudaenv lock envspecs/default.yaml",
    )
    lk.add_argument("specs", nargs="+", type=Path, metavar="SPEC", help=SPEC_HELP)
    lk.add_argument(
        "--upgrade",
        action="store_true",
        help="resolve afresh instead of preferring the versions of the current lock",
    )
    lk.add_argument(
        "--upgrade-package",
        action="append",
        default=[],
        metavar="NAME",
        help="let NAME move to its newest allowed version while every other locked version "
        "is kept (repeatable)",
    )
    lk.add_argument(
        "--exclude-newer",
        type=_view_time,
        metavar="TIME",
        help="resolve against the index as it stood at TIME (UTC, like 2026-12-01T05:23:12Z, "
        "or a date: its 00:00 UTC), and record it; default: the view the current lock "
        "records, the index as it is now for a new lock or with --upgrade "
        "(CUDAENV_EXCLUDE_NEWER sets that default)",
    )
    lk.set_defaults(args_type=commandargs.LockArgs)

    it = _sub(
        sub,
        "init",
        "set up a new box: detect it, choose the CUDA, write and lock a spec",
        "Read this box's platform, glibc, GPUs (their archs), NVIDIA driver and installed CUDA "
        "toolkits, then choose the newest CUDA that the driver runs, that torch has wheels for "
        "and that the asked packages accept: each candidate (13.2, 13.0, 12.8; CUDA 12 only "
        "with a CUDA 12 toolkit installed, PyPI has no CUDA 12 nvcc) is resolved by uv for this "
        "platform, and each one tried is printed with why it was refused. The spec is written "
        "with exact pins (torch as uv chose it, following any package that pins it) and the "
        "archs, locked, and its plan printed. A box without a GPU needs --gpu (exit 2); a file "
        "that exists is never overwritten (exit 2); an unknown package or a set no CUDA holds "
        "exits 3 with uv's reason, and nothing is written.",
        "cudaenv init --with vllm==0.33.0 --gpu 12.0",
    )
    it.add_argument(
        "--with",
        dest="with_",
        action="append",
        default=[],
        metavar="PKG",
        help="a package to install (PEP 508: vllm==0.33.0, sglang); repeat for more",
    )
    it.add_argument(
        "--gpu",
        action="append",
        default=[],
        metavar="ARCH",
        help="a GPU the env is for: 12.0, 9.0 (spelled as FlashInfer spells it for the chosen "
        "CUDA) or with its suffix, 12.0f; repeat for more (default: this box's GPUs; needed "
        "where none is visible)",
    )
    it.add_argument("--cuda", metavar="X.Y", help="this CUDA only (default: the newest that fits)")
    it.add_argument(
        "--name", help="the env's name (default: the first package, its version and the CUDA)"
    )
    it.add_argument(
        "--out", metavar="FILE", help="the spec file to write (default: envspecs/NAME.yaml)"
    )
    it.add_argument("--targets", metavar="FILE", help=TARGETS_HELP + "; the spec gets them")
    it.add_argument(
        "--exclude-newer",
        type=_view_time,
        metavar="TIME",
        help="choose from the index as it stood at TIME (as `cudaenv lock --exclude-newer`), "
        "so two boxes agree; default CUDAENV_EXCLUDE_NEWER, else now (init says which)",
    )
    it.set_defaults(args_type=commandargs.InitArgs)

    pl = _sub(
        sub,
        "plan",
        "print what a spec resolves to, without installing",
        "Show the versions the spec's lock (or a fresh resolution) installs: torch and its "
        "CUDA, the toolkit pin, the NVIDIA wheels, FlashInfer, sglang. Nothing is installed.",
        "cudaenv plan envspecs/default.yaml",
    )
    pl.add_argument("spec", type=Path, metavar="SPEC", help=SPEC_HELP)
    pl.add_argument("--fresh", action="store_true", help="resolve even if the lock is up to date")
    pl.add_argument("--json", action="store_true", help="print JSON, for scripts")
    pl.add_argument(
        "--platform",
        metavar="PLATFORM",
        help="the platform whose packages to show: linux-x86_64 or linux-aarch64 (default: "
        "this machine's)",
    )
    pl.add_argument("--targets", metavar="FILE", help=TARGETS_HELP + "; shows each one's verdict")
    pl.set_defaults(args_type=commandargs.PlanArgs)

    bd = _sub(
        sub,
        "build",
        "build the env of each spec from its lock",
        "Install the spec's lock (hash-checked) into a venv built beside .envs/NAME and swapped "
        "in whole when complete, then wire cuda-home/ and the start-up hook. A failed or "
        "interrupted build leaves the previous env intact. A missing lock is resolved first. "
        "--platform linux-aarch64 on an x86_64 machine (or the reverse) assembles that "
        "machine's env without running any of it: its wheels unpacked hash-checked, cuda-home/ "
        "and the hook, each compiler binary checked to be that machine's. Before anything is "
        "resolved or built, a spec whose CUDA this machine's NVIDIA driver cannot run is "
        "refused (exit 7; a machine without a driver builds).",
        "cudaenv build --verify envspecs/default.yaml",
    )
    bd.add_argument("specs", nargs="+", type=Path, metavar="SPEC", help=SPEC_HELP)
    bd.add_argument("--env-dir", help="where the env goes (default .envs/NAME); one spec only")
    bd.add_argument("--force", action="store_true", help="rebuild even if the env is up to date")
    bd.add_argument("--verify", action="store_true", help="run `cudaenv verify` on each env built")
    bd.add_argument("--report", help="with --verify: write the JSON report here")
    bd.add_argument("--keep-going", action="store_true", help="with --verify: " + KEEP_GOING_HELP)
    bd.add_argument(
        "--json", action="store_true", help="print one JSON object per env (with its verify report)"
    )
    bd.add_argument(
        "--record",
        help="write a JSON build record here (stage, status, reason, exit code, verify report)",
    )
    bd.add_argument(
        "--relock", action="store_true", help="re-resolve the lock first when it is stale"
    )
    bd.add_argument(
        "--wheelhouse", help="install only from this directory (made by `cudaenv export`)"
    )
    bd.add_argument(
        "--offline", action="store_true", help="no network: uv --offline, no Python download"
    )
    bd.add_argument(
        "--platform",
        metavar="PLATFORM",
        help="assemble the env for another machine (linux-x86_64, linux-aarch64); needs "
        "--env-dir, not --verify",
    )
    bd.add_argument("--no-driver-check", action="store_true", help=NO_DRIVER_CHECK_HELP)
    bd.add_argument(
        "--no-target-check",
        action="store_true",
        help="build even when a target the spec marks required cannot run the stack",
    )
    bd.set_defaults(args_type=commandargs.BuildArgs)

    ex = _sub(
        sub,
        "export",
        "download every locked file (hash-checked), or write a lock with this index's URLs",
        "Fill a wheelhouse with every file of the spec's lock, each sha256 checked, for "
        "`cudaenv build --offline --wheelhouse DIR` on a machine without an index; without "
        "--wheelhouse, the wheelhouse an index-neutral lock names beside it, so `uv pip install "
        "-r` and `pip install -r` of the lock work. --pylock FILE writes a standard PEP 751 lock "
        "of the same files with their URLs on the index this machine's uv is configured with; "
        "a file the index serves with another hash is refused.",
        "cudaenv export envspecs/default.yaml --wheelhouse /srv/wheels",
    )
    ex.add_argument(
        "--with-jit",
        action="store_true",
        help="also carry the env's compiled JIT results (from its last verify) in the "
        "wheelhouse, so the first verify on an air-gapped machine compiles nothing",
    )
    ex.add_argument(
        "--env-dir", help="with --with-jit: where the spec's env is (default .envs/NAME)"
    )
    ex.add_argument(
        "--platform",
        metavar="PLATFORM",
        help="download the files of another machine (linux-aarch64 or linux-x86_64), for "
        "that machine or for `cudaenv build --platform ... --offline --wheelhouse DIR`",
    )
    ex.add_argument("spec", type=Path, metavar="SPEC", help=SPEC_HELP)
    ex.add_argument(
        "--wheelhouse",
        help="directory to fill (default: an index-neutral lock's own wheelhouse beside it)",
    )
    ex.add_argument(
        "--pylock",
        metavar="FILE",
        help="write a PEP 751 lock with this machine's index URLs (pylock.toml or pylock.NAME.toml)",
    )
    ex.set_defaults(args_type=commandargs.ExportArgs)

    vf = _sub(
        sub,
        "verify",
        "prove an env works: compile and run real kernels",
        "Run the checks (" + ", ".join(spec.CHECKS) + ") on a spec's built env, or on any "
        "interpreter with --python, cheapest first: those that read the env, then those that "
        "compile (FlashInfer's JIT), then those that need a GPU. A failed check leaves the later "
        "stages not run (skipped, 'not run: X failed') unless --keep-going. A check that cannot "
        "run here (no GPU) says skipped with the reason. A failed check exits 5; a missing "
        "tool 6.",
        "cudaenv verify envspecs/default.yaml --checks toolchain,kernel-compile",
    )
    vf.add_argument("spec", nargs="?", type=Path, metavar="SPEC", help=SPEC_HELP)
    vf.add_argument("--python", help="verify this interpreter (or env directory) instead")
    vf.add_argument("--env-dir", help="where the spec's env is (default .envs/NAME)")
    vf.add_argument("--checks", help="comma or space separated, of: " + ", ".join(spec.CHECKS))
    vf.add_argument(
        "--archs", help='comma or space separated, e.g. "9.0a,12.0f" (default: the env\'s)'
    )
    vf.add_argument("--fresh", action="store_true", help="rebuild what a check would reuse")
    vf.add_argument("--keep-going", action="store_true", help=KEEP_GOING_HELP)
    vf.add_argument("--report", help="write the JSON report here")
    vf.add_argument("--markdown", help="write the Markdown report here")
    vf.set_defaults(args_type=commandargs.VerifyArgs)

    dr = _sub(
        sub,
        "doctor",
        "find the root cause of a split CUDA toolchain in any env",
        "Probe an interpreter (a venv, conda env or system Python; no import of torch unless "
        "--deep) and name what is wrong first: a JIT nvcc that is not torch's CUDA, mixed "
        "toolkit minors, a stale JIT cache, a missing host compiler, ... with the fix. Exits 1 "
        "when it finds an error.",
        "cudaenv doctor --python .venv/bin/python",
    )
    dr.add_argument(
        "--python",
        help="the interpreter or env directory to diagnose (default: $VIRTUAL_ENV's, else python3)",
    )
    dr.add_argument(
        "--archs",
        help="the archs the env is for (e.g. 12.0), when this box has not those GPUs: the SM 12.x "
        "rules then apply as on the target",
    )
    dr.add_argument("--deep", action="store_true", help="also import FlashInfer and torch there")
    dr.add_argument("--json", action="store_true", help="print JSON instead of the report")
    dr.set_defaults(args_type=commandargs.DoctorArgs)

    ad = _sub(
        sub,
        "adopt",
        "give an existing venv or conda env the toolchain its torch is built for",
        "Read torch's CUDA from the env itself, install the matching toolkit components there "
        "with uv (realigning drifted ones), add the cuda-home/ overlay, the start-up hook, the "
        "activate block and the env's own JIT caches, then verify. Every change is journalled: "
        "--undo restores the same distributions and versions and removes every cudaenv file; "
        "an interrupted adopt is undone, and a rerun finishes from where the env was. Refuses "
        "(exit 3, nothing changed) a CPU-only or missing torch, a CUDA 12 torch without its "
        "toolkit on the machine, a system Python (unless --force), and a set uv cannot "
        "resolve without breaking the env's own pins; exits 7 where this machine's NVIDIA "
        "driver cannot run torch's CUDA.",
        "cudaenv adopt --python .venv/bin/python --dry-run",
    )
    ad.add_argument("--python", required=True, help="the env's interpreter or directory")
    ad.add_argument("--archs", help="arch list for the JIT (default: 12.0f plus visible GPUs)")
    ad.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    ad.add_argument("--undo", action="store_true", help="put the env back as before adopt")
    ad.add_argument("--force", action="store_true", help="also adopt a system or distro Python")
    ad.add_argument("--no-verify", action="store_true", help="skip the verify that follows")
    ad.add_argument("--no-driver-check", action="store_true", help=NO_DRIVER_CHECK_HELP)
    ad.set_defaults(args_type=commandargs.AdoptArgs)

    ls = _sub(
        sub,
        "list",
        "the envs built here",
        "Each env under .envs/: its spec, whether it matches the spec's current lock, its size "
        "on disk (and how much of it no other env or uv's cache shares), its last verify.",
        "cudaenv list --json",
    )
    ls.add_argument("--json", action="store_true", help="print JSON, for scripts")
    ls.set_defaults(args_type=commandargs.ListArgs)

    rm_ = _sub(
        sub,
        "remove",
        "delete built envs",
        "Delete each named env whole, with what killed builds of it left and its lock file; a "
        "build of it in progress is waited for. NAME is an env's name in the project's .envs/ "
        "(as `cudaenv list` shows it), never a path: anything else is refused (exit 2). Where "
        ".envs/NAME is a link, the link is removed, not what it points to.",
        "cudaenv remove sglang-0.5.23-cu130",
    )
    rm_.add_argument("names", nargs="+", metavar="NAME", help="an env's name (`cudaenv list`)")
    rm_.set_defaults(args_type=commandargs.RemoveArgs)

    rn = _sub(
        sub,
        "run",
        "run a command in an env without activating it",
        "Run CMD with the env's bin/ first on PATH and every setting of its start-up hook "
        "(CUDA_HOME, arch lists, JIT caches, ...), exactly as its own python sees them; the "
        "exit status is the command's, or, as a shell's, 127 where CMD is not found and 126 "
        "where it cannot be run. NAME is an env's name in the project's .envs/, never a path.",
        "cudaenv run sglang-0.5.23-cu130 -- nvcc --version",
    )
    rn.add_argument("name", metavar="NAME", help="an env's name (`cudaenv list`)")
    rn.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    rn.set_defaults(args_type=commandargs.RunArgs)

    co = _sub(
        sub,
        "completion",
        "print shell completion for bash, zsh or fish",
        "Print a completion script for cudaenv's commands and options. bash: add "
        "`source <(cudaenv completion bash)` to ~/.bashrc; zsh: the same with zsh in ~/.zshrc; "
        "fish: `cudaenv completion fish > ~/.config/fish/completions/cudaenv.fish`.",
        "cudaenv completion bash",
    )
    co.add_argument("shell", nargs="?", choices=["bash", "zsh", "fish"])
    # What the scripts call to complete `run` and `remove`: the names of the envs built here.
    co.add_argument("--env-names", action="store_true", help=argparse.SUPPRESS)
    co.set_defaults(args_type=commandargs.CompletionArgs)

    fp = _sub(
        sub,
        "fingerprint",
        "one hash of what decides JIT results and kernel behaviour in an env",
        "Print one hash over the env's installed distributions and versions, the toolkit its "
        "JIT uses (release and the content of nvcc, cicc, ptxas, ...), the host compiler, the "
        "arch lists and the variables that change a compile; the env's own path does not "
        "count. Run it on every node of a deployment: equal hashes, equal compiles. "
        "--compare A.json B.json (two `--json` outputs) names each difference and exits 1 "
        "when there is one.",
        "cudaenv fingerprint --python .venv/bin/python --json > node1.json",
    )
    fp.add_argument(
        "--python",
        help="the interpreter or env directory (default: $VIRTUAL_ENV's, else python3)",
    )
    fp.add_argument("--json", action="store_true", help="print the parts as JSON too")
    fp.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="name the differences")
    fp.set_defaults(args_type=commandargs.FingerprintArgs)

    au = _sub(
        sub,
        "audit",
        "can every prebuilt CUDA binary of an env run on the target GPUs?",
        "Read the SASS and PTX of every binary in the env (site-packages, cuda-home/, its JIT "
        "caches) and judge each target arch: runs, runs through the driver's PTX JIT, or has "
        "no code. The binaries the stack loads on that arch (torch's libraries, sgl_kernel's "
        "common ops as its loader picks them, vLLM's extensions, and what they link) are "
        "required: one without code fails, naming package, file, what it holds and the arch. "
        "Also lists the CUDA libraries linked by major, and imports the stack in the env to "
        "read what one process maps (two majors of one library fail). Exits 5 on a failure.",
        "cudaenv audit envspecs/default.yaml --archs 12.1f",
    )
    au.add_argument("spec", nargs="?", type=Path, metavar="SPEC", help=SPEC_HELP)
    au.add_argument("--python", help="audit the env of this interpreter (or env directory)")
    au.add_argument("--env-dir", help="where the spec's env is (default .envs/NAME)")
    au.add_argument(
        "--archs",
        help='target archs, e.g. "12.1f,9.0a" (default: the env\'s list, else each visible GPU)',
    )
    au.add_argument("--json", action="store_true", help="print JSON, for scripts")
    au.add_argument("--markdown", metavar="FILE", help="also write a Markdown report here")
    au.add_argument(
        "--no-probe", action="store_true", help="do not import the stack to read what it maps"
    )
    au.add_argument(
        "--targets",
        metavar="FILE",
        help=TARGETS_HELP + ": judge each from the lock's wheels of its platform (no env needed)",
    )
    au.set_defaults(args_type=commandargs.AuditArgs)

    tg = _sub(
        sub,
        "target",
        "write this node's GPU class into a fleet file",
        "Read this node's GPUs (their compute capabilities), NVIDIA driver and platform, and "
        "print each distinct GPU class as a fleet-file target, or add it to --out FILE (made "
        "when missing; a class already there is kept once). Run it on one node of each class "
        "and the fleet file is collected, not typed. --cc and --driver say what a node without "
        "nvidia-smi has.",
        "cudaenv target --name rtx-pro-6000 --out envspecs/fleet.yaml",
    )
    tg.add_argument("--name", help="the class's name (default: from the GPU and platform)")
    tg.add_argument("--out", metavar="FILE", help="add to this fleet file instead of printing")
    tg.add_argument("--required", action="store_true", help="mark the class required")
    tg.add_argument("--cc", help='the compute capability, e.g. "12.0" (default: the GPUs\')')
    tg.add_argument("--driver", help='the driver version, e.g. "580.95.05" (default: found)')
    tg.add_argument(
        "--platform",
        help='the platform, e.g. "linux-aarch64" for a DGX Spark class written from an x86_64 '
        "box (default: this node's; needs --cc and --driver when it is not this node's)",
    )
    tg.set_defaults(args_type=commandargs.TargetArgs)

    cp = _sub(
        sub,
        "compat",
        "which stacks run on which GPU classes: a compatibility table",
        "Judge each stack (a spec, or every cell of a matrix file) for each target from its "
        "lock's wheels, as `audit --targets` does, and print a table: stacks as rows, GPU "
        "class x platform x driver as columns, each cell a verdict with its evidence. Without "
        "--targets, the common classes: 7.5 to 12.1 on both platforms, on a 570 and a 580 "
        "driver. Exits 0 whatever the verdicts (a table, not a gate).",
        "cudaenv compat envspecs/default.yaml envspecs/vllm-0.33-cu130.yaml --markdown c.md",
    )
    cp.add_argument("specs", nargs="+", type=Path, metavar="SPEC", help="specs or matrix files")
    cp.add_argument("--targets", metavar="FILE", help=TARGETS_HELP + " (default: common classes)")
    cp.add_argument("--json", action="store_true", help="print JSON, for scripts")
    cp.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown here")
    cp.add_argument("--html", metavar="FILE", help="also write a self-contained HTML page here")
    cp.set_defaults(args_type=commandargs.CompatArgs)

    mx = _sub(
        sub,
        "matrix",
        "build and verify every cell of a matrix file",
        "Expand a matrix file (specs: or base: + axes:) into cells, build and verify each, -j at "
        "a time, and write matrix.json, matrix.html, matrix.md and junit.xml. A cell the policy "
        "refuses is shown as refused; a failing cell never stops the others.",
        "cudaenv matrix envspecs/matrix/release.yaml -j 2 --baseline old/matrix.json",
    )
    mx.add_argument("file", metavar="FILE", help="a matrix file (envspecs/matrix/NAME.yaml)")
    mx.add_argument("-j", "--jobs", type=int, default=2, help="cells at once (default 2)")
    mx.add_argument("--fail-fast", action="store_true", help="stop starting cells after a failure")
    mx.add_argument("--out", help="report directory (default .envs/.matrix/NAME/report)")
    mx.add_argument("--baseline", help="an earlier matrix.json: exit non-zero for regressions only")
    mx.add_argument("--emit", choices=["github"], help="print a GitHub Actions strategy.matrix")
    mx.add_argument(
        "--cell",
        metavar="NAME",
        help="run only this cell, judged as in the whole matrix (one CI job per cell)",
    )
    mx.set_defaults(args_type=commandargs.MatrixArgs)

    ad_ = _sub(
        sub,
        "add",
        "add packages to a spec, then lock, rebuild and verify its env",
        "Put each requirement into the spec's packages: (the file's comments and layout kept; a "
        "package listed already gets the new requirement), lock it (the current versions "
        "preferred), rebuild the env from the new lock and verify it. A resolve or build that "
        "fails leaves the spec, its lock and the env as they were.",
        "cudaenv add 'transformers>=4.57' --spec envspecs/default.yaml",
    )
    ad_.add_argument("packages", nargs="+", metavar="PKG", help="PEP 508 requirements")
    ad_.add_argument("--spec", help="the spec to add to (default envspecs/default.yaml)")
    ad_.add_argument("--no-verify", action="store_true", help="lock and rebuild, skip the verify")
    ad_.set_defaults(args_type=commandargs.AddArgs)

    st = _sub(
        sub,
        "store",
        "the JIT store: list, check, trim, share",
        "The machine-wide store of compiled JIT results (FlashInfer's modules, the top-k/top-p "
        "kernel), keyed by what made them and checked by sha256 each time one is placed. "
        "CUDAENV_JIT_STORE moves it, CUDAENV_JIT_STORE_MAX caps it (default 10G), "
        "CUDAENV_JIT_REMOTE=oci://HOST/REPO shares it through a registry.",
        "cudaenv store gc --max 5G",
    )
    ssub = st.add_subparsers(dest="store_command", required=True, metavar="COMMAND")
    sl = _sub(
        ssub,
        "list",
        "every entry: key, kind, size, last use, where it was made",
        "Every entry of the store, least recently used first, and the total against the cap. "
        "With SPEC, the FlashInfer modules that spec's env would get: those of its lock's "
        "FlashInfer version, CUDA release, archs and machine (a build places each whose key, "
        "computed in the env, is equal).",
        "cudaenv store list envspecs/default.yaml",
    )
    sl.add_argument("spec", nargs="?", metavar="SPEC", help="only what this spec's env would get")
    sl.add_argument("--json", action="store_true", help="print JSON, for scripts")
    sl.set_defaults(args_type=commandargs.StoreListArgs)
    sv = _sub(
        ssub,
        "verify",
        "check every entry's files against their recorded sha256",
        "Read every entry and hash every file; an entry that differs from its record is "
        "discarded (it is compiled again where it is next needed). Exit 5 when one was.",
        "cudaenv store verify",
    )
    sv.set_defaults(args_type=commandargs.StoreVerifyArgs)
    sg = _sub(
        ssub,
        "gc",
        "trim the store to its cap, least recently used first",
        "Remove entries of older store formats, what interrupted builds left, unused locks, "
        "then the least recently used entries until the store is under --max.",
        "cudaenv store gc --max 5G",
    )
    sg.add_argument(
        "--max", metavar="SIZE", help="the size to trim to, like 5G or 500M (default: the cap)"
    )
    sg.set_defaults(args_type=commandargs.StoreGcArgs)
    sp = _sub(
        ssub,
        "push",
        "push the entries an env's verify used to the JIT remote",
        "What a CI warmer runs after `cudaenv build SPEC --verify`: every store entry the env "
        "used, and the list of their keys tagged by the spec's lock, go to CUDAENV_JIT_REMOTE.",
        "CUDAENV_JIT_REMOTE=oci://registry.example:5000/cudaenv/jit cudaenv store push "
        "envspecs/default.yaml",
    )
    sp.add_argument("spec", metavar="SPEC", help=SPEC_HELP)
    sp.add_argument("--env-dir", help="the env (default .envs/NAME)")
    sp.set_defaults(args_type=commandargs.StorePushArgs)
    sq = _sub(
        ssub,
        "pull",
        "pull what a warmer pushed for a spec into this machine's store",
        "Every entry listed under the spec's lock on CUDAENV_JIT_REMOTE, each checked by "
        "digest and sha256, added to the local store before a build or verify needs it.",
        "cudaenv store pull envspecs/default.yaml",
    )
    sq.add_argument("spec", metavar="SPEC", help=SPEC_HELP)
    sq.set_defaults(args_type=commandargs.StorePullArgs)

    wm = _sub(
        sub,
        "warm",
        "JIT-build the FlashInfer modules a server loads into the store (and the JIT remote)",
        "For each arch list (default: the spec's), build in the spec's env the FlashInfer "
        "modules a server loads at its first requests (FlashInfer's own generators: norm, "
        "rope, page, sampling, cascade, quantization, top-k, the fused activations, batch "
        "prefill and decode attention of each --head-dim and --dtype) through the JIT store, "
        "and push them with the spec's warm list to CUDAENV_JIT_REMOTE when one is set; "
        "`cudaenv build` on a node places them. Modules already in the store are not built "
        "again (a rerun resumes). Exit 4 when a module could not be built for an arch list: "
        "each is listed with FlashInfer's reason.",
        "cudaenv warm envspecs/default.yaml --modules 'batch_*' norm --head-dim 128",
    )
    wm.add_argument("spec", metavar="SPEC", help=SPEC_HELP)
    wm.add_argument(
        "--archs",
        action="append",
        default=[],
        metavar="A,B",
        help="an arch list to warm (repeat for several; default: the spec's archs)",
    )
    wm.add_argument(
        "--modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="PATTERN",
        help="only modules whose FlashInfer name matches one of these fnmatch patterns",
    )
    wm.add_argument(
        "--head-dim",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="attention head dim (repeat for several; default 128)",
    )
    wm.add_argument(
        "--dtype",
        action="append",
        default=[],
        choices=("bf16", "fp16"),
        help="attention dtype (repeat for several; default bf16)",
    )
    wm.add_argument("--env-dir", help="the env (default .envs/NAME)")
    wm.add_argument("--json", action="store_true", help="print JSON, for scripts")
    wm.set_defaults(args_type=commandargs.WarmArgs)

    rp = _sub(
        sub,
        "report",
        "work with reports",
        "Join reports written on several machines into one matrix report.",
        "cudaenv report merge runner-*/verify.json --out merged",
    )
    rsub = rp.add_subparsers(dest="report_command", required=True, metavar="COMMAND")
    mg = _sub(
        rsub,
        "merge",
        "join verify/matrix JSON reports into one matrix report",
        "Each verify report becomes a cell, each matrix report adds its cells; the merged "
        "matrix.json, matrix.html, matrix.md and junit.xml go to --out.",
        "cudaenv report merge a/verify.json b/matrix.json --out merged",
    )
    mg.add_argument("reports", nargs="+", metavar="REPORT")
    mg.add_argument("--out", default="merged-report", help="directory for the merged reports")
    mg.add_argument("--name", default="merged")
    mg.set_defaults(args_type=commandargs.ReportMergeArgs)
    return p
