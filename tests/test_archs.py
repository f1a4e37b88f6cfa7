"""The arch concept (builder/machine/archs.py): parsing, FlashInfer's normalisation, what each CUDA
targets, the one GPU query, the env's list and its torch/FlashInfer spellings."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from builder.core import proc
from builder.core.cudaversion import CudaVersion
from builder.machine import archs, driver
from builder.machine.archs import Arch, Gpu

A = Arch.parse
C = CudaVersion.parse


def test_parse_and_spellings() -> None:
    a = A("12.0f")
    assert (a.major, a.minor, a.suffix) == (12, 0, "f")
    assert (str(a), a.sm, a.cubin_sm, a.code) == ("12.0f", "sm_120f", "sm_120", "120f")
    assert a.gencode() == "-gencode=arch=compute_120f,code=sm_120f"
    for bad in ("120", "12.0x", "", "12", "sm_120", "12.10"):
        with pytest.raises(ValueError, match="expected an arch like"):
            A(bad)


@pytest.mark.parametrize("text", ["12.0f,9.0a", "12.0f 9.0a", "12.0f;9.0a", " 12.0f , 9.0a ,"])
def test_parse_list_takes_every_separator(text: str) -> None:
    assert archs.parse_list(text) == (A("12.0f"), A("9.0a"))


def test_parse_list_refuses_bad_and_empty_input() -> None:
    with pytest.raises(ValueError, match=r"'12\.0q'"):
        archs.parse_list("9.0a,12.0q")
    with pytest.raises(ValueError, match="one or more archs"):
        archs.parse_list(" , ")
    assert archs.parse_list("9.0a 9.0a") == (A("9.0a"),)


def test_normalise_as_flashinfer_does() -> None:
    assert archs.normalise(9, 0, C("13.0")) == A("9.0a")
    assert archs.normalise(12, 0, C("13.0")) == A("12.0f")
    assert archs.normalise(12, 0, C("12.8")) == A("12.0a")
    assert archs.normalise(12, 1, C("12.9")) == A("12.1f")
    assert archs.normalise(8, 6, C("13.0")) == A("8.6")
    # No toolkit known: spelled for the default CUDA, never a crash.
    assert archs.normalise(12, 0, None) == archs.normalise(12, 0, archs.DEFAULT_CUDA)
    assert C("13.0") == archs.DEFAULT_CUDA


def test_a_cuda_that_is_no_version_is_refused_not_taken_for_the_default() -> None:
    """Text that names no CUDA once became the default 13.0 here (and so a family ``f``
    target); now it is refused where it is read, naming it."""
    for bad in ("garbage", "", "13", "13.0.1", "v13.0", "13.x"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            archs.normalise(12, 0, C(bad))


def test_what_each_cuda_targets() -> None:
    assert archs.cuda_problems(C("13.0"), archs.parse_list("9.0a 10.0a 12.0f")) == []
    assert archs.cuda_problems(C("12.8"), archs.parse_list("12.0a 10.0a")) == []
    assert archs.cuda_problems(C("12.8"), [A("12.0f")]) == [
        "arch 12.0f needs CUDA >= 12.9 but the spec asks 12.8"
    ]
    assert archs.cuda_problems(C("12.6"), [A("12.0a")]) == [
        "arch 12.0a needs CUDA >= 12.8 but the spec asks 12.6"
    ]
    assert archs.cuda_problems(C("12.8"), [A("12.1a")]) == [
        "arch 12.1a needs CUDA >= 12.9 but the spec asks 12.8"
    ]
    assert archs.cuda_problems(C("13.0"), [A("7.0")]) == [
        "arch 7.0: CUDA 13 dropped targets below SM 7.5"
    ]


def test_which_cubins_run_on_which_gpu() -> None:
    assert A("9.0a").runs_on((9, 0))
    assert not A("9.0a").runs_on((10, 0))
    assert A("12.0f").runs_on((12, 1))
    assert not A("12.1f").runs_on((12, 0))
    assert not A("12.0f").runs_on((9, 0))
    assert A("8.0").runs_on((8, 6))


def test_gpu_query_output_is_parsed_without_crashing() -> None:
    out = (
        "0, GPU-aaaa, NVIDIA H200, 9.0, Disabled\n"
        "1, GPU-bbbb, NVIDIA RTX PRO 6000 Blackwell, Workstation Edition, 12.0, [N/A]\n"
        "2, GPU-cccc, Mystery, [N/A], [N/A]\n"
        "3, GPU-dddd, NVIDIA A100-SXM4-80GB, 8.0, Enabled\n"
        "garbage line\n"
        "\n"
    )
    gpus = archs.parse_gpu_query(out)
    assert gpus == [
        Gpu(index=0, uuid="GPU-aaaa", name="NVIDIA H200", capability=(9, 0)),
        Gpu(
            index=1,
            uuid="GPU-bbbb",
            name="NVIDIA RTX PRO 6000 Blackwell, Workstation Edition",
            capability=(12, 0),
        ),
        Gpu(index=2, uuid="GPU-cccc", name="Mystery", capability=None),
        Gpu(index=3, uuid="GPU-dddd", name="NVIDIA A100-SXM4-80GB", capability=(8, 0), mig=True),
    ]
    # A driver that does not know the MIG field: four columns.
    old = archs.parse_gpu_query("0, GPU-aaaa, NVIDIA H200, 9.0\n", archs._QUERY[:-1])
    assert old == [gpus[0]]
    assert gpus[0].arch(C("13.0")) == A("9.0a")
    assert gpus[2].arch(C("13.0")) is None
    assert gpus[2].label == "GPU 2 (Mystery, SM unknown)"


def test_visible_gpus_says_why_there_are_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(driver, "detect", lambda: None)
    assert archs.visible_gpus() == ([], driver.not_found())
    monkeypatch.undo()
    monkeypatch.setenv("CUDAENV_DRIVER_VERSION", "580.65.06")
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho '0, GPU-x, NVIDIA H200, 9.0, Disabled'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(smi.parent))
    gpus, why = archs.visible_gpus()
    assert why is None and [g.capability for g in gpus] == [(9, 0)]
    smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    gpus, why = archs.visible_gpus()
    assert gpus == [] and why == "no visible NVIDIA GPU (nvidia-smi: No devices were found)"
    assert proc.which("nvidia-smi") == str(smi)


def test_env_archs_add_the_visible_gpus_spelled_for_the_cuda() -> None:
    h200 = Gpu(index=0, uuid="u", name="H200", capability=(9, 0))
    unknown = Gpu(index=1, uuid="v", name="?", capability=None)
    spec_archs = (A("12.0f"),)
    assert archs.env_archs(spec_archs, C("13.0"), [h200, unknown]) == (A("12.0f"), A("9.0a"))
    assert archs.env_archs((A("9.0a"),), C("13.0"), [h200]) == (A("9.0a"),)
    assert archs.uncovered(spec_archs, h200)
    assert not archs.uncovered((A("9.0a"),), h200)
    assert not archs.uncovered(spec_archs, unknown)


def test_torch_and_flashinfer_spellings() -> None:
    env = archs.parse_list("9.0a 12.0f 12.0a")
    assert archs.flashinfer_spelling(env) == "9.0a 12.0f 12.0a"
    assert archs.torch_spelling(env) == "9.0;12.0"
    assert archs.texts(env) == ["9.0a", "12.0f", "12.0a"]


@pytest.mark.slow
def test_no_other_module_parses_archs_or_queries_gpus() -> None:
    """The structure rule: builder/machine/archs.py alone owns the concept. No other module holds an
    arch or CUDA literal as a value (messages may quote examples), queries the GPUs, or
    parses an arch with a regex of its own. builder/machine/driver.py, below archs, alone asks
    nvidia-smi for the driver's version (one of the places the driver is read)."""
    root = Path(archs.__file__).parent
    literal = re.compile(r"^\d{1,2}\.\d[af]?$")
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "archs.py" or "probe" in path.parts:
            continue  # the probes run inside a foreign interpreter, stdlib only
        text = path.read_text()
        is_driver = path.name == "driver.py"
        if is_driver:
            text = text.replace("--query-gpu=driver_version", "")
        for needle in ("--query-gpu", "compute_cap", "normalise_arch", r"(\d)([af]?)"):
            if needle in text:
                offenders.append(f"{path.relative_to(root)}: {needle}")
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and (literal.match(node.value) or (node.value == "nvidia-smi" and not is_driver))
            ):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    assert offenders == []


