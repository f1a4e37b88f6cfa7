"""Attacks on cudaenv's cache directory: another user who can write there must not make cudaenv
(often root) run or write what they chose.

Each attack plants its files as another user: uid 65534 through ``setpriv`` where the tests run
as root (as they do in CI), else as this user in a directory everyone may write (the stand-in:
what cudaenv refuses is the directory's mode, whoever wrote the file). A file "of another user"
in a directory of ours is made by ``chown`` to uid 65534 where root may, else by mode 0666.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from builder.audit import scan as audit
from builder.core import cachefiles, paths, proc
from builder.core.paths import cache_dir
from builder.formats import templates
from builder.machine import interpreters
from builder.spec import uvcompile as resolve
from builder.spec.lock import LockedFile, LockedPackage, packages_to_json
from builder.verify import cubin
from tests.helpers import env_facts

OTHER_UID = 65534
ATTACKER = (
    ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
    if os.geteuid() == 0 and shutil.which("setpriv")
    else None
)


def plant(path: Path, data: bytes, mode: int = 0o755) -> Path:
    """``data`` at ``path`` (parents made), written by another user where this test may run
    a process as one."""
    if ATTACKER is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)
        return path
    script = 'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod "$2" "$1"'
    subprocess.run([*ATTACKER, "sh", "-c", script, "sh", str(path), format(mode, "o")],
                   input=data, check=True)  # fmt: skip
    return path


def plant_link(link: Path, target: Path) -> None:
    if ATTACKER is None:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)
        return
    script = 'mkdir -p "$(dirname "$1")" && ln -s "$2" "$1"'
    subprocess.run([*ATTACKER, "sh", "-c", script, "sh", str(link), str(target)], check=True)


def foreign(path: Path) -> None:
    """``path`` as another user's file: chown to uid 65534 where root may, else mode 0666."""
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, OTHER_UID)
    else:
        path.chmod(0o666)


@pytest.fixture
def shared_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """CUDAENV_CACHE_DIR in a directory another user can write (mode 0777), reachable by
    them (below a 0755 directory in /tmp)."""
    base = Path(tempfile.mkdtemp(prefix="cudaenv-shared-", dir="/tmp"))
    base.chmod(0o755)
    cache = base / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    monkeypatch.setenv("CUDAENV_CACHE_DIR", str(cache))
    try:
        yield cache
    finally:
        shutil.rmtree(base)


@dataclasses.dataclass
class Planter:
    """Where an attack puts its files: a cache another user can write (``shared``), or a
    cache of ours holding a file another user owns (``foreign``)."""

    root: Path  # the CUDAENV_CACHE_DIR under attack
    shared: bool

    def put(self, rel: str, data: bytes, mode: int = 0o644) -> Path:
        path = self.root / rel
        if self.shared:
            return plant(path, data, mode)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)
        foreign(path)
        return path


@pytest.fixture(params=["shared-cache", "foreign-file"])
def attack(request: pytest.FixtureRequest) -> Planter:
    if request.param == "shared-cache":
        return Planter(root=request.getfixturevalue("shared_cache"), shared=True)
    return Planter(root=cache_dir(), shared=False)


def warnings_in(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("cudaenv: warning: ")]


# --------------------------------------------------------------------------- the rules


def test_a_cache_file_is_read_only_under_the_stores_rules(tmp_path: Path) -> None:
    cache = cache_dir()
    memo = cache / "memo" / "a.json"
    assert cachefiles.write_json(memo, {"a": 1})
    assert cachefiles.read_json(memo) == {"a": 1}
    memo.chmod(0o666)  # anyone may write it
    assert cachefiles.read_json(memo) is None
    memo.chmod(0o644)
    foreign(memo.parent)  # another user's directory
    assert cachefiles.read_json(memo) is None
    os.chown(memo.parent, os.geteuid(), os.getegid())
    memo.parent.chmod(0o755)
    memo.unlink()
    (tmp_path / "elsewhere.json").write_text('{"a": 2}')
    memo.symlink_to(tmp_path / "elsewhere.json")  # a link is never followed
    assert cachefiles.read_json(memo) is None
    memo.unlink()
    shutil.move(str(memo.parent), str(tmp_path / "real"))
    memo.parent.symlink_to(tmp_path / "real")  # nor a linked directory
    assert cachefiles.read_json(memo) is None


