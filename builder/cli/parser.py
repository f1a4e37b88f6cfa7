"""The command table: every command, its help, and the dataclass that declares its arguments
(builder/commands/args.py); the argparse parser is made from it by one loop.

Kept apart from cli/main.py, which holds what each command does: the table is read by the CLI,
by `cudaenv completion` and by the reference docs, and none of them needs the handlers.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from builder import __version__
from builder.commands import args as commandargs
from builder.commands.options import Command, add_arguments, fill
from builder.core import errors
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


class Parser(argparse.ArgumentParser):
    """argparse, with cudaenv's errors: one ``error:`` line (after the usage of the command it
    concerns), and an empty value refused wherever it is given."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {self.prog}: {errors.printable(message)}\n")

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
        args=fill(args.args_type, args),
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


@dataclass(frozen=True)
class Sub:
    """One command: its name, its one-line summary, what it does, an example, and either the
    dataclass of its arguments or, for a group (``store``, ``report``), its own commands."""

    name: str
    summary: str
    description: str
    example: str
    args: type[Command] | None = None
    subs: tuple[Sub, ...] = ()


COMMANDS: tuple[Sub, ...] = (
    Sub(
        "lock",
        "resolve specs and write their PEP 751 locks",
        "Resolve each spec with uv under the matching policy (torch's CUDA = the spec's, every "
        "toolkit component of that CUDA minor, one CUDA major, FlashInfer companions matched) "
        "and write locks/pylock.NAME.toml beside it (dots in NAME become '-'): file URLs, or "
        'wheelhouse paths where pyproject.toml says [tool.cudaenv] locks = "index-neutral". '
        "A set the policy refuses exits 3.",
        "cudaenv lock envspecs/default.yaml",
        args=commandargs.LockArgs,
    ),
    Sub(
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
        args=commandargs.InitArgs,
    ),
    Sub(
        "plan",
        "print what a spec resolves to, without installing",
        "Show the versions the spec's lock (or a fresh resolution) installs: torch and its "
        "CUDA, the toolkit pin, the NVIDIA wheels, FlashInfer, sglang. Nothing is installed.",
        "cudaenv plan envspecs/default.yaml",
        args=commandargs.PlanArgs,
    ),
    Sub(
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
        args=commandargs.BuildArgs,
    ),
    Sub(
        "export",
        "download every locked file (hash-checked), or write a lock with this index's URLs",
        "Fill a wheelhouse with every file of the spec's lock, each sha256 checked, for "
        "`cudaenv build --offline --wheelhouse DIR` on a machine without an index; without "
        "--wheelhouse, the wheelhouse an index-neutral lock names beside it, so `uv pip install "
        "-r` and `pip install -r` of the lock work. --pylock FILE writes a standard PEP 751 lock "
        "of the same files with their URLs on the index this machine's uv is configured with; "
        "a file the index serves with another hash is refused.",
        "cudaenv export envspecs/default.yaml --wheelhouse /srv/wheels",
        args=commandargs.ExportArgs,
    ),
    Sub(
        "verify",
        "prove an env works: compile and run real kernels",
        "Run the checks (" + ", ".join(spec.CHECKS) + ") on a spec's built env, or on any "
        "interpreter with --python, cheapest first: those that read the env, then those that "
        "compile (FlashInfer's JIT), then those that need a GPU. A failed check leaves the later "
        "stages not run (skipped, 'not run: X failed') unless --keep-going. A check that cannot "
        "run here (no GPU) says skipped with the reason. A failed check exits 5; a missing "
        "tool 6.",
        "cudaenv verify envspecs/default.yaml --checks toolchain,kernel-compile",
        args=commandargs.VerifyArgs,
    ),
    Sub(
        "doctor",
        "find the root cause of a split CUDA toolchain in any env",
        "Probe an interpreter (a venv, conda env or system Python; no import of torch unless "
        "--deep) and name what is wrong first: a JIT nvcc that is not torch's CUDA, mixed "
        "toolkit minors, a stale JIT cache, a missing host compiler, ... with the fix. Exits 1 "
        "when it finds an error.",
        "cudaenv doctor --python .venv/bin/python",
        args=commandargs.DoctorArgs,
    ),
    Sub(
        "adopt",
        "give an existing venv or conda env the toolchain its torch is built for",
        "Read torch's CUDA from the env itself, install the matching toolkit components there "
        "with uv (realigning drifted ones), add the cuda-home/ overlay, the start-up hook, the "
        "activate block and the env's own JIT caches, then verify. Every change is journalled: "
        "--undo restores the same distributions and versions and removes every cudaenv file; "
        "an interrupted adopt is undone, and a rerun finishes from where the env was. --rebuild "
        "PKG compiles packages the env built at install again from their sdists against the "
        "matched toolkit, keeping the old build for --undo. Refuses "
        "(exit 3, nothing changed) a CPU-only or missing torch, a CUDA 12 torch without its "
        "toolkit on the machine, a system Python (unless --force), and a set uv cannot "
        "resolve without breaking the env's own pins; exits 7 where this machine's NVIDIA "
        "driver cannot run torch's CUDA.",
        "cudaenv adopt --python .venv/bin/python --dry-run",
        args=commandargs.AdoptArgs,
    ),
    Sub(
        "list",
        "the envs built here",
        "Each env under .envs/: its spec, whether it matches the spec's current lock, its size "
        "on disk (and how much of it no other env or uv's cache shares), its last verify.",
        "cudaenv list --json",
        args=commandargs.ListArgs,
    ),
    Sub(
        "remove",
        "delete built envs",
        "Delete each named env whole, with what killed builds of it left and its lock file; a "
        "build of it in progress is waited for. NAME is an env's name in the project's .envs/ "
        "(as `cudaenv list` shows it), never a path: anything else is refused (exit 2). Where "
        ".envs/NAME is a link, the link is removed, not what it points to.",
        "cudaenv remove sglang-0.5.23-cu130",
        args=commandargs.RemoveArgs,
    ),
    Sub(
        "run",
        "run a command in an env without activating it",
        "Run CMD with the env's bin/ first on PATH and every setting of its start-up hook "
        "(CUDA_HOME, arch lists, JIT caches, ...), exactly as its own python sees them; the "
        "exit status is the command's, or, as a shell's, 127 where CMD is not found and 126 "
        "where it cannot be run. NAME is an env's name in the project's .envs/, never a path.",
        "cudaenv run sglang-0.5.23-cu130 -- nvcc --version",
        args=commandargs.RunArgs,
    ),
    Sub(
        "completion",
        "print shell completion for bash, zsh or fish",
        "Print a completion script for cudaenv's commands and options. bash: add "
        "`source <(cudaenv completion bash)` to ~/.bashrc; zsh: the same with zsh in ~/.zshrc; "
        "fish: `cudaenv completion fish > ~/.config/fish/completions/cudaenv.fish`.",
        "cudaenv completion bash",
        args=commandargs.CompletionArgs,
    ),
    Sub(
        "fingerprint",
        "one hash of what decides JIT results and kernel behaviour in an env",
        "Print one hash over the env's installed distributions and versions, the toolkit its "
        "JIT uses (release and the content of nvcc, cicc, ptxas, ...), the host compiler, the "
        "arch lists and the variables that change a compile; the env's own path does not "
        "count. Run it on every node of a deployment: equal hashes, equal compiles. "
        "--compare A.json B.json (two `--json` outputs) names each difference and exits 1 "
        "when there is one.",
        "cudaenv fingerprint --python .venv/bin/python --json > node1.json",
        args=commandargs.FingerprintArgs,
    ),
    Sub(
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
        args=commandargs.AuditArgs,
    ),
    Sub(
        "target",
        "write this node's GPU class into a fleet file",
        "Read this node's GPUs (their compute capabilities), NVIDIA driver and platform, and "
        "print each distinct GPU class as a fleet-file target, or add it to --out FILE (made "
        "when missing; a class already there is kept once). Run it on one node of each class "
        "and the fleet file is collected, not typed. --cc and --driver say what a node without "
        "nvidia-smi has.",
        "cudaenv target --name rtx-pro-6000 --out envspecs/fleet.yaml",
        args=commandargs.TargetArgs,
    ),
    Sub(
        "compat",
        "which stacks run on which GPU classes: a compatibility table",
        "Judge each stack (a spec, or every cell of a matrix file) for each target from its "
        "lock's wheels, as `audit --targets` does, and print a table: stacks as rows, GPU "
        "class x platform x driver as columns, each cell a verdict with its evidence. Without "
        "--targets, the common classes: 7.5 to 12.1 on both platforms, on a 570 and a 580 "
        "driver. Exits 0 whatever the verdicts (a table, not a gate).",
        "cudaenv compat envspecs/default.yaml envspecs/vllm-0.33-cu130.yaml --markdown c.md",
        args=commandargs.CompatArgs,
    ),
    Sub(
        "matrix",
        "build and verify every cell of a matrix file",
        "Expand a matrix file (specs: or base: + axes:) into cells, build and verify each, -j at "
        "a time, and write matrix.json, matrix.html, matrix.md and junit.xml. A cell the policy "
        "refuses is shown as refused; a failing cell never stops the others.",
        "cudaenv matrix envspecs/matrix/release.yaml -j 2 --baseline old/matrix.json",
        args=commandargs.MatrixArgs,
    ),
    Sub(
        "add",
        "add packages to a spec, then lock, rebuild and verify its env",
        "Put each requirement into the spec's packages: (the file's comments and layout kept; a "
        "package listed already gets the new requirement), lock it (the current versions "
        "preferred), rebuild the env from the new lock and verify it. A resolve or build that "
        "fails leaves the spec, its lock and the env as they were.",
        "cudaenv add 'transformers>=4.57' --spec envspecs/default.yaml",
        args=commandargs.AddArgs,
    ),
    Sub(
        "store",
        "the JIT store: list, check, trim, share",
        "The machine-wide store of compiled JIT results (FlashInfer's modules, the top-k/top-p "
        "kernel), keyed by what made them and checked by sha256 each time one is placed. "
        "CUDAENV_JIT_STORE moves it, CUDAENV_JIT_STORE_MAX caps it (default 10G), "
        "CUDAENV_JIT_REMOTE=oci://HOST/REPO shares it through a registry.",
        "cudaenv store gc --max 5G",
        subs=(
            Sub(
                "list",
                "every entry: key, kind, size, last use, where it was made",
                "Every entry of the store, least recently used first, and the total against the cap. "
                "With SPEC, the FlashInfer modules that spec's env would get: those of its lock's "
                "FlashInfer version, CUDA release, archs and machine (a build places each whose key, "
                "computed in the env, is equal).",
                "cudaenv store list envspecs/default.yaml",
                args=commandargs.StoreListArgs,
            ),
            Sub(
                "verify",
                "check every entry's files against their recorded sha256",
                "Read every entry and hash every file; an entry that differs from its record is "
                "discarded (it is compiled again where it is next needed). Exit 5 when one was.",
                "cudaenv store verify",
                args=commandargs.StoreVerifyArgs,
            ),
            Sub(
                "gc",
                "trim the store to its cap, least recently used first",
                "Remove entries of older store formats, what interrupted builds left, unused locks, "
                "then the least recently used entries until the store is under --max.",
                "cudaenv store gc --max 5G",
                args=commandargs.StoreGcArgs,
            ),
            Sub(
                "push",
                "push the entries an env's verify used to the JIT remote",
                "What a CI warmer runs after `cudaenv build SPEC --verify`: every store entry the env "
                "used, and the list of their keys tagged by the spec's lock, go to CUDAENV_JIT_REMOTE.",
                "CUDAENV_JIT_REMOTE=oci://registry.example:5000/cudaenv/jit cudaenv store push "
                "envspecs/default.yaml",
                args=commandargs.StorePushArgs,
            ),
            Sub(
                "pull",
                "pull what a warmer pushed for a spec into this machine's store",
                "Every entry listed under the spec's lock on CUDAENV_JIT_REMOTE, each checked by "
                "digest and sha256, added to the local store before a build or verify needs it.",
                "cudaenv store pull envspecs/default.yaml",
                args=commandargs.StorePullArgs,
            ),
        ),
    ),
    Sub(
        "warm",
        "JIT-build the FlashInfer modules a server loads into the store (and the JIT remote)",
        "For each arch list (default: the spec's), build in the spec's env the FlashInfer "
        "modules a server loads at its first requests (FlashInfer's own generators: norm, "
        "rope, page, sampling, cascade, quantization, top-k, the fused activations, batch "
        "prefill and decode attention of each --head-dim and --dtype) through the JIT store, "
        "and push them with the spec's warm list to CUDAENV_JIT_REMOTE when one is set; "
        "`cudaenv build` on a node places them. The spec's packages that compile from their "
        "sdists are built for each arch list too, into the store only (the env is not "
        "changed). Modules already in the store are not built "
        "again (a rerun resumes). Exit 4 when a module could not be built for an arch list: "
        "each is listed with FlashInfer's reason.",
        "cudaenv warm envspecs/default.yaml --modules 'batch_*' norm --head-dim 128",
        args=commandargs.WarmArgs,
    ),
    Sub(
        "report",
        "work with reports",
        "Join reports written on several machines into one matrix report.",
        "cudaenv report merge runner-*/verify.json --out merged",
        subs=(
            Sub(
                "merge",
                "join verify/matrix JSON reports into one matrix report",
                "Each verify report becomes a cell, each matrix report adds its cells; the merged "
                "matrix.json, matrix.html, matrix.md and junit.xml go to --out.",
                "cudaenv report merge a/verify.json b/matrix.json --out merged",
                args=commandargs.ReportMergeArgs,
            ),
        ),
    ),
)


def make_parser(commands: Sequence[Sub] = COMMANDS) -> argparse.ArgumentParser:
    """Every command and its arguments; each command sets ``args_type``, the dataclass of its
    arguments, which cli/main.py maps to its handler."""
    p = Parser(
        prog="cudaenv",
        description=DESCRIPTION + "\n" + textwrap.fill("Exit codes: " + errors.exit_summary(), 94),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"cudaenv {__version__}")
    p.add_argument("--debug", action="store_true", help="log every command; tracebacks on errors")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr (CI logs)")
    _add_commands(p, "command", commands)
    return p


def _add_commands(parser: Parser, dest: str, commands: Sequence[Sub]) -> None:
    sub = parser.add_subparsers(dest=dest, required=True, metavar="COMMAND")
    for command in commands:
        p = _sub(sub, command.name, command.summary, command.description, command.example)
        if command.args is not None:
            add_arguments(p, command.args)
        else:
            _add_commands(p, f"{command.name}_command", command.subs)
