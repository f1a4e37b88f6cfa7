"""The command line: argparse, and the only place that prints errors and exits."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from builder import __version__, archs, lock, platforms, proc, resolve, spec
from builder.errors import (
    BuildError,
    CudaenvError,
    ReportError,
    SpecError,
    ToolMissing,
    UsageError,
    VerifyFailed,
)

if TYPE_CHECKING:
    from builder import report, verify
    from builder.manifest import Manifest

# build, verify, report, doctor and export pull in jinja2 and more: they are imported by the
# commands that use them, so `cudaenv lock` and `plan` start in a few milliseconds.

log = logging.getLogger("cudaenv")

DESCRIPTION = """\
cudaenv puts a matched CUDA toolchain next to torch, FlashInfer and sglang in an isolated
venv, from one declarative spec file, and proves it works by compiling and running real
kernels.

SPEC is a spec file (envspecs/NAME.yaml): the torch / CUDA / FlashInfer / sglang combination,
the Python, the toolkit components and the GPU archs. Wherever a SPEC is taken, FILE:CELL
names one cell of a matrix file instead (envspecs/matrix/release.yaml:sm12.0f), as CI
runners get it from `cudaenv matrix FILE --emit github`.

Exit codes: 0 ok; 1 other; 2 bad input (spec, matrix, report, argument); 3 refused or
unresolvable set; 4 build failed; 5 a check failed; 6 a tool is missing; 130 interrupted.
"""

QUIET_PROGRESS = False


def _progress(msg: str) -> None:
    if not QUIET_PROGRESS:
        print(f"cudaenv: {msg}", file=sys.stderr, flush=True)


def _command(argv: Sequence[str]) -> str:
    return shlex.join(["cudaenv", *argv])


def _load_spec(arg: Path | str) -> spec.EnvSpec:
    """A spec path, or MATRIX.yaml:CELL for one cell of a matrix (what CI runners get)."""
    if ":" not in str(arg):
        return spec.load(arg)  # the matrix module (and its imports) only for FILE:CELL
    from builder import matrix

    cell = matrix.split_cell_arg(str(arg))
    if cell is not None:
        return spec.load(matrix.load(cell[0]).cell(cell[1]).spec_path)
    return spec.load(arg)


def _lock_file(s: spec.EnvSpec) -> Path:
    return lock.lock_path(s.source, s.name)


def _check_lock_owner(s: spec.EnvSpec, path: Path) -> None:
    """Refuse to overwrite the lock of another spec whose name maps to the same file."""
    owner = lock.owner(path)
    if owner is not None and owner != s.name:
        lock.check_owner_name(owner, path, s.name)


def cmd_lock(args: argparse.Namespace) -> int:
    for path in args.specs:
        s = _load_spec(path)
        out = _lock_file(s)
        _check_lock_owner(s, out)
        _progress(f"resolving {s.name} ({path}) with uv")
        plan = resolve.resolve(
            s, command=_command(["lock", str(path)]), previous=None if args.upgrade else out
        )
        lock.write(plan.lock, out)
        for note in plan.lock.notes:
            _progress(f"note: {note}")
        _progress(
            f"wrote {out} ({_per_platform(plan.lock)}), torch {plan.lock.torch or '-'} "
            f"(CUDA {plan.lock.torch_cuda or '-'}), cuda-toolkit {plan.lock.toolkit or '-'} "
            f"in {plan.seconds:.1f} s"
        )
    return 0


def _per_platform(lk: lock.Lock) -> str:
    return ", ".join(f"{len(lk.packages_on(p))} packages for {p}" for p in lk.platforms)


def _current_lock(s: spec.EnvSpec, *, fresh: bool) -> tuple[lock.Lock, str]:
    path = _lock_file(s)
    if not fresh and path.exists():
        current = lock.read(path, spec_name=s.name)
        if current.fingerprint == s.fingerprint():
            return current, f"{path} (up to date)"
        return resolve.resolve(s).lock, f"a fresh resolution ({path} is stale: re-lock)"
    return resolve.resolve(s).lock, "a fresh resolution"


def plan_table(s: spec.EnvSpec, lk: lock.Lock, platform: str) -> list[tuple[str, str]]:
    """The lock as installed on ``platform`` (one of the lock's)."""
    packages = lk.packages_on(platform)
    others = [p for p in lk.platforms if p != platform]
    rows: list[tuple[str, str]] = [
        ("spec", f"{s.name} ({s.source})"),
        ("python", lk.python),
        ("platform", platform + (f" (the lock also holds {', '.join(others)})" if others else "")),
        ("cuda (spec)", s.cuda),
        ("torch", lk.torch or "-"),
        ("torch's CUDA", lk.torch_cuda or "-"),
        (
            "cuda-toolkit",
            lk.toolkit or ("system: " + str(s.toolchain.path) if s.toolchain.path else "-"),
        ),
        ("archs", archs.flashinfer_spelling(s.archs)),
    ]
    interesting = ("nvidia-", "cuda-toolkit", "flashinfer", "sglang", "sgl-kernel", "triton")
    for p in packages:
        if p.name.startswith(interesting) and p.name != "cuda-toolkit":
            rows.append((p.name, p.version))
    rows.append(("packages", str(len(packages))))
    return rows


def _known_platform(given: str | None) -> str | None:
    """A ``--platform`` value, refused in one line unless cudaenv knows the platform."""
    if given is not None and given not in platforms.KNOWN:
        raise UsageError(
            f"--platform {given!r}: unknown platform; expected one of: {', '.join(platforms.KNOWN)}"
        )
    return given


def _platform_arg(s: spec.EnvSpec, lk: lock.Lock, given: str | None) -> str:
    """``--platform`` (default: this machine's, else the lock's first), one of the lock's."""
    _known_platform(given)
    if given is not None and given not in lk.platforms:
        raise UsageError(
            f"--platform {given}: {s.source} is locked for {', '.join(lk.platforms)} only; add "
            f"{given} to its `platforms:` and re-lock"
        )
    if given is not None:
        return given
    host = platforms.host_name()
    return host if host in lk.platforms else lk.platforms[0]


def cmd_plan(args: argparse.Namespace) -> int:
    s = _load_spec(args.spec)
    lk, origin = _current_lock(s, fresh=args.fresh)
    platform = _platform_arg(s, lk, args.platform)
    path = _lock_file(s)
    rows = [("lock", str(path) if path.exists() else f"{path} (not written yet)")]
    rows += plan_table(s, lk, platform)
    if args.json:
        doc = {
            "spec": str(s.source),
            "name": s.name,
            "lock": str(path),
            "lock_written": path.exists(),
            "from": origin,
            "platform": platform,
            "platforms": list(lk.platforms),
            "python": lk.python,
            "cuda": s.cuda,
            "torch": lk.torch,
            "torch_cuda": lk.torch_cuda,
            "toolkit": lk.toolkit,
            "archs": archs.texts(s.archs),
            "packages": {p.name: p.version for p in lk.packages_on(platform)},
        }
        print(json.dumps(doc, indent=2))
        return 0
    width = max(len(k) for k, _ in rows)
    print(f"# plan for {s.name} from {origin}; nothing installed")
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _ensure_lock(s: spec.EnvSpec, path: Path | str, *, offline: bool, relock: bool) -> lock.Lock:
    """The spec's lock: resolved first when missing (or, with ``relock``, when stale)."""
    lock_file = _lock_file(s)
    if lock_file.exists():
        lk = lock.read(lock_file, spec_name=s.name)
        if not relock or lk.fingerprint == s.fingerprint():
            return lk
        why = "is stale"
    else:
        why = "does not exist"
    if offline:
        raise BuildError(f"{lock_file} {why} and --offline cannot resolve one")
    _progress(f"{lock_file} {why}: resolving and writing it first")
    plan = resolve.resolve(
        s, command=_command(["lock", str(path)]), previous=lock_file if relock else None
    )
    lock.write(plan.lock, lock_file)
    return plan.lock


@dataclass
class _Stage:
    """Where `build --verify --record` is, for the record written at the end."""

    name: str = "resolve"
    recorded: bool = False


def cmd_build(args: argparse.Namespace) -> int:
    stage = _Stage()
    try:
        return _build(args, stage)
    except (CudaenvError, KeyboardInterrupt) as exc:
        if args.record and not stage.recorded:
            _write_record(Path(args.record), stage.name, exc)
        raise


def _write_record(
    path: Path,
    stage: str,
    exc: CudaenvError | KeyboardInterrupt | None,
    verified: report.VerifyReport | None = None,
) -> None:
    from builder import report
    from builder.errors import STATUS_OF_EXIT

    if exc is None:
        code, reason = 0, ""
    elif isinstance(exc, KeyboardInterrupt):
        code, reason = 130, "interrupted"
    else:
        assert isinstance(exc, CudaenvError)
        code = exc.exit_code
        reason = "; ".join(exc.problems) if isinstance(exc, SpecError) else str(exc)
    status = STATUS_OF_EXIT.get(code, "error")
    if isinstance(exc, VerifyFailed | ToolMissing) and stage == "verify":
        status = "failed"
    record = report.BuildRecord(
        stage=stage, status=status, reason=reason, exit_code=code, verify=verified
    )
    report.write_json(record, path)


def _cross_platform(args: argparse.Namespace) -> str | None:
    """``build --platform``: None for this machine's own, else the other platform's name."""
    if _known_platform(args.platform) is None or args.platform == platforms.host_name():
        return None
    if args.verify:
        raise UsageError(
            f"--verify runs the env, and an env assembled for {args.platform} cannot run on "
            f"this {platforms.host_name()} machine; verify it there"
        )
    if not args.env_dir:
        # .envs/NAME is this machine's env of the spec; another machine's goes elsewhere.
        raise UsageError(f"--platform {args.platform} needs --env-dir DIR (where to assemble it)")
    return str(args.platform)


def _build(args: argparse.Namespace, stage: _Stage) -> int:
    from builder import build, export

    if args.env_dir and len(args.specs) > 1:
        raise UsageError("--env-dir takes one spec")
    cross = _cross_platform(args)
    for path in args.specs:
        stage.name = "resolve"
        s = _load_spec(path)
        lk = _ensure_lock(s, path, offline=args.offline, relock=args.relock)
        stage.name = "build"
        lock_file = _lock_file(s)
        started = time.monotonic()
        _progress(
            f"building {s.name}: python {s.python}, torch {lk.torch or '-'}, CUDA {s.cuda} "
            f"({s.toolchain.source} toolchain), archs {archs.flashinfer_spelling(s.archs)}"
        )
        env_dir = Path(args.env_dir) if args.env_dir else None
        wheelhouse = Path(args.wheelhouse).absolute() if args.wheelhouse else None
        if wheelhouse is not None:
            export.check_wheelhouse(lk, wheelhouse, cross)  # before anything is built
            imported = export.import_jit(wheelhouse)
            if imported:
                _progress(
                    f"{imported} JIT result(s) from {wheelhouse / export.JIT_DIR} added to the "
                    "store; each is used only where its toolkit, flags and inputs match"
                )
        result = build.build(
            s,
            lk,
            lock_file=lock_file,
            env_dir=env_dir,
            force=args.force,
            source=build.Source(wheelhouse=wheelhouse, offline=args.offline),
            platform=cross,
            progress=_progress,
        )
        verb = "reused" if result.reused else ("assembled" if cross else "built")
        if cross:
            verb += f" (for {cross}, not runnable here)"
        seconds = time.monotonic() - started
        _progress(f"{verb} {result.path} in {seconds:.1f} s")
        if not args.json:
            print(result.path)
        doc: dict[str, object] = {
            "spec": str(s.source),
            "env": str(result.path),
            "reused": result.reused,
            "platform": cross or platforms.host_name(),
            "assembled": cross is not None,
            "seconds": round(seconds, 1),
            "verify": None,
        }
        if args.verify:
            stage.name = "verify"
            target = spec_target(s, result.path, lk, result.manifest)
            verified = verify_and_report(
                target, result.manifest, report_path=args.report, quiet_summary=args.json
            )
            if args.record:
                _write_record(Path(args.record), stage.name, _verdict(verified), verified)
                stage.recorded = True
            doc["verify"] = verified.to_json()
            if args.json:
                print(json.dumps(doc, indent=2))
            _raise_verdict(verified)
        else:
            if args.json:
                print(json.dumps(doc, indent=2))
            if args.record:
                _write_record(Path(args.record), stage.name, None)
    return 0


# --------------------------------------------------------------------------- verify


def _parse_archs(text: str) -> tuple[archs.Arch, ...]:
    try:
        return archs.parse_list(text)
    except ValueError as exc:
        raise UsageError(f"--archs {text!r}: {exc}") from exc


def spec_target(
    s: spec.EnvSpec,
    env_dir: Path,
    lk: lock.Lock | None,
    manifest: Manifest,
    *,
    checks: tuple[str, ...] | None = None,
    archs_override: tuple[archs.Arch, ...] | None = None,
    fresh: bool = False,
) -> verify.Target:
    """What verifying the env of ``s`` at ``env_dir`` means. The env must be the one this spec
    (and its current lock) describes: an env built from another spec of the same name, or
    from an older lock, is refused with the rebuild command."""
    from builder import verify

    rebuild = f"rebuild it: `cudaenv build {s.source}`"
    if manifest.fingerprint != s.fingerprint():
        raise VerifyFailed(
            f"{env_dir} was built from another spec than {s.source} (spec {manifest.spec}, "
            f"fingerprint {manifest.fingerprint[:19]}... != {s.fingerprint()[:19]}...); {rebuild}"
        )
    if lk is not None and manifest.lock_hash != lk.content_hash():
        raise VerifyFailed(
            f"{env_dir} was built from another lock than {_lock_file(s)} (lock "
            f"{manifest.lock_hash[:19]}... != {lk.content_hash()[:19]}...); {rebuild}"
        )
    chosen = archs_override or manifest.archs
    # Another list than the env's: the start-up hook takes it from CUDAENV_ARCH_LIST, so
    # FlashInfer JIT-builds those archs into the env's own cache for this run.
    extra = (
        (("CUDAENV_ARCH_LIST", archs.flashinfer_spelling(chosen)),)
        if chosen != manifest.archs
        else ()
    )
    return verify.Target(
        python=env_dir / "bin" / "python",
        archs=chosen,
        work=env_dir / "var" / "cudaenv",
        env_dir=env_dir,
        expected_cuda=s.cuda,
        spec_name=s.name,
        spec_path=str(s.source),
        checks=checks or s.verify,
        extra_env=extra,
        fresh=fresh,
    )


def _verify_target(args: argparse.Namespace) -> tuple[verify.Target, Manifest | None]:
    from builder import build, interpreters, manifest, verify
    from builder.paths import cache_dir

    checks = verify.parse_checks(args.checks) if args.checks else None
    archs_override = _parse_archs(args.archs) if args.archs else None
    if args.spec is None and args.python is None:
        raise UsageError("verify needs a SPEC or --python PATH (see `cudaenv verify --help`)")
    if args.spec is not None:
        if args.python is not None:
            raise UsageError("verify takes a SPEC or --python PATH, not both")
        s = _load_spec(args.spec)
        env_dir = (Path(args.env_dir) if args.env_dir else build.default_env_dir(s)).absolute()
        if not manifest.exists(env_dir):
            raise BuildError(f"{env_dir} is not built; run `cudaenv build {args.spec}` first")
        found = manifest.read(env_dir)
        host = platforms.host_name()
        if found.platform is not None and found.platform != host:
            raise UsageError(
                f"{env_dir} was assembled for {found.platform} and cannot run on this {host} "
                f"machine: copy it to a {found.platform} machine, make it a venv there "
                f"(`python{found.python} -m venv {env_dir}`) and verify it there"
            )
        lock_file = _lock_file(s)
        lk = lock.read(lock_file, spec_name=s.name) if lock_file.exists() else None
        target = spec_target(
            s,
            env_dir,
            lk,
            found,
            checks=checks,
            archs_override=archs_override,
            fresh=args.fresh,
        )
        return target, found
    python = interpreters.python_arg(args.python)
    root = python.absolute().parent.parent
    found_manifest = manifest.try_read(root)
    if archs_override is None:
        from_env = os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
        archs_override = (
            found_manifest.archs
            if found_manifest
            else (_parse_archs(from_env) if from_env else archs.DEFAULT_ARCHS)
        )
    key = hashlib.sha256(str(python.absolute()).encode()).hexdigest()[:12]
    spelled = archs.flashinfer_spelling(archs_override)
    # Both: a plain env's FlashInfer reads the first, a cudaenv env's hook the second.
    extra = (("FLASHINFER_CUDA_ARCH_LIST", spelled), ("CUDAENV_ARCH_LIST", spelled))
    return verify.Target(
        python=python,
        archs=archs_override,
        work=cache_dir() / "verify" / key,
        env_dir=root if found_manifest else None,
        checks=checks or verify.CHECKS,
        extra_env=extra,
        fresh=args.fresh,
    ), found_manifest


def verify_and_report(
    target: verify.Target,
    found: Manifest | None,
    *,
    report_path: str | None = None,
    markdown_path: str | None = None,
    quiet_summary: bool = False,
) -> report.VerifyReport:
    """Run the target's checks, print the summary, write the reports; the verdict is the
    caller's (:func:`_raise_verdict`)."""
    from builder import report, verify

    started = time.monotonic()
    facts, results = verify.run_checks(target, target.checks, _progress)
    rep = report.verify_report(target, facts, results, time.monotonic() - started, found)
    if not quiet_summary:
        print(report.terminal(rep))
    outputs = []
    if report_path:
        outputs.append(Path(report_path))
    elif target.env_dir is not None:
        outputs.append(target.env_dir / "var" / "cudaenv" / "verify.json")
    for out in outputs:
        report.write_json(rep, out)
        _progress(f"report: {out}")
    md = report.markdown(rep)
    if markdown_path:
        from builder.proc import atomic_write_text

        atomic_write_text(Path(markdown_path), md)
    report.append_step_summary(md)
    return rep


def _verdict(rep: report.VerifyReport) -> CudaenvError | None:
    failed = [c for c in rep.checks if c.status == "failed"]
    if not failed:
        return None
    missing = [c for c in failed if c.missing_tool]
    if missing:
        c = missing[0]
        return ToolMissing(f"{c.name}: no {c.missing_tool}: {c.fix}")
    return VerifyFailed(f"{len(failed)} check(s) failed: {', '.join(c.name for c in failed)}")


def _raise_verdict(rep: report.VerifyReport) -> None:
    verdict = _verdict(rep)
    if verdict is not None:
        raise verdict


def cmd_verify(args: argparse.Namespace) -> int:
    target, found = _verify_target(args)
    rep = verify_and_report(target, found, report_path=args.report, markdown_path=args.markdown)
    _raise_verdict(rep)
    return 0


# --------------------------------------------------------------------------- doctor, export


def cmd_doctor(args: argparse.Namespace) -> int:
    from builder import doctor, interpreters

    python = interpreters.python_arg(args.python) if args.python else doctor.default_python()
    facts, findings, seconds = doctor.probe(python, deep=args.deep)
    if args.json:
        print(json.dumps(doctor.to_json(python, facts, findings, seconds), indent=2))
    else:
        print(doctor.render(python, facts, findings))
    return 1 if any(f.severity == doctor.ERROR for f in findings) else 0


def cmd_adopt(args: argparse.Namespace) -> int:
    from builder import adopt, interpreters

    python = interpreters.python_arg(args.python)
    found = adopt.inspect(python)
    journal = adopt.read_journal(found.prefix)
    if args.undo:
        for line in adopt.undo(found.prefix, python, _progress):
            _progress(line)
        _progress(f"{found.prefix} is as it was before adopt")
        return 0
    if journal is not None and journal.get("state") == "done":
        _progress(
            f"{found.prefix} is adopted already; `cudaenv adopt --undo --python {args.python}` "
            "first to adopt it again"
        )
        return 0
    if journal is not None:
        # A run killed outright: put the env back as it was, then adopt from there.
        _progress(f"a previous adopt of {found.prefix} did not finish: undoing it first")
        adopt.undo(found.prefix, python, _progress)
        found = adopt.inspect(python)
    env_archs = _parse_archs(args.archs) if args.archs else None
    planned = adopt.plan(found, env_archs=env_archs, force=args.force)
    for line in planned.lines():
        print(line)
    if args.dry_run:
        print("(dry run: nothing changed)")
        return 0
    built = adopt.apply(planned, _progress)
    _progress(f"adopted {found.prefix}: nvcc {built.nvcc} in cuda-home/, archs "
              f"{archs.flashinfer_spelling(built.archs)}; `cudaenv adopt --undo` reverts")  # fmt: skip
    if args.no_verify:
        return 0
    verify_args = argparse.Namespace(
        spec=None, python=str(python), env_dir=None, checks=None, archs=None, fresh=False,
        report=None, markdown=None,
    )  # fmt: skip
    return cmd_verify(verify_args)


def cmd_list(args: argparse.Namespace) -> int:
    from builder import envs

    found = envs.listing()
    if args.json:
        print(json.dumps([e.to_json() for e in found], indent=2))
        return 0
    if not found:
        print("no envs built here (.envs/)")
        return 0
    for e in found:
        size = f"{envs.human(e.bytes_total)} ({envs.human(e.bytes_own)} not shared)"
        print(f"{e.name}  spec {e.spec}  lock {e.lock_state}  {size}  "
              f"last verify {e.verified or 'never'}"
              + (f"  [{e.platform}]" if e.platform else ""))  # fmt: skip
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    from builder import envs

    for name in args.names:
        path = envs.resolve(name)
        envs.remove(path)
        _progress(f"removed {path}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from builder import envs

    path = envs.resolve(args.name)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("run needs a command: `cudaenv run NAME -- CMD ARGS...`")
    python = path / "bin" / "python"
    if not python.exists():
        raise UsageError(f"{path} has no bin/python (assembled for another platform?)")
    env = dict(os.environ)
    env["VIRTUAL_ENV"] = str(path)
    env["PATH"] = f"{path / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONHOME", None)
    # The env's interpreter starts (its start-up hook sets CUDA_HOME, the arch lists, the
    # caches, ...) and replaces itself with the command, which inherits exactly that.
    trampoline = "import os, sys; os.execvp(sys.argv[1], sys.argv[1:])"
    proc.replace_process([str(python), "-c", trampoline, *command], env)


def cmd_completion(args: argparse.Namespace) -> int:
    from builder import completion

    print(completion.script(args.shell, make_parser()), end="")
    return 0


def cmd_fingerprint(args: argparse.Namespace) -> int:
    from builder import doctor, fingerprint, interpreters

    if args.compare:
        if args.python:
            raise UsageError("fingerprint takes --python or --compare A.json B.json, not both")
        a, b = (fingerprint.read(Path(p)) for p in args.compare)
        diffs = fingerprint.differences(a["parts"], b["parts"])
        for line in diffs:
            print(line)
        if not diffs:
            print(f"same fingerprint {a['fingerprint']}")
        return 1 if diffs else 0
    python = interpreters.python_arg(args.python) if args.python else doctor.default_python()
    facts, findings, _ = doctor.probe(python, deep=False)
    if facts is None:
        raise UsageError(findings[0].cause if findings else f"{python}: cannot be probed")
    doc = fingerprint.document(python, facts)
    print(json.dumps(doc, indent=2) if args.json else doc["fingerprint"])
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from builder import build, export

    pylock_out = Path(args.pylock) if args.pylock else None
    if pylock_out is not None:
        export.check_pylock_name(pylock_out)  # before any work
    s = _load_spec(args.spec)
    lock_file = _lock_file(s)
    lk = lock.read(lock_file, spec_name=s.name)
    build.check_lock(s, lk, lock_file)
    wheelhouse: Path | None = None
    if args.wheelhouse:
        wheelhouse = Path(args.wheelhouse).absolute()
    elif pylock_out is None:
        if lk.wheelhouse is None:
            raise UsageError(
                f"export needs --wheelhouse DIR or --pylock FILE: {lock_file} names its files by "
                "URL, so it has no wheelhouse of its own"
            )
        # The directory the index-neutral lock's paths name: filled, the lock installs as is.
        wheelhouse = (lock_file.parent / lk.wheelhouse).absolute()
    if args.with_jit and wheelhouse is None:
        raise UsageError(
            "--with-jit puts the env's JIT results into a wheelhouse: add --wheelhouse DIR"
        )
    if wheelhouse is not None:
        platform = _known_platform(args.platform)
        out = export.export(s, lk, wheelhouse, _progress, platform=platform)
        _progress(
            f"wrote {out}: {len(lk.packages)} files, every sha256 checked against {lock_file}"
        )
    if args.with_jit:
        assert wheelhouse is not None
        env_dir = (Path(args.env_dir) if args.env_dir else build.default_env_dir(s)).absolute()
        carried = export.export_jit(env_dir, wheelhouse)
        _progress(
            f"carried {carried} JIT result(s) of {env_dir} into {wheelhouse / export.JIT_DIR}: "
            "`cudaenv build --offline --wheelhouse` places them in the machine's store"
        )
    if pylock_out is not None:
        _progress(f"asking uv for the URL of every file of {lock_file} on this machine's index")
        command = _command(["export", str(args.spec), "--pylock", str(pylock_out)])
        export.export_pylock(s, lk, pylock_out, command=command)
        _progress(
            f"wrote {pylock_out}: {len(lk.packages)} packages, every sha256 as in {lock_file}"
        )
    return 0


# --------------------------------------------------------------------------- matrix, report


def _read_baseline(path: str) -> report.MatrixReport:
    from builder import report

    rep = report.read_report(Path(path))
    if not isinstance(rep, report.MatrixReport):
        raise ReportError(
            f"{path}: --baseline needs a matrix report (matrix.json), not a verify report"
        )
    return rep


def cmd_matrix(args: argparse.Namespace) -> int:
    from builder import matrix, report

    if args.jobs < 1:
        raise UsageError(f"-j {args.jobs}: run at least one cell at a time")
    # Checked before any cell runs: a typo must not cost a matrix run.
    baseline = _read_baseline(args.baseline) if args.baseline else None
    mx = matrix.load(Path(args.file))
    if args.cell:
        # One cell, run and judged exactly as in the whole matrix (a refused cell is a
        # result, exit 0): what a CI job per cell runs, so both agree.
        mx = dataclasses.replace(mx, cells=(mx.cell(args.cell),))
    if args.emit == "github":
        # One line: what `echo "matrix=$(...)" >> "$GITHUB_OUTPUT"` needs.
        print(json.dumps(matrix.github_matrix(mx), separators=(",", ":")))
        return 0
    out = Path(args.out) if args.out else mx.root / "report"
    _progress(f"matrix {mx.name}: {len(mx.cells)} cells, {args.jobs} at a time; logs in {out}/logs")
    results = matrix.run(mx, out, jobs=args.jobs, fail_fast=args.fail_fast, progress=_progress)
    rep = matrix.matrix_report(mx.name, results, out)
    found = report.regressions(baseline, rep) if baseline else []
    written = report.write_matrix_outputs(rep, out, found)
    _progress("reports: " + ", ".join(str(p) for p in written))
    print(f"matrix {mx.name}: " + ", ".join(f"{r.cell.name}={r.status}" for r in results))
    if baseline is not None:
        for r in found:
            print(f"regression: {r}")
        return 1 if found else 0
    return 0 if rep.status == "passed" else 1


def cmd_report_merge(args: argparse.Namespace) -> int:
    from builder import report

    reports = [report.read_report(Path(p)) for p in args.reports]
    merged = report.merge(reports, name=args.name)
    written = report.write_matrix_outputs(merged, Path(args.out))
    _progress("reports: " + ", ".join(str(p) for p in written))
    return 0


# --------------------------------------------------------------------------- the parser


def _sub(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    summary: str,
    description: str,
    example: str,
) -> argparse.ArgumentParser:
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


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cudaenv",
        description=DESCRIPTION,
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
    lk.set_defaults(func=cmd_lock)

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
    pl.set_defaults(func=cmd_plan)

    bd = _sub(
        sub,
        "build",
        "build the env of each spec from its lock",
        "Install the spec's lock (hash-checked) into a venv built beside .envs/NAME and swapped "
        "in whole when complete, then wire cuda-home/ and the start-up hook. A failed or "
        "interrupted build leaves the previous env intact. A missing lock is resolved first. "
        "--platform linux-aarch64 on an x86_64 machine (or the reverse) assembles that "
        "machine's env without running any of it: its wheels unpacked hash-checked, cuda-home/ "
        "and the hook, each compiler binary checked to be that machine's.",
        "cudaenv build --verify envspecs/default.yaml",
    )
    bd.add_argument("specs", nargs="+", type=Path, metavar="SPEC", help=SPEC_HELP)
    bd.add_argument("--env-dir", help="where the env goes (default .envs/NAME); one spec only")
    bd.add_argument("--force", action="store_true", help="rebuild even if the env is up to date")
    bd.add_argument("--verify", action="store_true", help="run `cudaenv verify` on each env built")
    bd.add_argument("--report", help="with --verify: write the JSON report here")
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
    bd.set_defaults(func=cmd_build)

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
    ex.set_defaults(func=cmd_export)

    vf = _sub(
        sub,
        "verify",
        "prove an env works: compile and run real kernels",
        "Run the checks (toolchain, kernel-compile, flashinfer-jit, cubin, sampling) on a spec's "
        "built env, or on any interpreter with --python. A check that cannot run here (no GPU) "
        "says skipped with the reason. A failed check exits 5; a missing tool 6.",
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
    vf.add_argument("--report", help="write the JSON report here")
    vf.add_argument("--markdown", help="write the Markdown report here")
    vf.set_defaults(func=cmd_verify)

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
    dr.add_argument("--deep", action="store_true", help="also import FlashInfer and torch there")
    dr.add_argument("--json", action="store_true", help="print JSON instead of the report")
    dr.set_defaults(func=cmd_doctor)

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
        "resolve without breaking the env's own pins.",
        "cudaenv adopt --python .venv/bin/python --dry-run",
    )
    ad.add_argument("--python", required=True, help="the env's interpreter or directory")
    ad.add_argument("--archs", help="arch list for the JIT (default: 12.0f plus visible GPUs)")
    ad.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    ad.add_argument("--undo", action="store_true", help="put the env back as before adopt")
    ad.add_argument("--force", action="store_true", help="also adopt a system or distro Python")
    ad.add_argument("--no-verify", action="store_true", help="skip the verify that follows")
    ad.set_defaults(func=cmd_adopt)

    ls = _sub(
        sub,
        "list",
        "the envs built here",
        "Each env under .envs/: its spec, whether it matches the spec's current lock, its size "
        "on disk (and how much of it no other env or uv's cache shares), its last verify.",
        "cudaenv list --json",
    )
    ls.add_argument("--json", action="store_true", help="print JSON, for scripts")
    ls.set_defaults(func=cmd_list)

    rm_ = _sub(
        sub,
        "remove",
        "delete built envs",
        "Delete each named env (a name under .envs/ or an env directory) whole; a build of it "
        "in progress is waited for.",
        "cudaenv remove sglang-0.5.23-cu130",
    )
    rm_.add_argument("names", nargs="+", metavar="NAME")
    rm_.set_defaults(func=cmd_remove)

    rn = _sub(
        sub,
        "run",
        "run a command in an env without activating it",
        "Run CMD with the env's bin/ first on PATH and every setting of its start-up hook "
        "(CUDA_HOME, arch lists, JIT caches, ...), exactly as its own python sees them; the "
        "exit status is the command's.",
        "cudaenv run sglang-0.5.23-cu130 -- nvcc --version",
    )
    rn.add_argument("name", metavar="NAME")
    rn.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    rn.set_defaults(func=cmd_run)

    co = _sub(
        sub,
        "completion",
        "print shell completion for bash, zsh or fish",
        "Print a completion script for cudaenv's commands and options. bash: add "
        "`source <(cudaenv completion bash)` to ~/.bashrc; zsh: the same with zsh in ~/.zshrc; "
        "fish: `cudaenv completion fish > ~/.config/fish/completions/cudaenv.fish`.",
        "cudaenv completion bash",
    )
    co.add_argument("shell", choices=["bash", "zsh", "fish"])
    co.set_defaults(func=cmd_completion)

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
    fp.set_defaults(func=cmd_fingerprint)

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
    mx.set_defaults(func=cmd_matrix)

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
    mg.set_defaults(func=cmd_report_merge)
    return p


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Turn SIGTERM into an exception so the build's cleanup runs (build.py).
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    global QUIET_PROGRESS
    parser = make_parser()
    args = parser.parse_args(argv)
    debug = bool(getattr(args, "debug", False))
    QUIET_PROGRESS = bool(getattr(args, "quiet", False))
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        format="cudaenv: %(message)s",
    )
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        rc: int = args.func(args)
        return rc
    except CudaenvError as exc:
        if debug:
            raise
        if isinstance(exc, SpecError):
            for problem in exc.problems:
                print(f"error: {problem}", file=sys.stderr)
            print(
                f"error: {len(exc.problems)} problem(s) in the {exc.what}; nothing was done",
                file=sys.stderr,
            )
        else:
            print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        from builder import build

        note = build.interrupt_note[-1] if build.interrupt_note else "nothing was built"
        print(f"error: interrupted; {note}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
