"""The driver gate: each place the driver version is read, their order, the one table of
minimum drivers, and `build` / `adopt` / `plan` refusing or showing what the driver runs."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from builder.adopt import journal as adopt_journal
from builder.adopt import repair as adopt
from builder.cli import main as cli
from builder.cli import parser as cliargs
from builder.commands import build as buildrun
from builder.commands.args import BuildArgs
from builder.core import proc
from builder.core.cudaversion import CudaVersion
from builder.core.errors import STATUS_OF_EXIT, BuildError, DriverTooOld, UsageError
from builder.core.reporter import Reporter
from builder.doctor import diagnose as doctor
from builder.doctor import rules as doctor_rules
from builder.machine import archs, driver
from builder.spec.envspec import EnvSpec, Toolchain
from tests.helpers import cudaenv, lock_of, program, workspace, write

CU130 = CudaVersion(major=13, minor=0)
CU128 = CudaVersion(major=12, minor=8)

PROC_PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu Jan  9 20:54:59 UTC 2025\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)
PROC_OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Sun Jul 27 07:09:32 UTC 2025\n"
    "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n"
)

TOO_OLD = (
    "error: envspecs/toolchain-cu130.yaml needs CUDA 13.0, which needs NVIDIA driver 580 or "
    "newer; this machine has driver 570.86.15 (read from CUDAENV_DRIVER_VERSION): use a spec "
    "for CUDA 12.x (which it runs), install driver 580 or newer (or cuda-compat-13-0 on a "
    "datacenter GPU), or pass --no-driver-check"
)


@pytest.fixture
def no_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH with no nvidia-smi: a bin directory the test may put a fake one in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def fake_smi(bin_dir: Path, body: str) -> Path:
    # Answers only the query driver.detect asks, so a changed query fails the test.
    return program(
        bin_dir / "nvidia-smi",
        'if [ "$1 $2" != "--query-gpu=driver_version --format=csv,noheader" ]; then\n'
        "  echo unexpected query >&2; exit 2\nfi\n" + body,
    )


# --------------------------------------------------------------------------- the table


@pytest.mark.parametrize(
    ("cuda", "minimum"),
    [("13.0", "580"), ("13.2", "580"), ("12.0", "525"), ("12.9", "525"), ("11.8", "450")],
)
def test_the_table_holds_nvidias_minor_version_minimums(cuda: str, minimum: str) -> None:
    assert driver.minimum_driver(CudaVersion.parse(cuda)) == minimum


def test_a_cuda_the_table_does_not_hold_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"no minimum driver known for CUDA 10\.2"):
        driver.minimum_driver(CudaVersion(major=10, minor=2))


@pytest.mark.parametrize(
    ("version", "cuda", "expected"),
    [
        ("570.86.15", CU130, False),  # pie-project/pie#327: a cu130 wheel on a 570 driver
        ("579.99.99", CU130, False),
        ("580", CU130, True),
        ("580.65.06", CU130, True),
        ("1000.1", CU130, True),  # numbers, not text: "1000" < "580" as strings
        ("570.86.15", CU128, True),
        ("525.60.13", CudaVersion(major=12, minor=9), True),
        ("520.61.05", CudaVersion(major=12, minor=0), False),
        ("450.80.02", CudaVersion(major=11, minor=8), True),
        ("418.87.01", CudaVersion(major=11, minor=0), False),
    ],
)
def test_runs_compares_versions_as_numbers(version: str, cuda: CudaVersion, expected: bool) -> None:
    assert driver.runs(version, cuda) is expected


def test_runs_refuses_a_version_that_is_not_dotted_numbers() -> None:
    with pytest.raises(ValueError) as info:
        driver.runs("580.x", CU130)
    assert str(info.value) == "expected a driver version like 580.65.06, got '580.x'"


def test_newest_cuda_major() -> None:
    assert driver.newest_cuda_major("570.86.15") == 12
    assert driver.newest_cuda_major("580.65.06") == 13
    assert driver.newest_cuda_major("390.157") is None


def test_a_driver_known_only_by_its_cuda_runs_every_minor_of_that_major() -> None:
    found = driver.Driver(version=None, cuda=CU128, source=driver.LIBCUDA)
    assert found.runs(CudaVersion(major=12, minor=9))
    assert not found.runs(CU130)


# --------------------------------------------------------------------------- each source


def test_the_override() -> None:
    found = driver.from_override({"CUDAENV_DRIVER_VERSION": " 580.65.06\n"})
    assert found == driver.Driver(version="580.65.06", cuda=None, source="CUDAENV_DRIVER_VERSION")
    assert driver.from_override({"CUDAENV_DRIVER_VERSION": ""}) is None
    assert driver.from_override({}) is None


@pytest.mark.parametrize("garbage", ["580.x", "latest", "13.0.0.0.0", "-1"])
def test_a_garbage_override_is_refused_naming_the_variable(garbage: str) -> None:
    with pytest.raises(UsageError) as info:
        driver.from_override({"CUDAENV_DRIVER_VERSION": garbage})
    assert str(info.value) == (
        f"CUDAENV_DRIVER_VERSION={garbage!r}: expected a driver version like 580.65.06"
    )


def test_the_sys_module_file(tmp_path: Path) -> None:
    path = write(tmp_path / "version", "580.65.06\n")
    assert driver.from_sys(path) == driver.Driver(version="580.65.06", cuda=None, source=str(path))
    assert driver.from_sys(write(tmp_path / "bad", "not a version\n")) is None
    assert driver.from_sys(tmp_path / "absent") is None


@pytest.mark.parametrize(
    ("text", "version"), [(PROC_PROPRIETARY, "570.86.15"), (PROC_OPEN, "580.65.06")]
)
def test_the_proc_file_proprietary_and_open_modules(
    tmp_path: Path, text: str, version: str
) -> None:
    path = write(tmp_path / "version", text)
    assert driver.from_proc(path) == driver.Driver(version=version, cuda=None, source=str(path))


def test_a_proc_file_without_a_kernel_module_line_gives_nothing(tmp_path: Path) -> None:
    assert driver.from_proc(write(tmp_path / "version", "GCC version: 12.2.0\n")) is None
    assert driver.from_proc(tmp_path / "absent") is None


def test_nvidia_smi(no_smi: Path) -> None:
    assert driver.from_smi() is None  # none on PATH
    fake_smi(no_smi, "echo 580.65.06\necho 580.65.06\n")  # two GPUs
    assert driver.from_smi() == driver.Driver(version="580.65.06", cuda=None, source="nvidia-smi")
    fake_smi(no_smi, "echo 'No devices were found'\nexit 6\n")
    assert driver.from_smi() is None
    fake_smi(no_smi, "echo '[N/A]'\n")
    assert driver.from_smi() is None


def test_a_hung_nvidia_smi_is_given_up_on(no_smi: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smi(no_smi, "sleep 30\n")
    seen: list[object] = []
    real = proc.run

    def short(*args: Any, **kwargs: Any) -> proc.Completed:
        seen.append(kwargs.get("timeout"))
        return real(*args, **{**kwargs, "timeout": 0.5})

    monkeypatch.setattr(proc, "run", short)
    assert driver.from_smi() is None
    assert seen == [10]


def test_libcuda_in_a_child(tmp_path: Path) -> None:
    python = program(tmp_path / "python", "echo 13000\n")
    assert driver.from_libcuda(str(python)) == driver.Driver(
        version=None, cuda=CU130, source="libcuda cuDriverGetVersion"
    )
    assert driver.from_libcuda(str(program(tmp_path / "p2", "echo 12080\n"))) == driver.Driver(
        version=None, cuda=CU128, source=driver.LIBCUDA
    )
    for body in ("true\n", "echo nope\n", "echo 13000; exit 1\n"):
        assert driver.from_libcuda(str(program(tmp_path / "p3", body))) is None


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to make a stand-in libcuda")
def test_the_child_calls_cudrivergetversion_of_the_libcuda_it_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real probe script against a stand-in libcuda.so.1 that reports 12.8."""
    source = write(
        tmp_path / "cuda.c", "int cuDriverGetVersion(int *v) { *v = 12080; return 0; }\n"
    )
    lib = tmp_path / "lib"
    lib.mkdir()
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(lib / "libcuda.so.1"), str(source)], check=True
    )
    monkeypatch.setenv("LD_LIBRARY_PATH", str(lib))
    found = driver.from_libcuda()
    assert found == driver.Driver(version=None, cuda=CU128, source=driver.LIBCUDA)


