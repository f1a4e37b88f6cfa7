"""The sampling check around the GPU: which devices it tests and how it addresses them, the
environment its runners get, each half's own verdict, the statistical design (row roles,
ties, the independent redraw) and that nothing in it can crash verify. The GPU, our binary and
FlashInfer's runner are replaced at their seams; the reference and statistics run for real."""

from __future__ import annotations

import dataclasses
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from builder import verify
from builder.core.statuses import FAILED, PASSED, SKIPPED
from builder.machine import archs
from builder.verify import reference as ref
from builder.verify import sampling
from builder.verify.kernel_compile import KernelBuild
from builder.verify.model import CheckResult, EnvFacts, Target
from tests.helpers import env_facts, write

H200 = archs.Gpu(index=0, uuid="GPU-aaaa-1111", name="NVIDIA H200", capability=(9, 0))
B200 = archs.Gpu(index=1, uuid="GPU-bbbb-2222", name="NVIDIA B200", capability=(10, 0))
A100_MIG = archs.Gpu(index=2, uuid="GPU-cccc-3333", name="NVIDIA A100", capability=(8, 0), mig=True)
Sampler = Callable[[ref.Case, random.Random], int]


def target(tmp_path: Path, *arch_texts: str) -> Target:
    return Target(
        python=Path(sys.executable),
        archs=archs.parse_list(" ".join(arch_texts) or "9.0a"),
        work=tmp_path / "work",
        env_dir=tmp_path,
        expected_cuda="13.0",
        spec_name="x",
        spec_path="envspecs/x.yaml",
    )


def facts(tmp_path: Path, **changes: Any) -> EnvFacts:
    nvcc = write(tmp_path / "cuda-home" / "bin" / "nvcc", "#!/bin/sh\n")
    nvcc.chmod(0o755)
    base = env_facts(cuda_home=str(tmp_path / "cuda-home"), environ={"PATH": "/usr/bin:/bin"})
    return dataclasses.replace(base, **changes)


def draws(cases: list[ref.Case], sampler: Sampler, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)  # noqa: S311 - reproducible
    return [[sampler(c, rng) for _ in range(sampling.DRAWS)] for c in cases]


def correct(case: ref.Case, rng: random.Random) -> int:
    return ref.sample(case.probs, case.top_k, case.top_p, rng.random())


def skips_top_p_when_top_k_is_set(case: ref.Case, rng: random.Random) -> int:
    return ref.sample(case.probs, case.top_k, 1.0 if case.top_k > 0 else case.top_p, rng.random())


