"""Atomic swap, leftovers and the per-env lock, with real files and processes."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from builder.core import platforms, proc
from builder.core.errors import BuildError
from builder.env import build, installproof, place
from builder.machine import interpreters
from builder.spec import lock


def make_tree(path: Path, marker: str) -> Path:
    path.mkdir(parents=True)
    (path / "marker").write_text(marker)
    return path


def test_swap_into_empty_place(tmp_path: Path) -> None:
    new = make_tree(tmp_path / ".env.tmp-1", "new")
    assert place.swap_into_place(new, tmp_path / "env") is None
    assert (tmp_path / "env" / "marker").read_text() == "new"
    assert not new.exists()


def test_swap_replaces_and_returns_the_old_tree(tmp_path: Path) -> None:
    make_tree(tmp_path / "env", "old")
    new = make_tree(tmp_path / ".env.tmp-1", "new")
    old = place.swap_into_place(new, tmp_path / "env")
    assert (tmp_path / "env" / "marker").read_text() == "new"
    assert old is not None
    assert (old / "marker").read_text() == "old"


def test_leftovers_of_killed_builds_are_removed(tmp_path: Path) -> None:
    make_tree(tmp_path / "env", "current")
    make_tree(tmp_path / ".env.tmp-123-abc", "half")
    make_tree(tmp_path / ".env.old-77", "old")
    make_tree(tmp_path / ".other.tmp-1", "someone else's")
    removed = place.clean_leftovers(tmp_path / "env")
    assert sorted(p.name for p in removed) == [".env.old-77", ".env.tmp-123-abc"]
    assert (tmp_path / "env" / "marker").read_text() == "current"
    assert (tmp_path / ".other.tmp-1").exists()


def hold_lock(env: Path, seconds: float) -> subprocess.Popen[str]:
    """A real second process holding the env's build lock for ``seconds``."""
    holder = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from pathlib import Path
        from builder.env import place
        with place.env_lock(Path({str(env)!r}), print):
            print("held", flush=True)
            time.sleep({seconds})
        """
    )
    child = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


@pytest.mark.slow
def test_second_builder_waits_for_the_lock_and_says_why(tmp_path: Path) -> None:
    first = hold_lock(tmp_path / "env", 1.5)
    messages: list[str] = []
    started = time.monotonic()
    with place.env_lock(tmp_path / "env", messages.append):
        waited = time.monotonic() - started
    first.wait(timeout=10)
    assert waited > 0.5
    assert len(messages) == 1
    assert messages[0].startswith(f"waiting for cudaenv build pid {first.pid} to finish building")


def test_lock_of_a_killed_builder_is_taken_over(tmp_path: Path) -> None:
    first = hold_lock(tmp_path / "env", 60)
    first.kill()
    first.wait(timeout=10)
    messages: list[str] = []
    started = time.monotonic()
    with place.env_lock(tmp_path / "env", messages.append):
        pass
    assert time.monotonic() - started < 1.0
    assert messages == []


def test_python_discovery_finds_this_interpreter() -> None:
    minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
    found = interpreters.find(minor, allow_download=False)
    assert found.version.startswith(minor + ".")


def test_python_discovery_names_what_it_found() -> None:
    from builder.core.errors import ToolMissing

    with pytest.raises(ToolMissing) as info:
        interpreters.find("3.99", allow_download=False)
    message = str(info.value)
    assert message.startswith("no Python 3.99 on this machine (looked at: ")
    assert "uv python install 3.99" in message


# --------------------------------------------------------------------------- install from the cache


def fake_uv(tmp_path: Path, *, cached: bool) -> Path:
    """A stand-in uv that, like uv, fails with --offline when the files are not cached, and
    records each of its runs."""
    uv = tmp_path / "uv"
    uv.write_text(
        f"#!{sys.executable}\n"
        "import sys, pathlib\n"
        f"pathlib.Path({str(tmp_path / 'runs')!r}).open('a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"cached = {cached!r}\n"
        "if '--offline' in sys.argv and not cached:\n"
        "    sys.exit('error: cuda-toolkit was not found in the cache')\n"
        "sys.stderr.write(' + cuda-toolkit==13.0.3.0\\n')\n"
    )
    uv.chmod(0o755)
    return uv


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "not-cached"])
def test_a_warm_install_asks_no_index_and_a_cold_one_goes_online(
    tmp_path: Path, cached: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    uv = fake_uv(tmp_path, cached=cached)
    req = tmp_path / "req.txt"
    argv = [str(uv), "pip", "sync", "--require-hashes"]
    took_cache = build._sync_from_cache(argv, req)
    assert took_cache is cached
    runs = (tmp_path / "runs").read_text().splitlines()
    assert runs == [f"pip sync --require-hashes --offline {req}"]
    # A cached install shows uv's own lines, as the online run would have; a failed attempt
    # shows nothing (the online run that follows says what there is to say).
    assert (" + cuda-toolkit" in capsys.readouterr().err) is cached


def test_an_install_that_is_offline_or_from_a_wheelhouse_is_left_as_asked(tmp_path: Path) -> None:
    uv = fake_uv(tmp_path, cached=True)
    for extra in (["--offline"], ["--no-index", "--find-links", "/w"]):
        assert not build._sync_from_cache([str(uv), "pip", "sync", *extra], tmp_path / "r.txt")
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- proof of install


def installed_dist(site: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A distribution as an installer leaves it: its files, a dist-info, a RECORD with the
    sha256 (urlsafe base64, no padding) and size of each."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    files = {**files, f"{info.name}/METADATA": f"Name: {name}\nVersion: {version}\n".encode()}
    rows = []
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{rel},sha256={digest},{len(data)}")
    (info / "RECORD").write_text("\n".join([*rows, f"{info.name}/RECORD,,"]) + "\n")
    return info


def a_site(tmp_path: Path) -> Path:
    site = tmp_path / "env" / "lib" / "python3.12" / "site-packages"
    installed_dist(
        site,
        "nvidia-cuda-nvcc",
        "13.0.88",
        {"nvidia/cu13/bin/nvcc": b"nvcc" * 100, "nvidia/cu13/bin/ptxas": b"ptxas"},
    )
    installed_dist(site, "cuda-toolkit", "13.0.3.0", {})
    return site  # fmt: skip


LOCKED = (
    lock.LockedPackage(name="nvidia-cuda-nvcc", version="13.0.88"),
    lock.LockedPackage(name="cuda-toolkit", version="13.0.3"),  # 13.0.3 == 13.0.3.0
)


def test_a_complete_install_has_no_problems(tmp_path: Path) -> None:
    site = a_site(tmp_path)
    assert installproof.problems(site, tmp_path / "env", LOCKED) == []
    assert installproof.problems(site, tmp_path / "env", LOCKED, hash_linked=True) == []


def test_what_a_full_disk_leaves_is_named(tmp_path: Path) -> None:
    site = a_site(tmp_path)
    bin_dir = site / "nvidia" / "cu13" / "bin"
    (bin_dir / "ptxas").unlink()
    (bin_dir / "nvcc").write_bytes(b"nvcc")  # cut short
    (site / "cuda_toolkit-13.0.3.0.dist-info" / "RECORD").unlink()
    locked = (*LOCKED, lock.LockedPackage(name="nvidia-nvvm", version="13.0.88"))
    assert installproof.problems(site, tmp_path / "env", locked) == [
        "nvidia-nvvm 13.0.88: not installed (no .dist-info)",
        "cuda_toolkit-13.0.3.0.dist-info/RECORD: No such file or directory",
        "nvidia_cuda_nvcc-13.0.88.dist-info: nvidia/cu13/bin/ptxas: missing",
        # A file that differs from its RECORD is said after the rest (its wheel is asked).
        "nvidia_cuda_nvcc-13.0.88.dist-info: nvidia/cu13/bin/nvcc: 4 bytes, RECORD says 400",
    ]


def test_another_version_or_a_path_outside_the_env_is_a_problem(tmp_path: Path) -> None:
    site = a_site(tmp_path)
    record = site / "nvidia_cuda_nvcc-13.0.88.dist-info" / "RECORD"
    record.write_text(record.read_text() + "../../../../outside,,\n")
    locked = (lock.LockedPackage(name="nvidia-cuda-nvcc", version="13.0.96"),)
    assert installproof.problems(site, tmp_path / "env", locked) == [
        "nvidia-cuda-nvcc: 13.0.88 installed, the lock says 13.0.96",
        "nvidia_cuda_nvcc-13.0.88.dist-info: ../../../../outside: outside the env",
    ]


def test_a_copied_file_is_hashed_a_hard_linked_one_only_when_asked(tmp_path: Path) -> None:
    """Same size, other bytes: a copy (one link) is caught by its hash; a file hard-linked
    from uv's cache is taken as the cache's (its size is still checked) unless hash_linked."""
    site = a_site(tmp_path)
    ptxas = site / "nvidia" / "cu13" / "bin" / "ptxas"
    ptxas.write_bytes(b"PTXAS")
    wrong = (
        "nvidia_cuda_nvcc-13.0.88.dist-info: nvidia/cu13/bin/ptxas: sha256 differs from RECORD's"
    )
    assert installproof.problems(site, tmp_path / "env", LOCKED) == [wrong]
    os.link(ptxas, tmp_path / "cache-copy")  # now two links, as uv's hard-link install makes
    assert installproof.problems(site, tmp_path / "env", LOCKED) == []
    assert installproof.problems(site, tmp_path / "env", LOCKED, hash_linked=True) == [wrong]


def test_many_bytes_are_hashed_by_a_pool_with_the_same_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(installproof, "_POOL_BYTES", 1)
    site = a_site(tmp_path)
    assert installproof.problems(site, tmp_path / "env", LOCKED) == []
    (site / "nvidia" / "cu13" / "bin" / "nvcc").write_bytes(b"x" * 400)
    assert installproof.problems(site, tmp_path / "env", LOCKED) == [
        "nvidia_cuda_nvcc-13.0.88.dist-info: nvidia/cu13/bin/nvcc: sha256 differs from RECORD's"
    ]


# --------------------------------------------------------------------------- a full disk


@pytest.mark.parametrize(
    ("output", "quota"),
    [
        ("  cause: failed to copy file from a to b: No space left on device (os error 28)", False),
        ("error: Failed to write: Disk quota exceeded (os error 122)", True),
    ],
)
def test_an_offline_install_that_met_a_full_disk_is_not_a_cache_miss(
    tmp_path: Path, output: str, quota: bool
) -> None:
    uv = write_uv(tmp_path, f"import sys\nsys.stderr.write({output!r})\nsys.exit(2)\n")
    with pytest.raises(proc.CommandFailed) as info:
        build._sync_from_cache([str(uv), "pip", "sync"], tmp_path / "req.txt")
    assert place.out_of_space(info.value.output)
    assert place.over_quota(info.value.output) is quota


def write_uv(tmp_path: Path, body: str) -> Path:
    uv = tmp_path / "uv"
    uv.write_text(f"#!{sys.executable}\n{body}")
    uv.chmod(0o755)
    return uv


def test_a_package_whose_marker_does_not_hold_is_not_required() -> None:
    here = {
        **platforms.get("linux-x86_64").marker_environment("3.12"),
        "python_full_version": "3.12.1",
    }
    only_old = lock.LockedPackage(name="x", version="1", marker="python_full_version < '3.12'")
    unreadable = lock.LockedPackage(name="y", version="1", marker="nonsense ==")
    plain = lock.LockedPackage(name="z", version="1")
    assert not installproof.applies(only_old, here)
    assert installproof.applies(unreadable, here)  # required: uv's reading is not guessed
    assert installproof.applies(plain, here)


def test_a_full_disk_is_said_with_uvs_line_naming_the_file(tmp_path: Path) -> None:
    tmp = tmp_path / ".env.tmp-1"
    tmp.mkdir()
    said = "Resolved 6 packages\n  cause: failed to copy file from /c/a to /e/b: Disk quota exceeded (os error 122)\n"
    message = place.no_space(tmp, tmp_path / "env", said=said)
    assert message.startswith(
        f"the disk quota was exceeded while building in {tmp_path} (the build had "
    )
    assert message.endswith(
        " MiB; uv: cause: failed to copy file from /c/a to /e/b: Disk quota exceeded (os error "
        "122)); free space there or pass --env-dir on a larger filesystem. Nothing was replaced: "
        "the previous env, if any, is intact"
    )


def test_a_path_two_wheels_ship_is_as_one_of_them_records(tmp_path: Path) -> None:
    """flashinfer-python 0.7.2 and torch-c-dlpack-ext 0.1.5 both install a top-level
    build_backend.py (48458 and 3802 bytes): the installer's last write stays, and the env is
    complete. A file that is neither's is still found."""
    site = tmp_path / "env" / "lib" / "python3.12" / "site-packages"
    installed_dist(site, "flashinfer-python", "0.7.2", {"build_backend.py": b"f" * 48458})
    installed_dist(site, "torch-c-dlpack-ext", "0.1.5", {"build_backend.py": b"t" * 3802})
    env = tmp_path / "env"
    assert (site / "build_backend.py").stat().st_size == 3802  # the second one's
    assert installproof.problems(site, env) == []
    (site / "build_backend.py").write_bytes(b"t" * 3801 + b"x")  # same size, other bytes
    assert installproof.problems(site, env) == [
        "build_backend.py: 3802 bytes, as none of the RECORDs that name it say "
        "(flashinfer_python-0.7.2.dist-info, torch_c_dlpack_ext-0.1.5.dist-info)"
    ]
    (site / "build_backend.py").unlink()
    assert installproof.problems(site, env) == [
        "flashinfer_python-0.7.2.dist-info: build_backend.py: missing"
    ]


