"""`cudaenv doctor`: each rule fires on the smallest real setup and stays silent on a healthy one.

"Real setup": a real venv whose site-packages hold real dist-info metadata and a
torch/version.py, real executables standing in for nvcc 12.8 / g++ (PyPI has no CUDA 12
nvcc), real JIT cache files; the real probe runs inside that venv. Facts that cannot be
staged without root (the driver in /proc, glibc) are tested on the rules directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from builder.core import proc
from builder.core.errors import UsageError
from builder.doctor import diagnose as doctor
from builder.doctor import rules as doctor_rules
from builder.env import caches, manifest
from builder.env.manifest import Manifest
from builder.machine import archs, interpreters
from tests.helpers import REPO, links_only, run_printed, write

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
    # As the start-up hook of a built env sets them (builder/env/caches.py).
    for cache in caches.CACHES:
        monkeypatch.setenv(cache.variable, str(tmp_path / "venv" / "var" / cache.subdir))
    for variable, _tool in caches.TRITON_TOOLS:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("CXX", str(gxx))
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    # The index a companion fix is checked against: none (no test here reaches the network).
    for variable, value in links_only(tmp_path, tmp_path / "links").items():
        monkeypatch.setenv(variable, value)
    fake.dists(HEALTHY_DISTS)
    yield fake


def a_manifest(
    env_archs: str = "12.0f", *, nvcc: str = "13.0", spec: str = "envspecs/default.yaml"
) -> Manifest:
    return Manifest(
        name="default",
        spec=spec,
        fingerprint="f" * 16,
        lock_hash="h" * 16,
        python="3.12",
        cuda=nvcc,
        torch="2.14.1",
        torch_cuda="13.0",
        toolkit="13.0.3.0",
        nvcc=nvcc,
        toolchain_source="wheels",
        archs=archs.parse_list(env_archs),
        spec_archs=archs.parse_list(env_archs),
        # What FakeEnv installs: the env holds exactly its lock.
        packages=tuple(sorted(HEALTHY_DISTS.items())),
        env=(),
        built_at="2025-01-01T00:00:00+00:00",
        cudaenv="0.1.0",
        path="/e",
    )


def gpu(capability: tuple[int, int] | None, name: str = "NVIDIA H200", index: int = 0) -> archs.Gpu:
    return archs.Gpu(index=index, uuid=f"GPU-{index}", name=name, capability=capability)


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe tests see the GPUs a test gives them, not the machine's (cudaenv lists them
    with archs.visible_gpus; the probe in the target interpreter no longer does)."""
    monkeypatch.setattr(archs, "visible_gpus", lambda: ([], "no GPU in this test"))


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
    # Not an env cudaenv built: the first fix repairs it where it stands.
    assert first.fix[0].startswith(
        f"repair this env in place: `cudaenv adopt --python {env.python}`"
    )
    # An adopted env (its manifest says so) is adopted again, not rebuilt from a spec.
    manifest.write(a_manifest("12.0f", spec="(adopted)"), env.python.parent.parent)
    findings, _ = run(env)
    assert findings[0].fix[0] == (
        f"adopt it again: `cudaenv adopt --undo --python {env.python}`, then "
        f"`cudaenv adopt --python {env.python}`"
    )


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


@pytest.mark.slow
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
    # The fake env has no pip: uv, with this env's interpreter.
    assert findings[0].fix[0].startswith("uv pip uninstall --python ")
    assert findings[0].fix[0].endswith("/bin/python nvidia-cublas-cu12")


def test_flashinfer_companion_mismatch(env: FakeEnv) -> None:
    env.dist("flashinfer-cubin", "0.7.1")
    env.dist("flashinfer-jit-cache", "0.7.2+cu130")  # local version: matches
    findings, _ = run(env)
    assert codes(findings, doctor.ERROR) == ["flashinfer-companion-mismatch"]
    assert findings[0].cause == "flashinfer-cubin 0.7.1 does not match flashinfer-python 0.7.2"


def a_wheel(links: Path, name: str, version: str) -> Path:
    """A minimal pure wheel of ``name`` ``version`` in ``links`` (a find-links index)."""
    import base64
    import hashlib
    import zipfile

    stem = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{name.replace('-', '_')}/__init__.py": "",
        f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = ""
    for rel, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record += f"{rel},sha256={digest.decode()},{len(text.encode())}\n"
    files[f"{stem}.dist-info/RECORD"] = record + f"{stem}.dist-info/RECORD,,\n"
    links.mkdir(parents=True, exist_ok=True)
    out = links / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as zf:
        for rel, text in files.items():
            zf.writestr(rel, text)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("held", [False, True], ids=["index-lacks-it", "index-holds-it"])
