"""Packages that compile at install, with the real thing: a test sdist (tests/sdist_maker.py:
a setup.py that imports torch, a CUDAExtension from one .cu, a download unless forced) locked
from a find-links directory by uv, built by `cudaenv build` in an env of torch 2.14.1 with
the env's nvcc 13.0 while the shell's CUDA_HOME names a toolkit whose nvcc says 12.8, kept in
the store and pushed to Debian's docker-registry; a second env takes it from the store and a
second node from the registry, with no compile. A build that downloads and a release that
passes -std=c++17 each fail in one line, the previous env kept."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from builder import store as jit_store
from builder.env import export as exporting
from builder.env import wheelproof
from builder.machine import fatbin
from builder.machine.archs import Arch
from tests.conftest import Registry
from tests.helpers import cudaenv, write
from tests.sdist_maker import FORCE, MODULE, NAME, make_sdist

pytestmark = [pytest.mark.e2e, pytest.mark.network]

COMPILING = "compiling from its sdist"
SPEC = """\
name: testext-cu130
python: "3.12"
cuda: "13.0"
torch: "2.14.1"
packages: [{package}]
toolchain: {{source: wheels, components: [nvcc, cudart, crt, nvvm, cccl]}}
archs: ["12.0f"]
{build_env}verify: [toolchain]
"""


def project(
    root: Path,
    *,
    version: str = "0.1.0",
    forced: bool = True,
    extra: str = "",
    prelude: str = "",
    force_cuda: bool = False,
) -> Path:
    """A project whose spec asks for the test sdist, served from ``links/``."""
    make_sdist(
        root / "links", version=version, extra_nvcc=extra, prelude=prelude, force_cuda=force_cuda
    )
    build_env = f'build-env: {{{FORCE}: "TRUE"}}\n' if forced else ""
    write(root / "pyproject.toml", '[tool.cudaenv]\nlocks = "urls"\n')
    write(
        root / "envspecs" / "testext.yaml",
        SPEC.format(package=f"{NAME}=={version}", build_env=build_env),
    )
    # A toolkit whose nvcc says 12.8 where the shell points: the build must not use it.
    fake = write(root / "cuda-12.8" / "bin" / "nvcc", "#!/bin/sh\necho 'release 12.8, V12.8.93'\n")
    fake.chmod(0o755)
    return root


def node(root: Path, store: str, remote: str = "off", push: bool = False) -> dict[str, str]:
    """What a machine's shell gives cudaenv: its index (here also the find-links directory,
    for uv and for pip), its store and registry, and a CUDA_HOME of another CUDA."""
    links = str(root / "links")
    return {
        "UV_FIND_LINKS": links,
        "PIP_FIND_LINKS": links,
        "CUDA_HOME": str(root / "cuda-12.8"),
        "CUDAENV_JIT_STORE": str(root / store),
        "CUDAENV_JIT_REMOTE": remote,
        "CUDAENV_JIT_PUSH": "1" if push else "0",
    }


def build(
    root: Path, env_dir: str, environ: dict[str, str], check: bool = True
) -> subprocess.CompletedProcess[str]:
    return cudaenv(
        "build", "envspecs/testext.yaml", "--env-dir", str(root / env_dir),
        cwd=root, env=environ, check=check,
    )  # fmt: skip


def extension_of(env: Path) -> Path:
    found = sorted(env.glob(f"lib/python3.12/site-packages/{MODULE}/_C*.so"))
    assert len(found) == 1, found
    return found[0]


def imports(env: Path) -> str:
    done = subprocess.run(
        [env / "bin" / "python", "-c", f"import torch, {MODULE}._C as c; print(c.add_one)"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One machine's store for the tests of this module: what one compiles, the next takes."""
    return tmp_path_factory.mktemp("machine") / "store"


def test_an_sdist_builds_with_the_envs_nvcc_once_for_the_store_and_the_registry(
    tmp_path: Path, registry: Registry, shared_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = project(tmp_path)
    (root / "store-a").symlink_to(shared_store, target_is_directory=True)
    cudaenv("lock", "envspecs/testext.yaml", cwd=root, env=node(root, "store-a"))
    lock = (root / "envspecs" / "locks" / "pylock.testext-cu130.toml").read_text()
    assert 'name = "cudaenv_testext-0.1.0.tar.gz"' in lock  # the lock records the sdist

    first = build(root, "a1", node(root, "store-a", registry.url, push=True))
    assert f"{NAME} 0.1.0: {COMPILING} with nvcc 13.0 for 12.0f" in first.stderr
    # The lock's wheels are proven before the sdist's setup.py runs in the env.
    proofs = re.findall(r"every file of (\d+) packages' RECORD in place", first.stderr)
    assert len(proofs) == 1, first.stderr
    assert first.stderr.index("RECORD in place") < first.stderr.index(COMPILING)
    assert "pushed " in first.stderr
    env = root / "a1"
    assert "add_one" in imports(env)
    scan = fatbin.scan(extension_of(env))
    assert {(c.kind, c.arch) for c in scan.codes} >= {
        ("sass", Arch(major=12, minor=0, suffix=""))
    }, scan
    made = json.loads((env / "cudaenv.json").read_text())["source_builds"]
    assert [row[:2] for row in made] == [[NAME, "0.1.0"]]

    plan = cudaenv("plan", "envspecs/testext.yaml", cwd=root, env=node(root, "store-a")).stdout
    assert f"{NAME} (source)" in plan and "compiled from its sdist at build" in plan
    assert "the store holds a build of it that took" in plan

    # A second env on the same machine: from the store, nothing compiled.
    second = build(root, "a2", node(root, "store-a"))
    assert COMPILING not in second.stderr
    assert f"{NAME} 0.1.0: taken from the store" in second.stderr
    # Nothing ran in the env: the lock's RECORDs read once (as uv installed the placed wheel),
    # then the placed wheel's alone.
    again = re.findall(r"every file of (\d+) packages' RECORD in place", second.stderr)
    assert again == proofs, second.stderr
    assert "1 package(s) built from source and proven" in second.stderr
    assert json.loads((root / "a2" / "cudaenv.json").read_text())["source_builds"] == made
    imports(root / "a2")

    # A second node: an empty store of its own and the registry.
    third = build(root, "b1", node(root, "store-b", registry.url))
    assert COMPILING not in third.stderr
    assert f"taken from the JIT remote {registry.url}" in third.stderr
    assert extension_of(root / "b1").read_bytes() == extension_of(env).read_bytes()

    # An air-gapped node: `export --with-jit` carries the built wheel with the env's other
    # JIT results (each env lists the entry it was made with or from).
    for made_in in ("a1", "a2"):
        used = jit_store.used_entries(root / made_in)
        assert len(used) == 1, used
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(root / "store-a"))
    wheelhouse = root / "wheelhouse"
    assert exporting.export_jit(root / "a2", wheelhouse) == 1
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(root / "store-c"))
    assert exporting.import_jit(wheelhouse) == (1, None)
    fourth = build(root, "c1", node(root, "store-c"))
    assert COMPILING not in fourth.stderr
    assert f"{NAME} 0.1.0: taken from the store" in fourth.stderr


def test_warm_builds_an_sdist_ahead_under_the_key_an_env_of_that_arch_list_asks_for(
    tmp_path: Path, shared_store: Path
) -> None:
    """`cudaenv warm --archs 9.0a` of an env with no FlashInfer compiles the spec's sdist
    package for 9.0a into the store and leaves the env as it was; a second warm finds it, and
    an env built from a spec of 9.0a installs it with no compile."""
    root = project(tmp_path)
    environ = {**node(root, "unused"), "CUDAENV_JIT_STORE": str(shared_store)}
    cudaenv("lock", "envspecs/testext.yaml", cwd=root, env=environ)
    build(root, "a1", environ)
    before = extension_of(root / "a1").read_bytes()
    argv = ["warm", "envspecs/testext.yaml", "--env-dir", str(root / "a1"), "--archs", "9.0a"]
    warmed = cudaenv(*argv, cwd=root, env=environ)
    assert f"{NAME} 0.1.0 (sdist) (9.0a): built in " in warmed.stderr, warmed.stderr[-2000:]
    assert "1 built, 0 already warm, 0 failed" in warmed.stdout
    assert extension_of(root / "a1").read_bytes() == before
    assert not (root / "a1" / "var" / "source-builds").exists()
    again = cudaenv(*argv, cwd=root, env=environ)
    assert f"{NAME} 0.1.0 (sdist) (9.0a): already warm" in again.stderr
    assert COMPILING not in again.stderr

    spec = root / "envspecs" / "testext.yaml"
    other = root / "envspecs" / "testext90.yaml"
    other.write_text(
        spec.read_text()
        .replace("name: testext-cu130", "name: testext90-cu130")
        .replace('archs: ["12.0f"]', 'archs: ["9.0a"]')
    )
    cudaenv("lock", "envspecs/testext90.yaml", cwd=root, env=environ)
    done = cudaenv(
        "build", "envspecs/testext90.yaml", "--env-dir", str(root / "h1"), cwd=root, env=environ
    )
    assert COMPILING not in done.stderr
    assert f"{NAME} 0.1.0: taken from the store" in done.stderr
    scan = fatbin.scan(extension_of(root / "h1"))
    assert ("sass", Arch(major=9, minor=0, suffix="")) in {(c.kind, c.arch) for c in scan.codes}


def test_cudaenv_add_of_an_sdist_package_builds_it_into_a_built_env(
    tmp_path: Path, shared_store: Path
) -> None:
    """`cudaenv add` of a package that exists only as an sdist, on an env built without it;
    the env's pip stand-in names that command."""
    root = project(tmp_path)
    spec = root / "envspecs" / "testext.yaml"
    spec.write_text(spec.read_text().replace(f"packages: [{NAME}==0.1.0]", "packages: []"))
    environ = {**node(root, "unused"), "CUDAENV_JIT_STORE": str(shared_store)}
    cudaenv("lock", "envspecs/testext.yaml", cwd=root, env=environ)
    build(root, ".envs/testext-cu130", environ)
    env = root / ".envs" / "testext-cu130"
    refused = subprocess.run(
        [env / "bin" / "pip", "install", "--no-build-isolation", NAME],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and "cudaenv add" in refused.stderr, refused.stderr
    cudaenv("add", f"{NAME}==0.1.0", "--spec", "envspecs/testext.yaml", cwd=root, env=environ)
    assert f"{NAME}==0.1.0" in spec.read_text()
    assert "add_one" in imports(env)
    # verify's imports check imports the package and its extension module by name.
    cudaenv("verify", "envspecs/testext.yaml", "--checks", "imports", cwd=root, env=environ)
    report = json.loads((env / "var" / "cudaenv" / "verify.json").read_text())
    evidence = next(c["evidence"] for c in report["checks"] if c["name"] == "imports")
    assert evidence[f"import {MODULE}._C"].startswith("ok"), evidence


def test_a_build_that_downloads_fails_in_one_line_and_the_env_is_kept(tmp_path: Path) -> None:
    root = project(tmp_path)
    environ = node(root, "store")
    cudaenv("lock", "envspecs/testext.yaml", cwd=root, env=environ)
    # Without its FORCE_BUILD switch the setup.py reaches for a prebuilt wheel first.
    spec = root / "envspecs" / "testext.yaml"
    spec.write_text(spec.read_text().replace(f'build-env: {{{FORCE}: "TRUE"}}\n', ""))
    (root / "old").mkdir()
    (root / "old" / "keep").write_text("the previous env")
    done = build(root, "old", environ, check=False)
    assert done.returncode == 4, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {NAME} 0.1.0: the source build with nvcc 13.0 failed: ")
    assert "tried to reach the network" in last and "FORCE_BUILD" in last
    assert "Traceback" not in done.stderr
    assert (root / "old" / "keep").read_text() == "the previous env"
    assert not any(root.glob("old/lib"))


def test_a_force_cuda_sdist_is_built_for_cuda_on_a_box_without_a_gpu_and_proven(
    tmp_path: Path,
) -> None:
    """The FORCE_CUDA kind (CUDAExtension only where torch sees a GPU or FORCE_CUDA=1 says so):
    on this GPU-less box every source build is told FORCE_CUDA=1, so its module holds SASS for
    12.0f. Built again with the spec's build-env saying FORCE_CUDA=0, the CPU module it makes
    is refused in one line naming the switch; the env built first is kept whole and the store
    holds nothing of the refused build."""
    root = project(tmp_path, version="0.3.0", forced=False, force_cuda=True)
    environ = node(root, "store")
    cudaenv("lock", "envspecs/testext.yaml", cwd=root, env=environ)
    first = build(root, "env", environ)
    assert "1 package(s) built from source and proven" in first.stderr
    codes = fatbin.scan(extension_of(root / "env")).codes
    assert wheelproof.covers(codes, Arch.parse("12.0f")), codes
    assert "add_one" in imports(root / "env")
    manifest = (root / "env" / "cudaenv.json").read_text()
    entries = sorted(p.name for p in (root / "store").rglob("entry.json"))

    spec = root / "envspecs" / "testext.yaml"
    spec.write_text(spec.read_text().replace("verify:", 'build-env: {FORCE_CUDA: "0"}\nverify:'))
    cudaenv("lock", "envspecs/testext.yaml", cwd=root, env=environ)
    done = build(root, "env", environ, check=False)
    assert done.returncode == 4, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {NAME} 0.3.0 was built without CUDA: its sdist ships CUDA"), (
        last
    )
    assert "FORCE_CUDA=0" in last and "set FORCE_CUDA=1" in last and "nothing was kept" in last
    assert "Traceback" not in done.stderr
    assert (root / "env" / "cudaenv.json").read_text() == manifest
    assert sorted(p.name for p in (root / "store").rglob("entry.json")) == entries


def test_a_release_that_passes_cxx17_is_refused_before_anything_is_installed(
    tmp_path: Path,
) -> None:
    """What the sdist says of itself is said by `lock` and `plan`: its setup.py (line 9)
    passes -std=c++17 to nvcc, which torch 2.14's headers refuse. The lock is not written, and
    plan (which then resolves afresh) says the same; nothing is installed or built."""
    root = project(tmp_path, version="0.2.0", extra='"-std=c++17"')
    environ = node(root, "store")
    for argv in (("lock",), ("plan",)):
        done = cudaenv(*argv, "envspecs/testext.yaml", cwd=root, env=environ, check=False)
        assert done.returncode == 4, done.stderr[-2000:]
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: {NAME} 0.2.0 cannot build against torch 2.14.1"), last
        assert "passes -std=c++17" in last and "need C++20" in last and "line 9" in last, last
        assert "Traceback" not in done.stderr and COMPILING not in done.stderr
    assert (
        "the lock was not written"
        in cudaenv("lock", "envspecs/testext.yaml", cwd=root, env=environ, check=False).stderr
    )
    assert not (root / "envspecs" / "locks").exists() or not list(
        (root / "envspecs" / "locks").iterdir()
    )
    done = build(root, "env", environ, check=False)
    assert done.returncode != 0 and COMPILING not in done.stderr
    assert not (root / "env").exists()


# What a hostile or careless setup.py does, when pip first runs it (for its metadata, as the
# sdist is fetched) or only when it builds the wheel: one file in its home (the build's own
# tree: allowed), one planted in torch's package (the env: never), then it stops.
PLANTS = """
import pathlib, sys
if {when}:
    pathlib.Path("~/.cache/testext").expanduser().mkdir(parents=True, exist_ok=True)
    pathlib.Path(torch.__file__).with_name("planted_by_setup.py").write_text("x = 1\\n")
    sys.exit("stopped after planting")
"""


@pytest.mark.parametrize("when", ["True", "'bdist_wheel' in sys.argv"], ids=["fetch", "build"])
def test_a_build_that_writes_into_the_env_fails_in_one_line_and_nothing_is_kept(
    tmp_path: Path, when: str
) -> None:
    """The write is found by comparing the env before and after each step that runs setup.py
    (pip's metadata step as it fetches the sdist, and the build) and named, not the step's
    own exit; no env is made, nothing goes into the store. A write into the build's HOME (its
    own tree) is no fault."""
    root = project(tmp_path, version="0.3.0", prelude=PLANTS.format(when=when))
    environ = node(root, "store")
    cudaenv("lock", "envspecs/testext.yaml", cwd=root, env=environ)
    done = build(root, "env", environ, check=False)
    assert done.returncode == 4, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"{NAME} 0.3.0: its build wrote outside its own tree, into the env" in last, last
    planted = "lib/python3.12/site-packages/torch/planted_by_setup.py (added)"
    assert f"into the env: {planted}; nothing of it is installed or stored" in last, last
    assert ".cache" not in last and "Traceback" not in done.stderr
    assert not (root / "env").exists()
    assert not (root / "store").exists() or not list((root / "store").rglob("*.whl"))
    if when != "True":  # the build's log is kept, with what setup.py said
        log = Path(last.rpartition("; the whole log: ")[2])
        assert "stopped after planting" in log.read_text(), log


REAL_SPEC = """\
name: causal-conv1d-cu130
python: "3.12"
cuda: "13.0"
torch: "2.14.1"
packages: [causal-conv1d==1.5.2]
archs: ["12.0f"]
build-env: {CAUSAL_CONV1D_FORCE_BUILD: "TRUE"}
verify: [toolchain]
"""


