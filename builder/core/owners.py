"""The owner rule, in one place: what another user owns or can write is never run, read as a
project, or borrowed from, as git refuses a repository another user owns (its
``safe.directory`` rule, CVE-2022-24765). cudaenv often runs as root: her ``.pth`` in an env's
``site-packages`` runs at the interpreter's start, her ``uv.toml`` in a shared parent chooses
an index. The launcher (``proc``), the project search (``paths``) and the borrowers
(``verify/recorded.py``, ``verify/imports.py``) ask here; CUDAENV_SAFE_DIRECTORIES is the one
override.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from builder.core import settings
from builder.core.errors import UsageError


def owned(st: os.stat_result) -> bool:
    """Whether a file or directory is the user's own (or root's) and no other user can write
    it: a group-writable one only where the group is the owner's alone."""
    if st.st_uid not in (os.geteuid(), 0) or st.st_mode & stat.S_IWOTH:
        return False
    if not st.st_mode & stat.S_IWGRP:
        return True
    try:
        import grp
        import pwd

        group = grp.getgrgid(st.st_gid)
        owner = pwd.getpwuid(st.st_uid)
    except (KeyError, ImportError):
        return False
    return group.gr_mem in ([], [owner.pw_name]) and owner.pw_gid == st.st_gid


def safe_directory(path: Path) -> bool:
    """``path`` lies in a directory the user trusts although another user owns or can write
    it (CUDAENV_SAFE_DIRECTORIES, git's ``safe.directory``: ``*`` trusts every one)."""
    listed = settings.current().safe_directories or ""
    for entry in filter(None, listed.split(os.pathsep)):
        if entry == "*" or path.is_relative_to(Path(entry).absolute()):
            return True
    return False


def tree_why(root: Path) -> str | None:
    """Why what lies under ``root`` may be another user's (None: it is not): ``root`` itself
    another user owns or can write, or a directory above it that another user can write
    without the sticky bit (in ``/tmp``, 1777, she can neither rename nor remove what root
    owns; in a 0777 directory she can swap ``root`` for her own). What cudaenv borrows from
    another env (its bytecode, a recorded pass) comes only from such a tree; a path in
    CUDAENV_SAFE_DIRECTORIES is trusted."""
    root = root.absolute()
    if safe_directory(root):
        return None
    try:
        st = root.stat()
    except OSError as exc:
        return f"{root} cannot be read ({exc.strerror})"
    if not owned(st):
        return f"{root} {who(st)}"
    for directory in root.parents:
        try:
            st = directory.stat()
        except OSError as exc:
            return f"{directory} cannot be read ({exc.strerror})"
        foreign = st.st_uid not in (os.geteuid(), 0)
        if foreign or (not owned(st) and not st.st_mode & stat.S_ISVTX):
            return f"{directory} (above {root}) {who(st)}"
    return None


def who(st: os.stat_result, *, mode: bool = False) -> str:
    """What makes ``st`` another user's, as every refusal says it: its owner's uid, or that
    others can write it (with its mode, where ``mode``)."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"belongs to uid {st.st_uid}"
    said = "can be written by other users"
    return f"{said} (mode {stat.S_IMODE(st.st_mode):04o})" if mode else said


# What a Python interpreter runs at start from its env, besides its own file: a `.pth` file
# is executed by site.py, and sitecustomize/usercustomize are imported (CPython's site docs).
_STARTUP_FILES = ("sitecustomize.py", "usercustomize.py")


def _env_root(program: Path) -> Path | None:
    """The venv or conda env ``program`` belongs to (``ENV/bin/PROGRAM``), if any."""
    root = program.parent.parent
    if (root / "pyvenv.cfg").exists() or (root / "conda-meta").is_dir():
        return root
    return None


def _not_owned_why(where: Path) -> str | None:
    """Why ``where`` may be another user's: it, or what a link there names, owned by another
    user or writable by one. A link's own mode means nothing (always 0777 on Linux); its
    owner does, and what it names is judged as any file."""
    try:
        link = where.lstat()
        st = where.stat()
    except OSError:
        return f"{where} cannot be read"
    for judged in (link, st) if where.is_symlink() else (st,):
        if judged.st_uid not in (os.geteuid(), 0):
            return f"{where} belongs to uid {judged.st_uid}"
    if owned(st):
        return None
    return f"{where} can be written by other users"


def env_why(root: Path) -> str | None:
    """Why the env at ``root`` may hold another user's code (None: it does not): the env
    directory, ``pyvenv.cfg``, each ``site-packages`` directory (and ``lib``, ``lib/pythonX.Y``
    above it), and each file an interpreter runs from there at start (``*.pth``,
    sitecustomize, usercustomize), owned by another user or writable by one. Directories
    and start-up files only: a module under ``site-packages`` that she owns was put there by
    someone who could write that directory, which is checked."""
    checked = [root, root / "pyvenv.cfg"] if (root / "pyvenv.cfg").exists() else [root]
    for lib in ("lib", "lib64"):
        if not (root / lib).is_dir() or (root / lib).is_symlink():
            continue
        checked.append(root / lib)
        for version in sorted((root / lib).glob("python*")):
            checked.append(version)
            site = version / "site-packages"
            if not site.is_dir():
                continue
            checked.append(site)
            try:
                entries = sorted(site.iterdir())
            except OSError:
                entries = []
            checked += [e for e in entries if e.suffix == ".pth" or e.name in _STARTUP_FILES]
    for where in checked:
        why = _not_owned_why(where)
        if why is not None:
            return why
    return None


def launch_why(program: str | os.PathLike[str]) -> str | None:
    """Why cudaenv will not start ``program`` (None: it may): :func:`planted_why` for the file,
    its directory and where its link leads, then, for a program of a venv or conda env (an
    interpreter given with ``--python``, an env's ``bin/`` tool), :func:`env_why` for that env.
    cudaenv often runs as root: a ``.pth`` another user put in an env's ``site-packages`` would
    run as root at the interpreter's start. A path in CUDAENV_SAFE_DIRECTORIES is trusted."""
    given = Path(program).absolute()
    if safe_directory(given) or not (given.exists() or given.is_symlink()):
        return None  # nothing there: starting it fails as a missing program (ToolMissing)
    why = planted_why(str(given))
    if why is not None:
        return why
    root = _env_root(given)
    return None if root is None else env_why(root)


def refused(program: str | os.PathLike[str]) -> UsageError | None:
    """The one-line refusal for starting ``program`` (:func:`launch_why`), naming the override;
    None where it may start."""
    why = launch_why(program)
    if why is None:
        return None
    given = Path(program).absolute()
    root = _env_root(given) or given.parent
    return UsageError(
        f"{program}: not run: {why}, and cudaenv runs no program another user could have "
        f"written (as git's safe.directory rule): run cudaenv as that user, or trust it with "
        f"CUDAENV_SAFE_DIRECTORIES={root}"
    )


def planted_why(program: str) -> str | None:
    """Why ``program`` may be another user's (None: it is not): its file or its directory,
    or where a link leads and that directory, owned by another user or writable by one."""
    given = Path(program).absolute()
    real = given.resolve()
    for where in dict.fromkeys((given, given.parent, real, real.parent)):
        try:
            st = where.stat()
        except OSError:
            return f"{where} cannot be read"
        if not owned(st):
            return f"{where} {who(st)}"
    return None
