"""``cudaenv adopt``: give an env the user already has the toolchain torch is built for.

Where a user stands: a working venv (uv, venv/pip, virtualenv) or conda env with torch and
FlashInfer, a system ``/usr/local/cuda`` of another release, and a JIT that cannot build.
Adopt reads torch's CUDA from the env itself (torch's own ``cuda-toolkit`` pin), installs the
matching toolkit components with uv into that env (realigning drifted ones: nvcc 13.5 and
cccl 13.3 beside runtime 13.0, flashinfer#3493), then adds what a built env has: the
``cuda-home/`` overlay, the start-up hook, the ``activate`` block, the JIT caches in ``var/``
and a manifest.

Every change goes into a journal first (``.cudaenv-adopt.json`` in the env, one file written
whole, so that writing it creates no directory a kill could leave behind). A failure or
interrupt inside adopt undoes what was done before it returns; a run killed outright (at any
point: uv's install included) leaves the journal, and one more ``adopt`` (or ``adopt --undo``)
puts the env back as it was first. The start-up hook's ``.pth`` is written last, so until the
very end the interpreter behaves as before. Undo is resumable the same way: each of its steps
looks at the env as it is, so it can run again from the start, and the journal stays (marked
``undoing``) until the env has been checked to be as it was; removing the journal is undo's
last step. What a killed uv leaves, undo removes too: files below ``site-packages/nvidia/``
that were not there before adopt and that no installed package's RECORD names (a package whose
files were copied before its ``.dist-info``), and a ``.dist-info`` without RECORD.

Adopt and undo hold the env's lock (:func:`locked`) from reading its state to the last change.
Adopt never touches an env whose cudaenv files it cannot account for: one ``cudaenv build``
made (its build manages it) or one holding cudaenv's files without a journal.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime as dt
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal, get_args

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement

from builder import (
    __version__,
    archs,
    caches,
    channels,
    jsondoc,
    manifest,
    platforms,
    proc,
    toolchain,
)
from builder.archs import Arch
from builder.build import env_lock, fault_point
from builder.cudaversion import CudaVersion
from builder.errors import BuildError, CommandFailed, CudaenvError
from builder.jsondoc import Reader
from builder.manifest import Manifest
from builder.spec import DEFAULT_COMPONENTS, EnvSpec, Toolchain

JOURNAL = Path(".cudaenv-adopt.json")
# Where earlier releases kept it (its directory made first): still read, moved on the next write.
OLD_JOURNAL = Path("var") / "cudaenv" / "adopt.json"
# The lock adopt and --undo hold: build's env lock (a flock the kernel drops when its holder
# dies, the holder's name inside for a waiter to print), but its file inside the env, as uv
# keeps .venv/.lock: adopt changes the env in place (a build swaps the directory whole, so its
# lock lies beside it), and a file beside a user's .venv would land in their project. Not uv's
# own .lock, which the uv adopt runs takes. Removed when the env is left with no journal: an
# undone env holds nothing of cudaenv.
LOCK_FILE = ".cudaenv-adopt.lock"
# How long a second adopt (or undo) of one env waits for the first before refusing (exit 3):
# uv's default for its own locks (UV_LOCK_TIMEOUT, 300 s). It waits rather than refusing at
# once, as a second uv does: run twice, the second finds the env adopted and says so (exit 0);
# only a holder stuck for minutes is an error, named with its pid.
LOCK_WAIT = 300.0
Progress = Callable[[str], None]


class Refused(CudaenvError):
    """adopt will not touch this env; nothing was changed."""

    exit_code = 3


@dataclass(frozen=True, kw_only=True)
class Env:
    """What the probe found in the interpreter to adopt."""

    python: Path
    prefix: Path
    version: str
    is_env: bool  # a venv or a conda env, not a system or distro Python
    purelib: Path
    dists: dict[str, str]
    torch: str | None
    torch_cuda: str | None
    torch_requires: tuple[str, ...]
    cuda_home: str
    # *.dist-info directories with no METADATA (an uninstall killed midway), full paths.
    broken: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Plan:
    env: Env
    cuda: str
    requirements: tuple[str, ...]  # what uv installs ("" for a system toolkit)
    changes: tuple[tuple[str, str | None, str | None], ...]  # name, before, after
    system_toolkit: Path | None
    spec: EnvSpec
    files: tuple[str, ...] = field(default=())

    def lines(self) -> list[str]:
        out = [f"adopt {self.env.prefix}: torch {self.env.torch} is built for CUDA {self.cuda}"]
        if self.system_toolkit is not None:
            out.append(f"  toolkit: the machine's {self.system_toolkit} (CUDA {self.cuda})")
        for name, before, after in self.changes:
            verb = "install" if before is None else ("remove" if after is None else "replace")
            what = (
                after if before is None else (before if after is None else f"{before} -> {after}")
            )
            out.append(f"  {verb} {name} {what}")
        if not self.changes and self.system_toolkit is None:
            out.append("  packages: nothing to install, the toolkit already matches")
        out += [f"  add {f}" for f in self.files]
        return out


def inspect(python: Path) -> Env:
    script = str(resources.files("builder.probe").joinpath("adopt_probe.py"))
    done = proc.run([python, script], timeout=120)
    try:
        doc = json.loads(done.stdout.strip().splitlines()[-1])
        torch = doc["torch"]
        return Env(
            python=python,
            prefix=Path(doc["prefix"]),
            version=str(doc["version"]),
            is_env=doc["prefix"] != doc["base_prefix"] or bool(doc["conda"]),
            purelib=Path(doc["purelib"]),
            dists={str(k): str(v) for k, v in doc["distributions"].items()},
            torch=torch.get("version") if torch.get("installed") else None,
            torch_cuda=torch.get("cuda"),
            torch_requires=tuple(torch.get("requires") or ()),
            cuda_home=str(doc.get("cuda_home") or ""),
            broken=tuple(str(b) for b in doc.get("broken") or ()),
        )
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise BuildError(
            f"{python}: the adopt probe printed no facts: {done.stdout[-300:]!r}"
        ) from exc


def torch_pin(env: Env) -> tuple[str, str] | None:
    """(name, version) of the CUDA package torch pins exactly on this platform:
    ``cuda-toolkit`` (torch >= 2.10) or ``nvidia-cuda-runtime*`` (older)."""
    marker_env: dict[str, str] = {str(k): str(v) for k, v in default_environment().items()}
    marker_env["python_version"] = env.version
    host = platforms.KNOWN.get(platforms.host_name())
    if host is not None:
        marker_env.update(host.marker_environment(env.version))
    for text in env.torch_requires:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({**marker_env, "extra": ""}):
            continue
        name = req.name.lower()
        if name == "cuda-toolkit" or name.startswith("nvidia-cuda-runtime"):
            pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
            if pins:
                return name, pins[0]
    return None


# Where a CUDA 12 env's toolkit may be, after the env's own CUDA_HOME.
SYSTEM_TOOLKITS = ("/usr/local/cuda-{cuda}", "/usr/local/cuda")


def _system_toolkit(cuda: str, env: Env) -> Path | None:
    """A toolkit on this machine whose nvcc is CUDA ``cuda`` (CUDA 12 has no pip nvcc)."""
    candidates = [env.cuda_home, *(c.format(cuda=cuda) for c in SYSTEM_TOOLKITS)]
    for text in dict.fromkeys(c for c in candidates if c):
        path = Path(text)
        if (path / "bin" / "nvcc").exists():
            with contextlib.suppress(CudaenvError):
                if toolchain.nvcc_release(path) == cuda:
                    return path
    return None


def _refuse(env: Env, why: str) -> Refused:
    return Refused(f"{env.python}: {why}; nothing was changed")


def _cudaenv_files(prefix: Path, site: Path) -> list[str]:
    """The files of cudaenv's wiring present in the env, relative to it."""
    found = [
        str(path.relative_to(prefix)) + ("/" if path.name == "cuda-home" else "")
        for path in (
            prefix / "cuda-home",
            prefix / manifest.FILE,
            site / toolchain.PTH_NAME,
            site / f"{toolchain.HOOK_MODULE}.py",
        )
        if path.is_symlink() or path.exists()
    ]
    for name, path in _activation_scripts(prefix).items():
        with contextlib.suppress(OSError):
            if toolchain.BLOCK_MARK in path.read_text(errors="replace"):
                found.append(f"the cudaenv block in bin/{name}")
    return found


