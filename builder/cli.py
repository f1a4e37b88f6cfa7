"""argparse front end: the only place that prints errors and exits."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from builder import __version__, lock, resolve, spec

if TYPE_CHECKING:
    from builder import verify

# build, verify, report, doctor and export pull in jinja2 and more: they are imported by the
# commands that use them, so `cudaenv lock` and `plan` start in a few milliseconds.
from builder.errors import BuildError, CudaenvError, SpecError, VerifyFailed
from builder.proc import CommandFailed

log = logging.getLogger("cudaenv")


def _progress(msg: str) -> None:
    print(f"cudaenv: {msg}", file=sys.stderr, flush=True)


def _lock_file(s: spec.EnvSpec) -> Path:
    return s.source.parent / "locks" / f"pylock.{s.name}.toml"


def _command(argv: Sequence[str]) -> str:
    return shlex.join(["cudaenv", *argv])


def _load_spec(arg: Path | str) -> spec.EnvSpec:
    """A spec path, or MATRIX.yaml:CELL for one cell of a matrix (what CI runners get)."""
    text = str(arg)
    if ":" in text:
        from builder import matrix

        return spec.load(matrix.resolve_spec_arg(text))
    return spec.load(arg)


def cmd_lock(args: argparse.Namespace) -> int:
    for path in args.specs:
        s = _load_spec(path)
        _progress(f"resolving {s.name} ({path}) with uv")
        out = _lock_file(s)
        previous = None if args.upgrade else out
        plan = resolve.resolve(s, command=_command(["lock", str(path)]), previous=previous)
        lock.write(plan.lock, out)
        for note in plan.lock.notes:
            _progress(f"note: {note}")
        _progress(
            f"wrote {out}: {len(plan.lock.packages)} packages, torch {plan.lock.torch or '-'} "
            f"(CUDA {plan.lock.torch_cuda or '-'}), cuda-toolkit {plan.lock.toolkit or '-'} "
            f"in {plan.seconds:.1f} s"
        )
    return 0


def _current_lock(s: spec.EnvSpec, *, fresh: bool) -> tuple[lock.Lock, str]:
    path = _lock_file(s)
    if not fresh and path.exists():
        current = lock.read(path)
        if current.fingerprint == s.fingerprint():
            return current, f"{path} (up to date)"
        if not fresh:
            return resolve.resolve(s).lock, f"a fresh resolution ({path} is stale: re-lock)"
    return resolve.resolve(s).lock, "a fresh resolution"


def plan_table(s: spec.EnvSpec, lk: lock.Lock) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = [
        ("spec", f"{s.name} ({s.source})"),
        ("python", lk.python),
        ("platform", lk.platform),
        ("cuda (spec)", s.cuda),
        ("torch", lk.torch or "-"),
        ("torch's CUDA", lk.torch_cuda or "-"),
        (
            "cuda-toolkit",
            lk.toolkit or ("system: " + str(s.toolchain.path) if s.toolchain.path else "-"),
        ),
        ("archs", " ".join(s.archs)),
    ]
    interesting = ("nvidia-", "cuda-toolkit", "flashinfer", "sglang", "sgl-kernel", "triton")
    for p in lk.packages:
        if p.name.startswith(interesting) and p.name != "cuda-toolkit":
            rows.append((p.name, p.version))
    rows.append(("packages", str(len(lk.packages))))
    return rows


def cmd_plan(args: argparse.Namespace) -> int:
    s = _load_spec(args.spec)
    lk, origin = _current_lock(s, fresh=args.fresh)
    rows = plan_table(s, lk)
    width = max(len(k) for k, _ in rows)
    print(f"# plan for {s.name} from {origin}; nothing installed")
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from builder import build, export

    for path in args.specs:
        s = _load_spec(path)
        lock_file = _lock_file(s)
        if not lock_file.exists():
            if args.offline:
                raise BuildError(f"{lock_file} does not exist and --offline cannot resolve one")
            _progress(f"{lock_file} does not exist: resolving and writing it first")
            plan = resolve.resolve(s, command=_command(["lock", str(path)]))
            lock.write(plan.lock, lock_file)
        lk = lock.read(lock_file)
        started = time.monotonic()
        _progress(
            f"building {s.name}: python {s.python}, torch {lk.torch or '-'}, CUDA {s.cuda} "
            f"({s.toolchain.source} toolchain), archs {' '.join(s.archs)}"
        )
        env_dir = Path(args.env_dir) if args.env_dir else None
        wheelhouse = Path(args.wheelhouse).absolute() if args.wheelhouse else None
        if wheelhouse is not None:
            export.check_wheelhouse(lk, wheelhouse)  # before anything is built
        source = build.Source(wheelhouse=wheelhouse, offline=args.offline)
        result = build.build(
            s,
            lk,
            lock_file=lock_file,
            env_dir=env_dir,
            force=args.force,
            source=source,
            progress=_progress,
        )
        verb = "reused" if result.reused else "built"
        _progress(f"{verb} {result.path} in {time.monotonic() - started:.1f} s")
        print(result.path)
        if args.verify:
            verify_args = argparse.Namespace(
                spec=path,
                python=None,
                env_dir=str(result.path),
                checks=None,
                archs=None,
                report=args.report,
                markdown=None,
            )
            cmd_verify(verify_args)
    return 0


def _verify_target(args: argparse.Namespace) -> tuple[verify.Target, dict[str, object] | None]:
    from builder import build, channels, verify

    if args.spec is None and args.python is None:
        raise CudaenvError("verify needs a SPEC or --python PATH")
    if args.spec is not None:
        s = _load_spec(args.spec)
        env_dir = (Path(args.env_dir) if args.env_dir else build.default_env_dir(s)).absolute()
        if not (env_dir / build.MANIFEST).exists():
            raise BuildError(f"{env_dir} is not built; run `cudaenv build {args.spec}` first")
        manifest = build.read_manifest(env_dir)
        raw_archs = manifest.get("archs")
        archs = tuple(str(a) for a in raw_archs) if isinstance(raw_archs, list) else s.archs
        checks = s.verify
        return verify.Target(
            python=env_dir / "bin" / "python",
            archs=tuple(args.archs.split()) if args.archs else archs,
            work=env_dir / "var" / "cudaenv",
            env_dir=env_dir,
            expected_cuda=s.cuda,
            spec_name=s.name,
            checks=tuple(args.checks.split(",")) if args.checks else checks,
        ), manifest
    python = Path(args.python)
    if not python.exists():
        raise CudaenvError(f"{python}: no such interpreter")
    root = python.absolute().parent.parent
    found = build.read_manifest(root) if (root / build.MANIFEST).exists() else None
    archs_text = args.archs or os.environ.get("FLASHINFER_CUDA_ARCH_LIST") or "12.0f"
    key = hashlib.sha256(str(python.absolute()).encode()).hexdigest()[:12]
    extra = (("FLASHINFER_CUDA_ARCH_LIST", archs_text),)
    return verify.Target(
        python=python,
        archs=tuple(str(spec.Arch.parse(a)) for a in archs_text.split()),
        work=channels.cache_dir() / "verify" / key,
        env_dir=root if found else None,
        checks=tuple(args.checks.split(",")) if args.checks else spec.CHECKS,
        extra_env=extra,
    ), found


def cmd_verify(args: argparse.Namespace) -> int:
    from builder import report, verify

    target, manifest = _verify_target(args)
    started = time.monotonic()
    facts, results = verify.run_checks(target, target.checks, _progress)
    rep = report.verify_report(target, facts, results, time.monotonic() - started, manifest)
    print(report.terminal(rep))
    outputs = []
    if args.report:
        outputs.append(Path(args.report))
    elif target.env_dir is not None:
        outputs.append(target.env_dir / "var" / "cudaenv" / "verify.json")
    for out in outputs:
        report.write_json(rep, out)
        _progress(f"report: {out}")
    md = report.markdown(rep)
    if args.markdown:
        Path(args.markdown).write_text(md)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with Path(summary).open("a") as fh:
            fh.write(md + "\n")
    failed = [c.name for c in results if c.status == verify.FAILED]
    if failed:
        raise VerifyFailed(f"{len(failed)} check(s) failed: {', '.join(failed)}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from builder import doctor

    python = args.python or doctor.default_python()
    facts, findings, seconds = doctor.probe(python, deep=args.deep)
    if args.json:
        print(json.dumps(doctor.to_json(python, facts, findings, seconds), indent=2))
    else:
        print(doctor.render(python, facts, findings))
    return 1 if any(f.severity == doctor.ERROR for f in findings) else 0


def cmd_export(args: argparse.Namespace) -> int:
    from builder import build, export

    s = _load_spec(args.spec)
    lock_file = _lock_file(s)
    lk = lock.read(lock_file)
    build.check_lock(s, lk, lock_file)
    out = export.export(s, lk, Path(args.wheelhouse).absolute(), _progress)
    _progress(f"wrote {out}: {len(lk.packages)} files, every sha256 checked against {lock_file}")
    return 0


def _write_matrix_outputs(doc: dict[str, object], out: Path, regressions: list[str]) -> None:
    from builder import matrix, report

    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "matrix.html").write_text(report.matrix_html(doc, regressions))
    md = report.matrix_markdown(doc, regressions)
    (out / "matrix.md").write_text(md)
    (out / "junit.xml").write_text(report.matrix_junit(doc))
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with Path(summary).open("a") as fh:
            fh.write(md + "\n")
    del matrix
    _progress(f"reports: {out}/matrix.json, matrix.html, matrix.md, junit.xml")


def cmd_matrix(args: argparse.Namespace) -> int:
    from builder import matrix

    mx = matrix.load(Path(args.file))
    if args.emit == "github":
        # One line: what `echo "matrix=$(...)" >> "$GITHUB_OUTPUT"` needs.
        print(json.dumps(matrix.github_matrix(mx), separators=(",", ":")))
        return 0
    out = Path(args.out or (Path(".envs") / ".matrix" / mx.name / "report"))
    _progress(f"matrix {mx.name}: {len(mx.cells)} cells, {args.jobs} at a time; logs in {out}/logs")
    results = matrix.run(mx, out, jobs=args.jobs, fail_fast=args.fail_fast, progress=_progress)
    doc = matrix.matrix_report(mx.name, results, out)
    regressions: list[str] = []
    if args.baseline:
        regressions = matrix.regressions(json.loads(Path(args.baseline).read_text()), doc)
    _write_matrix_outputs(doc, out, regressions)
    print(f"matrix {mx.name}: " + ", ".join(f"{r.cell.name}={r.status}" for r in results))
    if args.baseline:
        for r in regressions:
            print(f"regression: {r}")
        return 1 if regressions else 0
    return 0 if doc["status"] == "passed" else 1


def cmd_report_merge(args: argparse.Namespace) -> int:
    from builder import matrix

    docs = [json.loads(Path(p).read_text()) for p in args.reports]
    doc = matrix.merge(docs, name=args.name)
    _write_matrix_outputs(doc, Path(args.out), [])
    return 0


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cudaenv", description=__doc__)
    p.add_argument("--version", action="version", version=f"cudaenv {__version__}")
    p.add_argument("--debug", action="store_true", help="log every command; tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True)
    lk = sub.add_parser("lock", help="resolve specs and write envspecs/locks/pylock.NAME.toml")
    lk.add_argument("specs", nargs="+", type=Path)
    lk.add_argument(
        "--upgrade",
        action="store_true",
        help="resolve afresh instead of preferring the versions of the current lock",
    )
    lk.set_defaults(func=cmd_lock)
    pl = sub.add_parser("plan", help="print what a spec resolves to, without installing")
    pl.add_argument("spec", type=Path)
    pl.add_argument("--fresh", action="store_true", help="resolve even if the lock is up to date")
    pl.set_defaults(func=cmd_plan)
    bd = sub.add_parser("build", help="build the env of each spec from its lock")
    bd.add_argument("specs", nargs="+", type=Path)
    bd.add_argument("--env-dir", help="where the env goes (default .envs/NAME); one spec only")
    bd.add_argument("--force", action="store_true", help="rebuild even if the env is up to date")
    bd.add_argument("--verify", action="store_true", help="run `cudaenv verify` on each env built")
    bd.add_argument("--report", help="with --verify: write the JSON report here")
    bd.add_argument(
        "--wheelhouse", help="install only from this directory (made by `cudaenv export`)"
    )
    bd.add_argument(
        "--offline", action="store_true", help="no network: uv --offline, no Python download"
    )
    ex = sub.add_parser(
        "export", help="download every locked file (hash-checked) for offline builds"
    )
    ex.add_argument("spec", type=Path)
    ex.add_argument("--wheelhouse", required=True, help="directory to fill")
    ex.set_defaults(func=cmd_export)
    bd.set_defaults(func=cmd_build)
    vf = sub.add_parser("verify", help="prove an env works: compile and run real kernels")
    vf.add_argument("spec", nargs="?", type=Path, help="a spec whose env cudaenv built")
    vf.add_argument("--python", help="verify this interpreter's env instead (any env)")
    vf.add_argument("--env-dir", help="where the spec's env is (default .envs/NAME)")
    vf.add_argument("--checks", help=f"comma separated, of: {','.join(spec.CHECKS)}")
    vf.add_argument("--archs", help='space separated, e.g. "9.0a 12.0f" (default: the env\'s)')
    vf.add_argument("--report", help="write the JSON report here")
    vf.add_argument("--markdown", help="write the Markdown report here")
    vf.set_defaults(func=cmd_verify)
    dr = sub.add_parser("doctor", help="find the root cause of a split CUDA toolchain in any env")
    dr.add_argument(
        "--python", help="the interpreter to diagnose (default: $VIRTUAL_ENV's, else python3)"
    )
    dr.add_argument("--deep", action="store_true", help="also import FlashInfer and torch there")
    dr.add_argument("--json", action="store_true", help="print JSON instead of the report")
    dr.set_defaults(func=cmd_doctor)
    mx = sub.add_parser("matrix", help="build and verify every cell of a matrix file")
    mx.add_argument("file", help="envspecs/matrix/NAME.yaml")
    mx.add_argument("-j", "--jobs", type=int, default=2, help="cells at once (default 2)")
    mode = mx.add_mutually_exclusive_group()
    mode.add_argument(
        "--keep-going", action="store_true", default=True, help="run every cell (default)"
    )
    mode.add_argument(
        "--fail-fast", action="store_true", help="stop starting cells after a failure"
    )
    mx.add_argument("--out", help="report directory (default .envs/.matrix/NAME/report)")
    mx.add_argument("--baseline", help="an earlier matrix.json: exit non-zero for regressions only")
    mx.add_argument("--emit", choices=["github"], help="print a GitHub Actions strategy.matrix")
    mx.set_defaults(func=cmd_matrix)
    rp = sub.add_parser("report", help="work with reports")
    rsub = rp.add_subparsers(dest="report_command", required=True)
    mg = rsub.add_parser("merge", help="join verify/matrix JSON reports into one matrix report")
    mg.add_argument("reports", nargs="+")
    mg.add_argument("--out", default="merged-report", help="directory for the merged reports")
    mg.add_argument("--name", default="merged")
    mg.set_defaults(func=cmd_report_merge)
    return p


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Turn SIGTERM into an exception so the build's cleanup runs (build.py).
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="cudaenv: %(message)s",
    )
    if getattr(args, "env_dir", None) and len(getattr(args, "specs", [])) > 1:
        parser.error("--env-dir takes one spec")
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        rc: int = args.func(args)
        return rc
    except CudaenvError as exc:
        if args.debug:
            raise
        if isinstance(exc, SpecError):
            for problem in exc.problems:
                print(f"error: {problem}", file=sys.stderr)
            print(
                f"error: {len(exc.problems)} problem(s) in the spec; nothing was done",
                file=sys.stderr,
            )
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, CommandFailed) else exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted; the previous env (if any) is untouched", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
