"""The JIT store treats what lies in it as untrusted input: each case a red team tried (an
entry planted by another user, a tampered or truncated output, a forged entry, a symlink, a
path that leaves the entry, an endless input, a hostile lock, a swapped file in a wheelhouse,
a read-only or full disk) is refused or repaired, and a verify never fails because of it.

Real files, real processes, real mounts; the compiler is the stand-in nvcc of
test_kernel_compile and the toy ninja build of test_jit_store. The "other user" is uid 65534
(nobody): these tests run as root, as cudaenv often does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder import store as jit_store
from builder.core.errors import BuildError
from builder.core.paths import jit_store_dir
from builder.core.statuses import PASSED
from builder.env import export
from builder.machine import archs
from builder.verify import kernel_compile
from tests.helpers import write
from tests.test_jit_store import (
    FAKECC,
    LINK,
    build_and_publish,
    make_env,
    ninja,
)
from tests.test_kernel_compile import env_with, facts, make_toolkit, target

ARCH = archs.Arch.parse("12.0f")
NOBODY = 65534


def store() -> jit_store.Store:
    root = jit_store_dir()
    assert root is not None
    return jit_store.Store(root)


def build(tmp_path: Path, name: str, env: dict[str, str]) -> kernel_compile.KernelBuild:
    """Env ``name`` (its own toolkit and work dir) builds the kernel through the store."""
    home = tmp_path / name / "cuda-home"
    if not home.exists():
        make_toolkit(home)
    return kernel_compile.build_kernel(
        home / "bin" / "nvcc", ARCH, tmp_path / name / "work", env=env, owner=name
    )


def compiled(tmp_path: Path, name: str) -> bool:
    """Whether env ``name``'s nvcc ran (it compiled rather than reused)."""
    return (tmp_path / name / "cuda-home" / "bin" / "calls").exists()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return env_with(tmp_path, "gcc 12.2.0")


@pytest.fixture
def published(tmp_path: Path, env: dict[str, str]) -> jit_store.Entry:
    """Env A compiled the kernel and published it: the one entry of the store."""
    first = build(tmp_path, "envA", env)
    assert first.error is None and not first.reused
    (key, variant), *rest = store().all()
    assert not rest
    return store().load(key, variant)


def rewrite_doc(entry: jit_store.Entry, **changes: object) -> None:
    doc = json.loads((entry.path / "entry.json").read_text())
    doc.update(changes)
    (entry.path / "entry.json").write_text(json.dumps(doc))


def test_an_entry_is_recorded_with_the_size_and_sha256_of_each_file(
    published: jit_store.Entry,
) -> None:
    kernel = published.path / "files" / "kernel"
    record = published.files["kernel"]
    assert record.size == kernel.stat().st_size
    assert record.sha256 == jit_store.sha256_file(kernel, trusted=True)[1]
    assert published.inputs  # at least the CUB header the depfile named


def test_the_second_env_reuses_a_sound_entry(
    tmp_path: Path, env: dict[str, str], published: jit_store.Entry
) -> None:
    second = build(tmp_path, "envB", env)
    assert second.reused and second.stored is not None and not second.notes
    assert not compiled(tmp_path, "envB")


# --------------------------------------------------------------------------- who wrote it


def test_a_store_other_users_can_write_is_not_read(
    tmp_path: Path, env: dict[str, str], published: jit_store.Entry
) -> None:
    """A mode-1777 store: anyone could have planted an entry. Compiled without it, one
    warning naming the path and the chmod that fixes it, and the check still passes."""
    root = store().root
    root.chmod(0o1777)
    second = build(tmp_path, "envB", env)
    assert second.error is None and not second.reused and compiled(tmp_path, "envB")
    assert second.notes == (
        f"the JIT store was not used: {root} can be written by other users (mode 1777): the "
        f"JIT store reads nothing another user could have written (chmod go-w {root})",
    )
    result = kernel_compile.check(
        target(tmp_path, archs=(ARCH,), work=tmp_path / "envC" / "work"),
        facts(make_toolkit(tmp_path / "envC" / "cuda-home"), env),
    )
    assert result.status == PASSED
    assert result.warnings and "chmod go-w" in result.warnings[0]