def _built_by(prefix: Path) -> str | None:
    """The spec of an env ``cudaenv build`` made (its manifest names one), else None."""
    found = manifest.try_read(prefix)
    return found.spec if found is not None and found.spec != manifest.ADOPTED_SPEC else None


def preflight(env: Env) -> None:
    """Refused where adopt must not start: an env ``cudaenv build`` made (its spec and build
    manage its toolchain; adopt's rollback would remove the build's wiring), cudaenv's files
    with no adopt journal to account for them (undoing a failure would remove what adopt did
    not write), or a place adopt writes that this user cannot."""
    spec = _built_by(env.prefix)
    if spec is not None:
        raise _refuse(
            env,
            f"{env.prefix} was built by cudaenv from {spec} (its {manifest.FILE}); "
            f"`cudaenv build {spec} --force` rebuilds it, adopt would unwire it",
        )
    if read_journal(env.prefix) is None:
        present = _cudaenv_files(env.prefix, env.purelib)
        if present:
            raise _refuse(
                env,
                f"{env.prefix} holds cudaenv's {', '.join(present)} but no adopt journal "
                f"({JOURNAL}) says what they replaced; remove them, then adopt",
            )
    places = [
        env.prefix,
        env.prefix / "bin",
        env.purelib,
        env.prefix / "var",
        env.prefix / "var" / "cudaenv",
    ]
    for place in places:
        if place.exists() and not os.access(place, os.W_OK):
            raise _refuse(env, f"{place} is not writable by this user (a read-only env?)")


