"""Prefetch at ``build`` and ``adopt``: every JIT store entry a warmer made for this env's
FlashInfer, toolkit and archs placed into the env's FlashInfer cache, so a server's first
request on a new node runs no nvcc.

Candidates are the store's entries that record a FlashInfer module (``cudaenv warm`` and
verify record one) of the env's FlashInfer version, after the spec's warm list (the index tag
of its lock and platform, ``jit_share.index_tag``) has been pulled from the JIT remote when
one is set. Whether a candidate fits is never judged here: the probe
(``builder/probe/jit_warm.py prefetch``) generates each module again inside the env, computes
its key there (the key covers the toolkit, the host compiler, the flags and the archs) and
places an entry only under an equal key, every file checked against its sha256 as it is
placed. Whatever fails costs one warning and the compile the module would have cost anyway;
a build never fails because of prefetch.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder import store as jit_store
from builder.core import cachefiles, proc, settings
from builder.core.errors import CommandFailed, ToolMissing
from builder.core.paths import jit_store_here
from builder.store import plans

if TYPE_CHECKING:
    from builder.jit.oci import Remote

# A probe that imports FlashInfer (~7 s) and copies files: minutes at most, even on a busy box.
PREFETCH_TIMEOUT = 600.0
# What the env's last prefetch judged (each recipe, as canonical JSON): a reused env runs the
# probe again only for a module warmed since.
JUDGED = Path("var") / "cudaenv-prefetched.json"
# How long a planned placement waits for a key another process is building (the probe's too).
PLAN_LOCK_WAIT = 10.0


def _judged(env: Path) -> set[str]:
    """The recipes the env's last prefetch judged; none where the record is unreadable (read
    under the cache's rules: no link followed, owner and modes checked, size bounded)."""
    doc = cachefiles.read_json(env / JUDGED)
    return {r for r in doc if isinstance(r, str)} if isinstance(doc, list) else set()


def _record_judged(env: Path, recipes: list[list[Any]]) -> None:
    """Add ``recipes`` to the record; one that cannot be written is judged again next time."""
    judged = {json.dumps(r, sort_keys=True) for r in recipes} | _judged(env)
    cachefiles.write_text(env / JUDGED, json.dumps(sorted(judged)) + "\n")


@dataclass(frozen=True, kw_only=True)
class Prefetched:
    """What the prefetch placed, and the one warning it cost (if any)."""

    placed: tuple[str, ...] = ()
    by_plan: int = 0  # of ``placed``: placed from a plan, with no interpreter started
    present: tuple[str, ...] = ()
    candidates: int = 0
    pulled: int = 0
    remote: str | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)
    skipped: str | None = None  # why nothing was tried

    def line(self) -> str:
        if self.skipped is not None:
            return f"prefetch: {self.skipped}"
        where = "the JIT store"
        if self.remote is not None:
            where += f" ({self.pulled} pulled from {self.remote})"
        kept = f", {len(self.present)} already in the env" if self.present else ""
        planned = (
            f"; {self.by_plan} placed from the plan of an identical env, without FlashInfer "
            "(ninja -n: no work to do)"
            if self.by_plan
            else ""
        )
        return (
            f"prefetched {len(self.placed)} of {self.candidates} warmed FlashInfer module(s) "
            f"from {where}{kept}{planned}"
        )


def module_of(content: dict[str, Any]) -> dict[str, Any] | None:
    """What an entry records of the FlashInfer module it holds (builder/probe/env_facts.py
    ``module_meta``), None for any other entry or a malformed record."""
    module = content.get("module")
    if not isinstance(module, dict):
        return None
    recipe = module.get("recipe")
    if not (isinstance(recipe, list) and len(recipe) == 2 and isinstance(recipe[0], str)):
        return None
    if not isinstance(recipe[1], dict):
        return None
    return module


def candidates(
    store: jit_store.Store, flashinfer: str | None, archs: str | None = None
) -> list[list[Any]]:
    """The recipes of every stored module of FlashInfer ``flashinfer`` (any, when None) built
    for the arch list ``archs`` as FlashInfer spells it (any, when None) on this machine's
    architecture, each once: the probe judges each by its key. What an entry records can only
    rule it out (its key covers the arch list and the machine's tools): an entry of another
    arch list never starts the probe, which costs a build seconds."""
    import platform

    found: dict[str, list[Any]] = {}
    for key, variant in store.all():
        try:
            entry = store.load(key, variant)
        except (jit_store.EntryError, jit_store.StoreError, OSError):
            continue
        module = module_of(entry.content)
        if module is None or (flashinfer and module.get("flashinfer") != flashinfer):
            continue
        if archs is not None and module.get("archs") not in (None, "", archs):
            continue
        if module.get("machine") not in (None, "", platform.machine()):
            continue
        recipe = module["recipe"]
        found.setdefault(json.dumps(recipe, sort_keys=True), recipe)
    return list(found.values())


