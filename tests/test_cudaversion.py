"""builder/core/cudaversion.py: the one reading of a CUDA version, its order and its refusals."""

from __future__ import annotations

import ast

import pytest

from builder.core.cudaversion import CudaVersion
from tests.helpers import REPO

C = CudaVersion.parse


def test_parse_reads_major_minor_and_writes_it_back() -> None:
    v = C("13.0")
    assert (v.major, v.minor) == (13, 0)
    assert str(v) == "13.0"
    for text in ("12.8", "12.9", "12.10", "13.2", "0.0"):
        assert str(C(text)) == text
    assert C("12.9") == CudaVersion(major=12, minor=9)
    assert C("12.9").next_minor() == C("12.10")


def test_order_is_numeric_not_textual() -> None:
    assert C("12.9") < C("12.10") < C("13.0")  # as text, "12.10" < "12.9"
    assert sorted(C(t) for t in ("13.0", "12.10", "12.8", "12.9")) == [
        C("12.8"),
        C("12.9"),
        C("12.10"),
        C("13.0"),
    ]
    assert max(C("12.8"), C("13.0")) == C("13.0")
    assert len({C("13.0"), C("13.0"), C("12.8")}) == 2


def test_it_equals_only_its_own_kind() -> None:
    text: object = "13.0"
    pair: object = (13, 0)
    assert C("13.0") != text
    assert C("13.0") != pair
    with pytest.raises(TypeError):
        _ = C("13.0") < (13, 1)  # type: ignore[operator]


@pytest.mark.parametrize(
    "bad",
    ["", "13", "13.", ".0", "13.0.1", "13.00", "013.0", "v13.0", " 13.0", "13.0\n", "13,0",
     "thirteen", "13.x", "cu130", "123.0", "-1.0"],
)  # fmt: skip
def test_parse_refuses_garbage_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match=r"expected a CUDA version major\.minor") as info:
        C(bad)
    assert repr(bad) in str(info.value)


def test_of_version_reads_the_leading_major_minor_of_a_longer_version() -> None:
    assert CudaVersion.of_version("13.0.96") == C("13.0")  # nvidia-cuda-runtime
    assert CudaVersion.of_version("13.0.3.0") == C("13.0")  # cuda-toolkit
    assert CudaVersion.of_version("12.8.90") == C("12.8")
    assert CudaVersion.of_version("12.8") == C("12.8")
    for bad in ("", "13", "garbage", "v13.0.1"):
        with pytest.raises(ValueError, match=r"starting with a CUDA major\.minor") as info:
            CudaVersion.of_version(bad)
        assert repr(bad) in str(info.value)


def test_read_says_unknown_instead_of_guessing() -> None:
    assert CudaVersion.read("13.0.96") == C("13.0")
    assert CudaVersion.read(None) is None
    assert CudaVersion.read("") is None
    assert CudaVersion.read("garbage") is None


def test_the_fields_are_whole_numbers() -> None:
    for major, minor in ((-1, 0), (13, -1), (True, 0)):
        with pytest.raises(ValueError, match="two whole numbers"):
            CudaVersion(major=major, minor=minor)


@pytest.mark.slow
def test_no_other_module_reads_a_cuda_version_by_hand() -> None:
    """``int(cuda.split(".")[0])`` and friends are what this module replaces."""
    offenders = []
    for path in sorted((REPO / "builder").rglob("*.py")):
        if "probe" in path.parts or path.name == "cudaversion.py":
            continue  # the probes run in foreign interpreters, standard library only
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "split"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == "."
                and "cuda" in ast.unparse(node.func.value).lower()
            ):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []
