"""The adopted env's journal and its undo: what ``cudaenv adopt`` changed, recorded so that
it can be put back.

Every change goes into a journal first (``.cudaenv-adopt.json`` in the env, one file written
whole, so that writing it creates no directory a kill could leave behind). A failure or
interrupt inside adopt undoes what was done before it returns; a run killed outright (at any
point: uv's install included) leaves the journal, and one more ``adopt`` (or ``adopt --undo``)
puts the env back as it was first. Undo is resumable the same way: each of its steps looks at
the env as it is, so it can run again from the start, and the journal stays (marked
``undoing``) until the env has been checked to be as it was; removing the journal is undo's
last step. What a killed uv leaves, undo removes too: files below ``site-packages/nvidia/``
that were not there before adopt and that no installed package's RECORD names (a package whose
files were copied before its ``.dist-info``), and a ``.dist-info`` without RECORD.

Adopt and undo hold the env's lock (:func:`locked`) from reading its state to the last change.
The env as the probe finds it (:class:`Env`, :func:`inspect`) is here too: the journal records
it and undo checks against it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import ClassVar, Literal

from builder.adopt import saved as saving
from builder.core import proc
from builder.core.errors import BuildError, CommandFailed, CudaenvError
from builder.env import hooks, manifest, toolchain
from builder.env.build import fault_point
from builder.env.installproof import record_rows
from builder.env.place import env_lock
from builder.formats import codec, jsondoc
from builder.formats.jsondoc import Reader

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


def cudaenv_files(prefix: Path, site: Path) -> list[str]:
    """The files of cudaenv's wiring present in the env, relative to it."""
    found = [
        str(path.relative_to(prefix)) + ("/" if path.name == "cuda-home" else "")
        for path in (
            prefix / "cuda-home",
            prefix / manifest.FILE,
            site / hooks.PTH_NAME,
            site / f"{hooks.HOOK_MODULE}.py",
        )
        if path.is_symlink() or path.exists()
    ]
    for name, path in activation_scripts(prefix).items():
        with contextlib.suppress(OSError):
            if hooks.BLOCK_MARK in path.read_text(errors="replace"):
                found.append(f"the cudaenv block in bin/{name}")
    return found


@contextlib.contextmanager
def locked(
    prefix: Path, progress: Progress, *, holder: str = "cudaenv adopt", wait: float = LOCK_WAIT
) -> Iterator[None]:
    """Hold the env's lock (see LOCK_FILE): EnvBusy (exit 3) naming the holder after ``wait``
    seconds, Refused where the lock cannot be made (a read-only env)."""
    flock_path = prefix / LOCK_FILE
    with contextlib.ExitStack() as stack:
        try:
            lock = env_lock(prefix, progress, flock_path=flock_path, holder=holder,
                            doing="changing", wait=wait)  # fmt: skip
            stack.enter_context(lock)
        except OSError as exc:
            raise Refused(
                f"{flock_path}: cannot take the env's lock ({exc.strerror}); nothing was changed"
            ) from exc
        try:
            yield
        finally:
            # Unlinked while held: a waiter that then locks the removed file sees it is not
            # the one at the path and opens that (place.env_lock).
            with contextlib.suppress(OSError, CudaenvError):
                if read_journal(prefix) is None:
                    flock_path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- the journal


# "started" from before the first change until the manifest is written, "done" after it;
# "undoing" from the first change an undo makes until the env is checked to be as it was.
JournalState = Literal["started", "done", "undoing"]


@dataclass(frozen=True, kw_only=True)
class Journal:
    """The adopt journal: the env as it was, so that undo can put it back."""

    state: JournalState
    python: str | None
    # Distribution -> version before adopt; None where the journal does not say (undo then
    # leaves the packages alone rather than remove every one).
    before: tuple[tuple[str, str], ...] | None
    # Name, before, after (the plan's).
    changes: tuple[tuple[str, str | None, str | None], ...] = field(
        metadata=codec.meta(shape="[name, version before or null, version after or null]")
    )
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
    # Each package `adopt --rebuild` built again, as it was installed before: undo reinstalls
    # the saved wheel (builder/adopt/saved.py) after checking its sha256.
    rebuilt: tuple[tuple[str, str, str, str, str], ...] = field(
        default=(),
        metadata=codec.meta(
            shape="[name, version, saved wheel below the env, its sha256, direct_url.json]"
        ),
    )

    # No key is required: a journal written by an older cudaenv may lack any of them, and
    # undo does what the keys present allow; one not marked done is an unfinished adopt.
    # Only a key present with a value of the wrong kind is an error.
    json_form: ClassVar[codec.Form] = codec.Form(
        what="adopt journal",
        absent={"state": "started", "changes": (), "activation": (), "var_before": (),
                "var_existed": False},
        sparse=("rebuilt",),  # absent until `adopt --rebuild` rebuilds a package
    )  # fmt: skip

    def to_json(self) -> dict[str, object]:
        return codec.to_json(self)

    @classmethod
    def from_json(cls, doc: object, where: str) -> Journal:
        r = Reader(doc, where, "adopt journal")
        if r.doc.get("activation") is None:
            # A journal written before every shell's script was kept held bin/activate alone.
            old = r.opt_text("activate")
            doc = {**r.doc, "activation": {"activate": old} if old is not None else {}}
        return codec.from_json(cls, doc, where)


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