class Fakes:
    """The seams: build_kernel, run_kernel and run_flashinfer, recording what they got."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpus: list[archs.Gpu]) -> None:
        self.built: list[str] = []
        self.kernel_envs: list[dict[str, str]] = []
        self.fi_seeds: list[int] = []
        self.flashinfer: Sampler = correct
        self.build_error: str | None = None
        monkeypatch.setattr(archs, "visible_gpus", lambda: (gpus, None))
        # A driver that runs the env's CUDA, wherever the tests run (a test may set another).
        monkeypatch.setenv("CUDAENV_DRIVER_VERSION", "580.65.06")
        monkeypatch.delenv(sampling.GPU_CHECK, raising=False)
        monkeypatch.setattr(sampling, "build_kernel", self.build_kernel)
        monkeypatch.setattr(sampling, "run_kernel", self.run_kernel)
        monkeypatch.setattr(sampling, "run_flashinfer", self.run_flashinfer)

    def build_kernel(self, nvcc: Path, arch: archs.Arch, work: Path, **kw: Any) -> KernelBuild:
        self.built.append(str(arch))
        return KernelBuild(
            arch=arch, path=work / "k", seconds=0.0, reused=True, error=self.build_error
        )

    def run_kernel(
        self,
        binary: Path,
        device: sampling.Device,
        cases: list[ref.Case],
        us: list[list[float]],
        work: Path,
        env: dict[str, str],
    ) -> tuple[list[list[int]] | None, str]:
        self.kernel_envs.append(sampling.device_env(env, device))
        return [
            [ref.sample(c.probs, c.top_k, c.top_p, u) for u in row]
            for c, row in zip(cases, us, strict=True)
        ], ""

    def run_flashinfer(
        self,
        target: Target,
        facts: EnvFacts,
        device: sampling.Device,
        cases: list[ref.Case],
        work: Path,
        seed: int,
    ) -> list[list[int]]:
        self.fi_seeds.append(seed)
        return draws(cases, self.flashinfer, seed)


# --------------------------------------------------------------------------- 1: archs


@pytest.mark.slow
def test_both_halves_pass_and_are_reported_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes = Fakes(monkeypatch, [H200])
    result = sampling.check(target(tmp_path, "9.0a"), facts(tmp_path))
    assert result.status == PASSED, result.summary
    assert fakes.built == ["9.0a"]
    assert result.summary == (
        "1 device(s): our kernel passed on 1 device(s); FlashInfer passed on 1 device(s)"
    )
    shown = dict(result.evidence)
    assert shown["GPU 0 (NVIDIA H200, SM 9.0) our kernel"].startswith("passed: 9.0a: ")
    assert "samples exact" in shown["GPU 0 (NVIDIA H200, SM 9.0) our kernel"]
    assert "chi2=" in shown["GPU 0 (NVIDIA H200, SM 9.0) FlashInfer"]


@pytest.mark.slow
def test_a_gpu_missing_from_the_envs_archs_fails_flashinfer_with_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Fakes(monkeypatch, [H200])
    result = sampling.check(target(tmp_path, "12.0f"), facts(tmp_path))
    assert result.status == FAILED
    shown = dict(result.evidence)
    assert shown["GPU 0 (NVIDIA H200, SM 9.0) FlashInfer"] == (
        "failed: env built for 12.0f, this GPU is 9.0a: add it with "
        "`cudaenv verify envspecs/x.yaml --archs 9.0a` or rebuild on this box"
    )
    # Our kernel is built for the GPU's own arch and still passes.
    assert shown["GPU 0 (NVIDIA H200, SM 9.0) our kernel"].startswith("passed")


# --------------------------------------------------------------------------- 2, 3: devices


@pytest.mark.slow
def test_runners_get_the_envs_whole_environment_and_one_device_by_uuid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes = Fakes(monkeypatch, [H200])
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"}
    sampling.check(target(tmp_path), facts(tmp_path, environ=env))
    (got,) = fakes.kernel_envs
    assert got["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
    assert got["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa-1111"
    assert got["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_run_kernel_passes_the_environment_to_the_binary(tmp_path: Path) -> None:
    binary = write(
        tmp_path / "k",
        "#!/bin/sh\n"
        '[ "$LD_LIBRARY_PATH" = /usr/local/nvidia/lib64 ] || { echo cudaErrorInsufficientDriver; exit 3; }\n'
        '[ "$CUDA_VISIBLE_DEVICES" = GPU-aaaa-1111 ] || { echo wrong device; exit 4; }\n'
        "printf '1 2\\n' > \"$2\"\n",
    )
    binary.chmod(0o755)
    device = sampling.Device(gpu=H200, select=H200.uuid)
    cases = ref.make_cases()[:1]
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"}
    assert sampling.run_kernel(binary, device, cases, [[0.5]], tmp_path, env) == ([[1, 2]], "")
    rows, error = sampling.run_kernel(binary, device, cases, [[0.5]], tmp_path, {"PATH": "/bin"})
    assert rows is None and error == "cudaErrorInsufficientDriver"


def selects(gpus: list[archs.Gpu], **environ: str) -> tuple[list[str], list[str]]:
    devices, notes = sampling.select_devices(gpus, environ)
    return [d.select for d in devices], notes


def test_device_selection_honours_the_users_cuda_visible_devices() -> None:
    both = [H200, B200]
    assert selects(both) == (["GPU-aaaa-1111", "GPU-bbbb-2222"], [])
    assert selects(both, CUDA_VISIBLE_DEVICES="GPU-bbbb") == (["GPU-bbbb-2222"], [])
    chosen, notes = selects(both, CUDA_VISIBLE_DEVICES="1")
    assert chosen == ["GPU-bbbb-2222"]
    assert notes[0].startswith("CUDA_VISIBLE_DEVICES=1 read in PCI bus order")
    assert selects(both, CUDA_VISIBLE_DEVICES="1", CUDA_DEVICE_ORDER="PCI_BUS_ID") == (
        ["GPU-bbbb-2222"],
        [],
    )
    assert selects(both, CUDA_VISIBLE_DEVICES="-1") == (
        [],
        ["CUDA_VISIBLE_DEVICES='-1' hides every GPU"],
    )
    chosen, notes = selects(both, CUDA_VISIBLE_DEVICES="GPU-zzzz,0")
    assert chosen == ["GPU-aaaa-1111"]
    assert "'GPU-zzzz' matches no single GPU" in notes[-1]


def test_a_gpu_in_mig_mode_is_tested_through_a_named_instance_only() -> None:
    chosen, notes = selects([H200, A100_MIG])
    assert chosen == ["GPU-aaaa-1111"]
    assert "GPU 2 (NVIDIA A100, SM 8.0) is in MIG mode" in notes[0]
    chosen, notes = selects([H200, A100_MIG], CUDA_VISIBLE_DEVICES="MIG-abcd")
    assert chosen == ["MIG-abcd"] and notes == []
    devices, _ = sampling.select_devices([A100_MIG], {"CUDA_VISIBLE_DEVICES": "MIG-abcd"})
    assert devices[0].label == "GPU 2 (NVIDIA A100, SM 8.0, MIG-abcd)"


# --------------------------------------------------------------------------- 4: halves


@pytest.mark.slow
def test_no_flashinfer_is_a_skipped_half_and_said_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes = Fakes(monkeypatch, [H200])
    result = sampling.check(target(tmp_path), facts(tmp_path, flashinfer_installed=False))
    assert result.status == PASSED
    assert result.summary == (
        "1 device(s): our kernel passed on 1 device(s); "
        "FlashInfer skipped (not installed in this env)"
    )
    assert fakes.fi_seeds == []


@pytest.mark.slow
def test_a_flashinfer_that_does_not_import_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Fakes(monkeypatch, [H200])
    broken = facts(tmp_path, flashinfer_error="ImportError: No module named 'tvm_ffi'")
    result = sampling.check(target(tmp_path), broken)
    assert result.status == FAILED
    assert "FlashInfer: installed but does not import: ImportError: No module named 'tvm_ffi'" in (
        result.summary
    )


def test_nothing_to_run_is_skipped_not_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Fakes(monkeypatch, [A100_MIG])
    result = sampling.check(target(tmp_path), facts(tmp_path))
    assert result.status == SKIPPED
    assert result.summary.startswith("no GPU to test: GPU 2 (NVIDIA A100, SM 8.0) is in MIG mode")


# --------------------------------------------------------------------------- 4b: the GPU check


@pytest.mark.slow
def test_in_the_gpu_check_a_skipped_half_fails_naming_what_it_lacked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes = Fakes(monkeypatch, [H200])
    monkeypatch.setenv(sampling.GPU_CHECK, "1")
    result = sampling.check(target(tmp_path), facts(tmp_path, flashinfer_installed=False))
    assert result.status == FAILED
    assert result.summary == (
        "GPU 0 (NVIDIA H200, SM 9.0) FlashInfer: did not run on GPU 0 (NVIDIA H200, SM 9.0) "
        "(not installed in this env); CUDAENV_GPU_CHECK=1: the GPU check needs both halves"
    )
    assert dict(result.evidence)["GPU 0 (NVIDIA H200, SM 9.0) our kernel"].startswith("passed")
    assert fakes.fi_seeds == []
    # Both halves there: the GPU check passes as verify does.
    assert sampling.check(target(tmp_path), facts(tmp_path)).status == PASSED


@pytest.mark.parametrize("gpus", [[], [A100_MIG]], ids=["no-gpu", "mig-only"])
def test_in_the_gpu_check_nothing_to_run_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: list[archs.Gpu]
) -> None:
    Fakes(monkeypatch, gpus)
    if not gpus:
        monkeypatch.setattr(archs, "visible_gpus", lambda: ([], "no visible NVIDIA GPU"))
    monkeypatch.setenv(sampling.GPU_CHECK, "1")
    result = sampling.check(target(tmp_path), facts(tmp_path))
    assert result.status == FAILED
    assert result.summary.endswith("(CUDAENV_GPU_CHECK=1: the GPU check needs a GPU)")
    monkeypatch.setenv(sampling.GPU_CHECK, "0")
    assert sampling.check(target(tmp_path), facts(tmp_path)).status == SKIPPED


@pytest.mark.slow
def test_a_driver_too_old_for_torchs_cuda_fails_flashinfer_with_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch cu130 on a 570 driver: FlashInfer's half would die in cudaErrorInsufficientDriver;
    it fails before running, with the build gate's table. Our kernel, from a 12.8 nvcc, runs."""
    fakes = Fakes(monkeypatch, [H200])
    monkeypatch.setenv("CUDAENV_DRIVER_VERSION", "570.86.15")
    result = sampling.check(target(tmp_path), facts(tmp_path, nvcc_release="12.8"))
    assert result.status == FAILED
    shown = dict(result.evidence)
    assert shown["GPU 0 (NVIDIA H200, SM 9.0) FlashInfer"] == (
        "failed: driver too old: torch 2.14.1+cu130 needs CUDA 13.0, which needs NVIDIA driver "
        "580 or newer; this machine has driver 570.86.15 (read from CUDAENV_DRIVER_VERSION): "
        "use a torch built for CUDA 12.x (which it runs) or install driver 580 or newer (or "
        "cuda-compat-13-0 on a datacenter GPU)"
    )
    assert shown["GPU 0 (NVIDIA H200, SM 9.0) our kernel"].startswith("passed")
    assert fakes.fi_seeds == []  # FlashInfer was not run
    assert result.fix.startswith("the driver cannot run this env's CUDA")