def nothing_to_undo(env: Env) -> str:
    """What ``--undo`` says of an env with no adopt journal; Refused where cudaenv's files are
    there all the same (no journal says what they replaced, so undo cannot put it back)."""
    spec = _built_by(env.prefix)
    if spec is not None:
        return (
            f"nothing to undo: {env.prefix} was built by cudaenv from {spec}, not adopted "
            f"(`cudaenv build {spec}` manages it)"
        )
    present = _cudaenv_files(env.prefix, env.purelib)
    if present:
        raise _refuse(
            env,
            f"it holds cudaenv's {', '.join(present)} but no adopt journal ({JOURNAL}) says "
            "what they replaced, so undo cannot put it back; remove them by hand",
        )
    _tidy(env.prefix)  # the lock file of a run killed before or after its journal
    return f"nothing to undo: {env.prefix} has no adopt journal ({JOURNAL}); it is not adopted"


@contextlib.contextmanager
def locked(
    prefix: Path, progress: Progress, *, holder: str = "cudaenv adopt", wait: float = LOCK_WAIT
) -> Iterator[None]:
    """Hold the env's lock (see LOCK_FILE): EnvBusy (exit 3) naming the holder after ``wait``
    seconds, Refused where the lock cannot be made (a read-only env)."""
    lock_file = prefix / LOCK_FILE
    with contextlib.ExitStack() as stack:
        try:
            lock = env_lock(prefix, progress, lock_file=lock_file, holder=holder,
                            doing="changing", wait=wait)  # fmt: skip
            stack.enter_context(lock)
        except OSError as exc:
            raise Refused(
                f"{lock_file}: cannot take the env's lock ({exc.strerror}); nothing was changed"
            ) from exc
        try:
            yield
        finally:
            # Unlinked while held: a waiter that then locks the removed file sees it is not
            # the one at the path and opens that (build.env_lock).
            with contextlib.suppress(OSError, CudaenvError):
                if read_journal(prefix) is None:
                    lock_file.unlink(missing_ok=True)


def plan(env: Env, *, env_archs: tuple[Arch, ...] | None = None, force: bool = False) -> Plan:
    """What adopt will do, or Refused naming why it will not (nothing is changed either way)."""
    preflight(env)
    if not env.is_env and not force:
        raise _refuse(
            env,
            "not inside a virtual environment or conda env (a system or distro Python); "
            "pass --force to change it anyway",
        )
    if env.torch is None:
        raise _refuse(env, "no torch here: adopt matches the toolkit to torch's CUDA")
    if not env.torch_cuda:
        raise _refuse(
            env,
            f"torch {env.torch} is a CPU-only build (torch.version.cuda is None): no CUDA to match",
        )
    cuda = env.torch_cuda
    try:
        version = CudaVersion.parse(cuda)
    except ValueError:
        raise _refuse(
            env,
            f"torch {env.torch} reports torch.version.cuda = {cuda!r}, not a CUDA major.minor "
            'like "13.0": no CUDA to match',
        ) from None
    components = list(DEFAULT_COMPONENTS)
    if "flashinfer-python" in env.dists:
        components.append("curand")  # FlashInfer's sampling kernels include <curand.h>
    chosen = env_archs or archs.DEFAULT_ARCHS
    if env_archs is None and archs.cuda_problems(version, chosen):
        # 12.0f needs CUDA 12.9; before it, the arch-specific 12.0a is what nvcc knows.
        chosen = tuple(dataclasses.replace(a, suffix="a") for a in chosen)
    problems = archs.cuda_problems(version, chosen)
    if problems:
        raise _refuse(env, "; ".join(problems) + " (name the archs with --archs)")
    spec = EnvSpec(
        name=f"adopted-{env.prefix.name}",
        python=env.version,
        cuda=cuda,
        source=env.prefix / "cudaenv-adopted",
        archs=chosen,
        toolchain=Toolchain(source="wheels", components=tuple(components)),
    )
    if not channels.has_pip_nvcc(version.major):
        toolkit = _system_toolkit(cuda, env)
        if toolkit is None:
            raise _refuse(
                env,
                f"torch {env.torch} is built for CUDA {cuda}, which has no nvcc on PyPI, and no "
                f"CUDA {cuda} toolkit is on this machine (CUDA_HOME, /usr/local/cuda-{cuda}): "
                f"install CUDA {cuda} there",
            )
        spec = dataclasses.replace(spec, toolchain=Toolchain(source="system", path=toolkit))
        return Plan(env=env, cuda=cuda, requirements=(), changes=(), system_toolkit=toolkit,
                    spec=spec, files=_files(env))  # fmt: skip
    pin = torch_pin(env)
    extras = channels.toolkit_extras(tuple(components))
    if pin is not None and pin[0] == "cuda-toolkit":
        requirements: tuple[str, ...] = (f"cuda-toolkit[{extras}]=={pin[1]}",)
    else:
        requirements = (f"cuda-toolkit[{extras}]>={cuda},<{version.next_minor()}",)
        if pin is not None:
            requirements += (f"{pin[0]}=={pin[1]}",)
    changes = _dry_run(env, requirements)
    return Plan(env=env, cuda=cuda, requirements=requirements, changes=changes,
                system_toolkit=None, spec=spec, files=_files(env))  # fmt: skip


