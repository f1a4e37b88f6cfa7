"""An installed distribution kept as a wheel, so that ``adopt --undo`` can put it back.

``adopt --rebuild`` replaces a package compiled at install with one built again against the
env's matched toolkit. The index cannot give the old one back: what the user had was built on
their machine, by their toolkit, from the same sdist. So before anything is replaced, the
installed files are packed into a wheel below the env's ``var/cudaenv/adopt-saved/``, each
checked against the hash its RECORD gives (a file changed since install is refused, not
saved as if it were the install); undo reinstalls that wheel after checking its sha256, and
then checks that the installed files are the saved ones again. The installer's note of where
the package came from (``direct_url.json``, what ``pip freeze`` prints) is kept too, so that
after undo the env names the user's source again, not a saved wheel undo has removed.

Only what lies below site-packages is saved: a distribution whose RECORD names files outside
it (scripts in ``bin/``, data files) is refused, since a wheel made here could not put those
back where they were.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

from builder.core.errors import BuildError, CudaenvError

SAVED = Path("var") / "cudaenv" / "adopt-saved"
# What installers write into a .dist-info for themselves: not part of the wheel (uv adds
# uv_cache.json for a wheel installed from a local file, and rewrites it on each install).
_DIRECT_URL = "direct_url.json"
_INSTALLER_FILES = ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json", "uv_cache.json")


class NotSavable(CudaenvError):
    """The installed distribution cannot be kept as a wheel; nothing was changed (exit 3,
    as adopt's other refusals)."""

    exit_code = 3


@dataclass(frozen=True)
class Saved:
    name: str
    version: str
    wheel: str  # relative to the env's prefix
    sha256: str
    # The installed direct_url.json (PEP 610) as it was, "" where there was none.
    origin: str = ""


def dist_info(site: Path, name: str, version: str) -> Path | None:
    """The ``.dist-info`` of ``name`` ``version`` in ``site``, or None."""
    want = canonicalize_name(name)
    for info in sorted(site.glob("*.dist-info")):
        dist, _, ver = info.name[: -len(".dist-info")].rpartition("-")
        if canonicalize_name(dist) == want and ver == version and not info.is_symlink():
            return info
    return None


def record_hash(data: bytes) -> str:
    """A RECORD's hash field for ``data`` (PEP 376/427: urlsafe base64, no padding)."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def _rows(info: Path) -> list[tuple[str, str]]:
    """(path relative to site-packages, hash field) of each file the RECORD names."""
    record = info / "RECORD"
    if record.is_symlink() or not record.is_file():
        raise NotSavable(f"{record}: no RECORD, so what the package installed is not known")
    rows = []
    for row in csv.reader(io.StringIO(record.read_text(encoding="utf-8", errors="replace"))):
        if row:
            rows.append((row[0], row[1] if len(row) > 1 else ""))
    return rows


def _inside(site: Path, rel: str) -> Path | None:
    """``site/rel`` where it is a file below ``site`` (no ``..`` out of it, no link), else None."""
    if Path(rel).is_absolute() or ".." in Path(rel).parts:
        return None
    path = site / rel
    # A directory on the way that is a link out of site-packages counts as outside too.
    if path.is_symlink() or not path.is_file():
        return None
    if not path.resolve().is_relative_to(site.resolve()):
        return None
    return path


def _installers(rel: str) -> bool:
    """Whether ``rel`` is a file an installer writes into a .dist-info for itself."""
    parts = Path(rel).parts
    return len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] in _INSTALLER_FILES


def members(site: Path, info: Path) -> list[tuple[str, bytes]]:
    """The distribution's files as a wheel holds them: every RECORD row below site-packages,
    each the bytes its RECORD hash names; NotSavable naming the first that is not."""
    out: list[tuple[str, bytes]] = []
    for rel, hashed in _rows(info):
        if rel.endswith(".pyc") and not hashed:
            continue  # bytecode an installer compiled: not the wheel's
        if _installers(rel):
            continue
        path = _inside(site, rel)
        if path is None:
            raise NotSavable(
                f"{info.name}/RECORD names {rel}, which is not a file below {site}: a wheel "
                "made here could not put it back, so it is not replaced"
            )
        data = path.read_bytes()
        if hashed and hashed != record_hash(data):
            raise NotSavable(
                f"{path} differs from the hash {info.name}/RECORD gives it (changed since it "
                "was installed), so it is not replaced"
            )
        out.append((rel, data))
    return out


def _tag(info: Path) -> str:
    """The first ``Tag:`` its WHEEL file gives (what the saved wheel is called by)."""
    wheel = info / "WHEEL"
    text = wheel.read_text(errors="replace") if wheel.is_file() else ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Tag" and value.strip().count("-") == 2:
            return value.strip()
    raise NotSavable(f"{wheel}: no Tag line, so the saved wheel could not be named")


def save(prefix: Path, site: Path, name: str, version: str) -> Saved:
    """Pack the installed ``name`` ``version`` into a wheel below ``prefix/SAVED`` (written
    whole, RECORD rewritten with each file's hash) and return where and its sha256."""
    info = dist_info(site, name, version)
    if info is None:
        raise NotSavable(f"{site}: no .dist-info of {name} {version}")
    files = members(site, info)
    dist = info.name[: -len(".dist-info")].rpartition("-")[0]
    record_rows = [(rel, record_hash(data), str(len(data))) for rel, data in files]
    record_rows.append((f"{info.name}/RECORD", "", ""))
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(record_rows)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel, data in files:
            zf.writestr(rel, data)
        zf.writestr(f"{info.name}/RECORD", buf.getvalue())
    where = prefix / SAVED
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{dist}-{version}-{_tag(info)}.whl"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(out.getvalue())
    os.replace(tmp, path)  # whole or not at all: undo checks its sha256 either way
    return Saved(
        name=canonicalize_name(name),
        version=version,
        wheel=str(path.relative_to(prefix)),
        sha256=hashlib.sha256(out.getvalue()).hexdigest(),
        origin=_origin(info),
    )


def _origin(info: Path) -> str:
    """The installed direct_url.json, or "" where there is none or it is not a JSON object
    (then it is not kept: nothing but what PEP 610 describes is written back)."""
    path = info / _DIRECT_URL
    if path.is_symlink() or not path.is_file():
        return ""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        return text if isinstance(json.loads(text), dict) else ""
    except ValueError:
        return ""


def put_back_origin(site: Path, saved: Saved) -> None:
    """Write the saved direct_url.json into the reinstalled .dist-info (removing the one the
    reinstall wrote where there was none) and give its RECORD row the new hash, so that the
    RECORD still vouches for every file it names."""
    info = dist_info(site, saved.name, saved.version)
    if info is None or (not saved.origin and not (info / _DIRECT_URL).exists()):
        return
    try:
        if not isinstance(json.loads(saved.origin or "{}"), dict):
            return
    except ValueError:
        return  # a journal edited by hand: the reinstall's own note stays
    target = info / _DIRECT_URL
    rel = f"{info.name}/{_DIRECT_URL}"
    target.unlink(missing_ok=True)
    rows = [r for r in _rows(info) if r[0] != rel]
    if saved.origin:
        data = saved.origin.encode()
        target.write_bytes(data)
        rows.insert(-1 if rows else 0, (rel, record_hash(data)))
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(
        (r, h, str((site / r).stat().st_size) if h and (site / r).is_file() else "")
        for r, h in rows
    )
    tmp = info / ".RECORD.tmp"
    tmp.write_text(buf.getvalue(), encoding="utf-8")
    os.replace(tmp, info / "RECORD")


def checked(prefix: Path, saved: Saved) -> Path:
    """The saved wheel's path once it is a file below ``prefix/SAVED`` (no link) whose sha256
    is the journal's; BuildError naming what is wrong."""
    path = prefix / saved.wheel
    root = prefix / SAVED
    if ".." in Path(saved.wheel).parts or path.parent != root:
        raise BuildError(f"{saved.wheel}: the journal names a saved wheel outside {SAVED}")
    if path.is_symlink() or not path.is_file():
        raise BuildError(f"{path}: the saved wheel of {saved.name} {saved.version} is gone")
    if hashlib.sha256(path.read_bytes()).hexdigest() != saved.sha256:
        raise BuildError(f"{path}: differs from the sha256 the adopt journal gives it")
    return path


def differs(site: Path, wheel: Path) -> list[str]:
    """The files of ``wheel`` that are not installed in ``site`` as the wheel holds them."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not _installers(n)]
        wrong = []
        for rel in names:
            path = _inside(site, rel)
            if path is None or path.read_bytes() != zf.read(rel):
                wrong.append(rel)
    return wrong
