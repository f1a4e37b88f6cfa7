"""Two nodes on one Redis, with the real tools: an env built from a spec naming a remote cache
(spec -> lock with the Redis client -> build -> the env's hook wires Triton and Inductor).

Node A compiles a Triton kernel for sm_120 (an explicit target: no GPU needed) and an Inductor
graph on the CPU; node B, with empty local caches of its own, gets both from Redis and runs no
ptxas and no compiler. Triton's keys are its own: another target arch, or a ptxas that reports
another version, is another entry. A Redis that is down, hung, not Redis, trickling its reply or announcing a huge one
costs one warning and a local compile."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.core import remote_cache
from builder.env import toolchain
from builder.spec import lock
from tests.conftest import Redis, start_redis
from tests.helpers import ENVSPECS, cudaenv, lock_of, loopback_server, workspace, write
from tests.test_remote_cache import DEEP, HUGE, SLOW, trickle_server

pytestmark = [pytest.mark.e2e, pytest.mark.network]

# Node code: compile one Triton kernel for the arch given and print what it did as JSON. The
# ptxas it runs is a wrapper that logs each call (set after the hook, which points Triton at
# the env's own ptxas).
TRITON_NODE = r"""
import json, os, sys, time
os.environ["TRITON_PTXAS_PATH"] = os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = sys.argv[2]
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget

@triton.jit
def add(x, y, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out + offs, tl.load(x + offs, mask=m) + tl.load(y + offs, mask=m), mask=m)

src = triton.compiler.ASTSource(
    fn=add, signature={"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32"},
    constexprs={"BLOCK": 128})
started = time.monotonic()
kernel = triton.compile(src, target=GPUTarget("cuda", int(sys.argv[1]), 32))
print(json.dumps({"seconds": time.monotonic() - started, "cubin": len(kernel.asm["cubin"]),
                  "manager": os.environ.get("TRITON_CACHE_MANAGER")}))
"""

# Node code: an Inductor graph on the CPU whose one op is an extern matmul (no C++ kernel to
# build); prints Inductor's counters.
INDUCTOR_NODE = r"""
import json, torch
from torch._dynamo.utils import counters
a, b = torch.randn(8, 8), torch.randn(8, 8)
out = torch.compile(lambda a, b: a @ b)(a, b)
assert torch.allclose(out, a @ b, atol=1e-5)
print(json.dumps(dict(counters["inductor"])))
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    served = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def wired_env(tmp_path_factory: pytest.TempPathFactory, shared: Redis) -> Path:
    """default.yaml with `remote-cache:` naming the shared server, locked and built as a user
    would: the lock gains `redis`, the hook wires both tools."""
    ws = workspace(tmp_path_factory.mktemp("ws"), "default.yaml")
    write(ws / "envspecs" / "rc.yaml",
          f"extends: default.yaml\nname: rc-e2e\nremote-cache: {shared.url}\n")  # fmt: skip
    # The new lock resolves at the view of the committed default lock, not the index of today.
    view = lock.read(lock_of(ENVSPECS / "default.yaml")).exclude_newer
    assert view is not None
    cudaenv("build", "envspecs/rc.yaml", cwd=ws, env={"CUDAENV_EXCLUDE_NEWER": view})
    env = ws / ".envs" / "rc-e2e"
    lock_text = (ws / "envspecs" / "locks" / "pylock.rc-e2e.toml").read_text()
    assert '\nname = "redis"\n' in lock_text
    site = toolchain.site_packages(env)
    assert (site / f"{remote_cache.BACKEND_MODULE}.py").is_file()
    return env


def ptxas_wrapper(env: Path, where: Path, version: str | None = None) -> tuple[Path, Path]:
    """A ptxas that logs each call and runs the env's own; ``version``: what it says to
    --version instead (another toolkit's ptxas, as far as Triton's key can tell)."""
    log = where / "ptxas.log"
    real = env / "cuda-home" / "bin" / "ptxas"
    fake = f'[ "$1" = --version ] && {{ echo "ptxas: {version}"; exit 0; }}\n' if version else ""
    wrapper = write(where / "ptxas",
                    f'#!/bin/sh\necho "$*" >> {log}\n{fake}exec {real} "$@"\n')  # fmt: skip
    wrapper.chmod(0o755)
    return wrapper, log


