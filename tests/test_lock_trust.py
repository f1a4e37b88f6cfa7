"""A lock is an input a pull request can edit: what it says about where files come from is
believed only as far as the spec says the same, its parse memo only where no one else can have
written it, and it is read only as a regular file under a size cap.

Each test edits a real lock file on disk and reads it the way the commands do (most through
the real CLI in a child process): nothing is mocked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from builder.core import paths, platforms, proc
from builder.core.errors import SpecError
from builder.spec import envspec as spec
from builder.spec import lock
from tests.helpers import REPO, cudaenv, installed, tiny_wheel, uv_venv, write

PY = f"{sys.version_info.major}.{sys.version_info.minor}"
NAME = "cudaenv-tiny-alpha"
WHEEL = "cudaenv_tiny_alpha-1.0-py3-none-any.whl"
SPEC = f"""\
name: tiny
python: "{PY}"
cuda: "13.0"
packages: [{NAME}==1.0]
"""


def a_lock(s: spec.EnvSpec, sha256: str = "0" * 64, **where: Any) -> lock.Lock:
    """The lock of ``s``: one package, its wheel named at ``where`` (url=, path=), up to date."""
    wheel = lock.LockedFile(name=WHEEL, sha256=sha256, size=1, **where)
    return lock.Lock(
        spec_name=s.name,
        fingerprint=s.fingerprint(),
        python=s.python,
        platforms=s.platforms,
        cuda=s.cuda,
        torch=None,
        torch_cuda=None,
        toolkit=None,
        packages=(lock.LockedPackage(name=NAME, version="1.0", wheels=(wheel,)),),
    )


def project(tmp: Path, extra: str = "") -> spec.EnvSpec:
    """A project of the tiny spec (``extra`` appended to it) with its lock file's directory."""
    (tmp / "envspecs" / "locks").mkdir(parents=True)
    return spec.load(write(tmp / "envspecs" / "tiny.yaml", SPEC + extra))


def evil_wheel(tmp: Path) -> Path:
    """A wheel an attacker controls, on a file:// index of its own."""
    return tiny_wheel(tmp / "evil" / "simple" / NAME, NAME, "1.0", "WHO = 'evil'\n")


def error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]


# --------------------------------------------------------------------------- index and url