def _files(env: Env) -> tuple[str, ...]:
    return (
        "cuda-home/ (the toolkit in CUDA_HOME's shape)",
        f"{env.purelib.relative_to(env.prefix)}/{toolchain.HOOK_MODULE}.py and {toolchain.PTH_NAME}",
        "bin/activate and each other shell's activation script the env has: the cudaenv block",
        f"var/: the JIT caches ({len(caches.CACHES)} directories) and var/cudaenv/",
        manifest.FILE,
    )


_CHANGE = re.compile(r"^\s*([+-])\s+([A-Za-z0-9._-]+)==(\S+)")


def _dry_run(
    env: Env, requirements: Sequence[str]
) -> tuple[tuple[str, str | None, str | None], ...]:
    argv = [
        proc.uv_bin(),
        "pip",
        "install",
        "--dry-run",
        "--python",
        str(env.python),
        *requirements,
    ]
    try:
        done = proc.run(argv, env=proc.uv_env(), timeout=1800)
    except proc.CommandFailed as exc:
        lines = [ln for ln in exc.output.strip().splitlines() if ln.strip()][-15:]
        raise _refuse(
            env,
            "uv cannot install the matched toolkit without breaking what this env pins:\n"
            + "\n".join(lines),
        ) from exc
    before: dict[str, str] = {}
    after: dict[str, str] = {}
    for line in (done.stdout + "\n" + done.stderr).splitlines():
        m = _CHANGE.match(line)
        if m:
            (before if m.group(1) == "-" else after)[m.group(2).lower()] = m.group(3)
    names = sorted(set(before) | set(after))
    return tuple((n, before.get(n), after.get(n)) for n in names)


# --------------------------------------------------------------------------- apply / undo


# "started" from before the first change until the manifest is written, "done" after it;
# "undoing" from the first change an undo makes until the env is checked to be as it was.
JournalState = Literal["started", "done", "undoing"]
JOURNAL_STATES: tuple[JournalState, ...] = get_args(JournalState)


@dataclass(frozen=True, kw_only=True)
class Journal:
    """The adopt journal: the env as it was, so that undo can put it back."""

    state: JournalState
    python: str | None
    # Distribution -> version before adopt; None where the journal does not say (undo then
    # leaves the packages alone rather than remove every one).
    before: tuple[tuple[str, str], ...] | None
    changes: tuple[tuple[str, str | None, str | None], ...]  # name, before, after (the plan's)
    activation: tuple[tuple[str, str], ...]  # each shell's activation script as it was
    var_before: tuple[str, ...]  # what var/ held, relative to the env
    var_existed: bool
    started_at: str | None
    # *.dist-info directories already without METADATA before adopt: not adopt's to remove.
    broken_before: tuple[str, ...] = ()
    # The directories below site-packages/nvidia/ (two levels) before adopt, where the toolkit
    # wheels unpack; None in a journal from before it was kept (undo then checks no tree).
    site_before: tuple[str, ...] | None = None
    # Every file, link and directory (ending in /) below site-packages/nvidia/ before adopt,
    # relative to site-packages: what a killed uv copied there with no .dist-info naming it
    # yet is told apart by it. None in a journal from before it was kept (undo then removes
    # no unnamed file).
    nvidia_before: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "state": self.state,
            "python": self.python,
            "before": None if self.before is None else dict(self.before),
            "changes": [list(c) for c in self.changes],
            "activation": dict(self.activation),
            "var_before": list(self.var_before),
            "var_existed": self.var_existed,
            "started_at": self.started_at,
            "broken_before": list(self.broken_before),
            "site_before": None if self.site_before is None else list(self.site_before),
            "nvidia_before": None if self.nvidia_before is None else list(self.nvidia_before),
        }

    @classmethod
    def from_json(cls, doc: object, where: str) -> Journal:
        # No key is required: a journal written by an older cudaenv may lack any of them, and
        # undo does what the keys present allow; one not marked done is an unfinished adopt.
        # Only a key present with a value of the wrong kind is an error.
        r = Reader(doc, where, "adopt journal")
        activation = r.opt_text_map("activation")
        if activation is None:
            # A journal written before every shell's script was kept held bin/activate alone.
            old = r.opt_text("activate")
            activation = {"activate": old} if old is not None else {}
        before = r.opt_text_map("before")
        return cls(
            state=r.opt_choice("state", JOURNAL_STATES) or "started",
            python=r.opt_text("python"),
            before=None if before is None else tuple(before.items()),
            changes=tuple(
                _change(r, i, c) for i, c in enumerate(r.items("changes", required=False))
            ),
            activation=tuple(activation.items()),
            var_before=r.texts("var_before", required=False),
            var_existed=r.opt_flag("var_existed"),
            started_at=r.opt_text("started_at"),
            broken_before=r.texts("broken_before", required=False),
            site_before=None if r.doc.get("site_before") is None else r.texts("site_before"),
            nvidia_before=None if r.doc.get("nvidia_before") is None else r.texts("nvidia_before"),
        )


