"""The machine-wide JIT store (builder/store/) with real ninja, on a toy build
laid out as FlashInfer lays out its own: absolute paths of the env in every command, a
depfile per object (``deps = gcc``), a link step. The compiler is a script that records each
run, so a test sees whether anything was compiled."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from builder import store as jit_store
from builder.core.reporter import Reporter
from tests.helpers import write

# A compiler: output = flags + source + header; a depfile naming both; one line per run.
FAKECC = """\
import sys
args = sys.argv[1:]
out = args[args.index("-o") + 1]
dep = args[args.index("-MF") + 1]
src = args[args.index("-c") + 1]
inc = args[args.index("-I") + 1]
flags = [a for a in args if a.startswith("-gencode")]
header = inc + "/cub.cuh"
open(out, "w").write(" ".join(flags) + open(src).read() + open(header).read())
open(dep, "w").write(out + ": " + src + " " + header + "\\n")
open(sys.argv[0] + ".runs", "a").write(out + "\\n")
"""
LINK = """\
import sys
args = sys.argv[1:]
out = args[args.index("-o") + 1]
open(out, "w").write("".join(open(a).read() for a in args[: args.index("-o")]))
open(sys.argv[0] + ".runs", "a").write(out + "\\n")
"""


KEY, OTHER = "ab" * 32, "cd" * 32


def ninja() -> str:
    found = shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("ninja is not installed")
    return found


def make_env(root: Path, tools: Path, *, arch: str = "120f", cub: str = "cub 13.0") -> Path:
    """An env at ``root``: a toolkit (cuda-home with an nvcc file), a source, and the
    module's build.ninja as FlashInfer writes it (absolute paths of this env)."""
    write(root / "cuda-home" / "bin" / "nvcc", "nvcc 13.0.88\n")
    write(root / "cuda-home" / "include" / "cub.cuh", cub + "\n")
    write(root / "site" / "sampling.cu", "__global__ void k() {}\n")
    build = root / "var" / "cache" / "sampling"
    build.mkdir(parents=True)
    write(
        build / "build.ninja", ninja_text(root, tools, build, root / "site" / "sampling.cu", arch)
    )
    return build


def ninja_text(root: Path, tools: Path, build: Path, source: Path, arch: str = "120f") -> str:
    """The module's build.ninja as FlashInfer writes it: absolute paths of the env."""
    py = sys.executable
    return f"""ninja_required_version = 1.3
cuda_home = {root}/cuda-home
cxx = c++
cuda_cflags = -I {root}/cuda-home/include -gencode=arch=compute_{arch},code=sm_{arch}

rule cuda_compile
  command = {py} {tools}/fakecc.py -MF $out.d $cuda_cflags -c $in -o $out
  depfile = $out.d
  deps = gcc

rule link
  command = {py} {tools}/link.py $in -o $out

build {build}/sampling.cuda.o: cuda_compile {source}
build {build}/sampling.so: link {build}/sampling.cuda.o
default {build}/sampling.so
"""


def make_tools(tmp_path: Path) -> Path:
    """The toy compiler and linker, each recording its runs."""
    d = tmp_path / "tools"
    write(d / "fakecc.py", FAKECC)
    write(d / "link.py", LINK)
    return d


def make_host_path(tmp_path: Path) -> str:
    """A PATH whose c++, gcc and g++ are scripts of known content (the host compiler)."""
    bin_dir = tmp_path / "host-bin"
    for name in ("c++", "gcc", "g++"):
        write(bin_dir / name, "#!/bin/sh\necho gcc 12.2.0\n").chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


def runs(tools: Path) -> list[str]:
    out = []
    for name in ("fakecc.py.runs", "link.py.runs"):
        path = tools / name
        out += path.read_text().splitlines() if path.exists() else []
    return out