def test_an_index_the_spec_does_not_pin_is_refused_and_plan_does_not_call_it_up_to_date(
    tmp_path: Path,
) -> None:
    s = project(tmp_path)
    evil = evil_wheel(tmp_path)
    tampered = a_lock(s, hashlib.sha256(evil.read_bytes()).hexdigest(), url=evil.as_uri())
    pkg = dataclasses.replace(tampered.packages[0], index=evil.parent.parent.as_uri())
    path = lock.lock_path(s.source, s.name)
    lock.write(dataclasses.replace(tampered, packages=(pkg,)), path)
    with pytest.raises(SpecError) as info:
        lock.read(path, spec=s)
    assert info.value.what == "lock"
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}: {NAME}==1.0: index: '{pkg.index}' is named, but the spec ")
    done = cudaenv("plan", "envspecs/tiny.yaml", cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "up to date" not in done.stdout + done.stderr
    assert error_lines(done) == [
        f"error: {problem}".replace(str(path), "envspecs/locks/pylock.tiny.toml"),
        "error: 1 problem(s) in the lock; nothing was done",
    ]
    # Without the spec (a lock read on its own), no entry may name an index either.
    with pytest.raises(SpecError, match=r": index: .* the spec pins no index"):
        lock.read(path)


def test_a_pinned_package_is_installed_by_its_url_only_when_that_url_is_on_its_index(
    tmp_path: Path,
) -> None:
    index = (tmp_path / "pinned" / "simple").as_uri()
    s = project(tmp_path, f"indexes: {{{NAME}: {index}}}\n")
    path = lock.lock_path(s.source, s.name)
    good_url = f"{index}/{NAME}/{WHEEL}"
    good = a_lock(s, url=good_url)
    pinned = dataclasses.replace(good.packages[0], index=index)
    lock.write(dataclasses.replace(good, packages=(pinned,)), path)
    read = lock.read(path, spec=s)
    assert read.requirements_txt("linux-x86_64").startswith(f"{NAME} @ {good_url} ")
    for key, bad in (
        ("url", "http://127.0.0.1:9/" + WHEEL),
        ("url", f"{index}/../../evil/{WHEEL}"),
        ("url", index.removesuffix("/simple") + ".evil/" + WHEEL),
        ("index", None),
    ):
        if key == "url":
            wheel = dataclasses.replace(pinned.wheels[0], url=bad)
            entry = dataclasses.replace(pinned, wheels=(wheel,))
        else:
            entry = dataclasses.replace(pinned, index=bad)
        lock.write(dataclasses.replace(good, packages=(entry,)), path)
        with pytest.raises(SpecError) as info:
            lock.read(path, spec=s)
        (problem,) = info.value.problems
        assert problem.startswith(f"{path}: {NAME}==1.0: {key}: {bad!r} is not "), problem
    # Another index than the pinned one.
    other = dataclasses.replace(pinned, index="https://elsewhere.invalid/simple")
    lock.write(dataclasses.replace(good, packages=(other,)), path)
    with pytest.raises(SpecError, match=r"index: 'https://elsewhere\.invalid/simple' is not"):
        lock.read(path, spec=s)


def test_uv_installs_a_pinned_package_from_its_index_url_as_the_build_asks(
    tmp_path: Path,
) -> None:
    """The requirements the build hands `uv pip sync`: the pinned file by its URL, hash
    required, no other index asked (the machine's index here is one that does not exist)."""
    index_root = tmp_path / "pinned"
    whl = tiny_wheel(index_root / "simple" / NAME, NAME, "1.0", "WHO = 'pinned'\n")
    index = (index_root / "simple").as_uri()
    s = project(tmp_path, f"indexes: {{{NAME}: {index}}}\n")
    path = lock.lock_path(s.source, s.name)
    good = a_lock(s, hashlib.sha256(whl.read_bytes()).hexdigest(), url=whl.as_uri())
    pinned = dataclasses.replace(good.packages[0], index=index)
    lock.write(dataclasses.replace(good, packages=(pinned,)), path)
    req = write(
        tmp_path / "req.txt", lock.read(path, spec=s).requirements_txt(platforms.host_name())
    )
    venv = uv_venv(Path(sys.executable).resolve(), tmp_path / "venv")
    nowhere = (tmp_path / "no-index").as_uri()
    done = subprocess.run(
        [
            proc.uv_bin(),
            "pip",
            "sync",
            "--require-hashes",
            "--offline",
            "--python",
            str(venv),
            str(req),
        ],
        env={
            **os.environ,
            "UV_DEFAULT_INDEX": nowhere,
            "UV_INDEX_URL": nowhere,
            "UV_NO_CONFIG": "1",
            "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
        },
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert installed(venv) == {(NAME, "1.0")}


def test_a_url_of_an_unpinned_package_is_never_fetched(tmp_path: Path) -> None:
    """A lock of URLs keeps the URL uv resolved each file to (for other PEP 751 readers), but
    cudaenv installs and exports it by name, version and hash through the machine's index."""
    s = project(tmp_path)
    path = lock.lock_path(s.source, s.name)
    lock.write(a_lock(s, url="http://127.0.0.1:9/" + WHEEL), path)
    text = lock.read(path, spec=s).requirements_txt("linux-x86_64")
    assert text == f"{NAME}==1.0 --hash=sha256:{'0' * 64}\n"


def test_a_path_that_is_not_a_file_beside_the_lock_is_refused_on_read(tmp_path: Path) -> None:
    s = project(tmp_path)
    path = lock.lock_path(s.source, s.name)
    for bad in (f"/srv/{WHEEL}", f"wheels/../../x/./{WHEEL}", "wheels/other.whl", "wheels\\x.whl"):
        lock.write(a_lock(s, path=bad), path)
        with pytest.raises(SpecError) as info:
            lock.read(path, spec=s)
        assert info.value.problems == [
            f"{path}: {NAME}==1.0: path: {bad!r} is not a relative path to {WHEEL!r} beside the "
            "lock; re-lock it with `cudaenv lock`"
        ]
    lock.write(a_lock(s, path=f"../../wheels/{WHEEL}"), path)  # a wheelhouse above: export's call
    assert lock.read(path, spec=s).packages[0].wheels[0].path == f"../../wheels/{WHEEL}"


# --------------------------------------------------------------------------- the parse memo


def memo_of(path: Path) -> Path:
    """The memo the first read of ``path`` left (whatever its name)."""
    lock.read(path)
    (memo,) = (paths.cache_dir() / "locks").glob("*.json")
    return memo


def poisoned(memo: Path, url: str) -> str:
    """The memo's own JSON with every locked file replaced by the attacker's URL and hash."""
    doc = json.loads(memo.read_text())
    inner = doc.get("lock", doc)
    for pkg in inner["packages"]:
        pkg["index"] = url.rsplit("/", 1)[0]
        for f in pkg["wheels"]:
            f.update(url=url, path=None, sha256="e" * 64)
    return json.dumps(doc)


@pytest.fixture
def committed(tmp_path: Path) -> tuple[spec.EnvSpec, Path]:
    """A lock as committed (paths in wheels/), read once so its memo exists."""
    s = project(tmp_path)
    path = lock.lock_path(s.source, s.name)
    lock.write(a_lock(s, path=f"wheels/{WHEEL}"), path)
    return s, path


def test_a_memo_others_can_write_is_not_believed(committed: tuple[spec.EnvSpec, Path]) -> None:
    s, path = committed
    memo = memo_of(path)
    assert memo.stat().st_mode & 0o777 == 0o644
    memo.write_text(poisoned(memo, "http://127.0.0.1:9/" + WHEEL))
    memo.chmod(0o666)  # a shared cache, or one another user may write
    read = lock.read(path, spec=s)
    assert read.packages[0].wheels[0].path == f"wheels/{WHEEL}" and read.packages[0].index is None


def test_a_memo_through_a_link_or_of_another_lock_is_not_believed(
    committed: tuple[spec.EnvSpec, Path], tmp_path: Path
) -> None:
    s, path = committed
    memo = memo_of(path)
    # A link to a file someone else prepared, with the right name.
    bait = write(tmp_path / "bait.json", poisoned(memo, "http://127.0.0.1:9/" + WHEEL))
    bait.chmod(0o644)
    memo.unlink()
    memo.symlink_to(bait)
    assert lock.read(path, spec=s).packages[0].index is None
    # The memo of another lock (another version), renamed onto this lock's name.
    memo.unlink()
    other = path.with_name("pylock.other.toml")
    lock.write(dataclasses.replace(a_lock(s, path=f"wheels/{WHEEL}"), notes=("other",)), other)
    lock.read(other)
    (theirs,) = (m for m in memo.parent.glob("*.json") if m != memo)
    theirs.rename(memo)
    assert lock.read(path, spec=s).notes == ()


def test_a_memo_another_user_owns_is_not_believed(committed: tuple[spec.EnvSpec, Path]) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    s, path = committed
    memo = memo_of(path)
    memo.write_text(poisoned(memo, "http://127.0.0.1:9/" + WHEEL))
    os.chown(memo, 65534, 65534)  # nobody
    assert lock.read(path, spec=s).packages[0].index is None


def test_a_memo_is_still_used_under_a_group_writable_umask(
    committed: tuple[spec.EnvSpec, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memo is written so that its own check passes: reading it back still saves the
    parse (~40 ms, ~110 ms with packaging's import, per command)."""
    s, path = committed
    old = os.umask(0o002)
    try:
        first = lock.read(path, spec=s)
    finally:
        os.umask(old)

    def no_parse(p: Path, raw: bytes) -> lock.Lock:
        raise AssertionError("parsed again")

    monkeypatch.setattr(lock, "_parse", no_parse)
    assert lock.read(path, spec=s) == first


# --------------------------------------------------------------------------- what is read


def plan_bounded(cwd: Path) -> subprocess.CompletedProcess[str]:
    """`cudaenv plan` of the tiny spec in a child with a deadline and 2 GiB of address space:
    a read that blocks on a FIFO or never ends on /dev/zero fails the test, never hangs it or
    exhausts the machine's memory."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run(
        [sys.executable, "-m", "builder.cli", "plan", "envspecs/tiny.yaml"],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit,
        check=False,
    )


@pytest.mark.slow
def test_a_lock_that_is_a_fifo_a_device_or_too_big_is_refused_at_once(tmp_path: Path) -> None:
    s = project(tmp_path)
    path = lock.lock_path(s.source, s.name)
    shown = "envspecs/locks/pylock.tiny.toml"
    os.mkfifo(path)  # a plain read waits for a writer forever
    for what in ("a FIFO", "a character device"):
        done = plan_bounded(tmp_path)
        assert done.returncode == 2, done.stderr
        assert error_lines(done) == [
            f"error: {shown}: {what}, not a file; a lock is a regular file",
            "error: 1 problem(s) in the lock; nothing was done",
        ], done.stderr
        path.unlink()
        path.symlink_to("/dev/zero")  # read whole, it never ends
    path.unlink()
    with path.open("wb") as fh:
        fh.truncate(lock.MAX_LOCK_BYTES + 1)  # sparse: no disk used
    with pytest.raises(SpecError) as info:
        lock.read(path, spec=s)
    assert info.value.problems == [
        f"{path}: file is {lock.MAX_LOCK_BYTES + 1} bytes; a lock is at most {lock.MAX_LOCK_BYTES}"
    ]
    assert lock.owner(path) is None


def test_the_lock_cap_leaves_ample_room_for_the_committed_locks() -> None:
    biggest = max(p.stat().st_size for p in (REPO / "envspecs" / "locks").glob("pylock.*.toml"))
    assert biggest * 50 < lock.MAX_LOCK_BYTES