def test_a_cache_another_user_can_write_is_replaced_by_a_private_one(
    shared_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Everything below the cache root follows from it: the verify work directories, the
    channel pins, the JIT store's default place. A refused root is not used for any."""
    cachefiles._warned.clear()
    plant(shared_cache / "verify" / "k" / "kernels" / "topk_topp.sm_90", b"#!/bin/sh\n")
    own = cache_dir()
    assert own != shared_cache and not own.is_relative_to(shared_cache)
    st = own.stat()
    assert (st.st_uid, st.st_mode & 0o077) == (os.geteuid(), 0)
    assert cache_dir() == own and list(own.iterdir()) == []
    (line,) = warnings_in(capsys.readouterr().err)
    assert line.startswith(f"cudaenv: warning: {shared_cache} can be written by other users")
    assert paths.jit_store_dir() == own / "jit-store"


def test_a_refused_cache_warns_once_and_the_run_goes_on(
    shared_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cachefiles._warned.clear()
    memo = shared_cache / "memo.json"
    for _ in range(3):
        assert not cachefiles.write_json(memo, {"a": 1})
        assert cachefiles.read_json(memo) is None
    (line,) = warnings_in(capsys.readouterr().err)
    assert line == (
        f"cudaenv: warning: {shared_cache} can be written by other users (mode 0777): cudaenv "
        f"uses nothing in its cache that another user could have written (chmod go-w "
        f"{shared_cache}); going on without it"
    )
    assert not memo.exists()


def test_a_write_replaces_a_planted_link_and_never_writes_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's own")
    victim.chmod(0o600)
    memo = cache_dir() / "x" / "memo.txt"
    memo.parent.mkdir(parents=True)
    memo.symlink_to(victim)
    assert cachefiles.write_text(memo, "new")
    assert victim.read_text() == "root's own"
    assert not memo.is_symlink() and memo.read_text() == "new"


# --------------------------------------------------------------------------- the attacks


def test_a_planted_hook_memo_is_never_taken(
    attack: Planter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Attack 3: the start-up hook's rendered memo has one name for every env of the same
    values; appended to, it runs as root in every env built after."""
    values = {"name": "x", "spec": "s.yaml", "env": [], "archs": "12.0f"}
    monkeypatch.setenv("CUDAENV_CACHE_DIR", str(tmp_path / "own"))
    genuine = templates.render("pip_stub.py.j2", values)
    (name,) = [p.name for p in (tmp_path / "own" / "rendered").iterdir()]
    monkeypatch.setenv("CUDAENV_CACHE_DIR", str(attack.root))
    marker = tmp_path / "owned"
    attack.put(f"rendered/{name}", (genuine + f"\nopen({str(marker)!r}, 'w')\n").encode())
    for _ in range(2):
        assert templates.render("pip_stub.py.j2", values) == genuine
    assert len(warnings_in(capsys.readouterr().err)) == 1


def test_a_planted_interpreter_list_is_never_taken(attack: Planter, tmp_path: Path) -> None:
    """Attack 4: ``pythons.json`` points this Python's minor at the attacker's wrapper."""
    minor = "{}.{}".format(*sys.version_info[:2])
    marker = tmp_path / "owned"
    wrapper = attack.put(f"evil/python{minor}",
                         f"#!/bin/sh\ntouch {marker}\nexec {sys.executable} \"$@\"\n".encode(),
                         0o755)  # fmt: skip
    st = wrapper.stat()
    doc = {minor: {"path": str(wrapper), "version": f"{minor}.0", "found_by": "PATH",
                   "stat": [st.st_ino, st.st_size, st.st_mtime_ns]}}  # fmt: skip
    attack.put("pythons.json", json.dumps(doc).encode())
    found = interpreters.find(minor, allow_download=False)
    assert found.path != wrapper
    assert "cached" not in found.found_by


class FakeInstall:
    """The one subprocess seam, with ``uv pip install --target DIR`` answered by a genuine
    cuobjdump (a script listing one sm_90 cubin); other commands run for real."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.installs: list[Path] = []
        self.real = proc.run
        monkeypatch.setattr(proc, "run", self)
        monkeypatch.setattr(proc, "uv_bin", lambda: "uv")

    def __call__(self, argv: Sequence[object], **kwargs: object) -> proc.Completed:
        args = [str(a) for a in argv]
        if args[:3] == ["uv", "pip", "install"]:
            target = Path(args[args.index("--target") + 1])
            exe = target / "nvidia" / "cu13" / "bin" / "cuobjdump"
            exe.parent.mkdir(parents=True, exist_ok=True)
            exe.write_text("#!/bin/sh\necho 'ELF file    1: k.1.sm_90.cubin'\n")
            exe.chmod(0o755)
            self.installs.append(target)
            return proc.Completed(argv=tuple(args), returncode=0, stdout="", stderr="")
        return self.real(argv, **kwargs)  # type: ignore[arg-type]


EVIL_CUOBJDUMP = "#!/bin/sh\ntouch {marker}\necho 'ELF file    1: k.1.sm_120.cubin'\n"


def test_a_planted_cuobjdump_never_runs(
    shared_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack 5: a planted ``tools/cuobjdump`` ran as root in verify, and the cubin check
    passed on the sm_120 it made up."""
    marker = tmp_path / "owned"
    planted = plant(shared_cache / "tools" / "cuobjdump" / "nvidia" / "cu13" / "bin" / "cuobjdump",
                    EVIL_CUOBJDUMP.format(marker=marker).encode())  # fmt: skip
    fake = FakeInstall(monkeypatch)
    exe, _ = cubin.find_cuobjdump(env_facts(cuda_home=str(tmp_path / "no-toolkit")))
    assert exe is not None and exe != planted
    assert len(fake.installs) == 1
    assert cubin.list_elf(exe, tmp_path / "k") == ["sm_90"]
    assert not marker.exists()


def test_a_cached_cuobjdump_runs_only_while_its_hash_vouches_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeInstall(monkeypatch)
    facts = env_facts(cuda_home=str(tmp_path / "no-toolkit"))
    first, _ = cubin.find_cuobjdump(facts)
    again, _ = cubin.find_cuobjdump(facts)
    assert first == again and len(fake.installs) == 1  # installed once, then reused
    assert again is not None
    marker = tmp_path / "owned"
    again.write_text(EVIL_CUOBJDUMP.format(marker=marker))  # changed after it was recorded
    third, _ = cubin.find_cuobjdump(facts)
    assert len(fake.installs) == 2
    assert third is not None and cubin.list_elf(third, tmp_path / "k") == ["sm_90"]
    assert not marker.exists()
    assert "is not the file cudaenv installed" in capsys.readouterr().err


UV_OUTPUT = (
    'lock-version = "1.0"\ncreated-by = "uv"\nrequires-python = ">=3.10"\n\n'
    '[[packages]]\nname = "a"\nversion = "1"\n'
    'wheels = [{url = "https://files.invalid/a-1-py3-none-any.whl", '
    f'hashes = {{sha256 = "{"aa" * 32}"}}}}]\n'
).encode()


def forged_memo() -> bytes:
    forged = LockedPackage(name="a", version="1", wheels=(LockedFile(
        name="a-1-py3-none-any.whl", sha256="bb" * 32,
        url="https://attacker.invalid/a-1-py3-none-any.whl"),))  # fmt: skip
    return json.dumps(packages_to_json([forged])).encode()


def memo_name() -> str:
    return f"{hashlib.sha256(UV_OUTPUT).hexdigest()}.{resolve._MEMO}.json"


def test_a_planted_resolution_memo_puts_nothing_in_a_lock(attack: Planter) -> None:
    """Attack 6: a rewritten resolution memo put the attacker's URL and hash into the lock,
    which ``uv pip install -r`` installs."""
    attack.put(f"resolutions/{memo_name()}", forged_memo())
    (pkg,) = resolve._parsed(UV_OUTPUT)
    assert pkg.wheels[0].url == "https://files.invalid/a-1-py3-none-any.whl"
    assert pkg.wheels[0].sha256 == "aa" * 32


def test_a_resolution_memo_names_only_what_uvs_output_holds() -> None:
    """Even a memo of this user's own is taken only where every URL and hash it names is in
    the output it is the memo of."""
    memo = cache_dir() / "resolutions" / memo_name()
    memo.parent.mkdir(parents=True)
    memo.write_bytes(forged_memo())
    (pkg,) = resolve._parsed(UV_OUTPUT)
    assert pkg.wheels[0].url == "https://files.invalid/a-1-py3-none-any.whl"
    assert json.loads(memo.read_text())[0]["wheels"][0]["sha256"] == "aa" * 32  # rewritten
    assert resolve._parsed(UV_OUTPUT) == (pkg,)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-cache", "own-cache"])
def test_a_linked_audit_directory_gets_no_scans(
    shared: bool, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Attack 8: ``audit/`` linked to a root-only directory got ``scans.json`` written there."""
    cache = request.getfixturevalue("shared_cache") if shared else cache_dir()
    root_only = tmp_path / "root-only"
    root_only.mkdir(mode=0o700)
    if shared:
        plant_link(cache / "audit", root_only)
    else:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "audit").symlink_to(root_only)
    scans = audit.ScanCache.default()
    scans.entries["k"] = {"x": 1}
    scans.dirty = True
    scans.save()
    assert list(root_only.iterdir()) == []


@pytest.mark.e2e
def test_no_test_reads_or_writes_the_users_jit_store(session_jit_store: Path) -> None:
    """The tests that keep the user's cache (network, e2e: its resolutions save minutes) still
    use a JIT store of this session's own (conftest's session_jit_store): what a store holds
    changes what a build does (a marked module is prefetched), so a developer's or an earlier
    run's marks would make the suite pass or fail by the machine it runs on."""
    assert paths.jit_store_dir() == session_jit_store
    assert not session_jit_store.is_relative_to(cache_dir())
    assert os.environ["CUDAENV_JIT_STORE"] == str(session_jit_store)  # children inherit it


def test_no_test_names_a_uv_variable_uv_does_not_read() -> None:
    """uv 0.13 reads no UV_NO_INDEX: a test that set it to keep the real index out reached it
    (a fix's install took cuda-python 13.4.4 from the index, not the test's own 13.0.3). The
    tests keep it out with tests.helpers.links_only."""
    import re

    from tests.helpers import REPO

    named = re.compile("[\"']UV_NO_" + "INDEX[\"']")  # as a string a test sets
    said = [p.name for p in sorted((REPO / "tests").glob("*.py")) if named.search(p.read_text())]
    assert said == []
