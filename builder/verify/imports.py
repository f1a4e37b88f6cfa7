"""`imports`: the packages the spec asks for import in the env, and so do the modules their
servers import at start-up.

An env can pass every compile and still not start: sglang 0.5.2 imports ``pybase64``
without declaring it, so ``import sglang`` fails in an env installed from its own metadata.
This check runs ``builder/probe/imports_probe.py`` in the env's interpreter (its start-up
hook applies; nothing touches a GPU): each top-level package of each distribution the spec
asks for, plus the server modules of :data:`SERVERS`. A module that does not import fails
the check, naming the missing module and who imported it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Final

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from builder.core import proc
from builder.core.statuses import FAILED, PASSED, SKIPPED
from builder.store import normalise, plans
from builder.verify.model import CheckResult, EnvFacts, Target, env_of


@dataclass(frozen=True, kw_only=True)
class Server:
    """A package that serves models, and what its server imports before it takes a request."""

    distribution: str
    modules: tuple[str, ...]
    # Its kernels JIT-compile through FlashInfer: an env without flashinfer-python cannot
    # serve (the flashinfer-jit check fails instead of skipping).
    needs_flashinfer: bool


# What each server imports at start-up beyond `import NAME` (sglang 0.5.23's engine imports
# more than `import sglang` does). One table: the imports check and flashinfer-jit read it.
SERVERS: Final = (
    Server(
        distribution="sglang", modules=("sglang.srt.entrypoints.engine",), needs_flashinfer=True
    ),
    Server(
        distribution="vllm",
        modules=("vllm.entrypoints.openai.api_server",),
        needs_flashinfer=True,
    ),
    Server(
        distribution="flashinfer-python",
        modules=("flashinfer", "flashinfer.jit"),
        needs_flashinfer=False,
    ),
)

# sglang's engine import alone takes tens of seconds on two cores; torch's ~10 s.
TIMEOUT_SECONDS: Final = 900.0


@dataclass(frozen=True, kw_only=True)
class Asked:
    """A distribution to import: ``required`` unless its marker may leave it out here (or it
    is only one of the stack's usual packages, probed where installed)."""

    name: str
    required: bool


def asked(target: Target) -> list[Asked]:
    """What the target asks for: the spec's packages (and torch); without a spec, the
    servers' packages and torch where the interpreter has them."""
    if target.packages is None:
        return [
            Asked(name=n, required=False) for n in ("torch", *(s.distribution for s in SERVERS))
        ]
    out: list[Asked] = []
    for text in target.packages:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            out.append(Asked(name=str(canonicalize_name(text)), required=True))
            continue
        out.append(Asked(name=str(canonicalize_name(req.name)), required=req.marker is None))
    return out


def servers_asked(target: Target) -> list[Server]:
    """The servers the target asks for: by the spec, else those installed in its env."""
    if target.packages is not None:
        names = {a.name for a in asked(target)}
    else:
        names = installed_names(target.python)
    return [s for s in SERVERS if s.distribution in names]


def installed_names(python: Path) -> set[str]:
    """The distributions installed in the site-packages of ``python``'s env (read from the
    metadata directories; nothing runs)."""
    root = python.absolute().parent.parent
    sites = [str(p) for p in sorted(root.glob("lib/python3*/site-packages"))]
    if not sites:
        return set()
    return {
        str(canonicalize_name(d.metadata["Name"]))
        for d in metadata.distributions(path=sites)
        if d.metadata["Name"]
    }


def source_extensions(python: Path) -> dict[str, list[str]]:
    """The extension modules of each package the env built from its sdist (its manifest's
    ``source_builds``), by distribution, read from its RECORD: each is imported by name, so
    a package whose ``__init__`` loads its kernels lazily is still proven to load them."""
    from builder.env import installproof, manifest

    env = python.absolute().parent.parent
    found = manifest.try_read(env)
    if found is None or not found.source_builds:
        return {}
    out: dict[str, list[str]] = {}
    for name, version, *_ in found.source_builds:
        stem = f"{str(canonicalize_name(name)).replace('-', '_')}-{version}.dist-info"
        for record in sorted(env.glob(f"lib/python3*/site-packages/{stem}/RECORD")):
            with contextlib.suppress(OSError):
                rows = installproof.record_rows(record)
                out[str(canonicalize_name(name))] = sorted(
                    row[0].partition(".")[0].replace("/", ".")
                    for row in rows
                    if row[0].endswith(".so") and not row[0].startswith((".", "/"))
                )
    return out


def request(
    names: Sequence[Asked], extensions: dict[str, list[str]] | None = None
) -> dict[str, Any]:
    modules = {s.distribution: list(s.modules) for s in SERVERS}
    for dist, more in (extensions or {}).items():
        modules[dist] = [*modules.get(dist, []), *more]
    return {
        "distributions": [[a.name, a.required] for a in names],
        "modules": {a.name: modules[a.name] for a in names if a.name in modules},
    }


def read_lines(text: str) -> list[dict[str, Any]]:
    docs = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            docs.append(doc)
    return docs


def why(doc: dict[str, Any]) -> str:
    """One line on a failed import: the error, and for a missing module who wants it."""
    module, error = str(doc.get("module")), str(doc.get("error"))
    missing = doc.get("missing")
    where = doc.get("importer") if isinstance(doc.get("importer"), dict) else None
    if not missing:
        at = ""
        if where is not None:
            by = f" ({where['dist']} {where.get('version', '')})" if where.get("dist") else ""
            at = f" (in {where.get('file')}:{where.get('line')}{by})"
        return f"import {module} failed: {error}{at}"
    provided = [str(p) for p in doc.get("providers") or []]
    if provided:
        source = f"{', '.join(provided)} provides it but it does not import"
    else:
        source = "no installed distribution provides it"
    by = ""
    if where is not None and where.get("dist"):
        how = where.get("declares")
        declared = (
            f"declares it only with its extra {how!r}, which the spec does not ask for"
            if isinstance(how, str)
            else "declares it"
            if how
            else "does not declare it in its requirements"
        )
        by = f"; {where['dist']} {where.get('version', '')} imports it and {declared}"
    elif where is not None:
        by = f"; imported by {where.get('file')}"
    return f"import {module} failed: No module named {missing!r} ({source}{by})"


# Bump when the check proves something else (what it imports, how it judges a failure).
CHECK_VERSION: Final = 1
# What changes what an import finds, besides the variables the env's hook sets (the probe
# reports those: EnvFacts.env).
IMPORT_VARIABLES: Final = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH",
                           "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONPLATLIBDIR",
                           "LD_LIBRARY_PATH", "LD_PRELOAD")  # fmt: skip
