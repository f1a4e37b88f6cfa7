"""`cudaenv init`: the CUDA candidate choice (with a fake resolver), argument errors, no
overwrite, nothing written on failure; one network test runs the real vLLM init."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from builder.commands import init, pipeline
from builder.core.cudaversion import CudaVersion
from builder.core.errors import ResolveError, UsageError
from builder.core.reporter import Reporter, silent
from builder.machine import box as boxes
from builder.machine.archs import Arch, Gpu
from builder.machine.driver import Driver
from builder.spec import envspec as spec
from builder.spec import lock
from builder.spec.lock import LockedPackage
from tests.helpers import cudaenv

CU132 = CudaVersion(major=13, minor=2)
CU130 = CudaVersion(major=13, minor=0)
CU128 = CudaVersion(major=12, minor=8)
NO_GPU = boxes.Box(platform="linux-x86_64", glibc="2.36", gpu_note="no NVIDIA driver")

# What torch pins for its CUDA, per release (the real releases' own metadata).
TORCH_CUDA = {
    "2.15.0": ("cuda-toolkit", "13.2.2"),
    "2.14.0": ("cuda-toolkit", "13.0.3.0"),
    "2.10.0": ("nvidia-cuda-runtime-cu12", "12.8.90"),
}
# A package -> the torch it pins (a stand-in for uv's metadata).
PINS_TORCH = {"vllm": "2.14.0", "old-thing": "2.10.0"}


class FakeUv:
    """Answers a probe as uv would for the tables above: the newest torch the packages and the
    CUDA constraints allow, with flashinfer-python and cuda-python 12.6 riding along."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = []

    def __call__(
        self, s: spec.EnvSpec, requirements: Sequence[str], constraints: Sequence[str]
    ) -> Sequence[LockedPackage]:
        self.calls.append((s.cuda, tuple(requirements), tuple(constraints)))
        names = [r.split("==")[0] for r in requirements]
        if "nosuchpackage-xyz" in names:
            raise ResolveError(
                f"{s.name} ({s.source}): uv could not resolve [{', '.join(requirements)}] for "
                "linux-x86_64:\nerror: No solution found when resolving dependencies\n  cause: "
                "Because nosuchpackage-xyz was not found in the package registry and you "
                "require nosuchpackage-xyz, we can conclude that your requirements are "
                "unsatisfiable."
            )
        wanted = [PINS_TORCH[n] for n in names if n in PINS_TORCH]
        lo, hi = constraints[0].split(">=")[1].split(",<")
        for torch, (dep, version) in TORCH_CUDA.items():
            if wanted and torch not in wanted:
                continue
            # A constraint binds only what torch requires (as uv's --constraints does).
            bound = constraints[0].split(">=")[0]
            if bound == dep and not (_v(lo) <= _v(version) < _v(hi)):
                continue
            return [
                LockedPackage(name="torch", version=torch),
                LockedPackage(name=dep, version=version),
                LockedPackage(name="flashinfer-python", version="0.7.2.post1"),
                LockedPackage(name="cuda-python", version="12.6.2.post1"),
                *(
                    LockedPackage(name=n, version="0.33.0")
                    for n in names
                    if n not in ("torch", "flashinfer-python")
                ),
            ]
        raise ResolveError(
            f"{s.name} ({s.source}): uv could not resolve [x] for linux-x86_64:\n"
            f"  \u00d7 No solution found when resolving dependencies:\n"
            f"  \u2570\u2500\u25b6 Because torch=={wanted[0] if wanted else '2.15.0'} depends on "
            f"{constraints[0].split('>=')[0]} and you require {constraints[0]}, unsatisfiable."
        )


# The newest release of each package on the fake index.
NEWEST = {"vllm": "0.33.0", "sglang": "0.5.23", "old-thing": "1.0"}


def fake_latest(s: spec.EnvSpec, req: Requirement) -> str | None:
    if req.name == "nosuchpackage-xyz":
        raise ResolveError(
            f"{s.name} ({s.source}): uv could not resolve [{req}] for linux-x86_64:\n"
            "  cause: Because nosuchpackage-xyz was not found in the package registry and you "
            "require nosuchpackage-xyz, we can conclude that your requirements are unsatisfiable."
        )
    return NEWEST.get(req.name)


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


