"""A fleet that starts warm, with the real thing: FlashInfer's JIT and nvcc in built envs of
the default spec, Debian's docker-registry between two "nodes" (two env dirs, each with its
own JIT store). Node A warms the two cheapest modules of the default set (the fused
activations, ~5 s each on 2 cores) into the registry; node B builds the env with an empty
store and loads each module with no compile. A forged blob, a registry that is down and one
that serves garbage each cost one warning and place nothing wrong."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest

from tests.conftest import Registry
from tests.helpers import REPO, cudaenv, workspace

SPEC = "envspecs/default.yaml"
MODULES = ("gelu_and_mul", "silu_and_mul")
CACHED_OPS = Path("var/flashinfer/.cache/flashinfer/0.7.2/120f/cached_ops")


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return workspace(tmp_path_factory.mktemp("warm"), "default.yaml")


def node(ws: Path, name: str, remote: str | None) -> dict[str, str]:
    """A node's environment: its own JIT store, the registry (or none)."""
    return {
        "CUDAENV_JIT_STORE": str(ws / f"store-{name}"),
        "CUDAENV_JIT_REMOTE": remote or "off",
        "CUDAENV_JIT_PUSH": "0",
    }


def build(ws: Path, name: str, remote: str | None) -> subprocess.CompletedProcess[str]:
    return cudaenv("build", SPEC, "--env-dir", str(ws / name), cwd=ws, env=node(ws, name, remote))


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("cudaenv: warning:")]


LOAD = """
import json, os, sys
from flashinfer.jit.activation import gen_act_and_mul_module
out = {}
for act in sys.argv[1:]:
    spec = gen_act_and_mul_module(act)
    lib = spec.get_library_path()
    log = os.path.join(os.path.dirname(lib), ".ninja_log")
    before = (os.stat(lib).st_mtime_ns, open(log).read())
    spec.build_and_load()
    out[spec.name] = (os.stat(lib).st_mtime_ns, open(log).read()) == before
print(json.dumps(out))
"""


