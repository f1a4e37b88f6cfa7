#!/usr/bin/env python3
"""The GPU check: on a machine with an NVIDIA GPU, everything cudaenv verifies, run for real,
failing loudly on anything that did not run.

Run as ``bash .ci/gpu-check.sh [--dry-run]`` (docs/development/gpu-check.md). First a
pre-flight, each step one line of the summary and all of them run so one reading names every
problem: the interpreter and its modules, the toolkit's files the checks need, torch's CUDA,
the driver (the table the build gate uses), the visible GPUs and their archs, FlashInfer (the
interpreter's own, or the slice carried next to the tree). A failed pre-flight stops there:
the long steps would only fail later, slower. Then `doctor --deep`, `verify` with
``CUDAENV_GPU_CHECK=1`` (a skipped half of `sampling` fails), `audit` and the `gpu` tests, each
bounded by what is left of ``--budget``. ``$OUT/summary.json`` holds every step's verdict and
reason, each half of `sampling` per device, and the machine (GPUs, driver, torch, nvcc); a
check that was skipped counts as failed here, and the exit status is 0 only when all passed.
``--dry-run`` stops after the pre-flight.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from builder.core.cudaversion import CudaVersion  # noqa: E402
from builder.core.errors import DriverTooOld, UsageError  # noqa: E402
from builder.machine import archs, driver  # noqa: E402 - the tree's own package, put on the path above
from builder.verify import CHECKS  # noqa: E402 - every one runs here, and none may be skipped

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
STEPS = ("doctor", "verify", "audit", "pytest")
HALVES = ("our kernel", "FlashInfer")
# The toolkit's files the checks need, and who needs each: a missing one fails the pre-flight
# instead of failing (or being skipped) ten minutes in.
TOOLKIT: tuple[tuple[str, str], ...] = (
    ("bin/nvcc", "compiles our kernel and FlashInfer's sampling module"),
    ("bin/cuobjdump", "the cubin check lists the cubins with it (else it tries to download it)"),
    ("include/cuda_runtime.h", "every CUDA compile includes it"),
    ("lib64/libcudart.so", "FlashInfer's JIT links -lcudart (flashinfer-ai/flashinfer#5064)"),
    ("lib64/stubs/libcuda.so", "FlashInfer's JIT links -lcuda (flashinfer-ai/flashinfer#5064)"),
)
MODULES = ("yaml", "jinja2", "packaging", "pytest")  # cudaenv's own and the gpu tests'
SLICE = ".gpu-carry/flashinfer-slice.tar.gz"
# Seconds each step may take at most; each also gets no more than what is left of --budget.
STEP_LIMITS = {"doctor": 180.0, "verify": 600.0, "audit": 180.0, "pytest": 420.0}


@dataclass
class Result:
    name: str
    status: str
    reason: str
    seconds: float = 0.0
    device: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name, "status": self.status, "reason": self.reason}
        if self.seconds:
            doc["seconds"] = round(self.seconds, 1)
        if self.device is not None:
            doc["device"] = self.device
        return doc


@dataclass
class Run:
    """What the check found so far, and where it writes."""

    out: Path
    python: str
    log: IO[str]
    results: list[Result] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # what every child runs with

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def add(self, result: Result) -> Result:
        self.results.append(result)
        where = f" [{result.device}]" if result.device else ""
        self.say(f"-- {result.name}{where}: {result.status.upper()}: {result.reason}")
        return result

    def worst(self) -> str:
        return worst([x.status for x in self.results])


def worst(statuses: Sequence[str]) -> str:
    """failed over skipped over passed; nothing at all is a failure (nothing was checked)."""
    if not statuses or FAILED in statuses:
        return FAILED
    return SKIPPED if SKIPPED in statuses else PASSED


# --------------------------------------------------------------------------- children


@dataclass(frozen=True)
class Done:
    code: int | None  # None: killed at its time limit
    output: str
    seconds: float


def run(
    argv: Sequence[str],
    env: Mapping[str, str],
    timeout: float,
    echo: Callable[[str], None] | None = None,
    stdout: IO[str] | None = None,
) -> Done:
    """``argv`` in its own process group, killed with it after ``timeout`` seconds; its
    output (stdout and stderr, or stderr alone where ``stdout`` is a file) line by line to
    ``echo`` as it comes, and returned."""
    started = time.monotonic()
    lines: list[str] = []
    try:
        child = subprocess.Popen(
            list(argv),
            cwd=REPO,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=stdout if stdout is not None else subprocess.PIPE,
            stderr=subprocess.PIPE if stdout is not None else subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
    except OSError as exc:
        return Done(code=127, output=f"{argv[0]}: {exc}", seconds=0.0)
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)

    timer = threading.Timer(max(timeout, 0.1), kill)
    timer.start()
    try:
        stream = child.stderr if stdout is not None else child.stdout
        assert stream is not None
        for line in stream:
            lines.append(line)
            if echo is not None:
                echo(line.rstrip("\n"))
        code = child.wait()
    finally:
        timer.cancel()
    return Done(
        code=None if killed.is_set() else code,
        output="".join(lines),
        seconds=time.monotonic() - started,
    )


def ask(run_: Run, code: str, timeout: float = 120.0) -> tuple[Any, str]:
    """(what ``code`` printed as JSON on its last line, or None; its output) from the
    interpreter under test, with the check's environment."""
    done = run([run_.python, "-c", code], run_.env, timeout)
    last = done.output.strip().splitlines()[-1] if done.output.strip() else ""
    if done.code != 0:
        return None, done.output.strip()[-1500:] or f"exit {done.code}"
    try:
        return json.loads(last), done.output
    except ValueError:
        return None, f"printed no JSON: {last[:200]!r}"


