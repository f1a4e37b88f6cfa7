"""A stack judged for fleet targets from its lock's wheels, no env built (`cudaenv audit SPEC
--targets FILE`): each verdict shown on real wheels, each broken input refused in one line.

The offline tests serve a frozen index of wheels named `vllm` (its loader, `vllm/_C*.so`, is
what the audit requires) whose `_C.abi3.so` is a real shared library nvcc built here: SASS for
sm_80 only, PTX for compute_80 only, or one cut short. The network tests read the real
sglang-kernel 0.4.10 wheels of both platforms (27 MB for aarch64).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.audit import fleet
from builder.commands import compat
from builder.core.reporter import silent
from builder.machine import targets
from builder.machine.archs import Arch
from builder.spec import envspec as spec
from builder.spec import lock
from tests.helpers import (
    REPO,
    cudaenv,
    lock_of,
    simple_index,
    the_only_index,
    workspace,
    write,
)

PY = f"{sys.version_info.major}.{sys.version_info.minor}"
KERNEL = "__global__ void k(float *x) { x[threadIdx.x] *= 2.0f; }\n"


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").is_file():
        found = "/usr/local/cuda/bin/nvcc"
    return found


@pytest.fixture(scope="module")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Shared libraries built by the real nvcc: SASS sm_80, PTX compute_80, and a cut one."""
    tool = nvcc()
    if tool is None:
        pytest.skip("no nvcc on this machine to build the test's device code")
    d = tmp_path_factory.mktemp("kernels")
    (d / "k.cu").write_text(KERNEL)
    out: dict[str, bytes] = {}
    for name, code in (("sass", "sm_80"), ("ptx", "compute_80")):
        so = d / f"{name}.so"
        subprocess.run(
            [tool, "-shared", "-Xcompiler", "-fPIC", "-gencode", f"arch=compute_80,code={code}",
             "-o", str(so), str(d / "k.cu")],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        out[name] = so.read_bytes()
    whole = out["sass"]
    marker = whole.find(b"\x50\xed\x55\xba")  # the fatbin container's magic
    assert marker > 0
    out["cut"] = whole[: marker + 40]  # the section's header says more than the file holds
    return out


def wheel(root: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A py3-none-any wheel of ``files`` on the index at ``root`` (RECORD with hashes)."""
    dist = f"{name}-{version}"
    files = {
        **files,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    files[f"{dist}.dist-info/RECORD"] = (
        "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
    ).encode()
    out = root / "simple" / name / f"{dist}-py3-none-any.whl"
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    out.write_bytes(buf.getvalue())
    simple_index(root)
    return out


@pytest.fixture
def index(tmp_path: Path, libraries: dict[str, bytes]) -> Iterator[Path]:
    root = tmp_path / "index"
    wheel(root, "vllm", "1.0", {"vllm/__init__.py": b"", "vllm/_C.abi3.so": libraries["sass"]})
    wheel(root, "vllm", "2.0", {"vllm/__init__.py": b"", "vllm/_C.abi3.so": libraries["ptx"]})
    wheel(root, "vllm", "3.0", {"vllm/__init__.py": b"", "vllm/_C.abi3.so": libraries["cut"]})
    with the_only_index(root, tmp_path / "uv-cache"):
        yield root


def stack(ws: Path, version: str, extra: str = "") -> Path:
    path = write(
        ws / "envspecs" / f"v{version.replace('.', '')}.yaml",
        f'name: v{version.replace(".", "")}\npython: "{PY}"\ncuda: "13.0"\n'
        "toolchain: {source: system, path: /usr/local/cuda-13.0}\n"
        f"packages: [vllm=={version}]\n" + extra,
    )
    cudaenv("lock", str(path.relative_to(ws)), cwd=ws)
    return path


FLEET = """\
targets:
  - {name: t4, cc: "7.5", platform: linux-x86_64, driver: "580.95.05"}
  - {name: a10, cc: "8.6", platform: linux-x86_64, driver: "580.95.05"}
  - {name: a10-570, cc: "8.6", platform: linux-x86_64, driver: "570.86.15"}
  - {name: arm, cc: "8.0", platform: linux-aarch64, driver: "580"}
  - {name: h100, cc: "9.0", platform: linux-x86_64, driver: "580"}
"""


def judged(ws: Path, spec_file: Path, fleet_file: Path) -> tuple[int, dict[str, dict[str, object]]]:
    done = cudaenv(
        "audit", str(spec_file.relative_to(ws)), "--targets", str(fleet_file), "--json",
        cwd=ws, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 5), done.stderr
    doc = json.loads(done.stdout)
    return done.returncode, {t["target"]["name"]: t for t in doc["targets"]}


@pytest.mark.slow
def test_every_verdict_from_the_wheels_of_the_lock(index: Path, tmp_path: Path) -> None:
    ws = workspace(tmp_path / "ws")
    fleet_file = write(tmp_path / "fleet.yaml", FLEET)
    rc, got = judged(ws, stack(ws, "1.0"), fleet_file)
    assert rc == 5
    assert {n: t["verdict"] for n, t in got.items()} == {
        "t4": "no-kernel",
        "a10": "runs",
        "a10-570": "driver-too-old",
        "arm": "runs",  # the aarch64 "wheel" is the same file
        "h100": "no-kernel",  # SASS runs within its major only: sm_80 not on 9.0
    }
    assert got["t4"]["detail"] == "vllm: vllm/_C.abi3.so has no code for 7.5 (sm_80)"
    assert "needs driver 580 or newer" in str(got["a10-570"]["detail"])
    # PTX only: the driver compiles it at the first start.
    rc, got = judged(ws, stack(ws, "2.0"), fleet_file)
    assert got["a10"]["verdict"] == "runs-after-ptx-jit"
    assert "through PTX" in str(got["a10"]["detail"])
    assert got["t4"]["verdict"] == "no-kernel"  # compute_80 PTX does not JIT for 7.5
    # A lock of one platform: the other's targets have no wheel.
    rc, got = judged(ws, stack(ws, "1.0", "platforms: [linux-x86_64]\nname: only-x86\n"
                                   .replace("name: only-x86\n", "")), fleet_file)  # fmt: skip
    assert got["arm"]["verdict"] == "no-wheel"
    assert "has no wheels for linux-aarch64" in str(got["arm"]["detail"])


@pytest.mark.slow
def test_a_binary_that_cannot_be_read_never_covers_a_target(index: Path, tmp_path: Path) -> None:
    ws = workspace(tmp_path / "ws")
    fleet_file = write(tmp_path / "fleet.yaml", FLEET)
    rc, got = judged(ws, stack(ws, "3.0"), fleet_file)
    assert rc == 5
    assert got["a10"]["verdict"] == "no-kernel"
    assert "could not be read" in json.dumps(got["a10"]["evidence"])


@pytest.mark.slow
def test_a_wheel_that_is_not_the_locked_zip_is_one_line(index: Path, tmp_path: Path) -> None:
    """The index now serves bytes that are not a wheel (and not the locked hash): one error
    line, exit 4, nothing judged from them."""
    ws = workspace(tmp_path / "ws")
    good = wheel(index, "vllm", "4.0", {"vllm/_C.abi3.so": b"x"})
    spec_file = stack(ws, "4.0")
    good.write_bytes(b"not a zip at all")
    simple_index(index)
    done = cudaenv("audit", str(spec_file.relative_to(ws)), "--targets",
                   str(write(tmp_path / "f.yaml", FLEET)), cwd=ws, check=False)  # fmt: skip
    assert done.returncode == 4, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "could not be unpacked" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_required_target_that_cannot_run_stops_the_build(index: Path, tmp_path: Path) -> None:
    ws = workspace(tmp_path / "ws")
    spec_file = stack(
        ws,
        "1.0",
        'targets: [{name: t4, cc: "7.5", platform: linux-x86_64, driver: "580", required: true}]\n',
    )
    done = cudaenv(
        "build", str(spec_file.relative_to(ws)), "--no-driver-check", cwd=ws, check=False
    )
    assert done.returncode == 5, done.stderr
    assert "cannot run on 1 required target(s), nothing was installed" in done.stderr
    assert "t4 (7.5, linux-x86_64, driver 580): no kernel: vllm: vllm/_C.abi3.so" in done.stderr
    assert not (ws / ".envs" / spec.load(spec_file).name).exists()
    # plan shows the verdict per target without refusing.
    plan = cudaenv("plan", str(spec_file.relative_to(ws)), cwd=ws)
    assert "target t4" in plan.stdout and "no kernel" in plan.stdout


def test_verdicts_survive_their_json() -> None:
    t = targets.Target(name="x", cc=Arch.parse("12.1"), platform="linux-aarch64", driver="580")
    v = fleet.Verdict(target=t, kind="runs-after-ptx-jit", detail="d", evidence=("e",))
    assert fleet.from_json(v.to_json()) == v
    with pytest.raises(ValueError, match="unknown verdict"):
        fleet.from_json({**v.to_json(), "verdict": "maybe"})


# --------------------------------------------------------------------------- real wheels

SGL = """\
name: sgl
python: "3.12"
cuda: "13.0"
toolchain: {source: system, path: /usr/local/cuda-13.0}
packages: [sglang-kernel==0.4.10]
"""


@pytest.mark.network
def test_the_aarch64_sglang_kernel_runs_on_a_dgx_spark_and_the_x86_one_not_on_a_t4(
    tmp_path: Path,
) -> None:
    """sglang-kernel 0.4.10: the aarch64 wheel's sm100/common_ops holds sm_121a (DGX Spark);
    the x86_64 one starts at sm_80 (T4 is 7.5: sglang#38515). Only each platform's own wheel
    can say so."""
    ws = workspace(tmp_path / "ws")
    spec_file = write(ws / "envspecs" / "sgl.yaml", SGL)
    cudaenv("lock", "envspecs/sgl.yaml", cwd=ws)
    s = spec.load(spec_file)
    lk = lock.read(lock_of(spec_file))
    fleet_ = targets.load_file(
        write(
            tmp_path / "f.yaml",
            "targets:\n"
            '  - {name: spark, cc: "12.1", platform: linux-aarch64, driver: "580.95.05"}\n'
            '  - {name: t4, cc: "7.5", platform: linux-x86_64, driver: "580.95.05"}\n',
        )
    )
    spark, t4 = fleet.judge(s, lk, [fleet_[0]], silent()) + fleet.judge(
        s, lk, [fleet_[1]], silent()
    )
    assert spark.kind == "runs", spark
    assert t4.kind == "no-kernel"
    assert t4.detail.startswith(
        "sglang-kernel: sgl_kernel/sm100/common_ops.abi3.so has no code for 7.5"
    )


# --------------------------------------------------------------------------- the table


@pytest.mark.slow
def test_compat_tabulates_stacks_by_target(index: Path, tmp_path: Path) -> None:
    ws = workspace(tmp_path / "ws")
    a, b = stack(ws, "1.0"), stack(ws, "2.0")
    fleet_file = write(tmp_path / "fleet.yaml", FLEET)
    md, page = tmp_path / "c.md", tmp_path / "c.html"
    done = cudaenv(
        "compat", str(a.relative_to(ws)), str(b.relative_to(ws)), "envspecs/nope.yaml",
        "--targets", str(fleet_file), "--json", "--markdown", str(md), "--html", str(page),
        cwd=ws, check=False,
    )  # fmt: skip
    # A SPEC that is not there is bad input, before anything is judged.
    assert done.returncode == 2 and "envspecs/nope.yaml: no such spec file" in done.stderr
    done = cudaenv(
        "compat", str(a.relative_to(ws)), str(b.relative_to(ws)), "--targets", str(fleet_file),
        "--json", "--markdown", str(md), "--html", str(page), cwd=ws,
    )  # fmt: skip
    doc = json.loads(done.stdout)
    grid = {
        r["stack"]: {v["target"]["name"]: v["verdict"] for v in r["verdicts"]} for r in doc["rows"]
    }
    assert grid["v10"]["a10"] == "runs" and grid["v20"]["a10"] == "runs-after-ptx-jit"
    assert grid["v10"]["t4"] == "no-kernel" and grid["v10"]["a10-570"] == "driver-too-old"
    text = md.read_text()
    assert "## linux-x86_64, driver 580.95.05" in text
    # v10 runs on 8.6, with a note: its JIT arch list (12.0f) builds nothing for it.
    assert (
        "| v10 | no kernel [1] | runs [2] |\n| v20 | no kernel [3] | runs after PTX JIT [4] |"
        in text
    )
    assert "2. v10: 1 required binaries hold SASS for 8.6; the spec's JIT arch list" in text
    assert "1. v10: vllm: vllm/_C.abi3.so has no code for 7.5 (sm_80)" in text
    html = page.read_text()
    assert "<td class='jit'><details><summary>runs after PTX JIT</summary>" in html
    # The data reads back into the same table.
    assert compat.from_json(doc).to_json() == doc


def test_the_shipped_compatibility_page_is_current() -> None:
    """docs/reference/compat.md is the rendering of compat.json, made from today's locks of
    every shipped spec (`nox -s compat` regenerates both)."""
    assert compat.stale(REPO) == []


def test_a_stale_compatibility_page_is_caught(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    shutil.copytree(REPO / "envspecs", root / "envspecs")
    (root / "docs" / "reference").mkdir(parents=True)
    for name in ("compat.json", "compat.md"):
        shutil.copy(REPO / "docs" / "reference" / name, root / "docs" / "reference" / name)
    assert compat.stale(root) == []
    lock_file = lock_of(root / "envspecs" / "toolchain-cu130.yaml")
    text = lock_file.read_text()
    at = text.index('sha256 = "') + len('sha256 = "')
    lock_file.write_text(text[:at] + ("0" if text[at] != "0" else "1") + text[at + 1 :])
    page = root / "docs" / "reference" / "compat.md"
    page.write_text(page.read_text().replace("runs", "walks", 1))
    write(root / "envspecs" / "new.yaml", 'name: new\npython: "3.12"\ncuda: "13.0"\n')
    assert compat.stale(root) == [
        "envspecs/new.yaml is not in the table",
        "envspecs/toolchain-cu130.yaml: its lock changed since the table was made",
        "docs/reference/compat.md is not the rendering of docs/reference/compat.json",
    ]


@pytest.mark.slow
def test_lock_warns_for_each_target_the_new_set_cannot_serve(index: Path, tmp_path: Path) -> None:
    ws = workspace(tmp_path / "ws")
    path = write(
        ws / "envspecs" / "w.yaml",
        f'name: w\npython: "{PY}"\ncuda: "13.0"\n'
        "toolchain: {source: system, path: /usr/local/cuda-13.0}\npackages: [vllm==1.0]\n"
        'targets: [{name: t4, cc: "7.5", platform: linux-x86_64, driver: "580"},'
        ' {name: a10, cc: "8.6", platform: linux-x86_64, driver: "580"}]\n',
    )
    done = cudaenv("lock", str(path.relative_to(ws)), cwd=ws)
    warned = [ln for ln in done.stderr.splitlines() if ln.startswith("cudaenv: warning: target")]
    assert warned == [
        "cudaenv: warning: target t4 (7.5, linux-x86_64, driver 580): no kernel: vllm: "
        "vllm/_C.abi3.so has no code for 7.5 (sm_80)"
    ]


def test_a_driver_too_old_names_the_stack_beside_that_runs_there_or_says_none_does() -> None:
    """ "Serve it a stack of an older CUDA" named none: the verdict names the shipped stacks
    whose lock's CUDA the driver runs on the target's platform, or says none does."""
    from builder.core.cudaversion import CudaVersion

    beside = fleet.stacks_beside(REPO / "envspecs")
    assert ("torch2.9-cu128-system", CudaVersion.parse("12.8"), ("linux-x86_64",)) in beside
    cu13 = CudaVersion.parse("13.0")
    x86 = targets.Target(name="h100", cc=Arch.parse("9.0"), platform="linux-x86_64", driver="570")
    arm = targets.Target(name="gh200", cc=Arch.parse("9.0"), platform="linux-aarch64", driver="570")
    said = fleet.driver_verdict(x86, cu13, "torch's", beside)
    assert said is not None and said.detail.endswith(
        "install driver 580+ there, or serve it torch2.9-cu128-system, which it runs"
    )
    none = fleet.driver_verdict(arm, cu13, "torch's", beside)  # its lock is x86_64 only
    assert none is not None
    assert none.detail.endswith("(no stack beside this one runs there either)")
    assert fleet.driver_verdict(x86, cu13, "torch's", ()) is not None
    newer = targets.Target(
        name="b200", cc=Arch.parse("10.0"), platform="linux-x86_64", driver="580"
    )
    assert fleet.driver_verdict(newer, cu13, "torch's", beside) is None


def test_compat_of_one_spec_lists_the_classes_it_runs_on_too() -> None:
    """Given one spec, compat listed only the failing classes: the ones it runs on are
    named on one line first."""
    h100 = targets.Target(name="h100", cc=Arch.parse("9.0"), platform="linux-x86_64", driver="580")
    old = targets.Target(name="v100", cc=Arch.parse("7.0"), platform="linux-x86_64", driver="580")
    row = compat.Row(stack="s", source="s.yaml", lock="h", cuda="13.0", verdicts=(
        fleet.Verdict(target=h100, kind="runs", detail="sm_90 SASS"),
        fleet.Verdict(target=old, kind="no-kernel", detail="no sm_70 code"),
    ))  # fmt: skip
    lines = compat.text(compat.Table(targets=(h100, old), rows=(row,))).splitlines()
    assert lines[0] == "s (CUDA 13.0, s.yaml): runs on 1 of 2 classes"
    assert lines[1] == "  runs on: h100"
    assert lines[2].startswith("  v100 ")


def test_a_class_the_spec_jit_builds_nothing_for_says_flashinfer_compiles_there() -> None:
    """An H100 "runs" a spec whose JIT arch list is 12.0f alone: the verdict says FlashInfer
    compiles at the first start there and names the arch to add; a class the list covers
    (12.0f: SM 12.x) is as it was."""
    from builder.core.cudaversion import CudaVersion

    s = spec.load(REPO / "envspecs" / "default.yaml")
    assert [a for a in s.archs] == [Arch.parse("12.0f")]
    cu13 = CudaVersion.parse("13.0")
    h100 = targets.Target(name="h100", cc=Arch.parse("9.0"), platform="linux-x86_64", driver="580")
    spark = targets.Target(
        name="spark", cc=Arch.parse("12.1"), platform="linux-aarch64", driver="580"
    )
    runs = fleet.Verdict(target=h100, kind="runs", detail="4 required binaries hold SASS for 9.0")
    noted = fleet._with_jit_archs(runs, s, cu13)
    assert noted.ok and noted.compiles_at_start
    assert noted.detail.endswith(
        "the spec's JIT arch list (12.0f) has nothing for 9.0: FlashInfer compiles its modules "
        "at the first start there (an env built on such a node adds its GPU's arch; nothing was "
        "warmed for it), or add 9.0a to `archs:`"
    )
    covered = fleet.Verdict(target=spark, kind="runs", detail="ok")
    assert fleet._with_jit_archs(covered, s, cu13) == covered
