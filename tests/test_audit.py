"""`cudaenv audit`: the judgement of an env's prebuilt binaries, on envs made of real ELF files
(tests/data/fatbin/, built by nvcc) laid out as packages lay them out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from builder.audit import scan as audit
from builder.machine import fatbin
from builder.machine.archs import Arch
from tests.helpers import REPO, cudaenv

DATA = REPO / "tests" / "data" / "fatbin"
SITE = "lib/python3.12/site-packages"


def code(kind: str, arch: str, isa: tuple[int, int] | None = None) -> fatbin.DeviceCode:
    return fatbin.DeviceCode(kind=kind, arch=Arch.parse(arch), ptx_isa=isa)  # type: ignore[arg-type]


def a_scan(*codes: fatbin.DeviceCode, needed: tuple[str, ...] = (), error: str | None = None
           ) -> fatbin.Scan:  # fmt: skip
    return fatbin.Scan(path=Path("x.so"), elf=True, codes=codes, needed=needed, machine=62,
                       error=error)  # fmt: skip


def binary(rel: str, package: str, scan: fatbin.Scan) -> audit.Binary:
    return audit.Binary(path=Path(SITE) / rel, package=package, scan=scan)


def test_a_verdict_follows_the_compatibility_rules() -> None:
    spark, blackwell = Arch.parse("12.1f"), Arch.parse("12.0f")
    common_ops = a_scan(code("sass", "9.0a"), code("sass", "12.0a"))
    assert audit.verdict(common_ops, blackwell, None) == "sass"
    assert audit.verdict(common_ops, spark, None) == "none"
    ptx_only = a_scan(code("ptx", "8.0", (9, 0)))
    assert audit.verdict(ptx_only, spark, None) == "ptx"
    # PTX newer than the driver's CUDA cannot be compiled by it.
    from builder.core.cudaversion import CudaVersion

    assert audit.verdict(ptx_only, spark, CudaVersion(major=12, minor=9)) == "none"
    # A file that could not be read whole is never covered, whatever was seen before the fault.
    broken = a_scan(code("sass", "12.0"), error="truncated")
    assert audit.verdict(broken, blackwell, None) == "unreadable"


def test_what_the_stack_loads_is_required_by_arch_and_what_it_links_too() -> None:
    found = [
        binary("sgl_kernel/sm90/common_ops.abi3.so", "sglang-kernel", a_scan(code("sass", "9.0a"))),
        binary("sgl_kernel/sm100/common_ops.abi3.so", "sglang-kernel",
               a_scan(code("sass", "12.0a"), needed=("libhelper.so",))),
        binary("sgl_kernel/flash_ops.abi3.so", "sglang-kernel", a_scan(code("sass", "9.0a"))),
        binary("helper/libhelper.so", "helper", a_scan(code("sass", "8.0"))),
        binary("nvidia/cu13/lib/libcufft.so.12", "nvidia-cufft", a_scan(code("sass", "7.5"))),
        binary("torch/lib/libtorch_cuda.so", "torch",
               a_scan(code("sass", "12.0"), needed=("libcufft.so.12",))),
    ]  # fmt: skip
    hopper = audit.required_on(found, (9, 0))
    spark = audit.required_on(found, (12, 1))
    names = {p.name for p in spark}
    assert "common_ops.abi3.so" in {p.name for p in hopper}
    assert Path(SITE, "sgl_kernel/sm90/common_ops.abi3.so") in hopper
    assert Path(SITE, "sgl_kernel/sm100/common_ops.abi3.so") in spark
    assert Path(SITE, "sgl_kernel/sm90/common_ops.abi3.so") not in spark
    assert "libhelper.so" in names  # linked by a required binary
    assert "flash_ops.abi3.so" not in names  # loaded in a try: optional
    assert "libcufft.so.12" not in names  # NVIDIA's libraries choose their kernels at run time
    done = audit.Audit(
        env=Path("/e"), archs=(Arch.parse("12.1f"),), driver_cuda=None, binaries=tuple(found),
        judgements=tuple(audit.judge(found, [Arch.parse("12.1f")], None)), linked=(),
        other_majors=(), major=13, mapped=None, seconds=0.0,
    )  # fmt: skip
    assert done.failures == [
        f"sglang-kernel: {SITE}/sgl_kernel/sm100/common_ops.abi3.so holds sm_120a: no code for "
        "12.1f (needed there: sgl_kernel's load_utils takes sm100/common_ops on every CC but 9.0)",
        f"helper: {SITE}/helper/libhelper.so holds sm_80: no code for 12.1f (needed there: "
        "linked by common_ops.abi3.so)",
    ]


def test_cuda_majors_come_only_from_sonames_that_carry_them() -> None:
    assert audit.cuda_major_of("libcudart.so.13") == ("libcudart", 13)
    assert audit.cuda_major_of("libnvrtc.so.12") == ("libnvrtc", 12)
    # cuFFT and cuRAND number their own majors: CUDA 13 ships libcufft.so.12, libcurand.so.10.
    assert audit.cuda_major_of("libcufft.so.12") is None
    assert audit.cuda_major_of("libcurand.so.10") is None
    assert audit.cuda_major_of("libc10_cuda.so") is None


def fake_env(root: Path) -> Path:
    """An env whose torch ships the nvcc-built libshared.so (sm_120, links libcudart.so.13)
    and a cu12 package that something requires."""
    site = root / SITE
    lib = site / "torch" / "lib"
    lib.mkdir(parents=True)
    shutil.copy(DATA / "libshared.so", lib / "libtorch_cuda.so")
    (site / "torch-2.14.1.dist-info").mkdir()
    (site / "torch-2.14.1.dist-info" / "RECORD").write_text("torch/lib/libtorch_cuda.so,,\n")
    for name, requires in (
        ("nvidia_cutlass_dsl-4.8.0", "Requires-Dist: nvidia-cutlass-dsl-libs-cu12==4.8.0\n"),
        ("nvidia_cutlass_dsl_libs_cu12-4.8.0", ""),
    ):
        meta = site / f"{name}.dist-info"
        meta.mkdir()
        dist, version = name.rsplit("-", 1)
        (meta / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n{requires}\nbody\n"
        )
    return root


def test_an_env_of_real_binaries_is_judged_and_a_second_audit_reads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = fake_env(tmp_path / "env")
    cache = audit.ScanCache(tmp_path / "scans.json")
    done = audit.run(env, [Arch.parse("12.0f"), Arch.parse("9.0a")], driver_cuda=None,
                     cache=cache, major=13)  # fmt: skip
    assert [str(b.path) for b in done.with_code] == [f"{SITE}/torch/lib/libtorch_cuda.so"]
    assert done.with_code[0].package == "torch"
    assert done.failures == [
        f"torch: {SITE}/torch/lib/libtorch_cuda.so holds sm_120: no code for 9.0a (needed "
        "there: torch loads its libraries at import)"
    ]
    assert any("nvidia-cutlass-dsl-libs-cu12 4.8.0 (CUDA 12) is installed, required by "
               "nvidia-cutlass-dsl" in w for w in done.warnings)  # fmt: skip
    assert [(ln.library, ln.major) for ln in done.linked] == [("libcudart", 13)]
    # Unchanged files are not read again.
    calls: list[Path] = []
    real = fatbin.scan

    def counted(path: Path) -> fatbin.Scan:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(fatbin, "scan", counted)
    again = audit.run(env, [Arch.parse("12.0f")], driver_cuda=None,
                      cache=audit.ScanCache(tmp_path / "scans.json"), major=13)  # fmt: skip
    assert calls == [] and not again.failures


def test_a_scan_cache_that_is_not_ours_is_ignored(tmp_path: Path) -> None:
    env = fake_env(tmp_path / "env")
    cached = tmp_path / "scans.json"
    target = env / SITE / "torch" / "lib" / "libtorch_cuda.so"
    key = audit.ScanCache.key(target)
    forged = {"elf": True, "codes": [["sass", "9.0a", None]], "needed": [], "machine": 62,
              "error": None}  # fmt: skip
    # A malformed entry decides nothing: the file itself is read (sm_120 does not run on 9.0).
    cached.write_text(json.dumps({key: {**forged, "elf": "yes"}}))
    done = audit.run(env, [Arch.parse("9.0a")], driver_cuda=None,
                     cache=audit.ScanCache(cached), major=13)  # fmt: skip
    assert done.failures
    # A well-formed one in a cache file another user may write is not read at all.
    cached.write_text(json.dumps({key: forged}))
    assert audit.ScanCache(cached).entries  # ours: read
    cached.chmod(0o666)
    assert audit.ScanCache(cached).entries == {}
    cached.unlink()
    (tmp_path / "elsewhere.json").write_text(json.dumps({key: forged}))
    cached.symlink_to(tmp_path / "elsewhere.json")
    assert audit.ScanCache(cached).entries == {}
    cached.unlink()
    cached.write_text("not json")
    assert audit.ScanCache(cached).entries == {}


def test_the_cli_needs_an_arch_and_one_target(tmp_path: Path) -> None:
    env = fake_env(tmp_path / "env")
    (env / "bin").mkdir()
    both = cudaenv("audit", "x.yaml", "--python", str(env), cwd=tmp_path, check=False)
    assert both.returncode == 2 and "one of them" in both.stderr
    bad = cudaenv("audit", "--python", str(env), "--archs", "12.1x", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "--archs '12.1x'" in bad.stderr
    assert "Traceback" not in both.stderr + bad.stderr


def test_the_import_probe_runs_again_only_when_the_env_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    env = fake_env(tmp_path / "env")
    runs: list[str] = []
    real = audit.probe_maps

    def counted(python: Path, modules: list[str], *, env: object = None) -> audit.Mapped:
        runs.append("probe")
        return real(python, modules)

    monkeypatch.setattr(audit, "probe_maps", counted)

    def once() -> audit.Audit:
        return audit.run(env, [Arch.parse("12.0f")], driver_cuda=None, major=13,
                         cache=audit.ScanCache(tmp_path / "scans.json"),
                         probe=(Path(sys.executable), ["json"], None))  # fmt: skip

    first = once()
    assert first.mapped is not None and first.mapped.imported == ("json",)
    assert once().mapped == first.mapped and runs == ["probe"]
    # A distribution installed or changed: its RECORD is new, so the probe runs again.
    (env / SITE / "torch-2.14.1.dist-info" / "RECORD").write_text("changed,,\n")
    once()
    assert runs == ["probe", "probe"]


def test_a_recorded_path_with_a_comma_keeps_its_owner(tmp_path: Path) -> None:
    """RECORD quotes a path holding a comma (PEP 376, csv): split on the first comma, the
    file was owned by a path that does not exist and the package was lost."""
    site = tmp_path / "site-packages"
    info = site / "pkg-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "RECORD").write_text('"pkg/lib,v2.so",sha256=x,3\npkg/plain.so,,\n')
    owners = audit._owners(site)
    assert owners == {"pkg/lib,v2.so": "pkg", "pkg/plain.so": "pkg"}


def test_what_the_env_built_from_an_sdist_is_required_and_its_cubins_checked(
    tmp_path: Path,
) -> None:
    """A package cudaenv compiled from its sdist was built for the env's archs alone: each of
    its binaries with device code is required on every target (the audit fails an H100 for a
    build of 12.0 only), and the cubin check lists it among what it inspects."""
    from dataclasses import replace

    from builder.env import manifest
    from builder.verify import cubin
    from tests.test_doctor import a_manifest

    env = fake_env(tmp_path / "env")
    site = env / SITE
    (site / "testext").mkdir()
    shutil.copy(DATA / "libshared.so", site / "testext" / "_C.so")  # sm_120 only
    true = shutil.which("true")
    assert true is not None
    shutil.copy(true, site / "testext" / "host.so")  # an ELF of host code only
    info = site / "cudaenv_testext-0.1.0.dist-info"
    info.mkdir()
    outside = tmp_path / "elsewhere.so"
    shutil.copy(DATA / "libshared.so", outside)
    (site / "testext" / "linked.so").symlink_to(outside)
    (info / "RECORD").write_text("testext/_C.so,,\ntestext/host.so,,\ntestext/linked.so,,\n")

    def failures() -> list[str]:
        cache = audit.ScanCache(tmp_path / "scans.json")
        done = audit.run(env, [Arch.parse("9.0a")], driver_cuda=None, cache=cache, major=13)
        return [f for f in done.failures if "testext" in f]

    assert failures() == []  # not cudaenv's build: listed, not required
    assert cubin.built_extensions(env) == []
    made = replace(a_manifest(), source_builds=(("cudaenv-testext", "0.1.0", "s" * 64, "k" * 16),))
    manifest.write(made, env)
    assert failures() == [
        f"cudaenv-testext: {SITE}/testext/_C.so holds sm_120: no code for 9.0a (needed there: "
        f"{audit.BUILT_HERE})"
    ]
    assert cubin.built_extensions(env) == [
        ("cudaenv-testext testext/_C.so", site / "testext" / "_C.so")
    ]


def test_a_cpu_build_of_a_package_built_here_is_judged_never_skipped() -> None:
    """A package the env built from its sdist whose modules link torch and hold no device code
    (its setup.py chose a CppExtension on a box without a GPU) is judged as holding nothing
    for each arch and fails where it is required; a package with one module of code and a host
    helper beside it, or one not built here, is not."""
    torch_linked = a_scan(needed=("libc10.so", "libtorch_cpu.so"))
    found = [
        binary("cpuext/_C.so", "cpu-ext", torch_linked),
        binary("cpuext/_plain.so", "cpu-ext", a_scan(needed=("libc.so.6",))),
        binary("mixed/_C.so", "mixed", a_scan(code("sass", "12.0"))),
        binary("mixed/_host.so", "mixed", torch_linked),
        binary("wheel/_C.so", "from-a-wheel", torch_linked),
    ]
    built = frozenset({"cpu-ext", "mixed"})
    assert audit.built_without_cuda(found, built) == {Path(SITE) / "cpuext/_C.so"}
    judged = audit.judge(found, [Arch.parse("12.0f")], None, built)
    failing = [(str(j.binary.path), j.verdict, j.required) for j in judged if not j.covered]
    assert failing == [(f"{SITE}/cpuext/_C.so", "none", audit.BUILT_HERE)]