# --------------------------------------------------------------------------- pre-flight


def check_python(r: Run) -> Result:
    doc, said = ask(
        r,
        "import importlib.util, json, sys\n"
        f"print(json.dumps({{'version': sys.version.split()[0], 'missing': [m for m in "
        f"{list(MODULES)!r} if importlib.util.find_spec(m) is None]}}))",
    )
    if doc is None:
        return Result("python", FAILED, f"{r.python} does not run: {said}")
    r.machine["python_version"] = doc["version"]
    if doc["missing"]:
        return Result(
            "python", FAILED, f"{r.python} {doc['version']} lacks {', '.join(doc['missing'])}"
        )
    return Result("python", PASSED, f"{r.python} {doc['version']} with {', '.join(MODULES)}")


def nvcc_release(nvcc: Path, env: Mapping[str, str]) -> CudaVersion:
    """The CUDA of ``nvcc --version``'s "release X.Y", parsed: a string compared with a
    CudaVersion raises TypeError deep in the arch list (every SM 12.x GPU)."""
    done = run([str(nvcc), "--version"], env, 60)
    if done.code != 0:
        raise ValueError(f"{nvcc} --version: exit {done.code}: {done.output.strip()[-300:]}")
    m = re.search(r"release (\d+\.\d+)", done.output)
    if m is None:
        raise ValueError(f"{nvcc} --version names no release: {done.output.strip()[-300:]!r}")
    return CudaVersion.parse(m.group(1))


def check_toolkit(r: Run, cuda_home: Path) -> tuple[Result, CudaVersion | None]:
    r.say(f"== toolkit: CUDA_HOME={cuda_home}")
    missing = []
    for rel, why in TOOLKIT:
        path = cuda_home / rel
        if path.exists():
            r.say(f"   ok       {rel} -> {path.resolve()}")
        else:
            r.say(f"   MISSING  {rel}: {why}")
            missing.append(f"{rel} ({why})")
    version = cuda_home / "version.json"
    if version.is_file():
        try:
            cuda = json.loads(version.read_text())["cuda"]["version"]
            r.say(f"   version.json: CUDA {cuda}")
        except (ValueError, KeyError, TypeError):
            r.say("   version.json: unreadable")
    if missing:
        return Result("toolkit", FAILED, f"{cuda_home} lacks " + "; ".join(missing)), None
    try:
        cuda = nvcc_release(cuda_home / "bin" / "nvcc", r.env)
    except ValueError as exc:
        return Result("toolkit", FAILED, str(exc)), None
    r.machine["nvcc"] = str(cuda)
    return Result("toolkit", PASSED, f"{cuda_home}: nvcc {cuda}, and every file above"), cuda


