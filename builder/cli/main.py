"""The command line: parse (the command table is builder/cli/parser.py, each command's arguments
a dataclass of builder/commands/args.py), call one use case, print its result, exit. Errors
raised below become one line and an exit code here (``reporter.run_main``)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from builder.cli import parser as cliargs
from builder.commands import add, pipeline
from builder.commands import args as ca
from builder.commands import audit as auditrun
from builder.commands import build as buildrun
from builder.commands import export as exportrun
from builder.commands import store as storerun
from builder.commands import verify as verifyrun
from builder.commands.options import Command
from builder.core import context, paths, proc, settings
from builder.core.errors import UsageError, VerifyFailed
from builder.core.reporter import Reporter, flushed, run_main
from builder.env import envs
from builder.machine import archs, interpreters, targets
from builder.spec import project

# report, doctor, warm, completion: imported where used (imports are most of a build's own time)

make_parser = cliargs.make_parser


def _rows(title: str, rows: Sequence[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(title)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _archs(text: str | None) -> tuple[archs.Arch, ...] | None:
    return pipeline.parse_archs(text) if text else None


def cmd_lock(args: ca.LockArgs, say: Reporter) -> int:
    for path in args.specs:
        pipeline.lock_spec(path, args.upgrade, args.upgrade_package, args.exclude_newer, say)
    return 0


def cmd_plan(args: ca.PlanArgs, say: Reporter) -> int:
    planned = pipeline.plan(
        args.spec, fresh=args.fresh, platform=args.platform, targets_file=args.targets, reporter=say
    )
    if args.json:
        print(json.dumps(planned.to_json(), indent=2))
        return 0
    title = f"# plan for {planned.spec.name} from {planned.origin}; nothing installed"
    _rows(title, planned.rows())
    return 0


def cmd_init(args: ca.InitArgs, say: Reporter) -> int:
    from builder.commands import init

    request = init.make_request(
        with_=list(args.with_),
        gpu=list(args.gpu),
        cuda=args.cuda,
        name=args.name,
        out=args.out,
        argv=args.argv(),
        targets_file=args.targets,
        exclude_newer=args.exclude_newer,
    )
    done = init.init(request, say)
    lk = done.locked.lock
    platform = done.box.platform if done.box.platform in lk.platforms else lk.platforms[0]
    rows = [("lock", str(done.locked.path))]
    rows += pipeline.plan_table(done.spec, lk, platform, done.box.driver)
    _rows(
        f"# {done.spec_path}: CUDA {done.choice.cuda}, locked in {done.locked.seconds:.1f} s", rows
    )
    print("next:")
    print(f"  cudaenv build --verify {done.spec_path}")
    print(f"  cudaenv audit {done.spec_path}   (can each prebuilt binary run on this box's GPUs?)")
    return 0


def cmd_build(args: ca.BuildArgs, say: Reporter) -> int:
    for request in buildrun.requests(args):
        built, verified = buildrun.build_and_verify(
            request, say, show=(lambda _text: None) if args.json else print
        )
        if args.json:
            print(json.dumps(built.to_json(verified), indent=2))
        if verified is not None:
            verifyrun.raise_verdict(verified)
    return 0


def cmd_verify(args: ca.VerifyArgs, say: Reporter) -> int:
    _verify(verifyrun.request(args), say, args.report, args.markdown)
    return 0


def _verify(
    request: verifyrun.VerifyRequest,
    say: Reporter,
    report_path: Path | None = None,
    markdown: Path | None = None,
) -> None:
    from builder.verify import report

    target, found = verifyrun.verify_target(request)
    rep = verifyrun.verify_and_report(
        target, found, say, report_path=report_path, markdown_path=markdown
    )
    print(report.terminal(rep))
    verifyrun.raise_verdict(rep)


def cmd_doctor(args: ca.DoctorArgs, say: Reporter) -> int:
    from builder.doctor import diagnose as doctor

    python = interpreters.python_arg(args.python) if args.python else doctor.default_python()
    targets = _archs(args.archs) or ()
    facts, findings, seconds = doctor.probe(python, deep=args.deep, target_archs=targets)
    if args.json:
        print(json.dumps(doctor.to_json(python, facts, findings, seconds), indent=2))
    else:
        print(doctor.render(python, facts, findings))
    return 1 if any(f.severity == doctor.ERROR for f in findings) else 0


def cmd_adopt(args: ca.AdoptArgs, say: Reporter) -> int:
    from builder.adopt import rebuild
    from builder.adopt import repair as adopt

    wanted, build_env = rebuild.arguments(args.rebuild, args.build_env, undo=args.undo)
    if args.undo:
        adopt.undo_adopt(interpreters.python_arg(args.python), say)
        return 0
    python = interpreters.python_arg(args.python)
    request = adopt.AdoptRequest(
        python=python,
        given=args.python,
        env_archs=_archs(args.archs),
        dry_run=args.dry_run,
        force=args.force,
        driver_check=not args.no_driver_check,
        rebuild=wanted,
        build_env=build_env,
    )
    if adopt.adopt(request, say, show=print) is not None and not args.no_verify:
        _verify(verifyrun.VerifyRequest(python=str(python)), say)
    return 0


def cmd_list(args: ca.ListArgs, say: Reporter) -> int:
    found = envs.listing()
    if args.json:
        print(json.dumps([e.to_json() for e in found], indent=2))
        return 0
    print(envs.where())
    print("\n".join(e.line() for e in found) if found else "no envs built")
    return 0


def cmd_remove(args: ca.RemoveArgs, say: Reporter) -> int:
    # Every name is checked before anything is deleted: one typo removes nothing.
    paths = [envs.resolve(name) for name in args.names]
    for path in dict.fromkeys(paths):
        say(envs.remove(path))
    return 0


def cmd_run(args: ca.RunArgs, say: Reporter) -> int:
    envs.run(args.name, args.command)  # replaces this process; returns only by raising


def cmd_completion(args: ca.CompletionArgs, say: Reporter) -> int:
    from builder.cli import completion

    if args.env_names:
        for name in envs.names():
            print(name)
        return 0
    if args.shell is None:
        raise UsageError("completion needs a shell: `cudaenv completion bash` (or zsh, fish)")
    print(completion.script(args.shell, make_parser()), end="")
    return 0


def cmd_audit(args: ca.AuditArgs, say: Reporter) -> int:
    done = auditrun.run_audit(auditrun.request(args), args.targets, say)
    print(done.text(as_json=args.json))
    if args.markdown:
        proc.atomic_write_text(args.markdown, done.markdown())
    failure = done.failure()
    if failure is not None:
        raise VerifyFailed(failure)
    return 0


def cmd_target(args: ca.TargetArgs, say: Reporter) -> int:
    found = targets.this_node(name=args.name, cc=args.cc, driver_version=args.driver,
                              required=args.required, platform=args.platform)  # fmt: skip
    if not args.out:
        print(targets.render_file(found), end="")
        return 0
    added, kept = targets.add_to_file(args.out, found)
    for t in added:
        say(f"added {t.label} to {args.out}")
    for t in kept:
        say(f"{t.label} is in {args.out} already")
    return 0


def cmd_compat(args: ca.CompatArgs, say: Reporter) -> int:
    from builder.commands import compat

    table = compat.tabulate(list(args.specs), args.targets, say)
    print(json.dumps(table.to_json(), indent=2) if args.json else compat.text(table))
    if args.markdown:
        proc.atomic_write_text(args.markdown, compat.markdown(table))
    if args.html:
        proc.atomic_write_text(args.html, compat.html(table))
    return 0


def cmd_fingerprint(args: ca.FingerprintArgs, say: Reporter) -> int:
    from builder.doctor import diagnose as doctor
    from builder.doctor import fingerprint

    if args.compare:
        if args.python:
            raise UsageError("fingerprint takes --python or --compare A.json B.json, not both")
        a, b = (fingerprint.read(Path(p)) for p in args.compare)
        diffs = fingerprint.differences(a.parts, b.parts)
        print("\n".join(diffs) if diffs else f"same fingerprint {a.fingerprint}")
        return 1 if diffs else 0
    python = interpreters.python_arg(args.python) if args.python else doctor.default_python()
    facts, findings, _ = doctor.probe(python, deep=False)
    if facts is None:
        raise UsageError(findings[0].cause if findings else f"{python}: cannot be probed")
    doc = fingerprint.document(python, facts)
    print(json.dumps(doc.to_json(), indent=2) if args.json else doc.fingerprint)
    return 0


def cmd_export(args: ca.ExportArgs, say: Reporter) -> int:
    exportrun.export(args, say)
    return 0


def cmd_matrix(args: ca.MatrixArgs, say: Reporter) -> int:
    from builder.commands import matrix
    from builder.spec import matrixfile

    if args.emit == "github":
        # One line: what `echo "matrix=$(...)" >> "$GITHUB_OUTPUT"` needs.
        mx, _ = matrix.prepare(args)
        print(json.dumps(matrixfile.github_matrix(mx), separators=(",", ":")))
        return 0
    done = matrix.run_matrix(args, say)
    print(f"matrix {done.name}: " + ", ".join(f"{r.cell.name}={r.status}" for r in done.results))
    for r in done.regressions or ():
        print(f"regression: {r}")
    return done.exit_code


def cmd_report_merge(args: ca.ReportMergeArgs, say: Reporter) -> int:
    from builder.verify import report

    reports = [report.read_report(Path(p)) for p in args.reports]
    merged = report.merge(reports, name=args.name)
    written = report.write_matrix_outputs(merged, Path(args.out))
    say("reports: " + ", ".join(str(p) for p in written))
    return 0


def cmd_store_list(args: ca.StoreListArgs, say: Reporter) -> int:
    print(storerun.listing(args.spec).text(as_json=args.json))
    return 0


def cmd_store_verify(args: ca.StoreVerifyArgs, say: Reporter) -> int:
    storerun.verify_store(say, show=print)
    return 0


def cmd_store_gc(args: ca.StoreGcArgs, say: Reporter) -> int:
    done = storerun.gc(args.max)
    for note in done.notes:
        say(f"warning: {note}")
    say(done.summary())
    return 0


def cmd_store_push(args: ca.StorePushArgs, say: Reporter) -> int:
    pushed, warnings, tag = storerun.store_push(args.spec, args.env_dir)
    for w in warnings:
        say(f"warning: {w}")
    say(f"pushed {pushed} entr{'y' if pushed == 1 else 'ies'} and the list {tag}")
    return 0 if pushed or not warnings else 1


def cmd_store_pull(args: ca.StorePullArgs, say: Reporter) -> int:
    added, warnings, tag = storerun.store_pull(args.spec)
    for w in warnings:
        say(f"warning: {w}")
    say(f"added {added} entr{'y' if added == 1 else 'ies'} listed under {tag} to the store")
    return 1 if warnings and not added else 0


def cmd_warm(args: ca.WarmArgs, say: Reporter) -> int:
    from builder.commands import warm as warmrun

    return warmrun.outcome(warmrun.warm(warmrun.request(args), say), say, args.json, print)


def cmd_add(args: ca.AddArgs, say: Reporter) -> int:
    add.add(args.spec, list(args.packages), say, verify=not args.no_verify, show=print)
    return 0


# Each command's handler, by the dataclass of its arguments (the parser names that type for
# each command, so nothing here is a string to keep in step; a test checks both ways).
HANDLERS: dict[type[Command], Callable[[Any, Reporter], int]] = {
    ca.LockArgs: cmd_lock,
    ca.InitArgs: cmd_init,
    ca.TargetArgs: cmd_target,
    ca.CompatArgs: cmd_compat,
    ca.PlanArgs: cmd_plan,
    ca.BuildArgs: cmd_build,
    ca.ExportArgs: cmd_export,
    ca.VerifyArgs: cmd_verify,
    ca.DoctorArgs: cmd_doctor,
    ca.AdoptArgs: cmd_adopt,
    ca.ListArgs: cmd_list,
    ca.RemoveArgs: cmd_remove,
    ca.RunArgs: cmd_run,
    ca.CompletionArgs: cmd_completion,
    ca.FingerprintArgs: cmd_fingerprint,
    ca.AuditArgs: cmd_audit,
    ca.MatrixArgs: cmd_matrix,
    ca.ReportMergeArgs: cmd_report_merge,
    ca.AddArgs: cmd_add,
    ca.StoreListArgs: cmd_store_list,
    ca.StoreVerifyArgs: cmd_store_verify,
    ca.StoreGcArgs: cmd_store_gc,
    ca.StorePushArgs: cmd_store_push,
    ca.StorePullArgs: cmd_store_pull,
    ca.WarmArgs: cmd_warm,
}


def main(argv: Sequence[str] | None = None) -> int:
    # What a command resolves once (the driver, the project's pyproject.toml, the JIT remote)
    # lives as long as this command: core/context.py.
    with context.command():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    try:
        parsed = cliargs.parse(make_parser(), argv)
    except SystemExit as exc:
        # --help, --version and usage errors end in argparse; flushed here, so a reader that
        # left early (`cudaenv --help | head -1`) is 141, not a BrokenPipeError at exit.
        return flushed(exc.code if isinstance(exc.code, int) else 2)
    args = parsed.args
    say = Reporter(quiet=parsed.quiet)
    logging.basicConfig(
        level=logging.DEBUG if parsed.debug else logging.WARNING,
        format="cudaenv: %(message)s",
    )
    handler = HANDLERS[type(args)]
    # One line naming the project root where it is not the current directory and the command
    # may pick an env there for the user (.envs/NAME): `cd envspecs && cudaenv verify
    # default.yaml` says which .envs/ it reads.
    if args.picks_env():
        root = paths.project_root()
        if root is not None and root != paths.current_dir():
            say(f"project root {root} (envs in {paths.envs_dir()})")

    def body() -> int:
        found = settings.establish(debug=parsed.debug, quiet=parsed.quiet)  # before any work
        if parsed.debug:  # each setting and where it came from
            settings.show(project.applied(found, getattr(args, "spec", None)))
        return handler(args, say)

    return run_main(body, say, debug=parsed.debug)


if __name__ == "__main__":
    sys.exit(main())