# --------------------------------------------------------------------------- the order


def test_the_first_source_that_answers_wins(tmp_path: Path, no_smi: Path) -> None:
    sys_file = write(tmp_path / "sys", "580.65.06\n")
    proc_file = write(tmp_path / "proc", PROC_PROPRIETARY)
    fake_smi(no_smi, "echo 575.51.03\n")
    python = str(program(tmp_path / "python", "echo 12090\n"))

    def found(environ: dict[str, str]) -> driver.Driver | None:
        return driver.detect(environ=environ, sys_file=sys_file, proc_file=proc_file, python=python)

    override = {"CUDAENV_DRIVER_VERSION": "590.1"}
    assert found(override) == driver.Driver(version="590.1", cuda=None, source=driver.OVERRIDE)
    assert found({}) == driver.Driver(version="580.65.06", cuda=None, source=str(sys_file))
    sys_file.unlink()
    assert found({}) == driver.Driver(version="570.86.15", cuda=None, source=str(proc_file))
    proc_file.unlink()
    assert found({}) == driver.Driver(version="575.51.03", cuda=None, source="nvidia-smi")
    (no_smi / "nvidia-smi").unlink()
    assert found({}) == driver.Driver(
        version=None, cuda=CudaVersion(major=12, minor=9), source=driver.LIBCUDA
    )
    python = str(program(tmp_path / "python", "true\n"))
    assert found({}) is None  # a build node