def _change(r: Reader, i: int, item: object) -> tuple[str, str | None, str | None]:
    if (
        not isinstance(item, list)
        or len(item) != 3
        or not isinstance(item[0], str)
        or not all(v is None or isinstance(v, str) for v in item[1:])
    ):
        raise r.error(
            f"expected [name, version before or null, version after or null], got {item!r}",
            f"changes[{i}]",
        )
    return item[0], item[1], item[2]


def _journal(prefix: Path) -> Path:
    """Where the env's journal is: JOURNAL, or OLD_JOURNAL where only that one is there."""
    if not (prefix / JOURNAL).exists() and (prefix / OLD_JOURNAL).exists():
        return prefix / OLD_JOURNAL
    return prefix / JOURNAL


def read_journal(prefix: Path) -> Journal | None:
    """The env's adopt journal; None where there is none, ReportError (exit 2) naming the file
    and the key where it is unreadable or malformed."""
    path = _journal(prefix)
    if not path.exists():
        return None
    return Journal.from_json(jsondoc.load(path, "adopt journal"), str(path))


def _write_journal(prefix: Path, journal: Journal) -> None:
    """Write the journal whole (a reader, or a run after a kill, sees the old one or the new
    one); an old-place journal goes once the new one is written."""
    proc.atomic_write_text(
        prefix / JOURNAL, json.dumps(journal.to_json(), indent=1, sort_keys=True)
    )
    (prefix / OLD_JOURNAL).unlink(missing_ok=True)


def _atomic_leftovers(prefix: Path) -> list[Path]:
    """The temporary files of cudaenv's atomic writes into the env (proc.atomic_write_text:
    ``.NAME.XXXXXXXX.tmp`` beside NAME) that a kill mid-write left: the journal, the manifest,
    the hook's .pth and each shell's activation script."""
    beside = [(prefix, JOURNAL.name), (prefix, manifest.FILE),
              (prefix / OLD_JOURNAL.parent, OLD_JOURNAL.name)]  # fmt: skip
    beside += [(site, toolchain.PTH_NAME) for site in prefix.glob("lib/python3.*/site-packages")]
    beside += [(prefix / "bin", name) for name, _, _ in toolchain.ACTIVATIONS]
    return [tmp for d, name in beside for tmp in d.glob(f".{name}.*.tmp") if tmp.is_file()]


def _tidy(prefix: Path) -> None:
    """What a run killed before its journal was written or after it was removed can leave:
    the env's lock file and the temporary file of an atomic write. Removed only with the lock
    taken at once (nobody is changing the env) and no journal there; otherwise left."""
    lock_file = prefix / LOCK_FILE
    if not lock_file.exists() and not _atomic_leftovers(prefix):
        return
    with contextlib.suppress(CudaenvError, OSError), locked(prefix, lambda _: None, wait=0):
        # locked() removes the lock file on the way out where there is no journal.
        if read_journal(prefix) is None:
            for tmp in _atomic_leftovers(prefix):
                tmp.unlink(missing_ok=True)