def write_journal(prefix: Path, journal: Journal) -> None:
    """Write the journal whole (a reader, or a run after a kill, sees the old one or the new
    one); an old-place journal goes once the new one is written."""
    proc.atomic_write_text(
        prefix / JOURNAL, json.dumps(journal.to_json(), indent=1, sort_keys=True)
    )
    (prefix / OLD_JOURNAL).unlink(missing_ok=True)


def atomic_leftovers(prefix: Path) -> list[Path]:
    """The temporary files of cudaenv's atomic writes into the env (proc.atomic_write_text:
    ``.NAME.XXXXXXXX.tmp`` beside NAME) that a kill mid-write left: the journal, the manifest,
    the hook's .pth and each shell's activation script."""
    beside = [(prefix, JOURNAL.name), (prefix, manifest.FILE),
              (prefix / OLD_JOURNAL.parent, OLD_JOURNAL.name)]  # fmt: skip
    beside += [(site, hooks.PTH_NAME) for site in prefix.glob("lib/python3.*/site-packages")]
    beside += [(prefix / "bin", name) for name, _, _ in hooks.ACTIVATIONS]
    return [tmp for d, name in beside for tmp in d.glob(f".{name}.*.tmp") if tmp.is_file()]


def tidy(prefix: Path) -> None:
    """What a run killed before its journal was written or after it was removed can leave:
    the env's lock file and the temporary file of an atomic write. Removed only with the lock
    taken at once (nobody is changing the env) and no journal there; otherwise left."""
    flock_path = prefix / LOCK_FILE
    if not flock_path.exists() and not atomic_leftovers(prefix):
        return
    with contextlib.suppress(CudaenvError, OSError), locked(prefix, lambda _: None, wait=0):
        # locked() removes the lock file on the way out where there is no journal.
        if read_journal(prefix) is None:
            for tmp in atomic_leftovers(prefix):
                tmp.unlink(missing_ok=True)


