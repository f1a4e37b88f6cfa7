"""The matching policy on recorded resolutions, and resolve() through its one seam."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from builder import lock, resolve, spec
from builder.errors import ResolveError
from builder.lock import LockedFile, LockedPackage
from tests.helpers import ENVSPECS, write

DATA = Path(__file__).parent / "data"
TOOLKIT_REQ = "cuda-toolkit[cccl,crt,cudart,nvcc,nvvm]==13.0.3.0"
CU130_PINS = {
    "nvidia-cuda-nvcc": "13.0.88",
    "nvidia-cuda-crt": "13.0.88",
    "nvidia-cuda-cccl": "13.0.85",
    "nvidia-cuda-runtime": "13.0.96",
    "nvidia-nvvm": "13.0.88",
    "nvidia-cufft": "12.0.0.61",
}


def pkg(name: str, version: str) -> LockedPackage:
    return LockedPackage(
        name=name,
        version=version,
        wheels=(LockedFile(name=f"{name}-{version}.whl", sha256="0" * 64),),
    )


def recorded(name: str) -> list[LockedPackage]:
    out = []
    for line in (DATA / name).read_text().splitlines():
        if line and not line.startswith("#"):
            n, v = line.split("==")
            out.append(pkg(n, v))
    return out


@pytest.fixture
def default_spec() -> spec.EnvSpec:
    return spec.load(ENVSPECS / "default.yaml")


def test_unconstrained_sglang_mixes_minors_and_is_refused(default_spec: spec.EnvSpec) -> None:
    packages = recorded("resolved-sglang-0.5.23-unconstrained.txt")
    versions = {p.name: p.version for p in packages}
    # FACTS §2: sglang alone pulls torch 2.14.1 (runtime 13.0.96) with nvcc 13.5.
    assert versions["nvidia-cuda-runtime"] == "13.0.96"
    assert versions["nvidia-cuda-nvcc"].startswith("13.5.")
    problems = resolve.policy_problems(default_spec, packages, CU130_PINS)
    assert problems == [
        "nvidia-cuda-cccl 13.3.5.0.6 is not the CUDA 13.0 build (13.0.85): mixed toolkit minors "
        "break JIT (flashinfer#3493)",
        "nvidia-cuda-crt 13.5.37 is not the CUDA 13.0 build (13.0.88): mixed toolkit minors "
        "break JIT (flashinfer#3493)",
        "nvidia-cuda-nvcc 13.5.37 is not the CUDA 13.0 build (13.0.88): mixed toolkit minors "
        "break JIT (flashinfer#3493)",
        "nvidia-nvvm 13.5.37 is not the CUDA 13.0 build (13.0.88): mixed toolkit minors "
        "break JIT (flashinfer#3493)",
    ]


def test_default_lock_is_matched(default_spec: spec.EnvSpec) -> None:
    lk = lock.read(lock.lock_path(default_spec.source, default_spec.name))
    assert lk.fingerprint == default_spec.fingerprint()
    assert lk.torch == "2.14.1"
    assert lk.torch_cuda == "13.0"
    versions = {p.name: p.version for p in lk.packages}
    for name in (
        "nvidia-cuda-nvcc",
        "nvidia-cuda-crt",
        "nvidia-nvvm",
        "nvidia-cuda-runtime",
        "nvidia-cuda-cccl",
        "nvidia-cuda-nvrtc",
        "nvidia-cuda-cupti",
    ):
        assert versions[name].startswith("13.0."), (name, versions[name])
    assert versions["flashinfer-python"] == "0.7.2"
    assert versions["sglang"] == "0.5.23"
    assert resolve.policy_problems(default_spec, lk.packages, CU130_PINS) == []
    assert all(p.hashes for p in lk.packages)


def test_torch_cuda_mismatch_names_both(in_tmp: Path) -> None:
    s = spec.load(
        write(in_tmp / "s.yaml", 'name: x\npython: "3.12"\ncuda: "13.2"\ntorch: "2.14.1"\n')
    )
    packages = [pkg("torch", "2.14.1"), pkg("cuda-toolkit", "13.0.3.0")]
    assert resolve.policy_problems(s, packages, {}) == [
        "torch 2.14.1 is built for CUDA 13.0 (cuda-toolkit==13.0.3.0) but the spec asks 13.2"
    ]
    cu12 = [pkg("torch", "2.9.1"), pkg("nvidia-cuda-runtime-cu12", "12.8.90")]
    assert resolve.policy_problems(s, cu12, {}) == [
        "torch 2.9.1 is built for CUDA 12.8 (nvidia-cuda-runtime-cu12==12.8.90) but the spec "
        "asks 13.2",
        "nvidia-cuda-runtime-cu12 12.8.90 is CUDA 12.8 but the spec asks 13.2",
        "nvidia-cuda-runtime-cu12 12.8.90 is a CUDA 12 wheel in a CUDA 13 env",
    ]
    assert resolve.policy_problems(s, [pkg("torch", "2.14.1")], {}) == [
        "torch 2.14.1 pins no CUDA runtime (a CPU build?) but the spec asks CUDA 13.2"
    ]


def test_one_cuda_major_and_companions(default_spec: spec.EnvSpec) -> None:
    packages = [
        pkg("torch", "2.14.1"),
        pkg("cuda-toolkit", "13.0.3.0"),
        pkg("nvidia-cublas-cu12", "12.8.4.1"),
        pkg("nvidia-cutlass-dsl-libs-cu12", "4.8.0"),  # one build per major by design
        pkg("flashinfer-python", "0.7.2"),
        pkg("flashinfer-cubin", "0.7.1"),
        pkg("flashinfer-jit-cache", "0.7.2+cu130"),
    ]
    assert resolve.policy_problems(default_spec, packages, {}) == [
        "nvidia-cublas-cu12 12.8.4.1 is a CUDA 12 wheel in a CUDA 13 env",
        "flashinfer-cubin 0.7.1 does not match flashinfer-python 0.7.2",
    ]


class FakeUv:
    """Replaces the one subprocess seam (uv pip compile) with recorded answers."""

    def __init__(self, answers: dict[str, list[LockedPackage]]) -> None:
        self.answers = answers
        self.calls: list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = []

    def __call__(
        self, s: spec.EnvSpec, reqs: Sequence[str], cons: Sequence[str], over: Sequence[str]
    ) -> resolve.Resolution:
        self.calls.append((tuple(reqs), tuple(cons), tuple(over)))
        key = " + ".join(reqs) + (" lowest" if "--resolution=lowest" in over else "")
        return resolve.Resolution(packages=tuple(self.answers[key]), seconds=0.0)


def test_resolve_refuses_before_the_full_resolution(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(in_tmp / "cache"))
    write(in_tmp / "s.yaml", 'name: x\npython: "3.12"\ncuda: "13.2"\ntorch: "2.14.1"\n')
    s = spec.load("s.yaml")
    fake = FakeUv({"torch==2.14.1": [pkg("torch", "2.14.1"), pkg("cuda-toolkit", "13.0.3.0")]})
    with pytest.raises(ResolveError) as info:
        resolve.resolve(s, compile_=fake)
    assert str(info.value) == (
        "x (s.yaml): refused by the matching policy, nothing was installed:\n"
        "  - torch 2.14.1 is built for CUDA 13.0 (cuda-toolkit==13.0.3.0) but the spec asks 13.2"
    )
    assert [c[0] for c in fake.calls] == [("torch==2.14.1",)]


def test_resolve_pins_the_toolkit_torch_pins(in_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(in_tmp / "cache"))
    s = spec.load(
        write(
            in_tmp / "s.yaml",
            'name: x\npython: "3.12"\ncuda: "13.0"\ntorch: "2.14.1"\npackages: [sglang==0.5.23]\n',
        )
    )
    toolkit_all = [
        pkg("cuda-toolkit", "13.0.3.0"),
        *(pkg(n, v) for n, v in CU130_PINS.items()),
        pkg("nvidia-nvjitlink", "13.5.37"),
    ]
    toolkit_low = [*toolkit_all[:-1], pkg("nvidia-nvjitlink", "13.0.88")]
    final = [pkg("torch", "2.14.1"), pkg("sglang", "0.5.23"), *toolkit_all]
    fake = FakeUv(
        {
            "torch==2.14.1": [pkg("torch", "2.14.1"), pkg("cuda-toolkit", "13.0.3.0")],
            "cuda-toolkit[all]==13.0.3.0": toolkit_all,
            "cuda-toolkit[all]==13.0.3.0 lowest": toolkit_low,
            "torch==2.14.1 + sglang==0.5.23 + " + TOOLKIT_REQ: final,
        }
    )
    plan = resolve.resolve(s, compile_=fake)
    reqs, cons, _ = fake.calls[-1]
    assert reqs == (
        "torch==2.14.1",
        "sglang==0.5.23",
        "cuda-toolkit[cccl,crt,cudart,nvcc,nvvm]==13.0.3.0",
    )
    # nvjitlink floats within the major in cuda-toolkit's own metadata: not a pin.
    assert "nvidia-nvjitlink==13.5.37" not in cons
    assert "nvidia-cuda-nvcc==13.0.88" in cons
    assert plan.lock.toolkit == "13.0.3.0"
    assert plan.lock.torch_cuda == "13.0"
    assert [p.name for p in plan.lock.packages] == [p.name for p in final]
    # The second resolve reads the cached torch pin and channel pins: one uv call, the final one.
    fake.calls.clear()
    resolve.resolve(s, compile_=fake)
    assert [c[0][0] for c in fake.calls] == ["torch==2.14.1"]
    assert len(fake.calls[0][0]) == 3


def test_cuda12_wheel_toolchain_is_refused(in_tmp: Path) -> None:
    s = spec.load(
        write(in_tmp / "s.yaml", 'name: x\npython: "3.12"\ncuda: "12.8"\narchs: ["12.0f"]\n')
    )
    fake = FakeUv({})
    with pytest.raises(ResolveError) as info:
        resolve.resolve(s, compile_=fake)
    assert str(info.value).splitlines()[1:] == [
        "  - arch 12.0f needs CUDA >= 12.9 but the spec asks 12.8",
        "  - CUDA 12.8 has no nvcc on PyPI (nvidia-cuda-nvcc-cu12 ships only ptxas, "
        "NVIDIA/cuda-python#2100): use `toolchain: {source: system, path: /usr/local/cuda-12.8}`",
    ]
    assert fake.calls == []