# A RECORD larger than this is read no further (torch's is ~2 MB): its size still counts.
MAX_RECORD: Final = 64 << 20


def inputs(target: Target, facts: EnvFacts) -> dict[str, Any] | None:
    """What this check's verdict depends on, for a recorded pass (verify/recorded.py): what
    it is asked, the probe script, the interpreter, the variables that steer imports, and each
    site-packages directory as installers leave it (its entries, every ``.pth`` file, and
    every distribution's RECORD, which lists each installed file with its sha256). None for an
    interpreter whose site-packages cudaenv cannot find (it is checked every time).

    Nothing of it names where the env lies (its path is written ``@ENV@``; a RECORD's lines
    for files outside site-packages, console scripts that hold the env's path in their first
    line, are left out), so a pass holds for every identical env: a second env of one lock
    and spec reuses the first one's pass."""
    root = target.python.absolute().parent.parent
    roots = [str(root), os.path.realpath(root)]
    sites = sorted(root.glob("lib/python3*/site-packages"))
    if not sites:
        return None
    listed: dict[str, Any] = {}
    for site in sites:
        entries = sorted(e.name for e in site.iterdir() if e.name != "__pycache__")
        digests = {}
        for name in entries:
            if name.endswith(".dist-info"):
                digests[name] = _digest(site / name / "RECORD", "RECORD", roots)
            elif name.endswith(".pth") or name == plans.HOOK:
                digests[name] = _digest(site / name, name, roots)
        listed[str(site.relative_to(root))] = {"entries": entries, "digests": digests}
    exe = target.python.resolve()
    st = exe.stat()
    script = resources.files("builder.probe").joinpath("imports_probe.py").read_bytes()
    names = sorted({*facts.env, *IMPORT_VARIABLES})
    return {
        "check": CHECK_VERSION,
        "request": request(asked(target)),
        "probe": hashlib.sha256(script).hexdigest(),
        "python": [str(exe), st.st_size, st.st_mtime_ns, facts.python_version],
        "variables": {k: _placeless(facts.environ.get(k), roots) for k in names},
        "sites": listed,
    }


def _placeless(value: str | None, roots: list[str]) -> str | None:
    """``value`` with the env's path written ``@ENV@``."""
    return None if value is None else normalise(value, roots)


def _digest(path: Path, name: str, roots: list[str]) -> str:
    """The sha256 of what the site-packages entry ``name`` at ``path`` holds wherever the env
    lies (plans.placeless); links not followed: a link's target is named instead."""
    try:
        if path.is_symlink():
            return f"link:{path.readlink()}"
        with path.open("rb") as f:
            data = f.read(MAX_RECORD)
    except OSError as exc:
        return f"unreadable: {type(exc).__name__}"
    return hashlib.sha256(plans.placeless(name, data, roots)).hexdigest()


def borrow_bytecode(other: Path, target: Target) -> tuple[str, str]:
    """The bytecode an identical env at ``other`` holds for its site-packages, copied into
    this env where this env has none: what the imports check would have written here (a pass
    reused from ``other`` imports nothing), so a server's first start here imports from
    bytecode too. A file is copied only when its header names this env's own source (its
    mtime and size: uv links one cache's files into both envs) and it is a regular file that
    only this user or root can write, in directories reached without a link; Python fixes
    the code's file names to this env's on load. The evidence line."""
    started = time.monotonic()
    # Strings and os.path, not pathlib: parsing 44,000 paths cost 1.3 s of 2.3 s for the
    # default env's 6,587 files; with this and hard links the borrow takes 0.5 s.
    root = str(target.python.absolute().parent.parent)
    copied = skipped = 0
    for site in sorted(other.glob("lib/python3*/site-packages")):
        if site.is_symlink() or not site.is_dir():
            continue
        there = str(site)
        here_site = os.path.join(root, str(site.relative_to(other)))  # noqa: PTH118
        # os.walk descends into no linked directory.
        for dirpath, _, filenames in os.walk(there):
            if os.path.basename(dirpath) != "__pycache__":  # noqa: PTH119
                continue
            into = here_site + dirpath[len(there) :]
            made = False
            for name in filenames:
                if not name.endswith(".pyc"):
                    continue
                done = _borrow_one(os.path.join(dirpath, name), into, name, made)  # noqa: PTH118
                made = made or done
                copied += done
                skipped += not done
    seconds = time.monotonic() - started
    return (
        "bytecode",
        f"{copied} file(s) copied from {other} in {seconds:.1f} s, each for this env's own "
        f"source ({skipped} left: present, or for another source)",
    )