def check_torch(r: Run) -> tuple[Result, CudaVersion | None]:
    doc, said = ask(
        r,
        "import json, torch\n"
        "print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda}))",
        timeout=300,
    )
    if doc is None:
        return Result("torch", FAILED, f"torch does not import in {r.python}: {said}"), None
    r.machine["torch"] = doc["version"]
    r.machine["torch_cuda"] = doc["cuda"]
    if not doc["cuda"]:
        return Result("torch", FAILED, f"torch {doc['version']} is a CPU build"), None
    try:
        cuda = CudaVersion.parse(str(doc["cuda"]))
    except ValueError as exc:
        return Result("torch", FAILED, f"torch {doc['version']}: {exc}"), None
    return Result("torch", PASSED, f"torch {doc['version']} for CUDA {cuda}"), cuda


def check_driver(r: Run, torch_cuda: CudaVersion | None, nvcc_cuda: CudaVersion | None) -> Result:
    try:
        found = driver.detect()
    except UsageError as exc:
        return Result("driver", FAILED, str(exc))
    if found is None:
        return Result("driver", FAILED, driver.not_found())
    r.machine["driver"] = found.to_json()
    asks = [
        (f"torch {r.machine.get('torch')}", "a torch built", torch_cuda),
        (f"CUDA_HOME's nvcc {nvcc_cuda}", "a toolkit", nvcc_cuda),
    ]
    lines = []
    for needs, older, cuda in asks:
        if cuda is None:
            continue
        try:
            lines.append(driver.require(cuda, found, needs=needs, older=older, bypass=None))
        except DriverTooOld as exc:
            return Result("driver", FAILED, f"driver too old: {exc}")
    return Result("driver", PASSED, "; ".join(dict.fromkeys(lines)) or found.describe())


def check_gpus(r: Run, nvcc_cuda: CudaVersion | None, given: str | None) -> Result:
    gpus, why = archs.visible_gpus()
    r.machine["gpus"] = [
        {"index": g.index, "name": g.name, "capability": g.capability_text, "uuid": g.uuid}
        for g in gpus
    ]
    if not gpus:
        return Result("gpus", FAILED, why or "no visible NVIDIA GPU")
    if given:
        try:
            chosen = archs.parse_list(given)
        except ValueError as exc:
            return Result("gpus", FAILED, f"--archs: {exc}")
    else:
        chosen = archs.env_archs((), nvcc_cuda or archs.DEFAULT_CUDA, gpus)
    r.machine["archs"] = archs.texts(chosen)
    if not chosen:
        return Result("gpus", FAILED, "no GPU reports a compute capability: no arch to verify")
    listed = ", ".join(g.label for g in gpus)
    return Result("gpus", PASSED, f"{listed}: archs {','.join(archs.texts(chosen))}")


FLASHINFER_PROBE = (
    "import importlib.util, json\n"
    "spec = importlib.util.find_spec('flashinfer')\n"
    "print(json.dumps({'flashinfer': spec.origin if spec else None,\n"
    "                  'tvm_ffi': importlib.util.find_spec('tvm_ffi') is not None}))"
)


def unpack(archive: Path, site: Path) -> int:
    """The slice into ``site``; only plain files and directories inside it (tarfile's
    ``data`` filter where this Python has it)."""
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        for m in members:
            bad = m.name.startswith("/") or ".." in Path(m.name).parts
            if bad or not (m.isfile() or m.isdir()):
                raise tarfile.TarError(f"refusing member {m.name!r}")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(site, filter="data")
        else:  # Python before 3.10.12 / 3.11.4: the members were checked above
            tar.extractall(site)  # noqa: S202
    return len(members)