def test_an_entry_planted_by_another_user_is_never_placed(
    tmp_path: Path, env: dict[str, str], published: jit_store.Entry
) -> None:
    """uid 65534 replaced the kernel with its own payload and fixed the record to match:
    the ownership check alone stands between it and root's env."""
    payload = b"\x7fELF payload"
    kernel = published.path / "files" / "kernel"
    kernel.write_bytes(payload)
    digest = jit_store.sha256_file(kernel, trusted=False)[1]
    rewrite_doc(published, files={"kernel": {"size": len(payload), "sha256": digest}})
    for path in (published.path, published.path / "files", kernel, published.path / "entry.json"):
        os.chown(path, NOBODY, NOBODY)
    second = build(tmp_path, "envB", env)
    assert not second.reused and compiled(tmp_path, "envB")
    assert second.path.read_bytes() != payload
    assert any(f"belongs to uid {NOBODY}" in n and "chown" in n for n in second.notes)


def test_a_memo_of_hashes_another_user_wrote_is_ignored(tmp_path: Path) -> None:
    root = tmp_path / "store"
    header = write(tmp_path / "cub.cuh", "CUB 13.0")
    st = header.stat()
    ident = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns - 10 * 10**9))
    st = header.stat()
    ident = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    write(root / "identities.json", json.dumps({ident: "0" * 64}))
    assert jit_store.Store(root).hasher.sha256(header) == "0" * 64  # the memo is read...
    os.chown(root / "identities.json", NOBODY, NOBODY)
    real = jit_store.sha256_file(header, trusted=False)[1]
    assert jit_store.Store(root).hasher.sha256(header) == real  # ...unless another user's


# --------------------------------------------------------------------------- what it holds


@pytest.mark.parametrize(
    "damage",
    ["appended", "same size", "truncated to 0 B", "deleted", "entry.json truncated", "no inputs"],
)
def test_a_damaged_entry_is_discarded_rebuilt_and_replaced(
    tmp_path: Path, env: dict[str, str], published: jit_store.Entry, damage: str
) -> None:
    kernel = published.path / "files" / "kernel"
    if damage == "appended":
        with kernel.open("ab") as fh:
            fh.write(b"payload")
    elif damage == "same size":
        kernel.write_bytes(b"X" * kernel.stat().st_size)
    elif damage == "truncated to 0 B":
        kernel.write_bytes(b"")
    elif damage == "deleted":
        kernel.unlink()
    elif damage == "entry.json truncated":
        doc = (published.path / "entry.json").read_bytes()
        (published.path / "entry.json").write_bytes(doc[: len(doc) // 2])
    else:
        rewrite_doc(published, inputs={})
    second = build(tmp_path, "envB", env)
    assert second.error is None and not second.reused and compiled(tmp_path, "envB")
    assert any(n.startswith("discarded the store entry v3/") for n in second.notes), second.notes
    # Published again, sound: a third env reuses it.
    third = build(tmp_path, "envC", env)
    assert third.reused and not compiled(tmp_path, "envC"), third.notes


def test_a_link_in_an_entry_is_never_followed(
    tmp_path: Path, env: dict[str, str], published: jit_store.Entry
) -> None:
    secret = write(tmp_path / "shadow", "root:$6$secret")
    kernel = published.path / "files" / "kernel"
    kernel.unlink()
    kernel.symlink_to(secret)
    second = build(tmp_path, "envB", env)
    assert not second.reused and second.path.read_bytes() != secret.read_bytes()
    assert any("symbolic link" in n for n in second.notes)
    assert not second.path.is_symlink()


def test_no_file_name_leaves_its_entry(tmp_path: Path) -> None:
    """A ninja entry whose stored file is named ../../etc/shadow: refused as malformed."""
    tools = tmp_path / "tools"
    write(tools / "fakecc.py", FAKECC)
    write(tools / "link.py", LINK)
    host = f"{tmp_path}/none:/usr/bin:/bin"
    s = jit_store.Store(tmp_path / "store")
    key = build_and_publish(s, tmp_path / "envA", tools, host)
    (_, variant), *_ = s.all()
    secret = write(tmp_path / "etc" / "shadow", "secret")
    doc = json.loads((variant / "entry.json").read_text())
    name = next(iter(doc["file_of"]))
    doc["file_of"][name] = "../" * 20 + str(secret).lstrip("/")
    (variant / "entry.json").write_text(json.dumps(doc))
    build_dir = make_env(tmp_path / "envB", tools)
    assert jit_store.place_ninja(s, key, build_dir, str(tmp_path / "envB"), ninja()) is None
    assert not variant.exists() and any("file_of" in n for n in s.notes)
    assert not list(build_dir.glob("*.so"))
    with pytest.raises(jit_store.EntryError, match="not a file name inside the entry"):
        jit_store.parse_entry(
            {"kind": "topk_topp", "inputs": {"/x": "a" * 64}, "files": {"../k": {}}}
        )


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "huge"])
def test_an_input_that_is_not_a_regular_file_under_the_cap_never_stalls_a_build(
    tmp_path: Path, kind: str
) -> None:
    s = jit_store.Store(tmp_path / "store")
    out = write(tmp_path / "kernel", "cubin")
    if kind == "/dev/zero":
        source = "/dev/zero"
    elif kind == "fifo":
        source = str(tmp_path / "pipe")
        os.mkfifo(source)
    else:
        source = str(tmp_path / "huge.h")
        with Path(source).open("wb") as fh:
            fh.truncate(jit_store.MAX_INPUT + 1)  # sparse: no disk used
    key = "ab" * 32
    meta = {"kind": "topk_topp"}
    started = time.monotonic()
    assert s.publish(key, {"kernel": out}, [source], meta, str(tmp_path)) is None
    # A forged entry that records it: never matches, never blocks.
    inputs = {source: "0" * 64}
    forged = s.entries(key) / jit_store.variant_of(inputs)
    write(forged / "files" / "kernel", "cubin")
    digest = jit_store.sha256_file(forged / "files" / "kernel", trusted=True)[1]
    doc = {
        "kind": "topk_topp",
        "inputs": inputs,
        "files": {"kernel": {"size": 5, "sha256": digest}},
    }
    write(forged / "entry.json", json.dumps(doc))
    assert s.find(key, str(tmp_path)) is None
    assert time.monotonic() - started < 5


