"""The store's registry tier with a real registry (Debian's docker-registry on loopback): node
A compiles and pushes, node B (an empty store) pulls and places, checked; a blob changed in
the registry's own storage, a registry that is down or a wrong setting never fails a build.
The compiler is the stand-in nvcc of test_kernel_compile: what is shared is the store's."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from builder import store as jit_store
from builder.core.paths import jit_store_dir
from builder.jit import oci
from builder.jit import remote as jit_remote
from builder.jit import share as jit_share
from builder.machine import archs
from builder.verify import flashinfer_jit, kernel_compile
from builder.verify.model import EnvFacts, StoreUse
from tests.conftest import Registry
from tests.helpers import write
from tests.test_jit_store import FAKECC, LINK, make_env, run_ninja, runs
from tests.test_kernel_compile import env_with, make_toolkit

ARCH = archs.Arch.parse("12.0f")
KEY = hashlib.sha256(b"an entry").hexdigest()


def node(
    tmp_path: Path,
    name: str,
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
    *,
    push: bool,
    remote: str | None = None,
) -> kernel_compile.KernelBuild:
    """One machine: its own store and env, the cluster's registry."""
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / f"store-{name}"))
    env = env_with(tmp_path, "gcc 12.2.0", CUDAENV_JIT_REMOTE=remote or registry.url)
    if push:
        env["CUDAENV_JIT_PUSH"] = "1"
    home = make_toolkit(tmp_path / name / "cuda-home")
    return kernel_compile.build_kernel(
        home / "bin" / "nvcc", ARCH, tmp_path / name / "work", env=env, owner=name
    )


def compiled(tmp_path: Path, name: str) -> bool:
    return (tmp_path / name / "cuda-home" / "bin" / "calls").exists()