def test_the_companion_fix_names_what_the_index_holds_and_running_it_clears_the_finding(
    env: FakeEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: bool
) -> None:
    """flashinfer-cubin 0.6.13 beside flashinfer-python 0.7.2, on an index (a find-links
    directory, as uv and the doctor read it) that holds 0.7.2 or does not. The fix names the
    matching release only where the index holds it, else the companion's removal; the printed
    command is run as a user would (a shell), and the doctor then finds nothing of it."""
    links = tmp_path / "links"
    a_wheel(links, "flashinfer-cubin", "0.6.13")
    if held:
        a_wheel(links, "flashinfer-cubin", HEALTHY_DISTS["flashinfer-python"])
    for variable, value in links_only(tmp_path, links).items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    proc.run([proc.uv_bin(), "pip", "install", "--python", str(env.python),
              "flashinfer-cubin==0.6.13"], env=proc.uv_env())  # fmt: skip
    findings, _ = run(env)
    (found,) = [f for f in findings if f.code == "flashinfer-companion-mismatch"]
    (fix,) = found.fix
    want = f"flashinfer-cubin=={HEALTHY_DISTS['flashinfer-python']}"
    if held:
        assert fix == f"uv pip install --python {env.python} {want}"
    else:
        assert fix.startswith(f"uv pip uninstall --python {env.python} flashinfer-cubin  # ")
        assert f"the index holds no {want}" in fix
    done = subprocess.run(["sh", "-c", fix], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": f"{Path(proc.uv_bin()).parent}:/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    findings, _ = run(env)
    assert "flashinfer-companion-mismatch" not in codes(findings), findings


@pytest.fixture
def links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A find-links index only (no network), as uv and the doctor read it."""
    where = tmp_path / "links"
    where.mkdir(exist_ok=True)
    for variable, value in links_only(tmp_path, where).items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    return where


def installed(env: FakeEnv, links: Path, *pins: str) -> None:
    """Each ``name==version`` made a wheel in ``links`` and installed by uv (with its RECORD,
    as an installer leaves it: what a printed uninstall or upgrade works on)."""
    for pin in pins:
        name, version = pin.split("==")
        for old in env.site.glob(f"{name.replace('-', '_')}-*.dist-info"):
            shutil.rmtree(old)  # the fixture's METADATA-only stand-in
        a_wheel(links, name, version)
    proc.run([proc.uv_bin(), "pip", "install", "--python", str(env.python), *pins],
             env=proc.uv_env())  # fmt: skip


def test_the_printed_uninstall_of_another_cuda_majors_wheels_clears_the_finding(
    env: FakeEnv, links: Path
) -> None:
    """A CUDA 12 cuBLAS wheel beside torch cu130: the printed command removes it (uv, in the
    env diagnosed) and the doctor then finds nothing of it."""
    installed(env, links, "nvidia-cublas-cu12==12.9.1.4")
    findings, _ = run(env)
    (found,) = [f for f in findings if f.code == "multiple-cuda-majors"]
    (command,) = list(found.commands())[:1]
    assert command == f"uv pip uninstall --python {env.python} nvidia-cublas-cu12"
    done = run_printed(command, env.root)
    assert done.returncode == 0, done.stderr
    findings, _ = run(env)
    assert "multiple-cuda-majors" not in codes(findings), findings


def test_the_printed_install_of_a_matching_nvjitlink_clears_the_finding(
    env: FakeEnv, links: Path
) -> None:
    """nvJitLink 13.0 beside the CUDA 13.1 runtime: the printed install (a range the index
    holds a release of) upgrades it, and the finding is gone."""
    installed(env, links, "nvidia-nvjitlink==13.0.88", "nvidia-cuda-runtime==13.1.80")
    a_wheel(links, "nvidia-nvjitlink", "13.1.80")
    findings, _ = run(env)
    (found,) = [f for f in findings if f.code == "nvjitlink-too-old"]
    commands = [c for c in list(found.commands()) if c.startswith("uv ")]
    assert commands == [f"uv pip install --python {env.python} 'nvidia-nvjitlink>=13.1,<14'"]
    done = run_printed(commands[0], env.root)
    assert done.returncode == 0, done.stderr
    findings, _ = run(env)
    assert "nvjitlink-too-old" not in codes(findings), findings


def test_the_command_a_crashed_rule_prints_diagnoses_the_same_interpreter(
    env: FakeEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rule's own bug: the command to report it with is run, and it diagnoses the env the
    doctor was asked about (not whatever python is first on PATH), in JSON."""

    def rule_boom(facts: doctor.Facts) -> list[doctor.Finding]:
        raise ValueError("boom")

    monkeypatch.setattr(doctor_rules, "RULES", (rule_boom, *doctor_rules.RULES))
    findings, _ = run(env)
    (found,) = [f for f in findings if f.code == "rule-crashed"]
    (command,) = list(found.commands())
    assert command == f"cudaenv doctor --python {env.python} --json"
    done = run_printed(command, env.root)
    assert done.returncode in (0, 1), done.stderr  # 1: a finding (the env is a stand-in)
    doc = json.loads(done.stdout)
    assert doc["facts"]["python"]["executable"] == str(env.python), doc["facts"]


def test_jit_cache_of_another_toolkit_and_version(env: FakeEnv, tmp_path: Path) -> None:
    cache = tmp_path / "venv" / "var" / "flashinfer" / ".cache" / "flashinfer"
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
    # Each printed command run as a user runs it (a shell): the finding it fixes is gone, and
    # what the other finding is about is still there until its own command runs.
    for code in ("stale-jit-cache", "old-jit-cache"):
        (found,) = [f for f in findings if f.code == code]
        for command in found.fix[:1] if code == "stale-jit-cache" else found.fix:
            done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, (command, done.stderr)
        findings, _ = run(env)
        assert code not in codes(findings), findings
    assert problems(findings) == []
    assert cache.is_dir()  # the cache itself stays


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


@pytest.mark.slow
@pytest.mark.parametrize("minor", ["3.9", "3.10", "3.11", "3.12", "3.13"])
def test_probe_runs_on_every_supported_python(minor: str) -> None:
    from builder.core.errors import ToolMissing
    from builder.machine import interpreters

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
        "driver": {"version": "580.82.07"},
        "jit_cache": {"root": "/e/var", "entries": []},
        "host_compiler": {"path": "/usr/bin/c++", "banner": "c++ 12.2.0", "gcc_major": 12},
        "errors": {},
    }
    doc.update(changes)
    return doc


