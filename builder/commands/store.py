"""`cudaenv store`: this machine's JIT store listed, checked and trimmed, and shared through
the JIT remote (push what an env's verify used, pull what a warmer pushed for a spec)."""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder import store as jit_store
from builder.commands.pipeline import built_env, jit_remote_for, load_spec, lock_file
from builder.core import platforms, settings
from builder.core.errors import BuildError, UsageError, VerifyFailed
from builder.core.reporter import Reporter
from builder.env.envs import human, shown
from builder.machine import archs
from builder.spec import envspec as spec
from builder.spec import lock

if TYPE_CHECKING:
    from builder.jit.oci import Remote


def jit_store_here() -> jit_store.Store:
    """This machine's JIT store, made and checked; UsageError when it is off or unusable."""
    from builder.core import paths

    store = paths.jit_store_here()
    if store is None:
        raise UsageError("the JIT store is off (CUDAENV_JIT_STORE=off)")
    try:
        store.ready()
    except jit_store.StoreError as exc:
        raise UsageError(f"the JIT store cannot be used: {exc}") from None
    return store


def _remote_for(s: spec.EnvSpec) -> Remote:
    """The spec's JIT remote (pipeline.jit_remote_for); UsageError where none is set."""
    remote = jit_remote_for(s.source)
    if remote is None:
        raise UsageError(
            "no JIT remote: set CUDAENV_JIT_REMOTE=oci://HOST[:PORT]/REPO, or jit-remote in "
            "[tool.cudaenv] of the project's pyproject.toml"
        )
    return remote


def index_tag_for(s: spec.EnvSpec) -> str:
    """The tag of the spec's list of keys on the JIT remote (its lock, this platform)."""
    from builder.jit import share as jit_share

    lk = lock.read(lock_file(s), spec=s)
    return jit_share.index_tag(lk.content_hash())


def store_push(spec_arg: str, env_dir: Path | None) -> tuple[int, list[str], str]:
    """Push every store entry the built env of ``spec_arg`` used (a warmer's job), the list
    of their keys under the tag of the spec's lock, and the env's placement plan; (pushed,
    warnings, tag)."""
    from builder.jit import share as jit_share

    s, env = built_env(spec_arg, env_dir)
    used = jit_store.used_entries(env)
    if not used:
        raise BuildError(
            f"{env} has used no JIT results from the store: verify it first (`cudaenv verify "
            f"{spec_arg}`) with the store on"
        )
    remote, tag = _remote_for(s), index_tag_for(s)
    store = jit_store_here()
    pushed, warnings = jit_share.push_env(store, used, remote, tag)
    if store is not None:
        # The plan that places the env's modules (where warm or a prefetch made one).
        warning = jit_share.push_plan(store, env, remote)
        warnings += [warning] if warning else []
    return pushed, warnings, tag


def store_pull(spec_arg: str) -> tuple[int, list[str], str]:
    """Add to this machine's store every entry a warmer pushed for the spec's lock."""
    from builder.jit import share as jit_share

    s = load_spec(spec_arg)
    remote, tag = _remote_for(s), index_tag_for(s)
    added, warnings = jit_share.pull_env(jit_store_here(), remote, tag)
    return added, warnings, tag


# --------------------------------------------------------------------------- list, verify, gc


@dataclass(frozen=True, kw_only=True)
class Listing:
    """Every entry of the store, least recently used first, and the total against the cap;
    with a spec, only the FlashInfer modules its env would get (``wanted`` says which)."""

    root: Path
    cap: int
    entries: tuple[jit_store.Listed, ...]
    wanted: dict[str, str] | None = None

    @property
    def total(self) -> int:
        return sum(r.size for r in self.entries)

    def to_json(self) -> dict[str, Any]:
        out = {
            "root": str(self.root),
            "cap": self.cap,
            "bytes": self.total,
            "entries": [dataclasses.asdict(r) for r in self.entries],
        }
        return out if self.wanted is None else {**out, "for": self.wanted}

    def lines(self) -> list[str]:
        out = []
        for r in self.entries:
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.last_used))
            # What an entry records came from whoever made it (a registry's, perhaps): shown
            # quoted where it holds a control character, so it cannot forge a line.
            module = (
                f"  {_printable(r.module.get('name'))} for {_printable(r.module.get('archs'))}"
                if r.module
                else ""
            )
            out.append(
                f"{r.key[:16]}/{r.variant}  {_printable(r.kind):<9}  {human(r.size):>10}  used {used}  "
                f"made for {_printable(r.made_for or '?')}{module}"
            )
        total, cap = human(self.total), human(self.cap)
        last = f"{len(self.entries)} entries, {total} of {cap} in {self.root}"
        if self.wanted is not None:
            what = ", ".join(f"{k} {v}" for k, v in self.wanted.items())
            last = f"{len(self.entries)} FlashInfer module(s) for {what} in {self.root}"
        return [*out, last]

    def text(self, *, as_json: bool) -> str:
        return json.dumps(self.to_json(), indent=2) if as_json else "\n".join(self.lines())