def test_a_file_its_own_wheel_contradicts_the_record_of_is_an_erratum_by_hash(
    tmp_path: Path,
) -> None:
    """pynvvideocodec 2.0.4's RECORD gives two of its .so files 36191 bytes less than the
    wheel holds: such a file passes only as a known erratum, by the size and sha256 the wheel
    really ships; a file cut short is still found, and so is one of the erratum's size with
    other bytes."""
    site = tmp_path / "env" / "lib" / "python3.12" / "site-packages"
    info = installed_dist(site, "pynvvideocodec", "2.0.4", {"PyNvVideoCodec/c.so": b"s" * 100})
    recorded = base64.urlsafe_b64encode(hashlib.sha256(b"s" * 100).digest()).rstrip(b"=")
    real = b"s" * 120  # what the wheel really holds
    real_digest = base64.urlsafe_b64encode(hashlib.sha256(real).digest()).rstrip(b"=").decode()
    so = site / "PyNvVideoCodec" / "c.so"
    so.write_bytes(real)
    env = tmp_path / "env"
    wrong = f"{info.name}: PyNvVideoCodec/c.so: 120 bytes, RECORD says 100"
    assert installproof.problems(site, env) == [wrong]
    errata = {(info.name, "PyNvVideoCodec/c.so", recorded.decode()): (120, real_digest)}
    assert installproof.problems(site, env, errata=errata) == []
    so.write_bytes(b"t" * 120)  # the erratum's size, other bytes
    assert installproof.problems(site, env, errata=errata) == [wrong]
    so.write_bytes(real[:50])  # a copy cut short
    assert installproof.problems(site, env, errata=errata) == [
        f"{info.name}: PyNvVideoCodec/c.so: 50 bytes, RECORD says 100"
    ]