def test_a_list_cudaenv_did_not_write_is_read_leniently() -> None:
    """doctor reads the shell's lists: torch's +PTX keeps its arch, a named arch and an empty
    list give nothing, never an error."""
    assert archs.texts(archs.parse_lenient("8.0;12.0+PTX Hopper,12.0")) == ["8.0", "12.0"]
    assert archs.parse_lenient("Hopper") == ()
    assert archs.parse_lenient("") == ()


# --------------------------------------------------------------------------- what runs where
# Each case is one of NVIDIA's documented statements (CUDA C++ Programming Guide, binary and
# PTX compatibility; FACTS §12), or a consequence the audit relies on.


@pytest.mark.parametrize(
    ("kind", "arch", "capability", "runs"),
    [
        # "a cubin generated for compute capability X.y will only execute on devices of
        # compute capability X.z where z >= y"
        ("sass", "8.0", (8, 6), True),
        ("sass", "8.6", (8, 0), False),
        ("sass", "8.0", (9, 0), False),  # never across majors
        ("sass", "12.0", (12, 1), True),  # plain sm_120 serves a DGX Spark (vLLM's, FACTS §15)
        # arch-specific: exactly that CC
        ("sass", "12.0a", (12, 0), True),
        ("sass", "12.0a", (12, 1), False),  # sgl_kernel's sm_120a on CC 12.1 (sglang#29317)
        ("sass", "9.0a", (9, 0), True),
        ("sass", "10.0a", (10, 3), False),
        # family-specific: the family's members at or above it
        ("sass", "10.0f", (10, 3), True),
        ("sass", "12.0f", (12, 1), True),
        ("sass", "12.1f", (12, 0), False),
        ("sass", "12.0f", (10, 0), False),
        # PTX is compiled forward, across majors too
        ("ptx", "8.0", (12, 0), True),
        ("ptx", "9.0", (8, 9), False),
        ("ptx", "9.0a", (10, 0), False),  # arch-specific PTX has no forward path
        ("ptx", "9.0a", (9, 0), True),
        ("ptx", "10.0f", (10, 3), True),
        ("ptx", "10.0f", (12, 0), False),
    ],
)
def test_code_runs_where_nvidia_documents(
    kind: archs.CodeKind, arch: str, capability: tuple[int, int], runs: bool
) -> None:
    assert archs.code_runs_on(kind, archs.Arch.parse(arch), capability) is runs