def why(exc: BaseException) -> str:
    """An exception in one line: an OSError as ``PATH: reason``, a CudaenvError's first line."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror}"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def activation_scripts(prefix: Path) -> dict[str, Path]:
    names = [script for script, _, _ in hooks.ACTIVATIONS]
    return {n: prefix / "bin" / n for n in names if (prefix / "bin" / n).is_file()}


# The toolkit wheels unpack below site-packages/nvidia/ (nvidia/cu13/bin, ...), beside torch's
# own CUDA wheels; a directory there that adopt's packages made is adopt's to remove.
_TREE_ROOT = "nvidia"


def site_tree(site: Path) -> tuple[str, ...]:
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


def nvidia_files(site: Path) -> tuple[str, ...]:
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
            for row in record_rows(record):
                if row[0].startswith(f"{_TREE_ROOT}/"):
                    named.add(os.path.normpath(row[0]))
    return named


def _sweep_unnamed(site: Path, before: set[str]) -> int:
    """Remove each file below ``site/nvidia/`` that was not there before adopt and that no
    installed distribution's RECORD names (uv copies a wheel's files before writing its
    .dist-info, so a uv killed midway leaves files no uninstall will find), then each
    directory that was not there before and is left empty. Returns how many files."""
    named = _recorded(site)
    now = nvidia_files(site)
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
        for row in record_rows(record):
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
            f"{why(exc)}; the undo of {prefix} did not finish (its journal is kept): "
            f"`cudaenv adopt --undo --python {python}` finishes it"
        ) from exc


def _undo(prefix: Path, python: Path, journal: Journal, progress: Progress) -> list[str]:
    if journal.state != "undoing" or _journal(prefix) != prefix / JOURNAL:
        write_journal(prefix, dataclasses.replace(journal, state="undoing"))
    fault_point("undo-files", progress)
    done: list[str] = []
    # Files first: the hook goes before anything else, so the interpreter is plain again.
    site = toolchain.site_packages(prefix)
    for rel in (
        site / hooks.PTH_NAME,
        site / f"{hooks.HOOK_MODULE}.py",
        *sorted(site.glob(f"__pycache__/{hooks.HOOK_MODULE}.*.pyc")),
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
    for name, path in activation_scripts(prefix).items():
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
    shutil.rmtree(prefix / saving.SAVED, ignore_errors=True)  # put back, checked just above
    var = prefix / "var"
    kept = set(journal.var_before)
    if var.is_dir():
        for child in sorted(var.iterdir()):
            if str(child.relative_to(prefix)) not in kept:
                # Of any kind: a directory (FlashInfer's cache), a file (what the prefetch
                # judged) or a link; one that stays is said, the journal kept for a rerun.
                proc.delete(child)
    if not journal.var_existed and var.is_dir() and not any(var.iterdir()):
        var.rmdir()
    for tmp in atomic_leftovers(prefix):
        tmp.unlink(missing_ok=True)
    fault_point("undo-journal", progress)
    # The last step: until here a kill leaves the journal, and the next undo runs again.
    (prefix / JOURNAL).unlink(missing_ok=True)
    fault_point("undo-done", progress)  # killed here, the lock file stays (see tidy)
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
    rebuilt = [saving.Saved(*row) for row in journal.rebuilt]
    own = {r.name for r in rebuilt}
    changed = sorted(
        n for n in before if (now.dists.get(n) != before[n] or n in touched) and n not in own
    )
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
    done += _put_back_saved(prefix, python, now.purelib, rebuilt, progress)
    fault_point("undo-sweep", progress)
    if journal.nvidia_before is not None:
        swept = _sweep_unnamed(now.purelib, set(journal.nvidia_before))
        if swept:
            done.append(f"removed {swept} file(s) below {_TREE_ROOT}/ no package names")
    if journal.site_before is not None:
        for rel in sorted(set(site_tree(now.purelib)) - set(journal.site_before), reverse=True):
            tree = now.purelib / rel
            if tree.is_dir() and not _holds_files(tree):
                shutil.rmtree(tree)
                done.append(f"removed the empty {rel}/")
    return done


def _put_back_saved(
    prefix: Path, python: Path, site: Path, rebuilt: list[saving.Saved], progress: Progress
) -> list[str]:
    """Each package ``adopt --rebuild`` replaced, reinstalled from the wheel saved before."""
    done: list[str] = []
    for old in rebuilt:
        wheel = saving.checked(prefix, old)
        progress(f"reinstalling {old.name} {old.version} as it was before adopt --rebuild")
        argv = [proc.uv_bin(), "pip", "install", "--quiet", "--no-deps", "--offline",
                "--reinstall-package", old.name, "--python", str(python), str(wheel)]  # fmt: skip
        with contextlib.suppress(CommandFailed):  # the check after says what is not back
            proc.run(argv, env=proc.uv_env(), timeout=1800)
            saving.put_back_origin(site, old)
            done.append(f"reinstalled {old.name} {old.version} from {old.wheel}")
    return done


def _left_over(prefix: Path, python: Path, journal: Journal) -> list[str]:
    """What is not as the journal says it was, one phrase each; empty when all is back."""
    left: list[str] = []
    now = inspect(python) if journal.before is not None or journal.site_before else None
    site = now.purelib if now is not None else toolchain.site_packages(prefix)
    wiring = [f for f in cudaenv_files(prefix, site) if not f.startswith("the cudaenv block")]
    if wiring:
        left.append(", ".join(wiring))
    originals = dict(journal.activation)
    for name, path in activation_scripts(prefix).items():
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
        for old in (saving.Saved(*row) for row in journal.rebuilt):
            wheel = prefix / old.wheel
            wrong = saving.differs(now.purelib, wheel) if wheel.is_file() else ["its saved wheel"]
            if wrong:
                left.append(f"{old.name} {old.version} not as saved: {', '.join(wrong[:3])}")
    if now is not None and journal.site_before is not None:
        new = sorted(set(site_tree(now.purelib)) - set(journal.site_before))
        # The outermost of them: nvidia/cu13/ says what nvidia/cu13/include/ would again.
        trees = [t for t in new if not any(t.startswith(f"{o}/") for o in new)]
        if trees:
            left.append(f"files no package names in {', '.join(t + '/' for t in trees)}")
    return left