class Lines(Reporter):
    """A reporter that keeps its lines."""

    def __init__(self) -> None:
        super().__init__(quiet=True)
        self.lines: list[str] = []

    def __call__(self, msg: str) -> None:
        self.lines.append(msg)


def choose(
    box: boxes.Box = NO_GPU,
    *,
    uv: FakeUv | None = None,
    with_: Sequence[str] = (),
    gpu: Sequence[str] = (),
    cuda: str | None = None,
) -> tuple[init.Choice, list[str]]:
    say = Lines()
    request = init.make_request(with_=with_, gpu=gpu, cuda=cuda)
    got = init.choose(request, box, uv or FakeUv(), say, Path("envspecs/x.yaml"))
    return got, say.lines


# --------------------------------------------------------------------------- the choice


def test_newest_cuda_that_resolves_wins_and_torch_follows_the_package() -> None:
    uv = FakeUv()
    choice, lines = choose(uv=uv, with_=["vllm==0.33.0"], gpu=["12.0"])
    assert choice.cuda == CU130
    assert choice.torch == "2.14.0"
    assert choice.name == "vllm-0.33.0-cu130"
    assert choice.archs == (Arch.parse("12.0f"),)
    # Pins: the package as asked, FlashInfer as uv chose it, cuda-python held to CUDA 13.
    assert choice.packages == (
        "vllm==0.33.0",
        "flashinfer-python==0.7.2.post1",
        "cuda-python>=13.0,<14",
    )
    # 13.2 first, refused with uv's reason on one line; no torch pin of ours in either call.
    assert [c[0] for c in uv.calls] == ["13.2", "13.0"]
    assert all("torch" in c[1] and not any(r.startswith("torch==") for r in c[1]) for c in uv.calls)
    assert uv.calls[0][2] == ("cuda-toolkit>=13.2,<13.3", "nvidia-cuda-runtime>=13.2,<13.3")
    assert lines[1].startswith("  CUDA 13.2: refused: uv: Because torch==2.14.0 depends on")
    assert "\n" not in lines[1] and "\u2570" not in lines[1]
    assert lines[2] == "  CUDA 13.0: chosen: torch 2.14.0 (cuda-toolkit==13.0.3.0)"


def test_without_packages_the_newest_torch_and_cuda() -> None:
    choice, _ = choose(gpu=["9.0"])
    assert (choice.cuda, choice.torch, choice.name) == (CU132, "2.15.0", "torch-2.15.0-cu132")
    assert choice.archs == (Arch.parse("9.0a"),)


def test_driver_caps_the_cuda() -> None:
    box = boxes.Box(
        platform="linux-x86_64",
        glibc="2.36",
        gpus=(Gpu(index=0, uuid="GPU-1", name="NVIDIA H200", capability=(9, 0)),),
        driver=Driver(version="570.86.15", cuda=None, source="/sys/module/nvidia/version"),
    )
    uv = FakeUv()
    with pytest.raises(ResolveError) as err:
        choose(box, uv=uv, with_=["flashinfer-python"])
    # Both CUDA 13 minors skipped without asking uv; CUDA 12.8 has no toolkit here.
    assert uv.calls == []
    msg = str(err.value)
    assert "\n" not in msg
    assert "CUDA 13.2: skipped: driver 570.86.15" in msg and "needs 580 or newer" in msg
    assert "CUDA 12.8: skipped: no CUDA 12.8 toolkit installed here" in msg


def test_cuda_12_needs_a_system_toolkit_and_gets_it(tmp_path: Path) -> None:
    box = boxes.Box(
        platform="linux-x86_64",
        glibc="2.36",
        driver=Driver(version="570.86.15", cuda=None, source="CUDAENV_DRIVER_VERSION"),
        toolkits=(boxes.Toolkit(cuda=CU128, path=tmp_path / "cuda-12.8"),),
    )
    choice, _ = choose(box, with_=["old-thing"], gpu=["12.0", "9.0a"])
    assert (choice.cuda, choice.torch) == (CU128, "2.10.0")
    assert choice.toolchain == spec.Toolchain(source="system", path=tmp_path / "cuda-12.8")
    # A bare 12.0 is arch-specific below CUDA 12.9; a suffix given is kept.
    assert choice.archs == (Arch.parse("12.0a"), Arch.parse("9.0a"))


