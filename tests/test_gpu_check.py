"""The GPU check (.ci/gpu-check.sh) run for real on a stand-in machine: a fake nvidia-smi on
PATH, the driver through CUDAENV_DRIVER_VERSION, a CUDA_HOME tree, a torch that only names its
version, FlashInfer's slice. Its pre-flight must fail, naming the cause, for each thing a
machine with a GPU can lack, pass otherwise, and compute the archs of each GPU; the whole run
exits non-zero when verify fails and its summary judges a skipped half as failed."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from builder.machine import archs
from builder.verify import flashinfer_jit, sampling
from builder.verify.model import Target
from tests.helpers import REPO, program, write
from tests.test_sampling import H200, Fakes, facts

SCRIPT = REPO / ".ci" / "gpu-check.sh"


def gpu_check_module() -> ModuleType:
    """.ci/gpu-check.py, the script the shell one runs, imported (once) for its parts."""
    name = "cudaenv_gpu_check"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / ".ci" / "gpu-check.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


@dataclasses.dataclass
class Machine:
    """A stand-in H200 box; each test breaks one thing of it."""

    root: Path
    capability: str = "9.0"
    nvcc_release: str = "13.0"
    driver: str = "580.65.06"
    torch_cuda: str | None = "13.0"
    with_slice: bool = True

    @property
    def cuda_home(self) -> Path:
        return self.root / "cuda"

    @property
    def slice(self) -> Path:
        return self.root / "carry" / "flashinfer-slice.tar.gz"

    def make(self) -> Machine:
        home = self.cuda_home
        program(home / "bin" / "nvcc",
                f'echo "Cuda compilation tools, release {self.nvcc_release}, V{self.nvcc_release}.48"\n')  # fmt: skip
        program(home / "bin" / "cuobjdump", "exit 0\n")
        for rel in ("include/cuda_runtime.h", "lib64/libcudart.so", "lib64/stubs/libcuda.so"):
            write(home / rel, "")
        # nvidia-smi answers the two queries cudaenv asks, and nothing else.
        program(
            self.root / "bin" / "nvidia-smi",
            'case "$1" in\n'
            f"  --query-gpu=driver_version) echo {self.driver} ;;\n"
            "  --query-gpu=index,uuid,name,compute_cap,mig.mode.current)\n"
            f'    echo "0, GPU-aaaa-1111, NVIDIA Stand-in, {self.capability}, Disabled" ;;\n'
            '  *) echo "unexpected: $*" >&2; exit 2 ;;\nesac\n',
        )
        cuda = "None" if self.torch_cuda is None else repr(self.torch_cuda)
        write(self.root / "site" / "torch" / "__init__.py",
              'from . import version\n__version__ = "2.11.0+cu130"\n')  # fmt: skip
        write(self.root / "site" / "torch" / "version.py",
              f'__version__ = "2.11.0+cu130"\ncuda = {cuda}\n')  # fmt: skip
        if self.with_slice:
            tree = self.root / "slice-tree"
            write(tree / "flashinfer" / "__init__.py", "")
            write(tree / "tvm_ffi" / "__init__.py", "")
            members = [(tree / n, n) for n in ("flashinfer/__init__.py", "tvm_ffi/__init__.py")]
            slicer().write_archive(members, self.slice)
        return self

    def env(self) -> dict[str, str]:
        return {
            "PATH": f"{self.root / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "PYTHON": sys.executable,
            "PYTHONPATH": str(self.root / "site"),
            "CUDA_HOME": str(self.cuda_home),
            "CUDAENV_DRIVER_VERSION": self.driver,
            "FLASHINFER_SLICE": str(self.slice),
            "OUT": str(self.root / "out"),
            "HOME": str(self.root / "home"),
            "CUDAENV_CACHE_DIR": os.environ["CUDAENV_CACHE_DIR"],
            "LANG": "C.UTF-8",
        }


def slicer() -> ModuleType:
    from tests.test_flashinfer_slice import slicer as load

    return load()


def gpu_check(machine: Machine, *args: str) -> tuple[int, dict[str, Any], str]:
    done = subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=machine.env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    path = machine.root / "out" / "summary.json"
    # No summary at all is asserted after the exit status, which is what goes wrong first.
    summary = json.loads(path.read_text()) if path.is_file() else {"checks": []}
    return done.returncode, summary, done.stdout + done.stderr


def by_name(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in summary["checks"]}


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("this interpreter has FlashInfer: the slice would not be asked for")
    return Machine(root=tmp_path)


PREFLIGHT = ["python", "toolkit", "torch", "driver", "gpus", "flashinfer"]


def test_the_preflight_passes_on_a_complete_machine(machine: Machine) -> None:
    code, summary, output = gpu_check(machine.make(), "--dry-run")
    assert code == 0, output
    assert summary["status"] == "passed" and summary["exit"] == 0 and summary["dry_run"]
    assert [c["name"] for c in summary["checks"]] == PREFLIGHT
    m = summary["machine"]
    assert m["gpus"] == [
        {"index": 0, "name": "NVIDIA Stand-in", "capability": "9.0", "uuid": "GPU-aaaa-1111"}
    ]
    assert m["driver"] == {"version": "580.65.06", "cuda": None, "source": "CUDAENV_DRIVER_VERSION"}
    assert (m["torch"], m["torch_cuda"], m["nvcc"], m["archs"]) == (
        "2.11.0+cu130", "13.0", "13.0", ["9.0a"],
    )  # fmt: skip
    # The toolkit's files are shown before anything runs.
    assert "ok       lib64/stubs/libcuda.so" in output
    assert "from the slice" in by_name(summary)["flashinfer"]["reason"]


def _no_slice(m: Machine) -> None:
    m.with_slice = False


def _garbage_slice(m: Machine) -> None:
    m.slice.write_bytes(b"not a tar archive")
    m.slice.with_name(m.slice.name + ".sha256").unlink()


def _short_slice(m: Machine) -> None:
    m.slice.write_bytes(m.slice.read_bytes()[:-10])


def _empty_slice(m: Machine) -> None:
    with tarfile.open(m.slice, "w:gz"):
        pass
    m.slice.with_name(m.slice.name + ".sha256").unlink()


def _remove(rel: str) -> Callable[[Machine], None]:
    def change(m: Machine) -> None:
        (m.cuda_home / rel).unlink()

    return change


def _old_driver(m: Machine) -> None:
    m.driver = "570.86.15"


def _cpu_torch(m: Machine) -> None:
    m.torch_cuda = None


def _no_gpu(m: Machine) -> None:
    program(m.root / "bin" / "nvidia-smi", 'echo "No devices were found"; exit 6\n')


# (what breaks, before or after the machine is made, the check that fails, words its reason has)
BROKEN = [
    ("slice-missing", _no_slice, "before", "flashinfer", ["FlashInfer is missing", "no slice at"]),
    ("slice-garbage", _garbage_slice, "after", "flashinfer", ["does not unpack"]),
    ("slice-short", _short_slice, "after", "flashinfer", ["does not match", ".sha256"]),
    ("slice-empty", _empty_slice, "after", "flashinfer", ["holds no FlashInfer"]),
    ("cuobjdump-missing", _remove("bin/cuobjdump"), "after", "toolkit", ["bin/cuobjdump"]),
    ("stubs-missing", _remove("lib64/stubs/libcuda.so"), "after", "toolkit",
     ["lib64/stubs/libcuda.so", "-lcuda"]),
    ("nvcc-missing", _remove("bin/nvcc"), "after", "toolkit", ["bin/nvcc"]),
    ("driver-too-old", _old_driver, "before", "driver",
     ["driver too old", "570.86.15", "580 or newer", "cuda-compat-13-0"]),
    ("torch-cpu", _cpu_torch, "before", "torch", ["CPU build"]),
    ("no-gpu", _no_gpu, "after", "gpus", ["no visible NVIDIA GPU", "No devices were found"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("break_it", "when", "check", "words"),
    [pytest.param(*row[1:], id=row[0]) for row in BROKEN],
)
def test_the_preflight_fails_naming_what_is_missing(
    machine: Machine,
    break_it: Callable[[Machine], None],
    when: str,
    check: str,
    words: list[str],
) -> None:
    if when == "before":
        break_it(machine)
    machine.make()
    if when == "after":
        break_it(machine)
    code, summary, output = gpu_check(machine, "--dry-run")
    assert code == 1, output
    assert summary["status"] == "failed" and summary["exit"] == 1
    checks = by_name(summary)
    assert list(checks) == PREFLIGHT  # every step still reports
    failed = [name for name, c in checks.items() if c["status"] != "passed"]
    assert failed == [check], summary
    for word in words:
        assert word in checks[check]["reason"], checks[check]["reason"]
    assert f"failed: {check}:" in output  # said again at the end


@pytest.mark.parametrize(
    ("capability", "nvcc", "arch"),
    [
        ("9.0", "13.0", "9.0a"),
        ("10.0", "13.0", "10.0a"),
        ("12.0", "13.0", "12.0f"),
        ("12.1", "13.0", "12.1f"),
        ("12.0", "12.8", "12.0a"),  # before family targets (12.9)
    ],
)
def test_the_archs_are_each_gpus_for_the_toolkits_cuda(
    machine: Machine, capability: str, nvcc: str, arch: str
) -> None:
    """nvcc's release is parsed: compared as text with a CudaVersion it raised TypeError on
    every SM 12.x GPU, and verify fell back to 12.0f."""
    machine.capability, machine.nvcc_release = capability, nvcc
    machine.driver = "580.65.06" if nvcc.startswith("13") else "570.86.15"
    machine.torch_cuda = nvcc
    code, summary, output = gpu_check(machine.make(), "--dry-run")
    assert code == 0, output
    assert summary["machine"]["archs"] == [arch]
    assert summary["machine"]["nvcc"] == nvcc


@pytest.mark.slow
def test_a_failing_verify_fails_the_run_and_stops_nothing_silently(machine: Machine) -> None:
    """The real verify on the stand-in (a toolkit of empty files): it fails, and so does the
    run, with each check's and each half's verdict in the summary."""
    code, summary, output = gpu_check(machine.make(), "--steps", "verify")
    assert code == 1, output
    assert summary["status"] == "failed" and not summary["dry_run"]
    checks = by_name(summary)
    assert checks["verify"]["status"] == "failed"
    assert checks["verify"]["reason"].startswith("exit 5")
    for name in (
        "verify:toolchain",
        "verify:sampling",
        "sampling:our kernel",
        "sampling:FlashInfer",
    ):
        assert checks[name]["status"] == "failed", checks[name]
    assert (machine.root / "out" / "verify.json").is_file()
    assert (machine.root / "out" / "gpu-check.log").read_text().count("== verify") == 1


def test_a_failed_preflight_runs_no_step(machine: Machine) -> None:
    machine.with_slice = False
    code, summary, _ = gpu_check(machine.make())
    assert code == 1
    checks = by_name(summary)
    for step in ("doctor", "verify", "audit", "pytest"):
        assert checks[step] == {
            "name": step, "status": "skipped", "reason": "not run: the pre-flight failed"
        }  # fmt: skip
    assert not (machine.root / "out" / "verify.json").exists()


# --------------------------------------------------------------------------- the summary


@pytest.mark.slow
def test_a_skipped_half_or_flashinfer_jit_fails_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify's own report of an env without FlashInfer (sampling as it reports outside the
    GPU check: our kernel passed, FlashInfer skipped) read by the GPU check: both failed."""
    Fakes(monkeypatch, [H200])
    monkeypatch.delenv(sampling.GPU_CHECK, raising=False)
    no_fi = facts(tmp_path, flashinfer_installed=False)
    target = Target(python=Path(sys.executable), archs=archs.parse_list("9.0a"),
                    work=tmp_path / "work")  # fmt: skip
    results = [flashinfer_jit.check(target, no_fi), sampling.check(target, no_fi)]
    assert [r.status for r in results] == ["skipped", "passed"]  # what verify alone says
    judged = {
        (r.name, r.device): r
        for r in gpu_check_module().verify_results({"checks": [r.to_json() for r in results]})
    }
    jit = judged[("verify:flashinfer-jit", None)]
    assert jit.status == "failed" and "flashinfer-python is not installed" in jit.reason
    device = H200.label
    assert judged[("sampling:our kernel", device)].status == "passed"
    half = judged[("sampling:FlashInfer", device)]
    assert half.status == "failed" and "not installed in this env" in half.reason
    assert "needs both halves" in half.reason
    # A check the report lacks is a failure too.
    assert judged[("verify:cubin", None)].reason == "not in verify's report"