# --------------------------------------------------------------------------- locks


def test_a_lock_that_is_a_link_is_refused_and_nothing_is_created(
    tmp_path: Path, env: dict[str, str], published: jit_store.Entry
) -> None:
    lock = store().root / "locks" / f"{published.key}.lock"
    lock.unlink()
    target_file = tmp_path / "created-by-root"
    lock.symlink_to(target_file)
    second = build(tmp_path, "envB", env)
    assert second.error is None and compiled(tmp_path, "envB")
    assert not target_file.exists()
    assert second.notes and "is a symbolic link" in second.notes[0]


@pytest.fixture
def holder(published: jit_store.Entry) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the key's lock (as a stuck builder would)."""
    lock = store().root / "locks" / f"{published.key}.lock"
    code = (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.ftruncate(fd, 0); os.pwrite(fd, f'{os.getpid()}\\n'.encode(), 0)\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait(timeout=10)


@pytest.mark.slow
def test_a_lock_held_too_long_names_its_holder_and_the_build_goes_on(
    tmp_path: Path,
    env: dict[str, str],
    holder: subprocess.Popen[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDAENV_JIT_LOCK_TIMEOUT", "0.5")
    started = time.monotonic()
    second = build(tmp_path, "envB", env)
    assert time.monotonic() - started < 10
    assert second.error is None and compiled(tmp_path, "envB")
    assert second.notes and f"(held by pid {holder.pid})" in second.notes[0]


# --------------------------------------------------------------------------- a wheelhouse


def exported(tmp_path: Path, env: dict[str, str]) -> Path:
    """A wheelhouse carrying the entry env A used (export --with-jit)."""
    first = build(tmp_path, "envA", env)
    assert first.error is None
    env_dir = tmp_path / "envA"
    write(env_dir / "cudaenv.json", "{}")
    s = store()
    ((_, variant),) = s.all()
    jit_store.note_use(s, variant, str(env_dir))
    wheelhouse = tmp_path / "wheels"
    write(wheelhouse / export.MANIFEST, "{}")
    assert export.export_jit(env_dir, wheelhouse) == 1
    return wheelhouse


def test_the_export_manifest_records_every_carried_file(
    tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    wheelhouse = exported(tmp_path, env)
    carried = json.loads((wheelhouse / export.MANIFEST).read_text())["jit"]
    files = sorted(
        str(p.relative_to(wheelhouse / export.JIT_DIR))
        for p in (wheelhouse / export.JIT_DIR).rglob("*")
        if p.is_file()
    )
    assert sorted(carried) == files
    for rel, digest in carried.items():
        assert jit_store.sha256_file(wheelhouse / export.JIT_DIR / rel, trusted=False)[1] == digest
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "there"))
    assert export.import_jit(wheelhouse) == (1, None)


@pytest.mark.parametrize("swap", ["kernel", "kernel and the manifest", "no hashes"])
def test_a_carried_file_swapped_after_export_is_refused(
    tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, swap: str
) -> None:
    wheelhouse = exported(tmp_path, env)
    (kernel,) = (wheelhouse / export.JIT_DIR).glob("v3/*/*/*/files/kernel")
    kernel.write_bytes(b"\x7fELF tampered")
    manifest = json.loads((wheelhouse / export.MANIFEST).read_text())
    if swap == "kernel and the manifest":
        rel = str(kernel.relative_to(wheelhouse / export.JIT_DIR))
        manifest["jit"][rel] = jit_store.sha256_file(kernel, trusted=False)[1]
    if swap == "no hashes":
        del manifest["jit"]
    (wheelhouse / export.MANIFEST).write_text(json.dumps(manifest))
    there = tmp_path / "there"
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(there))
    message = {
        "kernel": "not as exported",
        # The manifest agrees, the entry's own record does not: the store refuses it.
        "kernel and the manifest": "not a JIT result the store accepts",
        "no hashes": "records no sha256",
    }[swap]
    with pytest.raises(BuildError, match=message):
        export.import_jit(wheelhouse)
    assert not list(there.glob("v3/*/*/*/files/kernel"))


# --------------------------------------------------------------------------- the disk


@pytest.fixture
def small_mount(tmp_path: Path) -> Iterator[Path]:
    """A 3 MB tmpfs (a real filesystem that fills up and can be made read-only)."""
    point = tmp_path / "mnt"
    point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m,mode=0755", "tmpfs", str(point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.mark.parametrize("trouble", ["read-only", "full"])
def test_a_store_that_cannot_be_written_costs_a_compile_never_the_check(
    tmp_path: Path,
    env: dict[str, str],
    small_mount: Path,
    monkeypatch: pytest.MonkeyPatch,
    trouble: str,
) -> None:
    root = small_mount / "store"
    root.mkdir()
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(root))
    if trouble == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    else:
        with (small_mount / "filler").open("wb") as fh, pytest.raises(OSError):
            while True:
                fh.write(b"\0" * (1 << 16))
                fh.flush()
    result = kernel_compile.check(
        target(tmp_path, archs=(ARCH,), work=tmp_path / "envB" / "work"),
        facts(make_toolkit(tmp_path / "envB" / "cuda-home"), env),
    )
    assert result.status == PASSED, result.summary
    assert len(result.warnings) == 1
    why = "Read-only file system" if trouble == "read-only" else "No space left on device"
    assert why in result.warnings[0]