def left_running(env: Path) -> list[str]:
    """The command lines of the live processes (zombies aside) that name ``env``."""
    found = []
    for proc_dir in Path("/proc").iterdir():
        try:
            state = (proc_dir / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
            argv = (proc_dir / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        line = b" ".join(argv).decode(errors="replace")
        if state not in (b"Z", b"X") and str(env) in line:
            found.append(line)
    return found


def loads_without_compiling(env: Path, first: Path | None = None) -> dict[str, bool]:
    """Each module loaded by FlashInfer (its build_and_load, as a server's first request does)
    in ``env`` with its bin/ first on PATH (`cudaenv run`), or, given ``first``, started as a
    bare ``bin/python`` with ``first`` (another ninja) leading PATH: whether ninja ran nothing
    for it (the library and ninja's log, where every command ninja runs is recorded,
    untouched), after ``ninja -n`` says it has no work to do."""
    lead = first if first is not None else env / "bin"
    path = f"{lead}:{os.environ.get('PATH', '')}"
    for module in MODULES:
        dry = subprocess.run(
            [env / "bin" / "ninja", "-C", env / CACHED_OPS / module, "-n"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        assert "no work to do" in dry.stdout, dry.stdout
    done = subprocess.run(
        [env / "bin" / "python", "-c", LOAD, "gelu", "silu"],
        capture_output=True, text=True, check=True, timeout=300,
        env={**os.environ, "PATH": path},
    )  # fmt: skip
    loaded: dict[str, bool] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


class Garbage(BaseHTTPRequestHandler):
    """A "registry" that answers every request with 200 and bytes that are no manifest."""

    def do_GET(self) -> None:
        body = b"\x00garbage\xff" * 64
        self.send_response(200)
        self.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def garbage() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"oci://127.0.0.1:{server.server_address[1]}/cudaenv/jit"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.network
@pytest.mark.e2e
def test_a_node_builds_warm_from_what_a_warmer_pushed(
    ws: Path, registry: Registry, garbage: str
) -> None:
    build(ws, "a", None)
    # The two activations, and cudaenv's own kernel (verify compiles it on every node).
    warm = ["warm", SPEC, "--env-dir", str(ws / "a"), "--modules", *MODULES, "topk_topp"]
    first = cudaenv(*warm, "--json", cwd=ws, env=node(ws, "a", registry.url))
    doc = json.loads(first.stdout)
    assert (doc["built"], doc["warm"], doc["failed"], doc["pushed"]) == (3, 0, 0, 3), doc
    assert "topk_topp 12.0f (12.0f): built in " in first.stderr, first.stderr
    # The count, both modules built at once on this machine's compile slots.
    assert "[2/2" in first.stderr and ", 2 at once (" in first.stderr, first.stderr
    # A rerun resumes: what the store holds is not built again.
    again = json.loads(cudaenv(*warm, "--json", cwd=ws, env=node(ws, "a", registry.url)).stdout)
    assert (again["built"], again["warm"]) == (0, 3), again
    listed = cudaenv("store", "list", SPEC, "--json", cwd=ws, env=node(ws, "a", None))
    names = sorted(
        e["module"]["name"] for e in json.loads(listed.stdout)["entries"] if e.get("module")
    )
    assert names == sorted(MODULES)
    # A second env of the stack on node A: placed from the plan warm kept for an env like A,
    # without starting the env's interpreter, and FlashInfer compiles nothing at first load.
    a2 = cudaenv("build", SPEC, "--env-dir", str(ws / "a2"), cwd=ws, env=node(ws, "a", None))
    assert (
        "prefetched 2 of 2 warmed FlashInfer module(s) from the JIT store; 2 placed from the "
        "plan of an identical env, without FlashInfer (ninja -n: no work to do)" in a2.stderr
    ), a2.stderr
    assert loads_without_compiling(ws / "a2") == dict.fromkeys(MODULES, True)

    # Node B: an empty store, the registry. Its build places both from the plan warm pushed,
    # without importing FlashInfer in the env; nothing compiles.
    b = build(ws, "b", registry.url)
    assert (
        # 3 pulled: the two modules and cudaenv's own kernel, which verify places itself.
        f"prefetched 2 of 2 warmed FlashInfer module(s) from the JIT store (3 pulled from "
        f"{registry.url}); 2 placed from the plan of an identical env, without FlashInfer"
        in b.stderr
    ), b.stderr
    assert warnings(b.stderr) == []
    assert loads_without_compiling(ws / "b") == dict.fromkeys(MODULES, True)
    # Node B's verify compiles nothing of its own either: the kernel came with the warm list.
    checked = cudaenv(
        "verify", SPEC, "--env-dir", str(ws / "b"), "--checks", "kernel-compile",
        cwd=ws, env=node(ws, "b", registry.url),
    )  # fmt: skip
    assert "reused from the store" in checked.stdout and "compiled in" not in checked.stdout, (
        checked.stdout
    )
    # A server started without activation, another ninja first on its PATH: the env's hook
    # puts the env's own bin/ ahead, so FlashInfer runs the ninja the key names and finds the
    # placed modules up to date (another ninja would read the log as "command line changed").
    shim = ws / "other-ninja"
    shim.mkdir(exist_ok=True)
    (shim / "ninja").write_text(f'#!/bin/sh\necho "$@" >> {shim / "ran"}\nexit 1\n')
    (shim / "ninja").chmod(0o755)
    assert loads_without_compiling(ws / "b", first=shim) == dict.fromkeys(MODULES, True)
    assert not (shim / "ran").exists()
    # Built again, up to date, nothing warmed since: reused, no probe run, nothing said of it.
    again_b = build(ws, "b", registry.url)
    assert "reused" in again_b.stderr and "prefetch" not in again_b.stderr, again_b.stderr

    # A blob of one module's library forged in the registry's storage: refused by its
    # digest or its recorded sha256, never placed; the other module still is. One warning.
    library = ws / "b" / CACHED_OPS / "silu_and_mul" / "silu_and_mul.so"
    blobs = (registry.root / "docker" / "registry" / "v2" / "blobs").rglob("data")
    (forged,) = [p for p in blobs if p.read_bytes() == library.read_bytes()]
    forged.write_bytes(b"\x7fELF" + b"\0" * (forged.stat().st_size - 4))
    c = build(ws, "c", registry.url)
    assert "prefetched 1 of 1 warmed" in c.stderr, c.stderr
    (warning,) = warnings(c.stderr)
    assert registry.url in warning
    assert not (ws / "c" / CACHED_OPS / "silu_and_mul").exists()
    assert (ws / "c" / CACHED_OPS / "gelu_and_mul" / "gelu_and_mul.so").is_file()

    # A registry that serves garbage, then one that is down: one warning each, nothing
    # placed, the build done.
    for name, remote in (("d", garbage), ("e", registry.url)):
        if name == "e":
            registry.stop()
        done = build(ws, name, remote)
        (warning,) = warnings(done.stderr)
        assert remote in warning, done.stderr
        assert "prefetch: no warmed FlashInfer module" in done.stderr
        assert not (ws / name / CACHED_OPS).exists() or not any((ws / name / CACHED_OPS).iterdir())


@pytest.mark.network
@pytest.mark.e2e
def test_a_module_flashinfer_cannot_build_for_an_arch_is_listed_with_its_reason(ws: Path) -> None:
    if not (ws / "a" / "cudaenv.json").exists():
        build(ws, "a", None)
    done = cudaenv(
        "warm", SPEC, "--env-dir", str(ws / "a"), "--archs", "7.0", "--modules", "silu_and_mul",
        cwd=ws, env=node(ws, "a", None), check=False,
    )  # fmt: skip
    assert done.returncode == 4, done.stderr
    assert (
        "silu_and_mul (7.0): failed: RuntimeError: FlashInfer requires GPUs with sm75 or higher"
        in done.stdout
    ), done.stdout
    assert "1 of 1 FlashInfer module(s) could not be built" in done.stderr


@pytest.mark.network
@pytest.mark.e2e
def test_an_interrupted_warm_keeps_what_it_finished_and_resumes(ws: Path) -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) once the first
    module is built: that module stays in the store, and the rerun builds only the other.
    An env and a store of its own, built here: the other tests' env "a" holds these modules
    in its own JIT cache once they ran, and a warm of an env that has them builds nothing
    there is to interrupt (it must pass first, last or alone)."""
    build(ws, "interrupted", None)
    cached = ws / "interrupted" / CACHED_OPS
    assert not cached.exists() or not any(cached.iterdir()), list(cached.iterdir())
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        **node(ws, "interrupted", None),
        # One module after the other (a MAX_JOBS of the user's own): built at once, both
        # would finish together and leave nothing to resume.
        "MAX_JOBS": "2",
    }
    argv = [sys.executable, "-m", "builder.cli", "warm", SPEC, "--env-dir", str(ws / "interrupted")]
    warm = [*argv, "--modules", *MODULES]
    child = subprocess.Popen(
        warm, cwd=ws, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    assert child.stderr is not None
    seen = []
    for line in child.stderr:
        seen.append(line)
        if ": built in " in line:
            os.killpg(child.pid, signal.SIGINT)
            break
    child.stderr.read()
    assert child.wait(timeout=120) != 0, "".join(seen)
    # Nothing it started compiles on into the env the rerun uses (core/descendants.py).
    assert left_running(ws / "interrupted") == [], "".join(seen)
    again = subprocess.run(
        [*warm, "--json"], cwd=ws, env=env, capture_output=True, text=True, timeout=600
    )
    doc = json.loads(again.stdout)
    said = "\n".join(f"{m['module']}: {m['status']} {m.get('reason', '')}" for m in doc["modules"])
    assert (doc["warm"], doc["built"], doc["failed"]) == (1, 1, 0), f"{said}\n{again.stderr}"