def test_a_driver_too_old_for_nvccs_cuda_fails_both_halves_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes = Fakes(monkeypatch, [H200])
    monkeypatch.setenv("CUDAENV_DRIVER_VERSION", "570.86.15")
    result = sampling.check(target(tmp_path), facts(tmp_path))
    assert result.status == FAILED
    for who in ("our kernel", "FlashInfer"):
        shown = dict(result.evidence)[f"GPU 0 (NVIDIA H200, SM 9.0) {who}"]
        assert shown.startswith("failed: driver too old: "), shown
    kernel = dict(result.evidence)["GPU 0 (NVIDIA H200, SM 9.0) our kernel"]
    assert "the kernel built by CUDA_HOME's nvcc 13.0 needs CUDA 13.0" in kernel
    assert (fakes.built, fakes.kernel_envs, fakes.fi_seeds) == ([], [], [])


# --------------------------------------------------------------------------- 5: statistics


def test_every_row_role_is_present_and_no_tie_sits_at_a_boundary() -> None:
    cases = ref.make_cases()
    assert [ref.role(c) for c in cases] == [r for r, _, _ in ref.ROWS]
    assert {"k", "p", "p-only", "both"} <= {ref.role(c) for c in cases}
    assert any(ref.role(c) == "p" and c.top_k > 0 for c in cases)
    assert not any(ref._tie_at_boundary(c) for c in cases)
    tied = ref.Case(probs=(0.4, 0.2, 0.2, 0.1, 0.1), top_k=2, top_p=1.0)
    assert ref._tie_at_boundary(tied)  # token 1 kept, token 2 (the same prob) dropped