@pytest.mark.slow
def test_a_skipped_gpu_test_fails_the_pytest_step(tmp_path: Path) -> None:
    tests = write(
        tmp_path / "test_x.py",
        "import pytest\n\ndef test_ran():\n    pass\n\n"
        "def test_no_flashinfer():\n    pytest.skip('FlashInfer is not installed')\n",
    )
    xml = tmp_path / "x.xml"
    mod = gpu_check_module()
    done = mod.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
         f"--junitxml={xml}", f"--rootdir={tmp_path}"], dict(os.environ), 120,
    )  # fmt: skip
    assert done.code == 0
    result = mod.pytest_results(xml, done)
    assert result.status == "failed"
    assert "1 skipped" in result.reason and "FlashInfer is not installed" in result.reason
    (tmp_path / "test_x.py").write_text("def test_ran():\n    pass\n")
    done = mod.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
         f"--junitxml={xml}", f"--rootdir={tmp_path}"], dict(os.environ), 120,
    )  # fmt: skip
    assert mod.pytest_results(xml, done).status == "passed"


@pytest.mark.slow
def test_a_step_past_its_limit_is_killed_and_failed() -> None:
    mod = gpu_check_module()
    done = mod.run(["sleep", "30"], dict(os.environ), 1.0)
    assert done.code is None and done.seconds < 10
    assert mod.exit_result("audit", done, 1.0).reason == "killed at its limit of 1 s"