def key_for(store: jit_store.Store, build: Path, root: Path, path: str) -> str:
    env = {"PATH": path, "CUDA_HOME": str(root / "cuda-home")}
    return jit_store.key_of(jit_store.ninja_material(store, build, str(root), ninja(), env))


def run_ninja(build: Path) -> str:
    done = subprocess.run(
        [ninja(), "-C", str(build)], capture_output=True, text=True, check=True, timeout=120
    )
    return done.stdout


def build_and_publish(store: jit_store.Store, root: Path, tools: Path, path: str) -> str:
    build = make_env(root, tools)
    key = key_for(store, build, root, path)
    run_ninja(build)
    assert jit_store.publish_ninja(store, key, build, str(root), ninja(), {"env": str(root)})
    return key


def test_the_logs_written_are_the_ones_ninja_writes(tmp_path: Path, tools: Path) -> None:
    """After a real ninja build: each .ninja_log hash is our hash of that edge's command, and
    .ninja_deps read and written back is byte for byte ninja's file."""
    build = make_env(tmp_path / "env", tools)
    run_ninja(build)
    header, *lines = (build / ".ninja_log").read_text().splitlines()
    assert header in jit_store.LOG_HASHES, f"a ninja log format cudaenv cannot write: {header}"
    logged = {line.split("\t")[3]: line.split("\t")[4] for line in lines}
    edges = jit_store.compdb(ninja(), build)
    assert len(edges) == 2
    for edge in edges:
        assert logged[edge["output"]] == jit_store.command_hash(edge["command"], header)
    recorded = jit_store.read_deps(build / ".ninja_deps")
    jit_store.write_deps(tmp_path / "again", [(k, m, d) for k, (m, d) in recorded.items()])
    assert (tmp_path / "again").read_bytes() == (build / ".ninja_deps").read_bytes()


@pytest.mark.parametrize(
    ("header", "command", "digest"),
    [
        # Lines of real logs: ninja 1.11 (v5, MurmurHash64A) and 1.13 (v7, rapidhash).
        ("# ninja log v5", "cp s.c o", "dbcab29a0a964135"),
        ("# ninja log v7", "touch a", "d91ff1f2760e13e4"),
        ("# ninja log v7", "cp s.c o0 #", "235f18f7ed34b422"),
    ],
)
def test_command_hashes_of_each_log_format(header: str, command: str, digest: str) -> None:
    assert jit_store.command_hash(command, header) == digest


def test_a_second_env_of_the_same_toolchain_reuses_the_result_and_ninja_has_no_work(
    tmp_path: Path, tools: Path, host_path: str
) -> None:
    store = jit_store.Store(tmp_path / "store")
    key = build_and_publish(store, tmp_path / "envA", tools, host_path)
    assert len(runs(tools)) == 2  # one compile, one link
    other = tmp_path / "elsewhere" / "envB"
    build = make_env(other, tools)
    assert key_for(store, build, other, host_path) == key  # the env's path is not in the key
    entry = jit_store.place_ninja(store, key, build, str(other), ninja())
    assert entry is not None and entry.provenance["env"] == str(tmp_path / "envA")
    assert "no work to do" in run_ninja(build)
    assert len(runs(tools)) == 2  # nothing compiled for env B
    assert (build / "sampling.so").read_text() == (
        tmp_path / "envA" / "var" / "cache" / "sampling" / "sampling.so"
    ).read_text()
    # ninja reads back what was written for env B: its own paths, its own commands.
    deps = jit_store.read_deps(build / ".ninja_deps")
    assert deps[str(build / "sampling.cuda.o")][1] == [
        str(other / "site" / "sampling.cu"),
        str(other / "cuda-home" / "include" / "cub.cuh"),
    ]