def _borrow_one(src: str, into: str, name: str, made: bool) -> bool:
    """Copy one .pyc ``src`` into the ``__pycache__`` ``into`` (see :func:`borrow_bytecode`);
    False when it is not copied. ``made``: ``into`` exists already, made by this walk.

    The file is judged and taken through one descriptor (opened without following a link):
    linked into this env from that descriptor, or copied from it, never by its path again,
    so a file swapped in after the check is never the one taken. Its source in the other env
    must be this env's own source (the same file, as uv's links from one cache make it, or
    the same bytes): a header's mtime and size say nothing of what the source holds."""
    import stat

    dst = os.path.join(into, name)  # noqa: PTH118
    stem = name.split(".", 1)[0] + ".py"
    source = os.path.join(os.path.dirname(into), stem)  # noqa: PTH118, PTH120
    theirs = os.path.join(os.path.dirname(os.path.dirname(src)), stem)  # noqa: PTH118, PTH120
    try:
        if os.path.lexists(dst):
            return False
        here = os.lstat(source)
        if not stat.S_ISREG(here.st_mode) or not _same_source(source, here, theirs):
            return False
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RECORD:
            return False
        if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022:
            return False
        header = os.pread(fd, 16, 0)
        if len(header) < 16:
            return False
        # PEP 552's header: magic, flags (0: checked by the source's mtime and size), mtime,
        # size.
        flags, mtime, size = (int.from_bytes(header[i : i + 4], "little") for i in (4, 8, 12))
        mine = (int(here.st_mtime) & 0xFFFFFFFF, here.st_size & 0xFFFFFFFF)
        if flags != 0 or (mtime, size) != mine:
            return False
        if not made:
            with contextlib.suppress(FileExistsError):
                os.mkdir(into, 0o755)  # noqa: PTH102
            if not stat.S_ISDIR(os.lstat(into).st_mode):
                return False  # a link where __pycache__ would be: never written through
        try:
            # The open file itself (linkat of /proc/self/fd/N follows that one link to the
            # inode judged above). Python replaces a stale .pyc by renaming a new one over
            # it, never by writing into it: a hard link shares nothing either env changes.
            os.link(f"/proc/self/fd/{fd}", dst, follow_symlinks=True)
        except OSError:  # no /proc, or another file system: copied from the descriptor
            data = os.pread(fd, st.st_size, 0)
            tmp = f"{dst}.{os.getpid()}.tmp"
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(out, "wb") as sink:
                sink.write(data)
            os.replace(tmp, dst)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def _same_source(mine: str, here: os.stat_result, theirs: str) -> bool:
    """Whether the other env's source ``theirs`` is this env's ``mine``: the same file (one
    inode, linked from uv's cache into both), else the same bytes (read both: a copy)."""
    import stat

    try:
        there = os.lstat(theirs)
        if (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino):
            return True
        if not stat.S_ISREG(there.st_mode) or there.st_size != here.st_size:
            return False
        if there.st_size > MAX_RECORD:
            return False
        with open(mine, "rb") as a, open(theirs, "rb") as b:  # noqa: PTH123
            return a.read() == b.read()
    except OSError:
        return False


@dataclass
class _Read:
    """What the import probe's lines say (one JSON object a line, in the order it wrote them)."""

    evidence: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # top-level modules no distribution provides
    started: list[str] = field(default_factory=list)  # modules begun and not finished
    imported: int = 0
    servers: int = 0  # server start-up modules among those imported
    finished: bool = False


def _read(docs: list[dict[str, Any]], target: Target) -> _Read:
    out = _Read()
    server_modules = {m for s in SERVERS for m in s.modules}
    for doc in docs:
        if "dist" in doc:
            if doc.get("installed"):
                out.evidence.append(
                    (f"{doc['dist']} {doc.get('version')}", "imports " + ", ".join(doc["imports"]))
                )
            elif doc.get("required"):
                out.problems.append(f"{doc['dist']} is not installed in this env")
            elif target.packages is not None:
                out.evidence.append((str(doc["dist"]), "not installed (its marker leaves it out?)"))
        elif isinstance(doc.get("bytecode"), dict):
            kept = doc["bytecode"]
            out.evidence.append(
                (
                    "bytecode of what was imported",
                    f"{kept.get('written', 0)} written, {kept.get('present', 0)} already there, "
                    f"{kept.get('failed', 0)} not writable, in {kept.get('seconds', 0)} s",
                )
            )
        elif "start" in doc:
            out.started.append(str(doc["start"]))
        elif "module" in doc:
            out.started.remove(str(doc["module"]))
            took = f"{float(doc.get('seconds', 0.0)):.1f} s"
            if doc.get("ok"):
                out.imported += 1
                out.servers += doc["module"] in server_modules
                out.evidence.append((f"import {doc['module']}", f"ok in {took}"))
            else:
                out.evidence.append((f"import {doc['module']}", f"{doc.get('error')} ({took})"))
                out.problems.append(why(doc))
                if doc.get("missing") and not doc.get("providers"):
                    out.missing.append(str(doc["missing"]).split(".")[0])
    out.finished = any(doc.get("done") for doc in docs)
    return out