def compiles(log: Path) -> list[str]:
    """The ptxas runs that compiled (not the --version query Triton's key asks)."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [line for line in lines if line.strip() != "--version"]


def node(
    env: Path, home: Path, code: str, *args: str, **extra: str
) -> tuple[dict[str, object], str]:
    """One process of ``env`` with local caches of its own under ``home`` (a node)."""
    home.mkdir(parents=True, exist_ok=True)
    environ = {
        **os.environ,
        "TRITON_CACHE_DIR": str(home / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(home / "inductor"),
        "HOME": str(home),
        **extra,
    }
    # The hook sets the env's own cache directories: a node's are given after it, in the code,
    # which is one file for every node (Triton's @jit reads its source from a file).
    prelude = (
        "import os\n"
        "os.environ['TRITON_CACHE_DIR'] = os.environ['NODE_HOME'] + '/triton'\n"
        "os.environ['TORCHINDUCTOR_CACHE_DIR'] = os.environ['NODE_HOME'] + '/inductor'\n"
    )
    script = home.parent / f"node-{hashlib.sha256(code.encode()).hexdigest()[:12]}.py"
    script.write_text(prelude + code)
    environ["NODE_HOME"] = str(home)
    done = subprocess.run([env / "bin" / "python", str(script), *args], env=environ,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_node_b_gets_the_triton_kernel_and_the_inductor_graph_without_compiling(
    wired_env: Path, shared: Redis, tmp_path: Path
) -> None:
    shared.command("FLUSHALL")
    wrapper, log = ptxas_wrapper(wired_env, tmp_path)
    a, _ = node(wired_env, tmp_path / "a", TRITON_NODE, "120", str(wrapper))
    assert a["manager"] == remote_cache.MANAGER
    assert len(compiles(log)) == 1
    keys = shared.keys("cudaenv-triton:*")
    assert any(k.endswith(":add.cubin") for k in keys), keys
    log.unlink()
    b, _ = node(wired_env, tmp_path / "b", TRITON_NODE, "120", str(wrapper))
    assert compiles(log) == [] and b["cubin"] == a["cubin"]
    assert shared.keys("cudaenv-triton:*") == keys

    # The host compiler is part of Inductor's key: both nodes name the same one, a wrapper
    # that logs each call.
    cxx_log = tmp_path / "cxx.log"
    real = shutil.which("g++") or "c++"
    cxx = write(tmp_path / "cxx", f'#!/bin/sh\necho "$*" >> {cxx_log}\nexec {real} "$@"\n')
    cxx.chmod(0o755)
    ia, _ = node(wired_env, tmp_path / "a", INDUCTOR_NODE, CXX=str(cxx))
    assert ia.get("fxgraph_cache_miss") == 1 and not ia.get("fxgraph_cache_hit"), ia
    assert shared.keys("pt2:fx-graph-*"), shared.keys()
    cxx_log.unlink(missing_ok=True)
    ib, _ = node(wired_env, tmp_path / "b", INDUCTOR_NODE, CXX=str(cxx))
    assert ib.get("fxgraph_cache_hit") == 1 and not ib.get("fxgraph_cache_miss"), ib
    assert not cxx_log.exists(), cxx_log.read_text()
    assert not (tmp_path / "b" / "inductor").exists() or not any(
        (tmp_path / "b" / "inductor").rglob("*.so")
    )


def test_two_toolchains_never_share_an_entry(
    wired_env: Path, shared: Redis, tmp_path: Path
) -> None:
    """Triton's key holds the target arch and ptxas' version: another of either is a new
    entry, compiled, never the other's."""
    shared.command("FLUSHALL")
    wrapper, log = ptxas_wrapper(wired_env, tmp_path)
    node(wired_env, tmp_path / "a", TRITON_NODE, "120", str(wrapper))
    first = set(shared.keys("cudaenv-triton:*"))
    log.unlink()
    node(wired_env, tmp_path / "b", TRITON_NODE, "90", str(wrapper))
    assert len(compiles(log)) == 1
    by_arch = set(shared.keys("cudaenv-triton:*")) - first
    assert by_arch and not by_arch & first
    other, other_log = ptxas_wrapper(wired_env, tmp_path / "c", version="Cuda compilation "
                                     "tools, release 13.0, V13.0.999")  # fmt: skip
    (tmp_path / "c").mkdir(exist_ok=True)
    node(wired_env, tmp_path / "c", TRITON_NODE, "120", str(other))
    assert len(compiles(other_log)) == 1
    by_ptxas = set(shared.keys("cudaenv-triton:*")) - first - by_arch
    assert by_ptxas and not by_ptxas & (first | by_arch)