@pytest.mark.parametrize("change", ["nvcc", "cccl", "arch", "host compiler"])
def test_any_difference_misses(tmp_path: Path, tools: Path, host_path: str, change: str) -> None:
    """A changed nvcc, a changed CCCL header, another arch, another host compiler: never the
    stored result; ninja compiles, and the result is kept beside the first."""
    store = jit_store.Store(tmp_path / "store")
    key = build_and_publish(store, tmp_path / "envA", tools, host_path)
    other = tmp_path / "envB"
    path = host_path
    if change == "arch":
        build = make_env(other, tools, arch="90a")
    elif change == "cccl":
        build = make_env(other, tools, cub="cub 13.3")
    else:
        build = make_env(other, tools)
    if change == "nvcc":
        write(other / "cuda-home" / "bin" / "nvcc", "nvcc 13.5.37\n")
    if change == "host compiler":
        bin_dir = tmp_path / "other-host"
        for name in ("c++", "gcc", "g++"):
            write(bin_dir / name, "#!/bin/sh\necho gcc 14.1.0\n").chmod(0o755)
        path = f"{bin_dir}:/usr/bin:/bin"
    new_key = key_for(store, build, other, path)
    assert (new_key == key) == (change == "cccl")  # a header is checked under the key
    assert jit_store.place_ninja(store, new_key, build, str(other), ninja()) is None
    assert not (build / "sampling.so").exists()
    before = len(runs(tools))
    run_ninja(build)
    assert len(runs(tools)) == before + 2
    assert jit_store.publish_ninja(store, new_key, build, str(other), ninja(), {"env": "B"})
    # Both variants are kept: env A's toolchain still finds its own.
    assert (
        jit_store.place_ninja(
            store, key, make_env(tmp_path / "envC", tools), str(tmp_path / "envC"), ninja()
        )
        is not None
    )


def test_a_stored_file_is_never_changed_through_an_env(
    tmp_path: Path, tools: Path, host_path: str
) -> None:
    store = jit_store.Store(tmp_path / "store")
    key = build_and_publish(store, tmp_path / "envA", tools, host_path)
    build = make_env(tmp_path / "envB", tools)
    assert jit_store.place_ninja(store, key, build, str(tmp_path / "envB"), ninja())
    # A compiler writing its output in place (no new file) into env B's cache.
    with (build / "sampling.so").open("r+") as fh:
        fh.write("rewritten in place")
    stored = [p.read_text() for p in store.entries(key).glob("*/files/*")]
    assert len(stored) == 2
    assert not any("rewritten" in text for text in stored)


