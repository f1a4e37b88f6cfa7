"""The store on disk: entries found by key and by the content of their inputs, published
whole, placed with every file checked, evicted least recently used first, and collected."""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .entries import (
    PROVENANCE,
    VERSION,
    Entry,
    is_key,
    is_variant,
    parse_entry,
    split_entry,
    variant_of,
)
from .errors import EntryError, StoreError
from .hashing import Hasher, localise
from .limits import MAX_INPUT, lock_timeout, store_max
from .locking import Lock, Waiting, lock_file
from .trust import (
    check_ancestors,
    check_dir,
    copy_checked,
    is_file_name,
    read_doc,
    remove_tree,
    sha256_file,
    tmp_tag,
    tree_size,
)


@dataclass(frozen=True)
class Listed:
    """One line of ``cudaenv store list``."""

    key: str
    variant: str
    kind: str
    size: int
    last_used: float
    first_built: str | None
    made_for: str | None
    # The FlashInfer module it holds, as its entry records it (name, recipe, archs, FlashInfer
    # and CUDA versions, machine): None for any other entry.
    module: dict[str, Any] | None = None


class Store:
    def __init__(self, root: Path) -> None:
        # The root the user named may be a link (their choice); nothing inside is followed.
        self.root = Path(os.path.realpath(root))
        self.hasher = Hasher(self.root / "identities.json")
        # What this process did to the store that the user should hear of (an entry
        # discarded), and why it could not be used.
        self.notes: list[str] = []
        self._ready = False

    def entries(self, key: str) -> Path:
        return self.root / VERSION / key[:2] / key

    def ready(self) -> None:
        """Made if missing, then checked: the root, the directories above it, its tree."""
        if self._ready:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o755)
        except OSError as exc:
            raise StoreError(f"{self.root}: {exc.strerror}") from exc
        check_ancestors(self.root)
        check_dir(self.root)
        self._ready = True

    def judged_again(self) -> Store:
        """This store, its tree to be checked again at its next use: one process's store is
        handed out to each part of a run (paths.store_at), and a tree made writable by others
        since the last part must not be read by the next."""
        self._ready = False
        return self

    def _dir(self, path: Path, *, make: bool) -> bool:
        """Each directory from the root down to ``path`` checked (and made when ``make``);
        False when one is missing."""
        self.ready()
        current = self.root
        for part in path.relative_to(self.root).parts:
            current = current / part
            if make:
                with contextlib.suppress(FileExistsError):
                    current.mkdir(mode=0o755)
            elif not os.path.lexists(current):
                return False
            check_dir(current)
        return True

    def acquire(
        self,
        key: str,
        timeout: float | None = None,
        *,
        note: str = "",
        waiting: Waiting | None = None,
    ) -> Lock:
        """The key's lock: one builder looks up, compiles and publishes ``key`` while another
        builder of the same key waits here. StoreError after ``timeout`` seconds, naming the
        process that holds it. ``note`` (what the holder builds) is left in the lock for a
        waiter to name; ``waiting`` is told of the holder now and then while this waits."""
        if not is_key(key):
            raise StoreError(f"{key!r} is not a store key")
        lock_dir = self.root / "locks"
        self._dir(lock_dir, make=True)
        wait = lock_timeout() if timeout is None else timeout
        return lock_file(lock_dir / f"{key}.lock", wait, note=note, waiting=waiting)

    @contextlib.contextmanager
    def locked(self, key: str, timeout: float | None = None) -> Iterator[None]:
        lock = self.acquire(key, timeout)
        try:
            yield
        finally:
            lock.release()

    def mark(self, entry: Entry, module: Mapping[str, Any]) -> bool:
        """Record ``module`` (what FlashInfer module the entry holds, and how to generate it
        again: env_facts.module_meta) in an entry made without it (a verify's, an adopt's, a
        server's first start), so that it is warm for every reader of that record: ``store
        list SPEC``, the prefetch at build, ``store push``. True when it was recorded now; an
        entry that records a module already is left as it is."""
        if isinstance(entry.content.get("module"), dict):
            return False
        path = entry.path / "entry.json"
        doc = read_doc(path, trusted=True)
        if not isinstance(doc, dict) or isinstance(doc.get("module"), dict):
            return False
        doc["module"] = dict(module)
        parse_entry(doc)
        tmp = path.with_name(f".entry.json.{tmp_tag()}")
        try:
            tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
            tmp.chmod(0o644)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def variants(self, key: str) -> list[Path]:
        base = self.entries(key)
        if not is_key(key) or not self._dir(base, make=False):
            return []
        return sorted(p for p in base.iterdir() if is_variant(p.name))

    def load(self, key: str, variant: Path) -> Entry:
        """The entry at ``variant`` read and checked (not its files' content: placing checks
        that); EntryError for a malformed one, StoreError for one that may not be read."""
        check_dir(variant)
        check_dir(variant / "files")
        doc = read_doc(variant / "entry.json", trusted=True)
        content, files, inputs = parse_entry(doc)
        if variant_of(inputs) != variant.name:
            raise EntryError(f"{variant.name} is not the variant its inputs make")
        provenance = {k: str(doc[k]) for k in PROVENANCE if k in doc}
        return Entry(key, variant, content, files, inputs, provenance)

    def discard(self, entry: Path, why: str) -> bool:
        """Remove a bad entry (it is compiled and published again) and say so: what was
        done, never a removal that did not happen (a read-only store). Whether it is gone."""
        rel = entry.relative_to(self.root) if entry.is_relative_to(self.root) else entry
        failed = remove_tree(entry)
        if failed is None:
            self.notes.append(f"discarded the store entry {rel}: {why}; compiled again")
            return True
        self.notes.append(
            f"the store entry {rel} is bad ({why}) and could not be removed ({failed}); "
            "it is not used"
        )
        return False

    def input_matches(self, path: str, digest: str) -> bool:
        return self.hasher.sha256(path, limit=MAX_INPUT) == digest

    def find(self, key: str, root: str) -> Entry | None:
        """The variant of ``key`` whose every recorded input has the same content in the env
        at ``root``. A malformed entry is discarded on the way."""
        for variant in self.variants(key):
            try:
                entry = self.load(key, variant)
            except EntryError as exc:
                self.discard(variant, str(exc))
                continue
            if all(self.input_matches(localise(p, root), h) for p, h in entry.inputs.items()):
                with contextlib.suppress(OSError):
                    os.utime(variant)  # used now: the last to be evicted
                return entry
        return None

    def stage(self, entry: Entry, name: str, dst: Path) -> Path:
        """The entry's file ``name`` copied beside ``dst`` and checked against its record;
        the staged file (rename it onto ``dst``). EntryError when it differs."""
        record = entry.files[name]
        dst.parent.mkdir(parents=True, exist_ok=True)
        # Named apart from dst's own name: a file name may be NAME_MAX long (trust.py), and
        # one more character would be refused by the file system.
        tag = hashlib.sha256(dst.name.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        tmp = dst.with_name(f".{tag}.{tmp_tag()}.tmp")
        copy_checked(
            entry.path / "files" / name,
            tmp,
            record.size,
            record.sha256,
            trusted=True,
            memo=self.hasher.memo,
        )
        self.hasher.dirty = True
        return tmp

    def place(self, entry: Entry, name: str, dst: Path) -> None:
        os.replace(self.stage(entry, name, dst), dst)

    def publish(
        self,
        key: str,
        files: Mapping[str, Path],
        inputs: Iterable[str],
        meta: Mapping[str, Any],
        root: str,
    ) -> Path | None:
        """Keep ``files`` (name -> built file) under ``key`` with the content of each input
        (paths normalised with ``@ENV@``); None when there is no input or one cannot be read
        as a regular file under the size cap (not kept)."""
        hashes: dict[str, str] = {}
        for name in sorted(set(inputs)):
            digest = self.hasher.sha256(localise(name, root), limit=MAX_INPUT)
            if digest is None:
                return None
            hashes[name] = digest
        if not hashes:
            return None
        content = {k: v for k, v in meta.items() if k not in PROVENANCE}
        provenance = {k: str(v) for k, v in meta.items() if k in PROVENANCE}
        provenance.setdefault(
            "first_built", dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        )
        return self._write(key, {**content, "inputs": hashes}, files, provenance)

    def import_entry(
        self,
        key: str,
        doc: Mapping[str, Any],
        files: Mapping[str, Path],
        provenance: Mapping[str, str],
    ) -> Path:
        """An entry that came from elsewhere (a registry, a wheelhouse) added to the store:
        checked as any entry is, every file against its recorded size and sha256."""
        if not is_key(key):
            raise EntryError(f"{key!r} is not a store key")
        content, records, _ = parse_entry(dict(doc))
        if set(files) != set(records):
            raise EntryError("the files carried are not the files the entry records")
        # When it came here: where it was first built is not part of what is shared.
        arrived = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        path = self._write(key, content, files, {"first_built": arrived, **provenance})
        assert path is not None
        return path

    def _write(
        self,
        key: str,
        content: Mapping[str, Any],
        files: Mapping[str, Path],
        provenance: Mapping[str, str],
    ) -> Path | None:
        records = content.get("files")
        final = self.entries(key) / variant_of(content["inputs"])
        if final.exists():
            return final
        self._dir(final.parent, make=True)
        tmp = Path(tempfile.mkdtemp(prefix=".publish-", dir=final.parent))
        try:
            (tmp / "files").mkdir(mode=0o755)
            written: dict[str, dict[str, Any]] = {}
            for name, src in sorted(files.items()):
                if not is_file_name(name):
                    raise EntryError(f"{name!r} is not a file name inside the entry")
                want = records.get(name) if isinstance(records, dict) else None
                size, digest = copy_checked(
                    src,
                    tmp / "files" / name,
                    want["size"] if want else None,
                    want["sha256"] if want else None,
                    # A build's own output or a download: taken by content, not owner.
                    trusted=False,
                )
                written[name] = {"size": size, "sha256": digest}
            doc = {**content, "files": written, **provenance}
            parse_entry(doc)
            (tmp / "entry.json").write_text(json.dumps(doc, indent=1, sort_keys=True))
            (tmp / "entry.json").chmod(0o644)  # whatever the umask (see check_dir)
            tmp.chmod(0o755)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.exists():  # a concurrent publisher won: theirs is the same
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.evict(keep=final)
        return final

    def export_entry(self, entry: Entry) -> tuple[dict[str, Any], dict[str, Path]]:
        """What another store needs of ``entry``: its content and its files, every file
        checked against its record first (a damaged entry is never passed on)."""
        for name, record in entry.files.items():
            if sha256_file(entry.path / "files" / name, trusted=True) != (
                record.size,
                record.sha256,
            ):
                raise EntryError(f"{entry.path / 'files' / name}: content differs from its record")
        return dict(entry.content), {n: entry.path / "files" / n for n in entry.files}

    def all(self) -> list[tuple[str, Path]]:
        """Every (key, variant dir) in the store, for listing, checking and eviction."""
        top = self.root / VERSION
        if not os.path.isdir(top):
            return []
        found = []
        for shard in sorted(os.scandir(top), key=lambda e: e.name):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for key in sorted(os.scandir(shard.path), key=lambda e: e.name):
                if not (is_key(key.name) and key.is_dir(follow_symlinks=False)):
                    continue
                for variant in sorted(os.scandir(key.path), key=lambda e: e.name):
                    if is_variant(variant.name) and variant.is_dir(follow_symlinks=False):
                        found.append((key.name, Path(variant.path)))
        return found

    def size_of(self, variant: Path) -> int:
        total = 0
        for path in (variant / "entry.json", *sorted((variant / "files").glob("*"))):
            with contextlib.suppress(OSError):
                total += os.lstat(path).st_size
        return total

    def evict(self, keep: Path | None = None, cap: int | None = None) -> list[Path]:
        """The least recently used entries removed until the store is under its cap
        (``CUDAENV_JIT_STORE_MAX``); never ``keep``, the entry just written."""
        limit = store_max() if cap is None else cap
        sized = []
        for _, variant in self.all():
            with contextlib.suppress(OSError):
                sized.append((os.lstat(variant).st_mtime_ns, variant, self.size_of(variant)))
        total = sum(size for _, _, size in sized)
        removed = []
        for _, variant, size in sorted(sized, key=lambda t: (t[0], str(t[1]))):
            if total <= limit:
                break
            if variant == keep:
                continue
            failed = remove_tree(variant)
            if failed is not None:
                self._unremoved(variant, failed)
                continue
            total -= size
            removed.append(variant)
        return removed

    def _unremoved(self, path: Path, why: str) -> None:
        note = f"could not remove {path} ({why})"
        if note not in self.notes:
            self.notes.append(note)

    def listing(self) -> list[Listed]:
        """Every entry, least recently used first."""
        rows = []
        for key, variant in self.all():
            try:
                entry = self.load(key, variant)
                kind, made = str(entry.content.get("kind")), entry.provenance
                module = entry.content.get("module")
            except (EntryError, StoreError) as exc:
                kind, made, module = f"unreadable ({exc})", {}, None
            with contextlib.suppress(OSError):
                rows.append(
                    Listed(
                        key=key,
                        variant=variant.name,
                        kind=kind,
                        size=self.size_of(variant),
                        last_used=os.lstat(variant).st_mtime,
                        first_built=made.get("first_built"),
                        made_for=made.get("env") or made.get("origin"),
                        module=module if isinstance(module, dict) else None,
                    )
                )
        return sorted(rows, key=lambda r: (r.last_used, r.key))

    def check(self, key: str, variant: Path) -> str | None:
        """What is wrong with one entry (its record, or a file against its record), or None."""
        try:
            self.export_entry(self.load(key, variant))
        except (EntryError, StoreError) as exc:
            return str(exc)
        return None

    def gc(self, cap: int) -> tuple[list[Path], int]:
        """What ``cudaenv store gc`` removes: entries of another format, what interrupted
        publishers left (an hour old), locks of keys no longer held by anyone, then the least
        recently used entries until the store is under ``cap``; (removed, bytes freed)."""
        self.ready()
        removed: list[Path] = []
        freed = 0
        hour_ago = time.time() - 3600
        old = [
            child
            for child in sorted(self.root.iterdir())
            if child.name.startswith("v") and child.name[1:].isdigit() and child.name != VERSION
        ]
        stale = [
            p
            for p in [*self.root.glob(".pull-*"), *self.root.glob(f"{VERSION}/*/*/.publish-*")]
            if os.lstat(p).st_mtime < hour_ago
        ]
        for path in [*old, *stale]:
            size = tree_size(path)
            failed = remove_tree(path)
            if failed is not None:
                self._unremoved(path, failed)
                continue
            freed += size
            removed.append(path)
        locks = self.root / "locks"
        if locks.is_dir():
            check_dir(locks)
            for lock in sorted(locks.glob("*.lock")):
                if self.variants(lock.name.removesuffix(".lock")):
                    continue
                with contextlib.suppress(OSError, StoreError):
                    held = self.acquire(lock.name.removesuffix(".lock"), timeout=0)
                    try:
                        lock.unlink()
                    except OSError as exc:
                        self._unremoved(lock, exc.strerror or type(exc).__name__)
                    finally:
                        held.release()
        before = {v: self.size_of(v) for _, v in self.all()}
        for variant in self.evict(cap=cap):
            freed += before.get(variant, 0)
            removed.append(variant)
        return removed, freed


# Where a cudaenv env lists the store entries it uses (`cudaenv export --with-jit` carries them).
USED = Path("var") / "cudaenv" / "jit-entries.json"


# The threads of one warm note their modules into one env's list: one at a time, or an
# update is lost.
_USED_LOCK = threading.Lock()


def note_use(store: Store, variant: Path, prefix: str) -> None:
    """Add ``variant`` to the entries the env at ``prefix`` uses; only a cudaenv env (one with
    a ``cudaenv.json``) is written to."""
    if not os.path.exists(os.path.join(prefix, "cudaenv.json")):
        return
    path = Path(prefix) / USED
    with _USED_LOCK, contextlib.suppress(OSError, ValueError):
        rel = str(variant.relative_to(store.root))
        used = json.loads(path.read_text()) if path.exists() else []
        if not isinstance(used, list):
            used = []
        if rel not in used:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{tmp_tag()}")
            tmp.write_text(json.dumps([*used, rel], indent=1))
            tmp.replace(path)


def used_entries(prefix: Path) -> list[str]:
    """The entries (``v3/ab/KEY/VARIANT``) the env at ``prefix`` used, of this format."""
    try:
        used = json.loads((prefix / USED).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(used, list):
        return []
    return [str(u) for u in used if split_entry(str(u)) is not None]