def check_flashinfer(r: Run, slice_path: Path, site: Path) -> Result:
    doc, said = ask(r, FLASHINFER_PROBE)
    if doc is not None and doc["flashinfer"] and doc["tvm_ffi"]:
        r.machine["flashinfer"] = doc["flashinfer"]
        return Result("flashinfer", PASSED, f"installed in {r.python}: {doc['flashinfer']}")
    if not slice_path.is_file():
        return Result(
            "flashinfer",
            FAILED,
            f"FlashInfer is missing: {r.python} has none and there is no slice at "
            f"{slice_path}: without it flashinfer-jit and FlashInfer's half of sampling cannot "
            "run; make it with .ci/flashinfer-slice.py and carry it next to the tree",
        )
    digest_file = slice_path.with_name(slice_path.name + ".sha256")
    if digest_file.is_file():
        want = digest_file.read_text().split()[0] if digest_file.read_text().strip() else ""
        have = hashlib.sha256(slice_path.read_bytes()).hexdigest()
        if want != have:
            return Result(
                "flashinfer",
                FAILED,
                f"the slice {slice_path} does not match {digest_file.name} (sha256 {have}, "
                f"expected {want or 'nothing'}): copied incompletely?",
            )
    try:
        count = unpack(slice_path, site)
    except (tarfile.TarError, OSError, EOFError) as exc:
        return Result("flashinfer", FAILED, f"the slice {slice_path} does not unpack: {exc}")
    r.env["PYTHONPATH"] = os.pathsep.join(p for p in (r.env.get("PYTHONPATH"), str(site)) if p)
    doc, said = ask(r, FLASHINFER_PROBE)
    if doc is None or not doc["flashinfer"] or not doc["tvm_ffi"]:
        what = said if doc is None else f"found {doc}"
        return Result(
            "flashinfer",
            FAILED,
            f"the slice {slice_path} unpacked ({count} entries) but holds no FlashInfer and "
            f"tvm_ffi: {what}",
        )
    r.machine["flashinfer"] = doc["flashinfer"]
    return Result(
        "flashinfer", PASSED, f"from the slice {slice_path} ({count} entries): {doc['flashinfer']}"
    )


def preflight(r: Run, args: argparse.Namespace, site: Path) -> bool:
    r.add(check_python(r))
    toolkit, nvcc_cuda = check_toolkit(r, args.cuda_home)
    r.add(toolkit)
    torch, torch_cuda = check_torch(r)
    r.add(torch)
    r.add(check_driver(r, torch_cuda, nvcc_cuda))
    r.add(check_gpus(r, nvcc_cuda, args.archs))
    r.add(check_flashinfer(r, args.slice, site))
    return all(x.status == PASSED for x in r.results)


# --------------------------------------------------------------------------- the steps


def verify_results(report: Mapping[str, Any]) -> list[Result]:
    """Each check of verify's report, and each half of `sampling` per device, as the GPU
    check judges them: a skipped check or half is a failure that names what it lacked."""
    checks = {c.get("name"): c for c in report.get("checks", []) if isinstance(c, dict)}
    out = []
    for name in CHECKS:
        c = checks.get(name)
        if c is None:
            out.append(Result(f"verify:{name}", FAILED, "not in verify's report"))
            continue
        status, summary = str(c.get("status")), str(c.get("summary", ""))
        seconds = float(c.get("seconds") or 0.0)
        if status == SKIPPED:
            out.append(Result(f"verify:{name}", FAILED, f"skipped ({summary}): the GPU check "
                              "needs every check to run", seconds))  # fmt: skip
        else:
            out.append(Result(f"verify:{name}", status, summary, seconds))
    sampling = checks.get("sampling") or {}
    shown = sampling.get("evidence")
    evidence: dict[str, Any] = shown if isinstance(shown, dict) else {}
    for who in HALVES:
        mine = [(k, str(v)) for k, v in evidence.items() if str(k).endswith(f" {who}")]
        for key, text in mine:
            status, _, detail = text.partition(": ")
            if status not in (PASSED, FAILED, SKIPPED):
                status, detail = FAILED, f"unreadable verdict: {text[:200]}"
            elif status == SKIPPED:
                status, detail = FAILED, f"skipped ({detail}): the GPU check needs both halves"
            out.append(
                Result(f"sampling:{who}", status, detail, device=key.removesuffix(f" {who}"))
            )
        if not mine:
            why = str(sampling.get("summary") or "sampling is not in verify's report")
            out.append(Result(f"sampling:{who}", FAILED, f"did not run: {why}"))
    return out


