"""`flashinfer-jit`: FlashInfer's sampling module JIT-builds for the env's archs into the env's
own cache (FLASHINFER_WORKSPACE_BASE = var/flashinfer); an unchanged env reuses it."""

from __future__ import annotations

import os
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from builder import store as jit_store
from builder.core.paths import jit_store_dir, store_at
from builder.core.statuses import FAILED, PASSED, SKIPPED
from builder.machine.archs import Arch, flashinfer_spelling, parse_list
from builder.spec import channels
from builder.verify.imports import servers_asked
from builder.verify.model import CheckResult, EnvFacts, StoreUse, Target


def built_archs(facts: EnvFacts) -> tuple[Arch, ...] | None:
    """The archs FlashInfer's JIT was asked for in the probe (its FLASHINFER_CUDA_ARCH_LIST),
    or None when unset or unreadable (FlashInfer then uses the visible GPUs')."""
    try:
        return parse_list(facts.env.get("FLASHINFER_CUDA_ARCH_LIST") or "")
    except ValueError:
        return None


# How many stored entries a miss is compared with: a store of thousands is not read whole.
MAX_COMPARED = 200


def owners(root: Path, files: Iterable[str]) -> dict[str, str]:
    """``files`` (absolute) of the env at ``root`` -> "distribution version" whose RECORD
    lists it; nothing runs in the env."""
    wanted = {os.path.normpath(f) for f in files}
    sites = [str(p) for p in sorted(root.glob("lib/python3*/site-packages"))]
    found: dict[str, str] = {}
    if not wanted or not sites:
        return found
    for dist in metadata.distributions(path=sites):
        for f in dist.files or []:
            where = os.path.normpath(str(dist.locate_file(f)))
            if where in wanted:
                found.setdefault(where, f"{dist.metadata['Name']} {dist.version}")
    return found


def why_missed(store_root: Path, key: str, library: Path, env_root: Path) -> str | None:
    """Why the store had no build of FlashInfer's ``library`` for this env: the nearest
    stored build of the same module (this key first, else any), and which of its inputs
    differ here, by the distribution that installs each ("apache-tvm-ffi 0.1.15.post2 here;
    the stored build's env had apache-tvm-ffi 0.1.11"). None when the store holds no build
    of that module (a first build has nothing to be compared with). Reads only."""
    store = store_at(store_root)
    same_key: list[jit_store.Entry] = []
    others: list[jit_store.Entry] = []
    for stored_key, variant in store.all()[:MAX_COMPARED]:
        try:
            entry = store.load(stored_key, variant)
        except (jit_store.EntryError, jit_store.StoreError, OSError):
            continue
        outputs = entry.content.get("outputs") or []
        if entry.content.get("kind") != "ninja" or not any(
            str(o).rsplit("/", 1)[-1] == library.name for o in outputs
        ):
            continue
        (same_key if stored_key.startswith(key) else others).append(entry)
    candidates = same_key or others
    if not candidates:
        return None
    root = str(env_root)

    def differing(entry: jit_store.Entry) -> list[str]:
        return [
            p
            for p, digest in sorted(entry.inputs.items())
            if store.hasher.sha256(jit_store.localise(p, root), limit=jit_store.MAX_INPUT) != digest
        ]

    best, diff = min(((e, differing(e)) for e in candidates), key=lambda pair: len(pair[1]))
    built_for = best.provenance.get("env") or best.provenance.get("origin") or "another env"
    if not diff:
        return (
            f"its build for {built_for} has this env's very inputs but another key: the "
            "toolkit, the host compiler, FlashInfer's flags or ninja differ"
            if not same_key
            else None
        )
    here = owners(env_root, (jit_store.localise(p, root) for p in diff))
    there_root = Path(built_for)
    there = (
        owners(there_root, (jit_store.localise(p, str(there_root)) for p in diff))
        if there_root.is_absolute() and there_root.is_dir()
        else {}
    )
    by_dist: dict[str, list[str]] = {}
    for p in diff:
        mine = here.get(os.path.normpath(jit_store.localise(p, root)))
        theirs = there.get(os.path.normpath(jit_store.localise(p, str(there_root))))
        if mine and theirs and mine != theirs:
            what = f"{mine} here; the stored build's env had {theirs.rsplit(' ', 1)[-1]}"
        elif mine:
            what = f"{mine} here"
        else:
            what = "a file of no installed distribution"
        by_dist.setdefault(what, []).append(p.replace(jit_store.ENV + "/", ""))
    parts = [
        f"{what} ({files[0]}" + (f" and {len(files) - 1} more file(s))" if len(files) > 1 else ")")
        for what, files in by_dist.items()
    ]
    how = (
        "the store has this key, but compiled from other files"
        if same_key
        else "no stored build has this key; the nearest differs in the toolkit, compilers or "
        "flags and in its files"
    )
    return f"{how}: {'; '.join(parts)} (nearest: the build for {built_for})"