def test_the_shipped_errata_are_pynvvideocodecs_measured_files() -> None:
    """Each erratum names a file of a wheel and the size and sha256 it really ships."""
    assert len(installproof.RECORD_ERRATA) == 6
    for (dist, rel, recorded), (size, real) in installproof.RECORD_ERRATA.items():
        assert dist == "pynvvideocodec-2.0.4.dist-info"
        assert rel.startswith("PyNvVideoCodec/PyNvVideoCodec_1")
        assert len(recorded) == len(real) == 43
        assert recorded != real
        assert size > 2_000_000


def test_a_file_cut_short_in_uvs_cache_never_vouches_for_itself(tmp_path: Path) -> None:
    """libcudart.so.13 truncated in uv's cache, hard-linked into the env: the env's file and
    the cache's are one inode, so the proof compares with RECORD and names the cache."""
    site = a_site(tmp_path)
    nvcc = site / "nvidia" / "cu13" / "bin" / "nvcc"
    cache = tmp_path / "uv-cache" / "archive-v0" / "AbC123" / "nvidia" / "cu13" / "bin"
    cache.mkdir(parents=True)
    with nvcc.open("r+b") as fh:
        fh.truncate(40)
    os.link(nvcc, cache / "nvcc")
    assert installproof.problems(site, tmp_path / "env", LOCKED) == [
        "nvidia_cuda_nvcc-13.0.88.dist-info: nvidia/cu13/bin/nvcc: 40 bytes, RECORD says 400; "
        "uv's cache holds this copy (`uv cache clean nvidia_cuda_nvcc`, then build again)"
    ]


