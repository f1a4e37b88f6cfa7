"""The matching policy on recorded resolutions, and resolve() through its one seam."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from packaging.pylock import Pylock

from builder.core.errors import ResolveError
from builder.spec import envspec as spec
from builder.spec import lock, resolve
from builder.spec.lock import LockedFile, LockedPackage
from tests.helpers import ENVSPECS, write

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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
    # Recorded: sglang alone pulls torch 2.14.1 (runtime 13.0.96) with nvcc 13.5.
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


def test_cuda_python_bindings_of_another_major_are_refused(default_spec: spec.EnvSpec) -> None:
    """The shipped FlashInfer 0.7.4 lock held cuda-python 12.6.2.post1 beside cuda-bindings
    13.5.0: its cuda/bindings/ files replace torch's, and `import flashinfer` fails."""
    packages = [
        pkg("torch", "2.14.1"),
        pkg("cuda-toolkit", "13.0.3.0"),
        pkg("cuda-bindings", "13.5.0"),
        pkg("cuda-python", "12.6.2.post1"),
    ]
    assert resolve.policy_problems(default_spec, packages, {}) == [
        "cuda-python 12.6.2.post1 binds CUDA 12 in a CUDA 13 env (it overwrites or pins the "
        "cuda-bindings torch and FlashInfer import)"
    ]
    matched = [*packages[:2], pkg("cuda-bindings", "13.4.4"), pkg("cuda-python", "13.4.4")]
    assert resolve.policy_problems(default_spec, matched, {}) == []


class FakeUv:
    """Replaces the one subprocess seam (uv pip compile) with recorded answers."""

    def __init__(
        self,
        answers: dict[str, list[LockedPackage]],
        before: Callable[[str, Sequence[str]], None] | None = None,
    ) -> None:
        self.answers = answers
        self.before = before  # called with (platform, requirements) as each call starts
        self.calls: list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = []
        self.platforms: list[str] = []
        self.lock = threading.Lock()

    def __call__(
        self,
        s: spec.EnvSpec,
        reqs: Sequence[str],
        cons: Sequence[str],
        over: Sequence[str],
        *,
        extra_args: Sequence[str] = (),
    ) -> resolve.Resolution:
        platform = resolve.platform_of(s).name
        with self.lock:  # the platforms resolve at once (resolve.each_platform)
            self.calls.append((tuple(reqs), tuple(cons), (*over, *extra_args)))
            self.platforms.append(platform)
        if self.before is not None:
            self.before(platform, reqs)
        key = " + ".join(reqs) + (" lowest" if "--resolution=lowest" in extra_args else "")
        # A recorded answer for one platform ("linux-aarch64: torch==...") wins over the
        # answer for every platform.
        answer = self.answers.get(f"{platform}: {key}", self.answers.get(key))
        if answer is None:
            raise KeyError(f"{platform}: {key}")
        return resolve.Resolution(packages=tuple(answer), seconds=0.0)


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
        "  - on linux-x86_64: torch 2.14.1 is built for CUDA 13.0 (cuda-toolkit==13.0.3.0) but "
        "the spec asks 13.2\n"
        "  - on linux-aarch64: torch 2.14.1 is built for CUDA 13.0 (cuda-toolkit==13.0.3.0) but "
        "the spec asks 13.2"
    )
    # Torch alone, once per platform: nothing more was resolved.
    assert [c[0] for c in fake.calls] == [("torch==2.14.1",)] * 2
    assert sorted(fake.platforms) == ["linux-aarch64", "linux-x86_64"]


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
    # NVIDIA's bindings held to the spec's major wherever anything pulls them in: uv
    # otherwise meets flashinfer-python's cuda-python>=12.0 with 12.6.2.post1.
    assert cons[-2:] == ("cuda-python>=13,<14", "cuda-bindings>=13,<14")
    assert "nvidia-cuda-nvcc==13.0.88" in cons
    assert plan.lock.toolkit == "13.0.3.0"
    assert plan.lock.torch_cuda == "13.0"
    assert [p.name for p in plan.lock.packages] == sorted(p.name for p in final)
    # The second resolve reads the cached torch pin and channel pins: one uv call per
    # platform, the final one.
    fake.calls.clear()
    fake.platforms.clear()
    resolve.resolve(s, compile_=fake)
    assert [c[0][0] for c in fake.calls] == ["torch==2.14.1"] * 2
    assert sorted(fake.platforms) == ["linux-aarch64", "linux-x86_64"]
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


