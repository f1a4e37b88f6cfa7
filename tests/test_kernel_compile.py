"""kernel-compile on a stand-in nvcc (a shell script at the one seam: the nvcc binary): the
build key covers the host compiler and nvcc's environment flags, reuse is said, a missing
host compiler is a missing tool, a missing header names its component. The real nvcc runs in
the e2e tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from builder.core.statuses import FAILED, PASSED
from builder.machine import archs
from builder.spec import channels
from builder.verify import kernel_compile
from builder.verify.model import EnvFacts, Target
from tests.helpers import env_facts, write

FAKE_NVCC = r"""#!/bin/sh
# A stand-in nvcc: checks its host compiler the way nvcc does (runs gcc from PATH) and the
# flags it reads from the environment, then "compiles" by writing the output file.
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0; fi
echo "$@ $NVCC_APPEND_FLAGS" >> "$(dirname "$0")/calls"
gcc --version >/dev/null 2>&1 || {
  echo "gcc: No such file or directory" >&2
  echo "nvcc fatal   : Failed to preprocess host compiler properties." >&2; exit 1; }
case " $NVCC_APPEND_FLAGS " in *" --bogus "*) echo "nvcc fatal   : Unknown option '--bogus'" >&2; exit 1;; esac
if [ -n "$FAKE_MISSING_HEADER" ]; then
  echo "topk_topp.cu:3:10: fatal error: $FAKE_MISSING_HEADER: No such file or directory" >&2; exit 1
fi
dep=""
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then cp "@KERNEL@" "$2"; fi
  if [ "$1" = "-MF" ]; then dep="$2"; fi
  shift
