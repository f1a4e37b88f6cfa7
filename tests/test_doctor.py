"""`cudaenv doctor`: each rule fires on the smallest real setup and stays silent on a healthy one.

"Real setup": a real venv whose site-packages hold real dist-info metadata and a
torch/version.py, real executables standing in for nvcc 12.8 / g++ (PyPI has no CUDA 12
nvcc), real JIT cache files; the real probe runs inside that venv. Facts that cannot be
staged without root (the driver in /proc, glibc) are tested on the rules directly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from builder import doctor, proc
from tests.conftest import REPO, write

HEALTHY_DISTS = {
    "torch": "2.14.1",
    "cuda-toolkit": "13.0.3.0",
    "nvidia-cuda-nvcc": "13.0.88",
    "nvidia-cuda-runtime": "13.0.96",
    "nvidia-cuda-crt": "13.0.88",
    "nvidia-nvvm": "13.0.88",
    "flashinfer-python": "0.7.2",
}


def fake_nvcc(home: Path, release: str, *, max_gcc: int = 15, hang: bool = False) -> Path:
    body = (
        "sleep 30\n"
        if hang
        else (
            'echo "nvcc: NVIDIA (R) Cuda compiler driver"\n'
            f'echo "Cuda compilation tools, release {release}, V{release}.1"\n'
        )
    )
    nvcc = write(home / "bin" / "nvcc", "#!/bin/sh\n" + body)
    nvcc.chmod(0o755)
    write(
        home / "include" / "crt" / "host_config.h",
        f"#if __GNUC__ > {max_gcc}\n#error -- unsupported GNU version!\n#endif\n",
    )
    return home


class FakeEnv:
    def __init__(self, root: Path) -> None:
        self.root = root
        proc.run([proc.uv_bin(), "venv", "--quiet", "--python", sys.executable, str(root / "venv")])
        self.python = root / "venv" / "bin" / "python"
        self.site = next((root / "venv").glob("lib/python3.*/site-packages"))

    def dist(self, name: str, version: str) -> None:
        for old in self.site.glob(f"{name.replace('-', '_')}-*.dist-info"):
            shutil.rmtree(old)
        info = self.site / f"{name.replace('-', '_')}-{version}.dist-info"
        write(info / "METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        if name == "torch":
            cuda = "'13.0'" if version.startswith("2.1") else "None"
            write(
                self.site / "torch" / "version.py",
                f"__version__ = '{version}+cu130'\ncuda: Optional[str] = {cuda}\n",
            )

    def dists(self, items: Mapping[str, str]) -> None:
        for name, version in items.items():
            self.dist(name, version)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeEnv]:
    fake = FakeEnv(tmp_path)
    home = fake_nvcc(tmp_path / "cuda-13.0", "13.0")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gxx = write(bin_dir / "g++", '#!/bin/sh\necho "g++ (GCC) 12.2.0"\n')
    gxx.chmod(0o755)
    for var in (
        "CUDA_PATH",
        "FLASHINFER_CUDA_ARCH_LIST",
        "TORCH_CUDA_ARCH_LIST",
        "CUDAENV_NO_HOOK",
        "VIRTUAL_ENV",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setenv("CXX", str(gxx))
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "ws"))
    fake.dists(HEALTHY_DISTS)
    yield fake


def run(env: FakeEnv) -> tuple[list[doctor.Finding], doctor.Facts]:
    facts, findings, _ = doctor.probe(str(env.python), deep=False)
    assert facts is not None, findings
    return findings, facts


def codes(findings: list[doctor.Finding], severity: str | None = None) -> list[str]:
    return [f.code for f in findings if severity is None or f.severity == severity]


def problems(findings: list[doctor.Finding]) -> list[str]:
    return [f.code for f in findings if f.severity in (doctor.ERROR, doctor.WARNING)]


def test_healthy_fake_env_is_silent(env: FakeEnv) -> None:
    findings, facts = run(env)
    assert problems(findings) == []
    assert facts.torch_cuda == "13.0"
    assert facts.jit_home is not None and facts.jit_home.release == "13.0"


def test_blackwell_case_names_the_root_cause_first(
    env: FakeEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = fake_nvcc(tmp_path / "cuda-12.8", "12.8")
    monkeypatch.setenv("CUDA_HOME", str(old))
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "12.0")
    findings, _ = run(env)
    first = findings[0]
    assert first.code == "sm12x-nvcc-too-old"
    assert first.cause == (
        f"FlashInfer's JIT uses nvcc 12.8 (from CUDA_HOME={old}) but torch is built for CUDA "
        "13.0; SM 12.x needs 12.9+"
    )
    assert [s.code for s in first.symptoms] == ["jit-toolkit-mismatch"]
    assert "jit-toolkit-mismatch" not in codes(findings)  # grouped under the root cause


def test_minor_and_major_jit_mismatch(
    env: FakeEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_HOME", str(fake_nvcc(tmp_path / "cuda-13.2", "13.2")))
    findings, _ = run(env)
    assert codes(findings, doctor.WARNING) == ["jit-toolkit-mismatch"]
    monkeypatch.setenv("CUDA_HOME", str(fake_nvcc(tmp_path / "cuda-12.6", "12.6")))
    findings, _ = run(env)
    assert codes(findings, doctor.ERROR) == ["jit-toolkit-mismatch"]


def test_distro_nvcc_makes_usr_the_cuda_home(
    env: FakeEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usr = fake_nvcc(tmp_path / "root" / "usr", "12.0")
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("PATH", f"{usr / 'bin'}:{os.environ['PATH']}")
    findings, facts = run(env)
    assert facts.jit_home is not None and facts.jit_home.path == str(usr)
    f = next(f for f in findings if f.code == "jit-toolkit-mismatch")
    assert f.severity == doctor.ERROR
    assert any("distro /usr/bin/nvcc" in e for e in f.evidence)


def test_no_nvcc_reachable(env: FakeEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "empty"))
    findings, _ = run(env)
    assert findings[0].code == "no-nvcc"
    assert (
        "FlashInfer's get_cuda_version() silently falls back to torch's CUDA 13.0"
        in findings[0].cause
    )


def test_hanging_nvcc_is_a_finding_not_a_hang(
    env: FakeEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_HOME", str(fake_nvcc(tmp_path / "hang", "13.0", hang=True)))
    monkeypatch.setenv("CUDAENV_PROBE_TIMEOUT", "1")
    findings, _ = run(env)
    assert findings[0].code == "nvcc-broken"
    assert findings[0].cause.endswith("--version failed: timed out after 1 s")


def test_mixed_toolkit_minors(env: FakeEnv) -> None:
    env.dist("nvidia-cuda-nvcc", "13.5.37")
    findings, _ = run(env)
    assert codes(findings, doctor.ERROR) == ["mixed-toolkit-minors"]
    assert findings[0].cause.startswith(
        "NVIDIA toolkit wheels of 2 CUDA minors are installed (13.0, 13.5)"
    )


def test_more_than_one_cuda_major(env: FakeEnv) -> None:
    env.dist("nvidia-cublas-cu12", "12.8.4.1")
    env.dist("nvidia-cutlass-dsl-libs-cu12", "4.8.0")  # by design: not counted
    findings, _ = run(env)
    assert codes(findings, doctor.ERROR) == ["multiple-cuda-majors"]
    assert findings[0].fix[0] == "pip uninstall nvidia-cublas-cu12"


def test_flashinfer_companion_mismatch(env: FakeEnv) -> None:
    env.dist("flashinfer-cubin", "0.7.1")
    env.dist("flashinfer-jit-cache", "0.7.2+cu130")  # local version: matches
    findings, _ = run(env)
    assert codes(findings, doctor.ERROR) == ["flashinfer-companion-mismatch"]
    assert findings[0].cause == "flashinfer-cubin 0.7.1 does not match flashinfer-python 0.7.2"


def test_jit_cache_of_another_toolkit_and_version(env: FakeEnv, tmp_path: Path) -> None:
    cache = tmp_path / "ws" / ".cache" / "flashinfer"
    write(
        cache / "0.7.2" / "120f" / "cached_ops" / "sampling" / "build.ninja",
        "ninja_required_version = 1.3\ncuda_home = /usr/local/cuda-12.8\n",
    )
    write(cache / "0.6.0" / "90a" / "cached_ops" / "norm" / "build.ninja", "cuda_home = /x\n")
    findings, _ = run(env)
    assert codes(findings, doctor.ERROR) == ["stale-jit-cache"]
    assert "flashinfer#3229" in findings[0].cause
    assert findings[0].fix[0] == f"rm -rf {cache}/0.7.2"
    assert codes(findings, doctor.WARNING) == ["old-jit-cache"]


def test_host_compiler_newer_than_nvcc_accepts(
    env: FakeEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_HOME", str(fake_nvcc(tmp_path / "cuda-13.0b", "13.0", max_gcc=11)))
    findings, _ = run(env)
    assert codes(findings, doctor.ERROR) == ["host-compiler-unsupported"]
    assert (
        "accepts GCC up to 11 (its crt/host_config.h) but the host compiler is GCC 12"
        in findings[0].cause
    )


def test_broken_torch_install_is_a_finding(env: FakeEnv) -> None:
    (env.site / "torch" / "version.py").unlink()
    findings, _ = run(env)
    assert findings[0].code == "probe-failed"
    assert findings[0].cause.startswith("probing torch failed: cannot read")


def test_an_interpreter_that_cannot_run_the_probe(tmp_path: Path) -> None:
    broken = write(tmp_path / "python", "#!/bin/sh\necho 'boom' >&2\nexit 3\n")
    broken.chmod(0o755)
    facts, findings, _ = doctor.probe(str(broken), deep=False)
    assert facts is None
    assert findings[0].code == "probe-failed"
    assert "could not run the probe (exit 3): boom" in findings[0].cause


@pytest.mark.parametrize("minor", ["3.9", "3.10", "3.11", "3.12", "3.13"])
def test_probe_runs_on_every_supported_python(minor: str) -> None:
    from builder import interpreters
    from builder.errors import ToolMissing

    try:
        py = interpreters.find(minor, allow_download=False)
    except ToolMissing:
        pytest.skip(f"no Python {minor} on this machine")
    facts, findings, _ = doctor.probe(str(py.path), deep=False)
    assert facts is not None, findings
    assert facts.python_version.startswith(minor + ".")


# ------------------------------------------------------------------ rules on facts (no /proc)


def facts_doc(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "python": {"executable": "/p", "version": "3.12.1", "prefix": "/e"},
        "platform": {"glibc": "2.36"},
        "env": {},
        "torch": {"installed": True, "version": "2.14.1+cu130", "cuda": "13.0"},
        "distributions": dict(HEALTHY_DISTS),
        "cuda_homes": [
            {
                "source": "$CUDA_HOME",
                "path": "/e/cuda-home",
                "nvcc": "/e/cuda-home/bin/nvcc",
                "exists": True,
                "release": "13.0",
                "max_gcc": 15,
            }
        ],
        "driver": {"version": "580.82.07", "gpus": []},
        "jit_cache": {"root": "/e/var", "entries": []},
        "host_compiler": {"path": "/usr/bin/c++", "banner": "c++ 12.2.0", "gcc_major": 12},
        "errors": {},
    }
    doc.update(changes)
    return doc


def diagnose(doc: dict[str, Any], manifest: dict[str, Any] | None = None) -> list[str]:
    return problems(doctor.diagnose(doctor.Facts.from_json(doc, manifest)))


def test_driver_too_old_for_torchs_cuda() -> None:
    assert diagnose(facts_doc()) == []
    assert diagnose(facts_doc(driver={"version": "550.54.15", "gpus": []})) == ["driver-too-old"]
    cu12 = facts_doc(
        torch={"installed": True, "version": "2.9.1", "cuda": "12.8"},
        distributions={"torch": "2.9.1"},
        cuda_homes=[
            {
                "source": "$CUDA_HOME",
                "path": "/c",
                "nvcc": "/c/bin/nvcc",
                "exists": True,
                "release": "12.8",
            }
        ],
    )
    assert diagnose({**cu12, "driver": {"version": "550.54.15", "gpus": []}}) == []
    assert diagnose({**cu12, "driver": {"version": "520.61.05", "gpus": []}}) == ["driver-too-old"]


def test_glibc_242_with_cuda_below_132() -> None:
    assert diagnose(facts_doc(platform={"glibc": "2.42"})) == ["glibc-too-new-for-cuda"]
    ok = facts_doc(
        platform={"glibc": "2.42"},
        torch={"installed": True, "version": "2.15.0", "cuda": "13.2"},
        distributions={"torch": "2.15.0"},
        cuda_homes=[
            {
                "source": "$CUDA_HOME",
                "path": "/c",
                "nvcc": "/c/bin/nvcc",
                "exists": True,
                "release": "13.2",
            }
        ],
    )
    assert diagnose(ok) == []


def test_a_gpu_missing_from_the_envs_arch_list() -> None:
    gpus = {
        "version": "580.82.07",
        "gpus": [{"index": 0, "name": "NVIDIA H200", "capability": "9.0"}],
    }
    manifest = {"archs": ["12.0f"], "nvcc": "13.0", "spec": "envspecs/default.yaml"}
    assert diagnose(facts_doc(driver=gpus), manifest) == ["gpu-arch-missing"]
    assert diagnose(facts_doc(driver=gpus), {**manifest, "archs": ["12.0f", "9.0a"]}) == []


def test_sm12_gpu_is_intent_too() -> None:
    gpus = {
        "version": "580.82.07",
        "gpus": [{"index": 0, "name": "RTX PRO 6000", "capability": "12.0"}],
    }
    old = [
        {
            "source": "$CUDA_HOME",
            "path": "/c",
            "nvcc": "/c/bin/nvcc",
            "exists": True,
            "release": "12.8",
        }
    ]
    assert diagnose(facts_doc(driver=gpus, cuda_homes=old))[0] == "sm12x-nvcc-too-old"


def test_cli_json_and_exit_codes(
    env: FakeEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "builder.cli", "doctor", "--python", str(env.python), *args],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            check=False,
        )

    done = cli("--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["healthy"] is True
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "empty"))
    done = cli()
    assert done.returncode == 1
    assert done.stdout.splitlines()[0].startswith(f"no nvcc at {tmp_path / 'empty'}/bin/nvcc")
    assert "Traceback" not in done.stderr


def test_deep_on_an_env_without_torch_or_flashinfer_is_healthy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare = FakeEnv(tmp_path)
    monkeypatch.setenv("CUDA_HOME", str(fake_nvcc(tmp_path / "cuda-13.0", "13.0")))
    facts, findings, _ = doctor.probe(str(bare.python), deep=True)
    assert facts is not None
    assert problems(findings) == []