def pull_warmed(store: jit_store.Store, remote: Remote, tag: str) -> tuple[int, str | None]:
    """The warm list ``tag`` pulled into ``store``: (entries added, one warning or None). A
    remote with no such list is no warning: nothing was warmed for this lock yet."""
    from builder.jit import share as jit_share

    added, warnings = jit_share.pull_env(
        store, remote, tag, absent_ok=True, budget=jit_share.PULL_BUDGET
    )
    if not warnings:
        return added, None
    more = f" (and {len(warnings) - 1} more)" if len(warnings) > 1 else ""
    return added, f"the JIT remote {remote.url}: {warnings[0]}{more}"


def prefetch(
    python: Path,
    *,
    flashinfer: str | None,
    remote: Remote | None = None,
    tag: str | None = None,
    only_new: bool = False,
    archs: str | None = None,
    variables: Sequence[tuple[str, str]] = (),
) -> Prefetched:
    """Place every fitting store entry into the FlashInfer cache of the env of ``python``;
    ``only_new``: only those the env's last prefetch did not judge (skipped: none are).
    ``variables``: the spec's own (its hook sets them), for the keys computed here."""
    if settings.current().no_prefetch:
        return Prefetched(skipped="off (CUDAENV_NO_PREFETCH=1)")
    store = jit_store_here()
    if store is None:
        return Prefetched(skipped="the JIT store is off")
    warnings: list[str] = []
    pulled = 0
    try:
        store.ready()
        if remote is not None and tag is not None:
            pulled, warning = pull_warmed(store, remote, tag)
            warnings += [warning] if warning else []
        recipes = candidates(store, flashinfer, archs)
    except (jit_store.StoreError, OSError) as exc:
        return Prefetched(skipped=f"the JIT store was not used: {exc}", warnings=tuple(warnings))
    where = remote.url if remote is not None and tag is not None else None
    env = python.parent.parent
    if only_new:
        judged = _judged(env)
        recipes = [r for r in recipes if json.dumps(r, sort_keys=True) not in judged]
        if not recipes:
            return Prefetched(skipped="nothing warmed since the last", warnings=tuple(warnings))
    if not recipes:
        return Prefetched(
            skipped=f"no warmed FlashInfer module in the JIT store for FlashInfer {flashinfer}",
            warnings=tuple(warnings),
        )
    placed: list[str] = []
    present: list[str] = []
    sig = plans.signature(env, store.hasher)
    if where is not None and remote is not None and sig is not None:
        # A warmer pushes the plan of its env beside the entries: a node's first env of the
        # same signature then places them without importing FlashInfer (seconds).
        warning = _plan_from(store, env, sig, remote, recipes)
        warnings += [warning] if warning else []
    # What the plan of an env like this one places without FlashInfer; the rest is the probe's.
    to_probe = place_by_plan(store, env, recipes, variables, placed, present, sig=sig)
    by_plan = len(placed)
    settled = [r for r in recipes if r not in to_probe]
    if to_probe:
        doc, trouble = run_probe(python, store.root, {"recipes": to_probe})
        warnings += [trouble] if trouble else []
        if doc is not None:
            settled = recipes
            keep_plans(store, env, doc.get("planned"), [str(n) for n in doc.get("placed") or []])
            notes = [str(w) for w in doc.get("warnings") or []]
            if notes:
                more = f" (and {len(notes) - 1} more)" if len(notes) > 1 else ""
                warnings.append(f"prefetch: {notes[0]}{more}")
            placed += [str(n) for n in doc.get("placed") or []]
            present += [str(n) for n in doc.get("present") or []]
    _record_judged(env, settled)
    return Prefetched(
        placed=tuple(placed),
        by_plan=by_plan,
        present=tuple(present),
        candidates=len(recipes),
        pulled=pulled,
        remote=where,
        warnings=tuple(warnings),
    )


def runtime_environ(env: Path, variables: Sequence[tuple[str, str]] = ()) -> dict[str, str]:
    """The environment the env's interpreter runs its compiles with, as its start-up hook
    (templates/hook.py.j2) leaves it for what a key reads (the toolkit, the PATH the host
    compiler and ninja are found on, the spec's variables), computed without starting it."""
    base = settings.child_environ(CUDAENV_JIT_SHARE=None, CUDAENV_ARCH_LIST=None)
    if not any(env.glob(f"lib/python3*/site-packages/{plans.HOOK}")):
        return with_env_bin(env / "bin", base)
    cuda_home = env / "cuda-home"
    cuda_bin, env_bin = str(cuda_home / "bin"), str(env / "bin")
    rest = [p for p in base.get("PATH", "").split(os.pathsep) if p and p not in (cuda_bin, env_bin)]
    base.update(
        CUDA_HOME=str(cuda_home),
        CUDA_PATH=str(cuda_home),
        PATH=os.pathsep.join([cuda_bin, env_bin, *rest]),
    )
    base.update(dict(variables))
    return base


def _plan_from(
    store: jit_store.Store, env: Path, sig: str, remote: Remote, recipes: list[list[Any]]
) -> str | None:
    """The remote's plan for ``sig`` added to the store's where it holds what the store's own
    plan lacks of ``recipes`` (jit_share.pull_plan); one warning, or None."""
    from builder.jit import share as jit_share

    missing = {json.dumps(r, sort_keys=True) for r in recipes} - set(plans.read_plan(store, sig))
    return jit_share.pull_plan(store, env, sig, remote, missing) if missing else None