@pytest.mark.slow
def test_a_sampler_that_skips_top_p_when_top_k_is_set_fails() -> None:
    cases = ref.make_cases()
    bad = [
        v.detail
        for v in sampling.judge_draws(cases, draws(cases, skips_top_p_when_top_k_is_set))
        if not v.passed
    ]
    failed_rows = {int(d.split(":")[0].split()[1]) for d in bad}
    assert failed_rows and all(ref.role(cases[i]) == "p" for i in failed_rows)
    assert sampling.judge_draws(cases, draws(cases, correct)) == [
        v for v in sampling.judge_draws(cases, draws(cases, correct)) if v.passed
    ]


@pytest.mark.slow
def test_a_chi_square_failure_is_redrawn_with_an_independent_seed() -> None:
    cases = ref.make_cases()
    good = draws(cases, correct)
    # Row 0's first draw is skewed (as an unlucky seed would be); the redraw is fair.
    unlucky = [list(row) for row in good]
    kept = ref.kept_set(cases[0].probs, cases[0].top_k, cases[0].top_p)
    unlucky[0] = [kept[0]] * sampling.DRAWS
    redraws: list[int] = []

    def fair() -> list[list[int]]:
        redraws.append(1)
        return draws(cases, correct, seed=2)

    failures, detail = sampling.judge_with_redraw(cases, unlucky, fair)
    assert failures == [] and redraws == [1]
    assert "redrawn rows [0]: failed again []" in detail
    # A sampler that is wrong every time fails on both draws.
    failures, _ = sampling.judge_with_redraw(cases, unlucky, lambda: unlucky)
    assert failures == ["row 0: chi-square failed on two independent draws"]
    # Membership is not a matter of luck: no redraw.
    outside = [list(row) for row in good]
    outside[1][0] = (
        63 if 63 not in ref.kept_set(cases[1].probs, cases[1].top_k, cases[1].top_p) else 62
    )
    failures, _ = sampling.judge_with_redraw(cases, outside, fair)
    assert len(redraws) == 1 and any("outside the top-k" in f for f in failures)


@pytest.mark.slow
def test_the_check_redraws_flashinfer_with_its_second_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes = Fakes(monkeypatch, [H200])

    def uniform_in_the_set(case: ref.Case, rng: random.Random) -> int:
        # Never outside the set (membership passes), but blind to the probabilities.
        return rng.choice(ref.kept_set(case.probs, case.top_k, case.top_p))

    fakes.flashinfer = uniform_in_the_set
    result = sampling.check(target(tmp_path), facts(tmp_path))
    assert result.status == FAILED
    assert fakes.fi_seeds == list(sampling.FLASHINFER_SEEDS)
    assert "chi-square failed on two independent draws" in result.summary