# --------------------------------------------------------------------------- two platforms


def cuda_torch_answers(**extra: list[LockedPackage]) -> dict[str, list[LockedPackage]]:
    toolkit_all = [pkg("cuda-toolkit", "13.0.3.0"), *(pkg(n, v) for n, v in CU130_PINS.items())]
    final = [pkg("torch", "2.14.1"), *toolkit_all]
    return {
        "torch==2.14.1": [pkg("torch", "2.14.1"), pkg("cuda-toolkit", "13.0.3.0")],
        "cuda-toolkit[all]==13.0.3.0": toolkit_all,
        "cuda-toolkit[all]==13.0.3.0 lowest": toolkit_all,
        "torch==2.14.1 + " + TOOLKIT_REQ: final,
        **extra,
    }


def test_the_platforms_resolve_at_once(in_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-lock of a two-platform spec is one uv resolution per platform, each about one
    core's work: they run together, so a lock takes about the slowest one's time, not the sum
    (one after the other, each call here would wait for a partner that never comes)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(in_tmp / "cache"))
    s = spec.load(
        write(in_tmp / "s.yaml", 'name: x\npython: "3.12"\ncuda: "13.0"\ntorch: "2.14.1"\n')
    )
    assert s.platforms == ("linux-x86_64", "linux-aarch64")
    met = threading.Barrier(2, timeout=10.0)

    def meet(platform: str, reqs: Sequence[str]) -> None:
        if " + ".join(reqs) == "torch==2.14.1 + " + TOOLKIT_REQ:
            met.wait()  # BrokenBarrierError where the other platform never came

    fake = FakeUv(cuda_torch_answers(), before=meet)
    plan = resolve.resolve(s, compile_=fake)
    assert met.n_waiting == 0 and not met.broken
    assert sorted(fake.platforms[-2:]) == ["linux-aarch64", "linux-x86_64"]
    assert plan.lock.platforms == ("linux-x86_64", "linux-aarch64")
    assert {p.name for p in plan.lock.packages} >= {"torch", "cuda-toolkit", "nvidia-cuda-nvcc"}


def test_a_platform_that_fails_is_said_once_every_platform_has_ended(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The platforms resolve at once; where one fails, the error raised is the first
    platform's (in the spec's order) and only after the other's uv call has ended: no
    resolution is left running behind a refusal."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(in_tmp / "cache"))
    s = spec.load(
        write(in_tmp / "s.yaml", 'name: x\npython: "3.12"\ncuda: "13.0"\ntorch: "2.14.1"\n')
    )
    ended: list[str] = []

    def fail_final(platform: str, reqs: Sequence[str]) -> None:
        if len(reqs) == 1:
            return
        if platform == "linux-x86_64":
            # The slower one: still running when aarch64's has failed, and yet the error
            # said, as the platforms are listed first.
            time.sleep(0.3)
        ended.append(platform)
        raise ResolveError(f"{platform.removeprefix('linux-')}'s failure")

    with pytest.raises(ResolveError, match="x86_64's failure"):
        resolve.resolve(s, compile_=FakeUv(cuda_torch_answers(), before=fail_final))
    # Both platforms' final calls had ended by the time the error came out.
    assert ended[-2:] == ["linux-aarch64", "linux-x86_64"]