done
# The depfile nvcc writes with --generate-dependencies-with-compile: the CUB header it read.
if [ -n "$dep" ]; then echo "out: $(dirname "$0")/../include/cub.cuh" > "$dep"; fi
"""
# What it "compiles": an nvcc object holding sm_90a and sm_120f cubins (tests/data/fatbin), so
# that what the store hands back passes the check a placed kernel gets.
FAKE_NVCC = FAKE_NVCC.replace("@KERNEL@", str(Path(__file__).parent / "data/fatbin/mixed.o"))


@pytest.fixture
def toolkit(tmp_path: Path) -> Path:
    return make_toolkit(tmp_path / "cuda-home")


def make_toolkit(home: Path, cub: str = "CUB 13.0") -> Path:
    write(home / "bin" / "nvcc", FAKE_NVCC).chmod(0o755)
    write(home / "include" / "cub.cuh", cub)
    return home


def gcc_dir(tmp_path: Path, banner: str) -> Path:
    d = tmp_path / f"gcc-{abs(hash(banner))}"
    write(d / "gcc", f"#!/bin/sh\necho '{banner}'\n").chmod(0o755)
    return d


def env_with(tmp_path: Path, banner: str | None, **extra: str) -> dict[str, str]:
    path = "/usr/bin:/bin" if banner is None else f"{gcc_dir(tmp_path, banner)}:/usr/bin:/bin"
    if banner is None:
        # A PATH without any gcc: only the shell's own tools.
        tools = tmp_path / "tools"
        tools.mkdir(exist_ok=True)
        for t in ("dirname", "sh", "echo"):
            src = Path("/bin") / t
            if src.exists() and not (tools / t).exists():
                (tools / t).symlink_to(src)
        path = str(tools)
    return {"PATH": path, **extra}


def target(tmp_path: Path, **changes: object) -> Target:
    base = Target(
        python=Path("/env/bin/python"),
        archs=archs.parse_list("9.0a 12.0f"),
        work=tmp_path / "work",
        env_dir=Path("/env"),
        expected_cuda="13.0",
        spec_name="x",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def facts(home: Path, environ: dict[str, str]) -> EnvFacts:
    return env_facts(cuda_home=str(home), nvcc_path=str(home / "bin" / "nvcc"), environ=environ)


def test_builds_then_says_reused_and_fresh_rebuilds(tmp_path: Path, toolkit: Path) -> None:
    env = env_with(tmp_path, "gcc (Debian 12.2.0-14) 12.2.0")
    first = kernel_compile.check(target(tmp_path), facts(toolkit, env))
    assert first.status == PASSED, first.summary
    assert "reused" not in first.summary
    second = kernel_compile.check(target(tmp_path), facts(toolkit, env))
    assert second.status == PASSED
    assert second.summary.endswith("(reused for 9.0a 12.0f)")
    calls = (toolkit / "bin" / "calls").read_text().splitlines()
    assert len(calls) == 2
    fresh = kernel_compile.check(target(tmp_path, fresh=True), facts(toolkit, env))
    assert "reused" not in fresh.summary
    assert len((toolkit / "bin" / "calls").read_text().splitlines()) == 4


def test_another_host_compiler_is_another_build(tmp_path: Path, toolkit: Path) -> None:
    nvcc = toolkit / "bin" / "nvcc"
    arch = archs.Arch.parse("9.0a")
    work = tmp_path / "work"
    one = kernel_compile.build_kernel(nvcc, arch, work, env=env_with(tmp_path, "gcc 12.2.0"))
    two = kernel_compile.build_kernel(nvcc, arch, work, env=env_with(tmp_path, "gcc 14.1.0"))
    assert not one.reused and not two.reused and one.path != two.path
    flags = env_with(tmp_path, "gcc 12.2.0", NVCC_PREPEND_FLAGS="-lineinfo")
    three = kernel_compile.build_kernel(nvcc, arch, work, env=flags)
    assert not three.reused and three.path not in (one.path, two.path)


def test_no_host_compiler_is_a_missing_tool_even_with_a_cached_build(
    tmp_path: Path, toolkit: Path
) -> None:
    ok = kernel_compile.check(target(tmp_path), facts(toolkit, env_with(tmp_path, "gcc 12")))
    assert ok.status == PASSED
    result = kernel_compile.check(target(tmp_path), facts(toolkit, env_with(tmp_path, None)))
    assert result.status == FAILED
    assert result.missing_tool == "host compiler"
    assert (
        result.summary == "nvcc 13.0 has no host compiler: no host compiler gcc on the env's PATH"
    )
    assert result.fix.startswith("install a C++ compiler nvcc supports")
    assert "drop the arch" not in result.fix


def test_the_envs_nvcc_flags_take_part(tmp_path: Path, toolkit: Path) -> None:
    env = env_with(tmp_path, "gcc 12", NVCC_APPEND_FLAGS="--bogus")
    result = kernel_compile.check(target(tmp_path), facts(toolkit, env))
    assert result.status == FAILED
    assert "Unknown option '--bogus'" in result.summary
    assert result.missing_tool is None
    assert "NVCC_*_FLAGS" in result.fix


def test_a_missing_cccl_header_names_the_component(tmp_path: Path, toolkit: Path) -> None:
    env = env_with(tmp_path, "gcc 12", FAKE_MISSING_HEADER="cub/block/block_reduce.cuh")
    result = kernel_compile.check(target(tmp_path), facts(toolkit, env))
    assert result.status == FAILED
    assert result.summary.startswith("nvcc 13.0 cannot find cub/block/block_reduce.cuh")
    assert result.fix.startswith("add 'cccl' to the spec's toolchain.components")


def test_missing_header_table() -> None:
    assert channels.missing_header("x.cu:1:10: fatal error: curand.h: No such file") == (
        "curand.h",
        "curand",
    )
    assert channels.missing_header(
        'x.cu(3): catastrophic error: cannot open source file "thrust/sort.h"'
    ) == (
        "thrust/sort.h",
        "cccl",
    )
    assert channels.missing_header("all good") is None
    assert channels.missing_header("fatal error: mylib.h: No such file") == ("mylib.h", None)


def test_host_compiler_named_by_ccbin(tmp_path: Path) -> None:
    d = gcc_dir(tmp_path, "clang version 18")
    clang = write(d / "clang++", "#!/bin/sh\necho 'clang version 18'\n")
    clang.chmod(0o755)
    host = kernel_compile.host_compiler(
        {"PATH": "/nonexistent", "NVCC_PREPEND_FLAGS": f"-ccbin {clang}"}
    )
    assert host.path == str(clang) and "clang version 18" in host.identity
    missing = kernel_compile.host_compiler({"PATH": "/nonexistent", "NVCC_CCBIN": "/nope/g++"})
    assert missing.path is None and "named by -ccbin/NVCC_CCBIN (/nope/g++)" in str(missing.error)


@pytest.mark.parametrize("change", [None, "nvcc", "cccl", "arch", "host compiler"])
def test_the_store_serves_another_env_of_the_same_toolchain_only(
    tmp_path: Path, change: str | None
) -> None:
    """Env A builds; env B (another path, its own work dir) reuses A's binary from the
    machine-wide store, unless its nvcc, its CCCL header, the arch or the host compiler
    differ: then B compiles."""
    env = env_with(tmp_path, "gcc 12.2.0")
    a = make_toolkit(tmp_path / "envA" / "cuda-home")
    arch = archs.Arch.parse("12.0f")
    first = kernel_compile.build_kernel(
        a / "bin" / "nvcc", arch, tmp_path / "envA" / "work", env=env, owner="envA"
    )
    assert first.error is None and first.stored is None
    b = make_toolkit(
        tmp_path / "envB" / "cuda-home", cub="CUB 13.3" if change == "cccl" else "CUB 13.0"
    )
    if change == "nvcc":
        write(b / "bin" / "nvcc", FAKE_NVCC + "# 13.5\n").chmod(0o755)
    if change == "host compiler":
        env = env_with(tmp_path, "gcc 14.1.0")
    arch_b = archs.Arch.parse("9.0a") if change == "arch" else arch
    second = kernel_compile.build_kernel(
        b / "bin" / "nvcc", arch_b, tmp_path / "envB" / "work", env=env, owner="envB"
    )
    assert second.error is None
    calls_b = b / "bin" / "calls"
    if change is None:
        assert second.reused and second.stored is not None
        assert second.stored[1] == "envA"
        assert not calls_b.exists()  # B's nvcc never ran
        assert second.path.read_bytes() == first.path.read_bytes()
        result = kernel_compile.check(
            target(
                tmp_path, archs=(arch,), work=tmp_path / "envC" / "work", env_dir=tmp_path / "envC"
            ),
            facts(make_toolkit(tmp_path / "envC" / "cuda-home"), env),
        )
        assert "reused from the store: 12.0f: first built " in result.summary
        assert result.summary.endswith("for envA)")
    else:
        assert not second.reused and second.stored is None
        assert len(calls_b.read_text().splitlines()) == 1


def test_a_built_kernel_another_user_could_write_is_rebuilt_not_run(
    tmp_path: Path, toolkit: Path
) -> None:
    """The sampling check runs the kernel this check built: one that another user could have
    written since (group/other-writable, or a link at its name) is never reused."""
    nvcc = toolkit / "bin" / "nvcc"
    arch = archs.Arch.parse("9.0a")
    work = tmp_path / "work"
    env = env_with(tmp_path, "gcc 12.2.0")
    first = kernel_compile.build_kernel(nvcc, arch, work, env=env)
    assert kernel_compile.build_kernel(nvcc, arch, work, env=env).reused
    first.path.chmod(0o666)
    again = kernel_compile.build_kernel(nvcc, arch, work, env=env)
    # Placed anew (from the machine-wide store, hash-checked), not the writable file.
    assert again.path == first.path and again.stored
    assert not again.path.stat().st_mode & 0o022
    elsewhere = tmp_path / "planted"
    elsewhere.write_bytes(b"#!/bin/sh\n")
    first.path.unlink()
    first.path.symlink_to(elsewhere)
    third = kernel_compile.build_kernel(nvcc, arch, work, env=env)
    assert third.stored and not first.path.is_symlink()
    assert elsewhere.read_bytes() == b"#!/bin/sh\n"