def test_node_b_reuses_what_node_a_pushed(
    tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = node(tmp_path, "A", registry, monkeypatch, push=True)
    assert a.error is None and not a.reused and not a.notes, a.notes
    b = node(tmp_path, "B", registry, monkeypatch, push=False)
    assert b.reused and not compiled(tmp_path, "B"), b.notes
    assert b.stored is not None and b.stored[1] == registry.url
    assert b.path.read_bytes() == a.path.read_bytes()
    # Kept in B's own store: a third env on B needs no registry.
    registry.stop()
    c = node(tmp_path, "C", registry, monkeypatch, push=False)
    assert c.notes and registry.url in c.notes[0]  # C has its own store: a miss, a warning
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store-B"))
    d = kernel_compile.build_kernel(
        make_toolkit(tmp_path / "D" / "cuda-home") / "bin" / "nvcc",
        ARCH,
        tmp_path / "D" / "work",
        env=env_with(tmp_path, "gcc 12.2.0", CUDAENV_JIT_REMOTE=registry.url),
        owner="D",
    )
    assert d.reused and not d.notes


def test_a_warmer_pushes_what_its_env_had_built_already(
    tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Env A compiled before the remote was set; its next verify as a warmer pushes."""
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store-A"))
    home = make_toolkit(tmp_path / "A" / "cuda-home")
    nvcc, work = home / "bin" / "nvcc", tmp_path / "A" / "work"
    first = kernel_compile.build_kernel(nvcc, ARCH, work, env=env_with(tmp_path, "gcc 12.2.0"))
    assert first.error is None
    env = env_with(tmp_path, "gcc 12.2.0", CUDAENV_JIT_REMOTE=registry.url, CUDAENV_JIT_PUSH="1")
    again = kernel_compile.build_kernel(nvcc, ARCH, work, env=env)
    assert again.reused and not again.notes
    b = node(tmp_path, "B", registry, monkeypatch, push=False)
    assert b.reused and not compiled(tmp_path, "B")


def test_a_node_that_only_pulls_never_pushes(
    tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = node(tmp_path, "A", registry, monkeypatch, push=False)
    assert a.error is None and not a.notes
    b = node(tmp_path, "B", registry, monkeypatch, push=False)
    assert not b.reused and compiled(tmp_path, "B")


def test_two_nodes_push_the_same_content(
    tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both compile one key (neither finds it first): the second push finds the same
    manifest there, and says nothing."""
    a = node(tmp_path, "A", registry, monkeypatch, push=True)
    b = node(tmp_path, "B", registry, monkeypatch, push=False, remote="off")
    assert not b.reused and compiled(tmp_path, "B")
    store_b = jit_store.Store(tmp_path / "store-B")
    ((key, variant),) = store_b.all()
    remote = jit_share.parse(registry.url)
    assert jit_share.push(store_b, store_b.load(key, variant), remote) is None
    assert a.error is None


def test_a_blob_changed_in_the_registry_is_refused_and_rebuilt(
    tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = node(tmp_path, "A", registry, monkeypatch, push=True)
    kernel = a.path.read_bytes()
    blobs = list((registry.root / "docker" / "registry" / "v2" / "blobs").rglob("data"))
    (changed,) = [b for b in blobs if b.read_bytes() == kernel]
    changed.write_bytes(b"X" * len(kernel))
    b = node(tmp_path, "B", registry, monkeypatch, push=False)
    assert b.error is None and not b.reused and compiled(tmp_path, "B")
    assert len(b.notes) == 1 and registry.url in b.notes[0]
    assert "compiled locally" in b.notes[0]
    root = jit_store_dir()
    assert root is not None
    # Compiled and kept locally: the registry's bad copy never entered the store.
    ((_, variant),) = jit_store.Store(root).all()
    assert (variant / "files" / "kernel").read_bytes() == b.path.read_bytes()


def test_a_registry_that_is_down_costs_a_compile_and_one_warning(
    tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry.stop()
    b = node(tmp_path, "B", registry, monkeypatch, push=True)
    assert b.error is None and compiled(tmp_path, "B")
    assert len(b.notes) == 2  # the pull and the push, each once
    assert all(registry.url in n for n in b.notes)


def test_store_push_and_pull_move_an_envs_entries(
    tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = node(tmp_path, "A", registry, monkeypatch, push=False)
    assert a.error is None
    store_a = jit_store.Store(tmp_path / "store-A")
    used = [str(v.relative_to(store_a.root)) for _, v in store_a.all()]
    remote = jit_share.parse(registry.url)
    pushed, warnings = jit_share.push_env(store_a, used, remote, "env-test")
    assert (pushed, warnings) == (1, [])
    store_b = jit_store.Store(tmp_path / "store-B")
    assert jit_share.pull_env(store_b, remote, "env-test") == (1, [])
    assert [k for k, _ in store_b.all()] == [k for k, _ in store_a.all()]
    assert jit_share.pull_env(store_b, remote, "env-other")[1][0].endswith(
        "push it from a warmer first"
    )


def test_a_malformed_remote_is_the_users_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from builder.commands import pipeline
    from builder.core.errors import UsageError

    with pytest.raises(jit_share.ShareError, match="oci://"):
        jit_share.configured({"CUDAENV_JIT_REMOTE": "http://registry/x"})
    monkeypatch.setenv("CUDAENV_JIT_REMOTE", "ftp://x/y")
    with pytest.raises(UsageError, match="CUDAENV_JIT_REMOTE"):
        pipeline.jit_remote_for(None)
    assert jit_share.configured({"CUDAENV_JIT_REMOTE": "off"}) is None
    assert jit_share.configured({}, setting="oci://127.0.0.1:5000/a/b") is not None
    # A remote off loopback speaks https unless plain http is asked for.
    remote = jit_share.configured({"CUDAENV_JIT_REMOTE": "oci://registry.example:5000/a"})
    assert remote is not None and not remote.insecure
    insecure = {"CUDAENV_JIT_REMOTE": "oci://registry.example:5000/a"}
    insecure["CUDAENV_JIT_REMOTE_INSECURE"] = "1"
    remote = jit_share.configured(insecure)
    assert remote is not None and remote.insecure


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_bad_remote_timeout_never_crashes_a_check(
    tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """The CLI refuses it at start-up; a process started otherwise (the probe's ``python -m
    builder.jit.share``) uses the default instead of passing it on to requests and sockets,
    which raised ValueError or OverflowError inside the check."""
    monkeypatch.setenv("CUDAENV_JIT_REMOTE_TIMEOUT", value)
    assert jit_share.timeout() == jit_share.DEFAULT_TIMEOUT
    a = node(tmp_path, "A", registry, monkeypatch, push=True)
    assert a.error is None and not a.notes, a.notes
    b = node(tmp_path, "B", registry, monkeypatch, push=False)
    assert b.reused and not b.notes


def push_index(registry: Registry, tag: str, keys: list[str]) -> None:
    """An index pushed by hand, as any client with push rights could."""
    from tests.test_jit_remote import push_raw

    config = json.dumps({"keys": keys}).encode()
    push_raw(registry, tag, config, [], config_type=jit_remote.INDEX_MEDIA_TYPE)


def test_an_index_of_too_many_keys_is_refused_at_once(tmp_path: Path, registry: Registry) -> None:
    """20,000 keys took 171 s to pull one by one and printed 20,000 warnings."""
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(20_000)]
    push_index(registry, "env-big", keys)
    started = time.monotonic()
    added, warnings = jit_share.pull_env(
        jit_store.Store(tmp_path / "store"), jit_share.parse(registry.url), "env-big"
    )
    assert time.monotonic() - started < 5
    assert added == 0
    assert warnings == [
        f"{registry.url}: index env-big lists 20000 entry keys, more than the "
        f"{jit_remote.MAX_INDEX_KEYS} it may hold; it is not read"
    ]
    # Nor is one that large pushed, or added to.
    with pytest.raises(oci.RemoteBadContent, match="lists 20000 entry keys"):
        jit_remote.publish_index(jit_share.parse(registry.url), "env-big", [KEY])
    with pytest.raises(oci.RemoteError, match="would list 4097 entry keys"):
        jit_remote.publish_index(jit_share.parse(registry.url), "env-new", keys[:4097])


def test_the_warnings_of_a_pull_are_summed_up(tmp_path: Path, registry: Registry) -> None:
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(30)]
    push_index(registry, "env-gone", keys)
    added, warnings = jit_share.pull_env(
        jit_store.Store(tmp_path / "store"), jit_share.parse(registry.url), "env-gone"
    )
    assert added == 0
    assert len(warnings) == jit_share.MAX_WARNINGS + 1
    assert all(w.endswith(f"listed but not in {registry.url}") for w in warnings[:-1])
    assert warnings[-1] == f"... and {30 - jit_share.MAX_WARNINGS} more warnings like these"


# --------------------------------------------------------------------------- FlashInfer's path


class ToyModule:
    """What build_through_store asks of a FlashInfer JitSpec, over the toy ninja build of
    test_jit_store (absolute paths of the env in every command, as FlashInfer writes)."""

    def __init__(self, build_dir: Path) -> None:
        self.ninja_path = str(build_dir / "build.ninja")
        self.build_dir = build_dir

    def write_ninja(self) -> None:
        pass  # make_env wrote it

    def get_library_path(self) -> str:
        return str(self.build_dir / "sampling.so")

    def build(self, verbose: bool) -> None:
        run_ninja(self.build_dir)


def probe_module() -> Any:
    """The probe's env_facts.py, imported as the env's interpreter imports it (its directory
    on sys.path)."""
    import importlib
    import sys

    probe_dir = str(Path(__file__).resolve().parent.parent / "builder" / "probe")
    if probe_dir not in sys.path:
        sys.path.insert(0, probe_dir)
    return importlib.import_module("env_facts")


@pytest.mark.slow
def test_flashinfer_builds_share_through_the_registry(
    tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node A's probe compiles and keeps the module, and cudaenv pushes it once the probe has
    answered (as verify does); node B (an env at the same path on another machine: an empty
    store) pulls through ``python -m builder.jit.share`` and places A's module, ninja has no
    work, and the verify evidence says where it came from."""
    import sys

    env_facts = probe_module()
    tools = tmp_path / "tools"
    write(tools / "fakecc.py", FAKECC)
    write(tools / "link.py", LINK)
    root = tmp_path / "env"
    monkeypatch.setattr(sys, "prefix", str(root))
    monkeypatch.setenv("CUDAENV_JIT_REMOTE", registry.url)
    monkeypatch.setenv("CUDAENV_JIT_SHARE", json.dumps([sys.executable, "-m", "builder.jit.share"]))
    monkeypatch.setenv("CUDAENV_JIT_PUSH", "1")
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store-A"))
    a = env_facts.build_through_store(
        ToyModule(make_env(root, tools)), tmp_path / "store-A", compiled=False
    )
    assert a["used"] and not a["hit"] and a["kept"] and a["warnings"] == [], a
    assert len(runs(tools)) == 2
    said: list[str] = []
    probed = cast("EnvFacts", SimpleNamespace(environ=dict(os.environ)))
    assert flashinfer_jit.pushed_to(probed, StoreUse.from_json(a), said) == registry.url, said
    shutil.rmtree(root)
    monkeypatch.delenv("CUDAENV_JIT_PUSH")
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store-B"))
    b = env_facts.build_through_store(
        ToyModule(make_env(root, tools)), tmp_path / "store-B", compiled=False
    )
    assert b["hit"] and b["env"] == registry.url and b["warnings"] == [], b
    assert len(runs(tools)) == 2  # nothing compiled on B
    # The registry down: C compiles, with one warning naming it.
    registry.stop()
    shutil.rmtree(root)
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store-C"))
    c = env_facts.build_through_store(
        ToyModule(make_env(root, tools)), tmp_path / "store-C", compiled=False
    )
    assert not c["hit"] and len(runs(tools)) == 4
    assert len(c["warnings"]) == 1 and registry.url in c["warnings"][0]


@pytest.mark.slow
def test_a_warm_list_whose_entries_never_answer_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4,096 listed keys whose entries time out: the pull stops after 3 failures in a row,
    and a slow one stops at its budget, each saying how many it left (they compile at first
    use); it never costs one full timeout per key."""
    keys = [f"{n:064x}" for n in range(4096)]
    calls: list[float] = []

    def fetch(remote: Any, tag: str, into: Path, *, timeout: float, check: Any = None) -> None:
        calls.append(timeout)
        raise oci.RemoteError(f"timed out after {timeout:.0f} s")

    monkeypatch.setattr(jit_remote, "fetch_index", lambda remote, tag, timeout: keys)
    monkeypatch.setattr(jit_remote, "fetch", fetch)
    store = jit_store.Store(tmp_path / "store")
    remote = oci.Remote.parse("oci://127.0.0.1:9/cudaenv/jit")
    added, warnings = jit_share.pull_env(store, remote, "t", budget=300.0)
    assert (added, len(calls)) == (0, 3)
    assert warnings[-1].startswith("3 entries failed in a row: 4093 of 4096 listed entries not")

    def slow(remote: Any, tag: str, into: Path, *, timeout: float, check: Any = None) -> None:
        calls.append(timeout)
        time.sleep(0.3)
        return None  # listed but not there: no failure, just slow

    calls.clear()
    monkeypatch.setattr(jit_remote, "fetch", slow)
    started = time.monotonic()
    added, warnings = jit_share.pull_env(store, remote, "t", budget=1.0)
    assert time.monotonic() - started < 3.0 and len(calls) <= 5
    assert any("the pull took its 1 s" in w for w in warnings), warnings
    assert all(t <= 1.0 for t in calls)  # each wait within what was left (1 s at least)


def test_an_entry_that_would_evict_this_nodes_own_is_refused_before_its_blobs(
    tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Junk entries were all downloaded before any was checked, and evicted the node's own
    entries under the size cap: what an entry claims is read first (its small config), and
    one that does not fit the room left under the cap is not pulled, its blobs never asked."""
    a = node(tmp_path, "A", registry, monkeypatch, push=False)
    assert a.error is None
    store_a = jit_store.Store(tmp_path / "store-A")
    used = [str(v.relative_to(store_a.root)) for _, v in store_a.all()]
    remote = jit_share.parse(registry.url)
    assert jit_share.push_env(store_a, used, remote, "env-test") == (1, [])
    ((_, variant),) = store_a.all()
    size = store_a.size_of(variant)
    downloads: list[object] = []
    real = oci.Client.download

    def counted(self: oci.Client, *args: object, **kwargs: object) -> object:
        if getattr(args[0], "title", None) is not None:  # a layer: one of the entry's files
            downloads.append(args[0])
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(oci.Client, "download", counted)
    monkeypatch.setenv("CUDAENV_JIT_STORE_MAX", str(size // 2))
    store_b = jit_store.Store(tmp_path / "store-B")
    added, warnings = jit_share.pull_env(store_b, remote, "env-test")
    assert added == 0 and downloads == []
    assert (
        len(warnings) == 1
        and "left under the store's cap (CUDAENV_JIT_STORE_MAX): not "
        "pulled, so this node's own entries stay"
        in warnings[0]
    )
    monkeypatch.setenv("CUDAENV_JIT_STORE_MAX", str(size * 4))
    assert jit_share.pull_env(store_b, remote, "env-test") == (1, [])
    assert downloads