def diagnose(
    doc: dict[str, Any], built: Manifest | None = None, gpus: tuple[archs.Gpu, ...] = ()
) -> list[str]:
    return problems(doctor_rules.diagnose(doctor.Facts.from_json(doc, built, gpus=gpus)))


def test_driver_too_old_for_torchs_cuda() -> None:
    assert diagnose(facts_doc()) == []
    assert diagnose(facts_doc(driver={"version": "550.54.15"})) == ["driver-too-old"]
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
    assert diagnose({**cu12, "driver": {"version": "550.54.15"}}) == []
    assert diagnose({**cu12, "driver": {"version": "520.61.05"}}) == ["driver-too-old"]


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
    h200 = (gpu((9, 0)),)
    assert diagnose(facts_doc(), a_manifest("12.0f"), h200) == ["gpu-arch-missing"]
    assert diagnose(facts_doc(), a_manifest("12.0f 9.0a"), h200) == []
    # A family target covers the minor revisions of its major (archs.Arch.runs_on).
    assert diagnose(facts_doc(), a_manifest("12.0f"), (gpu((12, 1), "RTX"),)) == []


def test_the_missing_arch_is_spelled_for_the_envs_nvcc() -> None:
    rtx = (gpu((12, 0), "RTX PRO 6000"),)
    for nvcc, spelled in (("13.0", "12.0f"), ("12.8", "12.0a")):
        facts = doctor.Facts.from_json(facts_doc(), a_manifest("9.0a", nvcc=nvcc), gpus=rtx)
        found = next(f for f in doctor_rules.diagnose(facts) if f.code == "gpu-arch-missing")
        assert found.cause == (
            "GPU RTX PRO 6000 (SM 12.0) is not in this env's arch list (9.0a): FlashInfer "
            "would build no kernel for it"
        )
        assert found.evidence == (f"GPU 0 RTX PRO 6000: {spelled}",)
        assert found.fix[0].endswith("`cudaenv build envspecs/default.yaml`")


def test_a_gpu_of_unknown_capability_is_not_reported_missing() -> None:
    # nvidia-smi printed no compute_cap: the old rule crashed on int("").
    facts = doctor.Facts.from_json(facts_doc(), a_manifest("12.0f"), gpus=(gpu(None),))
    assert doctor_rules.diagnose(facts) == []
    assert ("GPU 0", "NVIDIA H200 SM unknown") in doctor.facts_table(facts)


def test_sm12_gpu_is_intent_too() -> None:
    old = [
        {
            "source": "$CUDA_HOME",
            "path": "/c",
            "nvcc": "/c/bin/nvcc",
            "exists": True,
            "release": "12.8",
        }
    ]
    rtx = (gpu((12, 0), "RTX PRO 6000"),)
    assert diagnose(facts_doc(cuda_homes=old), gpus=rtx)[0] == "sm12x-nvcc-too-old"
    assert diagnose(facts_doc(cuda_homes=old), gpus=(gpu(None),)) == ["jit-toolkit-mismatch"]


def test_a_crashing_rule_is_a_finding_and_the_others_still_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def rule_boom(facts: doctor.Facts) -> list[doctor.Finding]:
        raise ValueError("invalid literal for int() with base 10: ''")

    monkeypatch.setattr(doctor_rules, "RULES", (rule_boom, doctor_rules.rule_driver))
    findings = doctor_rules.diagnose(
        doctor.Facts.from_json(facts_doc(driver={"version": "550.54.15"}), None)
    )
    assert codes(findings) == ["driver-too-old", "rule-crashed"]
    crashed = findings[1]
    assert crashed.severity == doctor.ERROR
    assert crashed.cause == (
        "the doctor's rule rule_boom crashed: ValueError: invalid literal for int() with base "
        "10: ''"
    )


def test_no_host_compiler_is_an_error() -> None:
    none = facts_doc(host_compiler={"error": "CXX is unset and neither c++ nor g++ is on PATH"})
    findings = doctor_rules.diagnose(doctor.Facts.from_json(none, None))
    assert problems(findings) == ["no-host-compiler"]
    assert findings[0].severity == doctor.ERROR
    assert findings[0].cause == (
        "no host C++ compiler (CXX is unset and neither c++ nor g++ is on PATH): nvcc needs "
        "one, so every JIT compile (FlashInfer, torch cpp_extension) fails"
    )
    assert findings[0].fix[0].startswith("install a C++ compiler: `apt-get install g++`")
    # An env with neither torch nor FlashInfer nor nvcc has no JIT to break.
    bare = {**none, "torch": {"installed": False}, "distributions": {}, "cuda_homes": []}
    assert diagnose(bare) == []


