"""The JIT store's remote tier: entries shared across a cluster through an OCI registry.

The local store (``builder/store/``) is tier 1; a registry the cluster already runs
(Harbor, GHCR, ECR, a plain distribution registry) is tier 2, named by
``CUDAENV_JIT_REMOTE=oci://HOST[:PORT]/REPO`` or ``jit-remote`` in ``[tool.cudaenv]``. On a
local miss the key's entry is pulled (``builder/jit/remote.py`` checks every blob's digest),
added to the local store (which checks every file against the entry's record) and placed from
there. Only a machine that says ``CUDAENV_JIT_PUSH=1`` pushes what it compiled or used: a CI
warmer pushes, serving nodes pull.

A remote that is down, refuses, times out or serves other content never fails a build: the
result is compiled locally and the caller prints the one warning this module returns.

What a remote serves is checked to be self-consistent, which anyone with push rights can
make an entry be: where that is not boundary enough, warmers sign what they push
(``CUDAENV_JIT_SIGNING_KEY``) and nodes take only entries signed by a key of their
allowed-signers file (``CUDAENV_JIT_ALLOWED_SIGNERS``; ``builder/jit/signing.py``).

``python -m builder.jit.share pull KEY PREFIX`` is what the probe inside a target env runs
(it imports nothing of cudaenv, so it cannot speak to a registry): it prints one JSON line.
What the probe built or placed is pushed by cudaenv itself once the probe has answered.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from builder import store as jit_store
from builder.core import settings
from builder.core.paths import jit_store_here
from builder.jit import signing as jit_signing

if TYPE_CHECKING:
    from builder.jit.oci import Remote

REMOTE_VAR = "CUDAENV_JIT_REMOTE"
PUSH_VAR = "CUDAENV_JIT_PUSH"
INSECURE_VAR = "CUDAENV_JIT_REMOTE_INSECURE"
# How long one registry request may take before the remote counts as down.
TIMEOUT_VAR = "CUDAENV_JIT_REMOTE_TIMEOUT"
DEFAULT_TIMEOUT = settings.resolve({}).jit_remote_timeout


class ShareError(Exception):
    """The remote named cannot be used as configured (a malformed URL): a user's error."""


def parse(url: str, environ: Mapping[str, str] | None = None) -> Remote:
    from builder.jit import oci

    try:
        return oci.Remote.parse(url, allow_http=settings.of(environ).jit_remote_insecure)
    except oci.RemoteError as exc:
        raise ShareError(str(exc)) from None


def configured(
    environ: Mapping[str, str] | None = None, setting: str | None = None
) -> Remote | None:
    """The remote named by ``CUDAENV_JIT_REMOTE`` (``off``: none), else by the project's
    ``jit-remote`` setting; None when neither names one."""
    url = remote_url(environ, setting)
    if not url:
        return None
    return parse(url, environ)


def remote_url(environ: Mapping[str, str] | None = None, setting: str | None = None) -> str:
    """The URL :func:`configured` parses, empty when none is named (nothing imported)."""
    # The cascade (the variable over the project's table) is the settings' own.
    return settings.of(environ).with_pyproject({"jit_remote": setting}, None).jit_remote or ""


def pushing(environ: Mapping[str, str] | None = None) -> bool:
    return settings.of(environ).jit_push


def timeout(environ: Mapping[str, str] | None = None) -> float:
    """CUDAENV_JIT_REMOTE_TIMEOUT. The CLI refuses a bad value at start-up
    (settings.establish); this process may have been started by another (the probe's
    ``python -m builder.jit.share``), so a bad value here is the default, never a crash."""
    return settings.of(environ).jit_remote_timeout


def pull(
    store: jit_store.Store, key: str, prefix: str, remote: Remote
) -> tuple[jit_store.Entry | None, str | None]:
    """The remote's entry for ``key`` added to ``store`` and found for the env at ``prefix``
    (None when the remote has none, or one built from other inputs), and a warning when the
    remote could not be used."""
    from builder.jit import oci
    from builder.jit import remote as jit_remote

    store.ready()
    signing = jit_signing.policy()
    if signing.refusal is not None:
        return (
            None,
            f"the JIT remote {remote.url} was not used: {signing.refusal}; compiled locally",
        )
    try:
        with tempfile.TemporaryDirectory(prefix=".pull-", dir=store.root) as tmp:
            got = jit_remote.fetch(remote, jit_remote.tag_for(key), Path(tmp), timeout=timeout())
            if got is None:
                return None, None
            doc, files = got
            _vouched(remote, key, doc, signing)
            store.import_entry(key, doc, files, {"origin": remote.url})
    except oci.RemoteError as exc:
        return None, f"the JIT remote {remote.url} was not used: {exc}; compiled locally"
    except (jit_store.EntryError, jit_signing.SigningError) as exc:
        return None, (
            f"the JIT remote {remote.url} served an entry for {key[:16]} the store refuses "
            f"({exc}); compiled locally"
        )
    return store.find(key, prefix), None