def test_a_cpu_only_torch_on_one_platform_is_refused_naming_it(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytorch#168065: on aarch64 the same torch version can resolve to a CPU-only wheel (no
    CUDA runtime among its requirements). Recorded: torch 2.9.1's aarch64 resolution."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(in_tmp / "cache"))
    write(in_tmp / "s.yaml", 'name: x\npython: "3.12"\ncuda: "13.0"\ntorch: "2.14.1"\n')
    s = spec.load("s.yaml")
    assert s.platforms == ("linux-x86_64", "linux-aarch64")
    fake = FakeUv(
        cuda_torch_answers(
            **{"linux-aarch64: torch==2.14.1": [pkg("torch", "2.14.1"), pkg("numpy", "2.3.5")]}
        )
    )
    with pytest.raises(ResolveError) as info:
        resolve.resolve(s, compile_=fake)
    assert str(info.value) == (
        "x (s.yaml): refused by the matching policy, nothing was installed:\n"
        "  - on linux-aarch64: torch 2.14.1 pins no CUDA runtime here (a CPU-only build) but "
        "the spec asks CUDA 13.0"
    )
    # Refused after torch alone on each platform: no full resolution ran.
    assert [c[0] for c in fake.calls] == [("torch==2.14.1",)] * 2
    # Narrowed to x86_64, the same answers lock.
    narrow = spec.load(
        write(in_tmp / "s.yaml", s.source.read_text() + "platforms: [linux-x86_64]\n")
    )
    assert resolve.resolve(narrow, compile_=fake).lock.platforms == ("linux-x86_64",)


def test_the_policy_runs_on_each_platforms_resolution(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(in_tmp / "cache"))
    s = spec.load(
        write(in_tmp / "s.yaml", 'name: x\npython: "3.12"\ncuda: "13.0"\ntorch: "2.14.1"\n')
    )
    answers = cuda_torch_answers()
    drifted = [
        p if p.name != "nvidia-cuda-nvcc" else pkg("nvidia-cuda-nvcc", "13.5.37")
        for p in answers["torch==2.14.1 + " + TOOLKIT_REQ]
    ]
    answers["linux-aarch64: torch==2.14.1 + " + TOOLKIT_REQ] = drifted
    with pytest.raises(ResolveError) as info:
        resolve.resolve(s, compile_=FakeUv(answers))
    assert str(info.value).splitlines()[1:] == [
        "  - on linux-aarch64: nvidia-cuda-nvcc 13.5.37 is not the CUDA 13.0 build (13.0.88): "
        "mixed toolkit minors break JIT (flashinfer#3493)"
    ]


def sdist_only(name: str, version: str) -> LockedPackage:
    return LockedPackage(
        name=name,
        version=version,
        sdist=LockedFile(name=f"{name}-{version}.tar.gz", sha256="1" * 64),
    )


def test_a_package_with_only_an_sdist_on_one_platform_is_refused_naming_both() -> None:
    resolved = {
        "linux-x86_64": (pkg("torch", "2.14.1"), pkg("sgl-kernel", "0.4.10")),
        "linux-aarch64": (pkg("torch", "2.14.1"), sdist_only("sgl-kernel", "0.4.10")),
    }
    assert resolve.wheel_gaps(resolved) == [
        "on linux-aarch64: sgl-kernel 0.4.10 has no linux-aarch64 wheel, only an sdist that "
        "would be compiled at install time: narrow `platforms:` to linux-x86_64"
    ]
    # A pure-Python package with an sdist alone everywhere is no gap.
    both = {k: (sdist_only("tiny", "1.0"),) for k in resolved}
    assert resolve.wheel_gaps(both) == []


def wheel(name: str, version: str, machine: str) -> LockedFile:
    return LockedFile(
        name=f"{name}-{version}-py3-none-manylinux_2_34_{machine}.whl", sha256=machine[0] * 64
    )