def test_no_host_compiler_found_by_the_real_probe(
    env: FakeEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bin" / "g++").unlink()
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no /usr/bin: no system c++ either
    findings, facts = run(env)
    assert problems(findings) == ["no-host-compiler"]
    assert facts.cxx is None and facts.cxx_error is not None
    monkeypatch.setenv("CXX", str(tmp_path / "gone" / "g++"))
    findings, _ = run(env)
    assert problems(findings) == ["no-host-compiler"]
    assert findings[0].cause.startswith(f"the host C++ compiler {tmp_path}/gone/g++ does not run")


def test_the_envs_manifest_is_read_typed(env: FakeEnv, tmp_path: Path) -> None:
    built = a_manifest("12.0f", spec="envspecs/mine.yaml")
    manifest.write(built, env.python.parent.parent)
    findings, facts = run(env)
    assert facts.manifest == built
    assert problems(findings) == []
    (tmp_path / "cuda-13.0" / "bin" / "nvcc").unlink()
    findings, _ = run(env)
    assert findings[0].code == "no-nvcc"
    assert findings[0].fix[-1].endswith("rebuild it: `cudaenv build envspecs/mine.yaml`")


def test_gpus_come_from_cudaenv_not_from_the_probe(
    env: FakeEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    listed = [gpu((9, 0)), gpu(None, "NVIDIA ???", 1)]
    monkeypatch.setattr(archs, "visible_gpus", lambda: (listed, None))
    manifest.write(a_manifest("12.0f"), env.python.parent.parent)
    findings, facts = run(env)
    assert facts.gpus == tuple(listed)
    # GPU 1's capability is unknown: only GPU 0 is reported, and nothing crashes.
    assert problems(findings) == ["gpu-arch-missing"]
    assert findings[0].evidence == ("GPU 0 NVIDIA H200: 9.0a",)
    script = REPO / "builder" / "probe" / "doctor_probe.py"
    done = subprocess.run([env.python, script], capture_output=True, text=True, check=True)
    # Nor the driver: the machine layer reads it (machine/driver.py), as for every command.
    probed = json.loads(done.stdout)
    assert "gpus" not in probed and "driver" not in probed


def test_json_keeps_every_cuda_home_candidate_in_lookup_order(
    env: FakeEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = fake_nvcc(tmp_path / "cuda-12.8", "12.8")
    monkeypatch.setenv("CUDA_PATH", str(other))
    monkeypatch.setattr(archs, "visible_gpus", lambda: ([gpu((9, 0)), gpu(None, "X", 1)], None))
    facts, findings, seconds = doctor.probe(env.python, deep=False)
    doc = json.loads(json.dumps(doctor.to_json(env.python, facts, findings, seconds)))
    assert doc["schema_version"] == 2
    assert doc["python"] == str(env.python)
    got = doc["facts"]
    home = tmp_path / "cuda-13.0"
    # [:2]: a machine's /usr/local/cuda, when it has one, is the third candidate.
    assert got["cuda_homes"][:2] == [
        {
            "source": "$CUDA_HOME",
            "path": str(home),
            "nvcc": f"{home}/bin/nvcc",
            "exists": True,
            "release": "13.0",
            "error": None,
            "max_gcc": 15,
        },
        {
            "source": "$CUDA_PATH",
            "path": str(other),
            "nvcc": f"{other}/bin/nvcc",
            "exists": True,
            "release": "12.8",
            "error": None,
            "max_gcc": 15,
        },
    ]
    assert got["gpus"] == [
        {"index": 0, "uuid": "GPU-0", "name": "NVIDIA H200", "capability": "9.0"},
        {"index": 1, "uuid": "GPU-1", "name": "X", "capability": None},
    ]
    assert got["torch"] == {
        "installed": True,
        "version": "2.14.1+cu130",
        "cuda": "13.0",
        "error": None,
    }
    assert got["flashinfer"] == "0.7.2"
    assert got["host_compiler"] == {
        "path": str(tmp_path / "bin" / "g++"),
        "banner": "g++ (GCC) 12.2.0",
        "gcc_major": 12,
        "error": None,
    }
    assert got["env"]["CUDA_PATH"] == str(other)
    assert got["manifest"] is None


def test_probe_of_a_failed_run_still_makes_json() -> None:
    failed = doctor.Finding(code="probe-failed", severity=doctor.ERROR, cause="x")
    doc = doctor.to_json("/nope", None, [failed], 0.0)
    assert doc["facts"] is None and doc["healthy"] is False


# ------------------------------------------------------------------ --python


def test_python_arg_takes_an_interpreter_or_an_env_dir(tmp_path: Path) -> None:
    venv = FakeEnv(tmp_path)
    assert interpreters.python_arg(str(venv.python)) == venv.python
    assert interpreters.python_arg(str(venv.root / "venv")) == venv.python  # not resolved


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda t: t, "a directory without bin/python"),
        (lambda t: Path("/etc/passwd"), "not executable"),
        (lambda t: t / "missing", "no such file"),
        (lambda t: write(t / "script.py", "print(1)\n"), "not executable"),
        (lambda t: Path("/bin/true"), "it ran but printed no Python version"),
        (
            lambda t: write(t / "boom", "#!/bin/sh\necho boom >&2\nexit 3\n"),
            "it does not run as Python: exit 3: boom",
        ),
    ],
    ids=["dir", "passwd", "missing", "non-executable", "true", "fails"],
)
def test_python_arg_refuses_anything_else(tmp_path: Path, make: Any, why: str) -> None:
    path = make(tmp_path)
    if path.name == "boom":
        path.chmod(0o755)
    with pytest.raises(UsageError) as err:
        interpreters.python_arg(str(path))
    assert str(err.value) == f"{path}: not a Python interpreter ({why})"
    assert err.value.exit_code == 2