def _vouched(
    remote: Remote, key: str, doc: Mapping[str, object], signing: jit_signing.Policy
) -> None:
    """Nothing when this node takes entries on push rights alone, or ``doc`` (the entry's
    content) is signed by a signer it trusts; SigningError saying why otherwise."""
    from builder.jit import remote as jit_remote

    if not signing.checks:
        return
    if signing.refusal is not None or signing.allowed is None:
        raise jit_signing.SigningError(signing.refusal or "no allowed-signers file")
    content = {k: v for k, v in doc.items() if k not in jit_store.PROVENANCE}
    signatures = jit_remote.fetch_signatures(remote, key, timeout=timeout())
    try:
        jit_signing.verify(signing.allowed, jit_signing.statement(key, content), signatures)
    except jit_signing.SigningError as exc:
        raise jit_signing.SigningError(
            f"{jit_signing.SIGNERS_VAR} requires a trusted signature and {exc}"
        ) from None


def push(store: jit_store.Store, entry: jit_store.Entry, remote: Remote) -> str | None:
    """``entry`` pushed to the remote under its key; a warning when it was not."""
    from builder.jit import oci
    from builder.jit import remote as jit_remote

    signing = jit_signing.policy()
    try:
        content, files = store.export_entry(entry)
        # Signed before anything is pushed: a warmer that cannot sign pushes nothing that
        # nodes requiring signatures would refuse anyway.
        signature = (
            jit_signing.sign(signing.key, jit_signing.statement(entry.key, content))
            if signing.key is not None
            else None
        )
        jit_remote.publish(remote, jit_remote.tag_for(entry.key), content, files, timeout=timeout())
        if signature is not None:
            jit_remote.publish_signature(remote, entry.key, signature, timeout=timeout())
    except oci.RemoteConflict:
        return (
            f"{remote.url} holds another build of {entry.key[:16]} (compiled from other "
            "inputs); an existing tag is never overwritten"
        )
    except (oci.RemoteError, jit_store.EntryError, jit_signing.SigningError, OSError) as exc:
        return f"pushing {entry.key[:16]} to the JIT remote {remote.url} failed: {exc}"
    return None


def index_tag(lock_hash: str, platform: str | None = None) -> str:
    """The tag of the list of keys an env of one lock (``Lock.content_hash()``, ``sha256:``
    or not) on one platform (default: this one) used."""
    from builder.core import platforms

    where = platform or platforms.host_name()
    return f"env-{where.replace('_', '-')}-{lock_hash.removeprefix('sha256:')[:32]}"


def push_env(
    store: jit_store.Store, used: Iterable[str], remote: Remote, tag: str
) -> tuple[int, list[str]]:
    """Push every entry an env used, then the index of their keys; (pushed, warnings)."""
    from builder.jit import oci
    from builder.jit import remote as jit_remote

    pushed, warnings, keys = 0, [], []
    for rel in used:
        split = jit_store.split_entry(rel)
        if split is None:
            continue
        key, variant = split
        try:
            entry = store.load(key, store.entries(key) / variant)
        except (jit_store.EntryError, jit_store.StoreError, OSError) as exc:
            warnings.append(f"{rel}: {exc}")
            continue
        warning = push(store, entry, remote)
        if warning:
            warnings.append(warning)
        else:
            pushed += 1
            keys.append(key)
    if keys:
        try:
            jit_remote.publish_index(remote, tag, keys, timeout=timeout())
        except oci.RemoteError as exc:
            warnings.append(f"the list of keys ({tag}) was not pushed: {exc}")
    return pushed, summarised(warnings)


def push_plan(store: jit_store.Store, env: Path, remote: Remote) -> str | None:
    """The plan of the env at ``env`` (builder/store/plans.py: what places its warmed
    FlashInfer modules without FlashInfer) pushed for the env's signature, merged with what
    the remote held for it; a warning when it was not. An env with no plan pushes nothing."""
    from builder.jit import oci
    from builder.jit import remote as jit_remote
    from builder.store import plans

    sig = plans.signature(env, store.hasher)
    mine = plans.read_plan(store, sig) if sig is not None else {}
    if sig is None or not mine:
        return None
    try:
        with contextlib.suppress(oci.RemoteBadContent):  # another kind there: replaced
            theirs = plans.parse_plan(jit_remote.fetch_plan(remote, sig, timeout=timeout()), sig)
            mine = {**theirs, **mine}
        jit_remote.publish_plan(remote, sig, plans.plan_doc(sig, mine), timeout=timeout())
    except oci.RemoteError as exc:
        return f"the placement plan was not pushed to the JIT remote {remote.url}: {exc}"
    return None


def pull_plan(
    store: jit_store.Store, env: Path, sig: str, remote: Remote, wanted: Iterable[str]
) -> str | None:
    """Add to the store's plan of ``sig`` (the env at ``env``'s) the modules of ``wanted``
    (recipes, as canonical JSON: those the store's own plan lacks) that the remote's plan
    holds and the store's entries vouch for (:func:`plans.vouched`); a warning when the
    remote could not be read."""
    from builder.jit import oci
    from builder.jit import remote as jit_remote
    from builder.store import plans

    try:
        doc = jit_remote.fetch_plan(remote, sig, timeout=timeout())
    except oci.RemoteError as exc:
        return f"the JIT remote {remote.url}: no placement plan read: {exc}"
    want = set(wanted)
    theirs = {k: v for k, v in plans.parse_plan(doc, sig).items() if k in want}
    plans.record_plan(store, sig, plans.vouched(store, theirs, str(env)))
    return None


