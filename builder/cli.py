"""The command line: parse (the command table is builder/cliargs.py), call the pipeline,
print, exit. The only place that prints errors and exits."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from builder import archs, cliargs, driver, pipeline, proc, variables
from builder.errors import ReportError, UsageError, VerifyFailed
from builder.reporter import Reporter, run_main

if TYPE_CHECKING:
    from builder import report

# build, verify, report, doctor and export pull in jinja2 and more: they are imported by the
# commands that use them, so `cudaenv lock` and `plan` start in a few milliseconds.

log = logging.getLogger("cudaenv")

make_parser = cliargs.make_parser


def cmd_lock(args: argparse.Namespace, say: Reporter) -> int:
    for path in args.specs:
        done = pipeline.write_lock(
            path, upgrade=args.upgrade, upgrade_packages=args.upgrade_package, reporter=say
        )
        lk = done.lock
        per_platform = ", ".join(f"{len(lk.packages_on(p))} packages for {p}" for p in lk.platforms)
        say(
            f"wrote {done.path} ({per_platform}), torch {lk.torch or '-'} "
            f"(CUDA {lk.torch_cuda or '-'}), cuda-toolkit {lk.toolkit or '-'} "
            f"in {done.seconds:.1f} s"
        )
        s = pipeline.load_spec(path)
        if s.targets:
            # A lock is never refused for its targets (build refuses the required ones): it
            # says which the new set cannot serve.
            for v in pipeline.judge_targets(s, lk, s.targets, say).failures:
                say(f"warning: target {v.line()}")
    return 0


def cmd_plan(args: argparse.Namespace, say: Reporter) -> int:
    s = pipeline.load_spec(args.spec)
    lk, origin = pipeline.current_lock(s, fresh=args.fresh)
    platform = pipeline.plan_platform(s, lk, args.platform)
    path = pipeline.lock_file(s)
    found = driver.detect()
    rows = [("lock", str(path) if path.exists() else f"{path} (not written yet)")]
    rows += pipeline.plan_table(s, lk, platform, found)
    fleet = pipeline.fleet_of(s, Path(args.targets) if args.targets else None)
    judged = pipeline.judge_targets(s, lk, fleet, say).verdicts if fleet else ()
    rows += [(f"target {v.target.name}", v.line().split(": ", 1)[1]) for v in judged]
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
            "cuda": str(s.cuda),
            "torch": lk.torch,
            "torch_cuda": lk.torch_cuda,
            "toolkit": lk.toolkit,
            "archs": archs.texts(s.archs),
            "driver": found.to_json() if found is not None else None,
            "driver_needed": (
                driver.minimum_driver(s.cuda_version)
                if s.cuda_major in driver.MINIMUM_DRIVER
                else None
            ),
            "driver_runs": (
                found.runs(s.cuda_version)
                if found is not None and s.cuda_major in driver.MINIMUM_DRIVER
                else None
            ),
            "packages": {p.name: p.version for p in lk.packages_on(platform)},
            "targets": [v.to_json() for v in judged],
        }
        print(json.dumps(doc, indent=2))
        return 0
    width = max(len(k) for k, _ in rows)
    print(f"# plan for {s.name} from {origin}; nothing installed")
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def cmd_init(args: argparse.Namespace, say: Reporter) -> int:
    from builder import init

    argv = [f"--with={w}" for w in args.with_] + [f"--gpu={g}" for g in args.gpu]
    argv += [f"--{k}={v}" for k, v in (("cuda", args.cuda), ("name", args.name)) if v]
    request = init.make_request(
        with_=args.with_,
        gpu=args.gpu,
        cuda=args.cuda,
        name=args.name,
        out=args.out,
        argv=argv + [f"--{k}={v}" for k, v in (("out", args.out), ("targets", args.targets)) if v],
        targets_file=args.targets,
    )
    done = init.init(request, say)
    lk = done.locked.lock
    platform = done.box.platform if done.box.platform in lk.platforms else lk.platforms[0]
    rows = [("lock", str(done.locked.path))]
    rows += pipeline.plan_table(done.spec, lk, platform, done.box.driver)
    width = max(len(k) for k, _ in rows)
    print(f"# {done.spec_path}: CUDA {done.choice.cuda}, locked in {done.locked.seconds:.1f} s")
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("next:")
    print(f"  cudaenv build --verify {done.spec_path}")
    if "audit" in HANDLERS:
        print(
            f"  cudaenv audit {done.spec_path}   (can each prebuilt binary run on this box's GPUs?)"
        )
    return 0


def cmd_build(args: argparse.Namespace, say: Reporter) -> int:
    if args.env_dir and len(args.specs) > 1:
        raise UsageError("--env-dir takes one spec")
    for path in args.specs:
        request = pipeline.BuildRequest(
            spec=str(path),
            env_dir=Path(args.env_dir) if args.env_dir else None,
            force=args.force,
            verify=args.verify,
            report=Path(args.report) if args.report else None,
            record=Path(args.record) if args.record else None,
            relock=args.relock,
            wheelhouse=Path(args.wheelhouse) if args.wheelhouse else None,
            offline=args.offline,
            platform=args.platform,
            no_driver_check=args.no_driver_check,
            keep_going=args.keep_going,
            no_target_check=args.no_target_check,
        )
        built, verified = pipeline.build_and_verify(
            request, say, show=(lambda _text: None) if args.json else print
        )
        if args.json:
            print(json.dumps(built.to_json(verified), indent=2))
        if verified is not None:
            pipeline.raise_verdict(verified)
    return 0


def print_summary(rep: report.VerifyReport) -> None:
    from builder import report

    print(report.terminal(rep))


def cmd_verify(args: argparse.Namespace, say: Reporter) -> int:
    from builder import verify

    request = pipeline.VerifyRequest(
        spec=str(args.spec) if args.spec is not None else None,
        python=args.python,
        env_dir=Path(args.env_dir) if args.env_dir else None,
        checks=verify.parse_checks(args.checks) if args.checks else None,
        archs=pipeline.parse_archs(args.archs) if args.archs else None,
        fresh=args.fresh,
        keep_going=args.keep_going,
    )
    report = Path(args.report) if args.report else None
    _verify(request, say, report, Path(args.markdown) if args.markdown else None)
    return 0


def _verify(
    request: pipeline.VerifyRequest,
    say: Reporter,
    report: Path | None = None,
    markdown: Path | None = None,
) -> None:
    target, found = pipeline.verify_target(request)
    rep = pipeline.verify_and_report(target, found, say, report_path=report, markdown_path=markdown)
    print_summary(rep)
    pipeline.raise_verdict(rep)


# --------------------------------------------------------------------------- doctor, export


def cmd_doctor(args: argparse.Namespace, say: Reporter) -> int:
    from builder import doctor, interpreters

    python = interpreters.python_arg(args.python) if args.python else doctor.default_python()
    targets = pipeline.parse_archs(args.archs) if args.archs else ()
    facts, findings, seconds = doctor.probe(python, deep=args.deep, target_archs=targets)
    if args.json:
        print(json.dumps(doctor.to_json(python, facts, findings, seconds), indent=2))
    else:
        print(doctor.render(python, facts, findings))
    return 1 if any(f.severity == doctor.ERROR for f in findings) else 0


def cmd_adopt(args: argparse.Namespace, say: Reporter) -> int:
    import contextlib

    from builder import adopt, interpreters

    python = interpreters.python_arg(args.python)
    found = adopt.inspect(python)
    if args.undo:
        # No journal: nothing to put back, the end state asked for holds. 0, as uv and pixi
        # answer a removal of what is not there; a script may run --undo twice.
        if adopt.read_journal(found.prefix) is None:
            say(adopt.nothing_to_undo(found))
            return 0
        with adopt.locked(found.prefix, say, holder="cudaenv adopt --undo"):
            journal = adopt.read_journal(found.prefix)
            if journal is None:  # the holder waited for undid it
                say(adopt.nothing_to_undo(found))
                return 0
            if journal.state == "undoing":
                say(f"an undo of {found.prefix} did not finish: finishing it")
            for line in adopt.undo(found.prefix, python, say):
                say(line)
        say(f"{found.prefix} is as it was before adopt")
        return 0
    if not args.dry_run:
        adopt.preflight(found)  # a read-only env named as such, not by the lock it cannot make
    # A dry run changes nothing, so it takes no lock (which would add the lock file).
    with contextlib.nullcontext() if args.dry_run else adopt.locked(found.prefix, say):
        if not args.dry_run:
            found = adopt.inspect(python)  # as it is now that no other adopt changes it
        journal = adopt.read_journal(found.prefix)
        if journal is not None and journal.state == "done":
            say(
                f"{found.prefix} is adopted already; `cudaenv adopt --undo --python "
                f"{args.python}` first to adopt it again"
            )
            return 0
        if journal is not None and args.dry_run:
            say(f"a previous adopt of {found.prefix} did not finish: adopt undoes it first")
        elif journal is not None:
            # A run killed outright: put the env back as it was, then adopt from there.
            say(f"a previous adopt of {found.prefix} did not finish: undoing it first")
            adopt.undo(found.prefix, python, say)
            found = adopt.inspect(python)
        env_archs = pipeline.parse_archs(args.archs) if args.archs else None
        planned = adopt.plan(found, env_archs=env_archs, force=args.force)
        if not args.no_driver_check:
            # Before anything changes, as build does: torch's CUDA is what the env must run.
            say(
                driver.require(
                    planned.spec.cuda_version,
                    driver.detect(),
                    needs=f"torch {found.torch} in {found.prefix}",
                    older="a torch built",
                )
            )
        for line in planned.lines():
            print(line)
        if args.dry_run:
            print("(dry run: nothing changed)")
            return 0
        built = adopt.apply(planned, say)
    say(
        f"adopted {found.prefix}: nvcc {built.nvcc} in cuda-home/, archs "
        f"{archs.flashinfer_spelling(built.archs)}; `cudaenv adopt --undo` reverts"
    )
    if not args.no_verify:
        _verify(pipeline.VerifyRequest(python=str(python)), say)
    return 0


def cmd_list(args: argparse.Namespace, say: Reporter) -> int:
    from builder import envs

    found = envs.listing()
    if args.json:
        print(json.dumps([e.to_json() for e in found], indent=2))
        return 0
    print(envs.where())
    if not found:
        print("no envs built")
        return 0
    for e in found:
        # Names and specs come from the file system and the manifests: escaped, so none can
        # forge a line or send the terminal a control sequence.
        size = f"{envs.human(e.bytes_total)} ({envs.human(e.bytes_own)} not shared)"
        print(f"{envs.shown(e.name)}  spec {envs.shown(e.spec)}  lock {e.lock_state}  {size}  "
              f"last verify {e.verified or 'never'}"
              + (f"  [{envs.shown(e.platform)}]" if e.platform else ""))  # fmt: skip
    return 0


def cmd_remove(args: argparse.Namespace, say: Reporter) -> int:
    from builder import envs

    # Every name is checked before anything is deleted: one typo removes nothing.
    paths = [envs.resolve(name) for name in args.names]
    for path in dict.fromkeys(paths):
        say(envs.remove(path))
    return 0


def cmd_run(args: argparse.Namespace, say: Reporter) -> int:
    from builder import envs

    path = envs.runnable(args.name)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("run needs a command: `cudaenv run NAME -- CMD ARGS...`")
    # What starts in the env's interpreter (after its start-up hook has run): it becomes the
    # command, or says why it cannot, as a shell does (127 not found, 126 found but not
    # runnable: not executable, a directory, ...), instead of a FileNotFoundError traceback.
    trampoline = """\