@pytest.mark.slow
def test_builders_of_one_key_wait_and_compile_once(
    tmp_path: Path, tools: Path, host_path: str
) -> None:
    """Two builders (matrix cells of one toolchain) at once: the second waits on the key's
    lock and finds the first one's result instead of compiling the same module again."""
    store = jit_store.Store(tmp_path / "store")
    envs = [tmp_path / "cellA", tmp_path / "cellB"]
    builds = [make_env(env, tools) for env in envs]
    key = key_for(store, builds[0], envs[0], host_path)
    outcome: dict[str, bool] = {}

    def cell(env: Path, build: Path) -> None:
        with store.locked(key):
            if jit_store.place_ninja(store, key, build, str(env), ninja()) is not None:
                run_ninja(build)
                outcome[env.name] = True
                return
            time.sleep(0.5)  # a long compile: the other cell arrives meanwhile
            run_ninja(build)
            jit_store.publish_ninja(store, key, build, str(env), ninja(), {"env": env.name})
            outcome[env.name] = False

    threads = [threading.Thread(target=cell, args=pair) for pair in zip(envs, builds, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(outcome.values()) == [False, True]  # one compiled, one reused
    assert len(runs(tools)) == 2
    assert all((build / "sampling.so").exists() for build in builds)


def test_a_waiter_hears_which_process_builds_the_key_and_since_when(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Progress that names what it waits for: the holder leaves its pid, the time and what it
    builds in the key's lock; a waiter is told of them while it waits, and a warm says
    "waiting for pid N's compile of sampling (12.0f), started 0s ago"."""
    from builder.commands import warm as warmrun
    from builder.store import locking

    monkeypatch.setattr(locking, "TELL_EVERY", 0.05)
    store = jit_store.Store(tmp_path / "store")
    held = store.acquire(KEY, note="sampling (12.0f)")
    heard: list[tuple[jit_store.Holder, float]] = []
    release = threading.Timer(0.4, held.release)
    release.start()
    second = store.acquire(KEY, timeout=30, waiting=lambda h, s: heard.append((h, s)))
    second.release()
    release.join()
    assert heard, "the waiter was never told whom it waits for"
    holder, waited = heard[-1]
    assert (holder.pid, holder.what) == (str(os.getpid()), "sampling (12.0f)")
    assert abs(holder.since - time.time()) < 5 and 0 < waited < 30
    said = io.StringIO()
    progress = warmrun.Progress("12.0f", Reporter(stream=said))
    since = time.time() - 125
    doc = {"pid": holder.pid, "what": holder.what, "since": since, "module": "sampling"}
    progress.event({"event": "waiting", **doc})
    (line,) = said.getvalue().splitlines()
    expected = (
        f"cudaenv: sampling (12.0f): waiting for pid {os.getpid()}'s compile of sampling (12.0f)"
    )
    assert line.startswith(f"{expected}, started 2m0") and line.endswith("s ago"), line
    # Past the deadline: the error names the holder's pid, as before.
    held = store.acquire(KEY, note="sampling (12.0f)")
    with pytest.raises(jit_store.StoreError, match=rf"held by pid {os.getpid()}\)"):
        store.acquire(KEY, timeout=0.1)
    held.release()


def test_an_envs_results_travel_in_a_wheelhouse_and_join_another_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """export --with-jit carries exactly the entries the env used; build --wheelhouse adds
    them to another machine's store (where each is still used only on a full match)."""
    from builder.core.errors import BuildError
    from builder.env import export

    here = tmp_path / "store-here"
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(here))
    env = tmp_path / "env"
    write(env / "cudaenv.json", "{}")
    wheelhouse = tmp_path / "wheels"
    with pytest.raises(BuildError, match="has no JIT results in the store to carry"):
        export.export_jit(env, wheelhouse)
    store = jit_store.Store(here)
    built = write(tmp_path / "kernel.bin", "cubin")
    header = write(tmp_path / "cub.cuh", "CUB 13.0")
    kernel = {"kind": "topk_topp", "env": str(env)}
    used = store.publish(KEY, {"kernel": built}, [str(header)], kernel, str(env))
    other = store.publish(OTHER, {"kernel": built}, [str(header)], {**kernel, "env": "x"}, "x")
    assert used is not None and other is not None
    jit_store.note_use(store, used, str(env))
    jit_store.note_use(store, used, str(tmp_path / "not-a-cudaenv-env"))  # never written
    assert jit_store.used_entries(env) == [str(used.relative_to(here))]
    (wheelhouse / export.MANIFEST).parent.mkdir(parents=True)
    (wheelhouse / export.MANIFEST).write_text("{}")
    assert export.export_jit(env, wheelhouse) == 1
    carried = sorted(p.parent for p in (wheelhouse / export.JIT_DIR).glob("v3/*/*/*/entry.json"))
    assert [str(p.relative_to(wheelhouse / export.JIT_DIR)) for p in carried] == [
        str(used.relative_to(here))
    ]
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store-there"))
    assert export.import_jit(wheelhouse) == (1, None)
    assert export.import_jit(wheelhouse) == (0, None)  # already there
    there = jit_store.Store(tmp_path / "store-there")
    assert there.find(KEY, str(env)) is not None
    header.write_text("CUB 13.3")  # another toolkit's header there: never placed
    assert jit_store.Store(tmp_path / "store-there").find(KEY, str(env)) is None
    monkeypatch.setenv("CUDAENV_JIT_STORE", "off")
    assert export.import_jit(wheelhouse) == (0, None)