def pushed_to(facts: EnvFacts, stored: StoreUse, warnings: list[str]) -> str | None:
    """Push the entry the probe placed or kept to the store's remote tier where this machine
    is a warmer (``CUDAENV_JIT_PUSH=1``, a remote set for the probe: ``CUDAENV_JIT_SHARE``):
    the remote it went to, or None (a push that failed adds its warning to ``warnings``).
    Done here, after the probe answered: this interpreter has the registry client, where the
    probe would start one for it (a second of a warmer's verify on 2 cores)."""
    from builder.jit import share as jit_share

    environ = facts.environ
    if not (stored.hit or stored.kept) or stored.entry is None:
        return None
    if not (environ.get("CUDAENV_JIT_SHARE") and jit_share.pushing(environ)):
        return None
    split = jit_store.split_entry(stored.entry)
    named = environ.get("CUDAENV_JIT_STORE")
    if split is None or not named or named == "off":
        return None
    try:
        remote = jit_share.configured(environ)
        if remote is None:
            return None
        store = store_at(Path(named))
        key, variant = split
        entry = store.load(key, store.entries(key) / variant)
    except (jit_share.ShareError, jit_store.StoreError, jit_store.EntryError, OSError) as exc:
        warnings.append(f"the JIT remote was not used: {exc}")
        return None
    warning = jit_share.push(store, entry, remote)
    if warning:
        warnings.append(warning)
        return None
    return remote.url


def store_miss(target: Target, facts: EnvFacts, key: str, library: Path) -> str | None:
    """:func:`why_missed` for the store this verify used; None when it cannot say."""
    named = facts.environ.get("CUDAENV_JIT_STORE")
    root = Path(named) if named and named != "off" else jit_store_dir()
    if root is None or not key:
        return None
    env_root = target.env_dir or target.python.absolute().parent.parent
    try:
        return why_missed(root, key, library, env_root)
    except (jit_store.StoreError, OSError):  # an explanation must not fail the check
        return None


def _not_installed(target: Target) -> CheckResult:
    """No FlashInfer in the env: a failure where a server asked for needs it, else a skip."""
    needing = [s.distribution for s in servers_asked(target) if s.needs_flashinfer]
    if needing:
        # A server that cannot JIT its kernels cannot serve: not a skip.
        who = " and ".join(needing)
        return CheckResult(
            name="flashinfer-jit",
            status=FAILED,
            summary=f"{who} needs FlashInfer for its JIT kernels; flashinfer-python is "
            "not installed in this env: add it to packages",
            fix="add flashinfer-python to the spec's packages: `cudaenv add flashinfer-python "
            f"--spec {target.spec_path or 'SPEC'}`",
        )
    return CheckResult(
        name="flashinfer-jit",
        status=SKIPPED,
        summary="flashinfer-python is not installed in this env (and no package asked "
        "for needs it)",
    )


def _did_not_build(error: str, evidence: list[tuple[str, str]], seconds: float) -> CheckResult:
    """The sampling module did not build: FlashInfer's error, with the cause named where it
    is a known one (a toolkit without a library or a header)."""
    hint = ""
    fix = "check the toolchain check first; rebuild the env with `cudaenv build SPEC`"
    if "cannot find -lcudart" in error or "cannot find -lcuda" in error:
        hint = " (CUDA_HOME lacks lib64/libcudart.so or lib64/stubs/libcuda.so: flashinfer#5064)"
    missing = channels.missing_header(error)
    if missing:
        header, component = missing
        hint = f" (the toolkit has no {header})"
        if component:
            fix = channels.component_fix(header, component)
    return CheckResult(
        name="flashinfer-jit",
        status=FAILED,
        summary=f"FlashInfer's sampling module did not build{hint}",
        evidence=(*evidence, ("error", error[-3000:])),
        seconds=seconds,
        fix=fix,
    )