def test_probe_of_a_file_that_cannot_be_executed_is_a_finding(tmp_path: Path) -> None:
    script = write(tmp_path / "python", "print(1)\n")  # no exec bit: PermissionError
    for target in (script, tmp_path):
        facts, findings, _ = doctor.probe(target, deep=False)
        assert facts is None
        assert codes(findings) == ["probe-failed"]
        assert findings[0].cause == f"{target} cannot be run: Permission denied"


@pytest.mark.slow
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
    assert doc["facts"]["cuda_homes"][0]["release"] == "13.0"
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


@pytest.mark.slow
def test_a_cache_outside_a_cudaenv_env_is_flagged(
    env: FakeEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cudaenv env keeps every JIT cache in var/ and Triton's ptxas at its own; anything
    else is named, with the variable and where it points."""
    manifest.write(a_manifest("12.0f", spec="envspecs/mine.yaml"), env.python.parent.parent)
    findings, facts = run(env)
    assert problems(findings) == []
    assert facts.env["TRITON_CACHE_DIR"] == str(tmp_path / "venv" / "var" / "triton")
    shared = tmp_path / "home" / ".triton" / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(shared))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    ptxas = write(tmp_path / "venv" / "cuda-home" / "bin" / "ptxas", "")
    findings, _ = run(env)
    assert problems(findings) == ["cache-outside-env"]
    assert findings[0].evidence == (
        f"TRITON_CACHE_DIR={shared} (Triton)",
        "TORCH_EXTENSIONS_DIR unset (torch uses its default, outside the env)",
        "TRITON_PTXAS_PATH unset (Triton uses its bundled ptxas, not the env's)",
        "TRITON_PTXAS_BLACKWELL_PATH unset (Triton uses its bundled ptxas, not the env's)",
    )
    assert (
        findings[0].fix[0]
        == "rebuild the env so its hook sets them: cudaenv build envspecs/mine.yaml --force"
    )
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(ptxas))
    monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", "/usr/local/cuda/bin/ptxas")
    findings, _ = run(env)
    assert findings[0].evidence[-1] == (
        "TRITON_PTXAS_BLACKWELL_PATH=/usr/local/cuda/bin/ptxas (not the env's ptxas)"
    )
    # Every location is shown, cudaenv env or not.
    text = doctor.render(env.python, *run(env)[::-1])
    rows = {line.split()[0]: line.split()[-1] for line in text.splitlines() if line.strip()}
    assert rows["TRITON_CACHE_DIR"] == str(shared)
    assert rows["TORCH_EXTENSIONS_DIR"] == "default)"  # "(unset: torch's default)"
    assert rows["TRITON_PTXAS_BLACKWELL_PATH"] == "/usr/local/cuda/bin/ptxas"
    # Not a cudaenv env: the locations are reported, nothing is flagged.
    (env.python.parent.parent / manifest.FILE).unlink()
    findings, _ = run(env)
    assert problems(findings) == []


def test_packages_drifted_from_the_lock_are_named(env: FakeEnv) -> None:
    """A package installed into a built env after the build (or a changed one) is drift:
    named with how to make it part of the spec."""
    manifest.write(a_manifest("12.0f", spec="envspecs/mine.yaml"), env.python.parent.parent)
    findings, _ = run(env)
    assert problems(findings) == []
    env.dist("requests", "2.32.0")
    env.dist("flashinfer-python", "0.7.4")
    findings, _ = run(env)
    assert problems(findings) == ["env-drift"]
    assert findings[0].evidence == (
        "added requests==2.32.0",
        f"changed flashinfer-python {HEALTHY_DISTS['flashinfer-python']} -> 0.7.4",
    )
    assert findings[0].fix[0].startswith("put what you need in `packages:` of envspecs/mine.yaml")


def test_a_shell_script_without_the_envs_settings_is_flagged(env: FakeEnv, tmp_path: Path) -> None:
    """An env wired before cudaenv patched every shell (bin/activate has the block,
    activate.nu does not) is named with the scripts; once every script is wired, nothing."""
    from builder.env import hooks
    from builder.spec import envspec as spec

    prefix = env.python.parent.parent
    manifest.write(a_manifest("12.0f", spec="envspecs/mine.yaml"), prefix)
    s = spec.load(write(tmp_path / "s.yaml", 'name: mine\npython: "3.12"\ncuda: "13.0"\n'))
    nu_before = (prefix / "bin" / "activate.nu").read_text()
    ps_before = (prefix / "bin" / "activate.ps1").read_text()
    hooks.write_hooks(prefix, s, archs.DEFAULT_ARCHS)
    findings, _ = run(env)
    assert "activation-unwired" not in codes(findings)
    (prefix / "bin" / "activate.nu").write_text(nu_before)
    (prefix / "bin" / "activate.ps1").write_text(ps_before)
    findings, _ = run(env)
    found = next(f for f in findings if f.code == "activation-unwired")
    assert found.evidence == ("bin/activate.nu", "bin/activate.ps1")
    assert found.fix == ("rebuild the env: cudaenv build envspecs/mine.yaml --force",)


@pytest.mark.parametrize(
    ("variable", "value", "intent"),
    [
        ("FLASHINFER_CUDA_ARCH_LIST", "9.0a 12.0f", True),
        ("TORCH_CUDA_ARCH_LIST", "8.0;12.0+PTX", True),
        ("TVM_FFI_CUDA_ARCH_LIST", "12.1a", True),
        ("TORCH_CUDA_ARCH_LIST", "9.0;Hopper", False),
        # A 1x.y arch is no SM 12.x, whatever its text begins with.
        ("FLASHINFER_CUDA_ARCH_LIST", "10.0a", False),
    ],
)
def test_sm12_intent_reads_every_arch_list_as_archs(
    variable: str, value: str, intent: bool
) -> None:
    facts = doctor.Facts.from_json({"env": {variable: value}}, None)
    assert doctor_rules.sm12_intent(facts) == (f"{variable}={value}" if intent else "")


OLD_NVCC = [
    {
        "source": "/usr/local/cuda",
        "path": "/usr/local/cuda",
        "nvcc": "/usr/local/cuda/bin/nvcc",
        "exists": True,
        "release": "12.8",
    }
]


def test_sm12_leads_when_the_env_or_the_user_names_12x_on_a_box_without_gpu() -> None:
    """The seed's split (torch cu130, nvcc 12.8) diagnosed where no GPU is visible: the SM 12.x
    cause leads when the env's arch list (its manifest) or --archs names 12.x."""
    doc = facts_doc(cuda_homes=OLD_NVCC)
    assert diagnose(doc) == ["jit-toolkit-mismatch"]  # nothing says 12.x: the major mismatch
    assert diagnose(doc, a_manifest("12.0f"))[0] == "sm12x-nvcc-too-old"
    facts = doctor.Facts.from_json(doc, None, target_archs=archs.parse_list("12.0"))
    found = doctor_rules.diagnose(facts)
    assert [f.code for f in found] == ["sm12x-nvcc-too-old"]
    assert "--archs 12.0" in " ".join(found[0].evidence)
    assert [s.code for s in found[0].symptoms] == ["jit-toolkit-mismatch"]
    assert diagnose(facts_doc(cuda_homes=OLD_NVCC), a_manifest("9.0a")) == ["jit-toolkit-mismatch"]


def test_install_fixes_work_in_the_env_they_name() -> None:
    """A uv venv has no pip: the fix goes through uv with that interpreter; an env with pip
    gets its own pip, never a bare `pip` (some other env's)."""
    dists = {k: v for k, v in HEALTHY_DISTS.items() if k != "pip"} | {"flashinfer-cubin": "0.6.0"}
    facts = doctor.Facts.from_json(facts_doc(distributions=dists), None)
    found = next(
        f for f in doctor_rules.diagnose(facts) if f.code == "flashinfer-companion-mismatch"
    )
    fi = HEALTHY_DISTS["flashinfer-python"]
    # Where the index could not be asked: both ways, as prose, never a command alone.
    assert found.fix[0].startswith("the index could not be asked: install `flashinfer-cubin==")
    assert f"`uv pip install --python /p flashinfer-cubin=={fi}`" in found.fix[0]
    facts = dataclasses.replace(facts, index_holds=((f"flashinfer-cubin=={fi}", True),))
    found = next(
        f for f in doctor_rules.diagnose(facts) if f.code == "flashinfer-companion-mismatch"
    )
    assert found.fix == (f"uv pip install --python /p flashinfer-cubin=={fi}",)
    with_pip = doctor.Facts.from_json(facts_doc(distributions={**dists, "pip": "25.3"}), None)
    with_pip = dataclasses.replace(with_pip, index_holds=((f"flashinfer-cubin=={fi}", True),))
    found = next(
        f for f in doctor_rules.diagnose(with_pip) if f.code == "flashinfer-companion-mismatch"
    )
    assert found.fix == (f"/p -m pip install flashinfer-cubin=={fi}",)
    assert not any(fix.startswith("pip ") for f in doctor_rules.diagnose(facts) for fix in f.fix)


# --------------------------------------------------------------------------- CUDA Python bindings


def test_cuda_python_of_another_major_than_torchs_is_named_first(env: FakeEnv, links: Path) -> None:
    """`uv pip install torch==2.14.1 flashinfer-python==0.7.2` pulls cuda-python 12.6.2.post1
    over torch's cuda-bindings 13.5.0 (`import flashinfer` fails): the doctor names it, as
    one finding (not a generic "two CUDA majors"), with a repair that reinstalls the bindings
    at torch's major in ranges uv can satisfy; that repair, run as printed (against an index
    holding cuda-python 13.0.3), clears the finding. (The other alternative, adopt, is run as
    printed on a real env in tests/test_adopt.py.)"""
    installed(env, links, "cuda-bindings==13.5.0", "cuda-python==12.6.2.post1")
    a_wheel(links, "cuda-python", "13.0.3")
    findings, _ = run(env)
    assert codes(findings, doctor.ERROR) == ["cuda-binding-major"]
    found = findings[0]
    assert found.cause.startswith(
        "cuda-python 12.6.2.post1 (CUDA 12) binds another CUDA major than torch 2.14.1+cu130 "
        "(CUDA 13.0): cuda-python below 12.8 ships cuda/bindings/ itself"
    )
    assert found.fix[0].startswith(
        f"repair this env in place: `cudaenv adopt --python {env.python}`"
    )
    assert found.fix[-1] == (
        f"`uv pip install --reinstall-package cuda-bindings --python {env.python} "
        "'cuda-python>=13,<14' 'cuda-bindings>=13,<14'`"
    )
    done = run_printed(found.commands()[-1], env.root)
    assert done.returncode == 0, done.stderr
    findings, _ = run(env)
    assert "cuda-binding-major" not in codes(findings), findings
    assert (env.site / "cuda_python-13.0.3.dist-info").is_dir()  # the only one the index holds


def test_cuda_bindings_of_a_cuda_12_torchs_other_major() -> None:
    """cuda-bindings 13 beside a CUDA 12.8 torch (nvidia-cutlass-dsl asks only >=12.8)."""
    doc = facts_doc(
        torch={"installed": True, "version": "2.9.1+cu128", "cuda": "12.8"},
        distributions={"torch": "2.9.1", "cuda-bindings": "13.5.0", "pip": "25.0"},
    )
    facts = doctor.Facts.from_json(doc, None)
    found = doctor_rules.rule_bindings(facts)
    assert [f.code for f in found] == ["cuda-binding-major"]
    assert "its driver and runtime calls are CUDA 13's" in found[0].cause
    assert found[0].fix[-1] == "`/p -m pip install --force-reinstall 'cuda-bindings>=12,<13'`"
    matched = facts_doc(distributions={**HEALTHY_DISTS, "cuda-bindings": "13.4.4",
                                       "cuda-python": "13.4.4"})  # fmt: skip
    assert doctor_rules.rule_bindings(doctor.Facts.from_json(matched, None)) == []


# --------------------------------------------------------------------------- the last verify


def a_verify_report(env_dir: Path, *, failed: bool, lock_hash: str = "h" * 16) -> Path:
    checks = [
        {"name": "toolchain", "status": "passed", "summary": "nvcc 13.0"},
        {"name": "imports", "status": "failed" if failed else "passed",
         "summary": "import flashinfer failed: AttributeError: cudaLibrary_t"},
    ]  # fmt: skip
    doc = {"schema_version": 1, "kind": "verify", "created": "2026-12-03T10:00:00+00:00",
           "lock_hash": lock_hash, "checks": checks}  # fmt: skip
    return write(env_dir / "var" / "cudaenv" / "verify.json", json.dumps(doc))


def test_an_env_whose_last_verify_failed_is_not_healthy(env: FakeEnv) -> None:
    """doctor said "healthy" while the env's own verify report said failed: it reads the
    report, and only a report of the env as it stands (a rebuild since is another env)."""
    venv = env.python.parent.parent
    a_verify_report(venv, failed=True)
    findings, facts = run(env)
    assert codes(findings, doctor.ERROR) == ["last-verify-failed"]
    assert findings[0].cause == (
        "this env's last verify (2026-12-03T10:00:00+00:00) failed: imports: import flashinfer "
        "failed: AttributeError: cudaLibrary_t"
    )
    assert (
        findings[0].fix[-1].startswith(f"then verify again: `cudaenv verify --python {env.python}`")
    )
    assert doctor.to_json(env.python, facts, findings, 0.0)["healthy"] is False
    a_verify_report(venv, failed=False)
    findings, _ = run(env)
    assert codes(findings, doctor.ERROR) == []


def test_a_report_of_an_earlier_build_or_another_kind_is_not_read_as_the_last_verify(
    tmp_path: Path,
) -> None:
    built = a_manifest()
    a_verify_report(tmp_path, failed=True, lock_hash="0" * 16)
    stale = doctor.last_verify(tmp_path, built)
    assert stale is not None and not stale.current
    a_verify_report(tmp_path, failed=True)
    assert doctor.last_verify(tmp_path, built) == doctor.LastVerify(
        path=str(tmp_path / "var" / "cudaenv" / "verify.json"),
        created="2026-12-03T10:00:00+00:00",
        failed=(("imports", "import flashinfer failed: AttributeError: cudaLibrary_t"),),
        current=True,
    )
    report = tmp_path / "var" / "cudaenv" / "verify.json"
    # A verify of another toolkit than the env's own (CUDAENV_NO_HOOK, the caller's CUDA_HOME).
    (tmp_path / "cuda-home").mkdir()
    doc = json.loads(report.read_text())
    report.write_text(json.dumps({**doc, "versions": {"CUDA_HOME": "/usr/local/cuda-12.8"}}))
    other = doctor.last_verify(tmp_path, built)
    assert other is not None and not other.current
    report.write_text(json.dumps({**doc, "versions": {"CUDA_HOME": str(tmp_path / "cuda-home")}}))
    own = doctor.last_verify(tmp_path, built)
    assert own is not None and own.current
    report.unlink()
    report.symlink_to("/etc/passwd")  # not a file of its kind: never read
    assert doctor.last_verify(tmp_path, built) is None
    report.unlink()
    report.write_text(json.dumps({"kind": "matrix", "checks": []}))
    assert doctor.last_verify(tmp_path, built) is None


def test_a_cuda_home_of_an_older_major_without_its_runtime_says_what_its_modules_need() -> None:
    """CUDA_HOME at a 12.8 toolkit beside torch cu130 with no CUDA 12 runtime in the env: the
    cause first (a major mismatch), and the evidence names the libcudart.so.12 its modules
    would need; the fix is the matched toolkit, not a CUDA 12 runtime."""
    home = {"source": "$CUDA_HOME", "path": "/usr/local/cuda-12.8", "exists": True,
            "nvcc": "/usr/local/cuda-12.8/bin/nvcc", "release": "12.8", "max_gcc": 14}  # fmt: skip
    facts = doctor.Facts.from_json(facts_doc(cuda_homes=[home]), None)
    first = doctor_rules.diagnose(facts)[0]
    assert first.code == "jit-toolkit-mismatch"
    assert first.cause.endswith(
        "but torch is built for CUDA 13.0: a major mismatch, torch's cpp_extension refuses it; "
        'CUDA 12.8 cannot build for SM 12.x either (FlashInfer: "SM 12.x requires CUDA >= 12.9")'
    )
    # The origin story on a box without a GPU: the cause and the first fix are the top lines.
    top = doctor.render("/p", facts, doctor_rules.diagnose(facts)).splitlines()
    assert top[0] == first.cause
    assert top[1] == f"fix: {first.fix[0]}"
    assert any("libcudart.so.12" in e for e in first.evidence)
    assert "cuda-toolkit[nvcc,cudart,crt,nvvm,cccl]==13.0.3.0" in first.fix[-1]
    with_runtime = facts_doc(cuda_homes=[home], distributions={
        **HEALTHY_DISTS, "nvidia-cuda-runtime-cu12": "12.8.90"})  # fmt: skip
    again = doctor_rules.diagnose(doctor.Facts.from_json(with_runtime, None))
    assert not any("libcudart.so.12" in e for f in again for e in f.evidence)


def test_an_nvjitlink_older_than_the_cuda_runtime_is_named_with_its_fix() -> None:
    """torch cu124's cuSPARSE beside an nvJitLink 12.1 ("undefined symbol:
    __nvJitLinkComplete_12_4, version libnvJitLink.so.12"): named, with the install that
    lifts nvJitLink to the runtime's minor within its major."""
    dists = {"torch": "2.5.1", "nvidia-cuda-runtime-cu12": "12.4.127",
             "nvidia-nvjitlink-cu12": "12.1.105", "nvidia-cusparse-cu12": "12.3.1.170"}  # fmt: skip
    doc = facts_doc(torch={"installed": True, "version": "2.5.1+cu124", "cuda": "12.4"},
                    distributions=dists, cuda_homes=[])  # fmt: skip
    found = doctor_rules.rule_nvjitlink(doctor.Facts.from_json(doc, None))
    assert [f.code for f in found] == ["nvjitlink-too-old"]
    assert found[0].cause.startswith(
        "nvidia-nvjitlink-cu12 12.1.105 (nvJitLink 12.1) is older than the CUDA runtime "
        "12.4.127 (12.4)"
    )
    assert "__nvJitLinkComplete_12_4" in found[0].cause
    assert "'nvidia-nvjitlink-cu12>=12.4,<13'" in found[0].fix[1]
    newer = {**dists, "nvidia-nvjitlink-cu12": "12.8.93"}  # newer than the runtime: fine
    doc["distributions"] = newer
    assert doctor_rules.rule_nvjitlink(doctor.Facts.from_json(doc, None)) == []


def test_a_wheel_built_for_the_other_cuda_major_is_named_from_its_import_error() -> None:
    """sgl-kernel built for CUDA 13 beside a cu129 torch: `import sgl_kernel` (doctor
    --deep) fails for libcudart.so.13; the doctor names the package and both majors, and does
    not suggest adding the other runtime."""
    error = (
        "ImportError: libcudart.so.13: cannot open shared object file: No such file or "
        "directory (/e/lib/python3.12/site-packages/sgl_kernel/common_ops.abi3.so)"
    )
    doc = facts_doc(
        torch={"installed": True, "version": "2.8.0+cu129", "cuda": "12.9"},
        deep={"torch": {"version": "2.8.0+cu129", "cuda": "12.9"},
              "imports": {"sgl_kernel": error, "vllm._C": None}},
    )  # fmt: skip
    found = doctor_rules.diagnose(doctor.Facts.from_json(doc, None))
    first = found[0]
    assert first.code == "built-for-other-cuda-major"
    assert first.cause == (
        "import sgl_kernel failed: sgl_kernel is built for CUDA 13 (it needs libcudart.so.13) "
        "but torch 2.8.0+cu129 is CUDA 12.9"
    )
    assert "two libcudart generations" in first.fix[1]
    same = facts_doc(deep={"imports": {"sgl_kernel": error}})  # torch cu130: not this finding
    codes_same = [f.code for f in doctor_rules.diagnose(doctor.Facts.from_json(same, None))]
    assert "built-for-other-cuda-major" not in codes_same


def test_a_release_the_index_lists_with_a_local_label_matches_the_fix() -> None:
    """`pip index versions` lists flashinfer-jit-cache as 0.4.0+cu128: the fix's `==0.4.0`
    installs it, so the index holds it; a pre-release is counted too (asked with --pre)."""
    from packaging.specifiers import SpecifierSet

    assert doctor._matches(SpecifierSet("==0.4.0"), "0.4.0+cu128")
    assert doctor._matches(SpecifierSet("==0.8.0rc1"), "0.8.0rc1")
    assert not doctor._matches(SpecifierSet("==0.4.0"), "0.4.1")
    assert not doctor._matches(SpecifierSet("==0.4.0"), "not a version")