# The index as it stood on this day: the releases these tests name, and what they depend on,
# resolve the same whatever is published later.
VIEW = ("--exclude-newer", "2026-12-01T00:00:00Z")


def test_a_real_release_that_asks_nvcc_13_for_compute_53_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    """causal-conv1d 1.5.2 from PyPI: resolved without building it (its PKG-INFO is 2.1, so uv
    would run its setup.py, which imports torch: cudaenv hands uv its metadata), then refused
    by `lock` itself, before anything is installed, since its sdist's setup.py (line 177) asks
    for compute_53, which nvcc 13.0 lacks: the lock is not written."""
    write(tmp_path / "pyproject.toml", '[tool.cudaenv]\nlocks = "urls"\n')
    write(tmp_path / "envspecs" / "cc.yaml", REAL_SPEC)
    uv_cache = tmp_path / "uv-cache"
    done = cudaenv("lock", "envspecs/cc.yaml", *VIEW, cwd=tmp_path,
                   env={"UV_CACHE_DIR": str(uv_cache)}, check=False)  # fmt: skip
    assert not list(uv_cache.glob("builds-v*")) or not any(uv_cache.glob("builds-v*/*"))
    # Refused at lock, before anything is installed, by what the sdist's setup.py says.
    assert done.returncode == 4, done.stderr[-2000:]
    assert COMPILING not in done.stderr and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "causal-conv1d 1.5.2 cannot build with nvcc 13.0" in last, last
    assert "(line 177) asks for compute_53" in last and "compute_75 and newer" in last, last
    assert last.endswith("the lock was not written"), last
    assert not (tmp_path / "envspecs" / "locks" / "pylock.causal-conv1d-cu130.toml").exists()


CAUSAL_CONV1D = "causal_conv1d_cuda"


def real_project(root: Path, name: str, text: str) -> dict[str, str]:
    """A project at ``root`` whose spec ``envspecs/NAME`` is ``text`` (a real PyPI release),
    and the environment its builds run in: a store of its own, and a CUDA_HOME whose nvcc
    says 12.8, which the build must not use."""
    write(root / "pyproject.toml", '[tool.cudaenv]\nlocks = "urls"\n')
    write(root / "envspecs" / name, text)
    fake = write(root / "cuda-12.8" / "bin" / "nvcc", "#!/bin/sh\necho 'release 12.8, V12.8.93'\n")
    fake.chmod(0o755)
    return {"CUDA_HOME": str(root / "cuda-12.8"), "CUDAENV_JIT_STORE": str(root / "store")}


DEEPSPEED_SPEC = """\
name: deepspeed-cu130
python: "3.12"
cuda: "13.0"
torch: "2.14.1"
packages: [deepspeed==0.19.8]
archs: ["12.0f"]
build-env: {DS_BUILD_OPS: "0", DS_BUILD_FUSED_ADAM: "1"}
verify: [toolchain]
"""
FUSED_ADAM = "deepspeed/ops/adam/fused_adam_op"