def place_by_plan(
    store: jit_store.Store,
    env: Path,
    recipes: list[list[Any]],
    variables: Sequence[tuple[str, str]],
    placed: list[str],
    present: list[str],
    sig: str | None,
) -> list[list[Any]]:
    """Place each recipe the plan of the env's signature ``sig`` holds
    (builder/store/plans.py), adding to ``placed`` and ``present``; the recipes left for the
    probe."""
    planned = plans.read_plan(store, sig) if sig is not None else {}
    environ = runtime_environ(env, variables)
    ninja = shutil.which("ninja", path=environ.get("PATH"))
    if not planned or ninja is None or not ninja.startswith(f"{env}{os.sep}"):
        return recipes  # the env's own ninja only: another on PATH writes another log
    left: list[list[Any]] = []
    # A placement only looks keys up: the toolkit's binaries count as their wheels' RECORDs
    # state them (a fresh store reads none of their ~190 MB); nothing is published here.
    recorded = jit_store.RecordedTools.in_env(env)
    for recipe in recipes:
        item = planned.get(json.dumps(recipe, sort_keys=True))
        if item is None:
            left.append(recipe)
            continue
        outcome, _ = plans.place_planned(
            store, item, str(env), ninja, environ, lock_wait=PLAN_LOCK_WAIT, recorded=recorded
        )
        if outcome == "placed":
            placed.append(str(item["name"]))
        elif outcome == "present":
            present.append(str(item["name"]))
        elif outcome == "unplanned":
            left.append(recipe)
    store.hasher.save()
    return left


def keep_plans(store: jit_store.Store, env: Path, planned: Any, placed: Sequence[str] = ()) -> None:
    """Keep what a probe found of each module it generated in the env (``planned``: its
    recipe, key, name and build directory; warm's and the prefetch's) as the plan of this
    env's signature, then remove the build directories it made for modules not ``placed``."""
    ninja = env / "bin" / "ninja"
    sig = plans.signature(env, store.hasher)
    modules: dict[str, dict[str, Any]] = {}
    for found in planned if isinstance(planned, list) else []:
        if not (isinstance(found, dict) and isinstance(found.get("dir"), str)):
            continue
        build_dir = Path(found["dir"])
        inside = _within(build_dir, env / "var")
        if sig is not None and inside and ninja.is_file():
            item = plans.planned_module(
                str(env), str(ninja), build_dir, str(found.get("key")), str(found.get("name"))
            )
            if item is not None:
                modules[json.dumps(found.get("recipe"), sort_keys=True)] = item
        left = found.get("made") and found.get("name") not in placed
        if left and inside:
            shutil.rmtree(build_dir, ignore_errors=True)
    if sig is not None:
        plans.record_plan(store, sig, modules)


def _within(path: Path, root: Path) -> bool:
    """``path`` lies in ``root`` on disk, not only by its text: no link on the way from
    ``root`` to it (a ``var/x`` linked to another directory would have a plan keep what a
    0600 file there holds, or a removal reach past the env)."""
    if not path.is_relative_to(root):
        return False
    here = root
    for part in path.relative_to(root).parts:
        here = here / part
        if here.is_symlink():
            return False
    return not root.is_symlink()


def with_env_bin(bin_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the env's bin/ first on PATH, as `cudaenv run` and activation put it: the
    ninja FlashInfer runs at serve time is then the one the key names (its version is part of
    the key), so what warm keeps and prefetch places is what a server finds up to date."""
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}


def probe_script() -> str:
    """builder/probe/jit_warm.py, which warm and prefetch run in the env's interpreter."""
    return str(resources.files("builder.probe").joinpath("jit_warm.py"))


def run_probe(
    python: Path, store_root: Path, request: dict[str, Any]
) -> tuple[dict[str, Any] | None, str | None]:
    """The prefetch probe's answer, or None and why there is none."""
    script = probe_script()
    env = with_env_bin(
        python.parent,
        settings.child_environ(
            CUDAENV_JIT_SHARE=None, CUDAENV_ARCH_LIST=None, CUDAENV_JIT_STORE=str(store_root)
        ),
    )
    lines: list[str] = []
    try:
        done = proc.run_lines(
            [python, script, "prefetch"],
            lines.append,
            env=env,
            input_text=json.dumps(request),
            timeout=PREFETCH_TIMEOUT,
        )
    except (CommandFailed, ToolMissing, OSError) as exc:
        return None, f"prefetch did not run: {str(exc)[-300:]}"
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or "placed" not in doc:
        said = str(doc.get("error")) if isinstance(doc, dict) else done.stderr.strip()[-300:]
        return None, f"prefetch failed in {python}: {said or 'no answer'}"
    return doc, None


def say_prefetched(done: Prefetched, say: Callable[[str], None]) -> None:
    """The one line a build prints of its prefetch, and its one warning if any."""
    say(done.line())
    if done.warnings:
        more = f" (and {len(done.warnings) - 1} more)" if len(done.warnings) > 1 else ""
        say(f"warning: {done.warnings[0]}{more}")
