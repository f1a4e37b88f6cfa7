"""What a source build changed in the env around it.

A ``setup.py`` is a program: it can write anywhere its user can, and cudaenv often runs as
root. Its build is given a tree of its own (``var/source-builds/NAME-VERSION``: the sdist,
``TMPDIR``, ``HOME``, the wheel), and everything else in the env it builds in is expected to
be exactly as it was when the build ends: a build that edits torch's headers, drops a
``.pth`` into site-packages or replaces a binary in ``bin/`` would change what every later
import and compile of that env runs, with no RECORD to say so. The env is recorded before
the build (every entry's type, size, mtime and inode, no link followed) and compared after;
any difference fails the build, naming the paths, before its wheel is installed or stored.

In an env in use (``warm`` building ahead, ``adopt --rebuild``), what its running processes
write (the JIT caches under ``var/``, bytecode in ``__pycache__``) is left out of the
comparison. This sees the env, which is what the build could spoil for cudaenv; a write elsewhere on the
machine is outside what an unprivileged check can see (``HOME`` and ``TMPDIR`` point into the
build's tree, so the usual places a build writes to are its own).
"""

from __future__ import annotations

import os
from pathlib import Path

# mode (type and permissions), size, mtime in ns, inode: a rewrite (its mtime), a replacement
# (its inode), a chmod or a new link each changes one of them. Not the ctime or the link
# count: the env's files are hard links into uv's cache, which every other env built from it
# links and unlinks again (measured: a build beside another one saw 17,666 ctimes move).
Entry = tuple[int, int, int, int]
_DIR = 0o040000


# What an env in use writes while it runs: its JIT caches and reports (var/) and the bytecode
# of what its processes import. In an env cudaenv is building nothing runs; in one that is
# in use (warm building ahead, adopt --rebuild) a server may be writing these meanwhile.
RUNTIME = ("var", "__pycache__")


def record(root: Path, *, skip: Path, live: bool = False) -> dict[str, Entry]:
    """Each entry below ``root`` (its path relative to ``root``) but ``skip`` and what is
    below it; links are recorded as links, never followed. ``live``: an env in use, whose
    :data:`RUNTIME` trees are left out (its processes write them)."""
    out: dict[str, Entry] = {}
    skipped = {os.fspath(skip)}
    if live:
        skipped.add(os.fspath(root / "var"))
    stack = [os.fspath(root)]
    while stack:
        top = stack.pop()
        try:
            listing = list(os.scandir(top))
        except OSError:
            continue  # gone or unreadable: what is found after says the difference
        for item in listing:
            if item.path in skipped or (live and item.name == "__pycache__"):
                continue
            try:
                st = item.stat(follow_symlinks=False)
            except OSError:
                continue
            rel = os.path.relpath(item.path, root)
            out[rel] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)
            if item.is_dir(follow_symlinks=False):
                stack.append(item.path)
    return out


def changes(before: dict[str, Entry], after: dict[str, Entry]) -> list[str]:
    """Each path that was added, removed or changed, sorted, with how ("added", ...)."""
    out = [f"{p} (added)" for p in after.keys() - before.keys()]
    out += [f"{p} (removed)" for p in before.keys() - after.keys()]
    out += [f"{p} (changed)" for p in before.keys() & after.keys() if _differ(before[p], after[p])]
    return sorted(out)


def _differ(old: Entry, new: Entry) -> bool:
    if old[0] & 0o170000 == new[0] & 0o170000 == _DIR:
        # A directory's size and mtime move with what is added to or removed from it, which
        # those paths say themselves; its mode and inode are its own.
        return (old[0], old[3]) != (new[0], new[3])
    return old != new


def said(found: list[str], *, most: int = 3) -> str:
    """``found`` as one phrase: the first few and how many more (paths relative to the env:
    the env being built is a temporary directory that is gone when this is read)."""
    more = len(found) - most
    return ", ".join(found[:most]) + (f" and {more} more" if more > 0 else "")