def test_cuda_flag_fixes_the_candidate() -> None:
    uv = FakeUv()
    choice, _ = choose(uv=uv, gpu=["12.0"], cuda="13.0")
    assert [c[0] for c in uv.calls] == ["13.0"]
    assert (choice.cuda, choice.torch) == (CU130, "2.14.0")


def test_an_arch_the_cuda_cannot_target_is_skipped_without_uv() -> None:
    uv = FakeUv()
    with pytest.raises(ResolveError, match=r"CUDA 13.0: skipped: arch 7.0: CUDA 13 dropped"):
        choose(uv=uv, gpu=["7.0"], cuda="13.0")
    assert uv.calls == []


def test_all_refused_is_one_line() -> None:
    with pytest.raises(ResolveError) as err:
        choose(with_=["vllm==0.33.0"], gpu=["12.0"], cuda="13.2")
    msg = str(err.value)
    assert "\n" not in msg
    # FlashInfer is asked beside vLLM: it JIT-builds vLLM's kernels.
    assert msg.startswith(
        "no CUDA fits [vllm==0.33.0, flashinfer-python, torch] on this box: CUDA 13.2: refused: uv:"
    )


def test_an_unknown_package_stops_at_the_first_answer() -> None:
    uv = FakeUv()
    with pytest.raises(ResolveError) as err:
        choose(uv=uv, with_=["nosuchpackage-xyz"], gpu=["12.0"])
    assert len(uv.calls) == 1
    assert str(err.value) == (
        "uv: Because nosuchpackage-xyz was not found in the package registry and you require nosuchpackage-xyz, we can conclude "
        "that your requirements are unsatisfiable."
    )


def test_a_box_without_gpu_needs_gpu() -> None:
    with pytest.raises(UsageError, match=r"no NVIDIA GPU is visible here .*--gpu ARCH"):
        choose(with_=["vllm"])


def test_visible_gpus_give_the_archs() -> None:
    box = boxes.Box(
        platform="linux-x86_64",
        glibc="2.36",
        gpus=(
            Gpu(index=0, uuid="a", name="H200", capability=(9, 0)),
            Gpu(index=1, uuid="b", name="RTX PRO 6000", capability=(12, 0)),
        ),
    )
    choice, _ = choose(box)
    assert choice.archs == (Arch.parse("9.0a"), Arch.parse("12.0f"))


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"with_": ["vllm=="]}, "--with 'vllm==': not a valid requirement"),
        ({"with_": ["vllm", "VLLM>=1"]}, "--with 'VLLM>=1': VLLM is asked twice"),
        ({"gpu": ["sm_90"]}, "--gpu 'sm_90': expected an arch like"),
        ({"cuda": "13"}, "--cuda '13': expected a CUDA version major.minor"),
        ({"cuda": "11.8"}, "--cuda 11.8: CUDA 12.x and 13.x are supported"),
        ({"name": "a/b"}, "--name 'a/b': 'a/b' is not a valid env name"),
    ],
)
def test_argument_errors(kw: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError) as err:
        init.make_request(**kw)  # type: ignore[arg-type]
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_torch_in_with_is_the_torch_request() -> None:
    r = init.make_request(with_=["torch>=2.14", "vllm"])
    assert r.torch is not None and str(r.torch) == "torch>=2.14"
    assert [str(p) for p in r.packages] == ["vllm"]


def test_existing_out_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "x.yaml"
    out.write_text("keep me\n")
    with pytest.raises(UsageError, match=r"--out .*x.yaml: the file exists"):
        init.make_request(gpu=["12.0"], out=str(out))
    assert out.read_text() == "keep me\n"