def test_every_kind_and_suffix_has_exactly_one_rule() -> None:
    pairs = [(r.kind, r.suffix) for r in archs.COMPATIBILITY]
    assert sorted(pairs) == sorted((k, s) for k in ("sass", "ptx") for s in ("", "a", "f"))
    with pytest.raises(ValueError, match="no compatibility rule"):
        archs.compat_rule("sass", "x")


def test_ptx_runs_only_on_a_driver_as_new_as_its_isa() -> None:
    plain_80 = archs.Arch.parse("8.0")
    cu129, cu130 = CudaVersion(major=12, minor=9), CudaVersion(major=13, minor=0)
    # PTX ISA 9.0 is CUDA 13.0's: a 12.9 driver cannot compile it ("unsupported toolchain").
    assert archs.code_runs_on("ptx", plain_80, (12, 0), ptx_isa=(9, 0), driver_cuda=cu130)
    assert not archs.code_runs_on("ptx", plain_80, (12, 0), ptx_isa=(9, 0), driver_cuda=cu129)
    assert archs.code_runs_on("ptx", plain_80, (12, 0), ptx_isa=(8, 8), driver_cuda=cu129)
    # An ISA nobody has told cudaenv about, or one that was not read, is never counted.
    assert not archs.code_runs_on("ptx", plain_80, (12, 0), ptx_isa=(9, 9), driver_cuda=cu130)
    assert not archs.code_runs_on("ptx", plain_80, (12, 0), driver_cuda=cu130)
    # Minor-version compatibility covers SASS, not PTX: a cubin does not care.
    assert archs.code_runs_on("sass", plain_80, (8, 6), ptx_isa=(9, 0), driver_cuda=cu129)


def test_the_ptx_isa_table_follows_cuda_releases() -> None:
    isa = archs.PTX_ISA_CUDA
    assert str(isa[(7, 0)]) == "11.0" and str(isa[(8, 0)]) == "12.0"
    assert str(isa[(8, 5)]) == "12.5" and str(isa[(8, 7)]) == "12.8"
    assert str(isa[(8, 8)]) == "12.9" and str(isa[(9, 0)]) == "13.0"
    ordered = [isa[k] for k in sorted(isa)]
    assert ordered == sorted(ordered)  # a newer ISA never maps to an older CUDA