# --------------------------------------------------------------------------- 6: no crash


@pytest.mark.slow
def test_a_kernel_that_does_not_build_still_runs_flashinfer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes = Fakes(monkeypatch, [H200])
    fakes.build_error = "ptxas fatal"
    result = sampling.check(target(tmp_path), facts(tmp_path))
    assert result.status == FAILED
    shown = dict(result.evidence)
    assert (
        shown["GPU 0 (NVIDIA H200, SM 9.0) our kernel"]
        == "failed: does not build for 9.0a: ptxas fatal"
    )
    assert shown["GPU 0 (NVIDIA H200, SM 9.0) FlashInfer"].startswith("passed")


def test_no_nvcc_is_a_failed_half_with_the_missing_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Fakes(monkeypatch, [H200])
    result = sampling.check(
        target(tmp_path),
        facts(tmp_path, cuda_home=str(tmp_path / "nothing"), flashinfer_installed=False),
    )
    assert result.status == FAILED and result.missing_tool == "nvcc"
    assert "no nvcc at" in result.summary


@pytest.mark.parametrize(
    ("script", "why"),
    [
        ("print('')", "printed no sample rows (last line: '')"),
        ("print('Traceback: oops')", "printed no sample rows (last line: 'Traceback: oops')"),
        ("import sys; print('boom', file=sys.stderr); sys.exit(1)", "exit 1: boom"),
    ],
)
def test_a_flashinfer_runner_without_usable_output_is_a_failed_half(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, why: str
) -> None:
    monkeypatch.setattr(sampling, "FLASHINFER_SCRIPT", script)
    device = sampling.Device(gpu=H200, select=H200.uuid)
    cases = ref.make_cases()[:1]
    with pytest.raises(sampling.RunnerFailed) as info:
        sampling.run_flashinfer(target(tmp_path), facts(tmp_path), device, cases, tmp_path, 1)
    assert str(info.value) == why


@pytest.mark.slow
def test_a_failed_flashinfer_runner_is_that_halfs_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Fakes(monkeypatch, [H200])

    def fails(*args: Any) -> list[list[int]]:
        raise sampling.RunnerFailed("exit 1: boom")

    monkeypatch.setattr(sampling, "run_flashinfer", fails)
    result = sampling.check(target(tmp_path), facts(tmp_path))
    assert result.status == FAILED
    assert dict(result.evidence)["GPU 0 (NVIDIA H200, SM 9.0) FlashInfer"] == (
        "failed: top_k_top_p_sampling_from_probs failed: exit 1: boom"
    )


def test_a_check_that_raises_never_loses_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crashes(t: Target, f: EnvFacts) -> CheckResult:
        raise IndexError("list index out of range")

    def no_tool(t: Target, f: EnvFacts) -> CheckResult:
        from builder.core.errors import ToolMissing

        raise ToolMissing("nvcc: not found", tool="nvcc")

    monkeypatch.setattr(verify, "registry", lambda: {"toolchain": crashes, "cubin": no_tool})
    monkeypatch.setattr(verify, "probe", lambda t, jit: facts(tmp_path))
    # --keep-going: cubin runs although toolchain failed before it.
    keep_going = dataclasses.replace(target(tmp_path), keep_going=True)
    _, results = verify.run_checks(keep_going, ("toolchain", "cubin"))
    assert [(r.name, r.status) for r in results] == [("toolchain", FAILED), ("cubin", FAILED)]
    assert results[0].summary == "the check crashed: IndexError: list index out of range"
    assert results[1].missing_tool == "nvcc"


def test_the_missing_tool_is_the_errors_own_not_read_from_its_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from builder.core import proc
    from builder.env import toolchain

    def no_compiler(t: Target, f: EnvFacts) -> CheckResult:
        toolchain._c_compiler()  # the message begins "no C compiler (cc/gcc) ..."
        raise AssertionError("a C compiler was found")

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(proc, "which", lambda *a, **k: None)
    monkeypatch.setattr(verify, "registry", lambda: {"kernel-compile": no_compiler})
    monkeypatch.setattr(verify, "probe", lambda t, jit: facts(tmp_path))
    _, results = verify.run_checks(target(tmp_path), ("kernel-compile",))
    assert results[0].status == FAILED
    assert results[0].summary.startswith("no C compiler (cc/gcc) to build the libcuda.so link")
    assert results[0].missing_tool == "cc"