def apply(p: Plan, progress: Progress) -> Manifest:
    """Adopt as planned, with :func:`locked` held. Anything that stops it midway (an error,
    Ctrl-C, SIGTERM) undoes what was done before it is raised again; an error then says
    whether the env is as it was."""
    env = p.env
    # Again, under the lock: the env may have changed since the plan was made.
    preflight(env)
    if read_journal(env.prefix) is not None:
        raise _refuse(env, f"it has an adopt journal ({JOURNAL}): undo that adopt first")
    var_before = sorted(str(c.relative_to(env.prefix)) for c in (env.prefix / "var").glob("*")) if (
        env.prefix / "var").is_dir() else []  # fmt: skip
    fault_point("adopt-start", progress)
    for tmp in _atomic_leftovers(env.prefix):  # a run killed mid-write, before its journal
        tmp.unlink()
    journal = Journal(
        state="started",
        python=str(env.python),
        before=tuple(env.dists.items()),
        changes=p.changes,
        # Every activation script write_hooks may change, as it was: undo puts each back.
        activation=tuple(
            (name, path.read_text()) for name, path in _activation_scripts(env.prefix).items()
        ),
        var_before=tuple(var_before),
        var_existed=(env.prefix / "var").exists(),
        started_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        broken_before=env.broken,
        site_before=_site_tree(env.purelib),
        nvidia_before=_nvidia_files(env.purelib),
    )
    try:
        _write_journal(env.prefix, journal)
        fault_point("adopt-journal", progress)
        if p.requirements:
            progress(f"installing {', '.join(p.requirements)} into {env.prefix} with uv")
            argv = [proc.uv_bin(), "pip", "install", "--python", str(env.python), *p.requirements]
            try:
                proc.run(argv, env=proc.uv_env(), stream=True, timeout=3600)
            except proc.CommandFailed as exc:
                raise BuildError(
                    f"installing the toolkit failed:\n{exc.output.strip()[-2000:]}"
                ) from exc
        fault_point("adopt-overlay", progress)
        env_archs = archs.env_archs(p.spec.archs, p.spec.cuda_version)
        if p.system_toolkit is None:
            overlay = toolchain.wheel_overlay(env.prefix, p.spec)
        else:
            overlay = toolchain.system_overlay(env.prefix, p.spec)
        fault_point("adopt-hooks", progress)
        toolchain.write_hooks(env.prefix, p.spec, env_archs)
        after = inspect(env.python).dists
        built = Manifest(
            name=p.spec.name,
            spec=manifest.ADOPTED_SPEC,
            fingerprint="adopted",
            lock_hash="sha256:"
            + hashlib.sha256(json.dumps(after, sort_keys=True).encode()).hexdigest(),
            python=env.version,
            cuda=p.cuda,
            torch=env.torch,
            torch_cuda=env.torch_cuda,
            toolkit=next(
                (v for n, _, v in p.changes if n == "cuda-toolkit" and v),
                env.dists.get("cuda-toolkit"),
            ),
            nvcc=overlay.nvcc_release,
            toolchain_source=p.spec.toolchain.source,
            archs=env_archs,
            spec_archs=p.spec.archs,
            packages=tuple(sorted(after.items())),
            env=(),
            built_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            cudaenv=__version__,
            path=str(env.prefix),
            platform=platforms.host_name(),
        )
        fault_point("adopt-manifest", progress)
        manifest.write(built, env.prefix)
        fault_point("adopt-done", progress)
        _write_journal(env.prefix, dataclasses.replace(journal, state="done"))
        return built
    except BaseException as exc:
        rollback = _roll_back(env, progress)
        if rollback is not None:
            raise BuildError(
                f"adopting {env.prefix} failed ({_why(exc)}) and undoing it failed too "
                f"({rollback}): `cudaenv adopt --undo --python {env.python}` finishes the undo"
            ) from exc
        if isinstance(exc, OSError):
            raise BuildError(f"{_why(exc)}; {env.prefix} is as it was before adopt") from exc
        raise


def _why(exc: BaseException) -> str:
    """An exception in one line: an OSError as ``PATH: reason``, a CudaenvError's first line."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror}"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _roll_back(env: Env, progress: Progress) -> str | None:
    """Undo a failed adopt; None when the env is as it was, else why not (the journal stays
    for ``--undo``)."""
    try:
        if read_journal(env.prefix) is not None:
            undo(env.prefix, env.python, progress)
        else:
            # The journal itself could not be written (it makes no directory): at most its
            # temporary file is there.
            for tmp in _atomic_leftovers(env.prefix):
                tmp.unlink(missing_ok=True)
    except Exception as exc:  # reported with the failure it was undoing
        return _why(exc)
    return None


def _activation_scripts(prefix: Path) -> dict[str, Path]:
    names = [script for script, _, _ in toolchain.ACTIVATIONS]
    return {n: prefix / "bin" / n for n in names if (prefix / "bin" / n).is_file()}


# The toolkit wheels unpack below site-packages/nvidia/ (nvidia/cu13/bin, ...), beside torch's
# own CUDA wheels; a directory there that adopt's packages made is adopt's to remove.
_TREE_ROOT = "nvidia"


def _site_tree(site: Path) -> tuple[str, ...]:
    """The directories ``nvidia``, ``nvidia/X`` and ``nvidia/X/Y`` below ``site``."""
    root = site / _TREE_ROOT
    if not root.is_dir() or root.is_symlink():
        return ()
    found = [_TREE_ROOT]
    for child in sorted(root.iterdir()):
        if child.is_dir() and not child.is_symlink() and child.name != "__pycache__":
            found.append(f"{_TREE_ROOT}/{child.name}")
            found += [
                f"{_TREE_ROOT}/{child.name}/{g.name}"
                for g in sorted(child.iterdir())
                if g.is_dir() and not g.is_symlink() and g.name != "__pycache__"
            ]
    return tuple(found)


def _holds_files(tree: Path) -> bool:
    return any(files for _, _, files in os.walk(tree))


def _nvidia_files(site: Path) -> tuple[str, ...]:
    """Every file, link and directory (``nvidia/cu13/``) below ``site/nvidia/``, relative to
    ``site``, sorted."""
    root = site / _TREE_ROOT
    if not root.is_dir() or root.is_symlink():
        return ()
    found = [f"{_TREE_ROOT}/"]
    for top, dirs, files in os.walk(root):
        here = Path(top)
        for d in dirs:  # a link to a directory is one entry, never walked into (os.walk)
            rel = (here / d).relative_to(site).as_posix()
            found.append(rel if (here / d).is_symlink() else f"{rel}/")
        found += [(here / f).relative_to(site).as_posix() for f in files]
    return tuple(sorted(found))


def _recorded(site: Path) -> set[str]:
    """The paths below ``site/nvidia/`` that some installed distribution's RECORD names."""
    named: set[str] = set()
    for record in site.glob("*.dist-info/RECORD"):
        with contextlib.suppress(OSError):
            for row in csv.reader(record.read_text(errors="replace").splitlines()):
                if row and row[0].startswith(f"{_TREE_ROOT}/"):
                    named.add(os.path.normpath(row[0]))
    return named