def pytest_results(xml: Path, done: Done) -> Result:
    """The gpu tests: any failure, error or skip (a silent half pass) fails the step."""
    try:
        root = ET.parse(xml).getroot()  # noqa: S314 - written by our own pytest run
    except (OSError, ET.ParseError) as exc:
        return Result("pytest", FAILED, f"no readable report ({exc}); exit {done.code}")
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, "0")) for s in suites) for k in ("tests", "failures",
                                                                   "errors", "skipped")}  # fmt: skip
    skips = [
        f"{case.get('name')}: {(sk.get('message') or '').strip()}"
        for case in root.iter("testcase")
        for sk in case.iter("skipped")
    ]
    said = (f"{counts['tests']} gpu test(s): {counts['failures']} failed, {counts['errors']} "
            f"errors, {counts['skipped']} skipped")  # fmt: skip
    if done.code != 0 or counts["failures"] or counts["errors"] or skips or not counts["tests"]:
        detail = "; ".join(skips)[:800]
        return Result("pytest", FAILED, f"{said} (exit {done.code}){': ' + detail if detail else ''}",
                      done.seconds)  # fmt: skip
    return Result("pytest", PASSED, said, done.seconds)


def steps(r: Run, args: argparse.Namespace, deadline: float) -> None:
    py = r.python
    archs_text = ",".join(r.machine.get("archs", []))
    for step in args.steps:
        left = deadline - time.monotonic()
        if left < 10:
            r.add(Result(step, FAILED, f"not run: the --budget of {args.budget:.0f} s is spent"))
            continue
        limit = min(STEP_LIMITS[step], left)
        r.say(f"== {step} (at most {limit:.0f} s)")
        if step == "doctor":
            done = run([py, "-m", "builder.cli", "doctor", "--python", py, "--deep"], r.env,
                       limit, r.say)  # fmt: skip
            r.add(exit_result(step, done, limit))
        elif step == "verify":
            report = r.out / "verify.json"
            report.unlink(missing_ok=True)
            argv = [py, "-m", "builder.cli", "verify", "--python", py, "--checks", ",".join(CHECKS), "--keep-going",
                    "--archs", archs_text, "--report", str(report),
                    "--markdown", str(r.out / "verify.md")]  # fmt: skip
            done = run(argv, r.env, limit, r.say)
            r.add(exit_result(step, done, limit))
            try:
                doc = json.loads(report.read_text())
            except (OSError, ValueError) as exc:
                r.add(Result("verify:report", FAILED, f"{report}: {exc}"))
                continue
            for result in verify_results(doc):
                r.add(result)
        elif step == "audit":
            with (r.out / "audit.json").open("w") as out:
                done = run([py, "-m", "builder.cli", "audit", "--python", py, "--archs",
                            archs_text, "--json"], r.env, limit, r.say, stdout=out)  # fmt: skip
            r.add(exit_result(step, done, limit))
        elif step == "pytest":
            xml = r.out / "pytest.xml"
            xml.unlink(missing_ok=True)
            done = run([py, "-m", "pytest", "-q", "-rs", "-m", "gpu", "tests/test_gpu.py",
                        "-p", "no:cacheprovider", f"--junitxml={xml}"], r.env, limit,
                       r.say)  # fmt: skip
            r.add(pytest_results(xml, done) if done.code is not None else
                  exit_result(step, done, limit))  # fmt: skip