def _fix(target: Target, missing: list[str]) -> str:
    """What to do about a failed import: add what provides a missing module, else rebuild
    (or, without a spec, ask the doctor)."""
    spec = target.spec_path or "SPEC"
    if missing:
        return (
            f"add the distribution that provides {', '.join(dict.fromkeys(missing))} to the "
            f"spec's packages (`cudaenv add NAME --spec {spec}`; NAME is often the module's), "
            "or pin a release of the importing package that declares it"
        )
    if target.spec_path:
        return (
            f"rebuild the env (`cudaenv build {spec} --force`); if it persists, the "
            "packages' versions do not work together: change the pins"
        )
    # No spec to rebuild from (an adopted env, or any interpreter): the doctor reads the
    # installed set for a cause (a binding of another CUDA major, mixed minors).
    return (
        f"`cudaenv doctor --python {target.python}` names the installed packages that "
        "do not work together, with the command that repairs them"
    )


def check(target: Target, facts: EnvFacts) -> CheckResult:
    names = asked(target)
    script = str(resources.files("builder.probe").joinpath("imports_probe.py"))
    started = time.monotonic()
    extensions = source_extensions(target.python)
    # What the env built from an sdist is asked for even where no spec names it (an adopted
    # env's `adopt --rebuild`): its manifest says it is there and was compiled for it.
    named = {a.name for a in names}
    names += [Asked(name=d, required=True) for d in extensions if d not in named]
    argv: list[str | os.PathLike[str]] = [
        target.python, script, json.dumps(request(names, extensions)),
    ]  # fmt: skip
    timed_out = False
    try:
        done = proc.run(argv, env=env_of(target, facts), timeout=TIMEOUT_SECONDS, check=False)
        output, code, stderr = done.stdout, done.returncode, done.stderr
    except proc.CommandFailed as exc:  # past the timeout: what it said so far still counts
        output, code, stderr, timed_out = exc.output, -1, "", True
    seconds = time.monotonic() - started
    got = _read(read_lines(output), target)
    evidence, problems = got.evidence, got.problems
    if timed_out:
        hung = got.started[0] if got.started else "the probe"
        problems.append(f"import {hung} did not finish within {TIMEOUT_SECONDS:.0f} s")
    elif not got.finished:
        tail = (stderr.strip().splitlines() or [f"exit {code}"])[-1]
        problems.append(f"the import probe stopped (exit {code}): {tail[:300]}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(
            name="imports",
            status=FAILED,
            summary=problems[0] + more,
            evidence=(*evidence, *((f"problem {i + 1}", p) for i, p in enumerate(problems))),
            seconds=seconds,
            fix=_fix(target, got.missing),
        )
    if got.imported == 0:
        return CheckResult(
            name="imports",
            status=SKIPPED,
            summary="nothing to import: the env has none of " + ", ".join(a.name for a in names)
            if target.packages is None
            else "nothing to import: the spec asks for no package",
            evidence=tuple(evidence),
            seconds=seconds,
        )
    return CheckResult(
        name="imports",
        status=PASSED,
        summary=f"{got.imported} module(s) import"
        + (f", {got.servers} server start-up module(s) among them" if got.servers else ""),
        evidence=tuple(evidence),
        seconds=seconds,
    )