def test_an_entry_of_site_packages_no_record_lists_is_refused(tmp_path: Path) -> None:
    """A .pth planted in a cached package tree runs at every interpreter start: an entry of
    site-packages no RECORD names is a problem, unless it was there before the install."""
    site = a_site(tmp_path)
    (site / "zz-evil.pth").write_text("import os; os.system('id')\n")
    (site / "_virtualenv.pth").write_text("import _virtualenv\n")
    (site / "stray").mkdir()
    made = ["_virtualenv.pth"]
    assert installproof.problems(site, tmp_path / "env", LOCKED, made_before=made) == [
        "stray: in site-packages, but no installed distribution's RECORD lists it",
        "zz-evil.pth: in site-packages, but no installed distribution's RECORD lists it "
        "(a .pth file runs at every interpreter start)",
    ]


def test_the_lock_proven_beside_an_install_counts_only_the_entries_named_as_arriving(
    tmp_path: Path,
) -> None:
    """A wheel from the store installs while the lock is proven (sourcebuild.py): its new
    entries of site-packages are not the lock's proof's to judge (its .dist-info may have no
    RECORD yet); any other stray entry still is a problem. Its own proof then reads its
    RECORD alone, where nothing ran in the env since; every RECORD where a compile ran."""
    site = a_site(tmp_path)
    (site / "b").mkdir()
    (site / "b-1.dist-info").mkdir()  # uv is still writing it
    said: list[str] = []

    def proof() -> installproof.Proof:
        return installproof.Proof(site, tmp_path / "env", "t", {}, [], LOCKED,
                                  lambda name, _t: said.append(name))  # fmt: skip

    with pytest.raises(BuildError, match=r"b: in site-packages, but no installed"):
        proof().beside_install(["b-1.dist-info"])
    beside = proof()
    beside.beside_install(["b", "b-1.dist-info"])
    assert said == ["every file of 2 packages' RECORD in place"]
    assert "b" not in beside.made_before and "nvidia" in beside.made_before
    installed_dist(site, "b", "1", {"b/__init__.py": b""})  # the install done
    (site / "nvidia" / "cu13" / "bin" / "ptxas").write_bytes(b"ptxa")  # after the lock's proof
    b = [lock.LockedPackage(name="b", version="1")]
    taken = [("b", "b-1.dist-info")]
    beside.rest(b, taken)  # b's RECORD alone: what the lock's proof saw is not read again
    with pytest.raises(BuildError, match=r"ptxas: 4 bytes, RECORD says 5"):
        beside.rest(b, [()])  # a compile ran in the env: every RECORD again
    (site / "stray.pth").write_text("")
    with pytest.raises(BuildError, match=r"stray.pth: in site-packages, but no installed"):
        beside.rest(b, taken)