def _printable(value: object) -> str:
    """``value`` as it is where every character prints, else quoted as envs.shown quotes."""
    text = str(value)
    return text if text.isprintable() else shown(text)


def wanted_by(spec_arg: str) -> dict[str, str]:
    """What an env of ``spec_arg`` on this machine asks of a FlashInfer module: its lock's
    FlashInfer version, the spec's CUDA release and archs (as its start-up hook sets them),
    this machine."""
    s = load_spec(spec_arg)
    lk = lock.read(lock_file(s), spec=s)
    found = [
        p.version for p in lk.packages_on(platforms.host_name()) if p.name == "flashinfer-python"
    ]
    if not found:
        raise UsageError(f"{spec_arg}: its lock has no flashinfer-python, so no FlashInfer module")
    return {
        "flashinfer": found[0],
        "cuda": s.cuda,
        "archs": archs.flashinfer_spelling(s.archs),
        "machine": platform.machine(),
    }


def fits(module: dict[str, Any] | None, wanted: dict[str, str]) -> bool:
    """Whether a stored module was made for what ``wanted`` says (its CUDA release is the
    spec's CUDA minor, or a patch of it)."""
    if module is None:
        return False
    cuda = str(module.get("cuda") or "")
    return all(str(module.get(k)) == wanted[k] for k in ("flashinfer", "archs", "machine")) and (
        cuda == wanted["cuda"] or cuda.startswith(wanted["cuda"] + ".")
    )


def listing(spec_arg: str | None = None) -> Listing:
    store = jit_store_here()
    rows = tuple(store.listing())
    wanted = wanted_by(spec_arg) if spec_arg else None
    if wanted is not None:
        rows = tuple(r for r in rows if fits(r.module, wanted))
    return Listing(
        root=store.root, cap=settings.current().jit_store_max, entries=rows, wanted=wanted
    )


def verify_store(reporter: Reporter, show: Callable[[str], None]) -> None:
    """Check every entry against its record (and a kernel's content); ``show`` each one
    discarded; VerifyFailed (exit 5) when one was."""
    from builder.verify import kernel_compile

    store = jit_store_here()
    entries = store.all()
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
            show(store.notes[-1])
    reporter(f"{len(entries) - bad} of {len(entries)} entries match their records in {store.root}")
    if bad:
        left = f"; {kept} could not be removed" if kept else ""
        raise VerifyFailed(
            f"the JIT store held {bad} damaged entr{'y' if bad == 1 else 'ies'}{left}"
        )


@dataclass(frozen=True, kw_only=True)
class Trimmed:
    removed: int
    freed: int
    left: int
    cap: int
    notes: tuple[str, ...]

    def summary(self) -> str:
        return (
            f"removed {self.removed} item(s), {human(self.freed)} freed; {human(self.left)} "
            f"left (cap {human(self.cap)})"
        )


def gc(max_size: str | None) -> Trimmed:
    """Trim the store to ``max_size`` (``5G``, ``500M``; default: the cap)."""
    try:
        cap = jit_store.parse_size(max_size) if max_size else settings.current().jit_store_max
    except ValueError as exc:
        raise UsageError(f"--max: {exc}") from None
    store = jit_store_here()
    removed, freed = store.gc(cap)
    left = sum(store.size_of(v) for _, v in store.all())
    return Trimmed(removed=len(removed), freed=freed, left=left, cap=cap, notes=tuple(store.notes))