def test_a_real_release_from_pypi_builds_its_cuda_op_with_the_envs_nvcc_once_per_machine(
    tmp_path: Path,
) -> None:
    """DeepSpeed 0.19.8 from its PyPI sdist with its fused Adam op built at install (about
    130 s of nvcc on 2 cores: the default suite's real release; causal-conv1d 1.7.0's nine
    gencodes take half an hour and run in the heavy session). The spec names only the op: the
    recipe table gives DeepSpeed DS_ACCELERATOR=cuda, as a build box without a GPU needs
    (without it DeepSpeed picks its CPU accelerator from what torch sees and builds the op for
    the CPU), and the proof reads the op's device code. Compiled with the env's nvcc 13.0 while the shell's
    CUDA_HOME names a 12.8 toolkit, the op links cudart and holds sm_120 code, imports after
    torch, and a second env takes it from the store with no compile."""
    environ = real_project(tmp_path, "ds.yaml", DEEPSPEED_SPEC)
    cudaenv("lock", "envspecs/ds.yaml", *VIEW, cwd=tmp_path, env=environ)
    first = cudaenv("build", "envspecs/ds.yaml", "--env-dir", str(tmp_path / "a"),
                    cwd=tmp_path, env=environ)  # fmt: skip
    assert "deepspeed 0.19.8: compiling from its sdist with nvcc 13.0 for 12.0f" in first.stderr, (
        first.stderr[-3000:]
    )
    [op] = (tmp_path / "a").glob(f"lib/python3.12/site-packages/{FUSED_ADAM}*.so")
    codes = {(c.kind, c.arch) for c in fatbin.scan(op).codes}
    assert ("sass", Arch(major=12, minor=0, suffix="")) in codes, codes
    needed = subprocess.run(["readelf", "-d", op], capture_output=True, text=True, timeout=60)
    assert "libcudart.so.13" in needed.stdout, needed.stdout
    done = subprocess.run(
        [tmp_path / "a" / "bin" / "python", "-c",
         "import torch, deepspeed.ops.adam.fused_adam_op as op; print(op.__file__)"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith(".so"), done.stderr[-3000:]

    second = cudaenv("build", "envspecs/ds.yaml", "--env-dir", str(tmp_path / "b"),
                     cwd=tmp_path, env=environ)  # fmt: skip
    assert COMPILING not in second.stderr
    assert "deepspeed 0.19.8: taken from the store" in second.stderr, second.stderr[-3000:]
    [again] = (tmp_path / "b").glob(f"lib/python3.12/site-packages/{FUSED_ADAM}*.so")
    assert again.read_bytes() == op.read_bytes()


@pytest.mark.heavy
def test_a_real_release_from_pypi_builds_with_the_envs_nvcc_and_once_per_machine(
    tmp_path: Path,
) -> None:
    """causal-conv1d 1.7.0, an sdist-only release whose setup.py imports torch, downloads a
    prebuilt wheel unless forced and passes its own nine -gencode flags (about 17 minutes of
    nvcc on 2 cores): locked without building, compiled with the env's nvcc 13.0 while the
    shell's CUDA_HOME names a 12.8 toolkit, its extension imports after torch and holds
    sm_120 code, verify's imports check covers it, and a second env takes it from the store
    with no compile."""
    environ = real_project(tmp_path, "cc.yaml", REAL_SPEC.replace("1.5.2", "1.7.0"))
    cudaenv("lock", "envspecs/cc.yaml", *VIEW, cwd=tmp_path, env=environ)
    locked = (tmp_path / "envspecs" / "locks" / "pylock.causal-conv1d-cu130.toml").read_text()
    assert "causal_conv1d-1.7.0.tar.gz" in locked
    first = cudaenv("build", "envspecs/cc.yaml", "--env-dir", str(tmp_path / "a"),
                    cwd=tmp_path, env=environ)  # fmt: skip
    assert (
        "causal-conv1d 1.7.0: compiling from its sdist with nvcc 13.0 for its setup.py's own "
        "list (7.5, 8.0, 8.7, 9.0, 10.0, 10.3, 11.0, 12.0, 12.1; the spec's 12.0f does not "
        "narrow it)"
    ) in first.stderr, first.stderr[-3000:]
    [ext] = (tmp_path / "a").glob(f"lib/python3.12/site-packages/{CAUSAL_CONV1D}*.so")
    codes = {(c.kind, c.arch) for c in fatbin.scan(ext).codes}
    assert ("sass", Arch(major=12, minor=0, suffix="")) in codes, codes
    assert ("sass", Arch(major=9, minor=0, suffix="")) in codes, codes  # its own list, whole
    checks = cudaenv("verify", "envspecs/cc.yaml", "--env-dir", str(tmp_path / "a"),
                     "--checks", "imports", cwd=tmp_path, env=environ, check=False)  # fmt: skip
    assert checks.returncode == 0, checks.stdout[-3000:] + checks.stderr[-3000:]
    report = json.loads((tmp_path / "a" / "var" / "cudaenv" / "verify.json").read_text())
    evidence = next(c["evidence"] for c in report["checks"] if c["name"] == "imports")
    assert evidence[f"import {CAUSAL_CONV1D}"].startswith("ok"), evidence

    second = cudaenv("build", "envspecs/cc.yaml", "--env-dir", str(tmp_path / "b"),
                     cwd=tmp_path, env=environ)  # fmt: skip
    assert COMPILING not in second.stderr
    assert "causal-conv1d 1.7.0: taken from the store" in second.stderr, second.stderr[-3000:]
    [again] = (tmp_path / "b").glob(f"lib/python3.12/site-packages/{CAUSAL_CONV1D}*.so")
    assert again.read_bytes() == ext.read_bytes()