def exit_result(name: str, done: Done, limit: float) -> Result:
    if done.code is None:
        return Result(name, FAILED, f"killed at its limit of {limit:.0f} s", done.seconds)
    if done.code != 0:
        tail = done.output.strip().splitlines()[-1:] or [""]
        return Result(name, FAILED, f"exit {done.code}: {tail[0][:300]}", done.seconds)
    return Result(name, PASSED, "exit 0", done.seconds)


# --------------------------------------------------------------------------- main


def parse(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--python", default=sys.executable, help="the interpreter under test")
    ap.add_argument("--dry-run", action="store_true", help="the pre-flight alone")
    ap.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                    help="where the log and reports go ($OUT; default a new temporary "
                    "directory, named at the start)")  # fmt: skip
    ap.add_argument("--cuda-home", type=Path,
                    default=Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda"),
                    help="the toolkit ($CUDA_HOME, default /usr/local/cuda)")  # fmt: skip
    ap.add_argument("--slice", type=Path,
                    default=Path(os.environ.get("FLASHINFER_SLICE") or REPO / SLICE),
                    help=f"FlashInfer's slice, where the interpreter has none ({SLICE})")  # fmt: skip
    ap.add_argument("--archs", help="verify these archs instead of the visible GPUs'")
    ap.add_argument("--steps", default=",".join(STEPS),
                    help=f"which steps after the pre-flight ({','.join(STEPS)})")  # fmt: skip
    ap.add_argument("--budget", type=float, default=720.0,
                    help="seconds the steps may take together (default 720)")  # fmt: skip
    args = ap.parse_args(argv)
    args.steps = [s for s in re.split(r"[\s,]+", args.steps) if s]
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown:
        ap.error(f"--steps: unknown {', '.join(unknown)}; known: {', '.join(STEPS)}")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    if args.out is None:  # a fixed name in /tmp could be another user's
        args.out = Path(tempfile.mkdtemp(prefix="cudaenv-gpu-out-"))
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_HOME": str(args.cuda_home),
           "CUDAENV_GPU_PYTHON": args.python, "CUDAENV_GPU_CHECK": "1",
           "OUT": str(args.out)}  # fmt: skip
    # OUT: the gpu tests keep their evidence there too (source-build.json).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    with (
        (args.out / "gpu-check.log").open("w") as log,
        tempfile.TemporaryDirectory(prefix="cudaenv-flashinfer-slice-") as site,
    ):
        r = Run(out=args.out, python=args.python, log=log, env=env)
        r.machine.update(python=args.python, cuda_home=str(args.cuda_home))
        r.say(
            f"== the GPU check, {stamp}{' (dry run: the pre-flight alone)' if args.dry_run else ''}"
        )
        ready = preflight(r, args, Path(site))
        if not args.dry_run:
            if ready:
                if shutil.which(driver.NVIDIA_SMI):
                    r.say("== nvidia-smi")
                    run([driver.NVIDIA_SMI], r.env, 30, r.say)
                steps(r, args, started + args.budget)
            else:
                for step in args.steps:
                    r.add(Result(step, SKIPPED, "not run: the pre-flight failed"))
        status = r.worst()
        doc = {
            "status": status,
            "exit": 0 if status == PASSED else 1,
            "dry_run": args.dry_run,
            "started": stamp,
            "seconds": round(time.monotonic() - started, 1),
            "machine": r.machine,
            "checks": [x.to_json() for x in r.results],
        }
        (args.out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
        bad = [x for x in r.results if x.status != PASSED]
        r.say(f"== {status.upper()}: {len(r.results) - len(bad)} of {len(r.results)} passed; "
              f"{args.out / 'summary.json'}")  # fmt: skip
        for x in bad:
            r.say(f"   {x.status}: {x.name}{f' [{x.device}]' if x.device else ''}: {x.reason}")
    return int(doc["exit"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