# A whole pull of a warm list (a build's prefetch) is bounded: a registry whose entries
# never answer would otherwise cost one full timeout per key, one after another (4,096 keys
# at 30 s is 34 h). Past the budget, or after this many failures in a row, the rest is left.
PULL_BUDGET = 300.0
MAX_FAILURES_IN_A_ROW = 3


def pull_env(
    store: jit_store.Store,
    remote: Remote,
    tag: str,
    *,
    absent_ok: bool = False,
    budget: float | None = None,
) -> tuple[int, list[str]]:
    """Every entry the index ``tag`` lists added to ``store``; (added, warnings). An index
    the remote does not hold is a warning unless ``absent_ok`` (nothing pushed for it yet).
    ``budget``: the seconds the whole pull may take (each request's timeout shrinks to what is
    left); it also stops after :data:`MAX_FAILURES_IN_A_ROW` entries failed one after another,
    saying how many were left."""
    from builder.jit import oci
    from builder.jit import remote as jit_remote

    signing = jit_signing.policy()
    if signing.refusal is not None:
        return 0, [signing.refusal]
    try:
        keys = jit_remote.fetch_index(remote, tag, timeout=timeout())
    except oci.RemoteError as exc:
        return 0, [str(exc)]
    if keys is None:
        return 0, [] if absent_ok else [
            f"{remote.url} has no list of keys {tag}: push it from a warmer first"
        ]
    added, warnings = 0, []
    store.ready()
    deadline = time.monotonic() + budget if budget is not None else None
    failed_in_a_row = 0
    wanted = [k for k in keys if jit_store.is_key(k) and not store.variants(k)]
    # What a pull may add without the cap evicting this node's own entries: a list of junk
    # (or of more than fits) costs entries pulled, never the ones this node made or used.
    room = [jit_store.store_max() - sum(store.size_of(v) for _, v in store.all())]

    def claims(doc: dict[str, object]) -> None:
        """What an entry claims, checked before its files are downloaded."""
        _content, records, _inputs = jit_store.parse_entry(doc)
        size = sum(r.size for r in records.values())
        if size > room[0]:
            raise jit_store.EntryError(
                f"{size} bytes claimed, more than the {max(room[0], 0)} left under the "
                "store's cap (CUDAENV_JIT_STORE_MAX): not pulled, so this node's own entries "
                "stay"
            )

    for done, key in enumerate(wanted):
        left = deadline - time.monotonic() if deadline is not None else None
        if (left is not None and left <= 0) or failed_in_a_row >= MAX_FAILURES_IN_A_ROW:
            why = (
                f"{failed_in_a_row} entries failed in a row"
                if failed_in_a_row >= MAX_FAILURES_IN_A_ROW
                else f"the pull took its {budget:.0f} s"
            )
            warnings.append(
                f"{why}: {len(wanted) - done} of {len(wanted)} listed entries not pulled "
                f"from {remote.url} (they compile at first use)"
            )
            break
        wait = timeout() if left is None else max(1.0, min(timeout(), left))
        try:
            with tempfile.TemporaryDirectory(prefix=".pull-", dir=store.root) as tmp:
                got = jit_remote.fetch(
                    remote, jit_remote.tag_for(key), Path(tmp), timeout=wait, check=claims
                )
                if got is None:
                    warnings.append(f"{key[:16]}: listed but not in {remote.url}")
                    continue
                _vouched(remote, key, got[0], signing)
                store.import_entry(key, got[0], got[1], {"origin": remote.url})
                room[0] -= sum(p.stat().st_size for p in got[1].values())
                added += 1
                failed_in_a_row = 0
        except (oci.RemoteError, jit_store.EntryError, jit_signing.SigningError) as exc:
            warnings.append(f"{key[:16]}: {exc}")
            failed_in_a_row += 1
    return added, summarised(warnings)


# Past this many, a command's warnings are summed up in one line.
MAX_WARNINGS = 10


def summarised(warnings: list[str], limit: int = MAX_WARNINGS) -> list[str]:
    """``warnings`` as they are, or the first ``limit`` and one line counting the rest."""
    if len(warnings) <= limit:
        return warnings
    return [*warnings[:limit], f"... and {len(warnings) - limit} more warnings like these"]


def main(argv: list[str]) -> int:
    """``pull KEY PREFIX`` for the probe: one JSON line out."""
    out: dict[str, object] = {}
    try:
        store = jit_store_here()
        remote = configured()
        if store is None or remote is None:
            out["warning"] = None
        elif argv[:1] == ["pull"] and len(argv) == 3:
            entry, warning = pull(store, argv[1], argv[2], remote)
            out = {"pulled": entry is not None, "warning": warning}
        else:
            out["warning"] = None
    except (ShareError, jit_store.StoreError, jit_store.EntryError, OSError) as exc:
        out["warning"] = f"the JIT remote was not used: {exc}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
