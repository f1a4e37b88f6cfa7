"""``cudaenv doctor``: run the probe in any interpreter, diagnose its facts, render the result.

The facts come from ``builder/probe/doctor_probe.py`` run inside the target interpreter
(standard library only, no ``import torch`` unless ``--deep``); the rules over them live in
:mod:`builder.doctor.rules`, the facts and findings in :mod:`builder.doctor.facts`.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion

from builder.core import proc, remote_cache, settings, variables
from builder.core.errors import CudaenvError

# The probe's result types, which every caller of probe() reads.
from builder.doctor.facts import ERROR as ERROR
from builder.doctor.facts import INFO as INFO
from builder.doctor.facts import WARNING as WARNING
from builder.doctor.facts import Facts as Facts
from builder.doctor.facts import Finding as Finding
from builder.doctor.facts import LastVerify as LastVerify
from builder.doctor.rules import diagnose
from builder.doctor.wheel_rules import companion_requirement
from builder.env import caches, manifest
from builder.machine import archs, driver
from builder.spec import policy

PROBE_TIMEOUT = 60.0
DEEP_TIMEOUT = 600.0
PYTHON_FIX = "check that this is a working Python 3.9+"
HANG_FIX = "run with --debug and look at what hangs"
# Bumped from 1 when "facts" became typed values instead of the report's display strings.
JSON_SCHEMA_VERSION = 2


def default_python() -> str:
    venv = settings.current().virtual_env
    if venv and (venv / "bin" / "python").exists():
        return str(venv / "bin" / "python")
    return proc.which("python3") or "python3"


def _probe_failed(cause: str, *fix: str) -> Finding:
    return Finding(code="probe-failed", severity=ERROR, cause=cause, fix=fix)


def probe(
    python: Path | str, *, deep: bool, target_archs: Sequence[archs.Arch] = ()
) -> tuple[Facts | None, list[Finding], float]:
    """Run the probe; a probe that cannot run becomes a Finding, not a traceback."""
    # Run by path: the probe imports its sibling flashinfer_light.py (sys.path[0] is its dir).
    script = str(resources.files("builder.probe").joinpath("doctor_probe.py"))
    started = time.monotonic()
    argv = [
        os.fspath(python),
        script,
        # What to report: the probe imports nothing of cudaenv.
        variables.probe_arg(variables.DOCTOR_PROBE),
        *(["--deep"] if deep else []),
    ]
    try:
        done = proc.run(argv, check=False, timeout=DEEP_TIMEOUT if deep else PROBE_TIMEOUT)
    except proc.CommandFailed as exc:
        limit = f"{exc.timed_out:g} s" if exc.timed_out is not None else "time"
        return None, [_probe_failed(f"the probe did not finish in {limit}", HANG_FIX)], 0.0
    except CudaenvError as exc:
        return None, [_probe_failed(str(exc), PYTHON_FIX)], 0.0
    except OSError as exc:
        # proc.run maps only FileNotFoundError: a file without the exec bit (PermissionError),
        # a directory or an unknown binary format (ENOEXEC) arrive here.
        cause = f"{os.fspath(python)} cannot be run: {exc.strerror or exc}"
        return None, [_probe_failed(cause, PYTHON_FIX)], 0.0
    line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    try:
        doc = json.loads(line)
        prefix = str(doc["python"]["prefix"])
    except (ValueError, KeyError, TypeError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        cause = (
            f"{os.fspath(python)} could not run the probe (exit {done.returncode}): "
            + " | ".join(tail)
        )
        return None, [_probe_failed(cause, PYTHON_FIX)], time.monotonic() - started
    # GPUs are listed here, in cudaenv, by the one query every command uses (archs.py), and
    # the driver read by the one function every command reads it with (machine/driver.py:
    # sysfs, procfs, nvidia-smi, libcuda), never a second opinion of the probe's.
    gpus, gpus_note = archs.visible_gpus()
    found = driver.current()
    doc = {**doc, "driver": found.to_json() if found is not None else {}}
    built = manifest.try_read(Path(prefix)) if prefix else None
    facts = Facts.from_json(doc, built, gpus=gpus, gpus_note=gpus_note, target_archs=target_archs)
    facts = _remote_cache(facts)
    facts = _asked_index(facts)
    if prefix:
        facts = replace(facts, last_verify=last_verify(Path(prefix), built))
    return facts, diagnose(facts), time.monotonic() - started


# How long the env's index is given to answer whether it holds one release (a resolve of
# one requirement, no download).
INDEX_TIMEOUT = 60.0


def _asked_index(facts: Facts) -> Facts:
    """Ask the env's index, with the installer a fix would run (the env's pip where it has one,
    else uv), whether it holds each release a companion fix would install: the rule then names
    that release or the companion's removal, never a version the index lacks. Only when such
    a finding fires; an index that cannot be reached leaves the answer out."""
    asked: list[tuple[str, bool]] = []
    for found in policy.companion_mismatches(facts.dists):
        if not found.flashinfer:
            continue
        want = companion_requirement(found.companion, found.flashinfer)
        held = _index_holds(facts, found.companion, found.flashinfer)
        if held is not None:
            asked.append((want, held))
    return replace(facts, index_holds=tuple(asked)) if asked else facts


def _index_holds(facts: Facts, name: str, version: str) -> bool | None:
    if "pip" in facts.dists:
        argv = [facts.python, "-m", "pip", "index", "versions", "--pre", name]
        env = None
    else:
        argv = [proc.uv_bin(), "pip", "install", "--dry-run", "--no-deps", "--python",
                facts.python, f"{name}=={version}"]  # fmt: skip
        env = proc.uv_env()
    try:
        done = proc.run(argv, check=False, timeout=INDEX_TIMEOUT, env=env)
    except (proc.CommandFailed, CudaenvError):
        return None
    said = f"{done.stdout}\n{done.stderr}"
    if argv[1:3] == ["-m", "pip"]:
        listed = re.search(r"Available versions:\s*(.+)", said)
        if done.returncode != 0 or listed is None:
            return False if "No matching distribution" in said else None
        # As the fix's `==VERSION` matches: a release with a local label (0.4.0+cu128) too.
        wanted = SpecifierSet(f"=={version}")
        return any(_matches(wanted, v.strip()) for v in listed.group(1).split(",") if v.strip())
    if done.returncode == 0:
        return True
    if re.search(r"no version of|not found in the package registry|No solution found", said):
        return False
    return None


def _matches(wanted: SpecifierSet, version: str) -> bool:
    try:
        return wanted.contains(version, prereleases=True)
    except InvalidVersion:
        return False


# A verify report holds a few lines per check: a file larger than this is not one.
_REPORT_LIMIT = 4 * 2**20


def last_verify(prefix: Path, built: manifest.Manifest | None) -> LastVerify | None:
    """What the env's own last verify report says; None where there is none, or the file
    there is not a readable verify report (it is never shown: only its checks' names and
    summaries are read)."""
    path = prefix / "var" / "cudaenv" / "verify.json"
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > _REPORT_LIMIT:
            return None
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("kind") != "verify":
        return None
    checks = doc.get("checks")
    if not isinstance(checks, list):
        return None
    failed = tuple(
        (str(c.get("name", "?"))[:60], str(c.get("summary", ""))[:300])
        for c in checks
        if isinstance(c, dict) and c.get("status") == "failed"
    )
    said = doc.get("lock_hash")
    current = built is None or said is None or said == built.lock_hash
    # A verify run with another toolkit than the env's own (CUDAENV_NO_HOOK and a CUDA_HOME of
    # the caller's) verified that setting, not the env as it runs.
    versions = doc.get("versions")
    seen = versions.get("CUDA_HOME") if isinstance(versions, dict) else None
    own = prefix / "cuda-home"
    if isinstance(seen, str) and seen not in ("", "-") and own.is_dir():
        current = current and os.path.realpath(seen) == os.path.realpath(own)
    return LastVerify(path=str(path), created=str(doc.get("created", "?"))[:40], failed=failed,
                      current=current)  # fmt: skip


def _remote_cache(facts: Facts) -> Facts:
    """``facts`` with the remote cache this interpreter is to use (CUDAENV_REMOTE_CACHE, else
    its env's `remote-cache:`) and, where the hook wired it, the server's answer to PING."""
    found = settings.current()
    if found.remote_cache is None and found.origin("remote_cache") != settings.DEFAULT:
        return facts  # `off`
    named = found.remote_cache or (facts.manifest.remote_cache if facts.manifest else None)
    if not named:
        return facts
    try:
        cache = remote_cache.parse(named).with_password(found.remote_cache_password)
    except remote_cache.RemoteCacheError:
        return replace(facts, remote_cache=named.split("@")[-1])  # the hook said why
    wired = (facts.env.get(remote_cache.WIRING_VAR) or "").startswith("wired ")
    answer = remote_cache.ping(cache) if wired else None
    return replace(facts, remote_cache=cache.shown, remote_answer=answer)


def facts_table(facts: Facts) -> list[tuple[str, str]]:
    rows = [
        ("python", f"{facts.python_version} ({facts.python})"),
        ("glibc", facts.glibc or "?"),
        (
            "torch",
            f"{facts.torch_version} (CUDA {facts.torch_cuda})"
            if facts.torch_version
            else "not installed",
        ),
        ("flashinfer", facts.flashinfer or "not installed"),
        ("sglang", facts.dists.get("sglang", "not installed")),
        ("cuda-toolkit", facts.dists.get("cuda-toolkit", "-")),
    ]
    for i, home in enumerate(facts.cuda_homes):
        state = home.release or home.error or ("no nvcc" if not home.exists else "?")
        rows.append(
            (
                ("JIT CUDA_HOME" if i == 0 else "  candidate"),
                f"{home.path} [{home.source}] nvcc {state}",
            )
        )
    if not facts.cuda_homes:
        rows.append(("JIT CUDA_HOME", "none"))
    for var in (*variables.ARCH_LISTS, "LD_LIBRARY_PATH"):
        rows.append((var, facts.env.get(var) or "(unset)"))
    shell = facts.env.get("CUDAENV_SHELL_CUDA_HOME")
    if shell is not None:
        rows.append(("shell CUDA_HOME", (shell or "(unset)") + " (overridden by this env's hook)"))
    rows.append(("driver", facts.driver or "no driver"))
    for gpu in facts.gpus:
        rows.append((f"GPU {gpu.index}", f"{gpu.name} SM {gpu.capability_text}"))
    rows.append(("JIT cache", f"{facts.jit_root} ({len(facts.jit_entries)} op(s))"))
    for cache in caches.CACHES:
        if cache.variable in facts.env:
            rows.append(
                (
                    f"  {cache.variable}",
                    facts.env.get(cache.variable) or f"(unset: {cache.owner}'s default)",
                )
            )
    for variable, _tool in caches.TRITON_TOOLS:
        if facts.env.get(variable):
            rows.append((f"  {variable}", str(facts.env[variable])))
    rows.append(("host C++", facts.cxx_banner or "none"))
    nv = sorted(
        f"{k}=={v}"
        for k, v in facts.dists.items()
        if k.startswith("nvidia-cuda") or k == "nvidia-nvvm"
    )
    rows.append(("toolkit wheels", ", ".join(nv) or "none"))
    if facts.deep:
        fi = facts.deep.get("flashinfer")
        if isinstance(fi, dict) and "cuda_version" in fi:
            rows.append(
                (
                    "FlashInfer sees",
                    f"get_cuda_path()={fi.get('cuda_path')} get_cuda_version()={fi['cuda_version']}",
                )
            )
        t = facts.deep.get("torch")
        if isinstance(t, dict) and "version" in t:
            rows.append(
                (
                    "torch.cuda",
                    f"available={t.get('available')} {t.get('capabilities') or t.get('cuda_error') or ''}",
                )
            )
    return rows


def render(python: Path | str, facts: Facts | None, findings: Sequence[Finding]) -> str:
    lines: list[str] = []
    errors = [f for f in findings if f.severity == ERROR]
    if findings and findings[0].severity != INFO:
        lines.append(findings[0].cause)
        if findings[0].fix:
            # The cause and what to do, at the top: the details follow for who wants them.
            lines.append(f"fix: {findings[0].fix[0]}")
    else:
        lines.append(f"healthy: no error or warning for {os.fspath(python)}")
    for f in findings:
        lines.append("")
        lines.append(f"[{f.severity}] {f.code}: {f.cause}")
        for e in f.evidence:
            lines.append(f"    evidence: {e}")
        for fix in f.fix:
            lines.append(f"    fix: {fix}")
        for s in f.symptoms:
            lines.append(f"    explains [{s.severity}] {s.code}: {s.cause}")
    if facts is not None:
        lines.append("")
        rows = facts_table(facts)
        width = max(len(k) for k, _ in rows)
        lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("")
    lines.append(
        f"{len(errors)} error(s), {sum(f.severity == WARNING for f in findings)} warning(s)"
    )
    return "\n".join(lines)


def to_json(
    python: Path | str, facts: Facts | None, findings: Sequence[Finding], seconds: float
) -> dict[str, Any]:
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "python": os.fspath(python),
        "healthy": not any(f.severity == ERROR for f in findings),
        "findings": [f.to_json() for f in findings],
        "facts": facts.to_json() if facts is not None else None,
        "seconds": round(seconds, 3),
    }