class SglangUv:
    """uv over sglang's real history: 0.5.23 pins torch 2.14.1 (CUDA 13.0) and FlashInfer
    0.7.2; 0.5.2 pins no torch, so an unpinned `sglang` on CUDA 13.2 resolves to it (with
    torch 2.15.0) and to no FlashInfer unless FlashInfer is asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def __call__(
        self, s: spec.EnvSpec, requirements: Sequence[str], constraints: Sequence[str]
    ) -> Sequence[LockedPackage]:
        self.calls.append((s.cuda, tuple(requirements)))
        newest = "sglang==0.5.23" in requirements
        fi = "flashinfer-python" in requirements
        if s.cuda == "13.2":
            if newest:
                raise ResolveError(
                    f"{s.name} ({s.source}): uv could not resolve [x] for linux-x86_64:\n"
                    "  \u2570\u2500\u25b6 Because sglang==0.5.23 depends on torch==2.14.1 and "
                    "torch==2.14.1 depends on cuda-toolkit==13.0.3.0, unsatisfiable."
                )
            return [
                LockedPackage(name="torch", version="2.15.0"),
                LockedPackage(name="cuda-toolkit", version="13.2.2"),
                LockedPackage(name="sglang", version="0.5.2"),
                *([LockedPackage(name="flashinfer-python", version="0.6.1")] if fi else []),
            ]
        return [
            LockedPackage(name="torch", version="2.14.1"),
            LockedPackage(name="cuda-toolkit", version="13.0.3.0"),
            LockedPackage(name="sglang", version="0.5.23"),
            LockedPackage(name="flashinfer-python", version="0.7.2"),
        ]


DRIVER_580 = boxes.Box(
    platform="linux-x86_64",
    glibc="2.36",
    gpu_note="no NVIDIA driver",
    driver=Driver(version="580.95.05", cuda=None, source="CUDAENV_DRIVER_VERSION"),
)


def test_the_newest_asked_release_comes_before_the_newest_cuda() -> None:
    """`init --with sglang --gpu 12.0` on a 580 driver: sglang 0.5.23 on CUDA 13.0 with its
    FlashInfer, not sglang 0.5.2 on CUDA 13.2 (which `import sglang` fails on)."""
    uv = SglangUv()
    say = Lines()
    request = init.make_request(with_=["sglang"], gpu=["12.0"])
    choice = init.choose(request, DRIVER_580, uv, say, Path("envspecs/x.yaml"), fake_latest)
    assert (choice.cuda, choice.torch) == (CU130, "2.14.1")
    assert choice.packages[:2] == ("sglang==0.5.23", "flashinfer-python==0.7.2")
    assert choice.name == "sglang-0.5.23-cu130"
    assert "newest releases for linux-x86_64: sglang 0.5.23" in say.lines
    assert "sglang: 0.5.23 (the newest release)" in say.lines
    # The newest release held, FlashInfer asked beside it, CUDA 13.2 tried first.
    assert uv.calls[0] == ("13.2", ("sglang==0.5.23", "flashinfer-python", "torch"))
    assert [c[0] for c in uv.calls] == ["13.2", "13.0"]


def test_a_release_older_than_the_newest_says_why() -> None:
    """Where no candidate takes the newest release (here CUDA 13.2 is fixed), an older one is
    chosen and the choice says which, beside the newest, and why."""
    say = Lines()
    request = init.make_request(with_=["sglang"], gpu=["12.0"], cuda="13.2")
    choice = init.choose(request, DRIVER_580, SglangUv(), say, Path("envspecs/x.yaml"), fake_latest)
    assert choice.packages[:2] == ("sglang==0.5.2", "flashinfer-python==0.6.1")
    said = [ln for ln in say.lines if ln.startswith("sglang: ")]
    assert len(said) == 1
    assert said[0].startswith(
        "sglang: 0.5.2, not the newest 0.5.23: 0.5.23 does not resolve here (CUDA 13.2: refused: "
        "uv: Because sglang==0.5.23 depends on torch==2.14.1"
    )
    assert said[0] in choice.notes  # and the spec's comments carry it
    assert "# note: " + said[0] in init.render(choice, request, DRIVER_580)


def test_a_stack_without_its_jit_companion_is_never_silent() -> None:
    class NoFlashInfer(SglangUv):
        def __call__(
            self, s: spec.EnvSpec, requirements: Sequence[str], constraints: Sequence[str]
        ) -> Sequence[LockedPackage]:
            got = super().__call__(s, requirements, constraints)
            return [p for p in got if p.name != "flashinfer-python"]

    say = Lines()
    request = init.make_request(with_=["sglang"], gpu=["12.0"])
    choice = init.choose(request, DRIVER_580, NoFlashInfer(), say, Path("e/x.yaml"), fake_latest)
    assert not any(p.startswith("flashinfer-python") for p in choice.packages)
    assert any(
        n.startswith("flashinfer-python is not in the set uv chose: sglang JIT-builds")
        for n in choice.notes
    )


def test_a_named_spec_that_exists_is_refused_before_any_resolution(in_tmp: Path) -> None:
    (in_tmp / "envspecs").mkdir()
    (in_tmp / "envspecs" / "mine.yaml").write_text("keep\n")
    uv = FakeUv()
    request = init.make_request(with_=["vllm"], gpu=["12.0"], name="mine")
    calls: list[str] = []

    def latest(s: spec.EnvSpec, req: Requirement) -> str | None:
        calls.append(req.name)
        return "0.33.0"

    with pytest.raises(UsageError, match="the file exists; init never overwrites"):
        init.init(request, silent(), box=NO_GPU, probe=uv, latest=latest, locker=_fake_locker)
    assert uv.calls == [] and calls == []


# --------------------------------------------------------------------------- writing


def _fake_locker(path: Path, say: Reporter) -> pipeline.Locked:
    s = spec.load(path)
    lk = lock.Lock(
        spec_name=s.name,
        fingerprint=s.fingerprint(),
        python=s.python,
        platforms=s.platforms,
        cuda=s.cuda,
        torch=s.torch,
        torch_cuda=s.cuda,
        toolkit=None,
        packages=(),
    )
    out = lock.lock_path(s.source, s.name)
    lock.write(lk, out)
    return pipeline.Locked(spec=s, path=out, lock=lk, seconds=0.0)


def test_writes_a_spec_that_loads_with_the_pins(tmp_path: Path) -> None:
    out = tmp_path / "new" / "vllm.yaml"
    request = init.make_request(
        with_=["vllm==0.33.0"], gpu=["12.0"], out=str(out), argv=["--with=vllm==0.33.0"]
    )
    done = init.init(
        request, silent(), box=NO_GPU, probe=FakeUv(), latest=fake_latest, locker=_fake_locker
    )
    s = spec.load(out)
    assert done.spec == s
    assert (s.name, s.cuda, s.torch) == ("vllm-0.33.0-cu130", "13.0", "2.14.0")
    assert s.packages == ("vllm==0.33.0", "flashinfer-python==0.7.2.post1", "cuda-python>=13.0,<14")
    assert s.archs == (Arch.parse("12.0f"),)
    assert s.toolchain == spec.Toolchain()
    text = out.read_text()
    assert text.startswith("# Written by `cudaenv init --with=vllm==0.33.0`\n")
    assert "#   CUDA 13.2: refused: uv:" in text
    assert done.locked.path == out.parent / "locks" / "pylock.vllm-0-33-0-cu130.toml"


def test_a_failed_lock_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "vllm.yaml"

    def refuse(path: Path, say: Reporter) -> pipeline.Locked:
        assert path.exists()  # the spec is on disk while it is locked...
        raise ResolveError("vllm (x): refused by the matching policy:\n  - on linux-aarch64: no")

    request = init.make_request(with_=["vllm==0.33.0"], gpu=["12.0"], out=str(out))
    with pytest.raises(ResolveError) as err:
        init.init(request, silent(), box=NO_GPU, probe=FakeUv(), latest=fake_latest, locker=refuse)
    assert "\n" not in str(err.value)
    assert str(err.value).endswith("refused by the matching policy: on linux-aarch64: no")
    assert list(tmp_path.iterdir()) == []  # ...and gone after, with the directories made


def test_a_refused_choice_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "x.yaml"
    request = init.make_request(with_=["nosuchpackage-xyz"], gpu=["12.0"], out=str(out))
    with pytest.raises(ResolveError):
        init.init(
            request, silent(), box=NO_GPU, probe=FakeUv(), latest=fake_latest, locker=_fake_locker
        )
    assert list(tmp_path.iterdir()) == []


def test_a_default_name_that_is_taken_is_never_overwritten_and_the_next_is_chosen(
    in_tmp: Path,
) -> None:
    """The name init chooses itself may be a shipped spec's (`init --with sglang` chooses the
    default spec's stack, so its name too): the existing spec and lock are kept, and the
    first free NAME-N is written, said. A --name the user gave is refused instead."""
    (in_tmp / "envspecs").mkdir()
    taken = in_tmp / "envspecs" / "vllm-0.33.0-cu130.yaml"
    taken.write_text("keep\n")
    request = init.make_request(with_=["vllm==0.33.0"], gpu=["12.0"])
    told = io.StringIO()
    done = init.init(
        request, Reporter(stream=told), box=NO_GPU, probe=FakeUv(), latest=fake_latest,
        locker=_fake_locker,
    )  # fmt: skip
    said = [line.removeprefix("cudaenv: ") for line in told.getvalue().splitlines()]
    assert taken.read_text() == "keep\n"
    assert done.spec_path == Path("envspecs") / "vllm-0.33.0-cu130-2.yaml"
    assert done.spec.name == "vllm-0.33.0-cu130-2"
    assert any(
        line.startswith("named vllm-0.33.0-cu130-2: vllm-0.33.0-cu130 is taken") for line in said
    )
    named = init.make_request(with_=["vllm==0.33.0"], gpu=["12.0"], name="vllm-0.33.0-cu130")
    with pytest.raises(UsageError, match="the file exists; init never overwrites"):
        init.init(
            named, silent(), box=NO_GPU, probe=FakeUv(), latest=fake_latest, locker=_fake_locker
        )


def test_an_existing_lock_of_that_name_is_not_overwritten(tmp_path: Path) -> None:
    stale = tmp_path / "locks" / "pylock.vllm-0-33-0-cu130.toml"
    stale.parent.mkdir()
    stale.write_text("old\n")
    request = init.make_request(with_=["vllm==0.33.0"], gpu=["12.0"], out=str(tmp_path / "v.yaml"))
    done = init.init(
        request, silent(), box=NO_GPU, probe=FakeUv(), latest=fake_latest, locker=_fake_locker
    )
    assert stale.read_text() == "old\n" and done.spec.name == "vllm-0.33.0-cu130-2"


def test_one_line_drops_uv_decoration() -> None:
    # uv's error tree: a cross, then a corner, a dash and an arrow.
    text = "  \u00d7 No solution found:\n  \u2570\u2500\u25b6 Because a, b.\n      And c."
    assert init.one_line(text) == "Because a, b. And c."


def test_glibc_is_read() -> None:
    found = boxes.glibc_version()
    assert found is None or found[0].isdigit()


# --------------------------------------------------------------------------- the command


def test_cli_without_gpu_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    if boxes.detect_box().gpus:
        pytest.skip("this box has a GPU: --gpu is not needed here")
    out = tmp_path / "x.yaml"
    done = cudaenv("init", "--with", "vllm==0.33.0", "--out", str(out), cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "--gpu ARCH" in errors[0]
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_cli_bad_argument_exits_2(tmp_path: Path) -> None:
    done = cudaenv("init", "--gpu", "12.0", "--cuda", "thirteen", cwd=tmp_path, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: --cuda 'thirteen':")


@pytest.mark.network
def test_real_vllm_init_pins_what_vllm_pins(tmp_path: Path) -> None:
    out = tmp_path / "vllm.yaml"
    done = cudaenv(
        "init", "--with", "vllm==0.33.0", "--gpu", "12.0", "--out", str(out), cwd=tmp_path
    )
    s = spec.load(out)
    assert (s.cuda, s.torch) == ("13.0", "2.14.0")
    assert "flashinfer-python==0.7.2.post1" in s.packages
    assert s.archs == (Arch.parse("12.0f"),)
    lk = lock.read(lock.lock_path(s.source, s.name), spec_name=s.name)
    assert lk.fingerprint == s.fingerprint()
    assert {p.name: p.version for p in lk.packages_on("linux-x86_64")}["torch"] == "2.14.0"
    assert "cudaenv build --verify" in done.stdout


@pytest.mark.network
def test_real_unknown_package_exits_3_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "n.yaml"
    done = cudaenv(
        "init", "--with", "nosuchpackage-xyz", "--gpu", "12.0", "--out", str(out),
        cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 3
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "nosuchpackage-xyz was not found" in errors[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.network
def test_real_sglang_init_takes_the_newest_sglang_and_its_flashinfer(tmp_path: Path) -> None:
    """`init --with sglang --gpu 12.0` on a 580 driver: the newest sglang on the CUDA it
    accepts, with its FlashInfer, each asked package said beside the newest release."""
    out = tmp_path / "sg.yaml"
    done = cudaenv(
        "init", "--with", "sglang", "--gpu", "12.0", "--out", str(out), cwd=tmp_path,
        env={"CUDAENV_DRIVER_VERSION": "580.95.05"},
    )  # fmt: skip
    s = spec.load(out)
    newest = next(ln for ln in done.stderr.splitlines() if "newest releases for" in ln)
    top = newest.rsplit("sglang ", 1)[1]
    assert f"sglang=={top}" in s.packages
    assert any(p.startswith("flashinfer-python==") for p in s.packages)
    assert f"cudaenv: sglang: {top} (the newest release)" in done.stderr


@pytest.mark.network
def test_real_init_for_a_fleet_with_a_t4_names_what_blocks_and_writes_nothing(
    tmp_path: Path,
) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "targets:\n"
        '  - {name: t4, cc: "7.5", platform: linux-x86_64, driver: "580.95.05"}\n'
        '  - {name: rtx, cc: "12.0", platform: linux-x86_64, driver: "580.95.05"}\n'
    )
    done = cudaenv(
        "init", "--with", "sglang", "--targets", str(fleet), "--out",
        str(tmp_path / "e" / "sg.yaml"), cwd=tmp_path, check=False,
        env={"CUDAENV_DRIVER_VERSION": "580.95.05"},
    )  # fmt: skip
    assert done.returncode == 5, done.stderr
    (error,) = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert "cannot run on t4 (7.5, linux-x86_64, driver 580.95.05): no kernel: " in error
    assert "sgl_kernel/sm100/common_ops.abi3.so has no code for 7.5" in error
    assert "nothing written" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.yaml"]


def test_a_bad_fleet_file_stops_init_before_any_resolution(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text('targets: [{name: t4, cc: "7.5f", platform: linux-x86_64, driver: "580"}]\n')
    done = cudaenv("init", "--with", "sglang", "--targets", str(fleet), cwd=tmp_path, check=False)
    assert done.returncode == 2
    assert "targets[0].cc: '7.5f' is an arch spelling" in done.stderr
    assert "resolving" not in done.stderr and "choosing" not in done.stderr


def test_the_asked_gpus_are_judged_as_targets_of_this_box() -> None:
    request = init.make_request(with_=["sglang"], gpu=["12.0", "7.5", "12.0a"])
    got = init.asked_gpus(request, DRIVER_580, CU130)
    assert [(t.name, t.cc_text, t.platform, t.driver) for t in got] == [
        ("gpu-12.0", "12.0", "linux-x86_64", "580.95.05"),
        ("gpu-7.5", "7.5", "linux-x86_64", "580.95.05"),
    ]
    # No driver found: the oldest that runs the CUDA, so only the binaries decide.
    (t,) = init.asked_gpus(init.make_request(gpu=["9.0"]), NO_GPU, CU130)
    assert t.driver == "580"


@pytest.mark.network
def test_real_init_for_a_t4_says_what_blocks_before_writing(tmp_path: Path) -> None:
    done = cudaenv(
        "init", "--with", "sglang", "--gpu", "7.5", "--out", str(tmp_path / "sg.yaml"),
        cwd=tmp_path, check=False, env={"CUDAENV_DRIVER_VERSION": "580.95.05"},
    )  # fmt: skip
    assert done.returncode == 5, done.stderr
    assert "cannot run on gpu-7.5 (7.5, linux-x86_64" in done.stderr
    assert "sgl_kernel/sm100/common_ops.abi3.so has no code for 7.5" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_fleet_of_570_drivers_gets_a_cuda_they_run(tmp_path: Path) -> None:
    """`init --targets` with a 570-driver fleet picked CUDA 13.0 and then refused it: the
    fleet's drivers rule candidates out before any resolution, each named."""
    from builder.machine import targets

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "targets:\n"
        '  - {name: h100, cc: "9.0", platform: "linux-x86_64", driver: "570.86.15"}\n'
        '  - {name: b200, cc: "10.0", platform: "linux-x86_64", driver: "580.95.05"}\n'
    )
    assert len(targets.load_file(fleet)) == 2
    box = boxes.Box(platform="linux-x86_64", glibc="2.36", gpu_note="no NVIDIA driver",
                    toolkits=(boxes.Toolkit(cuda=CU128, path=Path("/usr/local/cuda-12.8")),))  # fmt: skip
    say = Lines()
    request = init.make_request(with_=["old-thing"], targets_file=str(fleet))
    uv = FakeUv()
    choice = init.choose(request, box, uv, say, Path("envspecs/x.yaml"))
    assert choice.cuda == CU128
    assert {c[0] for c in uv.calls} == {"12.8"}  # CUDA 13 was never resolved
    assert any("the fleet's h100 (driver 570.86.15) does not run it (needs 580 or newer)" in ln
               for ln in say.lines)  # fmt: skip