def test_two_resolutions_merge_into_entries_each_platform_picks_exactly_once(
    tmp_path: Path,
) -> None:
    """Same version on both: one entry with both platforms' wheels. A version per platform,
    or a platform-only dependency: entries marked with their platform_machine and listed in
    [packages.tool.cudaenv]. The lock validates with packaging.pylock, reads back equal, and
    each platform's markers (evaluated as an installer there would) select what it resolved."""
    from packaging.markers import Marker

    from builder.core import platforms

    x86 = (
        LockedPackage(name="torch", version="2.14.1", marker="sys_platform == 'linux'",
                      wheels=(wheel("torch", "2.14.1", "x86_64"),)),
        LockedPackage(name="torchcodec", version="0.17.0", marker="platform_machine != 'aarch64'",
                      wheels=(wheel("torchcodec", "0.17.0", "x86_64"),)),
        LockedPackage(name="numpy", version="2.3.5", wheels=(wheel("numpy", "2.3.5", "x86_64"),)),
    )  # fmt: skip
    arm = (
        LockedPackage(name="torch", version="2.14.1", marker="sys_platform == 'linux'",
                      wheels=(wheel("torch", "2.14.1", "aarch64"),)),
        LockedPackage(name="numpy", version="2.3.4", wheels=(wheel("numpy", "2.3.4", "aarch64"),)),
        LockedPackage(name="av", version="16.1.0", marker="platform_machine == 'aarch64' or platform_machine == 'arm64'",
                      wheels=(wheel("av", "16.1.0", "aarch64"),)),
    )  # fmt: skip
    merged = resolve.merge({"linux-x86_64": x86, "linux-aarch64": arm})
    by = {(p.name, p.version): p for p in merged}
    assert [f.name for f in by["torch", "2.14.1"].wheels] == [
        "torch-2.14.1-py3-none-manylinux_2_34_x86_64.whl",
        "torch-2.14.1-py3-none-manylinux_2_34_aarch64.whl",
    ]
    assert by["torch", "2.14.1"].marker == "sys_platform == 'linux'"
    assert by["torch", "2.14.1"].platforms == ()
    assert by["numpy", "2.3.5"].platforms == ("linux-x86_64",)
    assert by["numpy", "2.3.5"].marker == "platform_machine == 'x86_64'"
    assert by["av", "16.1.0"].marker == (
        "(platform_machine == 'aarch64' or platform_machine == 'arm64') and "
        "platform_machine == 'aarch64'"
    )
    lk = lock.Lock(
        spec_name="x", fingerprint="sha256:0", python="3.12",
        platforms=("linux-x86_64", "linux-aarch64"), cuda="13.0", torch="2.14.1",
        torch_cuda="13.0", toolkit=None, packages=merged,
    )  # fmt: skip
    # Every file needs a url or a path to be written.
    lk = dataclasses.replace(
        lk,
        packages=tuple(
            dataclasses.replace(
                p,
                wheels=tuple(
                    dataclasses.replace(f, url=f"https://files.test/{f.name}") for f in p.wheels
                ),
            )
            for p in lk.packages
        ),
    )
    out = tmp_path / "pylock.x.toml"
    lock.write(lk, out)
    doc = tomllib.loads(out.read_text())
    Pylock.from_dict(doc)
    assert len(doc["environments"]) == 2
    assert lock.read(out) == lk
    expected = {
        "linux-x86_64": {("torch", "2.14.1"), ("torchcodec", "0.17.0"), ("numpy", "2.3.5")},
        "linux-aarch64": {("torch", "2.14.1"), ("numpy", "2.3.4"), ("av", "16.1.0")},
    }
    for name, want in expected.items():
        assert {(p.name, p.version) for p in lk.packages_on(name)} == want
        env = platforms.get(name).marker_environment("3.12")
        picked = {
            (p.name, p.version)
            for p in lk.packages
            if p.marker is None or Marker(p.marker).evaluate(env)
        }
        assert picked == want
        lines = lk.requirements_txt(name).splitlines()
        assert sorted(ln.split(" ")[0] for ln in lines) == sorted(f"{n}=={v}" for n, v in want)


def test_the_toolkit_pins_are_read_where_nvidia_ships_every_component(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuda-toolkit[all]==13.0.2 does not resolve for aarch64 (no nvidia-cuda-opencl wheel):
    the pins, cuda-toolkit's own metadata, are read for linux-x86_64 whatever the platform."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(in_tmp / "cache"))
    s = spec.load(
        write(
            in_tmp / "s.yaml",
            'name: x\npython: "3.12"\ncuda: "13.0"\ntorch: "2.14.1"\nplatforms: [linux-aarch64]\n',
        )
    )
    fake = FakeUv(cuda_torch_answers())
    resolve.resolve(s, compile_=fake)
    asked = dict(zip([c[0][0] for c in fake.calls], fake.platforms, strict=True))
    assert asked["cuda-toolkit[all]==13.0.3.0"] == "linux-x86_64"
    assert asked["torch==2.14.1"] == "linux-aarch64"