def _sweep_unnamed(site: Path, before: set[str]) -> int:
    """Remove each file below ``site/nvidia/`` that was not there before adopt and that no
    installed distribution's RECORD names (uv copies a wheel's files before writing its
    .dist-info, so a uv killed midway leaves files no uninstall will find), then each
    directory that was not there before and is left empty. Returns how many files."""
    named = _recorded(site)
    now = _nvidia_files(site)
    swept = 0
    for rel in now:
        if not rel.endswith("/") and rel not in before and rel not in named:
            (site / rel).unlink()
            swept += 1
    for rel in sorted((r for r in now if r.endswith("/") and r not in before), reverse=True):
        with contextlib.suppress(OSError):  # only an empty one
            (site / rel).rmdir()
    return swept


def _unrecorded(now: Env, before: dict[str, str]) -> list[Path]:
    """The .dist-info directories without RECORD of distributions adopt added or changed."""
    found = []
    for info in sorted(now.purelib.glob("*.dist-info")):
        name = _dist_name(str(info))
        if (name not in before or now.dists.get(name) != before[name]) and not (
            info / "RECORD"
        ).exists():
            found.append(info)
    return found


def _dist_name(dist_info: str) -> str:
    """``nvidia-cuda-cccl`` from ``.../nvidia_cuda_cccl-13.0.85.dist-info``."""
    return re.sub(r"[-_.]+", "-", Path(dist_info).name.split("-")[0]).lower()


def _remove_half_dist(dist_info: Path, prefix: Path) -> None:
    """Finish what a killed uninstall began: the files its RECORD still names (inside the
    env only), the dist-info directory, then the directories that left empty."""
    site = dist_info.parent
    parents: set[Path] = set()
    record = dist_info / "RECORD"
    if record.is_file():
        for row in csv.reader(record.read_text(errors="replace").splitlines()):
            if not row or not row[0]:
                continue
            path = Path(os.path.normpath(site / row[0]))
            if not path.is_relative_to(prefix) or path.is_relative_to(dist_info):
                continue
            if path.is_symlink() or path.is_file():
                path.unlink()
                parents.add(path.parent)
    shutil.rmtree(dist_info)
    for parent in sorted(parents, key=lambda d: len(d.parts), reverse=True):
        while parent != site and parent.is_relative_to(site):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent


def undo(prefix: Path, python: Path, progress: Progress) -> list[str]:
    """Put the env back as the journal says it was (with :func:`locked` held): the same
    distributions and versions, no cudaenv file; what was restored, one line each.

    Resumable: the journal says ``undoing`` from the first change on and goes only once the
    env is checked to be as it was, so an undo killed midway is finished by the next one (a
    half-removed distribution included). Where something could not be put back, BuildError
    names it and the journal stays for another try."""
    journal = read_journal(prefix)
    if journal is None:
        raise BuildError(
            f"{prefix} has no adopt journal ({JOURNAL}): it was not adopted by cudaenv"
        )
    try:
        return _undo(prefix, python, journal, progress)
    except OSError as exc:
        raise BuildError(
            f"{_why(exc)}; the undo of {prefix} did not finish (its journal is kept): "
            f"`cudaenv adopt --undo --python {python}` finishes it"
        ) from exc


def _undo(prefix: Path, python: Path, journal: Journal, progress: Progress) -> list[str]:
    if journal.state != "undoing" or _journal(prefix) != prefix / JOURNAL:
        _write_journal(prefix, dataclasses.replace(journal, state="undoing"))
    fault_point("undo-files", progress)
    done: list[str] = []
    # Files first: the hook goes before anything else, so the interpreter is plain again.
    site = toolchain.site_packages(prefix)
    for rel in (
        site / toolchain.PTH_NAME,
        site / f"{toolchain.HOOK_MODULE}.py",
        *sorted(site.glob(f"__pycache__/{toolchain.HOOK_MODULE}.*.pyc")),
        prefix / manifest.FILE,
    ):
        if rel.exists():
            rel.unlink()
            done.append(f"removed {rel.relative_to(prefix)}")
    home = prefix / "cuda-home"
    if home.is_symlink() or home.exists():
        if home.is_symlink():
            home.unlink()
        else:
            shutil.rmtree(home)
        done.append("removed cuda-home/")
    originals = dict(journal.activation)
    for name, path in _activation_scripts(prefix).items():
        original = originals.get(name)
        if original is not None and path.read_text() != original:
            proc.atomic_write_text(path, original)
            done.append(f"restored bin/{name}")
    if journal.before is not None:
        done += _undo_packages(prefix, python, journal, progress)
    left = _left_over(prefix, python, journal)
    if left:
        raise BuildError(
            f"{prefix}: undo could not put back {'; '.join(left)} (the journal is kept: "
            f"`cudaenv adopt --undo --python {python}` tries again)"
        )
    var = prefix / "var"
    kept = set(journal.var_before)
    if var.is_dir():
        for child in sorted(var.iterdir()):
            if str(child.relative_to(prefix)) not in kept:
                shutil.rmtree(child, ignore_errors=True)
    if not journal.var_existed and var.is_dir() and not any(var.iterdir()):
        var.rmdir()
    for tmp in _atomic_leftovers(prefix):
        tmp.unlink(missing_ok=True)
    fault_point("undo-journal", progress)
    # The last step: until here a kill leaves the journal, and the next undo runs again.
    (prefix / JOURNAL).unlink(missing_ok=True)
    fault_point("undo-done", progress)  # killed here, the lock file stays (see _tidy)
    return done