def test_a_garbage_override_is_refused_before_any_other_source(tmp_path: Path) -> None:
    sys_file = write(tmp_path / "sys", "580.65.06\n")
    with pytest.raises(UsageError, match="CUDAENV_DRIVER_VERSION='x'"):
        driver.detect(environ={"CUDAENV_DRIVER_VERSION": "x"}, sys_file=sys_file)


def test_detect_reads_the_module_paths_when_called(
    tmp_path: Path, no_smi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the driver is read is set once (module constants) and read at each call, so the
    GPU listing and the test suite's gpu marker ask the very same places as the gate."""
    monkeypatch.setattr(driver, "SYS_VERSION", write(tmp_path / "sys", "580.65.06\n"))
    assert driver.detect(environ={}) == driver.Driver(
        version="580.65.06", cuda=None, source=str(tmp_path / "sys")
    )
    monkeypatch.setattr(driver, "SYS_VERSION", tmp_path / "absent-sys")
    monkeypatch.setattr(driver, "PROC_VERSION", tmp_path / "absent-proc")
    assert driver.not_found() == (
        f"no NVIDIA driver (none at {tmp_path / 'absent-sys'}, {tmp_path / 'absent-proc'}, "
        "nvidia-smi or libcuda)"
    )


def smi_of_a_sandbox(bin_dir: Path) -> Path:
    """nvidia-smi of a GPU sandbox: both queries cudaenv asks answered."""
    return program(
        bin_dir / "nvidia-smi",
        'case "$1" in\n'
        "  --query-gpu=driver_version) echo 580.65.06 ;;\n"
        "  --query-gpu=index,uuid,name,compute_cap,mig.mode.current)\n"
        '    echo "0, GPU-aaaa, NVIDIA H200, 9.0, Disabled" ;;\n'
        "  *) exit 2 ;;\nesac\n",
    )


def test_a_sandbox_without_the_driver_files_still_has_its_gpus(
    tmp_path: Path, no_smi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No /sys/module/nvidia and no /proc/driver/nvidia, but nvidia-smi answers: the GPUs are
    seen by the sampling check's listing and by the gpu marker, as the gate sees the driver."""
    from tests.conftest import gpu_reason

    monkeypatch.setattr(driver, "SYS_VERSION", tmp_path / "absent-sys")
    monkeypatch.setattr(driver, "PROC_VERSION", tmp_path / "absent-proc")
    monkeypatch.delenv("CUDAENV_DRIVER_VERSION", raising=False)
    smi_of_a_sandbox(no_smi)
    assert driver.detect() == driver.Driver(version="580.65.06", cuda=None, source="nvidia-smi")
    gpus, why = archs.visible_gpus()
    assert why is None and [(g.name, g.capability) for g in gpus] == [("NVIDIA H200", (9, 0))]
    assert gpu_reason() is None
    # Where nothing answers, both say so with the gate's reason.
    (no_smi / "nvidia-smi").unlink()
    monkeypatch.setattr(driver, "from_libcuda", lambda python=sys.executable: None)
    assert archs.visible_gpus() == ([], driver.not_found())
    assert gpu_reason() == driver.not_found()


# --------------------------------------------------------------------------- the gate


def test_require_lets_a_new_enough_driver_or_none_through() -> None:
    new = driver.Driver(version="580.65.06", cuda=None, source="/sys/module/nvidia/version")
    assert driver.require(CU130, new, needs="x.yaml", older="a spec") == (
        "driver 580.65.06 (read from /sys/module/nvidia/version) runs CUDA 13.0 "
        "(needs 580 or newer)"
    )
    assert driver.require(CU130, None, needs="x.yaml", older="a spec") == (
        "no NVIDIA driver on this machine: going on; the env runs where the driver is "
        "580 or newer (CUDA 13.0)"
    )


def test_require_refuses_a_driver_too_old_in_one_line() -> None:
    old = driver.Driver(version=None, cuda=CU128, source=driver.LIBCUDA)
    with pytest.raises(DriverTooOld) as info:
        driver.require(CU130, old, needs="torch 2.14.1 in /v", older="a torch built")
    assert str(info.value) == (
        "torch 2.14.1 in /v needs CUDA 13.0, which needs NVIDIA driver 580 or newer; this "
        "machine has driver for CUDA 12.8 (read from libcuda cuDriverGetVersion): use a torch "
        "built for CUDA 12.x (which it runs), install driver 580 or newer (or cuda-compat-13-0 "
        "on a datacenter GPU), or pass --no-driver-check"
    )
    assert DriverTooOld.exit_code == 7 and STATUS_OF_EXIT[7] == "refused"
    # verify has no --no-driver-check: it cannot run kernels on a driver that cannot.
    with pytest.raises(DriverTooOld) as info:
        driver.require(CU130, old, needs="torch 2.14.1", older="a torch built", bypass=None)
    assert str(info.value).endswith(
        "use a torch built for CUDA 12.x (which it runs) or install driver 580 or newer (or "
        "cuda-compat-13-0 on a datacenter GPU)"
    )
    ancient = driver.Driver(version="418.87.01", cuda=None, source="nvidia-smi")
    with pytest.raises(DriverTooOld, match="use a spec for an older CUDA, install driver 525"):
        driver.require(CudaVersion(major=12, minor=4), ancient, needs="x", older="a spec")


def test_doctor_judges_torchs_cuda_by_the_same_table() -> None:
    facts = doctor.Facts.from_json(
        {
            "python": {"version": "3.12.1", "executable": "/v/bin/python", "prefix": "/v"},
            "torch": {"installed": True, "version": "2.14.1", "cuda": "13.0"},
            "driver": {"version": "570.86.15"},
        },
        None,
    )
    (found,) = doctor_rules.rule_driver(facts)
    assert found.code == "driver-too-old"
    assert found.fix == (
        "install NVIDIA driver 580 or newer (or cuda-compat-13-0 on a datacenter GPU)",
        "or use a torch/spec built for CUDA 12.x, which this driver runs",
    )
    ok = doctor.Facts.from_json(
        {
            "python": {"version": "3.12.1", "executable": "/v/bin/python", "prefix": "/v"},
            "torch": {"installed": True, "version": "2.14.1", "cuda": "13.0"},
            "driver": {"version": "580.65.06"},
        },
        None,
    )
    assert doctor_rules.rule_driver(ok) == []


# --------------------------------------------------------------------------- build, plan


def test_build_refuses_a_cuda_the_driver_cannot_run_and_builds_nothing(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    lock_before = lock_of(ws / "envspecs" / "toolchain-cu130.yaml").read_bytes()
    done = cudaenv(
        "build", "envspecs/toolchain-cu130.yaml", "--env-dir", str(tmp_path / "env"),
        cwd=ws, env={"CUDAENV_DRIVER_VERSION": "570.86.15"}, check=False,
    )  # fmt: skip
    assert done.returncode == 7, done.stderr
    assert done.stderr.strip().splitlines()[-1] == TOO_OLD
    assert not (tmp_path / "env").exists()
    assert lock_of(ws / "envspecs" / "toolchain-cu130.yaml").read_bytes() == lock_before


def test_a_garbage_override_is_bad_input_for_build(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    done = cudaenv(
        "build", "envspecs/toolchain-cu130.yaml", "--env-dir", str(tmp_path / "env"),
        cwd=ws, env={"CUDAENV_DRIVER_VERSION": "five-eighty"}, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: CUDAENV_DRIVER_VERSION='five-eighty': expected a driver version like 580.65.06"
    ]


@pytest.mark.parametrize(
    "flags",
    [["--no-driver-check"], ["--platform", "linux-aarch64"]],
    ids=["no-driver-check", "another-platform"],
)
def test_no_driver_check_and_another_platform_pass_the_gate(
    tmp_path: Path, flags: list[str]
) -> None:
    """Past the gate, the missing lock that --offline cannot resolve stops the build (4)."""
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    lock_of(ws / "envspecs" / "toolchain-cu130.yaml").unlink()
    done = cudaenv(
        "build", "--offline", "envspecs/toolchain-cu130.yaml", "--env-dir", str(tmp_path / "env"),
        *flags, cwd=ws, env={"CUDAENV_DRIVER_VERSION": "570.86.15"}, check=False,
    )  # fmt: skip
    assert done.returncode == 4, done.stderr
    assert "--offline cannot resolve one" in done.stderr
    assert "driver" not in done.stderr


def test_a_machine_without_a_driver_builds_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    spec_file = ws / "envspecs" / "toolchain-cu130.yaml"
    lock_of(spec_file).unlink()
    monkeypatch.setattr(driver, "detect", lambda: None)
    said = io.StringIO()
    request = BuildArgs(specs=(spec_file,), env_dir=tmp_path / "env", offline=True)
    with pytest.raises(BuildError), buildrun.Run(request, Reporter(stream=said)) as run:
        run.build()
    assert said.getvalue().splitlines()[0] == (
        "cudaenv: no NVIDIA driver on this machine: going on; the env runs where the "
        "driver is 580 or newer (CUDA 13.0)"
    )


def test_a_build_request_carries_no_driver_check() -> None:
    request = BuildArgs(specs=(Path("x.yaml"),), no_driver_check=True)
    parsed = cliargs.parse(cliargs.make_parser(), ["build", *request.argv()])
    assert isinstance(parsed.args, BuildArgs)
    assert buildrun.requests(parsed.args) == [request]
    assert "--no-driver-check" not in BuildArgs(specs=(Path("x.yaml"),)).argv()


@pytest.mark.network
@pytest.mark.parametrize(
    ("version", "flags"), [("580.65.06", []), ("570.86.15", ["--no-driver-check"])]
)
def test_build_goes_on_with_a_new_enough_driver_or_when_told(
    tmp_path: Path, version: str, flags: list[str]
) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    done = cudaenv(
        "build", "envspecs/toolchain-cu130.yaml", "--env-dir", str(tmp_path / "env"), *flags,
        cwd=ws, env={"CUDAENV_DRIVER_VERSION": version},
    )  # fmt: skip
    assert (tmp_path / "env" / "cudaenv.json").is_file()
    if not flags:
        assert (
            "cudaenv: driver 580.65.06 (read from CUDAENV_DRIVER_VERSION) runs CUDA 13.0 "
            "(needs 580 or newer)"
        ) in done.stderr.splitlines()


@pytest.mark.slow
def test_plan_shows_the_driver_and_the_minimum(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    old = {"CUDAENV_DRIVER_VERSION": "570.86.15"}
    text = cudaenv("plan", "envspecs/toolchain-cu130.yaml", cwd=ws, env=old).stdout
    rows = {
        line.split("  ")[0].strip(): line.split("  ", 1)[1].strip()
        for line in text.splitlines()[1:]
    }
    assert rows["driver"] == "driver 570.86.15 (read from CUDAENV_DRIVER_VERSION)"
    assert rows["driver needed"] == (
        "580 or newer for CUDA 13.0: this driver is too old (`build` refuses)"
    )
    doc = json.loads(
        cudaenv("plan", "--json", "envspecs/toolchain-cu130.yaml", cwd=ws, env=old).stdout
    )
    assert doc["driver"] == {
        "version": "570.86.15",
        "cuda": None,
        "source": "CUDAENV_DRIVER_VERSION",
    }
    assert (doc["driver_needed"], doc["driver_runs"]) == ("580", False)
    new = {"CUDAENV_DRIVER_VERSION": "580.65.06"}
    doc = json.loads(
        cudaenv("plan", "--json", "envspecs/toolchain-cu130.yaml", cwd=ws, env=new).stdout
    )
    assert doc["driver_runs"] is True


# --------------------------------------------------------------------------- adopt


def test_adopt_refuses_a_torch_the_driver_cannot_run_before_changing_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The env exists (adopt takes its lock inside it before anything else).
    (tmp_path / "v" / "lib" / "python3.12" / "site-packages").mkdir(parents=True)
    env = adopt_journal.Env(
        python=tmp_path / "v" / "bin" / "python",
        prefix=tmp_path / "v",
        version="3.12",
        is_env=True,
        purelib=tmp_path / "v" / "lib" / "python3.12" / "site-packages",
        dists={"torch": "2.14.1"},
        torch="2.14.1",
        torch_cuda="13.0",
        torch_requires=(),
        cuda_home="",
    )
    planned = adopt.Plan(
        env=env,
        cuda="13.0",
        requirements=(),
        changes=(),
        system_toolkit=None,
        spec=EnvSpec(
            name="adopted-v",
            python="3.12",
            cuda="13.0",
            source=env.prefix / "cudaenv-adopted",
            archs=archs.DEFAULT_ARCHS,
            toolchain=Toolchain(source="wheels"),
        ),
    )
    applied: list[adopt.Plan] = []
    monkeypatch.setattr(adopt, "inspect", lambda python: env)
    monkeypatch.setattr(adopt, "plan", lambda found, **kw: planned)

    def apply(p: adopt.Plan, progress: object) -> SimpleNamespace:
        applied.append(p)
        return SimpleNamespace(nvcc="13.0", archs=archs.DEFAULT_ARCHS)  # what the CLI reads

    monkeypatch.setattr(adopt, "apply", apply)
    monkeypatch.setenv("CUDAENV_DRIVER_VERSION", "570.86.15")
    argv = ["--quiet", "adopt", "--python", sys.executable, "--no-verify"]
    assert cli.main(argv) == 7
    assert capsys.readouterr().err.strip() == (
        f"error: torch 2.14.1 in {env.prefix} needs CUDA 13.0, which needs NVIDIA driver 580 "
        "or newer; this machine has driver 570.86.15 (read from CUDAENV_DRIVER_VERSION): use a "
        "torch built for CUDA 12.x (which it runs), install driver 580 or newer (or "
        "cuda-compat-13-0 on a datacenter GPU), or pass --no-driver-check"
    )
    assert cli.main([*argv, "--dry-run"]) == 7
    assert applied == []
    assert cli.main([*argv, "--no-driver-check"]) == 0
    monkeypatch.setenv("CUDAENV_DRIVER_VERSION", "580.65.06")
    assert cli.main(argv) == 0
    assert applied == [planned, planned]


def test_the_newest_cuda_a_driver_runs_is_never_guessed_upwards() -> None:
    # libcuda names it; a version alone gives its newest major's first minor (PTX newer than
    # that is then not counted as runnable by the audit).
    assert str(driver.Driver(version=None, cuda=CudaVersion(major=13, minor=1), source="x")
               .newest_cuda()) == "13.1"  # fmt: skip
    assert str(driver.Driver(version="580.65.06", cuda=None, source="x").newest_cuda()) == "13.0"
    assert str(driver.Driver(version="570.86.15", cuda=None, source="x").newest_cuda()) == "12.0"
    assert driver.Driver(version="400.1", cuda=None, source="x").newest_cuda() is None


def test_the_doctor_reads_the_driver_as_the_build_does(tmp_path: Path) -> None:
    """A WSL2-like box (uv#14647): nvidia-smi answers for two GPUs, driver 572.60, and there is
    no /proc/driver/nvidia/version or /sys/module/nvidia/version. The doctor reads the driver
    through the machine layer, as the build's gate does, so it names 572.60 as too old for
    torch's CUDA 13.0 (580 needed), never "no NVIDIA driver"."""
    if driver.SYS_VERSION.exists() or driver.PROC_VERSION.exists():
        pytest.skip("this machine has an NVIDIA kernel module: its files would answer first")
    bin_dir = tmp_path / "bin"
    fake_smi(bin_dir, "echo 572.60\necho 572.60\n")
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], check=True, timeout=120)
    site = next(env.glob("lib/python3*/site-packages"))
    write(site / "torch" / "__init__.py", "")
    write(site / "torch" / "version.py", "__version__ = '2.14.1+cu130'\ncuda = '13.0'\n")
    path = f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"
    done = cudaenv("doctor", "--python", str(env / "bin" / "python"), "--json",
                   cwd=tmp_path, env={"PATH": path}, check=False)  # fmt: skip
    doc = json.loads(done.stdout)
    found = {f["code"]: f for f in doc["findings"]}
    assert "no-driver" not in found, doc["findings"]
    old = found["driver-too-old"]
    assert old["cause"] == "driver 572.60 is too old for torch's CUDA 13.0: CUDA 13.x needs 580+"
    assert "driver 572.60 (read from nvidia-smi)" in old["evidence"]
    assert (doc["facts"]["driver"], doc["facts"]["driver_source"]) == ("572.60", "nvidia-smi")
    assert doc["healthy"] is False and done.returncode != 0


def test_the_doctor_says_where_it_looked_for_a_driver_it_did_not_find() -> None:
    """No driver anywhere: the doctor's finding names every place the machine layer asked."""
    facts = doctor.Facts.from_json({"torch": {"installed": True, "cuda": "13.0"}}, None)
    (finding,) = doctor_rules.rule_driver(facts)
    assert finding.code == "no-driver"
    assert finding.cause.startswith(driver.not_found())


def test_a_driver_only_libcuda_answered_for_is_judged_by_the_cuda_it_runs() -> None:
    doc = {"torch": {"installed": True, "version": "2.14.1+cu130", "cuda": "13.0"},
           "driver": {"version": None, "cuda": "12.8", "source": driver.LIBCUDA}}  # fmt: skip
    (finding,) = doctor_rules.rule_driver(doctor.Facts.from_json(doc, None))
    assert finding.code == "driver-too-old"
    assert finding.cause.startswith("driver for CUDA 12.8 is too old for torch's CUDA 13.0")
    doc["driver"] = {"version": None, "cuda": "13.0", "source": driver.LIBCUDA}
    assert doctor_rules.rule_driver(doctor.Facts.from_json(doc, None)) == []