@pytest.mark.parametrize("how", ["down", "hung", "garbage", "trickled", "huge", "corrupt entry"])
def test_a_broken_remote_costs_one_warning_and_a_local_compile(
    wired_env: Path, shared: Redis, tmp_path: Path, how: str
) -> None:
    """``trickled``: a reply under the size bound, 2 KiB/s (each byte renews redis-py's
    timeout of one read); ``huge``: 2 GiB announced, then the same trickle."""
    wrapper, log = ptxas_wrapper(wired_env, tmp_path)
    fake = contextlib.ExitStack()
    url = shared.url
    if how == "down":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    elif how in ("hung", "garbage"):
        reply = None if how == "hung" else b"\x00\xffgarbage\r\n"
        url = f"redis://127.0.0.1:{fake.enter_context(loopback_server(reply))}/0"
    elif how in ("trickled", "huge"):
        url = fake.enter_context(trickle_server(SLOW if how == "trickled" else HUGE)).url
    else:
        # Every entry of the kernel overwritten with bytes that are not what was stored.
        shared.command("FLUSHALL")
        node(wired_env, tmp_path / "a", TRITON_NODE, "120", str(wrapper))
        for key in shared.keys("cudaenv-triton:*"):
            shared.command("SET", key, "not the entry")
        log.unlink()
    with fake:
        out, err = node(wired_env, tmp_path / "b", TRITON_NODE, "120", str(wrapper),
                        CUDAENV_REMOTE_CACHE=url)  # fmt: skip
    assert len(compiles(log)) == 1
    warnings = [line for line in err.splitlines() if "Triton's remote cache is not used" in line]
    assert len(warnings) == 1, err
    assert float(str(out["seconds"])) < 3 * remote_cache.TIMEOUT + 30
    if how == "corrupt entry":
        assert "does not match its sha256" in warnings[0]
    if how == "trickled":
        assert f"(TooSlow: no whole answer in {remote_cache.TIMEOUT:g}s)" in warnings[0]
    if how == "huge":
        assert "(TooLarge: a reply of 2147483648 bytes announced" in warnings[0]


INDUCTOR_BACKEND = """
import json, sys, time
from torch._inductor import config
from torch._inductor.remote_cache import RedisRemoteCacheBackend
started = time.monotonic()
backend = RedisRemoteCacheBackend("k")
got = [backend._get("a"), backend._get("b")]
backend._put("c", b"x")
print(json.dumps({"fx": config.fx_graph_remote_cache, "autotune": config.autotune_remote_cache,
                  "got": got, "seconds": time.monotonic() - started}))
"""


@pytest.mark.parametrize("how", ["hung", "garbage", "trickled", "huge", "nested"])
def test_inductor_takes_both_caches_from_redis_and_a_bad_server_costs_a_miss(
    wired_env: Path, tmp_path: Path, how: str
) -> None:
    """Inductor's FX-graph and autotuning caches are wired; its Redis backend takes only a
    refused connection for a miss, and its autotuning cache reads unguarded: under a server
    that hangs (redis' TimeoutError), breaks the protocol, trickles its reply (each byte renews
    redis-py's timeout of one read), announces 2 GiB or nests past the parser's recursion (a
    RecursionError, no error of redis), the env's guard (and the bounded client it gives
    Inductor's backend) makes each read a miss, said once, by one deadline."""
    with contextlib.ExitStack() as fake:
        if how in ("hung", "garbage"):
            reply = None if how == "hung" else b"\x00\xffgarbage\r\n"
            url = f"redis://127.0.0.1:{fake.enter_context(loopback_server(reply))}/0"
        else:
            head = {"trickled": SLOW, "huge": HUGE, "nested": DEEP}[how]
            url = fake.enter_context(trickle_server(head)).url
        found, err = node(wired_env, tmp_path / "a", INDUCTOR_BACKEND, CUDAENV_REMOTE_CACHE=url)
    assert (found["fx"], found["autotune"], found["got"]) == (True, True, [None, None]), found
    said = [line for line in err.splitlines() if "Inductor's remote cache is not used" in line]
    assert len(said) == 1, err
    # The first failure gives up for the process: one deadline at most, however many reads.
    assert float(str(found["seconds"])) < remote_cache.TIMEOUT + 5
    if how == "trickled":
        assert f"(TooSlow: no whole answer in {remote_cache.TIMEOUT:g}s)" in said[0]
    if how == "huge":
        assert "(TooLarge: a reply of 2147483648 bytes announced" in said[0]
    if how == "nested":
        assert "(TooDeep: a reply nested deeper than any answer to GET)" in said[0]


def test_doctor_says_the_wired_cache_answers(wired_env: Path, shared: Redis) -> None:
    done = cudaenv("doctor", "--python", str(wired_env / "bin" / "python"), "--json",
                   cwd=wired_env, check=False)  # fmt: skip
    doc = json.loads(done.stdout)
    assert doc["facts"]["remote_cache"]["status"] == "answers", doc["facts"]["remote_cache"]
    assert "remote-cache" in [f["code"] for f in doc["findings"]]