def _store_part(
    target: Target,
    facts: EnvFacts,
    stored: StoreUse,
    how: str,
    reused: bool,
    library: Path,
    evidence: list[tuple[str, str]],
    warnings: list[str],
) -> str:
    """``how`` with what the JIT store did (reused, kept, why it missed, pushed), its
    evidence appended to ``evidence`` and a failed push's warning to ``warnings``."""
    evidence.append(("JIT store key", str(stored.key)))
    if stored.hit and reused:
        day = (stored.first_built or "?")[:10]
        how = f"reused from the store (first built {day} for {stored.env})"
    elif stored.kept:
        how += ", kept in the store for envs of the same toolchain"
    if not stored.hit:
        missed = store_miss(target, facts, stored.key or "", library)
        if missed:
            evidence.append(("why the store missed", missed))
            how += f"; the store missed: {missed}"
    remote = pushed_to(facts, stored, warnings)
    if remote is not None:
        how += f"; pushed to {remote} (CUDAENV_JIT_PUSH=1)"
        evidence.append(("pushed", f"{stored.key} to {remote}"))
    return how


def check(target: Target, facts: EnvFacts) -> CheckResult:
    if not facts.flashinfer_installed:
        return _not_installed(target)
    archs = facts.env.get("FLASHINFER_CUDA_ARCH_LIST") or "(unset: the visible GPUs')"
    evidence = [
        ("FLASHINFER_CUDA_ARCH_LIST", archs),
        ("FLASHINFER_WORKSPACE_BASE", str(facts.env.get("FLASHINFER_WORKSPACE_BASE"))),
    ]
    jit = facts.jit
    seconds = jit.seconds
    built_for = built_archs(facts)
    if built_for is not None and set(built_for) != set(target.archs):
        # The JIT read another list than the one verified: e.g. a hook that overwrote an
        # explicit `--archs`. Passing here would vouch for archs nothing was built for.
        return CheckResult(
            name="flashinfer-jit",
            status=FAILED,
            summary=f"FlashInfer JIT-built for {archs} but verify asked for "
            f"{flashinfer_spelling(target.archs)}",
            evidence=tuple(evidence),
            seconds=seconds,
            fix="rebuild the env (`cudaenv build SPEC --force`): its start-up hook then honours "
            "`cudaenv verify --archs`",
        )
    if facts.flashinfer_error or jit.error is not None or jit.library is None:
        error = jit.error or facts.flashinfer_error or "no JIT result"
        return _did_not_build(error, evidence, seconds)
    library = Path(jit.library)
    evidence.append(("library", str(library)))
    if target.env_dir is not None and not library.is_relative_to(target.env_dir):
        return CheckResult(
            name="flashinfer-jit",
            status=FAILED,
            summary=f"the JIT cache is outside the env ({library}): another toolkit's objects "
            "could be reused (flashinfer#3229)",
            evidence=tuple(evidence),
            seconds=seconds,
            fix="run the env's own python (its start-up hook sets FLASHINFER_WORKSPACE_BASE)",
        )
    # From what ninja ran (its log, read around the build), never from a file that existed.
    ran = jit.ran
    reused = jit.reused and not ran
    how = (
        "reused from the env's JIT cache (ninja ran nothing)"
        if reused
        else (f"built in {seconds:.1f} s ({len(ran)} command(s) run by ninja)")
    )
    if ran:
        evidence.append(("ninja ran", ", ".join(ran[:20]) + (" …" if len(ran) > 20 else "")))
    stored = jit.store
    warnings = list(stored.warnings) if stored is not None else []
    if stored is not None and stored.used:
        how = _store_part(target, facts, stored, how, reused, library, evidence, warnings)
    return CheckResult(
        name="flashinfer-jit",
        status=PASSED,
        summary=f"sampling module for {archs}: {how}",
        evidence=tuple(evidence),
        seconds=seconds,
        warnings=tuple(warnings),
    )