def _undo_packages(prefix: Path, python: Path, journal: Journal, progress: Progress) -> list[str]:
    assert journal.before is not None
    fault_point("undo-packages", progress)
    done: list[str] = []
    before = dict(journal.before)
    now = inspect(python)
    touched = set()
    for path in now.broken:
        if path not in journal.broken_before:
            _remove_half_dist(Path(path), prefix)
            touched.add(_dist_name(path))
            done.append(f"removed the half-removed {Path(path).name}")
    # A .dist-info a killed uv left without RECORD (written last): no installer can remove
    # it, and what it would name is swept below as files no package names.
    unrecorded = _unrecorded(now, before)
    for info in unrecorded:
        shutil.rmtree(info)
        touched.add(_dist_name(str(info)))
        done.append(f"removed {info.name} (no RECORD: its install was cut short)")
    if unrecorded:
        now = inspect(python)
    added = sorted(n for n in now.dists if n not in before)
    # A half-removed distribution of a package the env had may have shared its files with the
    # version there now: reinstalled whole.
    changed = sorted(n for n in before if now.dists.get(n) != before[n] or n in touched)
    uv = proc.uv_bin()
    # A failed uv leaves its packages where they are; the check after says which.
    if added:
        progress(f"removing {len(added)} package(s) adopt added")
        with contextlib.suppress(CommandFailed):
            proc.run([uv, "pip", "uninstall", "--python", str(python), *added], env=proc.uv_env())
            done += [f"uninstalled {n}" for n in added]
    if changed:
        progress(f"reinstalling {len(changed)} package(s) at their versions before adopt")
        argv = [uv, "pip", "install", "--no-deps", "--python", str(python)]
        argv += [a for n in changed for a in ("--reinstall-package", n)]
        with contextlib.suppress(CommandFailed):
            proc.run([*argv, *(f"{n}=={before[n]}" for n in changed)], env=proc.uv_env(),
                     timeout=3600)  # fmt: skip
            done += [f"reinstalled {n}=={before[n]}" for n in changed]
    fault_point("undo-sweep", progress)
    if journal.nvidia_before is not None:
        swept = _sweep_unnamed(now.purelib, set(journal.nvidia_before))
        if swept:
            done.append(f"removed {swept} file(s) below {_TREE_ROOT}/ no package names")
    if journal.site_before is not None:
        for rel in sorted(set(_site_tree(now.purelib)) - set(journal.site_before), reverse=True):
            tree = now.purelib / rel
            if tree.is_dir() and not _holds_files(tree):
                shutil.rmtree(tree)
                done.append(f"removed the empty {rel}/")
    return done


def _left_over(prefix: Path, python: Path, journal: Journal) -> list[str]:
    """What is not as the journal says it was, one phrase each; empty when all is back."""
    left: list[str] = []
    now = inspect(python) if journal.before is not None or journal.site_before else None
    site = now.purelib if now is not None else toolchain.site_packages(prefix)
    wiring = [f for f in _cudaenv_files(prefix, site) if not f.startswith("the cudaenv block")]
    if wiring:
        left.append(", ".join(wiring))
    originals = dict(journal.activation)
    for name, path in _activation_scripts(prefix).items():
        if name in originals and path.read_text() != originals[name]:
            left.append(f"bin/{name}")
    if now is not None and journal.before is not None:
        before = dict(journal.before)
        added = sorted(n for n in now.dists if n not in before)
        if added:
            left.append(f"still installed: {', '.join(added)}")
        wrong = [
            f"{n} {now.dists.get(n, 'missing')} (was {v})"
            for n, v in sorted(before.items())
            if now.dists.get(n) != v
        ]
        if wrong:
            left.append(f"not at its version before adopt: {', '.join(wrong)}")
        half = [Path(b).name for b in now.broken if b not in journal.broken_before]
        if half:
            left.append(f"half-removed: {', '.join(half)}")
    if now is not None and journal.site_before is not None:
        new = sorted(set(_site_tree(now.purelib)) - set(journal.site_before))
        # The outermost of them: nvidia/cu13/ says what nvidia/cu13/include/ would again.
        trees = [t for t in new if not any(t.startswith(f"{o}/") for o in new)]
        if trees:
            left.append(f"files no package names in {', '.join(t + '/' for t in trees)}")
    return left