import os, sys
try:
    os.execvp(sys.argv[1], sys.argv[1:])
except OSError as exc:
    cmd = sys.argv[1] if sys.argv[1].isprintable() else repr(sys.argv[1])
    missing = isinstance(exc, FileNotFoundError)
    why = "command not found" if missing and "/" not in cmd else exc.strerror
    sys.stderr.write("error: %s: %s\\n" % (cmd, why))
    sys.exit(127 if missing else 126)
"""
    python = path / "bin" / "python"
    if not python.exists():
        raise UsageError(
            f"{envs.shown(str(path))} has no bin/python (assembled for another platform?)"
        )
    env = dict(os.environ)
    env["VIRTUAL_ENV"] = str(path)
    env["PATH"] = f"{path / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONHOME", None)
    # The env's interpreter starts (its start-up hook sets CUDA_HOME, the arch lists, the
    # caches, ...) and replaces itself with the command, which inherits exactly that.
    proc.replace_process([str(python), "-c", trampoline, *command], env)


def cmd_completion(args: argparse.Namespace, say: Reporter) -> int:
    from builder import completion, envs

    if args.env_names:
        for name in envs.names():
            print(name)
        return 0
    if args.shell is None:
        raise UsageError("completion needs a shell: `cudaenv completion bash` (or zsh, fish)")
    print(completion.script(args.shell, make_parser()), end="")
    return 0


def cmd_audit(args: argparse.Namespace, say: Reporter) -> int:
    from builder import audit

    if args.spec is not None and not (args.python or args.env_dir or args.archs):
        fleet_file = Path(args.targets) if args.targets else None
        if fleet_file is not None or pipeline.load_spec(args.spec).targets:
            return show_targets(pipeline.audit_targets(args.spec, fleet_file, say), args)
    if args.targets:
        raise UsageError(
            "--targets judges a SPEC's lock: it takes no --python, --env-dir or --archs"
        )

    request = pipeline.AuditRequest(
        spec=str(args.spec) if args.spec is not None else None,
        python=args.python,
        env_dir=Path(args.env_dir) if args.env_dir else None,
        archs=pipeline.parse_archs(args.archs) if args.archs else None,
        probe=not args.no_probe,
    )
    done = pipeline.audit(request, say)
    print(json.dumps(done.to_json(), indent=2) if args.json else audit.render(done))
    if args.markdown:
        proc.atomic_write_text(Path(args.markdown), audit.markdown(done))
    if done.failures:
        raise VerifyFailed(f"audit: {len(done.failures)} required binary problem(s); see above")
    return 0


def show_targets(done: pipeline.Judged, args: argparse.Namespace) -> int:
    """A stack's verdict per target: the table (or JSON), a Markdown copy; exit 5 when one
    cannot run it."""
    from builder import fleet

    print(
        json.dumps(fleet.to_json(done.spec, done.lock, done.verdicts), indent=2)
        if args.json
        else fleet.render(done.spec, done.verdicts)
    )
    if getattr(args, "markdown", None):
        proc.atomic_write_text(Path(args.markdown), fleet.markdown(done.spec, done.verdicts))
    if done.failures:
        names = ", ".join(v.target.name for v in done.failures)
        raise VerifyFailed(
            f"{done.spec.name} cannot run on {len(done.failures)} target(s): {names}"
        )
    return 0


def cmd_target(args: argparse.Namespace, say: Reporter) -> int:
    from builder import targets

    found = targets.this_node(
        name=args.name, cc=args.cc, driver_version=args.driver, required=args.required
    )
    if not args.out:
        print(targets.render_file(found), end="")
        return 0
    added, kept = targets.add_to_file(Path(args.out), found)
    for t in added:
        say(f"added {t.label} to {args.out}")
    for t in kept:
        say(f"{t.label} is in {args.out} already")
    return 0


def cmd_compat(args: argparse.Namespace, say: Reporter) -> int:
    from builder import compat

    table = compat.tabulate(args.specs, Path(args.targets) if args.targets else None, say)
    print(json.dumps(table.to_json(), indent=2) if args.json else compat.text(table))
    if args.markdown:
        proc.atomic_write_text(Path(args.markdown), compat.markdown(table))
    if args.html:
        proc.atomic_write_text(Path(args.html), compat.html(table))
    return 0


def cmd_fingerprint(args: argparse.Namespace, say: Reporter) -> int:
    from builder import doctor, fingerprint, interpreters

    if args.compare:
        if args.python:
            raise UsageError("fingerprint takes --python or --compare A.json B.json, not both")
        a, b = (fingerprint.read(Path(p)) for p in args.compare)
        diffs = fingerprint.differences(a.parts, b.parts)
        for line in diffs:
            print(line)
        if not diffs:
            print(f"same fingerprint {a.fingerprint}")
        return 1 if diffs else 0
    python = interpreters.python_arg(args.python) if args.python else doctor.default_python()
    facts, findings, _ = doctor.probe(python, deep=False)
    if facts is None:
        raise UsageError(findings[0].cause if findings else f"{python}: cannot be probed")
    doc = fingerprint.document(python, facts)
    print(json.dumps(doc.to_json(), indent=2) if args.json else doc.fingerprint)
    return 0


def cmd_export(args: argparse.Namespace, say: Reporter) -> int:
    request = pipeline.ExportRequest(
        spec=str(args.spec),
        wheelhouse=Path(args.wheelhouse) if args.wheelhouse else None,
        pylock=Path(args.pylock) if args.pylock else None,
        with_jit=args.with_jit,
        env_dir=Path(args.env_dir) if args.env_dir else None,
        platform=args.platform,
    )
    pipeline.export(request, say)
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


def cmd_matrix(args: argparse.Namespace, say: Reporter) -> int:
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
    say(f"matrix {mx.name}: {len(mx.cells)} cells, {args.jobs} at a time; logs in {out}/logs")
    results = matrix.run(mx, out, jobs=args.jobs, fail_fast=args.fail_fast, progress=say)
    rep = matrix.matrix_report(mx.name, results, out)
    found = report.regressions(baseline, rep) if baseline else []
    written = report.write_matrix_outputs(rep, out, found)
    say("reports: " + ", ".join(str(p) for p in written))
    print(f"matrix {mx.name}: " + ", ".join(f"{r.cell.name}={r.status}" for r in results))
    if baseline is not None:
        for r in found:
            print(f"regression: {r}")
        return 1 if found else 0
    return 0 if rep.status == "passed" else 1


def cmd_report_merge(args: argparse.Namespace, say: Reporter) -> int:
    from builder import report

    reports = [report.read_report(Path(p)) for p in args.reports]
    merged = report.merge(reports, name=args.name)
    written = report.write_matrix_outputs(merged, Path(args.out))
    say("reports: " + ", ".join(str(p) for p in written))
    return 0


def cmd_store_list(args: argparse.Namespace, say: Reporter) -> int:
    from builder.probe import jit_store

    store = pipeline.jit_store_here()
    rows = store.listing()
    cap = jit_store.store_max()
    total = sum(r.size for r in rows)
    if args.json:
        doc = {
            "root": str(store.root),
            "cap": cap,
            "bytes": total,
            "entries": [dataclasses.asdict(r) for r in rows],
        }
        print(json.dumps(doc, indent=2))
        return 0
    for r in rows:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.last_used))
        print(
            f"{r.key[:16]}/{r.variant}  {r.kind:<9}  {_size(r.size):>10}  used {used}  "
            f"made for {r.made_for or '?'}"
        )
    print(f"{len(rows)} entries, {_size(total)} of {_size(cap)} in {store.root}")
    return 0


def _size(n: int) -> str:
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def cmd_store_verify(args: argparse.Namespace, say: Reporter) -> int:
    store = pipeline.jit_store_here()
    entries = store.all()
    from builder.verify import kernel_compile

    bad = kept = 0
    for key, variant in entries:
        problem = store.check(key, variant)
        if problem is None:
            # Consistent with its record; a kernel must also be one (a record says nothing
            # of who made the entry: docs, the store's trust rules).
            problem = kernel_compile.stored_kernel_problem(store.load(key, variant))
        if problem is not None:
            bad += 1
            kept += not store.discard(variant, problem)
            print(store.notes[-1])
    say(f"{len(entries) - bad} of {len(entries)} entries match their records in {store.root}")
    if bad:
        left = f"; {kept} could not be removed" if kept else ""
        raise VerifyFailed(
            f"the JIT store held {bad} damaged entr{'y' if bad == 1 else 'ies'}{left}"
        )
    return 0


def cmd_store_gc(args: argparse.Namespace, say: Reporter) -> int:
    from builder.probe import jit_store

    try:
        cap = jit_store.parse_size(args.max) if args.max else jit_store.store_max()
    except (ValueError, jit_store.StoreError) as exc:
        raise UsageError(f"--max: {exc}") from None
    store = pipeline.jit_store_here()
    removed, freed = store.gc(cap)
    for note in store.notes:
        say(f"warning: {note}")
    left = sum(store.size_of(v) for _, v in store.all())
    say(
        f"removed {len(removed)} item(s), {_size(freed)} freed; {_size(left)} left "
        f"(cap {_size(cap)})"
    )
    return 0


def cmd_store_push(args: argparse.Namespace, say: Reporter) -> int:
    pushed, warnings, tag = pipeline.store_push(
        args.spec, Path(args.env_dir) if args.env_dir else None
    )
    for w in warnings:
        say(f"warning: {w}")
    say(f"pushed {pushed} entr{'y' if pushed == 1 else 'ies'} and the list {tag}")
    return 0 if pushed or not warnings else 1


def cmd_store_pull(args: argparse.Namespace, say: Reporter) -> int:
    added, warnings, tag = pipeline.store_pull(args.spec)
    for w in warnings:
        say(f"warning: {w}")
    say(f"added {added} entr{'y' if added == 1 else 'ies'} listed under {tag} to the store")
    return 1 if warnings and not added else 0


def cmd_add(args: argparse.Namespace, say: Reporter) -> int:
    from builder import add

    add.add(args.spec, args.packages, say, verify=not args.no_verify)
    return 0


HANDLERS: dict[str, Callable[[argparse.Namespace, Reporter], int]] = {
    "lock": cmd_lock,
    "init": cmd_init,
    "target": cmd_target,
    "compat": cmd_compat,
    "plan": cmd_plan,
    "build": cmd_build,
    "export": cmd_export,
    "verify": cmd_verify,
    "doctor": cmd_doctor,
    "adopt": cmd_adopt,
    "list": cmd_list,
    "remove": cmd_remove,
    "run": cmd_run,
    "completion": cmd_completion,
    "fingerprint": cmd_fingerprint,
    "audit": cmd_audit,
    "matrix": cmd_matrix,
    "report_merge": cmd_report_merge,
    "add": cmd_add,
    "store_list": cmd_store_list,
    "store_verify": cmd_store_verify,
    "store_gc": cmd_store_gc,
    "store_push": cmd_store_push,
    "store_pull": cmd_store_pull,
}


def main(argv: Sequence[str] | None = None) -> int:
    from builder import paths
    from builder.reporter import flushed

    try:
        args = cliargs.parse(make_parser(), argv)
    except SystemExit as exc:
        # --help, --version and usage errors end in argparse; flushed here, so a reader that
        # left early (`cudaenv --help | head -1`) is 141, not a BrokenPipeError at exit.
        return flushed(exc.code if isinstance(exc.code, int) else 2)
    debug = bool(getattr(args, "debug", False))
    say = Reporter(quiet=bool(getattr(args, "quiet", False)))
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        format="cudaenv: %(message)s",
    )
    handler = HANDLERS[args.handler]
    # One line naming the project root where it is not the current directory and the command
    # may pick an env there for the user (.envs/NAME): `cd envspecs && cudaenv verify
    # default.yaml` says which .envs/ it reads.
    picks_env = args.handler in ("build", "verify", "audit", "export", "store_push", "matrix")
    if picks_env and not getattr(args, "env_dir", None) and not getattr(args, "python", None):
        root = paths.project_root()
        if root is not None and root != paths.current_dir():
            say(f"project root {root} (envs in {paths.envs_dir()})")

    def body() -> int:
        # Before any work: a timeout of nan or 0 would fail deep inside a check.
        variables.check_numbers(os.environ)
        return handler(args, say)

    return run_main(body, say, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
