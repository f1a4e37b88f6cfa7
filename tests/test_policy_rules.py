"""builder/spec/policy.py alone: each rule shown failing on a broken set and passing on a good one.

(How resolve and doctor word the findings is asserted in test_policy.py and test_doctor.py.)
"""

from __future__ import annotations

from builder.spec import policy
from builder.spec.policy import CompanionMismatch, MajorWheel, MixedMajors

GOOD = {
    "torch": "2.14.1",
    "cuda-toolkit": "13.0.3.0",
    "nvidia-cuda-runtime": "13.0.96",
    "nvidia-cublas": "13.1.0.3",
    "nvidia-cutlass-dsl-libs-cu12": "4.8.0",  # one build per major by design: not counted
    "nvidia-cutlass-dsl-libs-cu13": "4.8.0",
    "flashinfer-python": "0.7.2",
    "flashinfer-cubin": "0.7.2",
    "flashinfer-jit-cache": "0.7.2+cu130",  # a local label is the same release
}


def test_one_cuda_major_passes_a_matched_set() -> None:
    assert policy.mixed_majors(GOOD) is None
    assert policy.mixed_majors(GOOD, want=13) is None
    assert policy.mixed_majors({}) is None


def test_one_cuda_major_names_every_wheel_of_each_major() -> None:
    broken = {**GOOD, "nvidia-cublas-cu12": "12.8.4.1", "nvidia-cuda-nvrtc-cu12": "12.8.93"}
    found = policy.mixed_majors(broken)
    assert found == MixedMajors(
        wheels=(
            MajorWheel(name="nvidia-cuda-runtime", version="13.0.96", major=13, by_name=False),
            MajorWheel(name="nvidia-cublas-cu12", version="12.8.4.1", major=12, by_name=True),
            MajorWheel(name="nvidia-cuda-nvrtc-cu12", version="12.8.93", major=12, by_name=True),
        ),
        want=None,
    )
    assert found.rule == "one-cuda-major"
    assert found.majors == (12, 13)
    assert [w.name for w in found.others(13)] == ["nvidia-cublas-cu12", "nvidia-cuda-nvrtc-cu12"]
    assert [w.name for w in found.others(12)] == ["nvidia-cuda-runtime"]


def test_one_cuda_major_is_the_one_asked() -> None:
    cu12 = {"torch": "2.9.1", "nvidia-cuda-runtime-cu12": "12.8.90"}
    assert policy.mixed_majors(cu12) is None  # one major: fine when none is asked
    assert policy.mixed_majors(cu12, want=12) is None
    found = policy.mixed_majors(cu12, want=13)
    assert found is not None and found.want == 13
    assert found.others(13) == (
        MajorWheel(name="nvidia-cuda-runtime-cu12", version="12.8.90", major=12, by_name=True),
    )


def test_a_major_comes_from_the_name_else_a_cuda_versioned_version() -> None:
    assert policy.major_of("nvidia-cublas-cu12", "12.8.4.1") == 12
    assert policy.major_of("nvidia_cuBLAS_cu12", "12.8.4.1") == 12  # any spelling of the name
    assert policy.major_of("nvidia-cuda-runtime", "13.0.96") == 13
    # A library whose own version is not its CUDA's (cufft 12.0 ships with CUDA 13.0).
    assert policy.major_of("nvidia-cufft", "12.0.0.61") is None
    assert policy.major_of("nvidia-cuda-runtime", "garbage") is None
    assert policy.major_of("torch", "2.14.1") is None


def test_companions_pass_at_flashinfers_version() -> None:
    assert policy.companion_mismatches(GOOD) == ()
    assert policy.companion_mismatches({"torch": "2.14.1"}) == ()
    assert policy.companion_mismatches({"flashinfer-python": "0.7.2"}) == ()


def test_companions_of_another_release_or_alone_are_named() -> None:
    assert policy.companion_mismatches({**GOOD, "flashinfer-cubin": "0.7.1"}) == (
        CompanionMismatch(companion="flashinfer-cubin", version="0.7.1", flashinfer="0.7.2"),
    )
    alone = {"Flashinfer_JIT_Cache": "0.7.2", "flashinfer-cubin": "0.7.2"}
    found = policy.companion_mismatches(alone)
    assert found == (
        CompanionMismatch(companion="flashinfer-cubin", version="0.7.2", flashinfer=None),
        CompanionMismatch(companion="flashinfer-jit-cache", version="0.7.2", flashinfer=None),
    )
    assert found[0].rule == "flashinfer-companions"


def test_an_unreadable_installed_version_is_compared_as_written() -> None:
    odd = {"flashinfer-python": "main", "flashinfer-cubin": "main"}
    assert policy.companion_mismatches(odd) == ()
    assert policy.companion_mismatches({**odd, "flashinfer-cubin": "0.7.2"}) == (
        CompanionMismatch(companion="flashinfer-cubin", version="0.7.2", flashinfer="main"),
    )