# --------------------------------------------------------------------------- size


def test_the_cap_evicts_the_least_recently_used(tmp_path: Path) -> None:
    s = jit_store.Store(tmp_path / "store")
    header = write(tmp_path / "cub.cuh", "CUB")
    made = []
    for i in range(3):
        out = write(tmp_path / f"k{i}", "x" * 1000)
        key = format(i, "x") * 64
        path = s.publish(key, {"kernel": out}, [str(header)], {"kind": "topk_topp"}, "/")
        assert path is not None
        os.utime(path, (1000 + i, 1000 + i))
        made.append((key, path))
    assert s.find(made[0][0], "/") is not None  # the oldest used now: the newest
    removed = s.evict(cap=2 * s.size_of(made[0][1]) + 10)
    assert removed == [made[1][1]]
    assert jit_store.parse_size("10G") == 10 << 30
    assert jit_store.parse_size("500M") == 500 << 20
    assert jit_store.parse_size("1048576") == 1 << 20
    with pytest.raises(ValueError, match="not a size"):
        jit_store.parse_size("lots")


def test_store_commands_list_verify_gc(tmp_path: Path, env: dict[str, str]) -> None:
    from builder.cli import main as cli

    first = build(tmp_path, "envA", env)
    assert first.error is None
    (key, variant), *_ = store().all()
    (store().root / "v2" / "ab").mkdir(parents=True)  # an older format
    done = subprocess.run(
        [sys.executable, "-m", "builder.cli", "store", "list", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    listed = json.loads(done.stdout)
    assert [e["key"] for e in listed["entries"]] == [key]
    assert listed["entries"][0]["made_for"] == "envA"
    assert cli.main(["store", "verify"]) == 0
    with (variant / "files" / "kernel").open("ab") as fh:
        fh.write(b"x")
    assert cli.main(["store", "verify"]) == 5
    assert not variant.exists()
    assert cli.main(["store", "gc", "--max", "0"]) == 0
    assert not (store().root / "v2").exists()
    assert cli.main(["store", "gc", "--max", "lots"]) == 2


@pytest.mark.slow
def test_a_file_checked_once_is_copied_unread_until_it_changes(
    tmp_path: Path, env: dict[str, str], published: jit_store.Entry
) -> None:
    """Placing remembers a stored file's checked hash by inode, size, mtime and ctime (set
    only by writing it): a second placing copies it in the kernel, and any change to the file
    (even to the same size, its mtime put back) is hashed again and refused."""
    kernel = published.path / "files" / "kernel"
    time.sleep(2.1)  # older than the "too new" window
    s = store()
    entry = s.load(published.key, published.path)
    s.place(entry, "kernel", tmp_path / "one")
    ident = jit_store.stored_identity(kernel.stat())
    assert ident is not None and s.hasher.memo[ident] == published.files["kernel"].sha256
    s.place(entry, "kernel", tmp_path / "two")
    assert (tmp_path / "two").read_bytes() == kernel.read_bytes()
    st = kernel.stat()
    kernel.write_bytes(b"Y" * st.st_size)
    os.utime(kernel, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back; ctime moves
    with pytest.raises(jit_store.EntryError, match="differs from its record"):
        s.place(entry, "kernel", tmp_path / "three")


def test_gc_and_verify_on_a_read_only_store_claim_no_removal(
    tmp_path: Path,
    env: dict[str, str],
    small_mount: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """They said "discarded" and "removed 2 item(s)" of a store where nothing could go."""
    from builder.cli import main as cli

    root = small_mount / "store"
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(root))
    assert build(tmp_path, "envA", env).error is None
    ((_, variant),) = store().all()
    (root / "v2" / "ab").mkdir(parents=True)  # an older format: gc removes it
    with (variant / "files" / "kernel").open("ab") as fh:
        fh.write(b"x")  # damaged: verify removes it
    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    capsys.readouterr()
    assert cli.main(["store", "gc", "--max", "0"]) == 0
    out = capsys.readouterr().err
    assert "removed 0 item(s), 0 B freed" in out
    assert f"warning: could not remove {root / 'v2'} (Read-only file system)" in out
    assert f"warning: could not remove {variant} (Read-only file system)" in out
    assert cli.main(["store", "verify"]) == 5
    captured = capsys.readouterr()
    assert "discarded" not in captured.out
    assert "could not be removed (Read-only file system); it is not used" in captured.out
    assert "1 could not be removed" in captured.err
    assert variant.exists() and (root / "v2").exists()


def test_the_names_flashinfer_writes_are_kept_and_placed(tmp_path: Path) -> None:
    """FlashInfer's batch prefill for head dim 128, bf16 writes an object named with 212
    characters; the store kept nothing of it at a cap of 200 (warm said "0 failed"). Every
    name the file system allows (NAME_MAX, 255 bytes) is kept and placed; a longer one, which
    no build could have written, is refused."""
    s = jit_store.Store(tmp_path / "store")
    header = write(tmp_path / "cub.cuh", "CUB 13.0")
    prefill = "0-batch_prefill_with_kv_cache_" + "x" * 168 + "_mask_0.cuda.o"
    assert len(prefill) == 212
    longest = "y" * (jit_store.MAX_NAME_BYTES - 2) + ".o"
    files = {
        "kernel": write(tmp_path / "k.bin", "K"),
        prefill: write(tmp_path / "a.o", "A"),
        longest: write(tmp_path / "b.o", "B"),
    }
    entry_dir = s.publish("ab" * 32, files, [str(header)], {"kind": "topk_topp"}, "env")
    assert entry_dir is not None
    entry = s.find("ab" * 32, "env")
    assert entry is not None, s.notes
    assert set(entry.files) == {"kernel", prefill, longest}
    for name in (prefill, longest):
        s.place(entry, name, tmp_path / "placed" / name)
    assert (tmp_path / "placed" / prefill).read_text() == "A"
    assert (tmp_path / "placed" / longest).read_text() == "B"
    assert jit_store.is_file_name("é" * 127) and not jit_store.is_file_name("é" * 128)
    with pytest.raises(jit_store.EntryError, match="not a file name inside the entry"):
        s.publish(
            "cd" * 32, {"z" * 256: files[prefill]}, [str(header)], {"kind": "topk_topp"}, "env"
        )
